"""The Index reduction: the full cache gives Bob every bit; a cache of k rows gives k/n + (1 - k/n)/2; the
grouped-sign cache beats the verbatim line but not the Fano bound; argument errors; seeds."""

from __future__ import annotations

import math

import pytest
import torch

from methods.tensor_attention.index_problem import (
    accuracy_vs_bits,
    fano_accuracy,
    keep_rows,
    majority_accuracy,
    majority_v1,
    make_instance,
    retrieve,
    verbatim_accuracy,
)


@pytest.mark.slow
@pytest.mark.parametrize("n", [64, 128, 256])
def test_full_cache_recovers_every_bit(n):
    inst = make_instance(n, seed=0)
    assert inst.d == math.ceil(4 * math.log2(n)) and inst.margin >= 2
    assert torch.equal(retrieve(inst), inst.x)


def test_full_cache_recovers_n_times_d_bits():
    """w = d: every coordinate of V1 is a bit, n d bits in all, all recovered."""
    inst = make_instance(64, bits_per_token=24, seed=1)
    assert inst.x.shape == (64, 24) and torch.equal(retrieve(inst), inst.x)


def test_kept_rows_exact_dropped_rows_a_coin():
    """Keep k = 32 of n = 128 rows, 8 bits per token. Kept indices decode exactly. A dropped index's output
    depends only on the other bits, so each of its (n - k) * 8 = 768 bits is right with probability exactly
    1/2, independently: the total accuracy is k/n + (1 - k/n)/2 = 0.625 up to a Binomial(768, 1/2) / 1024
    fluctuation, standard deviation sqrt(768)/2/1024 = 0.0135; we allow 4 of them."""
    n, k, w = 128, 32, 8
    inst = make_instance(n, bits_per_token=w, seed=2)
    rows = keep_rows(n, k, seed=3)
    right = retrieve(inst, rows) == inst.x                                        # (n, w)
    assert right[rows].all()
    sigma = math.sqrt((n - k) * w) / 2 / (n * w)
    assert abs(right.double().mean().item() - (k / n + (1 - k / n) / 2)) < 4 * sigma


def test_grouped_signs_beat_the_verbatim_line_not_the_fano_bound():
    """Groups of 3: 43 groups * 8 bits = 344 bits of n w = 1024. Accuracy 3/4 expected (the last group has
    2 tokens: 0.75 too), above verbatim 1/2 + 344/2048 = 0.668, below Fano's 0.83. Per group the number
    right is 3 or 2 (variance 3/16), so the accuracy's sd is sqrt(43 * 8 * 3/16) / 1024 = 0.008."""
    n, w = 128, 8
    inst = make_instance(n, bits_per_token=w, seed=4)
    acc = (retrieve(inst, V1=majority_v1(inst, 3)) == inst.x).double().mean().item()
    bits = 43 * w
    assert abs(acc - 0.75) < 4 * math.sqrt(43 * w * 3 / 16) / (n * w)
    assert verbatim_accuracy(bits, n * w) + 0.04 < acc < fano_accuracy(bits, n * w)


def test_curves():
    assert fano_accuracy(0, 100) == 0.5 and fano_accuracy(100, 100) == 1.0
    assert verbatim_accuracy(0, 100) == 0.5 and verbatim_accuracy(50, 100) == 0.75
    fano = [fano_accuracy(s, 100) for s in range(0, 101, 10)]
    assert fano == sorted(fano)
    assert all(fano_accuracy(s, 100) >= verbatim_accuracy(s, 100) for s in range(101))
    assert majority_accuracy(1) == 1.0 and majority_accuracy(3) == 0.75
    assert math.isclose(majority_accuracy(5), 0.5 + math.comb(4, 2) / 2 ** 5)


def test_accuracy_vs_bits_rows():
    rows = accuracy_vs_bits(n=64, keep=(0.0, 0.5, 1.0), groups=(3,), trials=1)
    assert [r["scheme"] for r in rows] == ["rows", "rows", "rows", "majority"]
    assert rows[2]["accuracy"] == 1.0 and rows[2]["bits"] == 64
    for r in rows:
        assert r["expected"] <= r["fano"] + 1e-12
        assert set(r) == {"scheme", "param", "bits", "info_bits", "accuracy", "expected", "verbatim", "fano"}


def test_same_seed_same_instance():
    a, b, c = make_instance(32, seed=5), make_instance(32, seed=5), make_instance(32, seed=6)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("x", "K1", "K2", "V1", "queries"))
    assert not torch.equal(a.K1, c.K1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n must"):
        make_instance(1)
    with pytest.raises(ValueError, match="c "):
        make_instance(16, c=0.0)
    with pytest.raises(ValueError, match="d must"):
        make_instance(16, d=0)
    with pytest.raises(ValueError, match="bits_per_token"):
        make_instance(16, d=8, bits_per_token=9)
    with pytest.raises(ValueError, match="too small"):
        make_instance(64, d=2, max_redraws=2)
    inst = make_instance(16, seed=0)
    with pytest.raises(ValueError, match="cache_rows"):
        retrieve(inst, torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="repeat"):
        retrieve(inst, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="V1 must"):
        retrieve(inst, V1=torch.ones(16, 3))
    with pytest.raises(ValueError, match="k must"):
        keep_rows(16, 17)
    with pytest.raises(ValueError, match="group"):
        majority_v1(inst, 0)
    with pytest.raises(ValueError, match="trials"):
        accuracy_vs_bits(n=16, trials=0)
    with pytest.raises(ValueError, match="keep"):
        accuracy_vs_bits(n=16, keep=(1.5,))
