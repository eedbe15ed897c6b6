"""
nanollm.io.gguf: a tiny GGUF writer (below) builds files byte by byte from the spec; metadata and tensors of
every supported type round-trip, quantized blocks written out by hand dequantize to hand-computed values,
llama.cpp's q/k row order is undone, a tiny Llama model survives a GGUF round trip with identical logits, the
tokenizer gives hand-derived ids, and malformed files (listed cases, every truncation, random byte edits and
huge lengths) raise GGUFError and nothing else.

The real-file tests read SmolLM2-135M-Instruct.Q4_1.gguf from the cache (``python -m nanollm.cli.fetch
smollm2-135m``) and are skipped, saying so, where it has not been fetched.
"""

from __future__ import annotations

import dataclasses
import random
import struct
import time
import tracemalloc
from collections import Counter

import numpy as np
import pytest
import regex
import torch

from nanollm import Transformer, generate
from nanollm.io.gguf import (
    SMOLLM_PATTERN,
    GGUFError,
    dequantize,
    encoding,
    hf_config,
    load_tensors,
    read_gguf,
    read_tensor,
    unpermute_qk,
)
from nanollm.io.hf import config_from_hf, state_from_hf, state_to_hf
from nanollm.io.hf_tokenizer import GPT2_PATTERN, bytes_to_unicode

# ----------------------------------------------------------------------------------------------------------
# A tiny GGUF writer, straight from the spec (see the docstring of nanollm/io/gguf.py)

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
          BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, BF16 = 0, 1, 2, 3, 8, 12, 30
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20), Q4_K: (256, 144)}


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(vtype: int, value) -> bytes:
    """The bytes of a value; an array's value is (element type, list of values)."""
    if vtype in SCALAR:
        return struct.pack(SCALAR[vtype], value)
    if vtype == STRING:
        return gguf_string(value)
    etype, items = value
    return struct.pack("<IQ", etype, len(items)) + b"".join(gguf_value(etype, v) for v in items)


def gguf_bytes(metadata=(), tensors=(), *, alignment: int = 32, version: int = 3, magic: bytes = b"GGUF",
               n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """A whole file. ``metadata``: (key, type, value) triples; ``tensors``: (name, ggml type, torch shape, raw
    bytes) or with a 5th item, an explicit data offset. Tensors are laid out in order, each aligned; no padding
    follows the last one, so every shorter prefix of the file is truncated."""
    out = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                              len(metadata) if n_kv is None else n_kv)
    for key, vtype, value in metadata:
        out += gguf_string(key) + struct.pack("<I", vtype) + gguf_value(vtype, value)
    offsets, end = [], 0
    for t in tensors:
        offset = t[4] if len(t) > 4 else end + (-end % alignment)
        offsets.append(offset)
        end = max(end, offset + len(t[3]))
    for (name, ggml_type, shape, *_), offset in zip(tensors, offsets):
        out += gguf_string(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", n) for n in reversed(shape))      # ne: fastest dim first
        out += struct.pack("<IQ", ggml_type, offset)
    out += bytes(-len(out) % alignment)
    data = bytearray(end)
    for t, offset in zip(tensors, offsets):
        data[offset:offset + len(t[3])] = t[3]
    return out + bytes(data)


def fp16(x: float) -> np.float32:
    return np.float32(np.float16(x))


def make_tensor(ggml_type: int, shape: tuple, rng: np.random.Generator) -> tuple[bytes, torch.Tensor]:
    """Random raw data of a type and the float32 values it stands for, block by block (plain loops, written
    independently of the library's vectorised code)."""
    n = int(np.prod(shape))
    if ggml_type in (F32, F16, BF16):
        x = rng.standard_normal(n).astype(np.float32)
        if ggml_type == F32:
            raw = x.tobytes()
        elif ggml_type == F16:
            x = x.astype(np.float16).astype(np.float32)
            raw = x.astype(np.float16).tobytes()
        else:                                          # bf16: the upper two bytes of a float32
            bits = x.view(np.uint32) & 0xFFFF0000
            x = bits.view(np.float32)
            raw = (bits >> 16).astype(np.uint16).tobytes()
        return raw, torch.from_numpy(x.copy()).reshape(shape)
    raw, values = b"", []
    for _ in range(n // 32):
        d, m = float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2))
        if ggml_type == Q8_0:
            q = rng.integers(-128, 128, 32)
            raw += struct.pack("<e", d) + struct.pack("<32b", *q)
            values += [fp16(d) * np.float32(v) for v in q]
            continue
        nib = rng.integers(0, 16, 32)
        packed = bytes(int(nib[j]) | int(nib[j + 16]) << 4 for j in range(16))
        if ggml_type == Q4_0:
            raw += struct.pack("<e", d) + packed
            values += [fp16(d) * np.float32(v - 8) for v in nib]
        else:                                          # Q4_1
            raw += struct.pack("<ee", d, m) + packed
            values += [fp16(d) * np.float32(v) + fp16(m) for v in nib]
    return raw, torch.tensor(np.array(values, dtype=np.float32)).reshape(shape)


