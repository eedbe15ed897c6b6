"""
nanollm.io.hf_tokenizer: byte-level BPE files built by hand, exact token ids derived by hand, agreement with a
plain-Python HF BPE reference, and clear errors for what is not supported.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import regex

from nanollm.io.hf_tokenizer import GPT2_PATTERN, bytes_to_unicode, load_hf_tokenizer, tiktoken_gpt2, token_bytes

B2U = bytes_to_unicode()
# GPT-2's id order for single bytes: the 188 printable ones in byte order, then the other 68 ("Ġ" = space = 220)
GPT2_BYTE_VOCAB = {B2U[b]: i for i, b in enumerate(sorted(B2U, key=lambda b: (ord(B2U[b]) > 255, b)))}
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l"), ("he", "ll"), ("hell", "o")]   # ids 256..261
EOT_ID = 262


def tokenizer_json(merges=MERGES, vocab=None, pre_tokenizer=None, old_merges_format=False) -> dict:
    """A minimal GPT-2-style tokenizer.json: 256 byte tokens, then one token per merge, then <|endoftext|>."""
    if vocab is None:
        vocab = dict(GPT2_BYTE_VOCAB)
        for a, b in merges:
            vocab.setdefault(a + b, len(vocab))
        vocab["<|endoftext|>"] = len(vocab)
    return {
        "version": "1.0", "normalizer": None,
        "added_tokens": [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>", "special": True}],
        "pre_tokenizer": pre_tokenizer or {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "vocab": vocab,
                  "merges": [f"{a} {b}" if old_merges_format else [a, b] for a, b in merges]},
    }


def write(folder, tj: dict):
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    return folder


def test_byte_table_matches_gpt2():
    assert B2U[ord(" ")] == "Ġ" and B2U[ord("\n")] == "Ċ" and B2U[ord("a")] == "a"
    assert GPT2_BYTE_VOCAB["Ġ"] == 220 and GPT2_BYTE_VOCAB["h"] == 71      # GPT-2's real ids
    assert token_bytes("Ġthe") == b" the"


# Derivations (HF BPE merges the adjacent pair that comes first in MERGES):
#   "hello"  h e l l o -> [he] l l o (merge 1 beats 3) -> he [ll] o -> [hell] o -> [hello]      = 261
#   " the"   Ġ t h e -> [Ġt] h e (merge 0) -> Ġt [he] -> [Ġthe]                                  = 258
#   "the"    t h e: no (t, h) merge -> t [he]                                          = 83, 257
#   "lll"    leftmost pair first: [ll] l                                               = 259, 75
#   " hello" one chunk: Ġ h e l l o -> Ġ [he] l l o -> ... -> Ġ [hello]; (Ġ, hello) is no merge = 220, 261
HAND_CHECKED = {
    "hello": [261], "hellow": [261, 86], " the": [258], " then": [258, 77], "the": [83, 257],
    "hehe": [257, 257], "lll": [259, 75], " hello": [220, 261], "hello the": [261, 258], "": [],
}


@pytest.mark.parametrize("old_merges_format", [False, True])
def test_hand_checked_ids(tmp_path, old_merges_format):
    enc = load_hf_tokenizer(write(tmp_path / "tok", tokenizer_json(old_merges_format=old_merges_format)))
    for text, expected in HAND_CHECKED.items():
        assert enc.encode(text) == expected, text
        assert enc.decode(expected) == text
    assert enc.encode("hi<|endoftext|>", allowed_special="all") == [71, 72, EOT_ID]


def reference_bpe(text: str, merges: list[tuple[str, str]], vocab: dict[str, int], pattern: str) -> list[int]:
    """Hugging Face's BPE in plain Python: split, map bytes to characters, merge the best-ranked pair first."""
    rank = {pair: i for i, pair in enumerate(merges)}
    out = []
    for chunk in regex.findall(pattern, text):
        parts = [B2U[b] for b in chunk.encode("utf-8")]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: rank.get((parts[i], parts[i + 1]), float("inf")))
            if (parts[best], parts[best + 1]) not in rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        out += [vocab[p] for p in parts]
    return out


def test_matches_reference_bpe_on_random_text(tmp_path):
    tj = tokenizer_json()
    enc = load_hf_tokenizer(write(tmp_path / "tok", tj))
    rng = random.Random(0)
    alphabet = list("hellothe w\n\t.'s") + ["é", "東", "😀", "  "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        ids = enc.encode(text)
        assert ids == reference_bpe(text, MERGES, tj["model"]["vocab"], GPT2_PATTERN), text
        assert enc.decode(ids) == text


def test_split_pre_tokenizer_regex_is_used(tmp_path):
    """Llama 3 splits digits in runs of at most 3 before BPE: the (3, 4) merge cannot cross "123|4"."""
    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}|\p{L}+|\s+|[^\s\p{L}\p{N}]+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    gpt2 = load_hf_tokenizer(write(tmp_path / "a", tokenizer_json(merges=[("3", "4")])))
    split = load_hf_tokenizer(write(tmp_path / "b", tokenizer_json(merges=[("3", "4")], pre_tokenizer=llama3)))
    assert gpt2.encode("1234") == [16, 17, 256]          # one chunk "1234": 1 2 [34]
    assert split.encode("1234") == [16, 17, 18, 19]      # chunks "123", "4"


