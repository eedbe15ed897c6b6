"""
The grader against a student's shortcut, round four: wrong code that the hidden tests' inputs let through. Each
copy below holds the reference everywhere but one mistake a red-team reader found scoring full marks on its task
(the task's hidden tests never reached the case); each now loses that task's points.

* cache, ``group_scores``: the keys repeated for each query head (``repeat_interleave``), which the sheet
  forbids, and every hidden test compared values only (6 / 6): its memory is now watched at a size where the
  repeated keys hold 1 GiB.
* baselines, ``window_vote``: ``window_vote`` pooled by max whatever ``pooling`` said, while ``snapkv_scores``
  did its own (right) pooling, and no hidden test called ``window_vote`` (10 / 10).
* baselines, ``adakv``: the safeguard left out a head's NaN and -inf entries, and no hidden case had a head
  with fewer valid scores than its safeguard (5 / 5).
* kvreviver, ``insert``: the cells replaced by new tensors (``index_add``, not ``index_add_``), and every test
  read the cells again after the insert (8 / 8).
* critical_kv, ``two_stage``: scores ranked in the dtype they came in, where the docstring ranks them in float32,
  and every hidden test gave float32 scores (9 / 9).
* tensor_attention, ``pair_softmax``: a mask flattened with the scores, so one broadcast over the pairs (the
  docstring's "broadcast to S") fails, and every hidden mask had the pairs' full shape (5 / 5).
* kvreviver, ``query``: a median by ranks that falls back to row 0 where only some rows tie; the method's tests
  had no tied rows, only the plain function's and the kernel's (8 / 8).
* kernels, ``online_softmax``: fp32 products through ``tl.dot`` without ``input_precision="ieee"`` (tf32 on a GPU;
  Triton's CPU interpreter ignores it), the padding masked in m and p but not in the scores ``s`` left for H2O
  (the grader never switched ``SCORES`` on), and the 16-bit path's weights cast to float16 whatever the cache (a
  GPU's bfloat16 cache takes that path; the grader's never did): each 8 / 8; the kernels now run as on a GPU
  (``student_process.as_on_a_gpu``), ``s`` is checked, and bfloat16 goes through the 16-bit path too.
* kernels, ``merge_splits``: a merge kernel's store not masked to the output's d columns (the next row's program
  wrote over it in the interpreter; on a GPU rows race) kept 8 / 8; outputs are now read from wider buffers whose
  rest must stay untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from course.assignments import ASSIGNMENTS, ROOT
from tests.course.test_grader import put, student_copy
from tests.course.test_hostile_grade6 import graded_json

pytestmark = pytest.mark.slow


def failed(results: dict, test: str) -> bool:
    """Whether the graded JSON's hidden test ``test`` failed."""
    rows = [t for t in results["tests"] if t["name"].startswith(f"hidden: {test} ")]
    assert rows, f"no test {test} in the grade: {[t['name'] for t in results['tests']]}"
    return all(t["status"] == "failed" for t in rows)


def filled(name: str, task: str, tmp_path: Path, mistake) -> Path:
    """A student copy of ``name`` with every region of ``task`` (in every file) the reference's lines as
    ``mistake(lines)`` returns them (the lines unchanged where it has nothing to change)."""
    copy = student_copy(tmp_path, name)
    for r in [r for r in ASSIGNMENTS[name].regions() if r.task == task]:     # in file order, as put fills them
        lines = [line[len(r.indent):] for line in r.body(r.path.read_text().splitlines())]
        put(copy / r.path.relative_to(ROOT), task, mistake(lines))
    return copy


def replaced(lines: list[str], old: str, new: list[str]) -> list[str]:
    """``lines`` with the line whose code is ``old`` (its comment aside) replaced by ``new``; unchanged without it."""
    at = [i for i, line in enumerate(lines) if line.split("#")[0].strip() == old]
    return lines if not at else lines[:at[0]] + new + lines[at[0] + 1:]


def body_where(marker: str, new: list[str]):
    """A mistake for ``filled``: the region whose body has a line holding ``marker`` becomes ``new``, whole."""
    return lambda lines: new if any(marker in line for line in lines) else lines


def loses(tmp_path: Path, name: str, task: str, mistake, test: str) -> None:
    """A copy of ``name`` with ``task``'s reference as ``mistake`` changes it (``filled``) fails the hidden
    ``test`` (graded with ``-k task``)."""
    results = graded_json(filled(name, task, tmp_path, mistake), tmp_path / "r.json", name, task)
    assert failed(results, test), results


OWN_SCORES = [                                   # snapkv_scores right without window_vote
    "T = probs.shape[-1]",
    "w = min(window, T)",
    "votes = probs[:, :, -w:, :].float().sum(dim=2)                   # (B, H, T)",
    "B, H, _ = votes.shape",
    "per_kv = lambda x: x.view(B, n_kv_head, H // n_kv_head, -1).mean(dim=2)  # noqa: E731",
    "own = per_kv(votes[..., T - w:])",
    "if w == T:",
    "    return own",
    "return torch.cat([per_kv(pool1d(votes[..., :T - w], kernel, pooling)), own], dim=-1)"]


