"""``experiments.evaluation.agree``: two compare files agree when every answer and byte count is equal and the
float metrics lie within the tolerance; a plausible difference in each kind of field is caught and named."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from experiments.evaluation import agree
from tests.commands import refused

COMMITTED = Path(__file__).resolve().parents[3] / "results" / "compare_default.json"
RECORDS = 30                    # the tests that change a record read the file's first 30: each writes and reads two


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The committed file cut to its first RECORDS records (the whole file is read once, by the first test)."""
    data = json.loads(COMMITTED.read_text())
    data["records"] = data["records"][:RECORDS]
    path = tmp_path_factory.mktemp("agree") / "a.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def saved(base) -> dict:
    return json.loads(base.read_text())


def written(tmp_path: Path, data: dict, name: str = "b.json") -> str:
    (tmp_path / name).write_text(json.dumps(data))
    return str(tmp_path / name)


def test_a_file_agrees_with_itself(capsys):
    assert agree.main([str(COMMITTED), str(COMMITTED)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("\nagree") and "predictions          equal in 300 of 300 records" in out, out


@pytest.mark.parametrize("field, change", [
    ("predictions", lambda r: r["predictions"].__setitem__(3, r["predictions"][3] + "0")),
    ("accuracies", lambda r: r["accuracies"].__setitem__(0, 1.0 - r["accuracies"][0])),
    ("kv_bytes", lambda r: r.__setitem__("kv_bytes", r["kv_bytes"] + 2)),
    ("kl", lambda r: r.__setitem__("kl", r["kl"] + 2e-3 * max(1.0, r["kl"]))),
    ("attn_l1", lambda r: r["attn_l1"][-1].__setitem__(0, r["attn_l1"][-1][0] * (1 - 2e-3))),
])
def test_a_difference_in_one_record_is_caught_and_named(capsys, tmp_path, base, saved, field, change):
    other = copy.deepcopy(saved)
    change(other["records"][7])
    assert agree.main([str(base), written(tmp_path, other)]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"differ: {field}"), out


@pytest.mark.parametrize("change", [
    lambda r: r.__setitem__("kl", float("nan")),                                  # NaN against a number
    lambda r: r["attn_l1"][1].__setitem__(2, float("nan")),                       # ... inside the list
    lambda r: r["attn_l1"][0].__setitem__(0, None),                               # not a number
    lambda r: r.pop("lost_mass"),                                                 # missing in one file
])
def test_nan_none_or_a_missing_field_differs(capsys, tmp_path, base, saved, change):
    other = copy.deepcopy(saved)
    change(other["records"][3])
    assert agree.main([str(base), written(tmp_path, other)]) == 1
    assert "differ:" in capsys.readouterr().out


def test_nan_in_both_files_agrees(capsys, tmp_path, base, saved):
    both = copy.deepcopy(saved)
    both["records"][3]["kl"] = float("nan")
    a = written(tmp_path, both, "a.json")
    assert agree.main([a, written(tmp_path, both)]) == 0


def test_the_tolerance_lets_a_float_metric_move_and_nothing_else(capsys, tmp_path, base, saved):
    other = copy.deepcopy(saved)
    for r in other["records"]:
        r["kl"] += 5e-3
        r["decode_ms_per_token"] *= 3                  # timings and settings are not compared
        r["engine"] = "plain"
    b = written(tmp_path, other)
    assert agree.main([str(base), b]) == 1
    assert agree.main([str(base), b, "--tol", "1e-2"]) == 0
    assert "kl                   largest difference 0.005 (relative above 1) over 30 records (within 0.01)" \
        in capsys.readouterr().out


@pytest.mark.parametrize("value, moved, agrees", [
    (17.08992, 17.08873, True),       # a GPU's KVReviver record against the CPU's: 1.2e-3 apart, 6.9e-5 of it
    (17.08992, 17.0557, False),       # 2e-3 of it
    (0.9, 0.9012, False),             # up to 1 the difference is absolute
    (0.9, 0.9008, True),
])
def test_a_float_metric_is_compared_absolutely_up_to_1_and_relatively_above(capsys, tmp_path, saved, value,
                                                                            moved, agrees):
    a, b = copy.deepcopy(saved), copy.deepcopy(saved)
    a["records"][7]["attn_l1"][0][0], b["records"][7]["attn_l1"][0][0] = value, moved
    assert agree.main([written(tmp_path, a, "a.json"), written(tmp_path, b)]) == (0 if agrees else 1)
    assert capsys.readouterr().out.rstrip().endswith("agree" if agrees else "differ: attn_l1")


def test_files_of_other_cells_or_no_records_are_refused_in_one_line(capsys, tmp_path, base, saved):
    other = copy.deepcopy(saved)
    del other["records"][5]
    err = refused(capsys, agree.main, [str(base), written(tmp_path, other)])
    assert "the files hold different cells" in err and "0 only in B" in err, err
    err = refused(capsys, agree.main, [str(base), written(tmp_path, {"rows": []}, "x.json")])
    assert "not a experiments.compare results file" in err, err
    twice = copy.deepcopy(saved)
    twice["records"].append(twice["records"][0])
    err = refused(capsys, agree.main, [written(tmp_path, twice, "t.json"), str(base)])
    assert "two records of" in err, err


def test_records_names_each_record_that_differs_with_its_answers_and_gaps(capsys, tmp_path, base, saved):
    other = copy.deepcopy(saved)
    r = other["records"][7]
    r["prediction_ids"][2] = r["prediction_ids"][2] + [0]                       # one answer of the record
    r["kl"] += 5e-3 * max(1.0, r["kl"])
    other["records"][9]["kv_bytes"] += 2                                        # another record, a count only
    assert agree.main(["--records", str(base), written(tmp_path, other)]) == 1
    lines = capsys.readouterr().out.splitlines()
    cell = lambda rec: "/".join(str(rec[k]) for k in agree.KEY)                  # noqa: E731
    line7 = next(line for line in lines if line.startswith(cell(r) + "  "))
    assert f"answers 1 of {len(r['prediction_ids'])} differ" in line7 and "kl 0.005" in line7, line7
    line9 = next(line for line in lines if line.startswith(cell(other["records"][9]) + "  "))
    assert "answers 0 of" in line9 and line9.endswith("also: kv_bytes"), line9
    assert sum("answers" in line for line in lines) == 2 and lines[-1] == "differ: prediction_ids, kv_bytes, kl"
    assert agree.main(["--records", str(base), str(base)]) == 0
    assert "(no record differs)\nagree" in capsys.readouterr().out
    texts = copy.deepcopy(saved)                                                # a file without token ids
    for data in (texts, other):
        data["records"][7].pop("prediction_ids")
    texts["records"][7]["predictions"][4] += "0"
    other["records"][7]["predictions"][4] += "1"
    agree.main(["--records", written(tmp_path, texts, "a.json"), written(tmp_path, other)])
    line7 = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(cell(r) + "  "))
    assert "answers 1 of" in line7 and "also" not in line7, line7               # counted from the texts
