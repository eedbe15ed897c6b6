"""Synthetic task generators: determinism, length control, needle depth, solvability, scoring."""

import re
from collections import Counter

import pytest

from nanollm.data.tasks import TASKS, corpus, make_sample, string_match_all
from nanollm.io.tokenizer import Tokenizer

LENGTHS = [256, 512, 1024]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(corpus(200_000, seed=0), vocab_size=1024)


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_deterministic(tok, task):
    a, b = make_sample(task, tok, 384, seed=5), make_sample(task, tok, 384, seed=5)
    c = make_sample(task, tok, 384, seed=6)
    assert a == b
    assert (a.context, a.answers) != (c.context, c.answers)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_length_and_modes(tok, task, length):
    s = make_sample(task, tok, length, seed=1)
    # within one filler unit (a noise line, a prose sentence, a needle, a line of ten words) of the target
    assert length - 40 <= s.n_tokens <= length
    assert s.prompt_ids == s.context_ids + s.question_ids          # both modes see the same tokens
    assert tok.decode(s.context_ids) == s.context and tok.decode(s.question_ids) == s.question
    assert s.target_ids[-1] == tok.eot_id and "\nAnswer:" in s.question
    assert string_match_all(s.target, s.answers) == 1.0


@pytest.mark.parametrize("task", TASKS)
def test_answer_recoverable_by_string_search(tok, task):
    for seed in range(5):
        s = make_sample(task, tok, 512, seed=seed)
        if task.startswith("niah"):
            keys = list(dict.fromkeys(re.findall(r"[a-z]+-[a-z]+", s.question)))   # in order, once each
            values = [v for k in keys for v in re.findall(rf"for {k} is: (\d+)\.", s.context)]
            assert sorted(values) == sorted(s.answers)
            if task == "niah_multivalue":     # in order of appearance
                assert values == s.answers
        elif task == "vt":
            value = re.search(r"value (\d+)\?", s.question).group(1)
            chain = [re.search(rf"VAR ([A-Z]+) = {value}\.", s.context).group(1)]
            while m := re.search(rf"VAR ([A-Z]+) = VAR {chain[-1]}\.", s.context):
                chain.append(m.group(1))
            assert chain == s.answers
        elif task == "cwe":
            words = s.context.split("\n", 1)[1].split()
            counts = Counter(words)
            top = [w for w, _ in counts.most_common(len(s.answers))]
            assert sorted(top) == sorted(s.answers)
            assert min(counts[w] for w in s.answers) > max(c for w, c in counts.items() if w not in s.answers)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("task", ["niah_single_noise", "niah_single_prose", "niah_single_needle"])
def test_needle_depth(tok, task, depth):
    s = make_sample(task, tok, 1024, seed=3, depth=depth)
    value = s.answers[0]
    where = s.context.index(f"is: {value}.") / len(s.context)
    assert abs(where - depth) < 0.06
    assert abs(s.depths[0] - depth) < 0.05


def test_multi_needle_depths(tok):
    s = make_sample("niah_multiquery", tok, 1024, seed=0, depth=[0.1, 0.4, 0.6, 0.9])
    for v, d in zip(s.answers, [0.1, 0.4, 0.6, 0.9]):
        assert abs(s.context.index(f"is: {v}.") / len(s.context) - d) < 0.06


def test_distractor_count(tok):
    s = make_sample("niah_multikey", tok, 512, seed=0, n_distractors=6)
    assert s.context.count("special magic number for") == 7


def test_multi_token_values(tok):
    lengths = set()
    for seed in range(40):
        s = make_sample("niah_single_noise", tok, 256, seed=seed)
        lengths.add(len(s.answers[0]))
        assert len(s.target_ids) == len(s.answers[0]) + 2     # a space, one token per digit, end-of-text
    assert lengths == {4, 5, 6, 7}


def test_bad_input(tok):
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_sample("nope", tok, 512, seed=0)
    with pytest.raises(ValueError, match="too short"):
        make_sample("niah_multiquery", tok, 60, seed=0)
    with pytest.raises(ValueError, match="n_queries must be a positive"):
        make_sample("niah_multiquery", tok, 512, seed=0, n_queries=0)
    with pytest.raises(ValueError, match="n_distractors"):
        make_sample("niah_multikey", tok, 512, seed=0, n_distractors=-1)
    with pytest.raises(ValueError, match="unknown option"):
        make_sample("vt", tok, 512, seed=0, n_values=3)
    with pytest.raises(ValueError, match="length must be a positive"):
        make_sample("vt", tok, 0, seed=0)
    with pytest.raises(ValueError, match="depth must lie"):
        make_sample("niah_single_noise", tok, 512, seed=0, depth=1.5)


def test_string_match_all():
    assert string_match_all(" 12345, 678", ["12345", "678"]) == 1.0
    assert string_match_all(" 123456", ["12345"]) == 0.0          # digit strings match whole numbers only
    assert string_match_all(" 9912345", ["12345"]) == 0.0
    assert string_match_all(" 12345 and 123", ["123", "999"]) == 0.5
    assert string_match_all(" ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("task", TASKS)
def test_answer_budget_covers_the_longest_target(tok, task):
    from nanollm.data.evaluate import ANSWER_TOKENS
    longest = max(len(make_sample(task, tok, 512, seed=i).target_ids) for i in range(20))
    assert longest + 4 <= ANSWER_TOKENS[task]      # room for a few extra tokens before the cut
