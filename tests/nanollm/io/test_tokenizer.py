"""The BPE trainer, tiktoken encoding built from its ranks, and the pure-Python reference encoder."""

import pytest

from nanollm.data.tasks import corpus
from nanollm.io.tokenizer import EOT, Tokenizer, encode_python, train_bpe


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(corpus(60_000, seed=1), vocab_size=400)


def test_wikipedia_bpe_example():
    """'aaabdaaabac' (the Wikipedia BPE example, one regex chunk):
    merge 1: (a,a) occurs 4 times -> 256 'aa'; text becomes [aa a b d aa a b a c]
    merge 2: (aa,a)? no: pairs are (aa,a):2, (a,b):2 ... a tie, and the pair smallest by id wins -> 257 'ab'
    merge 3: (aa,ab) occurs 2 times -> 258 'aaab'; text = [258, d, 258, a, c]."""
    ranks = train_bpe("aaabdaaabac", vocab_size=259)
    inv = {r: b for b, r in ranks.items()}
    assert inv[256] == b"aa" and inv[257] == b"ab" and inv[258] == b"aaab"
    tok = Tokenizer(ranks)
    assert tok.encode("aaabdaaabac") == [258, ord("d"), 258, ord("a"), ord("c")]


def test_round_trip(tok):
    for text in ["The special magic number for calm-otter is: 4821733.", "VAR ABCDE = VAR FGHIJ.\n\n",
                 "  spaces   and\ttabs\n", "unicode: café, 東京, emoji 🙂", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_digits_are_single_tokens(tok):
    ids = tok.encode(" 4821733")
    assert [tok.decode([i]) for i in ids] == [" ", "4", "8", "2", "1", "7", "3", "3"]


def test_python_encoder_matches_tiktoken(tok):
    text = corpus(5_000, seed=7) + " café 🙂 ĳ"
    assert encode_python(text, tok.ranks, tok.pattern) == tok.encode(text)


def test_special_token_and_vocab_size(tok):
    assert tok.vocab_size == 400 and tok.eot_id == 399
    assert tok.encode("a" + EOT) == tok.encode("a") + [399]


def test_save_load(tok, tmp_path):
    tok.save(tmp_path / "t.json")
    tok2 = Tokenizer.load(tmp_path / "t.json")
    assert tok2.ranks == tok.ranks and tok2.encode("hello world 123") == tok.encode("hello world 123")


def test_corrupt_tokenizer_file(tmp_path):
    (tmp_path / "bad.json").write_text('{"ranks": [["YQ==", 5]], "pattern": "x"}')
    with pytest.raises(ValueError, match="corrupt"):
        Tokenizer.load(tmp_path / "bad.json")
    (tmp_path / "trunc.json").write_text('{"ranks": [["YQ==", ')
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        Tokenizer.load(tmp_path / "trunc.json")


def test_vocab_too_small():
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe("abc", vocab_size=100)
