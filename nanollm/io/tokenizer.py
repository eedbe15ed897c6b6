"""
A byte-level BPE tokenizer: trained by a short readable trainer, encoded by tiktoken.

Byte-pair encoding (Sennrich et al. 2016; byte-level as in GPT-2) with every digit a chunk of its own (as in
Llama), so the numbers of the synthetic tasks take one token per digit.

    tok = Tokenizer.train(text, vocab_size=1024)
    ids = tok.encode("The special magic number for calm-otter is: 4821733.")
    tok.save("tokenizer.json"); tok = Tokenizer.load("tokenizer.json")

``python -m nanollm.cli.tokenizer bench`` times tiktoken against the pure-Python encoder below (``bench``).
Details: nanollm/inside.md, section "io/tokenizer.py: a BPE tokenizer for the bundled models".
"""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from pathlib import Path

import regex
import tiktoken

from .files import atomic_write_text, read_json

# GPT-2's split pattern, except that every digit is its own chunk (GPT-2 keeps runs of digits together).
SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of ``pair`` in ``ids`` by ``new_id``, left to right."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train_bpe(text: str, vocab_size: int, pattern: str = SPLIT_PATTERN) -> dict[bytes, int]:
    """Learn ``vocab_size - 256`` merges from ``text``. Returns tiktoken's ``mergeable_ranks``: bytes -> rank.

    Works on the *distinct* chunks with their counts, so the cost scales with the vocabulary of the
    text rather than its length.
    """
    if vocab_size < 256:
        raise ValueError(f"a byte-level vocabulary needs at least 256 tokens, got vocab_size={vocab_size}")
    chunks = Counter(regex.findall(pattern, text))
    words = [(list(c.encode("utf-8")), n) for c, n in chunks.items()]   # token ids of each distinct chunk
    vocab = {i: bytes([i]) for i in range(256)}                          # id -> the bytes it stands for
    for new_id in range(256, vocab_size):
        pairs: Counter = Counter()
        for ids, n in words:
            for pair in zip(ids, ids[1:]):
                pairs[pair] += n
        if not pairs:
            break                                  # every chunk is a single token: nothing left to merge
        # most frequent pair; ties go to the pair that is smallest by id (deterministic)
        pair = max(pairs, key=lambda p: (pairs[p], -p[0], -p[1]))
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
        words = [(_merge(ids, pair, new_id), n) for ids, n in words]
    return {b: i for i, b in vocab.items()}


def encode_python(text: str, ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN) -> list[int]:
    """The same encoding as tiktoken, in pure Python (for the benchmark and as a readable reference)."""
    out = []
    for chunk in regex.findall(pattern, text):
        parts = [bytes([b]) for b in chunk.encode("utf-8")]
        while len(parts) > 1:
            # merge the adjacent pair whose merged bytes have the lowest rank (the earliest merge)
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], float("inf")))
            merged = parts[best] + parts[best + 1]
            if merged not in ranks:
                break
            parts[best:best + 2] = [merged]
        out.extend(ranks[p] for p in parts)
    return out


class Tokenizer:
    """A tiktoken ``Encoding`` built from our own ranks, plus the end-of-text token.

    ``eot_id`` is the last id; ``vocab_size`` counts it. ``encode`` treats "<|endoftext|>" in the text as
    the special token.
    """

    def __init__(self, ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN, name: str = "nanollm-bpe"):
        self.ranks = ranks
        self.pattern = pattern
        self.eot_id = len(ranks)
        self.enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens={EOT: self.eot_id})
        self.vocab_size = self.eot_id + 1

    @classmethod
    def train(cls, text: str, vocab_size: int) -> "Tokenizer":
        """Train on ``text`` so that the vocabulary (with the end-of-text token) has ``vocab_size`` tokens."""
        return cls(train_bpe(text, vocab_size - 1))

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special={EOT})

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(list(ids))

    def token_bytes(self, i: int) -> bytes:
        return self.enc.decode_single_token_bytes(i)

    def save(self, path: str | Path) -> None:
        ranks = [[base64.b64encode(b).decode("ascii"), r] for b, r in sorted(self.ranks.items(), key=lambda x: x[1])]
        atomic_write_text(path, json.dumps({"type": "nanollm-bpe", "pattern": self.pattern, "eot": EOT,
                                            "ranks": ranks}))

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer saved in ``path``; a ValueError naming the file for one that is not a regular file of
        at most 64 MB (``files.read_json``), not JSON, or not a tokenizer."""
        try:
            d = read_json(path, "tokenizer file")
        except ValueError as e:                  # its message starts with the path
            raise ValueError(f"cannot read tokenizer file {e}") from None
        try:
            ranks = {base64.b64decode(b): int(r) for b, r in d["ranks"]}
            pattern = d["pattern"]
            if not isinstance(pattern, str):
                raise TypeError(f"pattern must be a string, got {pattern!r:.100}")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read tokenizer file {path}: {e!r:.200}") from None
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError(f"tokenizer file {path} is corrupt: ranks are not 0..{len(ranks) - 1}")
        return cls(ranks, pattern)


def bench(tok: Tokenizer, text: str, repeats: int = 3) -> dict:
    """Encode ``text`` with tiktoken and with ``encode_python``; check they agree; return timings."""
    t_fast, t_py = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fast = tok.encode(text)
        t1 = time.perf_counter()
        slow = encode_python(text, tok.ranks, tok.pattern)
        t2 = time.perf_counter()
        t_fast.append(t1 - t0)
        t_py.append(t2 - t1)
    if fast != slow:
        raise AssertionError("tiktoken and the pure-Python encoder disagree")
    tf, tp = sorted(t_fast)[repeats // 2], sorted(t_py)[repeats // 2]
    return {"bytes": len(text.encode()), "tokens": len(fast), "tiktoken_s": tf, "python_s": tp,
            "tiktoken_MBps": len(text.encode()) / tf / 1e6, "python_MBps": len(text.encode()) / tp / 1e6,
            "speedup": tp / tf}
