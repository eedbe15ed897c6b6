"""
The process a student's code runs in while it is graded, and the messages it exchanges with the tests.

``course.grade`` runs the tests in one process and the student's code in another, this one, so that nothing
the student's code does (a ``sitecustomize.py``, a monkeypatch, a daemon) can reach the tests, the oracle or
the results: the test process asks, this process answers (course/sandbox/remote.py is the asking side). It is
started as ``python -I -S -c <this file's text> STUDENT ADAPTERS SITE_DIRS IN_FD OUT_FD PER_TEST_S MODE`` (MODE
holds lazy: the copy's adapters load at the first request, for a watch; room: ``no_new_program``); with ADAPTERS
empty it serves the copy's Triton kernels alone (``KernelsAlone``), importing none of its modules. Messages
travel on two pipes as a pickle of plain data with tensors out of band; one over ``MAX_MESSAGE`` bytes is refused
from its lengths, and the unpickler looks up no class. Any other object stays here and crosses as a handle; no
function crosses from the tests. Path, wire format, output, ``FILE_BYTES``: course/README.md, "The course's files".

The import guard below refuses the repository's own tests and the course's oracle and test files: a mistake
an honest copy can make (they hold reference implementations). It is no defence against a hostile student,
whose code runs in this process and can undo it; the defence is that the grade is computed elsewhere.
"""

from __future__ import annotations

import ast
import faulthandler
import functools
import importlib.util
import io
import json
import os
import pickle
import resource
import struct
import sys
import traceback
from pathlib import Path

LENGTH = struct.Struct("<Q")         # a message's count of parts, then each part's length in bytes
MAX_MESSAGE = 64 << 20               # 64 MiB: the largest message either side sends or reads; the eight
#                                      assignments' public and hidden tests, run on the reference, exchange
#                                      about 5 MiB at most (course/README.md, section "Limits"), over 10 times
#                                      less; a longer one is refused from its header, before it is read
MAX_PARTS = 1 << 16                  # the pickle and the bytes of at most 65535 tensors
CHUNK = 1 << 20                      # a part is read into its buffer this many bytes at a time at most
MAX_DEPTH = 64                       # lists, tuples and dicts within each other, at most (the tests' use: 6)
PICKLE_BYTES = 1 << 20               # a message's plain data (its tensors travel apart): the eight assignments'
MAX_CONTAINERS = 10_000              # tests, run on the reference, send at most 324 bytes and 17 containers
TEXT_CHARS = 4000                    # an error's text is cut to this many characters
FILE_BYTES = 256 << 20               # the largest file the student's code may write (course/sandbox/jail.py FILE_BYTES)
PACKAGES = ("nanollm", "methods", "kernels", "course")


# -- messages (both sides) --------------------------------------------------------------------------------

class MessageRefused(EOFError):
    """A message over the bounds (``MAX_MESSAGE``, ``MAX_PARTS``): the connection ends, as at the end of file."""


