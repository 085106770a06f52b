"""A process that has imported the ``sessionstore`` CLI and forks one child per command.

Started by ``tests.cli_process`` (never imported): each request is one run of the CLI, in a
child forked from here with its own argv, environment, working directory, stdin, stdout and
stderr, and a real exit status. Only the interpreter's start-up and the imports are shared:
they cost 0.7-0.9 s of CPU per command (SQLAlchemy, SQLModel, pydantic, Celery), which was a
quarter of the suite's CPU when every CLI test started a fresh interpreter.

Nothing here may open a connection, start a thread or read a setting before the fork: the
children must start as a fresh ``sessionstore`` would.

Protocol on the two file descriptors given in argv: a 4-byte big-endian length, then a
pickled request ``{args, env, cwd, stdin, timeout}``; the answer is framed the same way:
``{returncode, stdout, stderr, timed_out}``.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import sys
import tempfile
import time
import traceback
from typing import Any


def _preload() -> None:
    import importlib

    import tasks.cli

    for module in sorted({module for module, _ in tasks.cli.COMMANDS.values()}):
        importlib.import_module(module)
    # What nearly every command imports in its body (see tasks/cli/__init__.py).
    for module in (
        "tasks.cli.failures",
        "core",
        "core.store",
        "core.settings",
        "core.migrate",
        "tasks.app",
        "alembic.command",
        "alembic.script",
        "rich.console",
        "rich.table",
        "rich.progress",
    ):
        importlib.import_module(module)


def _read_exact(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _child(request: dict[str, Any], fds: tuple[int, int, int], control: tuple[int, int]) -> None:
    """In the forked child: become ``sessionstore <args>`` and exit with its status."""
    code: Any = 1
    try:
        for fd in control:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        time.tzset()
        sys.argv = [request["exe"], *request["args"]]
        from tasks.cli import main

        try:
            main()  # as the console script does: sys.exit(main())
            code = 0
        except SystemExit as exc:  # as the interpreter reports it
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # what the interpreter runs at exit (logging.shutdown...)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                code = 120  # as the interpreter does when flushing stdout fails at exit
    finally:
        os._exit(code & 0xFF if isinstance(code, int) else 1)


def _run(request: dict[str, Any], control: tuple[int, int]) -> dict[str, Any]:
    stdin = tempfile.TemporaryFile()
    stdin.write(request["stdin"] or b"")
    stdin.seek(0)
    stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        _child(request, (stdin.fileno(), stdout.fileno(), stderr.fileno()), control)
    stdin.close()
    pidfd = os.pidfd_open(pid)
    timed_out = False
    try:
        ready, _, _ = select.select([pidfd], [], [], request["timeout"])
        if not ready:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    outputs = []
    for stream in (stdout, stderr):
        stream.seek(0)
        outputs.append(stream.read())
        stream.close()
    return {
        "returncode": os.waitstatus_to_exitcode(status),
        "stdout": outputs[0],
        "stderr": outputs[1],
        "timed_out": timed_out,
    }


def main() -> None:
    requests, answers = int(sys.argv[1]), int(sys.argv[2])
    # As the console script: the first import path is the executable's directory.
    sys.path[0] = os.path.dirname(sys.argv[3])
    _preload()
    while True:
        header = _read_exact(requests, 4)
        if header is None:  # the test process went away
            return
        body = _read_exact(requests, struct.unpack(">I", header)[0])
        if body is None:
            return
        answer = pickle.dumps(_run(pickle.loads(body), (requests, answers)))
        os.write(answers, struct.pack(">I", len(answer)))
        view = memoryview(answer)
        while view:
            view = view[os.write(answers, view) :]


if __name__ == "__main__":
    main()
