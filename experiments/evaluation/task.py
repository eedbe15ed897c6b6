"""
A task: what the evaluation asks of one kind of sample. A new task is one class, named in ``TASKS``; a task
read from a JSON Lines file is ``task_file.FileTask`` (``--task-file`` on ``experiments.compare``).

    task = TASKS["niah_multikey"]; sample = task.sample(tok, 512, seed=0)
    task.chunks(sample, "question_after_context")   # [context ids, question ids]: fed one after the other
    task.reference(sample)                          # the answer's ids, fed one at a time (teacher forcing)
"""

from __future__ import annotations

import random

from nanollm.data.evaluate import ANSWER_TOKENS, MODES, answer_length, check_mode
from nanollm.data.tasks import ALL_TASKS, Sample, docs_paragraphs, make_sample, string_match_all


class Task:
    """A synthetic task of ``nanollm.data.tasks`` (RULER's style), scored by RULER's ``string_match_all``.
    Subclasses change what they need; every method has a default that fits a ``tasks.Sample``.
    ``answer_tokens``: the most tokens a greedy answer may take (a new task sets it on its class; the
    built-in ones have theirs in ``nanollm.data.evaluate.ANSWER_TOKENS``)."""

    answer_tokens: int | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    def sample(self, tok, length: int, seed: int) -> Sample:
        """A tokenized sample of at most ``length`` tokens, the same for the same (length, seed)."""
        return make_sample(self.name, tok, length, seed=seed)

    def chunks(self, sample: Sample, mode: str) -> list[list[int]]:
        """The prompt as the caches receive it: one prompt pass, then each further chunk ``extend``-ed."""
        check_mode(mode)
        return [sample.prompt_ids] if mode == MODES[0] else [sample.context_ids, sample.question_ids]

    def reference(self, sample: Sample) -> list[int]:
        """The reference answer's ids, end-of-text token included."""
        return sample.target_ids

    def answer_length(self, model, sample: Sample) -> int:
        """The most tokens a greedy answer may take, cut to the room the model's positions leave."""
        allowed = self.answer_tokens or ANSWER_TOKENS.get(self.name)
        if allowed is None:
            raise ValueError(f"task {self.name!r} has no answer length: set answer_tokens on its class")
        return answer_length(model, sample, max_new_tokens=allowed)

    def score(self, prediction: str, sample: Sample) -> float:       # the greedy answer's text -> [0, 1]
        return string_match_all(prediction, sample.answers)


class DocsContinuation(Task):
    """A task read from real text: a stretch of Python's help topics (``tasks.docs_paragraphs``), then a
    quote from inside it; the answer is the words that follow the quote there (finding a passage and copying
    on: what induction heads do). Scored by the share of the reference words the answer reproduces, in
    order, from its start (not RULER's scorer: a partial copy earns part of the score)."""

    CUE, ANSWER, ROOM = 8, 6, 96           # words quoted, words asked for, a first guess of their tokens

    def __init__(self) -> None:
        super().__init__("docs_continuation")

    def sample(self, tok, length: int, seed: int) -> Sample:
        if length <= self.ROOM:
            raise ValueError(f"length {length} is too short for task {self.name!r}")
        rng, paragraphs = random.Random(f"{self.name}/{seed}"), docs_paragraphs()
        start = rng.randrange(len(paragraphs))
        text = " ".join(paragraphs[(start + k) % len(paragraphs)] for k in range(1 + length // 40))   # one line
        context_ids = tok.encode(text)[:length - self.ROOM]
        words = tok.decode(context_ids).split()
        if len(words) // 2 <= self.CUE + self.ANSWER:
            raise ValueError(f"length {length} is too short for task {self.name!r}")
        at = rng.randrange(len(words) // 2 - self.CUE - self.ANSWER)       # the quote stays in when cut below
        cue, answer = " ".join(words[at:at + self.CUE]), " ".join(words[at + self.CUE:at + self.CUE + self.ANSWER])
        question = f'\n\nQuoted from the text above: "{cue}'
        question_ids, target_ids = tok.encode(question), tok.encode(" " + answer) + [tok.eot_id]
        context_ids = context_ids[:max(0, length - len(question_ids) - len(target_ids))]
        if f"{cue} {answer}" not in " ".join(tok.decode(context_ids).split()):
            raise ValueError(f"length {length} is too short for task {self.name!r}")
        return Sample(self.name, tok.decode(context_ids), question, [answer], " " + answer,
                      context_ids=context_ids, question_ids=question_ids, target_ids=target_ids)

    def answer_length(self, model, sample: Sample) -> int:
        return min(len(sample.target_ids) + 4, model.config.max_seq_len - len(sample.prompt_ids) + 1)

    def score(self, prediction: str, sample: Sample) -> float:
        said, want = ([w.strip('"\'.,;:') for w in text.split()] for text in (prediction, sample.answers[0]))
        n = 0
        while n < min(len(said), len(want)) and said[n] == want[n]:
            n += 1
        return n / len(want)


TASKS: dict[str, Task] = {name: Task(name) for name in ALL_TASKS} | {"docs_continuation": DocsContinuation()}