def test_a_window_vote_that_ignores_its_pooling_loses_its_points(tmp_path):
    def mistake(lines):
        if any("window_vote(" in line for line in lines):                     # snapkv_scores: its own votes
            return OWN_SCORES
        return replaced(lines, "vote = pool1d(vote, kernel, pooling)", ['vote = pool1d(vote, kernel, "max")'])
    loses(tmp_path, "baselines", "window_vote", mistake, "test_snapkv_scores_in_every_regime")


def test_a_safeguard_that_skips_nan_entries_loses_its_points(tmp_path):
    skip_invalid = ['    best = torch.gather(s, -1, safe)                        # a NaN or -inf entry is not forced',
                    '    s = s.scatter(-1, safe, torch.where(best > float("-inf"), float("inf"), best))']
    loses(tmp_path, "baselines", "adakv", lambda lines: replaced(lines, 's = s.scatter(-1, safe, float("inf"))',
                                                                 skip_invalid), "test_adakv_ties_infinities_and_nan")


def test_an_insert_into_new_tensors_loses_its_points(tmp_path):
    def mistake(lines):
        for part in ("key", "value"):
            old = f"self.{part}.view(flat).index_add_(0, idx, {part[0]}_rows.reshape(flat))"
            lines = replaced(lines, old, [f"self.{part} = " + old.replace("index_add_(", "index_add(") +
                                          f".view(self.{part}.shape)"])
        return lines
    loses(tmp_path, "kvreviver", "insert", mistake, "test_insert_for_any_number_of_rows_and_cells")


def test_a_median_wrong_where_some_rows_tie_loses_its_points(tmp_path):
    by_rank = ["def by_rank(x):                        # the entry with (r - 1) // 2 entries below it",
               "    est = x[0].clone()",
               "    for a in range(x.shape[0]):",
               "        est = torch.where((x < x[a]).sum(0) == (x.shape[0] - 1) // 2, x[a], est)",
               "    return est",
               "return by_rank(k), by_rank(v)"]
    loses(tmp_path, "kvreviver", "query", lambda lines: replaced(lines, "return lower_median(k), lower_median(v)",
                                                                 by_rank), "test_query_for_any_number_of_rows")


def test_a_two_stage_ranking_in_float64_loses_its_points(tmp_path):
    old = "s = torch.nan_to_num(s.float(), nan=lowest, neginf=lowest)"
    in_float64 = ["    " + old.replace("s.float()", "s")]
    loses(tmp_path, "critical_kv", "two_stage", lambda lines: replaced(lines, old, in_float64),
          "test_two_stage_masks_against_a_loop")


def test_a_pair_softmax_that_cannot_broadcast_its_mask_loses_its_points(tmp_path):
    flat = ["flat = S.flatten(-2)",
            "if allowed is not None:",
            '    flat = flat.masked_fill(~allowed.flatten(-2), float("-inf"))',
            "return torch.softmax(flat, dim=-1).view(S.shape)"]
    loses(tmp_path, "tensor_attention", "pair_softmax", body_where("masked_fill(~allowed", flat),
          "test_pair_softmax_with_masks_and_large_scores")


def test_scores_over_repeated_keys_lose_their_points(tmp_path):
    repeated = ["B, H, C, d = q.shape",
                "kr = k.repeat_interleave(H // k.shape[1], dim=1)               # (B, H, T, d): G copies",
                "return ((q @ kr.transpose(-1, -2)) / math.sqrt(d)).view(B, k.shape[1], H // k.shape[1], C, -1)"]
    loses(tmp_path, "cache", "group_scores", body_where("@ k.transpose(-1, -2)", repeated),
          "test_group_scores_against_a_loop_over_heads")


def test_an_fp32_dot_in_tf32_loses_its_points(tmp_path):
    def mistake(lines):
        for old in ('s = tl.dot(q, tl.trans(kb), input_precision="ieee")',
                    'acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")'):
            lines = replaced(lines, old, ["    " + old.replace(', input_precision="ieee"', "")])
        return lines
    loses(tmp_path, "kernels", "online_softmax", mistake, "test_scores_far_from_zero")


def test_scores_for_h2o_left_unmasked_lose_their_points(tmp_path):
    def mistake(lines):
        lines = replaced(lines, 's = tl.where(valid[None, :], s, float("-inf"))', [])
        lines = replaced(lines, "m_new = tl.maximum(m, tl.max(s, axis=1))",
                         ['m_new = tl.maximum(m, tl.max(tl.where(valid[None, :], s, float("-inf")), axis=1))'])
        return replaced(lines, "p = tl.exp(s - m_safe[:, None])",
                        ["p = tl.where(valid[None, :], tl.exp(s - m_safe[:, None]), 0.0)"])
    loses(tmp_path, "kernels", "online_softmax", mistake, "test_scores_far_from_zero")


def test_a_bfloat16_cache_weighted_in_float16_loses_its_points(tmp_path):
    old = "acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)"
    loses(tmp_path, "kernels", "online_softmax",
          lambda lines: replaced(lines, old, ["    " + old.replace("vb.dtype", "tl.float16")]),
          "test_three_query_heads_per_kv_head_and_ragged_ranges")


def test_a_merge_that_stores_past_its_output_loses_its_points(tmp_path):
    old = "tl.store(out_ptr + pid_bh * d + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < d)"
    loses(tmp_path, "kernels", "merge_splits",
          lambda lines: replaced(lines, old, [old.replace(", mask=offs_d < d", "")]),
          "test_merge_empty_ranges_anywhere")
