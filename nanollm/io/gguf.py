"""
Reading GGUF files, llama.cpp's one-file model format, written from scratch: the header and metadata, the
tensor table, dequantization (F32, F16, BF16, Q8_0, Q4_0, Q4_1) and the byte-level BPE tokenizer.

Follows the GGUF specification (``docs/gguf.md`` in the ggml repository) and the quantized block structs of
ggml's ``ggml-common.h``. Llama tensors get Hugging Face names, with llama.cpp's q/k row order undone
(:func:`unpermute_qk`); the "smollm" pre-tokenizer (:data:`SMOLLM_PATTERN`) splits off every digit before
GPT-2's regex. Everything wrong with a file raises :class:`GGUFError`, a ``ValueError`` naming the file.

    gguf = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")      # header only; tensor data stays on disk
    config = config_from_hf(hf_config(gguf))                  # nanollm.io.hf
    state = state_from_hf(load_tensors(gguf), config)         # float32, Hugging Face layout
    enc = encoding(gguf)                                       # tiktoken.Encoding

Details (the byte layout, the blocks, the names, the RoPE rows, the tokenizer, the checks): nanollm/inside.md,
section "io/gguf.py: reading a GGUF file".
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field

import numpy as np
import tiktoken
import torch
from torch import Tensor

from ..checks import check_finite_weights, is_int
from .files import open_data_file
from .hf_tokenizer import GPT2_PATTERN, _encoding, mergeable_ranks

if sys.byteorder != "little":      # the data is little-endian; we reinterpret its bytes without swapping
    raise ImportError("nanollm.io.gguf assumes a little-endian machine")


class GGUFError(ValueError):
    """A GGUF file is truncated, malformed, or holds something this reader does not support."""


MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                # ggml tensors have at most 4 dims
MAX_ARRAY_NESTING = 8       # arrays of arrays of ...: deeper than this is a corrupt file, not a model
# Longest metadata array we accept. Vocabularies (the longest arrays in real files) have up to ~260k tokens;
# a corrupt count below the file's size could otherwise turn every byte into a Python object (8x the memory).
MAX_ARRAY_LENGTH = 1 << 22

# Metadata value types, their names, and the struct / numpy format of the fixed-size ones
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
                  FLOAT32: "<f", BOOL: "<B", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
VALUE_TYPE_NAMES = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string",
                    "array", "uint64", "int64", "float64"]

# ggml tensor types: number -> (name, values per block, bytes per block), from ggml's block structs.
# Only those in _DEQUANTIZE (below) can be turned into floats; the others can be listed, not read.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
}
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30

# tokenizer.ggml.token_type values (llama.cpp's token attributes)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> the tiktoken split regex (see the module docstring for the "smollm" one)
SMOLLM_PATTERN = r"""\p{N}|'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
PRE_TOKENIZERS = {"gpt-2": GPT2_PATTERN, "smollm": SMOLLM_PATTERN}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor info of the header."""
    name: str
    shape: tuple[int, ...]      # torch order (slowest dim first): the file's ne reversed
    ggml_type: int              # a key of GGML_TYPES
    offset: int                 # from the start of the data section (GGUF.data_start)
    nbytes: int                 # bytes of data: numel / block size * block bytes

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


@dataclass
class GGUF:
    """A parsed, validated header; the tensor data stays in the file until read."""
    path: str
    version: int
    metadata: dict = field(repr=False)          # key -> value (int, float, bool, str, or a list of them)
    tensors: dict[str, TensorInfo] = field(repr=False)     # by name, in file order
    alignment: int
    data_start: int                             # file offset of the data section


# ----------------------------------------------------------------------------------------------------------
# The header

class _Parser:
    """A cursor over the file's bytes that refuses to read (or allocate for) anything past the end."""

    def __init__(self, buf, where: str) -> None:
        self.buf, self.pos, self.where = buf, 0, where

    def fail(self, message: str):
        raise GGUFError(f"{self.where}: {message}")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> int:
        """Advance past n bytes; return where they start."""
        if n > self.left():
            self.fail(f"truncated file: {what} needs {n} bytes at offset {self.pos}, only {self.left()} are left")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        start = self.take(n, what)                          # checked before the slice is made
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at offset {start} is not valid UTF-8")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in SCALAR_FORMATS:
            v = self.scalar(SCALAR_FORMATS[vtype], what)
            if vtype == BOOL:
                if v > 1:
                    self.fail(f"{what} is a bool but holds {v} (must be 0 or 1)")
                return bool(v)
            return v
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY:
            self.fail(f"{what} has unknown value type {vtype} (known: 0 to 12)")
        if depth >= MAX_ARRAY_NESTING:
            self.fail(f"{what} nests arrays more than {MAX_ARRAY_NESTING} deep")
        etype = self.scalar("<I", f"the element type of {what}")
        n = self.scalar("<Q", f"the length of {what}")
        if n > MAX_ARRAY_LENGTH:
            self.fail(f"{what} claims {n} elements, more than the {MAX_ARRAY_LENGTH} this reader accepts "
                      "(corrupt file?)")
        if etype in SCALAR_FORMATS:                          # fixed size: read all n at once
            dtype = np.dtype(SCALAR_FORMATS[etype])
            start = self.take(n * dtype.itemsize, f"{what} ({n} x {VALUE_TYPE_NAMES[etype]})")
            # a copy of the bytes, not a view: a view would keep the memory map from closing on an error
            values = np.frombuffer(self.buf[start:start + n * dtype.itemsize], dtype)
            if etype == BOOL:
                if n and values.max() > 1:
                    self.fail(f"{what} is an array of bools but holds {values.max()} (must be 0 or 1)")
                values = values.astype(bool)
            return values.tolist()
        # strings (>= 8 bytes each: the length) and arrays (>= 12 bytes: type and count) vary in size
        smallest = {STRING: 8, ARRAY: 12}.get(etype)
        if smallest is None:
            self.fail(f"{what} has unknown element type {etype} (known: 0 to 12)")
        if n * smallest > self.left():
            self.fail(f"{what} claims {n} elements of type {VALUE_TYPE_NAMES[etype]}, more than the "
                      f"{self.left()} bytes left can hold (truncated or corrupt file)")
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(n)]