def write(tmp_path, data: bytes, name: str = "x.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def read_everything(path):
    """What a user does with a file: the header, then every tensor's data."""
    g = read_gguf(path)
    return g, {name: read_tensor(g, name) for name in g.tensors}


# ----------------------------------------------------------------------------------------------------------
# Round trips

ALL_TYPES_METADATA = [
    ("t.uint8", UINT8, 255), ("t.int8", INT8, -128), ("t.uint16", UINT16, 65535), ("t.int16", INT16, -32768),
    ("t.uint32", UINT32, 2**32 - 1), ("t.int32", INT32, -(2**31)), ("t.float32", FLOAT32, 0.1),
    ("t.bool", BOOL, True), ("t.string", STRING, "héllo, 東京 😀"), ("t.empty", STRING, ""),
    ("t.uint64", UINT64, 2**64 - 1), ("t.int64", INT64, -(2**63)), ("t.float64", FLOAT64, 1e-300),
    ("t.ints", ARRAY, (INT32, [1, -2, 3])), ("t.floats", ARRAY, (FLOAT32, [0.5, -1.25])),
    ("t.bools", ARRAY, (BOOL, [True, False])), ("t.strings", ARRAY, (STRING, ["a", "", "Ġthe"])),
    ("t.nothing", ARRAY, (UINT64, [])), ("t.nested", ARRAY, (ARRAY, [(UINT8, [1, 2]), (STRING, ["x"])])),
]


def test_metadata_of_every_type_round_trips(tmp_path):
    g = read_gguf(write(tmp_path, gguf_bytes(ALL_TYPES_METADATA)))
    float32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]   # noqa: E731
    expected = {k: v[1] if vtype == ARRAY else v for k, vtype, v in ALL_TYPES_METADATA}
    expected["t.float32"], expected["t.nested"] = float32(0.1), [[1, 2], ["x"]]
    assert g.metadata == expected and list(g.metadata) == list(expected)
    assert type(g.metadata["t.bool"]) is bool and g.metadata["t.bools"] == [True, False]
    assert g.version == 3 and g.tensors == {} and g.alignment == 32


@pytest.mark.parametrize("ggml_type", [F32, F16, BF16, Q8_0, Q4_0, Q4_1])
@pytest.mark.parametrize("alignment", [32, 64])
def test_tensors_of_every_type_round_trip(tmp_path, ggml_type, alignment):
    rng = np.random.default_rng(ggml_type)
    shapes = {"matrix": (3, 64), "cube": (2, 2, 32), "vector": (96,)}
    made = {name: make_tensor(ggml_type, shape, rng) for name, shape in shapes.items()}
    tensors = [(name, ggml_type, shapes[name], raw) for name, (raw, _) in made.items()]
    metadata = [("general.alignment", UINT32, alignment)] if alignment != 32 else []
    g, got = read_everything(write(tmp_path, gguf_bytes(metadata, tensors, alignment=alignment)))
    assert g.alignment == alignment and g.data_start % alignment == 0 and list(g.tensors) == list(shapes)
    for name, (raw, want) in made.items():
        info = g.tensors[name]
        assert info.shape == shapes[name] and info.ggml_type == ggml_type and info.nbytes == len(raw)
        assert info.offset % alignment == 0
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name


# ----------------------------------------------------------------------------------------------------------
# Dequantization of hand-written blocks

def test_q8_0_block_by_hand():
    # d = 0.5 is fp16 0x3800 (little-endian bytes 00 38); q = -128, -1, 0, 1, ..., 29 (int8, two's complement)
    block = bytes([0x00, 0x38, 0x80, 0xFF] + list(range(30)))
    want = [-64.0, -0.5] + [0.5 * i for i in range(30)]
    assert dequantize(block, Q8_0, (32,)).tolist() == want