class PlainData(pickle.Unpickler):
    """Reads a pickle of plain data only (numbers, strings, lists, tuples, dicts): it names no class, so none
    is looked up and no code runs."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}: a message may hold plain data and tensors only")


def too_large(n: int) -> str:
    return f"a message of {n} bytes, more than MAX_MESSAGE = {MAX_MESSAGE >> 20} MiB"


def send(fd: int, obj) -> None:
    """Write one message: its parts' count and lengths, a pickle of plain data (tensors as ``pack`` writes
    them; anything else would name a class, which the reader refuses), then each tensor's bytes as they are.
    One over the bounds raises ``ValueError`` before anything is written."""
    buffers = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    parts = [memoryview(body), *(b.raw() for b in buffers)]
    size = sum(p.nbytes for p in parts)
    if size > MAX_MESSAGE:
        raise ValueError(too_large(size))
    if len(parts) > MAX_PARTS:
        raise ValueError(f"cannot send more than {MAX_PARTS - 1} tensors in one message")
    write_all(fd, LENGTH.pack(len(parts)) + b"".join(LENGTH.pack(p.nbytes) for p in parts))
    for part in parts:
        write_all(fd, part)


def write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def memory_order(t) -> list[int] | None:
    """The order of ``t``'s axes in memory, outermost first, when ``t`` is a contiguous tensor with its axes
    permuted (a transpose: the model's queries are one); None for a contiguous tensor and for any other layout
    (a slice, an expanded tensor), which travels contiguous."""
    if t.dim() < 2 or t.dim() > MAX_AXES or t.is_contiguous():
        return None
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return order if t.permute(order).is_contiguous() else None


def pack(t) -> dict:
    """A tensor as plain data: its type's name, shape and bytes (a buffer the message carries out of band), and
    the order of its axes in memory if it is a transpose (``memory_order``), so that it arrives as one: code that
    reads a transposed input as if it were contiguous (``.view``) fails in the grade as it would in the model."""
    torch = _torch()
    order = memory_order(t)
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_((t if order is None else t.permute(order)).detach().reshape(-1))   # in memory's order: plain
    raw = pickle.PickleBuffer(flat.view(torch.uint8).numpy()) if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "bytes": raw, "order": order}


MAX_AXES = 64                                         # the axes a transposed tensor may travel with (the tests use 5)


def unpack(d: dict):
    """The tensor ``pack`` wrote (a new tensor of its own, on the bytes the message was read into). Its bytes
    must be what its type and shape take: a few bytes never become a large tensor."""
    torch, dtype = _torch(), dtype_named(d["dtype"])
    shape, raw = [int(n) for n in d["shape"]], d["bytes"]
    numel = 1
    for n in shape:
        numel *= n
    if min(shape, default=0) < 0 or numel * dtype.itemsize != len(raw):
        raise ValueError(f"a tensor of shape {shape} and type {d['dtype']} with {len(raw)} bytes")
    order = d.get("order")
    if order is not None and not (type(order) is list and len(order) == len(shape) <= MAX_AXES
                                  and all(type(a) is int for a in order) and sorted(order) == list(range(len(shape)))):
        raise ValueError(f"a tensor of {len(shape)} axes with the axis order {str(order)[:80]}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    if not isinstance(raw, bytearray):                # bytes within the pickle: a copy each time they are named
        raise ValueError("a tensor's bytes travel out of band, in a buffer of their own")
    flat = torch.frombuffer(raw, dtype=dtype)
    if order is None:
        return flat.reshape(shape)
    back = sorted(range(len(order)), key=order.__getitem__)          # the inverse permutation
    return flat.reshape([shape[a] for a in order]).permute(back)


def read_exactly(fd: int, n: int) -> bytearray:
    """``n`` bytes, read in chunks into one buffer allocated once."""
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        read = os.readv(fd, [view[got:got + CHUNK]])
        if not read:
            raise EOFError("the other process closed the connection")
        got += read
    return buffer


def receive(fd: int):
    """Read one message (plain data: no class is looked up, no code runs while reading it). One over the
    bounds is refused from its lengths, before anything is allocated for it."""
    (count,) = LENGTH.unpack(read_exactly(fd, LENGTH.size))
    if not 1 <= count <= MAX_PARTS:
        raise MessageRefused(f"a message of {count} parts (1 to {MAX_PARTS})")
    lengths = struct.unpack(f"<{count}Q", read_exactly(fd, count * LENGTH.size))
    if sum(lengths) > MAX_MESSAGE or lengths[0] < 1:
        raise MessageRefused(too_large(sum(lengths)) if lengths[0] else "a message without its pickle")
    if lengths[0] > PICKLE_BYTES:
        raise MessageRefused(f"a message of {lengths[0]} bytes of plain data, more than {PICKLE_BYTES}")
    body, *tensors = [read_exactly(fd, n) for n in lengths]
    return each_part_once(PlainData(io.BytesIO(plain_ops(body)), buffers=tensors).load())


CONTAINERS = {"EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
              "FROZENSET", "MARK"}


def plain_ops(body: bytes) -> bytes:
    """``body`` if its pickle stores nothing in the memo by index (``PUT``: a pickle of protocol 5 memoises with
    ``MEMOIZE``; a ``LONG_BINPUT`` of a large index made the reader allocate 16 bytes per index first, 2 GiB
    from a 7-byte opcode) and builds at most ``MAX_CONTAINERS`` lists, tuples, dicts and sets (a megabyte of
    empty dicts costs about 145 times its size once read); else the message is refused before it is read."""
    import pickletools
    containers = 0
    try:
        for op, _, _ in pickletools.genops(body):   # a bytearray, read in place
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                raise MessageRefused(f"a message whose pickle uses {op.name}")
            containers += op.name in CONTAINERS
    except (ValueError, KeyError) as e:
        raise MessageRefused(f"a message that is not a pickle ({e})") from None
    if containers > MAX_CONTAINERS:
        raise MessageRefused(f"a message of {containers} containers, more than {MAX_CONTAINERS}")
    return body


def each_part_once(value, depth: int = MAX_DEPTH):
    """``value`` if no list, tuple, dict or buffer of it is reached twice and it nests at most ``depth`` deep;
    else the message is refused. A pickle may name one part many times at a few bytes each: one 48 MiB buffer
    under 40 tensors cost the reader 40 copies (6 GiB), lists nested as ``x = [x, x]`` 2 ** depth walks."""
    seen, todo = set(), [(value, 0)]
    while todo:
        part, level = todo.pop()
        if not isinstance(part, (list, tuple, dict, bytes, bytearray)) or not part:
            continue                                  # (an empty one may be Python's one object: () and b"")
        if id(part) in seen or level > depth:
            raise MessageRefused("a message whose parts repeat or nest too deep" if id(part) in seen else
                                 f"a message nested more than {depth} deep")
        seen.add(id(part))
        children = [*part.keys(), *part.values()] if isinstance(part, dict) else \
            part if isinstance(part, (list, tuple)) else []
        todo.extend((child, level + 1) for child in children)
    return value


class Mirrors:
    """Tensors that crossed between the two processes. Each side holds its own copy under a shared key; a
    change the tests make in place reaches the student's process with the next message, and so does a change the
    student's code makes to a tensor it handed out (a cache's storage). A change the student's code makes to a
    tensor the tests passed in never reaches the tests' copy: a test's inputs stay what it made, so the expected
    value it computes from them afterwards cannot be fed; if the student's code returns that tensor, the test
    gets its new values in a tensor of its own. The student's side compares each copy with what
    was last sent or received (a kernel writes without telling torch); the tests' side, whose writes are torch
    operations, compares version counters. Keys: the test process makes odd ones, the student's even."""

    def __init__(self, first_key: int):
        self.next_key, self.tests_side = first_key, first_key % 2 == 1
        self.table: dict[int, tuple] = {}              # key -> (weak reference to the tensor, its last state)
        self.recent: list = []     # tensors received since our last message: alive until it is sent (a write
        #                            into a temporary that is then dropped still reaches the other side)
        self.theirs: set[int] = set()                  # the keys the other side still holds (its last message)
        self.rewritten: dict[int, object] = {}         # the tests' side: its inputs as the student's code left them

    def encode(self, t) -> dict:
        import weakref
        key = getattr(t, "mirror_key", None)
        if key is None or key not in self.table or self.table[key][0]() is not t:
            key, self.next_key = self.next_key, self.next_key + 2
            t.mirror_key = key
        plain = t.detach()
        if type(plain) is not _torch().Tensor:
            plain = plain.as_subclass(_torch().Tensor)
        self.theirs.add(key)
        self.table[key] = (weakref.ref(t), self.state(t))
        return {"tensor": pack(plain), "key": key, "address": t.data_ptr()}

    def decode(self, d: dict):
        import weakref
        key = d["key"]
        if key in self.rewritten:                     # the tests' input, written by the student's code: its new
            return self.rewritten[key]                # values, in a tensor of their own (the input is unchanged)
        held = self.table.get(key)
        if held is not None and held[0]() is not None:
            t = held[0]()                             # our own tensor, back from the other side
            if self.tests_side and key % 2 == 1:      # as the student's code left it (encoding it there made its
                sent = unpack(d["tensor"])            # change no change): its values, the input unchanged
                if not (sent.shape == t.shape and sent.dtype == t.dtype and same(sent, t.detach())):
                    if not getattr(t, "takes_writes", False):
                        self.rewritten[key] = sent    # the tests' side fails the call (remote.InputChanged)
                        return sent
                    with _torch().no_grad():           # an output buffer the test marked: it takes the write
                        if sent.shape == t.shape and sent.dtype == t.dtype:
                            t.copy_(sent)
                        else:
                            t.set_(sent)
            return t
        t = unpack(d["tensor"])
        self.recent.append(t)
        t.mirror_key = key
        if self.tests_side:                           # where the student's process holds it
            t.student_address = d.get("address")
        self.table[key] = (weakref.ref(t), self.state(t))
        return t

    def state(self, t):
        """What a change is told by: the values (the student's side), or the version counter (the tests')."""
        if not self.tests_side:
            return t.detach().clone()
        try:
            return (t._version, t.data_ptr(), t.shape)
        except RuntimeError:                          # an inference tensor: no version counter
            return t.detach().clone()

    def changes(self) -> dict:
        """The tensors the other side holds that changed in place since the last message: key -> their values
        now."""
        out = {}
        for key in [k for k in self.theirs if k in self.table]:
            ref, last = self.table[key]
            t = ref()
            if t is None:
                del self.table[key]
            elif not (last == self.state(t) if isinstance(last, tuple) else same(t, last)):
                out[key] = pack(t)
                self.table[key] = (ref, self.state(t))
        self.recent.clear()
        return out

    def held(self) -> list[int]:
        """The keys we hold (the other side needs to look for changes in these only)."""
        alive = [k for k, (ref, _) in self.table.items() if ref() is not None]
        for k in set(self.table) - set(alive):
            del self.table[k]
        return alive

    def receive(self, message: dict) -> None:
        """Take the other side's changes and what it holds."""
        self.rewritten.clear()                        # what this message's values refer to
        self.apply(message.get("changes"))
        self.theirs = set(message.get("held", ()))

    def apply(self, changes: dict) -> None:
        """The other side's changes, written into our copies."""
        if not changes:
            return
        torch = _torch()
        for key, value in changes.items():
            value = unpack(value)
            held = self.table.get(key)
            t = held[0]() if held is not None else None
            if t is None:
                continue
            if self.tests_side and key % 2 == 1 and not getattr(t, "takes_writes", False):
                # a tensor the tests passed (not marked by oracle.written): the student's write never reaches
                self.rewritten[key] = value           # it (a test's expected value cannot be fed); the new values
                continue                              # come back only as what the student's code returns
            with torch.no_grad():
                if t.shape == value.shape and t.dtype == value.dtype:
                    t.copy_(value)
                else:
                    t.set_(value)
            self.table[key] = (held[0], self.state(t))


def same(a, b) -> bool:
    """The same shape, type and numbers (NaN where the other has NaN)."""
    torch = _torch()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


def encode_torch_name(value) -> dict:
    """A dtype or a device as plain data."""
    return {"torch": "dtype" if isinstance(value, _torch().dtype) else "device", "name": str(value)}


def decode_torch_name(d: dict):
    if d["torch"] == "device":
        return _torch().device(d["name"])
    return dtype_named(d["name"])


def dtype_named(name):
    """The torch dtype called ``name`` ("float32" or "torch.float32"), else ``ValueError``. Looked up in torch's
    namespace, not with ``getattr``, which imports the submodule a name names: a tensor's dtype "_dynamo" made
    the test process import 93 modules of ``torch._dynamo`` (round fifteen)."""
    torch = _torch()
    dtype = vars(torch).get(name.removeprefix("torch.")) if type(name) is str else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no tensor type {str(name)[:80]!r}")
    return dtype


def _torch():
    import torch
    return torch


# -- this process's side ----------------------------------------------------------------------------------

class Refused:
    """An import finder that refuses the copy's own tests and the course's oracle and test files."""

    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        if (parts[0] in ("tests", "oracle", "conftest", "test_public", "test_hidden", "remote")
                or name == "course.oracle" or (parts[0] == "course" and parts[-1].startswith("test_"))):
            raise ImportError(f"{name}: the graded code may not import the repository's own tests or the "
                              "course's oracle and tests", name=name)
        return None


