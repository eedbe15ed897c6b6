"""
Synthetic long-context tasks in the style of RULER (Hsieh et al. 2024, arXiv 2404.06654), scaled down for
tiny models: shorter contexts, a smaller vocabulary of keys and values, fewer needles.

A sample is a *context* (a haystack with needles), a *question* (ending with the answer prefix) and the
*answers*, tokenized once (``context_ids``, ``question_ids``) so that question-in-prompt (prefill context +
question) and question-after-context (prefill context, then extend by the question) see identical tokens.
``TASKS`` are the tasks the bundled model was trained on; ``LM_TASKS`` are RULER's passkey and the same builders
over paragraphs of Python's documentation (``docs_paragraphs.txt``), for pretrained models. Answers are 4-7
digit numbers, scored by RULER's ``string_match_all``; ``length`` counts every token of a sample, answer
included.

Details (each task and its RULER counterpart, the haystacks, how a length is met): nanollm/inside.md, section
"data/tasks.py: synthetic long-context tasks".
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from .words import ADJECTIVES, CWE_WORDS, NAMES, NOISE_LINE, NOUNS, PLACES, VERBS

TASKS = ["niah_single_noise", "niah_single_prose", "niah_single_needle", "niah_multikey",
         "niah_multivalue", "niah_multiquery", "vt", "cwe"]
TRAINING_TASKS = ["copy"]     # extra tasks that help training; never part of an evaluation suite
LM_TASKS = ["passkey", "niah_single_docs", "niah_multikey_docs", "niah_multivalue_docs", "niah_multiquery_docs",
            "vt", "cwe"]
ALL_TASKS = TASKS + [t for t in LM_TASKS if t not in TASKS]     # every evaluation task

HEADER_NIAH = "Some special magic numbers are hidden in the text below. Remember them for the quiz.\n"
HEADER_VT = "Remember the variable assignments hidden in the text below.\n"
HEADER_CWE = "Below is a list of words. Some of them appear many times.\n"
HEADER_PASSKEY = "A pass key is hidden somewhere in the long text below. Find it and remember it for later.\n"


@dataclass
class Sample:
    task: str
    context: str                # the document; prompt of the question-after-context mode
    question: str               # asked after the context; ends with the answer prefix ("Answer: ... is:")
    answers: list[str]          # reference strings, in the order the model is trained to write them
    target: str                 # the answer as the model writes it, e.g. " 4821733" (then end-of-text)
    depths: list[float] = field(default_factory=list)   # depth of each needle in the filler, 0 = start
    context_ids: list[int] = field(default_factory=list)
    question_ids: list[int] = field(default_factory=list)
    target_ids: list[int] = field(default_factory=list)  # target tokens + the end-of-text token

    @property
    def prompt_ids(self) -> list[int]:
        """Ids of the question-in-prompt mode: context then question."""
        return self.context_ids + self.question_ids

    @property
    def n_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids) + len(self.target_ids)


def _matches(pred: str, a: str) -> list[int]:
    """The end of every occurrence of ``a`` in ``pred`` (both lowercased) that counts as a match: a digit
    string must not continue a number on either side ("12345" is not found inside "123456")."""
    ends = []
    start = pred.find(a)
    while start >= 0:
        end = start + len(a)
        ok_left = not (a[0].isdigit() and start > 0 and pred[start - 1].isdigit())
        ok_right = not (a[-1].isdigit() and end < len(pred) and pred[end].isdigit())
        if ok_left and ok_right:
            ends.append(end)
        start = pred.find(a, start + 1)
    return ends


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's metric: the fraction of reference strings that occur in the prediction (case-insensitive).

    Digit strings must match exactly and in full: "12345" is not found inside "123456".
    """
    pred = prediction.lower()
    return sum(1 for a in answers if _matches(pred, a.lower())) / len(answers)


# ----------------------------------------------------------------------------------------------------------
# Pieces

def _key(rng: random.Random, used: set) -> str:
    while True:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in used:
            used.add(k)
            return k


def _number(rng: random.Random, lo_digits: int = 4, hi_digits: int = 7) -> str:
    n = rng.randint(lo_digits, hi_digits)
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is: {value}."


def _prose(rng: random.Random) -> str:
    return (f"{rng.choice(NAMES)} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} "
            f"near {rng.choice(PLACES)}.")