def test_q4_0_block_by_hand():
    # d = 2.0 is fp16 0x4000; byte j = 0x?? with low nibble j and high nibble 15 - j
    block = bytes([0x00, 0x40] + [j | (15 - j) << 4 for j in range(16)])
    # elements 0..15: the low nibbles 0..15, minus 8, times 2; elements 16..31: the high nibbles 15..0
    want = [-16.0, -14.0, -12.0, -10.0, -8.0, -6.0, -4.0, -2.0, 0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0,
            14.0, 12.0, 10.0, 8.0, 6.0, 4.0, 2.0, 0.0, -2.0, -4.0, -6.0, -8.0, -10.0, -12.0, -14.0, -16.0]
    assert dequantize(block, Q4_0, (32,)).tolist() == want


def test_q4_1_block_by_hand():
    # d = 0.25 (fp16 0x3400), m = -1.0 (fp16 0xBC00); bytes 0x10, 0x32, 0x54, ...: low nibbles 0, 2, 4, ...,
    # high nibbles 1, 3, 5, ... (wrapping at 16)
    qs = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
    block = bytes([0x00, 0x34, 0x00, 0xBC] + qs)
    low = [0, 2, 4, 6, 8, 10, 12, 14] * 2
    high = [1, 3, 5, 7, 9, 11, 13, 15] * 2
    want = [0.25 * n - 1.0 for n in low + high]
    assert dequantize(block, Q4_1, (32,)).tolist() == want
    assert want[:3] == [-1.0, -0.5, 0.0] and want[16:18] == [-0.75, -0.25]


def test_float_types_by_hand():
    assert dequantize(bytes([0x00, 0x3C, 0x00, 0xC0]), F16, (2,)).tolist() == [1.0, -2.0]      # fp16 1, -2
    assert dequantize(bytes([0x80, 0x3F, 0x40, 0xC0]), BF16, (2,)).tolist() == [1.0, -3.0]     # bf16 1, -3
    assert dequantize(struct.pack("<2f", 0.5, -7.0), F32, (1, 2)).tolist() == [[0.5, -7.0]]


def test_dequantize_takes_any_byte_buffer_and_checks_it():
    raw, want = make_tensor(Q4_1, (2, 64), np.random.default_rng(0))
    for buf in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8),
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)):
        assert torch.equal(dequantize(buf, Q4_1, (2, 64)), want)
    assert dequantize(b"", Q8_0, (0, 32)).shape == (0, 32)
    for args, message in [((raw[:-1], Q4_1, (2, 64)), "takes 80 bytes, got 79"),
                          ((raw, Q4_1, (4, 40)), "multiple of 32"),
                          ((raw, Q4_K, (1, 256)), "cannot be dequantized"), ((raw, 99, (2, 64)), "unknown"),
                          ((np.zeros(4, np.float32), F32, (4,)), "raw bytes")]:
        with pytest.raises(GGUFError, match=message):
            dequantize(*args)


# ----------------------------------------------------------------------------------------------------------
# llama.cpp's q/k row order