CHECKED: dict[str, bool] = {}       # module name -> loaded from outside the student copy
ALLOWED: list[Path] = []            # where modules may come from besides the copy: the standard library, site dirs


def borrowed(student: Path) -> list[str]:
    """Modules loaded from outside the student copy: the library's (or the course's) from anywhere else, and
    any module from a file outside the copy, the standard library and the installed packages (a file-path
    import of another checkout)."""
    for name, module in list(sys.modules.items()):
        if name not in CHECKED:
            path = getattr(module, "__file__", None)
            path = path if isinstance(path, str) and os.path.isabs(path) else None    # torch.ops names no file
            where = Path(path).resolve().parents if path else ()
            CHECKED[name] = path is not None and student not in where and (
                name.split(".")[0] in PACKAGES or not any(folder in where for folder in ALLOWED))
    return sorted(n for n, wrong in CHECKED.items() if wrong and n in sys.modules)


def inside(filename: str, student: Path) -> bool:
    try:
        return student in Path(filename).resolve().parents
    except (OSError, ValueError):
        return False


def describe(e: BaseException, student: Path) -> str:
    """An exception as its type and message; a syntax error with its file and line; the deepest line of the
    student's code it came from."""
    if isinstance(e, SyntaxError):
        where = Path(e.filename or "?")
        where = where.resolve().relative_to(student) if inside(str(where), student) else where.name
        text = f"{type(e).__name__}: {e.msg} ({where}, line {e.lineno})\n    {(e.text or '').strip()}"
    else:
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        frames = [f for f in traceback.extract_tb(e.__traceback__) if inside(f.filename, student)]
        if frames:
            f = frames[-1]
            text += f"\n(raised in {Path(f.filename).resolve().relative_to(student)}, line {f.lineno}, in {f.name})"
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS - 3] + "..."


class Server:
    """Answers the test process's requests with the student's code."""

    def __init__(self, student: Path, adapters_file: Path | None, fd_in: int, fd_out: int, dump_after_s: float,
                 eager: bool = True):
        self.student, self.fd_in, self.fd_out, self.dump_after_s = student, fd_in, fd_out, dump_after_s
        self.adapters_file = adapters_file
        self.objects: dict[int, object] = {}
        self.mirrors = Mirrors(first_key=2)
        self.taken: list = []                 # library functions taken away (harness "take_away")
        self.adapters_error = None
        if adapters_file is None:             # the kernels alone: none of the copy's modules is imported
            self.objects[0] = KernelsAlone(student)
        elif eager:                           # the copy's adapters now, before the first test asks; else (for
            self.load()                       # a watch, remote.Connection.fresh) at the first request

    def load(self) -> None:
        """Import the copy's ``adapters`` (object 0); an error is kept and every call reports it."""
        try:
            spec = importlib.util.spec_from_file_location("adapters", self.adapters_file)
            module = importlib.util.module_from_spec(spec)
            sys.modules["adapters"] = module
            spec.loader.exec_module(module)
            self.objects[0] = module
        except BaseException as e:            # noqa: BLE001  (every call will report it)
            self.adapters_error = e

    def post(self, message: dict) -> None:
        message["changes"], message["held"] = self.mirrors.changes(), self.mirrors.held()
        send(self.fd_out, message)

    def get(self) -> dict:
        message = receive(self.fd_in)
        self.mirrors.receive(message)
        return message

    def encode(self, value):
        """A value to send: plain data and tensors as they are, anything else as a handle."""
        torch = sys.modules.get("torch")      # None until some code imported it: then no value is a tensor
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if torch is not None and isinstance(value, (torch.dtype, torch.device)):
            return encode_torch_name(value)
        if torch is not None and isinstance(value, torch.Tensor):
            return self.mirrors.encode(value)
        if isinstance(value, tuple):           # torch.Size too
            return {"tuple": [self.encode(v) for v in value]}
        if isinstance(value, list):
            return [self.encode(v) for v in value]
        if isinstance(value, dict) and all(isinstance(k, (str, int)) for k in value):
            return {"dict": {k: self.encode(v) for k, v in value.items()}}
        key = len(self.objects) + 1
        self.objects[key] = value
        return {"handle": key, "type": type(value).__name__, "callable": callable(value)}

    def decode(self, value):
        """A received value: handles back to their objects."""
        if isinstance(value, dict):
            if "handle" in value:
                return self.objects[value["handle"]]
            if "tuple" in value:
                return tuple(self.decode(v) for v in value["tuple"])
            if "dict" in value:
                return {k: self.decode(v) for k, v in value["dict"].items()}
            if "tensor" in value:
                return self.mirrors.decode(value)
            if "torch" in value:
                return decode_torch_name(value)
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        return value

    def harness(self, name: str, args: list):
        """The tests' own tools, run beside the student's code (checks of honest mistakes only: code in this
        process can undo them; what is graded is read from outside it, course/sandbox/remote.py ``Watch``)."""
        if name == "test_started":             # where the code is goes to the dump shortly before the limit
            faulthandler.dump_traceback_later(float(args[0]) if args else self.dump_after_s, exit=False)
            return None
        if name == "take_away":                # args: names "package.module.function"
            for full in args:
                where, attr = full.rsplit(".", 1)
                try:
                    module = importlib.import_module(where)
                except Exception:              # noqa: BLE001  (a file that does not import has nothing to take)
                    continue
                if hasattr(module, attr):
                    self.taken.append((module, attr, getattr(module, attr)))
                    setattr(module, attr, Taken(full))
            return None
        if name == "read_slot":                # args: a storage, a slot j, the n slots appended: slot j of its
            store, j, n = args                 # k, v and pos read as the library's attention reads them, whole
            whole = (stored_whole(getattr(store, a), n, 2, f"store.{a}") for a in ("k", "v", "pos"))
            return tuple(t[:, :, j].clone() for t in whole)
        if name == "read_pair_row":            # args: a two-matrix cache, a row r, the n rows stored: row r of its
            cache, r, n = args                 # K~, V~ and pair positions, read as its attend reads them, whole
            kt, vt = stored_whole(cache.kt.t, n, 2, "cache.kt.t"), stored_whole(cache.vt.t, n, 2, "cache.vt.t")
            a, b = (stored_whole(p, n, 0, f"cache.pair_pos()[{i}]") for i, p in enumerate(cache.pair_pos()))
            return kt[:, :, r].clone(), vt[:, :, r].clone(), int(a[r]), int(b[r])
        if name == "ready":                    # started (remote.Connection.fresh waits for this answer)
            return None
        if name == "give_back":
            while self.taken:
                module, attr, f = self.taken.pop()
                setattr(module, attr, f)
            return None
        raise ValueError(f"no harness operation {name!r}")

    def answer(self, request: dict):
        op = request["op"]
        args, kwargs = self.decode(request.get("args", [])), self.decode(request.get("kwargs", {}))
        if op == "harness":
            return self.harness(request["name"], args)
        if 0 not in self.objects and self.adapters_error is None:
            self.load()
        if self.adapters_error is not None:
            raise self.adapters_error
        target = self.objects[request["target"]]
        if op == "getattr":
            return getattr(target, request["name"])
        if op == "call":
            return target(*args, **kwargs)
        if op == "method":
            return getattr(target, request["name"])(*args, **kwargs)
        if op == "list":
            return list(target)
        raise ValueError(f"no operation {op!r}")

    def serve(self):
        """Answer the test process's requests until it closes the connection."""
        while True:
            request = self.get()
            try:
                value = self.answer(request)
                wrong = borrowed(self.student)
                if wrong:
                    raise RuntimeError(f"imported from outside the student copy {self.student}: {wrong[:3]}")
                reply = {"ok": self.encode(value)}
            except BaseException as e:      # noqa: BLE001  (the student's exception, whatever it is, is the answer)
                reply = {"error": {"type": type(e).__name__, "builtin": type(e).__module__ == "builtins",
                                   "text": describe(e, self.student)}}
            try:
                self.post(reply)
            except ValueError as e:         # an answer over MAX_MESSAGE, not sent: the call fails saying so
                self.post({"error": {"type": "ValueError", "builtin": True,
                                     "text": f"ValueError: your code's answer was refused ({e})"}})


