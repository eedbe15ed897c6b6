"""``experiments.analysis.kvreviver_rounding``: the float64 insert is KVReviver's insert to fp32 rounding (and not
bit for bit: it is a change of rounding), in the plain and the fast engines' routed layouts; the change is
undone after its block; the command refuses what would run without it; the committed report is what
``agree --records`` prints of the two committed runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.analysis import kvreviver_rounding
from experiments.analysis.kvreviver_rounding import float64_insert, sums_in_float64
from experiments.evaluation import agree
from fastpath.reviver import routed
from methods.kvreviver_sketch import VagueSketch
from tests.commands import refused


def tokens(n: int = 600, heads: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(0)
    # keys share a mean, as a model's do: cells sum without signs, so they grow and round
    return torch.arange(n), 3 + torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g)


def close_not_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-5 * b.abs().max().item()), (a - b).abs().max()
    assert not torch.equal(a, b), "the same bits: the float64 sums changed nothing"


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_float64_insert_is_the_insert_to_fp32_rounding(sign):
    pos, k, v = tokens()
    plain, wide = VagueSketch(3, 8, 2, 16, seed=1), VagueSketch(3, 8, 2, 16, seed=1)   # 75 tokens a cell
    for part in (slice(0, 350), slice(350, None)):                              # onto cells already full
        plain.insert(pos[part], k[part], v[part], sign)
        float64_insert(wide, pos[part], k[part], v[part], sign)
    close_not_equal(wide.key, plain.key)
    close_not_equal(wide.value, plain.value)
    assert torch.equal(wide.query(pos)[0].sign(), plain.query(pos)[0].sign())


def test_the_routed_layout_of_the_fast_engines_takes_it_too():
    pos, k, v = tokens()
    one = VagueSketch(3, 8, 2, 16, seed=1)
    cells, signs = one.buckets(pos), one.signs(pos)                              # (3, n) each
    to = (torch.arange(3).view(3, 1) * 8 + cells).view(1, -1)                    # every row's cells as one row
    plain = routed(one, one.key.view(1, 24, 2, 16), one.value.view(1, 24, 2, 16), to, signs.view(1, -1))
    where, k3, v3 = pos.repeat(3), k.repeat(3, 1, 1), v.repeat(3, 1, 1)
    plain.insert(where, k3, v3)
    key, value = one.key.clone(), one.value.clone()
    one.key.zero_(), one.value.zero_()
    with sums_in_float64():
        plain.insert(where, k3, v3)
    close_not_equal(one.key, key)
    close_not_equal(one.value, value)
    reference = VagueSketch(3, 8, 2, 16, seed=1)
    reference.insert(pos, k, v)
    assert torch.equal(reference.key, key) and torch.equal(reference.value, value)


def test_the_change_is_undone_after_its_block_even_on_an_error():
    plain = VagueSketch.insert
    with pytest.raises(RuntimeError), sums_in_float64():
        assert VagueSketch.insert is float64_insert
        raise RuntimeError
    assert VagueSketch.insert is plain


def test_the_command_refuses_workers_it_cannot_reach(capsys, tmp_path):
    err = refused(capsys, kvreviver_rounding.main, ["--workers", "2", "--json", str(tmp_path / "x.json")])
    assert "--workers 2" in err and "--workers 1" in err, err
    assert not (tmp_path / "x.json").exists()


def test_the_committed_report_is_what_agree_prints_of_the_two_committed_runs(capsys, monkeypatch):
    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)                               # the report names the files as the repository's
    files = ["results/kvreviver_rounding_plain.json", "results/kvreviver_rounding_float64.json"]
    assert agree.main(["--records", *files]) == 1
    printed = capsys.readouterr().out
    assert printed in (root / "results" / "kvreviver_rounding_smollm2.txt").read_text()
    assert "full/" not in printed                          # the full cache's records agree
