"""An instruct model's chat template: read from SmolLM2's GGUF file and rendered as transformers renders it;
``ChatTask`` feeds a task's prompt inside it in both modes; ``--chat-template`` refuses a checkpoint without
one in a line, and its records rescore."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.evaluation import compare, rescore
from experiments.evaluation.chat import ChatTask
from experiments.evaluation.task import TASKS
from nanollm import load
from nanollm.data.evaluate import MODES
from nanollm.io.chat import chat_template, chat_wrap, render
from nanollm.io.checkpoint import load_tokenizer

QWEN_STYLE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHECKING = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}" + QWEN_STYLE


def test_smollm2_s_template_renders_as_transformers_renders_it(smollm2_file):
    transformers = pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    template = chat_template("smollm2-135m")
    assert template is not None and "<|im_start|>" in template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]
    for generation in (True, False):
        theirs = render_jinja_template([messages], chat_template=template, add_generation_prompt=generation)[0][0]
        assert render(template, messages, add_generation_prompt=generation) == theirs
    prefix, suffix = chat_wrap(template)
    assert prefix.endswith("<|im_start|>user\n") and suffix == "<|im_end|>\n<|im_start|>assistant\n"
    assert transformers is not None


def test_a_template_that_refuses_or_hides_the_message_is_one_error():
    with pytest.raises(ValueError, match="the chat template refuses: user first"):
        render(CHECKING, [{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="does not show the user's message once"):
        chat_wrap("{{ 'no message here' }}")


def test_a_chat_task_wraps_the_prompt_in_both_modes_and_fits_its_length(smollm2_file):
    tok = load_tokenizer("smollm2-135m")
    prefix, suffix = chat_wrap(chat_template("smollm2-135m"))
    task = ChatTask(TASKS["passkey"], tok, prefix, suffix)
    s = task.sample(tok, 256, seed=0)
    p, q = tok.encode(prefix), tok.encode(suffix)
    assert task.chunks(s, MODES[0]) == [p + s.prompt_ids + q]
    assert task.chunks(s, MODES[1]) == [p + s.context_ids, s.question_ids + q]
    assert len(p) + s.n_tokens + len(q) <= 256
    assert task.reference(s) == s.target_ids and task.score(s.target, s) == 1.0


def test_compare_refuses_a_checkpoint_without_a_template(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--chat-template", "--methods", "snapkv", "--samples", "1"])
    err = capsys.readouterr().err
    assert "--chat-template: checkpoint retrieval-llama has no chat template" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_compare_in_smollm2_s_template_in_bf16_and_its_records_rescore(tmp_path, capsys, smollm2_file):
    """A short run of SmolLM2-135M in its chat template, in bf16: the records say so, and rescore wraps the
    samples the same way to find the references again."""
    torch.set_num_threads(1)
    out = tmp_path / "chat.json"
    compare.main(["--checkpoint", "smollm2-135m", "--chat-template", "--dtype", "bfloat16", "--tasks", "passkey",
                  "--methods", "snapkv", "--keep-ratios", "0.5", "--samples", "1", "--length", "192",
                  "--workers", "1", "--quiet", "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert {(r["chat_template"], r["dtype"]) for r in records} == {(True, "bfloat16")}
    assert all(r["compressed_tokens"][0] > 0 for r in records)
    capsys.readouterr()
    rescore.main([str(out)])
    assert "accuracy: the same as stored in 4 of 4 records" in capsys.readouterr().out
    model, _, _ = load("smollm2-135m", dtype=torch.bfloat16)
    assert model.tok_emb.weight.dtype == torch.bfloat16