def stored_whole(t, n: int, dim: int, what: str):
    """``t`` (named ``what``) if it is one plain tensor of the ``n`` entries stored along ``dim``, as the library's
    attention reads it (the growth tests' reads); else ``ValueError``."""
    torch = _torch()
    if type(t) is not torch.Tensor or t.dim() <= dim or t.shape[dim] != n:
        found = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
        raise ValueError(f"{what} is not one tensor of the {n} entries stored (dimension {dim}), as the attention "
                         f"reads it: {found}")
    return t


class Taken:
    """A function of the library taken away while another implementation of the same task is graded."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"graded alone: this implementation called {self.name}, another implementation of "
                             "the same task; compute the answer here instead")

    def __getitem__(self, grid):
        return self


# -- the copy's Triton kernels alone (a process of their own) ----------------------------------------------------

JIT_BUILTINS = {"range": range, "min": min, "max": max, "float": float, "int": int, "bool": bool, "abs": abs,
                "len": len, "NotImplementedError": NotImplementedError}
# The syntax a kernel may use, and nothing else: a list of what is refused let `match` through (a class pattern's
# keywords are attribute names no Attribute node holds: `case tl.tensor(__reduce_ex__=f)` reached `object`, then
# `__globals__` and `exec`; merge_splits 8 / 8 in PyTorch, round fifteen).
KERNEL_SYNTAX = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.While, ast.If, ast.Return, ast.Expr, ast.Pass,
                 ast.Break, ast.Continue, ast.Raise, ast.Assert,                                # statements
                 ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.IfExp, ast.Compare, ast.Call, ast.keyword, ast.NamedExpr,
                 ast.Attribute, ast.Subscript, ast.Slice, ast.Name, ast.Constant, ast.Tuple, ast.List,
                 ast.JoinedStr, ast.FormattedValue,                                             # expressions
                 ast.arguments, ast.arg, ast.expr_context, ast.operator, ast.unaryop, ast.cmpop,
                 ast.boolop)                                                                    # their parts


class NotTriton(Exception):
    """A graded kernel that is not written in Triton's language alone."""


def kernel_builtins(tl) -> dict:
    """``JIT_BUILTINS`` as a kernel's namespace holds them: ``int``, ``float`` and ``bool`` of a tensor are
    refused, as Triton's compiler refuses them. In the interpreter they gave a tensor's data as a Python number
    to compute on outside Triton (with an f-string's text, a merge written in Python floats scored 8 / 8, round
    sixteen)."""
    def of_constants(convert):
        def converted(*args):
            if any(isinstance(a, tl.tensor) for a in args):
                raise NotTriton(f"{convert.__name__}() of a tensor is not Triton's language: a tensor's data stays "
                                "in Triton (.to(tl.float32) converts it)")
            return convert(*args)
        return converted
    return {**JIT_BUILTINS, **{c.__name__: of_constants(c) for c in (int, float, bool)}}


def constant_value(v) -> bool:
    """A value a ``tl.constexpr`` parameter may be given: a number, a bool, a string, None, a dtype or constexpr."""
    if v is None or type(v) in (int, float, bool, str):
        return True
    import triton.language as tl
    return isinstance(v, (tl.constexpr, tl.dtype))


def is_jit(decorator: ast.expr) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)`` with constant arguments."""
    call = decorator if isinstance(decorator, ast.Call) else None
    target = call.func if call else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name)
            and target.value.id == "triton" and all(map(literal, (k.value for k in (call.keywords if call else []))))
            and not (call and call.args))


def literal(node: ast.expr) -> bool:
    """A constant, or a list or tuple of constants (``do_not_specialize=["n"]``)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return all(isinstance(e, ast.Constant) for e in node.elts)
    return isinstance(node, ast.Constant)


def top_level(tree: ast.Module):
    """The file's statements at its top level and in its top-level ``if`` blocks (``if HAS_TRITON:``), in order."""
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop(0)
        if isinstance(node, ast.If):
            nodes[:0] = node.body + node.orelse
        else:
            yield node


def jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """The ``@triton.jit`` functions of a file, at its top level or in its top-level ``if`` blocks."""
    return {node.name: node for node in top_level(tree) if isinstance(node, ast.FunctionDef)
            and node.decorator_list and all(map(is_jit, node.decorator_list))}


def check_triton_only(fn: ast.FunctionDef, tl_names: set[str], where: str, kernels: set[str] = frozenset(),
                      helpers: dict[str, ast.FunctionDef] | None = None) -> None:
    """Raise ``NotTriton`` unless ``fn`` is Triton's language: only the syntax of ``KERNEL_SYNTAX`` (no import, nested
    function or class, comprehension, ``with``, ``try`` or ``match``); every name it reads is an argument, one of
    its variables, ``tl``, another of the file's ``kernels`` or one of ``JIT_BUILTINS``; ``tl`` only as
    ``tl.<name>`` for a name of triton.language that is not a module, and any other value's attributes only a
    tensor's or a dtype's (``value_attributes``). The namespace is not relied on: Triton's interpreter copies its
    own module's globals (``inspect``, ``np``, ...) into it, and ``[tl][0].core.builtins.exec`` named no forbidden
    attribute; both ran PyTorch as a kernel. On a GPU Triton's compiler refuses the rest; in its CPU interpreter,
    where a kernel runs as Python, this does. A kernel holds no text (``text_in_place``), assigns no attribute,
    and gives the constexpr parameters of the file's other kernels (``helpers``) only constants."""
    parent = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    for node in header_values(fn):              # run by Python when it defines the kernel, in the module's scope
        if not plain_value(node, tl_names, set(kernels)):
            raise NotTriton(f"{where}, line {node.lineno}: {ast.unparse(node)}: a kernel's defaults and annotations "
                            "are literals, tl.<name> or the file's tl.constexpr constants")
    stored = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
    # what a kernel may write into a string or raise to a power: its constexpr parameters and the file's constants,
    # unless it assigns them (`N = tl.load(p)`, `N += 1` in a loop, `(N := ...)` held a tensor's data or a number
    # counted out of it under a constant's name; f'{N}' then gave the data as text, round seventeen) or a
    # parameter takes the name (a parameter named as a file constant held data, round twenty)
    constants = (constexpr_parameters(fn) | (set(kernels) - params)) - stored
    own = params | stored
    named = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in (helpers or {})}
    calls_back = {name for name in named if fn.name in reached(name, helpers)}     # a cycle through a helper
    readable = own | set(kernels) | set(JIT_BUILTINS) | {"tl"}
    parts = [fn.args, fn.returns, *fn.body, *getattr(fn, "type_params", [])]     # defaults, annotations too
    for node in (n for part in parts if part for n in ast.walk(part)):
        line = f"{where}, line {getattr(node, 'lineno', fn.lineno)}"
        if not isinstance(node, KERNEL_SYNTAX):
            raise NotTriton(f"{line}: {type(node).__name__} is not Triton's language")
        value = node.value if isinstance(node, ast.FormattedValue) else None
        if value is not None and not (isinstance(value, ast.Constant) or isinstance(value, ast.Name)
                                      and value.id in constants):
            raise NotTriton(f"{line}: an f-string of {ast.unparse(value)} is not Triton's language: a kernel writes "
                            "only literals and tl.constexpr values into text (a tensor's text is its data)")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and not static(node, constants) or \
                isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Pow):
            raise NotTriton(f"{line}: {ast.unparse(node)}: ** of a value known only when the kernel runs is not "
                            "Triton's language (a tensor has no **; tl.exp2 and tl.log2 compute a power)")
        text = isinstance(node, ast.JoinedStr) or isinstance(node, ast.Constant) and type(node.value) in (str, bytes)
        if text and not text_in_place(node, parent):
            raise NotTriton(f"{line}: {ast.unparse(node)}: text only as an argument of tl.static_assert, "
                            "tl.static_print, tl.device_print or tl.device_assert, a keyword such as "
                            "eviction_policy, an assert's message or in a comparison (text in a variable, formatted "
                            "with %, gave a tensor's data as text, rounds seventeen and eighteen)")
        if isinstance(node, ast.Subscript) and not static_index(node.slice, constants):
            raise NotTriton(f"{line}: {ast.unparse(node)}: an index or a slice of constants only, as Triton's "
                            "compiler asks (indexed by a tensor, a list chose Python values by the data, rounds "
                            "eighteen and twenty; tl.gather reads by index)")
        if isinstance(node, ast.Name) and node.id in JIT_BUILTINS and node.id not in own and not (
                isinstance(parent.get(node), ast.Call) and parent[node].func is node
                or isinstance(parent.get(node), ast.Raise)):
            raise NotTriton(f"{line}: {node.id}: a built-in is called, not handed on (f = range escaped the checks "
                            "of a range, round twenty)")
        if (problem := python_value(node, parent, constants, own)) is not None:
            raise NotTriton(f"{line}: {ast.unparse(node)}: {problem} (Python values chosen or counted by the data, "
                            "rounds nineteen to twenty-one)")
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            raise NotTriton(f"{line}: {ast.unparse(node)}: a kernel assigns no attribute (it rewrote Triton's "
                            "classes for the kernels after it)")
        if isinstance(node, ast.Name) and node.id == fn.name:
            raise NotTriton(f"{line}: {fn.name} calls itself: Triton's compiler has no recursion (a call of itself "
                            "gave its tl.constexpr parameter a tensor, round eighteen)")
        if helpers and isinstance(node, ast.Name) and node.id in helpers:
            if (problem := helper_use(node, parent.get(node), helpers[node.id], constants)) is not None:
                raise NotTriton(f"{line}: {problem}")
            if node.id in calls_back:
                raise NotTriton(f"{line}: {node.id} calls {fn.name} back: Triton's compiler has no recursion")
        if isinstance(node, ast.Name) and node.id not in readable:
            raise NotTriton(f"{line}: {node.id}: a kernel reads only its arguments, its variables, tl, the file's "
                            "other kernels and a few built-ins")
        if isinstance(node, ast.Name) and node.id == "tl" and not (
                isinstance(parent.get(node), ast.Attribute) and parent[node].value is node):
            raise NotTriton(f"{line}: tl is read only as tl.<name>")
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "tl":
                if node.attr not in tl_names:
                    raise NotTriton(f"{line}: tl.{node.attr} is not a name of triton.language")
            elif node.attr not in value_attributes():
                raise NotTriton(f"{line}: .{node.attr}: a kernel reads only a tensor's or a dtype's attributes")


