"""
A task's prompts in an instruct model's chat template (``--chat-template`` on ``experiments.compare``): the
context and question become one user message, and the answer the assistant's turn.

    task = ChatTask(TASKS["niah_multikey"], tok, *chat_wrap(chat_template("smollm2-135m")))

The samples, references, answer lengths and scores are the wrapped task's; only the chunks the caches
receive change: ``prefix + prompt + suffix`` with the question in the prompt, and ``prefix + context``,
then ``question + suffix`` when the question comes after the context (the template's text around a message,
``nanollm.io.chat.chat_wrap``). The method compresses the prefix with the context, as a deployed instruct
model's cache would hold it.
"""

from __future__ import annotations

from nanollm.data.evaluate import MODES, check_mode
from nanollm.data.tasks import Sample

from .task import Task


class ChatTask(Task):
    def __init__(self, task: Task, tok, prefix: str, suffix: str) -> None:
        super().__init__(task.name)
        self.task, self.prefix_ids, self.suffix_ids = task, tok.encode(prefix), tok.encode(suffix)

    def sample(self, tok, length: int, seed: int) -> Sample:
        room = length - len(self.prefix_ids) - len(self.suffix_ids)
        if room < 1:
            raise ValueError(f"length {length} leaves no room inside the chat template's "
                             f"{len(self.prefix_ids) + len(self.suffix_ids)} tokens")
        return self.task.sample(tok, room, seed)        # the whole prompt, template included, fits ``length``

    def chunks(self, sample: Sample, mode: str) -> list[list[int]]:
        check_mode(mode)
        if mode == MODES[0]:
            return [self.prefix_ids + sample.prompt_ids + self.suffix_ids]
        return [self.prefix_ids + sample.context_ids, sample.question_ids + self.suffix_ids]

    def reference(self, sample: Sample) -> list[int]:
        return self.task.reference(sample)

    def answer_length(self, model, sample: Sample) -> int:
        wrapped = len(self.prefix_ids) + len(self.suffix_ids)
        return max(1, min(self.task.answer_length(model, sample), model.config.max_seq_len - wrapped
                          - len(sample.prompt_ids) + 1))

    def score(self, prediction: str, sample: Sample) -> float:
        return self.task.score(prediction, sample)

    def __getattr__(self, name):                         # a FileTask's path, items, ...
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)
