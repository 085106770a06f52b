"""A process that has imported the ``sessionstore`` CLI and forks one child per command.

Started by ``tests.cli_process`` (never imported): each request is one run of the CLI, in a
child forked from here with its own argv, environment, working directory, stdin, stdout and
stderr, and a real exit status. Only the interpreter's start-up and the imports are shared:
they cost 0.7-0.9 s of CPU per command (SQLAlchemy, SQLModel, pydantic, Celery), which was a
quarter of the suite's CPU when every CLI test started a fresh interpreter.

Nothing here may open a connection, start a thread or read a setting before the fork: the
children must start as a fresh ``sessionstore`` would. What they cannot have fresh: the hash
seed (one per zygote), what the preloaded packages read from the environment when they
were imported (``tests.cli_process`` execs when such a variable differs), and the values
the preloaded modules make once (``core.broker``'s process image id, which a fork's own pid
and start time already tell apart).

Protocol on the two file descriptors given in argv: a 4-byte big-endian length, then a
pickled request ``{args, env, cwd, stdin, timeout}``; the answer is framed the same way:
``{returncode, stdout, stderr, timed_out}``.
"""

from __future__ import annotations

import atexit
import os
import pickle
import selectors
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

# Third-party packages, and the project's modules that commands import: importing the
# project (core.store and what it pulls in, the CLI, the Celery app) was 0.2 s of the
# ~0.27 s of CPU a forked command took, a sixth of the whole suite's CPU over its ~1,500
# commands. None of them reads a setting, opens a connection or starts a thread when
# imported (each is a function's work). What preloading hides, a fresh process still
# meets, and other tests run it: a name a module uses without importing it (ruff's F821 and
# mypy refuse it), a submodule used as an attribute (``import alembic; alembic.command``)
# or an import cycle only one order of imports trips: the tests that run the executable
# (every command's --help, the start-up tests, ``SESSIONSTORE_TEST_CLI=exec``).
PRELOAD = (
    "sqlalchemy",
    "sqlalchemy.orm",
    "sqlmodel",
    "pydantic",
    "pydantic_settings",
    "typer",
    "click",
    "celery",
    "kombu",
    "alembic",
    "rich",
    "orjson",
    "platformdirs",
    "tasks.cli",
    "core.store",
    "core.interop.importer",
    "core.maintenance",
    "tasks.app",
)
SETUP_FAILED = "cli_zygote: the child could not be set up: "


def _preload() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)


def send(fd: int, message: Any) -> None:
    """Write ``message`` framed: its pickle's length (4 bytes, big-endian), then it."""
    body = pickle.dumps(message)
    view = memoryview(struct.pack(">I", len(body)) + body)
    while view:
        view = view[os.write(fd, view) :]


def receive(fd: int) -> Any | None:
    """The next framed message, or None when the other end has closed."""
    header = _read_exact(fd, 4)
    body = None if header is None else _read_exact(fd, struct.unpack(">I", header)[0])
    return None if body is None else pickle.loads(body)


def _read_exact(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _child(request: dict[str, Any], fds: tuple[int, int, int], close: list[int]) -> None:
    """In the forked child: become ``sessionstore <args>`` and exit with its status."""
    code: Any = 1
    try:
        try:
            for fd in close:
                os.close(fd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            time.tzset()
            tempfile.tempdir = None  # TMPDIR from this command's environment
            sys.argv = [request["exe"], *request["args"]]
        except BaseException as exc:  # the client raises it: never a silent exit status
            os.write(2, f"{SETUP_FAILED}{exc!r}".encode())
            os._exit(255)
        try:
            from tasks.cli import main

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
        # What the interpreter does at exit: wait for non-daemon threads, run atexit
        # (logging.shutdown...), flush stdout and stderr.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                code = 120  # as the interpreter does when flushing stdout fails at exit
    finally:
        os._exit(code & 0xFF if isinstance(code, int) else 1)


def _run(request: dict[str, Any], control: tuple[int, int]) -> dict[str, Any]:
    """Fork the child with pipes for stdin, stdout and stderr, as ``subprocess.run`` gives
    it; feed stdin, read both outputs to their end and reap the child, all within the
    timeout (as ``communicate``: a grandchild holding stdout open keeps the run going)."""
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(request, (stdin_r, out_w, err_w), [*control, stdin_w, out_r, err_r])
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    pending = memoryview(request["stdin"] or b"")
    if not pending:
        os.close(stdin_w)
        stdin_w = -1
    outputs = {out_r: bytearray(), err_r: bytearray()}
    deadline = time.monotonic() + request["timeout"]
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for fd in outputs:
            selector.register(fd, selectors.EVENT_READ)
        if stdin_w >= 0:
            selector.register(stdin_w, selectors.EVENT_WRITE)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            for key, _ in selector.select(left):
                fd = key.fd
                if fd == stdin_w:
                    try:
                        pending = pending[os.write(fd, pending[:65536]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(fd)
                        os.close(fd)
                        stdin_w = -1
                    continue
                chunk = os.read(fd, 65536)
                if chunk:
                    outputs[fd] += chunk
                else:
                    selector.unregister(fd)
    for fd in (stdin_w, out_r, err_r):
        if fd >= 0:
            os.close(fd)
    _, status = os.waitpid(pid, 0)
    return {
        "returncode": os.waitstatus_to_exitcode(status),
        "stdout": bytes(outputs[out_r]),
        "stderr": bytes(outputs[err_r]),
        "timed_out": timed_out,
    }


def main() -> None:
    requests, answers = int(sys.argv[1]), int(sys.argv[2])
    # As the console script: the first import path is the executable's directory.
    sys.path[0] = os.path.dirname(sys.argv[3])
    _preload()
    while (request := receive(requests)) is not None:  # None: the test process went away
        send(answers, _run(request, (requests, answers)))


if __name__ == "__main__":
    main()