def test_hf_trained_id_layout(tmp_path):
    """Tokenizers trained by HF `tokenizers`: special tokens first, then bytes by character, then merges."""
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(B2U.values()):
        vocab[ch] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    enc = load_hf_tokenizer(write(tmp_path / "tok", tokenizer_json(vocab=vocab)))
    assert enc.encode(" hello the") == [vocab["Ġ"], vocab["hello"], vocab["Ġthe"]]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [0]


def test_gpt2_vocab_and_merges_files(tmp_path):
    tj = tokenizer_json()
    for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        folder = tmp_path / vocab_name
        folder.mkdir()
        (folder / vocab_name).write_text(json.dumps(tj["model"]["vocab"]), encoding="utf-8")
        (folder / merges_name).write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES),
                                          encoding="utf-8")
        enc = load_hf_tokenizer(folder)
        assert all(enc.encode(t) == ids for t, ids in HAND_CHECKED.items())
        assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT_ID]


def test_bad_files_raise(tmp_path):
    assert load_hf_tokenizer(tmp_path) is None                       # no tokenizer files: caller decides
    swapped = tokenizer_json()
    v = swapped["model"]["vocab"]
    v["Ġt"], v["he"] = v["he"], v["Ġt"]                              # ids no longer in merge order
    cases = [
        (swapped, "merge order"),
        ({**tokenizer_json(), "model": {"type": "Unigram", "vocab": []}}, "'Unigram' is not supported"),
        ({**tokenizer_json(), "model": {"type": "WordPiece", "vocab": {}}}, "'WordPiece' is not supported"),
        ({**tokenizer_json(), "normalizer": {"type": "NFC"}}, "normalizer"),
        (tokenizer_json(pre_tokenizer={"type": "Metaspace"}), "Metaspace"),
        ({"type": "nanollm-bpe", "ranks": []}, "nanollm.io.tokenizer"),
    ]
    unknown = tokenizer_json()
    unknown["model"]["merges"].append(["hello", "world"])
    cases.append((unknown, "not in the vocab"))
    for k, (tj, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            load_hf_tokenizer(write(tmp_path / str(k), tj))
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"\x0a\x00")
    with pytest.raises(ValueError, match="SentencePiece"):
        load_hf_tokenizer(tmp_path / "sp")


def test_tiktoken_gpt2_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))        # an empty cache
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="not cached"):
        tiktoken_gpt2()
    assert time.perf_counter() - start < 1.0


def test_agrees_with_hf_tokenizers_library(tmp_path):
    """If HF `tokenizers` is installed: train a small byte-level BPE with it and compare ids."""
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    text = open(__file__, encoding="utf-8").read() + " naïve café 東京 😀" * 5
    trainer = tk.trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    enc = load_hf_tokenizer(tmp_path)
    rng = random.Random(0)
    for _ in range(200):
        i = rng.randrange(len(text))
        sample = text[i:i + rng.randint(0, 80)]
        assert enc.encode(sample, allowed_special="all") == tok.encode(sample).ids, sample


def test_bytes_missing_from_the_vocab_rank_past_it_and_are_dropped(tmp_path):
    """Some real vocabs (SmolLM2's) lack a few single bytes: tiktoken still needs a rank for each, which goes
    past the vocab, and the tokenizer the project uses drops such ids, as Hugging Face's BPE does."""
    from nanollm.io.checkpoint import EncodingTokenizer
    tj = tokenizer_json()
    vocab = tj["model"]["vocab"]
    del vocab["Ċ"]                                     # the byte 0x0A (newline)
    vocab = {tok: i for i, tok in enumerate(sorted(vocab, key=vocab.get))}      # ids 0..261 again
    tj["model"]["vocab"] = vocab
    tj["added_tokens"][0]["id"] = vocab["<|endoftext|>"]
    enc = load_hf_tokenizer(write(tmp_path, tj))
    assert enc.encode("\n") == [len(vocab)]            # ranked right after the largest id
    tok = EncodingTokenizer(enc, vocab["<|endoftext|>"], vocab_size=len(vocab))
    assert tok.encode("hello\nthe") == tok.encode("hellothe") == [vocab["hello"], vocab["t"], vocab["he"]]


def test_an_empty_normalizer_sequence_is_no_normalizer(tmp_path):
    """transformers may write "no normalizer" as an empty Sequence: read as none; a non-empty one is refused."""
    plain = load_hf_tokenizer(write(tmp_path / "plain", tokenizer_json()))
    empty = load_hf_tokenizer(write(tmp_path / "empty", {**tokenizer_json(),
                                                         "normalizer": {"type": "Sequence", "normalizers": []}}))
    assert empty.encode("hello the world") == plain.encode("hello the world")
    with pytest.raises(ValueError, match="normalizer 'Sequence' is not supported"):
        load_hf_tokenizer(write(tmp_path / "nfc", {**tokenizer_json(), "normalizer": {
            "type": "Sequence", "normalizers": [{"type": "NFC"}]}}))
