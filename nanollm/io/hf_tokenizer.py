"""
Tokenizers for real checkpoints: byte-level BPE from Hugging Face files, run by tiktoken.

Reads, from the checkpoint folder only: a byte-level BPE ``tokenizer.json`` (GPT-2, Llama 3, most tokenizers
trained with Hugging Face ``tokenizers`` on bytes), GPT-2's ``vocab.json`` + ``merges.txt`` (or OpenAI's
``encoder.json`` + ``vocab.bpe``), and tiktoken's ``gpt2`` when it is cached (:func:`tiktoken_gpt2`).
SentencePiece, Unigram and WordPiece tokenizers raise a clear error. A token's tiktoken rank is its Hugging
Face id, checked to increase in merge order; added tokens become tiktoken special tokens, and no BOS token
is prepended.

    enc = load_hf_tokenizer("path/to/gpt2")       # a tiktoken.Encoding, or None without tokenizer files
    ids = enc.encode("Hello world"); text = enc.decode(ids)

Details (why rank = id reproduces Hugging Face's merges, the caveats): nanollm/inside.md, section
"io/hf_tokenizer.py: Hugging Face tokenizers through tiktoken".
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import tiktoken

from .files import MAX_JSON_MB, open_data_file, read_json, read_text

# GPT-2's pre-tokenizer regex (tiktoken's r50k pattern, the same as HF's ByteLevel(use_regex=True)).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The files behind tiktoken.get_encoding("gpt2") and their sha256 (from tiktoken_ext/openai_public.py).
GPT2_TIKTOKEN_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe":
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json":
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
SUPPORTED = ("tokenizer.json with a byte-level BPE model (GPT-2, Llama 3 style)",
             "vocab.json + merges.txt", "encoder.json + vocab.bpe")
MAX_ID = 1 << 24            # token ids above this are refused: no real vocabulary comes near 16.8M tokens


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expect(ok: bool, path, field: str, value, expected: str) -> None:
    """One line that names the file, the field, what it holds and what was expected."""
    if not ok:
        raise ValueError(f"{path}: {field} must be {expected}, got {_short(value)}")


def _read_text(path) -> str:
    """A tokenizer file's text: a regular file of at most 64 MB, UTF-8 (``files.read_text``)."""
    return read_text(path, "tokenizer file")


def _read_json(path):
    """A JSON file's value; a ValueError naming the file for an empty, non-UTF-8, malformed or too deep one."""
    return read_json(path, "tokenizer file")


def _token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_ID


