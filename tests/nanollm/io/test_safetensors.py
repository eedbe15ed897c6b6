"""
nanollm.io.safetensors: byte-exact writer, reader vs a hand-built file, round trips, shards, pytorch_model.bin,
and malformed files (including a seeded fuzz loop) that must raise SafetensorsError and nothing else.
"""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch

from nanollm.io.safetensors import (
    SafetensorsError,
    load_file,
    load_sharded,
    load_torch_bin,
    read_header,
    save_file,
    serialize,
)


def hand_built() -> tuple[bytes, dict[str, torch.Tensor]]:
    """A file written byte by byte from the format spec, and the tensors it holds.

    Data order is the official library's: widest dtype first (I64, then F32, then BF16 before F16), then name.
    BF16 is the upper half of the float32 bit pattern (values chosen to be exact in bf16).
    """
    header = {
        "__metadata__": {"format": "pt"},
        "d": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
        "c": {"dtype": "BF16", "shape": [3], "data_offsets": [24, 30]},
        "b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [30, 38]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data = struct.pack("<2q", -7, 2**40)
    data += struct.pack("<2f", 1.0, -2.5)
    data += b"".join(struct.pack("<f", x)[2:] for x in (0.5, -3.0, 256.0))
    data += struct.pack("<4e", 0.25, -1.0, 1024.0, 0.0)
    tensors = {
        "a": torch.tensor([1.0, -2.5]),
        "b": torch.tensor([[0.25, -1.0], [1024.0, 0.0]], dtype=torch.float16),
        "c": torch.tensor([0.5, -3.0, 256.0], dtype=torch.bfloat16),
        "d": torch.tensor([-7, 2**40]),
    }
    return struct.pack("<Q", len(raw)) + raw + data, tensors


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def test_writer_matches_hand_built_bytes(tmp_path):
    expected, tensors = hand_built()
    assert serialize(tensors, {"format": "pt"}) == expected
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "x.safetensors").read_bytes() == expected


def test_reader_matches_hand_built_tensors(tmp_path):
    data, tensors = hand_built()
    (tmp_path / "x.safetensors").write_bytes(data)
    header, metadata, start = read_header(tmp_path / "x.safetensors")
    assert metadata == {"format": "pt"} and start % 8 == 0 and list(header) == ["d", "a", "c", "b"]
    assert_same(load_file(tmp_path / "x.safetensors"), tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int64, torch.int32, torch.uint8, torch.bool])
def test_round_trip(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {"matrix": torch.randn(5, 3, generator=g), "scalar": torch.randn((), generator=g),
               "empty": torch.zeros(0, 4), "vector.é": torch.randn(7, generator=g) * 100}
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, tmp_path / "x.safetensors")
    assert_same(load_file(tmp_path / "x.safetensors"), tensors)


def test_official_library_agrees(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    _, tensors = hand_built()
    tensors["e"] = torch.arange(6, dtype=torch.int16).view(2, 3)
    tensors["f"] = torch.tensor([True, False])
    # one metadata key: the library writes several in (random) hash-map order, we sort them
    assert serialize(tensors, {"format": "pt"}) == st.save(tensors, metadata={"format": "pt"})
    save_file(tensors, tmp_path / "x.safetensors")
    assert_same(st.load_file(str(tmp_path / "x.safetensors")), tensors)


def test_sharded_index(tmp_path):
    _, tensors = hand_built()
    save_file({"a": tensors["a"], "b": tensors["b"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"c": tensors["c"], "d": tensors["d"]}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors", "d": "model-00002-of-00002.safetensors"}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 38}, "weight_map": weight_map}))
    assert_same(load_sharded(index), tensors)

    for bad_map, message in [({**weight_map, "z": "model-00001-of-00002.safetensors"}, "not in its shard"),
                             ({"a": "missing.safetensors"}, "missing"),
                             ({"a": "../model-00001-of-00002.safetensors"}, "same folder")]:
        index.write_text(json.dumps({"weight_map": bad_map}))
        with pytest.raises(SafetensorsError, match=message):
            load_sharded(index)
    index.write_text("{not json")
    with pytest.raises(SafetensorsError):
        load_sharded(index)


class NotATensor:
    pass


def test_pytorch_model_bin(tmp_path):
    _, tensors = hand_built()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    assert_same(load_torch_bin(tmp_path / "pytorch_model.bin"), tensors)
    torch.save({"x": NotATensor()}, tmp_path / "evil.bin")       # weights_only refuses arbitrary classes
    with pytest.raises(SafetensorsError, match="weights-only"):
        load_torch_bin(tmp_path / "evil.bin")
    (tmp_path / "junk.bin").write_bytes(b"not a pickle")
    with pytest.raises(SafetensorsError):
        load_torch_bin(tmp_path / "junk.bin")


def with_header(edit) -> bytes:
    """The hand-built file with its header dict passed through ``edit`` (data unchanged)."""
    data, _ = hand_built()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


MALFORMED = {
    "too short": lambda: b"\x01\x02",
    "header past end": lambda: struct.pack("<Q", 1000) + b"{}",
    "huge header": lambda: struct.pack("<Q", 2**63) + b"{}",
    "truncated data": lambda: hand_built()[0][:-3],
    "trailing data": lambda: hand_built()[0] + b"\0" * 8,
    "bad json": lambda: struct.pack("<Q", 5) + b"{abc}",
    "not utf8": lambda: struct.pack("<Q", 4) + b"\xff\xfe{}",
    "not a dict": lambda: struct.pack("<Q", 2) + b"[]",
    "unknown dtype": lambda: with_header(lambda h: h["a"].update(dtype="F128")),
    "out of range": lambda: with_header(lambda h: h["b"].update(data_offsets=[30, 99])),
    "wrong length": lambda: with_header(lambda h: h["a"].update(shape=[3])),
    "overlap": lambda: with_header(lambda h: h["c"].update(data_offsets=[20, 26])),
    "negative shape": lambda: with_header(lambda h: h["a"].update(shape=[-2])),
    "bool offsets": lambda: with_header(lambda h: h["a"].update(data_offsets=[True, 8])),
    "extra field": lambda: with_header(lambda h: h["a"].update(note="hi")),
    "bad metadata": lambda: with_header(lambda h: h.update(__metadata__={"format": 1})),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_raise(tmp_path, case):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(MALFORMED[case]())
    with pytest.raises(SafetensorsError):
        load_file(path)


def test_duplicate_keys_raise(tmp_path):
    raw = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    (tmp_path / "dup.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0")
    with pytest.raises(SafetensorsError, match="duplicate"):
        load_file(tmp_path / "dup.safetensors")


def test_fuzz_only_raises_safetensors_error(tmp_path):
    """Random header byte edits, header lengths and truncations: a valid load or SafetensorsError, nothing else."""
    good, _ = hand_built()
    n = struct.unpack("<Q", good[:8])[0]
    rng = random.Random(0)
    path = tmp_path / "fuzz.safetensors"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        data = bytearray(good)
        kind = rng.choice(["flip", "flip", "length", "truncate"])
        if kind == "flip":                     # corrupt 1-4 bytes of the length prefix or JSON header
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(8 + n)] = rng.randrange(256)
        elif kind == "length":
            data[:8] = struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, n + 8, rng.randrange(2**64)]))
        else:
            data = data[:rng.randrange(len(data))]
        path.write_bytes(bytes(data))
        try:
            load_file(path)
            outcomes["ok"] += 1
        except SafetensorsError:
            outcomes["error"] += 1
    assert outcomes["error"] > 200            # nearly every corruption is caught, the rest load cleanly
