"""
The metrics glossary of notebook ``01_baselines`` (its appendix) says what each column of a results table
is. Here every metric is recomputed by hand from two traces, exactly as the glossary words it, and compared
with the harness's ``compare_traces`` / ``greedy_accuracies`` on the bundled model (a short sample, small
budgets): acc, KL(full || method), pert, attn_l1 and lost. A metric computed another way (KL with its
arguments swapped, lost with the method's own probabilities, pert at another step) fails here, and each
such variant is checked to give another number on this sample, so the test can tell them apart.
"""

from __future__ import annotations

import pytest
import torch

from experiments.evaluation.harness import compare_traces, greedy_accuracies, traces
from methods import make_policy
from nanollm import load
from nanollm.data.evaluate import MODES, answer
from nanollm.data.tasks import make_sample, string_match_all

LENGTH, BUDGET = 192, 40
SPECS = ["streaming_llm", "h2o", "snapkv", "adakv"]


@pytest.fixture(scope="module")
def run():
    """The bundled model, one sample, the full cache's trace and each baseline's, and the library's metrics."""
    torch.set_num_threads(1)
    model, tok, _ = load("retrieval-llama")
    sample = make_sample("niah_single_noise", tok, LENGTH, seed=1)
    trs = traces(model, sample, MODES[0], [None] + [make_policy(s, budget=BUDGET) for s in SPECS],
                 [True] + [False] * len(SPECS))
    full, methods = trs[0], dict(zip(SPECS, trs[1:]))
    G = model.config.group_size
    metrics = {s: compare_traces(full, tr, G) for s, tr in methods.items()}
    return model, tok, sample, trs, full, methods, metrics, G


def kl_by_hand(p_logits, q_logits):
    """KL(p || q) in nats per answer position, averaged: mean_m sum_v p(v) (log p(v) - log q(v))."""
    p_log = torch.log_softmax(p_logits.double(), -1)                   # (n_answer, V)
    q_log = torch.log_softmax(q_logits.double(), -1)
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def lost_by_hand(probs, attended, method_pos, G):
    """Mean over layers and query heads of the attention mass ``probs`` puts on positions the method's storage
    of that head's KV group does not hold."""
    lost = []
    for layer, p in probs.items():                                      # p (H, T) at the first decode step
        positions = attended[layer][0]                                  # (T,) every position the full cache holds
        for h in range(p.shape[0]):
            held = method_pos[layer][h // G]                            # (T_m,) -1 = empty slot
            lost.append(float(p[h][~torch.isin(positions, held)].sum()))
    return sum(lost) / len(lost)


@pytest.mark.parametrize("spec", SPECS)
def test_kl_pert_attn_l1_and_lost_are_what_the_glossary_says(run, spec):
    _, _, _, _, full, methods, metrics, G = run
    tr, m = methods[spec], metrics[spec]
    assert m["kl"] == pytest.approx(kl_by_hand(full.logits, tr.logits), abs=1e-9)
    pert = float((full.hidden - tr.hidden).norm() / full.hidden.norm())     # final hidden state, first decode step
    assert m["perturbation"] == pytest.approx(pert, abs=1e-7)
    attn_l1 = [[float((full.outs[layer][h] - tr.outs[layer][h]).abs().sum()) for h in range(full.outs[layer].shape[0])]
               for layer in range(len(full.outs))]                   # (L, H) ||o_full - o_method||_1 per head
    assert torch.allclose(torch.tensor(m["attn_l1"]), torch.tensor(attn_l1), atol=1e-6)
    assert m["lost_mass"] == pytest.approx(lost_by_hand(full.probs, full.attended, tr.pos, G), abs=1e-7)
    assert 0 <= m["lost_mass"] <= 1 and m["kl"] >= 0


def test_acc_is_string_match_all_of_the_greedy_answer(run):
    """acc: the greedy answer under each cache (decoded alone, from the prompt), scored by string_match_all."""
    model, tok, sample, trs, *_ = run
    for spec, (acc, prediction) in zip(["full"] + SPECS, greedy_accuracies(model, tok, sample, trs)):
        policy = None if spec == "full" else make_policy(spec, budget=BUDGET)
        alone = answer(model, tok, sample, MODES[0], policy)
        assert prediction == alone, spec
        assert acc == string_match_all(alone, sample.answers), spec
    assert string_match_all("12345", ["1234"]) == 0 and string_match_all("the 1234.", ["1234"]) == 1


def test_a_metric_computed_another_way_would_fail(run):
    """The variants a slip would produce give other numbers on this sample, so the checks above catch them."""
    _, _, _, _, full, methods, metrics, G = run
    tr, m = methods["streaming_llm"], metrics["streaming_llm"]
    assert m["kl"] > 0.01
    assert abs(kl_by_hand(tr.logits, full.logits) - m["kl"]) > 1e-3            # KL(method || full): swapped
    p, q = torch.softmax(full.logits.double(), -1), torch.softmax(tr.logits.double(), -1)
    assert abs(float((p - q).abs().sum(-1).mean()) - m["kl"]) > 1e-3          # a distance, not the KL
    assert abs(float((full.hidden - tr.hidden).norm()) - m["perturbation"]) > 1e-3     # not relative
    # lost is the full cache's attention mass on what the method dropped, not the share of positions dropped
    dropped = [float((~torch.isin(full.attended[layer][0], tr.pos[layer][h // G])).float().mean())
               for layer, p in full.probs.items() for h in range(p.shape[0])]
    assert abs(sum(dropped) / len(dropped) - m["lost_mass"]) > 1e-3
