"""
The tests' side of grading: ``adapters`` as the tests see it, a stand-in that asks the process running the
student's code (course/sandbox/student_process.py) and never runs that code itself.

``course.grade`` copies this file next to the tests, where ``import adapters as A`` gets ``connect(...)``, and
``A.scores(q, k)`` sends the call over a pipe and waits for the answer: a tensor (a copy; ``address(t)`` is
where the student's process holds it), plain data, a ``Remote`` handle for any other object (its attributes,
calls, ``with``, ``len`` and indexing go to the student's process too), or an exception of the same type name
and message. The student's process is started on the first call and restarted after it dies; as root it runs
as ``nobody`` (course/README.md, section "Threat model").

What the student's code prints comes through a pipe into ``Output``, which keeps the dump file bounded: its
first ``HEAD_BYTES`` and its last ``TAIL_BYTES``, with a line counting what was left out between them. More:
course/README.md, section "The course's files".
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

if __package__:                                  # imported as course.remote (the grader's own tests)
    from . import student_process as wire
else:                                            # the test process: beside the tests, a module of its own
    import student_process as wire


class StudentError(Exception):
    """An exception raised by the student's code; its class takes the exception's type name."""


class InputChanged(AssertionError):
    """The student's code wrote into a tensor a test passed it (not an output buffer, ``oracle.written``): a
    graded function leaves its inputs as they were. The wire sees the write (course/sandbox/student_process.py
    ``Mirrors``), so no test needs to ask."""


def student_exception(error: dict) -> Exception:
    """The exception a test sees for the student's: a built-in type where it was one, else a class of the same
    name. ``course_text`` holds the description (type, message, the student's file and line)."""
    kind = getattr(builtins, error["type"], None) if error["builtin"] else None
    if not (isinstance(kind, type) and issubclass(kind, Exception)) or issubclass(kind, (SyntaxError, UnicodeError)):
        kind = type(error["type"], (StudentError,), {})
    try:
        e = kind(error["text"].split("\n")[0].split(": ", 1)[-1])
    except Exception:                     # noqa: BLE001  (a type that takes other arguments)
        e = type(error["type"], (StudentError,), {})(error["text"])
    e.course_text = error["text"]
    return e


HEAD_BYTES = 64 << 10        # the start of the student's output kept in the dump file
TAIL_BYTES = 1 << 20         # and its end (the grader reads this much of the end: course/grade.py DUMP_TAIL)


class Output:
    """The student's output, kept in the dump file within bounds: the first ``HEAD_BYTES``, then the last
    ``TAIL_BYTES`` to ``2 * TAIL_BYTES`` (rewritten each time it passes twice, so a byte costs two writes at
    most) after a line saying how many bytes were left out. Memory and file hold under
    ``HEAD_BYTES + 2 * TAIL_BYTES`` and a chunk, however much the code writes. A write that fails (a full
    disk) loses that part of the dump, never the draining: the student's process never blocks on it."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """An empty dump (a test starts)."""
        with self.lock:
            self.head, self.tail, self.left_out = bytearray(), bytearray(), 0
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass

    def add(self, data: bytes) -> None:
        with self.lock:
            take = data[:HEAD_BYTES - len(self.head)]
            if take:
                self.write(take, len(self.head))
                self.head += take
                data = data[len(take):]
            if not data:
                return
            self.tail += data
            if len(self.tail) <= 2 * TAIL_BYTES:
                self.write(data, len(self.head) + len(self.note()) + len(self.tail) - len(data))
                return
            cut = len(self.tail) - TAIL_BYTES
            del self.tail[:cut]
            self.left_out += cut
            try:
                os.ftruncate(self.fd, len(self.head))
            except OSError:
                pass
            self.write(self.note() + self.tail, len(self.head))

    def note(self) -> bytes:
        return f"\n[... {self.left_out} bytes of output left out ...]\n".encode() if self.left_out else b""

    def write(self, data: bytes, offset: int) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError:
            pass

    def drain(self, fd: int) -> None:
        """Read the pipe ``fd`` until its end (the student's process and all it started have closed it)."""
        try:
            while chunk := os.read(fd, 1 << 16):
                self.add(chunk)
        except OSError:
            pass
        finally:
            os.close(fd)


class Connection:
    """The student's process and the pipes to it."""

    def __init__(self, student: str, adapters_file: str, site_dirs: list[str], dump: str, dump_after_s: float,
                 home: str | None, nobody: bool, python: str = sys.executable, jail: list[str] | None = None,
                 room: str | None = None):
        self.args = (student, adapters_file, json.dumps(site_dirs), str(dump_after_s))
        self.settings = (student, site_dirs, dump, dump_after_s, home, nobody, python, jail, room)
        self.output, self.home, self.nobody, self.python = Output(dump), home, nobody, python
        self.jail = jail                           # the command that runs another in the room (course/sandbox/jail.py)
        self.room = room                           # the room's spec, written to that command's standard input
        self.proc: subprocess.Popen | None = None
        self.mirrors = wire.Mirrors(first_key=1)
        self.generation = 0                        # which student's process the handles belong to
        self.forget = lambda: None                 # what the adapters stand-in drops when that process stops
        self.siblings: list[Connection] = []       # the kernels' own process (``kernels_alone``), closed with this
        self.test_started: float | None = None     # when the running test asked for its dump (harness test_started)

    def start(self, eager: bool = True) -> None:
        """Start the student's process; ``eager``: it imports the copy's adapters now, else at the first request.
        Never a second one beside it: a process started twice left the first running unwatched, outside
        ``Watch.tree``, and able to pass what it computed to the watched one (round fifteen)."""
        if self.proc is not None:
            raise RuntimeError("the student's process is running already: stop it before another starts")
        request_r, request_w = os.pipe()           # requests: we write, the child reads
        answer_r, answer_w = os.pipe()             # answers: the child writes, we read
        student, adapters_file, site_dirs, dump_after_s = self.args
        code = Path(wire.__file__).read_text()
        cmd = [self.python, "-I", "-S", "-B", "-c", code, student, adapters_file, site_dirs,
               str(request_r), str(answer_w), dump_after_s,
               ",".join(["eager" if eager else "lazy"] + (["room"] if self.jail else []))]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8",
               "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"), "HOME": self.home or "/nonexistent"}
        if self.home:
            env["TMPDIR"] = self.home
        drop = {}
        if self.jail:                              # the room: its own root, processes, user (course/sandbox/jail.py)
            cmd = [*self.jail, *cmd]
        elif self.nobody:                          # the grader runs as root: the student's code runs as nobody
            drop = {"user": 65534, "group": 65534, "extra_groups": []}
        elif os.geteuid() == 0:                    # never as root (course.grade refuses before this)
            raise RuntimeError("refused to run the student's code as root: nobody cannot read Python")
        printed_r, printed_w = os.pipe()           # what the code prints: into the bounded dump
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if self.jail else subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=printed_w,
                                         pass_fds=(request_r, answer_w), env=env, cwd=self.home or "/",
                                         start_new_session=True, **drop)
            if self.jail:                          # the room's spec, then the end of its input
                with self.proc.stdin:
                    self.proc.stdin.write((self.room or "").encode())
        except BaseException:
            os.close(printed_r)
            raise
        finally:
            for fd in (request_r, answer_w, printed_w):
                os.close(fd)
        threading.Thread(target=self.output.drain, args=(printed_r,), daemon=True).start()
        self.fd_out, self.fd_in = request_w, answer_r

    def fresh(self) -> None:
        """A new student's process in place of this one, in which none of the copy's code has run yet (PyTorch is
        loaded; the copy's adapters load at the first request): a watch begun now sees all the code holds, also
        what it would have set aside at import or in an earlier call (``Watch(fresh=True)``)."""
        if self.proc is not None:
            self.stopped("a fresh one replaces it")
        self.start(eager=False)
        self.request("harness", None, "ready")
        if self.test_started is not None:          # the test's dump, at the time it was due in the old process
            dump_after_s = float(self.args[3])
            left = dump_after_s - (time.monotonic() - self.test_started)
            self.request("harness", None, "test_started", [max(left, 0.1)])

    def kernels_alone(self) -> Connection:
        """A connection to a process of its own, started as this one (the same room and user), that serves the
        copy's Triton kernels alone (course/sandbox/student_process.py ``KernelsAlone``); its output has a dump of its
        own."""
        student, site_dirs, dump, dump_after_s, home, nobody, python, jail, room = self.settings
        other = Connection(student, "", site_dirs, f"{dump}.kernels", dump_after_s, home, nobody, python, jail, room)
        self.siblings.append(other)
        return other

    def stopped(self, why: str | None = None) -> RuntimeError:
        """The student's process died, or sent what cannot be read (``why``: it is killed): this call fails, the
        next one starts a fresh process."""
        proc, self.proc = self.proc, None
        if why is not None and proc is not None:
            proc.kill()
        self.generation += 1
        self.mirrors = wire.Mirrors(first_key=1)
        self.forget()
        for fd in (self.fd_in, self.fd_out):
            try:
                os.close(fd)
            except OSError:
                pass
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:   # one that stopped answering but runs on
                proc.kill()
                code = proc.wait()
        if why is not None:
            return RuntimeError(f"your code's answer was refused ({why}); the process running it was stopped")
        return RuntimeError(f"the process running your code stopped (exit code {code}) in this test")

    def request(self, op: str, target: int | None = None, name: str | None = None, args=(), kwargs=None):
        """Ask the student's process (``op``: getattr, call, method, list, harness) and wait for its answer."""
        if self.proc is None:
            self.start()
        if op == "harness" and name == "test_started" and not args:
            self.test_started = time.monotonic()
        message = {"op": op, "target": target, "name": name, "args": self.encode(list(args)),
                   "kwargs": self.encode(dict(kwargs or {}))}
        try:
            self.post(message)
            answer = self.get()
            if "error" in answer:
                raise student_exception(answer["error"])
            value = self.decode(answer["ok"])
            if op != "harness" and self.mirrors.rewritten:
                raise InputChanged(changed_inputs(self.mirrors.rewritten.values()))
            return value
        except wire.MessageRefused as e:
            raise self.stopped(str(e)) from None
        except (EOFError, BrokenPipeError, OSError) as e:
            if isinstance(e, OSError) and not isinstance(e, BrokenPipeError) and self.proc and self.proc.poll() is None:
                raise
            raise self.stopped() from None

    def post(self, message: dict) -> None:
        message["changes"], message["held"] = self.mirrors.changes(), self.mirrors.held()
        wire.send(self.fd_out, message)

    def get(self) -> dict:
        message = wire.receive(self.fd_in)
        self.mirrors.receive(message)
        return message

    def encode(self, value):
        import torch
        if isinstance(value, Remote):
            if value._generation != self.generation:
                raise RuntimeError(f"{value!r} belonged to a process running your code that has stopped")
            return {"handle": value._key}
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if isinstance(value, (torch.dtype, torch.device)):
            return wire.encode_torch_name(value)
        if isinstance(value, torch.Tensor):
            return self.mirrors.encode(value)
        if isinstance(value, tuple):
            return {"tuple": [self.encode(v) for v in value]}
        if isinstance(value, list):
            return [self.encode(v) for v in value]
        if isinstance(value, dict):
            return {"dict": {k: self.encode(v) for k, v in value.items()}}
        if callable(value):                        # a reference would be the student's to keep and call
            raise TypeError("the tests pass no function to the student's code (run the reference here, with the "
                            "student's function in its place: oracle.reference and oracle.patched)")
        raise TypeError(f"cannot pass a {type(value).__name__} to the student's code")

    def decode(self, value):
        if isinstance(value, dict):
            if "handle" in value:
                return Remote(self, value["handle"], value["type"])
            if "tuple" in value:
                return tuple(self.decode(v) for v in value["tuple"])
            if "dict" in value:
                return {k: self.decode(v) for k, v in value["dict"].items()}
            if "tensor" in value:
                return self.mirrors.decode(value)
            if "torch" in value:
                return wire.decode_torch_name(value)
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        return value

    def close(self) -> None:
        for other in self.siblings:
            other.close()
        if self.proc is not None:
            for fd in (self.fd_in, self.fd_out):
                os.close(fd)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Watch:
    """What the student's process and every process below it spend while a block runs, read by the test process
    from /proc (Linux), where the student's code cannot reach: ``cpu_s``, the CPU seconds (user and system, those
    of processes that ended and were waited for included), and ``peak_bytes``, how far the resident memory of
    each process rose above where it stood at the start, at its highest, added over the processes (a process
    started within counts whole). Points that rest on how an answer was computed (in place, without a large
    intermediate) are read here, never from what the student's process says. ``fresh``: the block runs in a
    new student's process that has loaded nothing of the copy's (``Connection.fresh``), so memory the code set
    aside before the block counts as growth."""

    def __init__(self, connection: Connection, fresh: bool = False):
        self.connection, self.fresh, self.cpu_s, self.peak_bytes = connection, fresh, 0.0, 0

    def __enter__(self) -> Watch:
        if self.fresh:                            # memory set aside before the block would not be seen to grow
            self.connection.fresh()
        elif self.connection.proc is None:
            self.connection.start()
        self.cpu0 = sum(map(cpu_ticks, self.tree()))
        self.rss0 = {}
        for pid in self.tree():
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")                # its peak resident set ("high water mark") starts again from now
            except OSError as e:
                raise RuntimeError(f"the grader cannot watch the process running your code ({e.strerror})") from None
            self.rss0[pid] = status_kib(pid, "VmHWM")
        return self

    def cpu_so_far(self) -> float:
        """The CPU seconds spent since the block began (a test may stop a run that is already over its limit)."""
        return (sum(map(cpu_ticks, self.tree())) - self.cpu0) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc) -> None:
        tree = self.tree()
        peaks = {pid: status_kib(pid, "VmHWM") for pid in tree}
        self.cpu_s = (sum(map(cpu_ticks, tree)) - self.cpu0) / os.sysconf("SC_CLK_TCK")
        self.peak_bytes = 1024 * sum(max(0, peak - self.rss0.get(pid, 0)) for pid, peak in peaks.items())
        if exc[0] is None and not all(peaks.get(pid) for pid in self.rss0):     # gone, or a zombie: its peak
            raise RuntimeError("the process running your code ended within a watched block, so what it spent "
                               "cannot be read")                                # went with it (read as 0)

    def tree(self) -> list[int]:
        """The process the test started (the room's wrapper, or the student's process) and all below it (none
        once it has stopped)."""
        if self.connection.proc is None:
            return []
        top = self.connection.proc.pid
        table = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        text = f.read().decode(errors="replace")
                    table[int(entry)] = int(text[text.rindex(")") + 2:].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
        found, frontier = [top], {top}
        while frontier:
            frontier = {pid for pid, parent in table.items() if parent in frontier and pid not in found}
            found += sorted(frontier)
        return found


def cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of a process, in clock ticks (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
        fields = text[text.rindex(")") + 2:].split()
        return sum(int(fields[i]) for i in (11, 12, 13, 14))       # fields 14-17 of proc(5)
    except (OSError, ValueError, IndexError):
        return 0


def status_kib(pid: int, key: str) -> int:
    """A line of /proc/PID/status in KiB (``VmHWM``, ``VmRSS``); 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), 0)
    except (OSError, ValueError, IndexError):
        return 0


def changed_inputs(tensors) -> str:
    """The message of ``InputChanged``: which tensors (their shapes and types), never their values."""
    said = ", ".join(f"shape {list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in list(tensors)[:3])
    return (f"your code wrote into a tensor the test passed it ({said}): a graded function must leave its inputs "
            "as they were (write into a copy: .clone(), or an out-of-place operation)")


class Remote:
    """An object that lives in the student's process."""

    def __init__(self, connection: Connection, key: int, kind: str):
        object.__setattr__(self, "_connection", connection)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_generation", connection.generation)

    def _ask(self, op: str, name: str | None = None, *args, **kwargs):
        if self._generation != self._connection.generation:
            raise RuntimeError(f"{self!r} belonged to a process running your code that has stopped")
        return self._connection.request(op, self._key, name, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __call__(self, *args, **kwargs):
        return self._ask("call", None, *args, **kwargs)

    def __enter__(self):
        return self._ask("method", "__enter__")

    def __exit__(self, *exc):
        self._ask("method", "__exit__", None, None, None)
        return False                            # an exception in the block is never the student's to swallow

    def __len__(self):
        return self._ask("method", "__len__")

    def __getitem__(self, key):
        return self._ask("method", "__getitem__", key)

    def __iter__(self):
        return iter(self._ask("list"))

    def __repr__(self):
        return f"<the student's {self._kind}>"


class Adapters(types.ModuleType):
    """``adapters`` as the tests see it: each attribute is asked of the student's ``adapters`` module."""

    def __init__(self, connection: Connection):
        super().__init__("adapters")
        self._connection = connection
        connection.forget = self._forget

    def _forget(self):
        for name in [n for n, v in vars(self).items() if isinstance(v, Remote)]:
            delattr(self, name)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = self._connection.request("getattr", 0, name)
        if isinstance(value, Remote):           # a function of the adapters: asked once
            setattr(self, name, value)
        return value

    def harness(self, name: str, *args):
        """The tests' watches, run beside the student's code (course/sandbox/student_process.py ``Server.harness``)."""
        return self._connection.request("harness", None, name, args)

    def launch(self, file: str, kernel: str, grid, *args, **meta) -> None:
        """``kernel[grid](*args, **meta)``: the copy's ``@triton.jit`` function ``kernel`` of ``file`` (a path in
        the copy), launched with the arguments the test's own wrapper computed, in a process that imports none
        of the copy's modules and checks the kernel is Triton's language alone. Mark the tensors it writes with
        ``oracle.written``."""
        if "_kernels" not in vars(self):
            self._kernels = self._connection.kernels_alone()
        self._kernels.request("method", 0, "launch", [file, kernel, [int(g) for g in grid], list(args), meta])

    def watch(self, fresh: bool = False) -> Watch:
        """Within: what the student's process and every process below it spend, read from outside it
        (``Watch``): no number it reports about itself counts. ``fresh``: in a new student's process, where the
        copy's code loads within the block (what it holds at import or kept from an earlier call counts)."""
        return Watch(self._connection, fresh)


def connect(student: str, adapters_file: str, site_dirs: list[str], dump: str, dump_after_s: float,
            home: str | None, nobody: bool, jail: list[str] | None = None, room: str | None = None) -> Adapters:
    """The stand-in; the conftest starts its student's process once the tests are read (in no test's time)."""
    return Adapters(Connection(student, adapters_file, site_dirs, dump, dump_after_s, home, nobody, jail=jail,
                               room=room))