def _check_vocab(vocab, path, field: str) -> None:
    _expect(isinstance(vocab, dict), path, field, vocab, "an object of token -> id")
    for tok, i in vocab.items():
        _expect(tok != "", path, f"{field}", "", "free of empty tokens (one would make encoding loop forever)")
        _expect(_token_id(i), path, f"{field}[{_short(tok)}]", i, f"an integer id in [0, {MAX_ID})")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used in byte-level BPE vocab and merges files."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:                 # control bytes, space, DEL, NBSP, soft hyphen: shifted past 255
            table[b] = chr(256 + n)
            n += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(token: str) -> bytes:
    """The raw bytes of a byte-level BPE token string ("Ġthe" -> b" the")."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError as e:
        raise ValueError(f"token {token!r} is not byte-level BPE: character {e.args[0]!r} does not stand for "
                         "a byte") from None


def mergeable_ranks(vocab: dict[str, int], merges: list[tuple[str, str]],
                    first_free: int | None = None) -> dict[bytes, int]:
    """tiktoken ``mergeable_ranks`` from a byte-level BPE vocab and merge list, with rank = HF token id.

    Raises ValueError unless the ids of merged tokens increase in merge order (see the module docstring).
    Single bytes missing from the vocab get ranks from ``first_free`` on (default: after the largest id;
    pass the first id that no token, special ones included, uses).
    The first merge producing a token sets its priority; later merges producing the same token (files
    converted from tiktoken list every split of a token) are consistent with that.
    """
    ranks = {token_bytes(tok): i for tok, i in vocab.items()}
    if len(ranks) != len(vocab) or len(set(ranks.values())) != len(ranks):
        raise ValueError("vocab has duplicate tokens or ids")
    # tiktoken needs every single byte to have a rank. Some vocabs leave a few out (SmolLM2's lacks 21: bytes
    # that cannot occur in UTF-8, like 0xC0 and 0xF5-0xFF, and rare ones, like the control byte 0x04), so
    # their tokenizer cannot encode them at all: give those ranks past the vocab. No merge makes or uses
    # them, and EncodingTokenizer drops their ids. (Hugging Face's BPE drops such a character before merging,
    # so its neighbours may merge across the gap there: a difference only next to such a byte.)
    end = max(ranks.values(), default=-1) + 1 if first_free is None else first_free
    for n, b in enumerate(b for b in range(256) if bytes([b]) not in ranks):
        ranks[bytes([b])] = end + n
    last_id, seen = -1, set()
    for k, (a, b) in enumerate(merges):
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise ValueError(f"merge {k} ({a!r}, {b!r}) refers to a token that is not in the vocab")
        if a + b in seen:
            continue
        seen.add(a + b)
        if vocab[a + b] <= last_id:
            raise ValueError(f"token ids do not follow merge order (merge {k} makes {a + b!r} with id "
                             f"{vocab[a + b]}, after a merged token with id {last_id}); tiktoken cannot "
                             "reproduce this tokenizer")
        last_id = vocab[a + b]
    return ranks


def _encoding(name: str, pattern: str, ranks: dict[bytes, int], special: dict[str, int]) -> tiktoken.Encoding:
    try:
        return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
    except ValueError as e:                  # e.g. a regex tiktoken's engine cannot compile
        raise ValueError(f"tiktoken cannot build tokenizer {name!r}: {e}") from None


# ----------------------------------------------------------------------------------------------------------
# tokenizer.json

def _pattern(pre: dict | None) -> str:
    """The split regex of a byte-level pre-tokenizer: ByteLevel alone, or Split(regex) then ByteLevel."""
    if pre is not None and not isinstance(pre, dict):
        raise ValueError(f"must be an object or null, got {_short(pre)}")
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    if not isinstance(steps, list) or not all(isinstance(step, dict) for step in steps):
        raise ValueError(f"pretokenizers must be a list of objects, got {_short(steps)}")
    pattern, byte_level = None, False
    for step in steps:
        kind = step.get("type")
        if kind == "Split" and pattern is None and not byte_level:
            regex = step.get("pattern", {}).get("Regex") if isinstance(step.get("pattern"), dict) else None
            if not isinstance(regex, str) or step.get("behavior") != "Isolated" or step.get("invert", False):
                raise ValueError(f"pre-tokenizer {step} is not supported: only Split with a Regex, "
                                 "behavior 'Isolated' and invert false")
            pattern = regex
        elif kind == "ByteLevel" and not byte_level:
            byte_level = True
            if step.get("add_prefix_space", False):
                raise ValueError("ByteLevel pre-tokenizer with add_prefix_space=true is not supported")
            if step.get("use_regex", True):
                if pattern is not None:
                    raise ValueError("a Split pre-tokenizer followed by ByteLevel(use_regex=true) is not supported")
                pattern = GPT2_PATTERN
        else:
            raise ValueError(f"pre-tokenizer {kind!r} is not supported here; byte-level BPE tokenizers use "
                             "ByteLevel, optionally after one Split")
    if not byte_level:
        raise ValueError("tokenizer.json has no ByteLevel pre-tokenizer: not a byte-level BPE tokenizer")
    return pattern or GPT2_PATTERN


def encoding_from_tokenizer_json(path: str | os.PathLike, name: str | None = None) -> tiktoken.Encoding:
    """A tiktoken Encoding equivalent to a byte-level BPE ``tokenizer.json`` (see the module docstring).
    Anything else is a ValueError that names the file and the field, before tiktoken sees it."""
    tj = _read_json(path)
    if not isinstance(tj, dict):
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json (expected an object, got {type(tj).__name__})")
    if tj.get("type") == "nanollm-bpe":
        raise ValueError(f"{path} is nanollm's own tokenizer format: load it with nanollm.io.tokenizer.Tokenizer.load")
    model = tj.get("model")
    _expect(isinstance(model, dict), path, "model", model, "an object with type, vocab and merges")
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: tokenizer model {model.get('type')!r} is not supported; supported: "
                         f"{'; '.join(SUPPORTED)}")
    normalizer = tj.get("normalizer")
    if normalizer == {"type": "Sequence", "normalizers": []}:   # what transformers writes for "none"
        normalizer = None
    _expect(normalizer is None or isinstance(normalizer, dict), path, "normalizer", normalizer, "an object or null")
    if normalizer is not None:
        raise ValueError(f"{path}: normalizer {normalizer.get('type')!r} is not supported (byte-level "
                         "BPE tokenizers like GPT-2 and Llama 3 have none)")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"{path}: BPE with {key}={model[key]!r} is not supported")
    if model.get("byte_fallback"):
        raise ValueError(f"{path}: byte_fallback BPE (SentencePiece style) is not supported")
    try:
        pattern = _pattern(tj.get("pre_tokenizer"))
    except ValueError as e:
        raise ValueError(f"{path}: pre_tokenizer: {e}") from None
    added = tj.get("added_tokens", [])
    _expect(isinstance(added, list), path, "added_tokens", added, "a list")
    special = {}
    for k, t in enumerate(added):
        _expect(isinstance(t, dict), path, f"added_tokens[{k}]", t, "an object with content and id")
        # an empty special token would make every encode loop forever: refused
        _expect(isinstance(t.get("content"), str) and t.get("content") != "", path, f"added_tokens[{k}].content",
                t.get("content"), "a non-empty string")
        _expect(_token_id(t.get("id")), path, f"added_tokens[{k}].id", t.get("id"), f"an integer id in [0, {MAX_ID})")
        special[t["content"]] = t["id"]
    special_ids = set(special.values())
    _check_vocab(model.get("vocab"), path, "model.vocab")
    vocab = {tok: i for tok, i in model["vocab"].items() if i not in special_ids}
    raw_merges = model.get("merges", [])
    _expect(isinstance(raw_merges, list), path, "model.merges", raw_merges, "a list of token pairs")
    merges = []            # "a b" strings in older files, [a, b] pairs since tokenizers 0.20
    for k, m in enumerate(raw_merges):
        pair = tuple(m.split(" ")) if isinstance(m, str) else tuple(m) if isinstance(m, list) else None
        _expect(pair is not None and len(pair) == 2 and all(isinstance(x, str) and x for x in pair), path,
                f"model.merges[{k}]", m, 'a pair of tokens ("a b" or ["a", "b"])')
        merges.append(pair)
    name = name or f"hf:{os.path.basename(os.path.dirname(os.path.abspath(path)))}"
    first_free = max([*vocab.values(), *special.values()], default=-1) + 1
    try:
        return _encoding(name, pattern, mergeable_ranks(vocab, merges, first_free), special)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def encoding_from_vocab_merges(vocab_path: str | os.PathLike, merges_path: str | os.PathLike,
                               name: str = "gpt2-files") -> tiktoken.Encoding:
    """GPT-2's original files: ``vocab.json``/``encoder.json`` ({token: id}) and ``merges.txt``/``vocab.bpe``."""
    vocab = _read_json(vocab_path)
    _check_vocab(vocab, vocab_path, "the vocabulary")
    merges = []
    for n, line in enumerate(_read_text(merges_path).split("\n"), 1):
        if line and not line.startswith("#version"):
            pair = tuple(line.split(" "))
            _expect(len(pair) == 2 and all(pair), merges_path, f"line {n}", line, "two tokens separated by one space")
            merges.append(pair)
    special = {tok: vocab.pop(tok) for tok in ("<|endoftext|>", "<|startoftext|>") if tok in vocab}
    try:
        return _encoding(name, GPT2_PATTERN, mergeable_ranks(vocab, merges), special)
    except ValueError as e:
        raise ValueError(f"{vocab_path} + {merges_path}: {e}") from None