DOCS_FILE = Path(__file__).with_name("docs_paragraphs.txt")


@functools.cache
def docs_paragraphs() -> tuple[str, ...]:
    """The documentation haystack: 721 prose paragraphs of Python's help topics, one a line, read from
    ``docs_paragraphs.txt`` beside this file (190 KB). The file is what ``paragraphs_from_pydoc`` gives on
    Python 3.11; it is committed because that text changes between Python versions, and every sample of the
    ``_docs`` tasks would change with it (the committed results were made on 3.11)."""
    return tuple(DOCS_FILE.read_text(encoding="utf-8").rstrip("\n").split("\n"))


def paragraphs_from_pydoc() -> tuple[str, ...]:
    """How ``docs_paragraphs.txt`` was made: the prose paragraphs of this Python's help topics
    (``pydoc_data.topics``, which ships with CPython), topics in name order, each on one line: paragraphs
    that start at the margin with a letter and have at least 80 characters (indented code, grammar rules and
    headings are left out). Python's documentation is under the PSF License."""
    from pydoc_data.topics import topics
    out = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            text = " ".join(para.split())
            if para[:1].isalpha() and len(text) >= 80:
                out.append(text)
    return tuple(out)


def _filler(rng: random.Random, kind: str, n: int, used: set) -> list[str]:
    if kind == "noise":
        return [NOISE_LINE] * n
    if kind == "prose":
        return [_prose(rng) for _ in range(n)]
    if kind == "needle":   # every filler line is itself a needle, with a fresh key (maximal distractors)
        return [_needle(_key(rng, used), _number(rng)) for _ in range(n)]
    if kind == "docs":     # consecutive paragraphs of one manual, from a random start
        docs = docs_paragraphs()
        start = rng.randrange(len(docs))
        return [docs[(start + i) % len(docs)] for i in range(n)]
    raise ValueError(f"unknown haystack {kind!r}; choose noise, prose, needle or docs")


def _insert(rng: random.Random, units: list[str], needles: list[str], depths) -> tuple[list[str], list[float]]:
    """Insert needles between filler units at the requested depths (fractions of the filler; None = random)."""
    n = len(units)
    if depths is None:
        depths = [None] * len(needles)
    elif isinstance(depths, (int, float)):
        depths = [depths] + [None] * (len(needles) - 1)
    slots = []
    for d in depths:
        if d is not None and not 0.0 <= d <= 1.0:
            raise ValueError(f"needle depth must lie in [0, 1], got {d}")
        slots.append(round(d * n) if d is not None else rng.randint(0, n))
    out = list(units)
    # insert from the deepest slot down so earlier indices stay valid; equal slots keep needle order
    for i in sorted(range(len(needles)), key=lambda i: (slots[i], i), reverse=True):
        out.insert(slots[i], needles[i])
    placed = [s / n if n else 0.0 for s in slots]
    return out, placed


def _join(items: list[str], last: str = "and") -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {last} " + items[-1]


# ----------------------------------------------------------------------------------------------------------
# Task builders: (rng, n filler units, options) -> (context, question, answers, target, depths)

def _build_niah(rng, n, haystack="prose", n_keys=1, n_values=1, n_queries=1, n_distractors=0, depth=None):
    used: set = set()
    keys = [_key(rng, used) for _ in range(max(n_keys, n_queries) + n_distractors)]
    values = {k: [_number(rng) for _ in range(n_values)] for k in keys}
    queried = keys[:n_queries]
    needles = [_needle(k, v) for k in keys for v in values[k]]
    if depth is None:                            # random depths: true needles and distractors in random order
        rng.shuffle(needles)                     # (given depths apply to the queried needles first, in order)
    units = _filler(rng, haystack, n, used)
    units, depths = _insert(rng, units, needles, depth)
    context = HEADER_NIAH + "\n".join(units) + "\n"
    # Answer prefixes restate the question the way the needle is phrased (RULER appends such a prefix
    # too), so the model continues a needle-shaped sentence with its value.
    if n_queries > 1:
        q = f"Question: What are the special magic numbers for {_join(queried)}?\nAnswer:"
        answers = [values[k][0] for k in queried]
        target = " " + ", ".join(f"{k} is: {values[k][0]}" for k in queried)
    elif n_values > 1:
        k = queried[0]
        q = f"Question: What are all the special magic numbers for {k}?\nAnswer: The special magic numbers for {k} are:"
        answers = sorted(values[k], key=lambda v: context.index(f" is: {v}."))   # in order of appearance
        target = " " + ", ".join(answers)
    else:
        k = queried[0]
        q = f"Question: What is the special magic number for {k}?\nAnswer: The special magic number for {k} is:"
        answers = values[k]
        target = " " + answers[0]
    true = [i for i, nd in enumerate(needles) if any(f" {k} is:" in nd for k in queried)]
    return context, q, answers, target, [depths[i] for i in true]