TEXT_CALLS = ("static_assert", "static_print", "device_print", "device_assert")      # tl.<name> that read text
TEXT_KEYWORDS = ("eviction_policy", "cache_modifier", "padding_option", "sem", "scope", "input_precision",
                 "fp_downcast_rounding", "rounding")                         # tl.<name>(..., <keyword>="<text>")
TEXT_METHODS = ("to",)                        # a tensor's x.<name>(..., <keyword>="<text>") (fp_downcast_rounding)


def text_in_place(node: ast.expr, parent: dict) -> bool:
    """A string or f-string where Triton reads text and nothing keeps it: an argument of ``tl.<TEXT_CALLS>`` or of
    ``NotImplementedError``, a string constant given to ``float`` (``float("-inf")``), one of ``TEXT_KEYWORDS`` in
    a call of ``tl.<name>`` (``eviction_policy="evict_last"``) or of a tensor's ``TEXT_METHODS``
    (``p.to(dtype, fp_downcast_rounding="rtne")``), either branch of a ternary in such a place (``"ieee" if
    DOT_FP32 else "tf32"``), an assert's message, a side of a comparison, a statement of its own, a quoted
    annotation, or a part of an f-string. Anywhere else it reached a variable, and
    ``%`` or an index then made text of a tensor's data (round seventeen; through ``tl.multiple_of(input=...)``,
    which hands back what it is given, and bytes, round eighteen)."""
    up = parent.get(node)
    if isinstance(up, (ast.JoinedStr, ast.FormattedValue, ast.Compare, ast.Expr)):
        return True
    if isinstance(up, ast.IfExp) and node is not up.test:     # "ieee" if DOT_FP32 else "tf32": text either way
        return text_in_place(up, parent)
    if isinstance(up, ast.arg):               # a quoted annotation ("tl.constexpr"), read by ``plain_value``
        return node is up.annotation
    if isinstance(up, ast.Assert):
        return node is up.msg
    if isinstance(up, ast.keyword):
        call = parent.get(up)
        if not isinstance(call, ast.Call):
            return False
        method = isinstance(call.func, ast.Attribute) and call.func.attr in TEXT_METHODS         # p.to(..., <kw>=)
        return tl_attribute(call.func, lambda name: name in TEXT_CALLS) or up.arg in TEXT_KEYWORDS and (
            tl_attribute(call.func, bool) or method)
    return isinstance(up, ast.Call) and node in up.args and (
        tl_attribute(up.func, lambda name: name in TEXT_CALLS)
        or isinstance(up.func, ast.Name) and up.func.id == "NotImplementedError"
        or isinstance(up.func, ast.Name) and up.func.id == "float" and isinstance(node, ast.Constant))


RANGES = ("range", "static_range")                  # tl.<name> the interpreter runs as Python's range
AXES = {**dict.fromkeys(("sum", "max", "min", "argmax", "argmin", "reduce", "cumsum", "cumprod", "xor_sum", "sort",
                          "associative_scan", "expand_dims", "unsqueeze", "squeeze", "flip", "histogram", "topk",
                          "softmax", "permute", "trans"), 1), "gather": 2}   # tl.<name>(x, ...): where its axes begin
AXIS_KEYWORDS = ("axis", "dim", "dims", "k", "num_bins")                     # constexpr in Triton's compiler
SHAPE_CALLS = ("zeros", "full", "reshape", "view", "broadcast_to", "permute", "trans", "expand_dims", "make_block_ptr",
               "advance", "load", "store")                                    # tl.<name> that take a list or tuple


def python_value(node: ast.AST, parent: dict, constants: set[str], own: set[str]) -> str | None:
    """What makes ``node`` hand a tensor's data to Python, or None. In the interpreter a range's bounds, an axis
    and a list's index read the data as a Python int (``__index__``), and a list of Python values, sorted or
    chosen by ``max`` or a ternary, chose by the data (rounds nineteen to twenty-one): a range is a for loop's
    iterable only; ``len`` takes a shape, a name or a list; a built-in takes no keyword; a list or tuple is a
    shape or an index given to a call of ``tl.<name>``, a value returned or unpacked, or a part of one; an axis is
    a constant."""
    up = parent.get(node)
    is_range = isinstance(node, ast.Name) and node.id == "range" and node.id not in own or tl_attribute(
        node, lambda name: name in RANGES)
    if is_range and not (isinstance(up, ast.Call) and up.func is node and isinstance(parent.get(up), ast.For)
                         and parent[up].iter is up):
        return "a range is a for loop's iterable only"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in JIT_BUILTINS:
        if node.keywords:
            return "a built-in takes no keyword"
        arg = node.args[0] if len(node.args) == 1 else None
        if node.func.id == "len" and not (isinstance(arg, (ast.Name, ast.List, ast.Tuple)) or
                                          isinstance(arg, ast.Attribute) and arg.attr == "shape"):
            return "len takes a shape, a name or a list"
    if isinstance(node, (ast.List, ast.Tuple)) and isinstance(node.ctx, ast.Load):
        call = parent.get(up) if isinstance(up, ast.keyword) else up
        shape = isinstance(call, ast.Call) and tl_attribute(call.func, lambda name: name in SHAPE_CALLS)
        unpacked = isinstance(up, ast.Assign) and all(isinstance(t, (ast.Tuple, ast.List)) for t in up.targets)
        returned = isinstance(node, ast.Tuple) and isinstance(up, ast.Return)
        if not (shape or unpacked or returned or isinstance(up, (ast.Subscript, ast.List, ast.Tuple))):
            return "a list or tuple is a shape given to tl.<name>, a tuple returned, or a value unpacked or indexed"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in AXES:
        first = AXES[node.func.attr] - (0 if tl_attribute(node.func, bool) else 1)   # tl.sum(x, a) or x.sum(a)
        axes = [k.value for k in node.keywords if k.arg in AXIS_KEYWORDS] + node.args[first:]
        if any(not constant_argument(a, constants) for a in axes if not isinstance(a, ast.Tuple)) or any(
                not constant_argument(e, constants) for a in axes if isinstance(a, ast.Tuple) for e in a.elts):
            return "an axis, a dimension or a count is a constant"
    if tl_attribute(node, lambda name: name in dtype_names()) and isinstance(up, (ast.BoolOp, ast.IfExp)):
        return "a dtype is a constant, not chosen by a condition"
    if isinstance(node, ast.Call) and tl_attribute(node.func, lambda name: name == "static_assert"):
        messages = node.args[1:] + [k.value for k in node.keywords if k.arg == "msg"]
        if any(not isinstance(m, ast.JoinedStr) and not (isinstance(m, ast.Constant) and isinstance(m.value, str))
               for m in messages):
            return "a static_assert's message is text"
    if isinstance(node, ast.Assert) and node.msg is not None and not isinstance(node.msg, ast.JoinedStr) and not (
            isinstance(node.msg, ast.Constant) and isinstance(node.msg.value, str)):
        return "an assert's message is text (a tensor there showed a test's inputs, round twenty-two)"
    return None


