"""Run the ``sessionstore`` command as ``subprocess.run([EXE, ...], capture_output=True,
text=True)`` would, in a child forked from a process that has already imported the CLI.

Each command still runs in a process of its own, through ``tasks.cli.main`` as the console
script calls it, with the environment, working directory and exit status it is given and
pipes for stdin, stdout and stderr; what is shared is the interpreter's start-up and the
third-party imports (``tests/cli_zygote.py`` says which, and what that cannot make fresh).
``tests/acceptance/test_cli_process.py`` checks the two ways agree, byte for byte.

``SESSIONSTORE_TEST_CLI=exec`` runs every command with a fresh interpreter instead; so does a
request whose environment changes what Python reads only at start-up (``PYTHON*``, locale).
Tests about start-up itself (imports, ``--help`` speed, signals) call the executable.
"""

from __future__ import annotations

import atexit
import locale
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.cli_zygote import SETUP_FAILED, receive, send

EXE = shutil.which("sessionstore") or str(Path(sys.executable).parent / "sessionstore")
_ZYGOTE = Path(__file__).with_name("cli_zygote.py")
# What the interpreter reads once, at start-up, and what the preloaded packages read when
# imported (typer's rich switch, Celery's and kombu's flags): a child of the zygote would
# keep the zygote's values, so a command whose environment changes one of them execs.
_STARTUP_VARS = ("PYTHON", "LANG", "LC_", "TYPER", "_TYPER", "CELERY", "KOMBU", "C_")


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_VARS)}


class _Zygote:
    def __init__(self) -> None:
        requests_r, self._requests = os.pipe()
        self._answers, answers_w = os.pipe()
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, str(_ZYGOTE), str(requests_r), str(answers_w), EXE],
            pass_fds=(requests_r, answers_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=self.env,
        )
        os.close(requests_r)
        os.close(answers_w)
        self.answered = 0  # commands this zygote ran (tests tell a fork from an exec by it)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            send(self._requests, request)
            answer: dict[str, Any] | None = receive(self._answers)
        except BrokenPipeError:
            answer = None
        if answer is None:
            raise RuntimeError(f"the CLI zygote died (exit {self.proc.wait()})")
        self.answered += 1
        return answer

    def close(self) -> None:
        if self._requests < 0:
            return
        os.close(self._requests)
        os.close(self._answers)
        self._requests = self._answers = -1
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_idle: list[_Zygote] = []
_all: list[_Zygote] = []
_lock = threading.Lock()


@atexit.register
def _close_all() -> None:
    for zygote in _all:
        zygote.close()


def _decode(data: bytes) -> str:
    # As subprocess's text mode: the locale's encoding, universal newlines.
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    input: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([EXE, *args], capture_output=True, text=True, check=False, ...)``,
    except that ``input=None`` gives the command an empty stdin, not the test's own."""
    env = dict(os.environ if env is None else env)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError(f"environment values must be strings: {env!r}")
    directory = os.path.abspath(cwd if cwd is not None else os.getcwd())
    if not os.path.isdir(directory):  # as subprocess raises it
        raise FileNotFoundError(2, "No such file or directory", str(cwd))
    forked = os.environ.get("SESSIONSTORE_TEST_CLI", "fork") != "exec"
    with _lock:
        zygote = _idle.pop() if _idle else None
    if zygote is not None and zygote.proc.poll() is not None:  # it died between commands
        zygote.close()
        zygote = None
    if forked and zygote is None:
        zygote = _Zygote()
        with _lock:
            _all.append(zygote)
    if not forked or zygote is None or _startup_env(env) != _startup_env(zygote.env):
        if zygote is not None:
            with _lock:
                _idle.append(zygote)
        return subprocess.run(
            [EXE, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            input=input,
            timeout=timeout,
            check=False,
        )
    try:
        answer = zygote.ask(
            {
                "exe": EXE,
                "args": list(args),
                "env": env,
                "cwd": directory,
                "stdin": None if input is None else input.encode(locale.getpreferredencoding()),
                "timeout": timeout,
            }
        )
    except BaseException:
        zygote.close()  # in an unknown state: the next command starts another
        raise
    with _lock:
        _idle.append(zygote)
    stdout, stderr = _decode(answer["stdout"]), _decode(answer["stderr"])
    if answer["returncode"] == 255 and stderr.startswith(SETUP_FAILED):
        raise RuntimeError(stderr)
    if answer["timed_out"]:
        raise subprocess.TimeoutExpired([EXE, *args], timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess([EXE, *args], answer["returncode"], stdout, stderr)