def _var(rng: random.Random, used: set) -> str:
    while True:
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in used:
            used.add(v)
            return v


def _build_vt(rng, n, n_hops=4, n_chains=1, depth=None):
    """Variable tracking (RULER vt): VAR X0 = value, VAR X1 = VAR X0, ...; statements in chain order."""
    used: set = set()
    chains = []
    for _ in range(n_chains):
        names = [_var(rng, used) for _ in range(n_hops + 1)]
        value = str(rng.randint(10000, 99999))
        chains.append((names, value))
    units = [NOISE_LINE] * n
    statements = []
    for names, value in chains:
        stmts = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        statements.append(stmts)
    needles = [s for stmts in statements for s in stmts]
    if depth is None:   # sorted random depths keep each chain's statements in order
        depth = sorted(rng.random() for _ in needles)
    units, depths = _insert(rng, units, needles, depth)
    context = HEADER_VT + "\n".join(units) + "\n"
    names, value = chains[0]
    q = f"Question: Which variables are assigned the value {value}?\nAnswer: The variables assigned {value} are:"
    return context, q, names, " " + ", ".join(names), depths[: n_hops + 1]


def _build_cwe(rng, n, n_common=5, freq_uncommon=1, depth=None):
    """Common-words extraction (RULER cwe): n_common words appear 10x as often as the n uncommon ones."""
    if n + n_common > len(CWE_WORDS):
        raise ValueError(f"cwe needs {n + n_common} distinct words, only {len(CWE_WORDS)} exist; "
                         "raise freq_uncommon for longer samples")
    words = rng.sample(CWE_WORDS, n_common + n)
    common, uncommon = words[:n_common], words[n_common:]
    items = common * (10 * freq_uncommon) + uncommon * freq_uncommon
    rng.shuffle(items)
    lines = [" ".join(items[i:i + 10]) for i in range(0, len(items), 10)]
    context = HEADER_CWE + "\n".join(lines) + "\n"
    q = f"Question: What are the {n_common} most common words in the list above?\nAnswer: The most common words are:"
    answers = sorted(common, key=lambda w: items.index(w))     # in order of first appearance
    return context, q, answers, " " + ", ".join(answers), []


def _build_passkey(rng, n, depth=None):
    """Passkey retrieval (RULER's passkey, after Mohtashami & Jaggi 2023, arXiv 2305.16300): one 5-digit key,
    stated twice in one line, among repeats of the noise line."""
    key = str(rng.randint(10000, 99999))
    units, depths = _insert(rng, [NOISE_LINE] * n, [f"The pass key is {key}. Remember it. {key} is the pass key."],
                            depth)
    context = HEADER_PASSKEY + "\n".join(units) + "\n"
    return context, "Question: What is the pass key?\nAnswer: The pass key is", [key], " " + key, depths


def _build_copy(rng, n, depth=None):
    """Training aid, not a RULER task: repeat a list of random words and numbers. The list's length varies,
    so no fixed offset solves it; the model must find where it is in the list by content (induction heads,
    Olsson et al. 2022), the mechanism every retrieval task above builds on."""
    items = [rng.choice(CWE_WORDS) if rng.random() < 0.7 else _number(rng, 2, 4) for _ in range(n)]
    text = " ".join(items)
    context = "Read the list below. You will have to repeat it.\n" + text + "\n"
    return context, "Question: Repeat the list.\nAnswer:", [text], " " + text, []