# ----------------------------------------------------------------------------------------------------------
# tiktoken's gpt2, offline only

def tiktoken_cache_dir() -> str:
    """Where tiktoken caches downloaded files (the same rules as ``tiktoken.load.read_file_cached``)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _cached(url: str, sha256: str) -> bool:
    cache = tiktoken_cache_dir()
    path = os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())
    if not cache or not os.path.isfile(path):
        return False
    with open_data_file(path, "tiktoken cache file", MAX_JSON_MB) as f:
        return hashlib.sha256(f.read()).hexdigest() == sha256   # a bad file makes tiktoken re-download


def tiktoken_gpt2() -> tiktoken.Encoding:
    """tiktoken's ``gpt2`` encoding if its files are in tiktoken's local cache; never touches the network."""
    missing = [url for url, sha in GPT2_TIKTOKEN_FILES.items() if not _cached(url, sha)]
    if missing:
        raise FileNotFoundError(
            f"tiktoken's 'gpt2' encoding is not cached in {tiktoken_cache_dir()!r} (missing "
            f"{', '.join(os.path.basename(u) for u in missing)}), and nanollm does not download. Either put "
            "GPT-2's tokenizer.json (or vocab.json + merges.txt) in the checkpoint folder and use "
            "load_hf_tokenizer(folder), or run tiktoken.get_encoding('gpt2') once on a machine with network "
            "and copy its cache folder here (pointing TIKTOKEN_CACHE_DIR at it)")
    return tiktoken.get_encoding("gpt2")


def load_hf_tokenizer(folder: str | os.PathLike) -> tiktoken.Encoding | None:
    """The tokenizer of a checkpoint folder as a tiktoken Encoding; None if the folder has no tokenizer files.

    Raises ValueError for tokenizer files of a kind we do not support (SentencePiece, WordPiece, ...).
    """
    def has(*names: str) -> bool:
        return all(os.path.isfile(os.path.join(folder, n)) for n in names)

    name = f"hf:{os.path.basename(os.path.abspath(folder))}"
    if has("tokenizer.json"):
        return encoding_from_tokenizer_json(os.path.join(folder, "tokenizer.json"), name)
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if has(vocab, merges):
            return encoding_from_vocab_merges(os.path.join(folder, vocab), os.path.join(folder, merges), name)
    for unsupported, kind in (("tokenizer.model", "SentencePiece"), ("spiece.model", "SentencePiece"),
                              ("vocab.txt", "WordPiece")):
        if has(unsupported):
            raise ValueError(f"{folder}: {unsupported} ({kind}) is not supported; supported: {'; '.join(SUPPORTED)}")
    return None


# ----------------------------------------------------------------------------------------------------------
# Writing: a nanollm tokenizer as a Hugging Face tokenizer.json

def _merge_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two lower-ranked tokens BPE joins to make ``token``: BPE over its bytes with earlier ranks only."""
    parts = [bytes([b]) for b in token]
    limit = ranks[token]
    while len(parts) > 2:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], limit))
        if ranks.get(parts[best] + parts[best + 1], limit) >= limit:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} cannot be written as one merge of earlier tokens")
    return parts[0], parts[1]


def tokenizer_json(ranks: dict[bytes, int], pattern: str, special: dict[str, int]) -> dict:
    """A byte-level BPE ``tokenizer.json`` (Split(pattern) then ByteLevel) equivalent to tiktoken ranks.

    Rank = token id, and merges are listed in rank order, so :func:`encoding_from_tokenizer_json` (and
    Hugging Face ``tokenizers``) reproduce the same ids.
    """
    table = bytes_to_unicode()
    show = lambda b: "".join(table[x] for x in b)   # noqa: E731
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    merges = [[show(a), show(b)] for a, b in (_merge_pair(tok, ranks) for tok, r in ordered if len(tok) > 1)]
    return {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for s, i in special.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  # the special tokens are in the vocab too, as in Hugging Face's own files: a reader that
                  # misses an added token's id there gives it a new id past the vocab
                  "vocab": dict(sorted([*((show(tok), r) for tok, r in ordered), *special.items()],
                                       key=lambda kv: kv[1])),
                  "merges": merges},
    }
