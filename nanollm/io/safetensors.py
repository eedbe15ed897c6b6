"""
Reading and writing checkpoint tensors: the safetensors format, sharded indexes, ``pytorch_model.bin``.

Follows the safetensors format (https://github.com/huggingface/safetensors, "Format" in its README): an
8-byte little-endian header length, a JSON header, then the tensors' raw bytes. :func:`read_header` checks
that the tensors tile the buffer before any data is read; every problem raises :class:`SafetensorsError` (a
``ValueError``), and no other exception type escapes from a malformed file. :func:`save_file` writes what
the official library writes, byte for byte. :func:`load_sharded` reads ``model.safetensors.index.json``
shards, :func:`load_torch_bin` a pickled ``pytorch_model.bin`` with ``weights_only=True``. Every file is
opened with ``files.open_data_file`` (a FIFO or a device is refused).

Details: nanollm/inside.md, section "io/safetensors.py: the safetensors format and the other weight files".
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys

import torch
from torch import Tensor

from ..checks import is_int
from .files import atomic_open, open_data_file, read_json


class SafetensorsError(ValueError):
    """A checkpoint file is truncated, malformed, or holds something this reader does not support."""


# Format dtype name -> torch dtype, listed in the official library's order (its Rust `Dtype` enum).
# The writer sorts tensors by this order, widest first, to lay the buffer out exactly as the library does.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
    "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_DTYPE_ORDER = {name: i for i, name in enumerate(DTYPES)}
MAX_HEADER_BYTES = 100_000_000     # the official library's limit; a larger N means a corrupt file

if sys.byteorder != "little":      # raw bytes are little-endian; we copy them without swapping
    raise ImportError("nanollm.io.safetensors assumes a little-endian machine")


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


# ----------------------------------------------------------------------------------------------------------
# Reading

def _no_duplicate_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise SafetensorsError(f"duplicate keys in the header: {dup}")
    return dict(pairs)


def _is_count(x) -> bool:
    """A non-negative JSON integer (JSON true/false parse as Python bools, which are ints: exclude them)."""
    return is_int(x) and x >= 0


def parse_header(raw: bytes, buffer_size: int, where: str = "header") -> tuple[dict, dict[str, str]]:
    """Validate header bytes against the size of the buffer that follows them.

    Returns ``(tensors, metadata)``: ``tensors`` maps each name to ``{"dtype", "shape", "data_offsets"}``
    in header order, ``metadata`` is the ``__metadata__`` dict (empty if absent).
    """
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SafetensorsError(f"{where}: the header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{where}: the header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{where}: __metadata__ must map strings to strings, got {metadata!r:.200}")

    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(
                f"{where}: tensor {name!r} must be {{'dtype', 'shape', 'data_offsets'}}, got {info!r:.200}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise SafetensorsError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}; "
                                   f"supported: {', '.join(DTYPES)}")
        if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
            raise SafetensorsError(f"{where}: tensor {name!r} has an invalid shape {shape!r:.200}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise SafetensorsError(f"{where}: tensor {name!r} has invalid data_offsets {offsets!r:.200}")
        begin, end = offsets
        if not begin <= end <= buffer_size:
            raise SafetensorsError(f"{where}: tensor {name!r} data_offsets [{begin}, {end}] are out of "
                                   f"range for a {buffer_size}-byte buffer (truncated file?)")
        nbytes = math.prod(shape) * itemsize(dtype)
        if nbytes != end - begin:
            raise SafetensorsError(f"{where}: tensor {name!r} of dtype {dtype} and shape {shape} needs "
                                   f"{nbytes} bytes but data_offsets [{begin}, {end}] span {end - begin}")
        spans.append((begin, end, name))

    # The tensors must tile the buffer: no overlap, no gap, nothing left over.
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            problem = "overlaps the previous tensor" if begin < cursor else f"leaves a gap at byte {cursor}"
            raise SafetensorsError(f"{where}: tensor {name!r} at data_offsets [{begin}, {end}] {problem}")
        cursor = end
    if cursor != buffer_size:
        raise SafetensorsError(f"{where}: the tensors cover {cursor} bytes but the buffer holds "
                               f"{buffer_size} (trailing or missing data)")
    return header, metadata


def read_header(path: str | os.PathLike) -> tuple[dict, dict[str, str], int]:
    """Read and validate a file's header without touching tensor data.

    Returns ``(tensors, metadata, data_start)`` where ``data_start = 8 + N`` is the file offset of the buffer.
    """
    with open_data_file(path, "weights file") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file "
                                   "(needs an 8-byte header length)")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit "
                                   "(not a safetensors file, or corrupt)")
        if 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} runs past the end of the {size}-byte file "
                                   "(truncated file?)")
        raw = f.read(n)
    tensors, metadata = parse_header(raw, size - 8 - n, where=str(path))
    return tensors, metadata, 8 + n


def stored_size(path: str | os.PathLike) -> tuple[int, int]:
    """(values, tensors) a safetensors file holds, from its header alone."""
    tensors = read_header(path)[0]
    return sum(math.prod(info["shape"]) for info in tensors.values()), len(tensors)


def load_file(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """All tensors of a safetensors file, by name, on ``device``. The header is validated first."""
    tensors, _, data_start = read_header(path)
    out = {}
    with open_data_file(path, "weights file") as f:
        for name, info in tensors.items():
            begin, end = info["data_offsets"]
            dtype = DTYPES[info["dtype"]]
            if end == begin:                                   # empty tensor: frombuffer rejects b""
                t = torch.empty(info["shape"], dtype=dtype)
            else:
                f.seek(data_start + begin)
                buf = bytearray(f.read(end - begin))
                if len(buf) != end - begin:                    # the file shrank since read_header
                    raise SafetensorsError(f"{path}: tensor {name!r} is truncated")
                t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(info["shape"])
            out[name] = t.to(device)
    return out


def shards(index_path: str | os.PathLike) -> tuple[dict[str, str], list[str]]:
    """(weight_map, paths of the shard files) of a sharded checkpoint's ``*.index.json``, checked: every shard
    is a file name in the index's own folder, and exists."""
    folder = os.path.dirname(os.path.abspath(index_path))
    try:
        index = read_json(index_path, "index file")
        weight_map = index["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise SafetensorsError(f"{index_path}: not a valid index ({{'weight_map': {{name: file}}}}): {e!r}")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SafetensorsError(f"{index_path}: weight_map must map tensor names to shard file names")
    paths = []
    for shard in sorted(set(weight_map.values())):
        if os.path.basename(shard) != shard or shard in (".", ".."):   # stay inside the folder
            raise SafetensorsError(f"{index_path}: shard {shard!r} must be a file name in the same folder")
        paths.append(os.path.join(folder, shard))
        if not os.path.isfile(paths[-1]):
            raise SafetensorsError(f"{index_path}: shard {shard!r} is missing from {folder}")
    return weight_map, paths


def load_sharded(index_path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Tensors of a sharded checkpoint from its ``*.index.json`` (safetensors or ``pytorch_model-*.bin``)."""
    weight_map, paths = shards(index_path)
    out: dict[str, Tensor] = {}
    for shard_path in paths:
        shard = os.path.basename(shard_path)
        loaded = load_file(shard_path, device) if shard.endswith(".safetensors") else \
            load_torch_bin(shard_path, device)
        for name, file in weight_map.items():
            if file == shard:
                if name not in loaded:
                    raise SafetensorsError(f"{index_path}: tensor {name!r} is not in its shard {shard!r}")
                out[name] = loaded[name]
    return out


def load_torch_bin(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """A pickled ``pytorch_model.bin`` state dict, loaded with ``weights_only=True`` (no code execution)."""
    with open_data_file(path, "weights file") as f:
        state = torch_load(f, path, device)
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise SafetensorsError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    return state


def torch_load(f, path, device: str | torch.device = "cpu"):
    """``torch.load(f, weights_only=True)`` of an open file named ``path``: any failure becomes a one-line
    SafetensorsError naming the file. ``weights_only`` unpickles tensors and plain containers only, so a
    crafted pickle cannot run code."""
    try:
        return torch.load(f, map_location=device, weights_only=True)
    except Exception as e:   # torch raises many types (UnpicklingError, RuntimeError, EOFError, ...)
        raise SafetensorsError(f"{path}: cannot load as a weights-only PyTorch checkpoint: "
                               f"{first_line(e)}") from None


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, at most ``limit`` characters (torch's unpickling errors run
    to a page of advice; the one-line reports need only what failed)."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ----------------------------------------------------------------------------------------------------------
# Writing

def _layout(tensors: dict[str, Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """The padded header bytes and the order the tensors' data follows it in."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError("metadata must map strings to strings")
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise SafetensorsError(f"invalid tensor name {name!r}")
        if not isinstance(t, Tensor) or t.dtype not in DTYPE_NAMES:
            raise SafetensorsError(f"tensor {name!r}: unsupported type or dtype "
                                   f"{getattr(t, 'dtype', type(t).__name__)}")
    # Widest dtypes first (in the library's dtype order), then by name.
    names = sorted(tensors, key=lambda n: (-_DTYPE_ORDER[DTYPE_NAMES[tensors[n].dtype]], n))
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)                               # the buffer starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, names


def _tensor_bytes(t: Tensor) -> bytes:
    """Raw little-endian row-major bytes of one tensor."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def serialize(tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file, laid out exactly as the official library lays them out."""
    head, names = _layout(tensors, metadata)
    return head + b"".join(_tensor_bytes(tensors[n]) for n in names)


def save_file(tensors: dict[str, Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` as safetensors, one tensor at a time (to a temporary file, then renamed:
    a failure leaves the previous file).

    Tensors that share memory (tied weights) are simply written twice; leave one out to save space.
    """
    head, names = _layout(tensors, metadata)
    with atomic_open(path, "wb") as f:
        f.write(head)
        for name in names:
            f.write(_tensor_bytes(tensors[name]))
