"""The "measure and explain" part: ``python -m course.measure NAME`` runs the copy's own code and draws its
figure; every sheet asks for it with a rubric; the writeup shows the figure and the pack carries it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from course import handout, measure, submit
from course.assignments import ASSIGNMENTS, ROOT


@pytest.mark.parametrize("name", sorted(ASSIGNMENTS))
def test_every_sheet_asks_for_a_measurement_with_a_rubric_and_a_model_answer(name):
    questions = handout.written_questions(ASSIGNMENTS[name].sheet)
    last = questions[-1]
    assert last["title"] == "Measure and explain" and last["points"] == 6
    assert f"python -m course.measure {name}" in " ".join(last["question"])
    assert "2 points: the figure" in " ".join(last["rubric"]) and last["answer"], "rubric and model answer"
    template = handout.writeup(ASSIGNMENTS[name])
    assert "![your figure](measure/figure.png)" in template                  # where course.measure writes it
    assert template.count("![your figure]") == 1
    sheet = ASSIGNMENTS[name].sheet.read_text()
    assert f"`course/{name}/writeup.md`, the one place for them" in " ".join(sheet.split())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ASSIGNMENTS))
def test_the_measurement_runs_and_draws_its_figure(name, tmp_path):
    out = tmp_path / "m"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "course.measure", name, "--quick", "--out", str(out)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (out / "figure.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "table.txt").read_text().strip()
    record = json.loads((out / "record.json").read_text())
    if name in measure.COMPARISONS:
        methods = {r["method"] for r in record["records"]}
        assert methods == {"full", *measure.COMPARISONS[name].methods}
        assert all(r["engine"] == "plain" for r in record["records"]), "the library's own code, not a fast engine"


@pytest.mark.slow
def test_the_measurement_of_an_unsolved_copy_stops_naming_the_task(tmp_path):
    copy = tmp_path / "copy"
    handout.student_copy(ASSIGNMENTS["chunkkv"], copy)
    run = subprocess.run([sys.executable, "-m", "course.measure", "chunkkv", "--quick"], cwd=copy,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    err = run.stderr.strip()
    assert err.startswith("error: the measurement stopped") and "\n" not in err, err
    assert "chunkkv, task chunk_ranking" in err, err                      # the copy's stub, not the library's


def test_the_measurement_refuses_before_any_work(capsys, tmp_path):
    (tmp_path / "taken").mkdir()
    for argv, said in [(["cache", "--out", str(tmp_path / "taken")], "exists"),
                       (["cache", "--seed", "3", "--out", str(tmp_path / "a")], "--seed is for"),
                       (["kernels", "--checkpoint", "smollm2-135m", "--out", str(tmp_path / "b")],
                        "--checkpoint is for"),
                       (["chunkkv", "--samples", "0", "--out", str(tmp_path / "c")], "--samples must be"),
                       (["nope"], "no assignment")]:
        with pytest.raises(SystemExit) as e:
            measure.main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.slow
def test_the_pack_carries_the_figure_and_the_grader_lays_it_over(tmp_path):
    a = ASSIGNMENTS["cache"]
    copy = tmp_path / "copy"
    handout.student_copy(a, copy)
    (copy / "course/cache/measure").mkdir()
    (copy / "course/cache/measure/figure.png").write_bytes(b"\x89PNG fake")
    files = submit.pack(copy, a, tmp_path / "pack.zip")
    assert "course/cache/measure/figure.png" in files and "course/cache/writeup.md" in files
    with zipfile.ZipFile(tmp_path / "pack.zip") as z:
        z.extractall(tmp_path / "unpacked")
    laid = submit.lay_over(tmp_path / "unpacked", "cache", tmp_path / "laid")
    assert (laid / "course/cache/measure/figure.png").read_bytes() == b"\x89PNG fake"
    (copy / "course/cache/measure/figure.png").unlink()
    assert "course/cache/measure/figure.png" not in submit.pack(copy, a, tmp_path / "pack2.zip")   # optional


def test_wilson_interval():
    assert measure.wilson(0, 10)[0] == 0 and 0.2 < measure.wilson(0, 10)[1] < 0.35
    low, high = measure.wilson(5, 10)
    assert abs((low + high) / 2 - 0.5) < 1e-12 and 0.2 < low < 0.3
    assert measure.wilson(10, 10)[1] == pytest.approx(1.0)