def converter_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to q_proj / k_proj, spelled out row by row: within each head of d rows,
    Hugging Face row s * d/2 + j (rotary half s, index j) moves to row 2j + s."""
    d = w.shape[0] // n_head
    out = torch.empty_like(w)
    for h in range(n_head):
        for j in range(d // 2):
            for s in range(2):
                out[h * d + 2 * j + s] = w[h * d + s * d // 2 + j]
    return out


def test_unpermute_on_labelled_rows():
    rows = torch.arange(8.0)[:, None]                       # each row holds its Hugging Face index
    gguf = converter_permute(rows, n_head=2)                # 2 heads of 4 rows: halves (0, 1 | 2, 3)
    assert gguf[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # pairs (0, 2), (1, 3) side by side
    assert converter_permute(torch.arange(6.0)[:, None], 1)[:, 0].tolist() == [0, 3, 1, 4, 2, 5]
    assert unpermute_qk(gguf, 2)[:, 0].tolist() == list(range(8))
    assert unpermute_qk(torch.tensor([[0.0], [3.0], [1.0], [4.0], [2.0], [5.0]]), 1)[:, 0].tolist() == list(range(6))


@pytest.mark.parametrize("n_head, d, cols", [(1, 2, 3), (3, 8, 5), (9, 64, 4), (2, 6, 1)])
def test_unpermute_inverts_the_converter(n_head, d, cols):
    w = torch.randn(n_head * d, cols, generator=torch.Generator().manual_seed(d))
    assert torch.equal(unpermute_qk(converter_permute(w, n_head), n_head), w)
    assert torch.equal(converter_permute(unpermute_qk(w, n_head), n_head), w)
    with pytest.raises(ValueError, match="heads"):
        unpermute_qk(torch.zeros(n_head * d + 1, cols), n_head)


def test_permuted_rows_with_pairwise_rope_equal_hf_rows_with_rotate_half():
    """Why the converter permutes: llama.cpp rotates adjacent pairs (2j, 2j + 1), Hugging Face rotates j with
    j + d/2, both at angle pos * base^(-2j/d). Rotating converter-permuted rows pairwise gives the permuted
    result of rotate_half, so attention scores agree."""
    n_head, d, base = 2, 8, 10000.0
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(n_head * d, dtype=torch.float64, generator=g), torch.randn(n_head * d, dtype=torch.float64,
                                                                                   generator=g)
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)                # (d/2,)

    def rotate_half(x, pos):                               # x (n_head * d,)
        x = x.view(n_head, d)
        a, b = x[:, :d // 2], x[:, d // 2:]
        c, s = torch.cos(pos * inv), torch.sin(pos * inv)
        return torch.cat([a * c - b * s, a * s + b * c], dim=1).reshape(-1)

    def rotate_pairs(x, pos):
        x = x.view(n_head, d // 2, 2)
        a, b = x[..., 0], x[..., 1]
        c, s = torch.cos(pos * inv), torch.sin(pos * inv)
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(-1)

    for pos in (0, 1, 7, 100):
        hf = rotate_half(q, pos)
        assert torch.allclose(rotate_pairs(converter_permute(q[:, None], n_head)[:, 0], pos),
                              converter_permute(hf[:, None], n_head)[:, 0])
        score_hf = (hf.view(n_head, d) * rotate_half(k, 3).view(n_head, d)).sum(-1)
        score_gguf = (rotate_pairs(converter_permute(q[:, None], n_head)[:, 0], pos).view(n_head, d)
                      * rotate_pairs(converter_permute(k[:, None], n_head)[:, 0], 3).view(n_head, d)).sum(-1)
        assert torch.allclose(score_hf, score_gguf)


# ----------------------------------------------------------------------------------------------------------
# A tiny Llama through GGUF and back

HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER_HF_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def llama_gguf(model: Transformer, extra_metadata=()) -> bytes:
    """A model written the way llama.cpp's converter writes a Hugging Face Llama (q/k rows permuted), in F32."""
    c = model.config
    tensors = []
    for name, w in state_to_hf(model).items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            if module in ("self_attn.q_proj", "self_attn.k_proj"):
                w = converter_permute(w, c.n_head if module == "self_attn.q_proj" else c.n_kv_head)
            gguf_name = f"blk.{i}.{LAYER_HF_TO_GGUF[module]}.weight"
        else:
            gguf_name = HF_TO_GGUF[name]
        tensors.append((gguf_name, F32, tuple(w.shape), w.detach().float().contiguous().numpy().tobytes()))
    metadata = [("general.architecture", STRING, "llama"), ("llama.block_count", UINT32, c.n_layer),
                ("llama.context_length", UINT32, c.max_seq_len), ("llama.embedding_length", UINT32, c.d_model),
                ("llama.feed_forward_length", UINT32, c.d_ff), ("llama.attention.head_count", UINT32, c.n_head),
                ("llama.attention.head_count_kv", UINT32, c.n_kv_head),
                ("llama.rope.freq_base", FLOAT32, c.rope_base),
                ("llama.attention.layer_norm_rms_epsilon", FLOAT32, c.norm_eps),
                ("llama.rope.dimension_count", UINT32, c.head_dim), *extra_metadata]
    return gguf_bytes(metadata, tensors)


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_round_trip_gives_identical_logits(tmp_path, tiny_cfg, make_model, tied):
    model = make_model(dataclasses.replace(tiny_cfg, tie_embeddings=tied), seed=1)
    g = read_gguf(write(tmp_path, llama_gguf(model)))
    cfg = hf_config(g)
    assert cfg["tie_word_embeddings"] == tied and cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 1e4
    config = config_from_hf(cfg)
    for f in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len", "rope_base",
              "norm_eps", "tie_embeddings", "head_dim"):
        assert getattr(config, f) == getattr(model.config, f), f
    sd = load_tensors(g)
    assert ("lm_head.weight" in sd) != tied
    assert torch.equal(sd["model.layers.1.self_attn.k_proj.weight"], model.blocks[1].attn.k_proj.weight)
    again = Transformer(config)
    again.load_state_dict(state_from_hf(sd, config))
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again.eval()(ids), model(ids))


