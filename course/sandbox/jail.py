"""
The room a student's code runs in while it is graded (Linux): a file system that holds the copy, its home folder
and the interpreter with its packages, and nothing else of the machine.

The grader starts it as ``python -I -S -B -c <this file's text> -- COMMAND...`` and writes SPEC, JSON, to its
standard input, not its arguments (which ``/proc/1/cmdline`` shows in the room):
``{"root": a new empty folder, "read": [...], "write": [...], "mask": [...], "user": "nobody"|"keep"}``.
Alone and single-threaded, it leaves the grader's mount, process-id, network and IPC namespaces (``unshare``),
forks process 1 of the new namespace, builds a root in an empty ``tmpfs`` (the system and SPEC's ``read``
read-only; at SPEC's ``write`` and ``/tmp`` fresh folders in memory of a bounded size; ``/dev``, ``/proc`` with
read-only kernel settings; SPEC's ``mask`` covered), moves into it (``pivot_root``), limits file sizes
(``FILE_BYTES``), as root drops to ``nobody`` (never uid 0), and runs COMMAND as process 2, which can start
no process (``no_new_processes``). Each step and why: course/README.md, section "The course's files" (what
it defends against: section "Threat model").

Any step that fails ends the program with exit code 125 and one line on standard error saying which; the
grader then grades unconfined and says so in the grade (``course.grade``'s note).
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
CLONE_NEWNET, CLONE_NEWIPC = 0x40000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")   # programs and libraries
#          (course/sandbox/confine.py JAIL_SYSTEM: the same)
DEVICES = ("null", "zero", "full", "random", "urandom")
KERNEL_SETTINGS = ("sys", "sysrq-trigger", "irq", "bus", "fs")     # of /proc: read-only in the room
NOBODY = 65534
FILE_BYTES = 256 << 20               # the largest file the student's code may write (its output included)
FOLDER_BYTES = 256 << 20             # what it may keep in its home, and again in /tmp (each a fresh tmpfs)
SHM_BYTES = 64 << 20                 # and in /dev/shm

libc = ctypes.CDLL(None, use_errno=True)


class Failed(Exception):
    """A step that failed: its name and why."""


def check(result: int, step: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise Failed(f"{step}: {os.strerror(errno)}")


def mount(source, target, fstype, flags, data=None) -> None:
    check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), f"mount {target}")


def enter_namespaces() -> None:
    """New mount, pid, network and IPC namespaces; as an ordinary user inside a user namespace of its own, where
    it keeps its own uid and gid."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
    check(libc.unshare(flags | (CLONE_NEWUSER if uid != 0 else 0)), "unshare")
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def place(source: str, root: str) -> str:
    """The path ``source`` has under ``root``, created as what it is (a folder or an empty file); a link keeps
    its target (``/lib -> usr/lib``), so it is made as the same link."""
    target = root + source
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(source) and not os.path.lexists(target):
        os.symlink(os.readlink(source), target)
    elif os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    elif not os.path.lexists(target):
        open(target, "w").close()
    return target


def bind(source: str, root: str, writable: bool) -> None:
    """``source`` read-only at its path under ``root``; or, ``writable``, a fresh folder of ``FOLDER_BYTES`` in
    memory at that path: what the code writes there never reaches the machine's disk, and a file cap alone
    would let it write file after file."""
    if not os.path.lexists(source):
        return
    target = place(source, root)
    if os.path.islink(source):
        return                                       # the link itself; what it points to is bound on its own
    if writable:
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={FOLDER_BYTES}")
        return
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(spec: dict) -> None:
    """Step 3: the new root's mounts, under ``spec["root"]``."""
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)       # nothing mounted here reaches the grader's namespace
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    for d in ("tmp", "dev", "proc"):
        os.makedirs(f"{root}/{d}")
    mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={FOLDER_BYTES}")
    paths = [(p, False) for p in (*SYSTEM, *spec["read"])] + [(p, True) for p in spec["write"]]
    for source, writable in sorted(paths, key=lambda pw: pw[0].count("/")):    # a folder before what is in it
        bind(os.path.normpath(source), root, writable)
    for path in spec["mask"]:
        target = root + os.path.normpath(path)
        if not os.path.lexists(target) or os.path.islink(target):
            continue                                 # not shown by any bind mount: nothing to hide
        if os.path.isdir(target):
            mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=555")
        else:
            mount("/dev/null", target, None, MS_BIND)
    mount("tmpfs", f"{root}/dev", "tmpfs", MS_NOSUID, "mode=755")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(f"{root}/dev/shm")
    mount("tmpfs", f"{root}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={SHM_BYTES}")
    # read-only: no file of it opens for writing, so the code cannot reset the peak memory the grader reads
    # (/proc/self/clear_refs: a Kronecker product built, freed, then its peak forgotten, scored 24 / 24)
    mount("proc", f"{root}/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in KERNEL_SETTINGS:                      # the machine's settings: nobody may write them, and the
        target = f"{root}/proc/{name}"                # room does not rely on the two alone
        if os.path.lexists(target):
            mount(target, target, None, MS_BIND | MS_REC)
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def enter_root(root: str) -> None:
    """Step 4: ``root`` becomes ``/``; the old root is unmounted, so nothing of it can be reached."""
    if SYS_PIVOT_ROOT is None:
        raise Failed(f"pivot_root: unknown on {platform.machine()}")
    os.chdir(root)
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "unmount the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges(user: str) -> None:
    """Step 5: as root, to nobody; no new privileges either way (no setuid program). Never uid 0."""
    if user == "nobody":
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")
    if 0 in (*os.getresuid(), *os.getresgid()):
        raise Failed(f"user {user!r}: the student's code would run as root (uid or gid 0); refused")


# The filter that leaves the student's code without new processes (seccomp, in classic BPF): fork, vfork and clone
# without CLONE_THREAD fail with EPERM, clone3 with ENOSYS (so that threads are made by clone, whose flags the
# filter reads); x32's numbers fail too, and so does every call of another architecture (i386's through int 0x80,
# whose fork this filter, reading x86_64's numbers, let through). A child's CPU time and memory could escape the
# grader's watch (a child reaped by the kernel counts to no process: a torch.cat append in helper processes scored
# 27 / 27, a Kronecker product in a child 24 / 24), so the code runs alone, with as many threads as it likes.
SECCOMP = {"x86_64": (0xC000003E, 56, 57, 58), "aarch64": (0xC00000B7, 220, -1, -1)}  # arch, clone, fork, vfork
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, CLONE_THREAD, CLONE3, X32 = 22, 2, 0x00010000, 435, 0x40000000
ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
KEYS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}      # add_key, request_key, keyctl