def helper_use(name: ast.Name, up: ast.AST | None, helper: ast.FunctionDef, constants: set[str]) -> str | None:
    """What is wrong with a use of another kernel of the file, ``helper``, or None: its ``tl.constexpr`` parameters
    take constants (``static``, a dtype, ``tl.constexpr`` of a constant), as Triton's compiler asks; a kernel with
    such parameters is called, not handed on (``tl.reduce``'s combine function). ``launch`` checks the launched
    kernel's; a helper's, given a tensor, was a constant to the checks inside it (round seventeen)."""
    fixed = constexpr_parameters(helper)
    if not fixed:
        return None
    if not (isinstance(up, ast.Call) and up.func is name):
        return f"{name.id}, a kernel with tl.constexpr parameters, is called, not handed on"
    named = [a.arg for a in [*helper.args.posonlyargs, *helper.args.args]]
    given = [(named[i] if i < len(named) else None, a) for i, a in enumerate(up.args)]
    given += [(k.arg, k.value) for k in up.keywords]
    for param, value in given:
        if param in fixed and not constant_argument(value, constants):
            return f"{name.id}({param}={ast.unparse(value)}): a tl.constexpr parameter takes a constant"
    return None


def constant_argument(node: ast.expr, constants: set[str]) -> bool:
    """A value known before the kernel runs: ``static``, ``tl.<a dtype>``, or ``tl.constexpr(...)`` of one."""
    if isinstance(node, ast.Call) and tl_attribute(node.func, lambda name: name == "constexpr"):
        return len(node.args) == 1 and not node.keywords and constant_argument(node.args[0], constants)
    return static(node, constants) or tl_attribute(node, lambda name: name in dtype_names()) or \
        isinstance(node, ast.Constant) and node.value is None


def static_index(node: ast.expr, constants: set[str]) -> bool:
    """An index Triton's compiler takes: ``static`` values, ``None``, ``...`` and slices and tuples of them."""
    if isinstance(node, ast.Constant) and (node.value is None or node.value is Ellipsis):
        return True
    if isinstance(node, ast.Slice):
        return all(part is None or static_index(part, constants) for part in (node.lower, node.upper, node.step))
    if isinstance(node, ast.Tuple):
        return all(static_index(e, constants) for e in node.elts)
    return static(node, constants)


def static(node: ast.expr, constants: set[str]) -> bool:
    """An expression of literals and ``constants`` (constexpr parameters, the file's constants) alone: Python
    computes it before Triton does (``2**63 - 1``, ``BLOCK ** 2``). In the interpreter, a value counted out of the
    data through ``range`` or ``if`` is a Python number too, on which ``**`` would run where Triton's compiler
    refuses it."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id in constants
    if isinstance(node, ast.UnaryOp):
        return static(node.operand, constants)
    return isinstance(node, ast.BinOp) and static(node.left, constants) and static(node.right, constants)


def constexpr_parameters(fn: ast.FunctionDef) -> set[str]:
    """The parameters annotated ``tl.constexpr`` (or ``"tl.constexpr"``, ``"constexpr"``): the interpreter hands
    them their values as they are, unconverted (``KernelsAlone.launch`` checks those values are constants)."""
    def constexpr(a: ast.expr | None) -> bool:
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            return a.value.strip().removeprefix("tl.") == "constexpr"
        return tl_attribute(a, lambda name: name == "constexpr")
    return {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs] if constexpr(a.annotation)}


def header_values(fn: ast.FunctionDef) -> list[ast.expr]:
    """What Python evaluates when it defines ``fn``: its defaults and its arguments' annotations (its return
    annotation is dropped before, ``as_kernel``)."""
    arguments = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg]
    return [*fn.args.defaults, *(d for d in fn.args.kw_defaults if d is not None),
            *(a.annotation for a in arguments if a is not None and a.annotation is not None)]


def tl_attribute(node: ast.expr | None, attr_ok) -> bool:
    """``node`` is ``tl.<name>`` with ``attr_ok(name)``."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tl" \
        and attr_ok(node.attr)


def unsigned(node: ast.expr) -> ast.expr:
    """``node`` without a leading ``-`` or ``+``."""
    return node.operand if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) else node


def plain_value(node: ast.expr, tl_names: set[str], names: set[str]) -> bool:
    """A number, a string or None (signed or not), ``tl.<name>``, or one of ``names`` (the file's constants): a
    default or an annotation evaluated in the module's scope, where a name of the function's own is not its
    argument (``triton=triton``, or a default calling a kernel, which filled the namespace with the
    interpreter's globals, ran ``exec``: a red-team helper's escape)."""
    node = unsigned(node)
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float, bool, str, type(None))
    if isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id == "tl" and node.attr in tl_names
    return isinstance(node, ast.Name) and node.id in names


def stub_hint(fn: ast.FunctionDef) -> str | None:
    """The hint of the first ``raise NotImplementedError("<hint>")`` in ``fn`` (a task not done yet), or None."""
    for node in ast.walk(fn):
        call = node.exc if isinstance(node, ast.Raise) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "NotImplementedError":
            first = call.args[0] if call.args else None
            return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
    return None


def stub_only(fn: ast.FunctionDef, hint: str) -> ast.FunctionDef:
    """``fn`` with its body cut to ``raise NotImplementedError(hint)``: a kernel holding a task's stub raises the
    stub's hint when it runs. The code around the stub reads what the task would compute (a kernel of the
    student copy reads ``s`` after its stub), and checked as it is, it made the untouched copy fail "not Triton"."""
    body = ast.parse(f"raise NotImplementedError({hint!r})").body
    return ast.fix_missing_locations(ast.FunctionDef(**{**vars(fn), "body": body}))


@functools.cache
def dtype_names() -> frozenset[str]:
    """triton.language's dtypes by name (``tl.float32``, ``tl.int64``, ...): a file's constant may be one."""
    import triton.language as tl
    return frozenset(n for n in language_names() if isinstance(getattr(tl, n), tl.dtype))


@functools.cache
def value_attributes() -> frozenset[str]:
    """What a kernel may read of a value that is not ``tl``: a Triton tensor's public methods, a tensor's, a
    dtype's and a constexpr's properties, a dtype's ``is_...`` tests; never ``handle``, the interpreter's array
    under a tensor."""
    import triton.language as tl
    methods = {n for n in dir(tl.tensor) if not n.startswith("_")} | {n for n in dir(tl.dtype) if n.startswith("is_")}
    return frozenset(methods | {"dtype", "shape", "type", "element_ty", "scalar", "primitive_bitwidth", "numel",
                                "value"}) - {"handle"}