def test_llama_errors(tmp_path, tiny_model):
    cases = {
        "not llama": (llama_gguf(tiny_model).replace(gguf_string("llama") + gguf_string("llama.block_count"),
                                                     gguf_string("gpt2!") + gguf_string("llama.block_count")),
                      "only 'llama'"),
        "rope scaling": (llama_gguf(tiny_model, [("llama.rope.scaling.type", STRING, "yarn")]), "RoPE scaling"),
        "partial rope": (llama_gguf(tiny_model, [("llama.attention.key_length", UINT32, 8)]), "key_length"),
    }
    for name, (data, message) in cases.items():
        g = read_gguf(write(tmp_path, data, name + ".gguf"))
        with pytest.raises(GGUFError, match=message):
            hf_config(g)
    g = read_gguf(write(tmp_path, gguf_bytes([("general.architecture", STRING, "llama")]), "bare.gguf"))
    with pytest.raises(GGUFError, match="lacks 'llama.attention.head_count'"):
        hf_config(g)
    extra = gguf_bytes([("general.architecture", STRING, "llama"), ("llama.attention.head_count", UINT32, 1)],
                       [("rope_freqs.weight", F32, (4,), bytes(16))])
    with pytest.raises(GGUFError, match="rope_freqs"):
        load_tensors(read_gguf(write(tmp_path, extra, "extra.gguf")))


# ----------------------------------------------------------------------------------------------------------
# The tokenizer

B2U = bytes_to_unicode()
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("1", "2")]


def tokenizer_metadata(pre: str = "gpt-2", model: str = "gpt2", drop_byte: int = 4) -> tuple[list, dict[str, int]]:
    """Metadata of a tiny byte-level BPE laid out as Hugging Face trains them: control tokens, the single
    bytes (one left out), one token per merge, then an unused token. Returns (metadata, {token: id})."""
    tokens = ["<|endoftext|>", "<|im_start|>"] + sorted(c for b, c in B2U.items() if b != drop_byte)
    tokens += [a + b for a, b in MERGES] + ["zzz"]
    types = [3, 3] + [1] * (len(tokens) - 3) + [5]          # control, normal, unused
    metadata = [("tokenizer.ggml.model", STRING, model), ("tokenizer.ggml.pre", STRING, pre),
                ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
                ("tokenizer.ggml.token_type", ARRAY, (INT32, types)),
                ("tokenizer.ggml.merges", ARRAY, (STRING, [f"{a} {b}" for a, b in MERGES]))]
    return metadata, {t: i for i, t in enumerate(tokens)}


def test_tokenizer_gives_hand_derived_ids(tmp_path):
    metadata, ids = tokenizer_metadata()
    enc = encoding(read_gguf(write(tmp_path, gguf_bytes(metadata))))
    # " hello the": chunks " hello", " the"; Ġ h e l l o -> Ġ [he] l l o -> Ġ [he] [ll] o -> Ġ [hell] o
    # -> Ġ [hello] ((Ġ, hello) is no merge); Ġ t h e -> [Ġt] h e -> [Ġt] [he] -> [Ġthe]
    assert enc.encode(" hello the") == [ids["Ġ"], ids["hello"], ids["Ġthe"]]
    assert enc.encode("a12") == [ids["a"], ids["12"]]                       # gpt-2: digits stay together
    assert enc.encode("<|im_start|>hi", allowed_special="all") == [1, ids["h"], ids["i"]]
    assert enc.encode("zzz") == [ids["z"]] * 3                             # the unused token is never made
    assert enc.encode("\x04") == [len(ids)]                                # the missing byte: past the vocab
    assert enc.decode(enc.encode("\x04 hello")) == "\x04 hello"
    smollm = encoding(read_gguf(write(tmp_path, gguf_bytes(tokenizer_metadata("smollm")[0]), "s.gguf")))
    assert smollm.encode("a12") == [ids["a"], ids["1"], ids["2"]]          # smollm: every digit alone
    assert smollm.encode(" hello the") == enc.encode(" hello the")