def no_new_processes() -> None:
    """Step 6: the filter above, for this process and what it runs (never lifted: no new privileges)."""
    arch, clone, fork, vfork = SECCOMP[platform.machine()]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    program = [(load, 0, 0, 4), (jeq, 0, 9, arch), (load, 0, 0, 0), (jge, 7, 0, X32), (jeq, 7, 0, CLONE3),
               (jeq, 5, 0, fork & 0xFFFFFFFF), (jeq, 4, 0, vfork & 0xFFFFFFFF), (jeq, 0, 2, clone),
               (load, 0, 0, 16), (jset, 0, 1, CLONE_THREAD), (ret, 0, 0, ALLOW), (ret, 0, 0, EPERM),
               (ret, 0, 0, ENOSYS)]

    install_filter(program, "no new processes (seccomp)")
    # and no kernel keyring (add_key, request_key, keyctl fail with EPERM): a keyring belongs to no namespace, so
    # nobody's user keyring carried a key from one grade to the next, and the grader's session keyring, inherited,
    # took a student's keys (a red-team helper's probes); another architecture's calls the filter above refuses
    add_key, request_key, keyctl = KEYS[platform.machine()]
    install_filter([(load, 0, 0, 4), (jeq, 0, 4, arch), (load, 0, 0, 0), (jeq, 3, 0, add_key),
                    (jeq, 2, 0, request_key), (jeq, 1, 0, keyctl), (ret, 0, 0, ALLOW), (ret, 0, 0, EPERM)],
                   "no keyring (seccomp)")


def install_filter(program: list[tuple[int, int, int, int]], what: str) -> None:
    """A seccomp filter (classic BPF: code, jump if true, jump if false, k per instruction) for this process and
    what it runs; filters add up, each call the strictest of their answers."""
    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]
    code = (Instruction * len(program))(*program)
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(Program(len(program), code)), 0, 0), what)


def init(spec: dict, command: list[str], status_w: int) -> None:
    """Process 1 of the new namespaces: builds the room, then starts COMMAND as process 2 and waits for it. A
    process 1 ignores every signal it has no handler for (``abort()`` would not end it), so the student's code
    is not that process; when it ends, this one sends its wait status to the parent and exits, and the kernel
    ends every process left in the namespace."""
    cwd = os.getcwd()
    build_root(spec)
    enter_root(spec["root"])
    drop_privileges(spec["user"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))   # no file it writes (its output to
    #                                                           the grader's dump among them) fills the disk
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)     # the parent killed: this goes too (set after the
    #                                                           change of user, which clears it)
    os.chdir(cwd)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)   # the student's code cannot trace this process (from before the
    pid = os.fork()                           # fork: its exec makes the child dumpable again, this stays not)
    if pid == 0:
        try:
            no_new_processes()
        except Failed as e:
            print(f"jail: {e}", file=sys.stderr, flush=True)
            os._exit(125)
        os.execve(command[0], command, dict(os.environ))   # the status pipe closes here (not inheritable)
    os.closerange(0, status_w)
    os.closerange(status_w + 1, 1 << 16)
    _, status = os.waitpid(pid, 0)
    os.write(status_w, status.to_bytes(4, "little"))
    os._exit(0)


def read_spec() -> dict:
    """SPEC from standard input (to its end), which then reads ``/dev/null``."""
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return json.loads(b"".join(chunks))


def main(argv: list[str]) -> None:
    command = argv[1:]                                      # after the "--"
    try:
        spec = read_spec()
    except (OSError, ValueError) as e:
        print(f"jail: no room specification on standard input ({e})", file=sys.stderr, flush=True)
        os._exit(125)
    try:
        enter_namespaces()
        status_r, status_w = os.pipe()                      # process 1 -> here: the student's wait status
        pid = os.fork()
    except (Failed, OSError) as e:
        print(f"jail: {e}", file=sys.stderr, flush=True)
        os._exit(125)
    if pid == 0:
        try:
            os.close(status_r)
            init(spec, command, status_w)
        except (Failed, OSError) as e:
            print(f"jail: {e}", file=sys.stderr, flush=True)
        os._exit(125)
    os.close(status_w)
    os.closerange(3, status_r)       # the pipes are the student's alone: its death reaches the tests as end of file
    os.closerange(status_r + 1, 1 << 16)
    _, own = os.waitpid(pid, 0)
    said = os.read(status_r, 4)
    status = int.from_bytes(said, "little") if len(said) == 4 else own      # the student's, else process 1's
    if os.WIFSIGNALED(status):                                               # end as the student's code did
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