def language_names() -> set[str]:
    """What ``tl.<name>`` may be: triton.language's public names that are not modules."""
    import types

    import triton.language as tl
    return {n for n in dir(tl) if not n.startswith("_") and not isinstance(getattr(tl, n), types.ModuleType)}


@functools.cache
def math_names() -> frozenset[str]:
    """The names of triton.language.math that are triton.language's own functions (``tl.math.exp2`` is
    ``tl.exp2``, as Triton's tutorials write it)."""
    import triton.language as tl
    return frozenset(n for n in dir(tl.math) if n in language_names() and getattr(tl.math, n) is getattr(tl, n))


class PlainTl(ast.NodeTransformer):
    """``tl.math.<name>`` written ``tl.<name>``, the same function, so that a kernel never reads ``tl.math``."""

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        inner = node.value
        if (isinstance(inner, ast.Attribute) and inner.attr == "math" and isinstance(inner.value, ast.Name)
                and inner.value.id == "tl" and node.attr in math_names()):
            return ast.copy_location(ast.Attribute(value=inner.value, attr=node.attr, ctx=node.ctx), node)
        return self.generic_visit(node)


def as_kernel(fn: ast.FunctionDef) -> ast.FunctionDef:
    """A ``@triton.jit`` function as the kernels' process checks and runs it: ``tl.math.<name>`` as
    ``tl.<name>``, and without its return annotation, which Triton never reads (a file written with ``from
    __future__ import annotations`` never evaluates it; run here without that import, it would run)."""
    fn = ast.FunctionDef(**{**vars(fn), "returns": None})
    return ast.fix_missing_locations(PlainTl().visit(fn))


RESERVED = {"tl", "triton", "repr", "debug", "version", "noinline", "launch_metadata", "do_not_specialize",
            "do_not_specialize_on_alignment"}        # Triton's interpreter reads jit's keywords as names


def usable_name(name: str) -> bool:
    """A name a kernel or a constant may take: not a dunder, a built-in a kernel reads, ``tl``, ``triton`` or
    a keyword of ``triton.jit`` (the interpreter evaluates defaults again with those bound)."""
    return not (name.startswith("__") or name in JIT_BUILTINS or name in RESERVED)


def constant_number(node: ast.expr) -> bool:
    """A number or a bool, signed or not, or ``float("inf")`` (``"-inf"``, ``"nan"``): what a file's constant holds."""
    node = unsigned(node)
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float, bool)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float"
            and not node.keywords and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).strip().lower() in ("inf", "-inf", "+inf", "nan", "infinity", "-infinity"))


def module_constants(tree: ast.Module) -> dict[str, str]:
    """The file's ``NAME = tl.constexpr(<a number>)`` (``constant_number``) and ``NAME = tl.<a dtype>`` at its top
    level or in its top-level ``if`` blocks (``top_level``, where the kernels are), as Triton lets a kernel read a
    global: name -> the assignment written again (``ast.unparse``: a float too large is ``1e309``, never ``inf``)."""
    def constant(value) -> bool:                                    # tl.constexpr(<a number>), or tl.<a dtype>
        if isinstance(value, ast.Call):
            return (tl_attribute(value.func, lambda a: a == "constexpr") and not value.keywords
                    and len(value.args) == 1 and constant_number(value.args[0]))
        return tl_attribute(value, lambda a: a in dtype_names())

    found = {}
    for node in top_level(tree):
        value = node.value if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if value is not None and isinstance(node.targets[0], ast.Name) and constant(value):
            if not usable_name(node.targets[0].id):
                raise NotTriton(f"line {node.lineno}: {node.targets[0].id}: a constant kernels read takes a name of "
                                "its own (not tl, triton, a built-in, a keyword of triton.jit or a dunder)")
            found[node.targets[0].id] = ast.unparse(node)
    return found


def reached(kernel: str, found: dict[str, ast.FunctionDef]) -> list[str]:
    """``kernel`` and the file's ``@triton.jit`` functions it calls or names, and those they do, in file order."""
    todo, seen = [kernel], {kernel}
    while todo:
        for node in ast.walk(found[todo.pop()]):
            if isinstance(node, ast.Name) and node.id in found and node.id not in seen:
                seen.add(node.id)
                todo.append(node.id)
    return [name for name in found if name in seen]


def written_again(fn: ast.FunctionDef) -> str:
    """The checked kernel written out again from its syntax tree (``ast.unparse``), without its docstring: what
    runs is what was checked. Cut from the file's text, it was not always: lines cut at a form feed (where
    Python does not cut) ran a string's text as code, and Triton's interpreter, which reads a kernel's source
    again from its last line starting with ``def``, ran a function written inside a docstring."""
    fn = ast.FunctionDef(**{**vars(fn), "body": fn.body[1:] if ast.get_docstring(fn, clean=False) is not None
                            and len(fn.body) > 1 else fn.body})
    text = ast.unparse(fn)
    if sum(line.strip().startswith("def ") for line in text.splitlines()) != 1:
        raise NotTriton(f"{fn.name}: a kernel holds one def, its own")
    return text


