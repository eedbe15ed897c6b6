"""Hidden tests of the ``cache`` assignment (the grader's; not in a student copy): the whole decoder with
its cache against the uncached forward pass, empty slots, both model flavours."""

import adapters as A
import torch
from oracle import assert_greedy_is_uncached, full_attention, points


def greedy_against_uncached(flavour: str, n_prompt: int = 12, n_new: int = 6) -> None:
    model = A.tiny_model(flavour)
    ids = torch.randint(0, model.config.vocab_size, (2, n_prompt), generator=torch.Generator().manual_seed(3))
    assert_greedy_is_uncached(A, model, ids, A.new_cache(model), n_new, what=flavour)


@points(3)
def test_cached_decode_equals_uncached_forward():
    """Llama flavour (RoPE, GQA): every greedy step's logits equal one uncached pass over the sequence."""
    greedy_against_uncached("llama")


@points(2)
def test_cached_decode_equals_uncached_forward_gpt2():
    """GPT-2 flavour (learned positions, multi-head)."""
    greedy_against_uncached("gpt2")


@points(3)
def test_extend_chunk_equals_uncached_forward():
    """A question of 4 tokens appended after the prompt (the masked path): logits equal the uncached pass."""
    model = A.tiny_model("llama", seed=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    cache = A.new_cache(model)
    A.run_prefill(model, ids[:, :16], cache)
    got = A.run_extend(model, ids[:, 16:], cache)
    torch.testing.assert_close(got, A.uncached_logits(model, ids)[:, 16:], rtol=1e-4, atol=1e-5)
    assert A.kept_positions(cache, 0)[0, 0].tolist() == list(range(20))


@points(2)
def test_empty_slots_are_never_attended():
    """A slot at position -1 holds garbage: it must not change the output."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 2, 8, generator=g)
    k, v = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    k[:, :, 2], v[:, :, 2] = 50.0, 1e4                                  # the empty slot's garbage
    k_pos = torch.tensor([0, 1, -1, 4, 5]).expand(1, 2, 5)
    q_pos = torch.tensor([5, 6])
    got = A.masked_attention(q, k, v, q_pos, k_pos)
    assert got.abs().max() < 100, "the empty slot (position -1) was attended"
    torch.testing.assert_close(got, full_attention(q, k, v, q_pos, k_pos), rtol=1e-5, atol=1e-5)