def test_tokenizer_errors(tmp_path):
    metadata, _ = tokenizer_metadata()
    swapped = [m if m[0] != "tokenizer.ggml.merges" else (m[0], ARRAY, (STRING, ["h e", "Ġ t"])) for m in metadata]
    for k, (data, message) in enumerate([
            (gguf_bytes(tokenizer_metadata(model="llama")[0]), "'llama' is not supported"),
            (gguf_bytes(tokenizer_metadata(pre="qwen2")[0]), "'qwen2' is not supported"),
            (gguf_bytes(metadata[:2]), "must be a list of strings"),
            (gguf_bytes(swapped), "merge order")]):
        with pytest.raises(GGUFError, match=message):
            encoding(read_gguf(write(tmp_path, data, f"{k}.gguf")))


def split_digits_then_gpt2(text: str) -> list[str]:
    """Hugging Face's Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)], in two steps."""
    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    return [c for p in pieces for c in ([p] if regex.fullmatch(r"\p{N}", p) else regex.findall(GPT2_PATTERN, p))]


def test_smollm_pattern_equals_digits_then_gpt2_split():
    tricky = ["  1", "a  1b", "x\n\n2", "'s1", "1's", " 12 345  ", "٣ ٤", "a1 b", "\t 7", "hi!!1?", "  "]
    rng = random.Random(0)
    alphabet = ["a", "Z", " ", "  ", "\n", "\t", "1", "2", "٣", "'s", "'", "é", "東", ".", "!", "😀", "’"]
    samples = tricky + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16))) for _ in range(2000)]
    for text in samples:
        assert regex.findall(SMOLLM_PATTERN, text) == split_digits_then_gpt2(text), repr(text)


# ----------------------------------------------------------------------------------------------------------
# Malformed files

def small_file() -> bytes:
    """A small valid file: a few metadata types, three tensors of three types."""
    rng = np.random.default_rng(0)
    return gguf_bytes(
        [("general.architecture", STRING, "llama"), ("a.u32", UINT32, 7), ("a.f32", FLOAT32, 1.5),
         ("a.list", ARRAY, (STRING, ["x", "yz"])), ("a.bools", ARRAY, (BOOL, [True])), ("a.flag", BOOL, False)],
        [("w", F32, (2, 3), make_tensor(F32, (2, 3), rng)[0]), ("q", Q8_0, (1, 32), make_tensor(Q8_0, (1, 32), rng)[0]),
         ("r", Q4_1, (2, 32), make_tensor(Q4_1, (2, 32), rng)[0])])


HEAD = b"GGUF" + struct.pack("<I", 3)


def header(n_tensors: int, n_kv: int) -> bytes:
    return HEAD + struct.pack("<QQ", n_tensors, n_kv)


def nested(depth: int) -> bytes:
    return struct.pack("<IQ", ARRAY, 1) + nested(depth - 1) if depth else struct.pack("<IQ", UINT8, 0)


