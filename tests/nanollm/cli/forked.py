"""
A process that imports torch once, then runs each command line it is sent in a fork of itself, as
``python ARGS`` would in a fresh process: the command's argv, working folder and ``sys.path[0]``, its own
standard output and error (the caller sees exactly what it printed), its exit status, Python's traceback
for an exception that escapes. test_cli.py's table of bad command lines runs about fifty commands that each
stop at their arguments; a fresh interpreter would spend about 3 of each one's 3.4 s importing torch.

What a fork cannot show, a fresh process can: a warning printed while torch is imported (the parent's, not
the command's). The other tests of the commands start fresh processes.

Protocol: one JSON line per command on stdin, {"args": [...], "cwd": "...", "timeout": s}; one JSON line
back on stdout, {"returncode": n, "stdout": "...", "stderr": "..."} (returncode -14: the timeout's SIGALRM).
"""

import json
import os
import runpy
import signal
import sys
import tempfile
import traceback

import torch  # noqa: F401  (what every command imports first)


def run(args: list[str], cwd: str, timeout: float, out: int, err: int) -> None:
    """In the child: the command, then exit with its status (never returns)."""
    os.chdir(cwd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    signal.alarm(max(1, int(timeout)))
    code = 0
    try:
        if args[0] == "-m":                               # python -m MODULE ...: the working folder first on the path
            sys.argv, sys.path[0] = [args[1], *args[2:]], cwd
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:                                             # python SCRIPT ...: the script's folder first on the path
            sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:                                 # noqa: BLE001  (as the interpreter would: traceback, 1)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                run(request["args"], request["cwd"], request["timeout"], out.fileno(), err.fileno())
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))
        print(json.dumps({"returncode": code, "stdout": texts[0], "stderr": texts[1]}), flush=True)


if __name__ == "__main__":
    main()