def _parse(buf, where: str) -> tuple[int, dict, dict[str, TensorInfo], int, int]:
    """(version, metadata, tensors, alignment, data_start) of a whole file's bytes; GGUFError if anything is off."""
    p = _Parser(buf, where)
    magic = bytes(buf[p.take(4, "the magic"):4])
    if magic != MAGIC:
        p.fail(f"not a GGUF file (the first 4 bytes are {magic!r}, not {MAGIC!r})")
    version = p.scalar("<I", "the version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        why = "a big-endian file" if swapped in VERSIONS else "obsolete" if version == 1 else "unknown"
        p.fail(f"GGUF version {version} is not supported ({why}); supported: {', '.join(map(str, VERSIONS))}")
    n_tensors = p.scalar("<Q", "the tensor count")
    n_kv = p.scalar("<Q", "the metadata count")
    # the smallest key/value is 13 bytes (an empty key, a type, a uint8); the smallest tensor info 24
    if n_kv * 13 > p.left() or n_tensors * 24 > p.left():
        p.fail(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in the {p.left()} bytes left "
               "(truncated or corrupt file)")

    metadata = {}
    for i in range(n_kv):
        key = p.string(f"metadata key {i}")
        if key in metadata:
            p.fail(f"metadata key {key!r:.100} appears twice")
        vtype = p.scalar("<I", f"the value type of {key!r:.100}")
        metadata[key] = p.value(vtype, f"metadata {key!r:.100}")

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not (is_int(alignment) and alignment > 0 and alignment & (alignment - 1) == 0):
        p.fail(f"general.alignment must be a power of two, got {alignment!r:.100}")

    infos = []
    for i in range(n_tensors):
        name = p.string(f"the name of tensor {i}")
        n_dims = p.scalar("<I", f"the dim count of tensor {name!r:.100}")
        if not 1 <= n_dims <= MAX_DIMS:
            p.fail(f"tensor {name!r:.100} has {n_dims} dims; GGUF tensors have 1 to {MAX_DIMS}")
        ne = [p.scalar("<Q", f"dim {d} of tensor {name!r:.100}") for d in range(n_dims)]
        ggml_type = p.scalar("<I", f"the type of tensor {name!r:.100}")
        offset = p.scalar("<Q", f"the offset of tensor {name!r:.100}")
        if ggml_type not in GGML_TYPES:
            p.fail(f"tensor {name!r:.100} has unknown ggml type {ggml_type}")
        type_name, block, block_bytes = GGML_TYPES[ggml_type]
        if ne[0] % block:
            p.fail(f"tensor {name!r:.100} of type {type_name} has rows of {ne[0]} values, not a multiple of "
                   f"its block size {block}")
        if offset % alignment:
            p.fail(f"tensor {name!r:.100} has offset {offset}, not a multiple of the alignment {alignment}")
        infos.append(TensorInfo(name, tuple(reversed(ne)), ggml_type, offset,
                                math.prod(ne) // block * block_bytes))
    data_start = p.pos + (-p.pos % alignment)

    tensors: dict[str, TensorInfo] = {}
    data_size = len(buf) - data_start
    for t in infos:
        if t.name in tensors:
            p.fail(f"tensor name {t.name!r:.100} appears twice")
        if t.offset + t.nbytes > data_size:
            p.fail(f"tensor {t.name!r:.100} ({t.type_name}, shape {list(t.shape)}) spans bytes "
                   f"[{t.offset}, {t.offset + t.nbytes}) of the data section, which holds {max(data_size, 0)} "
                   "(truncated file?)")
        tensors[t.name] = t
    end = 0                                                  # no two tensors may share bytes
    for t in sorted(infos, key=lambda t: t.offset):
        if t.offset < end:
            p.fail(f"tensor {t.name!r:.100} at offset {t.offset} overlaps the tensor before it (ends at {end})")
        end = max(end, t.offset + t.nbytes)
    return version, metadata, tensors, alignment, data_start


def read_gguf(path: str | os.PathLike) -> GGUF:
    """Read and validate a GGUF file's header (metadata and tensor infos); tensor data is not read."""
    path = os.fspath(path)
    with open_data_file(path, "GGUF file") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:                            # magic, version and the two counts; mmap refuses empty files
            raise GGUFError(f"{path}: {size} bytes is too short for a GGUF file (the fixed header alone is 24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            version, metadata, tensors, alignment, data_start = _parse(buf, path)
    return GGUF(path, version, metadata, tensors, alignment, data_start)


# ----------------------------------------------------------------------------------------------------------
# Tensor data

def _fp16(blocks: Tensor, at: int) -> Tensor:
    """The fp16 number at bytes [at, at + 2) of each block, as float32: (n_blocks, block_bytes) -> (n_blocks, 1)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """(n_blocks, 16) packed bytes -> (n_blocks, 32) values 0..15: low nibbles, then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def _q8_0(data: Tensor) -> Tensor:
    blocks = data.view(-1, 34)                               # (n_blocks, 34): fp16 d, int8 q[32]
    d = _fp16(blocks, 0)                                     # (n_blocks, 1)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n_blocks, 32)
    return d * q


def _q4_0(data: Tensor) -> Tensor:
    blocks = data.view(-1, 18)                               # (n_blocks, 18): fp16 d, uint8 qs[16]
    return _fp16(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8)  # (n_blocks, 1) * (n_blocks, 32)


def _q4_1(data: Tensor) -> Tensor:
    blocks = data.view(-1, 20)                               # (n_blocks, 20): fp16 d, fp16 m, uint8 qs[16]
    return _fp16(blocks, 0) * _nibbles(blocks[:, 4:]) + _fp16(blocks, 2)


# ggml type -> function from the raw bytes (uint8, 1-D) to float32 values (any shape, row-major order)
_DEQUANTIZE = {
    F32: lambda data: data.view(torch.float32).clone(),
    F16: lambda data: data.view(torch.float16).float(),
    BF16: lambda data: data.view(torch.bfloat16).float(),
    Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1,
}


def _as_bytes(raw) -> Tensor:
    """A 1-D uint8 torch tensor (a copy) of bytes, a bytearray, a memoryview, or a uint8 numpy / torch array."""
    if isinstance(raw, Tensor):
        if raw.dtype != torch.uint8:
            raise GGUFError(f"dequantize takes raw bytes; got a tensor of dtype {raw.dtype}")
        return raw.detach().reshape(-1).clone()
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8:
            raise GGUFError(f"dequantize takes raw bytes; got an array of dtype {raw.dtype}")
        return torch.from_numpy(np.array(raw, copy=True).reshape(-1))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)


def dequantize(raw, ggml_type: int, shape) -> Tensor:
    """float32 values of shape ``shape`` (torch order) from the raw bytes of a tensor of type ``ggml_type``."""
    shape = tuple(shape)
    if ggml_type not in GGML_TYPES:
        raise GGUFError(f"unknown ggml type {ggml_type}")
    type_name, block, block_bytes = GGML_TYPES[ggml_type]
    if ggml_type not in _DEQUANTIZE:
        raise GGUFError(f"ggml type {type_name} cannot be dequantized here; supported: "
                        f"{', '.join(GGML_TYPES[t][0] for t in _DEQUANTIZE)}")
    if not all(is_int(s) and s >= 0 for s in shape) or (shape[-1] if shape else 1) % block:
        raise GGUFError(f"shape {shape} is not valid for {type_name}: rows must be a multiple of {block} values")
    data = _as_bytes(raw)
    nbytes = math.prod(shape) // block * block_bytes
    if data.numel() != nbytes:
        raise GGUFError(f"{type_name} data of shape {list(shape)} takes {nbytes} bytes, got {data.numel()}")
    if nbytes == 0:
        return torch.zeros(shape)
    return _DEQUANTIZE[ggml_type](data).reshape(shape)


def _read(f, gguf: GGUF, info: TensorInfo) -> Tensor:
    f.seek(gguf.data_start + info.offset)
    raw = f.read(info.nbytes)
    if len(raw) != info.nbytes:                              # the file shrank since read_gguf
        raise GGUFError(f"{gguf.path}: tensor {info.name!r} is truncated")
    try:
        values = dequantize(raw, info.ggml_type, info.shape)
    except GGUFError as e:
        raise GGUFError(f"{gguf.path}: tensor {info.name!r}: {e}") from None
    try:
        check_finite_weights({info.name: values}, gguf.path)
    except ValueError as e:                                 # broken weights: a broken file
        raise GGUFError(str(e)) from None
    return values


def read_tensor(gguf: GGUF, name: str) -> Tensor:
    """One tensor, dequantized to float32, under its GGUF name and in the file's layout (torch-order shape)."""
    if name not in gguf.tensors:
        raise KeyError(f"{gguf.path} has no tensor {name!r}")
    with open_data_file(gguf.path, "GGUF file") as f:
        return _read(f, gguf, gguf.tensors[name])


# ----------------------------------------------------------------------------------------------------------
# Llama models: Hugging Face names, q/k rows, config

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(name: str) -> str | None:
    """The Hugging Face Llama name of a GGUF tensor name ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.
    q_proj.weight"); None if it has none."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_NAME.fullmatch(name)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{int(m[1])}.{_LAYER_NAMES[m[2]]}.weight"
    return None


def unpermute_qk(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's reordering of the rows of a q or k projection (n_head * d, ...), d = head dim.

    In each head, GGUF row 2j + s holds Hugging Face row s * d/2 + j (s in {0, 1}, j < d/2): the two
    rotary halves are interleaved. Reading the rows as (head, j, s) and swapping j and s gives (head, s, j),
    Hugging Face's order.
    """
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of an even size")
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _meta(gguf: GGUF, key: str, default=None, kind=int, positive: bool = True):
    """A metadata number a Llama model needs: present (or defaulted), of the right kind, positive ints."""
    value = gguf.metadata.get(key, default)
    if value is None:
        raise GGUFError(f"{gguf.path}: metadata lacks {key!r}, which a Llama model needs")
    ok = is_int(value) if kind is int else isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise GGUFError(f"{gguf.path}: metadata {key!r} must be {kind.__name__}, got {value!r:.100}")
    if kind is float and not math.isfinite(value):
        raise GGUFError(f"{gguf.path}: metadata {key!r} must be a finite number, got {value}")
    if positive and value <= 0:
        raise GGUFError(f"{gguf.path}: metadata {key!r} must be positive, got {value}")
    return value


def _token_ids(gguf: GGUF, key: str, vocab: int):
    """bos / eos: absent, or a token id (or a list of them) within the vocabulary."""
    value = gguf.metadata.get(key)
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(is_int(i) and 0 <= i < vocab for i in ids):
        raise GGUFError(f"{gguf.path}: metadata {key!r} must be a token id in [0, {vocab}), got {value!r:.100}")
    return value


def _check_llama(gguf: GGUF) -> None:
    arch = gguf.metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{gguf.path}: general.architecture is {arch!r:.100}; only 'llama' is supported")


def _decimal(x: float) -> float:
    """A float32 metadata number as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06);
    a number float32 cannot hold exactly (a float64 value) is left alone."""
    return float(str(np.float32(x))) if float(np.float32(x)) == x else x


def hf_config(gguf: GGUF) -> dict:
    """A Hugging Face LlamaConfig-style dict from the ``llama.*`` metadata (for ``hf.config_from_hf``)."""
    _check_llama(gguf)
    n_head = _meta(gguf, "llama.attention.head_count")
    d_model = _meta(gguf, "llama.embedding_length")
    if d_model % n_head:
        raise GGUFError(f"{gguf.path}: embedding_length {d_model} is not a multiple of head_count {n_head}")
    head_dim = d_model // n_head
    for key in ("llama.attention.key_length", "llama.attention.value_length", "llama.rope.dimension_count"):
        if _meta(gguf, key, head_dim) != head_dim:       # this reader builds heads of d_model / n_head
            raise GGUFError(f"{gguf.path}: {key} = {gguf.metadata[key]} differs from embedding_length / "
                            f"head_count = {head_dim}; not supported")
    scaling = gguf.metadata.get("llama.rope.scaling.type", "none")
    if scaling != "none" or _meta(gguf, "llama.expert_count", 0, positive=False) > 0:
        raise GGUFError(f"{gguf.path}: RoPE scaling ({scaling!r:.100}) and mixture-of-experts are not supported")
    if "token_embd.weight" in gguf.tensors:
        vocab = gguf.tensors["token_embd.weight"].shape[0]
    else:
        vocab = _meta(gguf, "llama.vocab_size", len(gguf.metadata.get("tokenizer.ggml.tokens", [])) or None)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": d_model, "intermediate_size": _meta(gguf, "llama.feed_forward_length"),
        "num_hidden_layers": _meta(gguf, "llama.block_count"), "num_attention_heads": n_head,
        "num_key_value_heads": _meta(gguf, "llama.attention.head_count_kv", n_head), "head_dim": head_dim,
        "max_position_embeddings": _meta(gguf, "llama.context_length"),
        "rms_norm_eps": _decimal(_meta(gguf, "llama.attention.layer_norm_rms_epsilon", kind=float)),
        "rope_theta": _decimal(_meta(gguf, "llama.rope.freq_base", 10000.0, kind=float)),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": _token_ids(gguf, "tokenizer.ggml.bos_token_id", vocab),
        "eos_token_id": _token_ids(gguf, "tokenizer.ggml.eos_token_id", vocab),
    }


def _check_names(gguf: GGUF) -> None:
    unknown = [name for name in gguf.tensors if hf_name(name) is None]
    if unknown:
        raise GGUFError(f"{gguf.path}: tensors with no Hugging Face Llama counterpart: {unknown[:8]}")


def meta_tensors(gguf: GGUF) -> dict[str, Tensor]:
    """What ``load_tensors`` returns, as meta tensors (shapes only, no data read): for checking the header's
    tensors against the model the metadata describes before a byte of data is read."""
    _check_llama(gguf)
    _check_names(gguf)
    return {hf_name(name): torch.empty(info.shape, device="meta") for name, info in gguf.tensors.items()}


def load_tensors(gguf: GGUF, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Every tensor of a Llama GGUF, dequantized, in ``dtype``, under Hugging Face names and layouts
    (q_proj and k_proj rows un-permuted), ready for ``hf.state_from_hf``."""
    _check_llama(gguf)
    n_head = _meta(gguf, "llama.attention.head_count")
    n_kv_head = _meta(gguf, "llama.attention.head_count_kv", n_head)
    _check_names(gguf)
    out = {}
    with open_data_file(gguf.path, "GGUF file") as f:
        for name, info in gguf.tensors.items():
            w = _read(f, gguf, info)                                     # (out, in) or (dim,)
            if name.endswith((".attn_q.weight", ".attn_k.weight")):
                heads = n_head if ".attn_q." in name else n_kv_head
                try:
                    w = unpermute_qk(w, heads)
                except ValueError as e:
                    raise GGUFError(f"{gguf.path}: tensor {name!r} of shape {list(w.shape)}: {e}") from None
            out[hf_name(name)] = w.to(dtype)
    return out


# ----------------------------------------------------------------------------------------------------------
# The tokenizer

def encoding(gguf: GGUF) -> tiktoken.Encoding:
    """The file's byte-level BPE tokenizer as a tiktoken Encoding (see the module docstring).

    As with any tiktoken Encoding, no BOS is prepended and text containing special tokens is refused unless
    allowed (``encode(text, allowed_special="all")``).
    """
    md, where = gguf.metadata, gguf.path
    model, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre")
    if model != "gpt2":
        raise GGUFError(f"{where}: tokenizer.ggml.model {model!r:.100} is not supported; supported: 'gpt2' "
                        "(byte-level BPE)")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{where}: tokenizer.ggml.pre {pre!r:.100} is not supported; supported: "
                        f"{', '.join(PRE_TOKENIZERS)}")
    tokens = md.get("tokenizer.ggml.tokens")
    types = md.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens or []))
    merges = md.get("tokenizer.ggml.merges", [])
    if not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens) and isinstance(types, list)
            and len(types) == len(tokens) and isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise GGUFError(f"{where}: tokenizer.ggml.tokens, token_type and merges must be a list of strings, a "
                        "list of ints of the same length, and a list of strings")
    empty = [i for i, (tok, kind) in enumerate(zip(tokens, types)) if tok == "" and kind in (NORMAL, CONTROL,
                                                                                          USER_DEFINED)]
    if empty:                                   # an empty token would make every encode loop forever
        raise GGUFError(f"{where}: tokenizer.ggml.tokens[{empty[0]}] is an empty string, expected a token")
    special = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)}
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}
    if len(special) + len(vocab) != sum(kind in (NORMAL, CONTROL, USER_DEFINED) for kind in types):
        raise GGUFError(f"{where}: tokenizer.ggml.tokens holds the same token twice")
    pairs = [tuple(m.split(" ")) for m in merges]
    try:
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError("every merge must be two tokens separated by one space")
        ranks = mergeable_ranks(vocab, pairs, first_free=len(tokens))    # missing bytes: ranks past the vocab
        return _encoding(f"gguf:{os.path.basename(where)}", PRE_TOKENIZERS[pre], ranks, special)
    except ValueError as e:
        raise GGUFError(f"{where}: tokenizer: {e}") from None