PAD = bytes(64)          # enough bytes after a header for the count checks to pass
F32_4 = ("w", F32, (4,), bytes(16))
MALFORMED = {
    "empty": (lambda: b"", "too short"),
    "short": (lambda: b"GGUF\x03\x00\x00", "too short"),
    "bad magic": (lambda: gguf_bytes(magic=b"GGML") + PAD, "not a GGUF file"),
    "version 1": (lambda: gguf_bytes(version=1) + PAD, "version 1 is not supported .obsolete"),
    "version 4": (lambda: gguf_bytes(version=4) + PAD, "version 4 is not supported .unknown"),
    "big-endian": (lambda: gguf_bytes(version=3 << 24) + PAD, "big-endian"),
    "truncated metadata": (lambda: small_file()[:60], "truncated"),
    "huge key length": (lambda: header(0, 1) + struct.pack("<Q", 2**64 - 1) + PAD, "truncated"),
    "huge string": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<IQ", STRING, 2**63) + PAD, "truncated"),
    "huge number array": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<IIQ", ARRAY, FLOAT64, 2**61) + PAD,
                          "claims 2305843009213693952 elements"),
    "huge string array": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<IIQ", ARRAY, STRING, 2**60) + PAD,
                          "claims 1152921504606846976 elements"),
    "long number array": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<IIQ", ARRAY, FLOAT64, 1000) + PAD,
                          "truncated file: metadata 'k' .1000 x float64. needs 8000 bytes"),
    "long string array": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<IIQ", ARRAY, STRING, 1000) + PAD,
                          "more than the 64 bytes left"),
    "huge metadata count": (lambda: header(0, 2**63) + PAD, "cannot fit"),
    "huge tensor count": (lambda: header(2**64 - 1, 0) + PAD, "cannot fit"),
    "unknown value type": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<I", 13) + PAD, "unknown value type"),
    "unknown element type": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<IIQ", ARRAY, 99, 1) + PAD,
                             "unknown element type 99"),
    "deep arrays": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<I", ARRAY) + nested(20) + PAD, "deep"),
    "bad bool": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<IB", BOOL, 2) + PAD, "0 or 1"),
    "bad bool array": (lambda: header(0, 1) + gguf_string("k") + struct.pack("<IIQB", ARRAY, BOOL, 1, 7) + PAD,
                       "0 or 1"),
    "bad utf-8": (lambda: header(0, 1) + gguf_string(b"\xff\xfe") + struct.pack("<IB", UINT8, 0) + PAD, "UTF-8"),
    "duplicate key": (lambda: gguf_bytes([("k", UINT8, 1), ("k", UINT8, 2)]) + PAD, "appears twice"),
    "alignment 24": (lambda: gguf_bytes([("general.alignment", UINT32, 24)]) + PAD, "power of two"),
    "alignment 0": (lambda: gguf_bytes([("general.alignment", UINT32, 0)]) + PAD, "power of two"),
    "alignment str": (lambda: gguf_bytes([("general.alignment", STRING, "32")]) + PAD, "power of two"),
    "no dims": (lambda: gguf_bytes([], [("w", F32, (), bytes(4))]), "0 dims"),
    "5 dims": (lambda: gguf_bytes([], [("w", F32, (1, 1, 1, 1, 4), bytes(16))]), "5 dims"),
    "unknown tensor type": (lambda: gguf_bytes([], [("w", 99, (4,), bytes(16))]), "unknown ggml type 99"),
    "partial block": (lambda: gguf_bytes([], [("w", Q8_0, (16,), bytes(17))]), "multiple of its block size 32"),
    "misaligned": (lambda: gguf_bytes([], [("w", F32, (4,), bytes(16), 8)]), "not a multiple of the alignment"),
    "past the end": (lambda: gguf_bytes([], [("w", F32, (8,), bytes(16))]), "spans bytes"),
    "huge dims": (lambda: gguf_bytes([], [("w", F32, (2**63, 2**63), bytes(16))]), "spans bytes"),
    "overlap": (lambda: gguf_bytes([], [F32_4, ("v", F32, (8,), bytes(32), 0)]), "overlaps"),
    "duplicate tensor": (lambda: gguf_bytes([], [F32_4, F32_4]), "appears twice"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_raise_one_line_errors(tmp_path, case):
    make, message = MALFORMED[case]
    path = write(tmp_path, make())
    with pytest.raises(GGUFError, match=message) as e:
        read_everything(path)
    assert isinstance(e.value, ValueError)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_unsupported_tensor_type_is_listed_but_not_read(tmp_path):
    g = read_gguf(write(tmp_path, gguf_bytes([], [("k", Q4_K, (2, 256), bytes(288))])))
    assert g.tensors["k"].type_name == "Q4_K" and g.tensors["k"].nbytes == 288
    with pytest.raises(GGUFError, match="Q4_K cannot be dequantized"):
        read_tensor(g, "k")


def test_every_truncation_raises(tmp_path):
    good = small_file()
    read_everything(write(tmp_path, good))                     # the whole file is fine
    path = tmp_path / "cut.gguf"
    for n in range(len(good)):
        path.write_bytes(good[:n])
        with pytest.raises(GGUFError):
            read_everything(path)


def test_fuzz_only_raises_gguf_error(tmp_path):
    """Random byte edits, anywhere, and huge uint64s written over random spots (lengths, counts, dims,
    offsets): each file loads cleanly or raises GGUFError, quickly and without allocating much."""
    good = small_file()
    rng = random.Random(0)
    path = tmp_path / "fuzz.gguf"
    outcomes = Counter()
    tracemalloc.start()
    start = time.perf_counter()
    for k in range(1200):
        data = bytearray(good)
        if k % 2:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            at = rng.randrange(len(data) - 8)
            data[at:at + 8] = struct.pack("<Q", rng.choice([2**64 - 1, 2**63, 2**40, 2**32 + 1,
                                                            rng.randrange(2**64)]))
        path.write_bytes(bytes(data))
        try:
            read_everything(path)
            outcomes["ok"] += 1
        except GGUFError:
            outcomes["error"] += 1
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert outcomes["error"] > 600 and outcomes["ok"] > 50, outcomes
    assert peak < 20e6, f"peak traced memory {peak / 1e6:.1f} MB"
    assert time.perf_counter() - start < 15


# ----------------------------------------------------------------------------------------------------------
# The real file: SmolLM2-135M-Instruct, Q4_1

@pytest.fixture(scope="module")
def smollm2(smollm2_file):
    return read_gguf(smollm2_file)


@pytest.fixture(scope="module")
def smollm2_model(smollm2):
    config = config_from_hf(hf_config(smollm2))
    model = Transformer(config)
    model.load_state_dict(state_from_hf(load_tensors(smollm2), config))
    return model.eval()


@pytest.mark.slow
def test_real_file_header(smollm2):
    g = smollm2
    assert g.version == 3 and g.alignment == 32 and len(g.tensors) == 272
    assert Counter(t.type_name for t in g.tensors.values()) == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert g.tensors["token_embd.weight"].type_name == "Q8_0"
    assert g.tensors["token_embd.weight"].shape == (49152, 576)
    assert g.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert {int(n.split(".")[1]) for n in g.tensors if n.startswith("blk.")} == set(range(30))
    assert "output.weight" not in g.tensors
    assert g.metadata["tokenizer.ggml.model"] == "gpt2" and g.metadata["tokenizer.ggml.pre"] == "smollm"


@pytest.mark.slow
def test_real_file_config(smollm2):
    cfg = hf_config(smollm2)
    assert {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id",
                                "eos_token_id")} == {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 1e5,
        "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2}
    c = config_from_hf(cfg)
    assert (c.n_layer, c.d_model, c.d_ff, c.n_head, c.n_kv_head, c.head_dim) == (30, 576, 1536, 9, 3, 64)


def reference_bpe(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """Hugging Face's pipeline in plain Python: split digits, then GPT-2's regex, then merge the pair that
    comes first in the merge list until none applies."""
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    out = []
    for chunk in split_digits_then_gpt2(text):
        parts = [B2U[b] for b in chunk.encode("utf-8")]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: rank.get((parts[i], parts[i + 1]), float("inf")))
            if (parts[best], parts[best + 1]) not in rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        out += [vocab[p] for p in parts]
    return out


@pytest.mark.slow
def test_real_file_tokenizer(smollm2):
    enc = encoding(smollm2)
    tokens, merges = smollm2.metadata["tokenizer.ggml.tokens"], smollm2.metadata["tokenizer.ggml.merges"]
    assert enc.encode("<|endoftext|><|im_start|><|im_end|>", allowed_special="all") == [0, 1, 2]
    texts = ["The capital of France is", "It's 2024: 1,234.56 apples, don't they'll?  Two  spaces\n\n\tand tabs",
             "naïve café — 東京 😀 ünïcödé", "def f(x):\n    return x ** 2  # comment\n", "   leading and trailing   ",
             open(__file__, encoding="utf-8").read()[:3000]]
    for text in texts:
        ids = enc.encode(text)
        assert ids == reference_bpe(text, tokens, merges), text[:40]
        assert enc.decode(ids) == text and max(ids) < 49152
    missing = [b for b in range(256) if B2U[b] not in set(tokens)]
    assert len(missing) == 21 and enc.encode("\x04") == [49152] and enc.decode([49152]) == "\x04"


@pytest.mark.slow
def test_real_model_knows_the_capital_of_france(smollm2, smollm2_model):
    enc = encoding(smollm2)
    ids = torch.tensor([enc.encode("The capital of France is")])
    new = generate(smollm2_model, ids, max_new_tokens=4)[0].tolist()
    assert " Paris" in [enc.decode([t]) for t in new], enc.decode(new)