def as_on_a_gpu() -> None:
    """Triton's CPU interpreter computes as numpy does where a GPU does not: ``tl.dot`` multiplies fp32 operands
    in full precision whatever ``input_precision`` says and bfloat16 ones as their raw bits
    (triton-lang/triton#11584), and a cast from fp32 to bfloat16 truncates. A GPU multiplies fp32 operands in
    tf32 (10 bits of mantissa) unless the dot asks for ``input_precision="ieee"`` (or "tf32x3"), bfloat16 ones
    exactly with fp32 accumulation, and rounds a cast to the nearest (ties to even). The kernels' process runs
    them as a GPU does: a kernel that leaves out the sheet's ``"ieee"`` loses its points here as its numbers
    would on a GPU, and the 16-bit path a GPU takes for a bfloat16 cache can be checked. A comparison of two
    scalars (``t < n``) is an i1 on a GPU and int32 in the interpreter, which refuses it as the mask of a load,
    a store or an atomic ("mask has unsupported dtype", Triton 3.9); here such a mask is taken as a GPU takes
    it. Other types and casts are the interpreter's own."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "as_on_a_gpu", False):
        return
    plain_dot, plain_cast = builder.create_dot, builder.cast_impl

    def nearest_even(x, drop: int):                   # float32's bits less their low ``drop``, rounded: (bits, kept)
        bits, drop = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32), np.uint32(drop)
        return bits, (bits + ((bits >> drop) & np.uint32(1)) + (np.uint32(1) << (drop - np.uint32(1))) -
                      np.uint32(1)) >> drop

    def tf32(x):                                      # 10 bits of mantissa; inf and nan as they are
        bits, kept = nearest_even(x, 13)
        special = (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
        return np.where(special, bits, kept << np.uint32(13)).view(np.float32)

    def widened(x):                                   # bfloat16's bits (the interpreter's uint16) as float32
        return (np.ascontiguousarray(x, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)

    def to_bf16(x):                                   # float32 to bfloat16's bits; nan stays nan
        _, kept = nearest_even(x, 16)
        return np.where(np.isnan(x), np.uint32(0x7FC0), kept).astype(np.uint16)

    def create_dot(self, a, b, d, input_precision, *rest):
        kinds = {a.dtype.scalar, b.dtype.scalar}
        if kinds == {tl.float32} and getattr(input_precision, "name", str(input_precision)).upper() == "TF32":
            a, b = (interpreter.TensorHandle(tf32(x.data), tl.float32) for x in (a, b))
        elif kinds == {tl.bfloat16}:
            a, b = (interpreter.TensorHandle(widened(x.data), tl.float32) for x in (a, b))
        return plain_dot(self, a, b, d, input_precision, *rest)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(to_bf16(src.data), tl.bfloat16)
        return plain_cast(self, src, dst_type)

    def any_mask(op, at: int):                       # a mask as a GPU's i1: nonzero is true (kernels.take_any_mask)
        def masked(self, *args):
            if args[at].data.dtype != bool:
                args = (*args[:at], interpreter.TensorHandle(args[at].data != 0, tl.int1), *args[at + 1:])
            return op(self, *args)
        masked.plain = op
        return masked
    create_dot.as_on_a_gpu = True
    create_dot.plain, cast_impl.plain = plain_dot, plain_cast          # (the grader's own tests put them back)
    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    for name, at in (("create_masked_load", 1), ("create_masked_store", 2), ("create_atomic_rmw", 3)):
        setattr(builder, name, any_mask(getattr(builder, name), at))


class KernelsAlone:
    """Serves the tests' launches of the copy's ``@triton.jit`` functions, in a process that imports none of
    the copy's modules: each file's kernels are read from its source (the syntax tree, never run as the
    copy's module), checked to be Triton's language alone (``check_triton_only``), compiled into a namespace
    holding only ``tl`` and the file's other kernels, and launched with the grid and arguments the test's own
    wrapper computed. A body in PyTorch behind the copy's Python wrapper, or a reference captured at import,
    is never reached: the wrapper is the grader's."""

    def __init__(self, student: Path):
        self.student, self.files, self.stubs, self.ready = student, {}, {}, {}

    def kernels_of(self, file: str) -> tuple[dict, dict]:
        """The file's ``@triton.jit`` functions (``as_kernel``; a kernel holding its task's stub as the stub alone)
        and its ``tl.constexpr`` constants, read from its syntax tree; none checked or run yet."""
        if file not in self.files:
            path = (self.student / file).resolve()
            if self.student not in path.parents or path.suffix != ".py":
                raise NotTriton(f"{file}: not a Python file of the copy")
            tree = ast.parse(path.read_text(), file)
            found = {name: as_kernel(fn) for name, fn in jit_functions(tree).items()}
            for kernel, fn in found.items():
                if not usable_name(kernel):
                    raise NotTriton(f"{file}, line {fn.lineno}: {kernel}: a kernel takes a name of its own (not tl, "
                                    "triton, a built-in, a keyword of triton.jit or a dunder)")
                hint = stub_hint(fn)
                if hint is not None:                  # a task not done: the kernel raises its hint (``stub_only``)
                    found[kernel] = stub_only(fn, hint)
                    self.stubs[(file, kernel)] = hint
            self.files[file] = (found, module_constants(tree))
        return self.files[file]

    def kernel(self, file: str, kernel: str):
        """The copy's ``kernel`` of ``file``, compiled with the functions it reaches (``reached``), each checked
        to be Triton's language alone (``check_triton_only``), into a namespace holding only ``tl``, those
        functions and the file's constants: a function the kernel never reaches is neither checked nor run, so a
        construct refused in one kernel costs only the tasks that launch it."""
        if (file, kernel) not in self.ready:
            import linecache

            import triton
            import triton.language as tl
            as_on_a_gpu()
            found, constants = self.kernels_of(file)
            if kernel not in found:
                raise NotTriton(f"{file} has no @triton.jit function {kernel!r}")
            names, readable = language_names(), set(found) | set(constants)
            chain = reached(kernel, found)
            for fn in (found[name] for name in chain):
                check_triton_only(fn, names, file, readable, found)
            name = f"<the copy's kernels: {file}, {kernel}>"
            source = "\n".join(constants.values()) + "\n\n" + "\n\n".join(written_again(found[k]) for k in chain) + "\n"
            linecache.cache[name] = (len(source), None, source.splitlines(True), name)   # Triton reads the source
            space = {"tl": tl, "triton": triton, "__builtins__": kernel_builtins(tl)}
            exec(compile(source, name, "exec"), space)
            self.ready[(file, kernel)] = space[kernel]
        return self.ready[(file, kernel)]

    def launch(self, file: str, kernel: str, grid: list[int], args: list, meta: dict) -> None:
        """``kernel[grid](*args, **meta)``, the kernel from the copy's ``file``; its writes into the tensors the
        test marked (``oracle.written``) reach the test."""
        self.kernels_of(file)                         # (a kernel of the file holding its stub is in self.stubs)
        if (file, kernel) in self.stubs:              # its hint in a line (the interpreter would wrap it)
            raise NotImplementedError(self.stubs[(file, kernel)])
        import inspect

        compiled = self.kernel(file, kernel)
        run = compiled[tuple(int(g) for g in grid)]
        signature = inspect.signature(compiled.fn)
        given = signature.bind_partial(*args, **{k: v for k, v in meta.items() if k in signature.parameters})
        raw = constexpr_parameters(self.files[file][0][kernel]) | set(getattr(run, "constexprs", ()))
        for name in raw & set(given.arguments):           # the interpreter's constexprs get their values as they are
            if not constant_value(given.arguments[name]):
                raise NotTriton(f"{file}, {kernel}: {name} is annotated tl.constexpr but is given a "
                                f"{type(given.arguments[name]).__name__}: a constexpr is a number, a bool or a dtype "
                                "(a tensor there reached the kernel as PyTorch's, not as a pointer)")
        try:
            run(*args, **meta)
        except Exception as e:                # noqa: BLE001  (Triton's interpreter wraps what the kernel raised)
            if isinstance(e, NotTriton) or "NotTriton(" in str(e):
                raise NotTriton(f"{file}, {kernel}: {e.__cause__ or e}") from None
            if not (isinstance(e, NameError) or str(e).startswith("NameError(")):
                raise
            raise NotTriton(f"{file}, {kernel}: {e}: a kernel reads only its arguments, its variables, tl and the "
                            "file's other kernels") from None


def limit_file_size(n: int) -> None:
    """No file this process (or one it starts) writes grows past ``n`` bytes: a write beyond fails with
    ``File too large`` (Python ignores SIGXFSZ). Lowered for good: the code cannot raise it again."""
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    n = n if hard == resource.RLIM_INFINITY else min(n, hard)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))


EXECS = {"x86_64": (0xC000003E, 59, 322), "aarch64": (0xC00000B7, 221, 281)}    # arch, execve, execveat


def no_new_program() -> None:
    """In the room, before any of the copy's code: this process can no longer replace its program (execve
    fails with "Operation not permitted"), a seccomp filter added to the room's (course/sandbox/jail.py
    ``no_new_processes``). A new program starts with a new peak memory: a Kronecker product built, then an
    exec of a program that sent the answer, scored 24 / 24."""
    import ctypes
    import platform
    arch, execve, execveat = EXECS[platform.machine()]
    load, jeq, ret, allow, eperm = 0x20, 0x15, 0x06, 0x7FFF0000, 0x00050000 | 1
    program = [(load, 0, 0, 4), (jeq, 0, 4, arch), (load, 0, 0, 0), (jeq, 2, 0, execve), (jeq, 1, 0, execveat),
               (ret, 0, 0, allow), (ret, 0, 0, eperm)]

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]
    code = (Instruction * len(program))(*program)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(22, 2, ctypes.byref(Program(len(program), code)), 0, 0) != 0:     # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "the room's filter against a new program")


def main(argv: list[str]) -> None:
    student, adapters_file, site_dirs, fd_in, fd_out, dump_after_s, mode = argv
    student = Path(student)
    sys.path[:] = [p for p in sys.path if p] + json.loads(site_dirs)
    ALLOWED.extend(Path(p).resolve() for p in sys.path)
    for name in list(sys.modules):
        CHECKED[name] = False                      # what Python itself loaded before any of the copy's code
    fd_in, fd_out = int(fd_in), int(fd_out)
    limit_file_size(FILE_BYTES)
    if "room" in mode.split(","):
        no_new_program()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)                                  # print() goes to the dump file, never to the messages
    sys.dont_write_bytecode = True
    sys.meta_path.insert(0, Refused())
    faulthandler.enable()
    if "lazy" in mode.split(","):                  # PyTorch while nothing of the copy is importable: none of its
        try:                                       # files (one named as a module PyTorch imports) runs before
            importlib.import_module("torch")       # the watch that started this process begins
        except ImportError:
            pass
    if adapters_file:                              # the kernels alone: nothing of the copy is importable
        sys.path.insert(0, str(student))
    server = Server(student, Path(adapters_file) if adapters_file else None, fd_in, fd_out, float(dump_after_s),
                    "lazy" not in mode.split(","))
    try:
        server.serve()
    except EOFError:
        os._exit(0)                                # the test process is done
    except BaseException:                          # noqa: BLE001  (a fault of this file: say where, then stop)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