# name -> (builder, default options)
_BUILDERS = {
    "niah_single_noise": (_build_niah, dict(haystack="noise")),
    "niah_single_prose": (_build_niah, dict(haystack="prose")),
    "niah_single_needle": (_build_niah, dict(haystack="needle")),
    "niah_multikey": (_build_niah, dict(haystack="prose", n_distractors=3)),
    "niah_multivalue": (_build_niah, dict(haystack="prose", n_values=4)),
    "niah_multiquery": (_build_niah, dict(haystack="prose", n_keys=4, n_queries=4)),
    "vt": (_build_vt, dict()),
    "cwe": (_build_cwe, dict()),
    "passkey": (_build_passkey, dict()),
    "niah_single_docs": (_build_niah, dict(haystack="docs")),
    "niah_multikey_docs": (_build_niah, dict(haystack="docs", n_distractors=3)),
    "niah_multivalue_docs": (_build_niah, dict(haystack="docs", n_values=4)),
    "niah_multiquery_docs": (_build_niah, dict(haystack="docs", n_keys=4, n_queries=4)),
    "copy": (_build_copy, dict()),       # training only (not in TASKS)
}


def _check_options(task: str, options: dict) -> dict:
    if task not in _BUILDERS:
        raise ValueError(f"unknown task {task!r}; choose one of {ALL_TASKS} (or {TRAINING_TASKS} for training)")
    builder, defaults = _BUILDERS[task]
    allowed = builder.__code__.co_varnames[2:builder.__code__.co_argcount]
    unknown = set(options) - set(allowed)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for task {task!r}; allowed: {list(allowed)}")
    opts = {**defaults, **options}
    for name in ("n_keys", "n_values", "n_queries", "n_hops", "n_chains", "n_common", "freq_uncommon"):
        if name in opts and (not isinstance(opts[name], int) or opts[name] <= 0):
            raise ValueError(f"{name} must be a positive integer, got {opts[name]!r}")
    if opts.get("n_distractors", 0) < 0:
        raise ValueError(f"n_distractors must be >= 0, got {opts['n_distractors']}")
    return opts


def build_text(task: str, n_units: int, seed: int, **options) -> Sample:
    """A sample with exactly ``n_units`` filler units and no tokenization (used to make tokenizer corpora)."""
    opts = _check_options(task, options)            # raises for an unknown task or option
    builder = _BUILDERS[task][0]
    context, question, answers, target, depths = builder(random.Random(f"{task}/{seed}"), n_units, **opts)
    return Sample(task, context, question, answers, target, depths)


def make_sample(task: str, tok, length: int, seed: int, **options) -> Sample:
    """A tokenized sample of ``task`` with at most ``length`` tokens (context + question + answer + end).

    Deterministic for (task, seed, length, options). Options: ``depth`` (a float in [0, 1] for the true
    needle, or one per needle), ``n_distractors``, ``n_values``, ``n_queries``/``n_keys``, ``n_hops``,
    ``n_chains``, ``n_common``, ``freq_uncommon`` (see the builders).
    """
    if task == "cwe" and "freq_uncommon" not in options:
        options = {**options, "freq_uncommon": max(1, math.ceil(length / 400))}
    _check_options(task, options)
    if not isinstance(length, int) or length <= 0:
        raise ValueError(f"length must be a positive integer, got {length!r}")

    def build(n: int) -> Sample:
        s = build_text(task, n, seed, **options)
        s.context_ids = tok.encode(s.context)
        s.question_ids = tok.encode(s.question)
        s.target_ids = tok.encode(s.target) + [tok.eot_id]
        return s

    def fits(n: int) -> bool:
        try:
            return build(n).n_tokens <= length
        except ValueError:        # e.g. cwe has run out of distinct words: treat as too long
            return False

    if not fits(1):
        raise ValueError(f"length {length} is too short for task {task!r}: its needles, question and "
                         f"answer alone take {build(1).n_tokens} tokens")
    lo, hi = 1, 2                      # grow hi until it overflows, then bisect: largest n that fits
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return build(lo)


def corpus(n_bytes: int, seed: int = 0) -> str:
    """Text from every task (untokenized), about ``n_bytes`` long: what the BPE tokenizer is trained on."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        task = rng.choice(TASKS)
        s = build_text(task, rng.randint(5, 40), seed=rng.randrange(1 << 30))
        text = s.context + s.question + s.target + "\n"
        parts.append(text)
        size += len(text)
    return "".join(parts)
