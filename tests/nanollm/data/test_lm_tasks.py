"""Tasks for real language models (``LM_TASKS``): the passkey and the needles in Python's documentation are
deterministic, fill their length, show both modes the same tokens, hold their answer where a string search
finds it, and the documentation haystack is a run of consecutive paragraphs of one manual."""

import re
import sys

import pytest

from nanollm.data import tasks
from nanollm.data.evaluate import ANSWER_TOKENS
from nanollm.data.tasks import LM_TASKS, TASKS, corpus, docs_paragraphs, make_sample, string_match_all
from nanollm.io.tokenizer import Tokenizer

NEW = [t for t in LM_TASKS if t not in TASKS]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(corpus(100_000, seed=0), vocab_size=512)


def test_the_documentation_haystack():
    docs = docs_paragraphs()
    assert len(docs) > 500 and all(len(p) >= 80 and "\n" not in p and p[0].isalpha() for p in docs)
    assert docs is docs_paragraphs()                                  # read once


def test_the_haystack_is_the_same_on_every_python(monkeypatch, tok):
    """The paragraphs come from the committed file, not from this Python's help topics, whose wording changes
    between versions (on 3.12 every sample of the ``_docs`` tasks was other than on 3.11): a Python without
    ``pydoc_data`` makes the same samples. On 3.11 the file is what ``paragraphs_from_pydoc`` gives."""
    before = make_sample("niah_single_docs", tok, 1024, seed=4)
    monkeypatch.setitem(sys.modules, "pydoc_data", None)               # its import now fails
    monkeypatch.delitem(sys.modules, "pydoc_data.topics", raising=False)
    monkeypatch.setattr(tasks, "docs_paragraphs", tasks.docs_paragraphs.__wrapped__)   # read anew
    assert len(tasks.docs_paragraphs()) == 721
    assert make_sample("niah_single_docs", tok, 1024, seed=4) == before
    monkeypatch.undo()
    if sys.version_info[:2] == (3, 11):
        assert tasks.paragraphs_from_pydoc() == docs_paragraphs()


@pytest.mark.parametrize("task", NEW)
def test_deterministic_and_both_modes(tok, task):
    a, b, c = (make_sample(task, tok, 1536, seed=s) for s in (5, 5, 6))
    assert a == b and (a.context, a.answers) != (c.context, c.answers)
    assert a.prompt_ids == a.context_ids + a.question_ids and "\nAnswer:" in a.question
    assert tok.decode(a.context_ids) == a.context and a.target_ids[-1] == tok.eot_id
    assert string_match_all(a.target, a.answers) == 1.0
    longest = max(len(make_sample(task, tok, 1536, seed=i).target_ids) for i in range(10))
    assert longest + 4 <= ANSWER_TOKENS[task]


@pytest.mark.parametrize("task", NEW)
@pytest.mark.parametrize("length", [1536, 3072])   # a paragraph can take ~600 tokens of this small vocab
def test_length(tok, task, length):
    s = make_sample(task, tok, length, seed=1)
    unit = max(len(tok.encode(p)) for p in docs_paragraphs()) if task.endswith("_docs") else 40
    assert length - unit <= s.n_tokens <= length                       # short of it by less than one unit


@pytest.mark.parametrize("task", NEW)
def test_answer_found_by_string_search(tok, task):
    for seed in range(5):
        s = make_sample(task, tok, 1536, seed=seed)
        if task == "passkey":
            assert re.findall(r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", s.context) == s.answers
            continue
        keys = list(dict.fromkeys(re.findall(r"[a-z]+-[a-z]+", s.question)))
        values = [v for k in keys for v in re.findall(rf"for {k} is: (\d+)\.", s.context)]
        assert sorted(values) == sorted(s.answers)


def test_documentation_lines_are_consecutive_paragraphs(tok):
    docs = docs_paragraphs()
    index = {p: i for i, p in enumerate(docs)}
    s = make_sample("niah_multikey_docs", tok, 2048, seed=3)
    lines = [line for line in s.context.split("\n")[1:] if line and not line.startswith("The special magic")]
    at = [index[line] for line in lines]                             # every filler line is a paragraph
    assert len(at) >= 3 and all((b - a) % len(docs) == 1 for a, b in zip(at, at[1:]))
