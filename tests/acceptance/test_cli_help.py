"""Every command's and subcommand's ``--help`` renders, and none imports the heavy modules."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import clean_env

EXE = shutil.which("sessionstore") or str(Path(sys.executable).parent / "sessionstore")

# Runs in a fresh interpreter: walks the command tree, calls main([..., "--help"]) for every
# path, and reports per path whether it rendered and which heavy modules got imported.
_WALK = r"""
import contextlib, io, json, sys
from typer import _click
from typer.core import TyperGroup
from tasks.cli import COMMANDS, app, main
import typer

HEAVY = ("celery", "kombu", "sqlalchemy", "alembic", "psycopg", "core.store", "tasks.app",
         "rich.console")
root = typer.main.get_command(app)
ctx = _click.Context(root)
paths = [[]]
def walk(cmd, path):
    if isinstance(cmd, TyperGroup):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            paths.append(path + [name])
            walk(sub, path + [name])
for name in COMMANDS:
    paths.append([name])
    walk(root.get_command(ctx, name), [name])
out = {}
for path in paths:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main([*path, "--help"])
            code = 0
        except SystemExit as exc:
            code = exc.code
    out[" ".join(path)] = {"code": code, "text": buf.getvalue()}
heavy = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in HEAVY))
print(json.dumps({"helps": out, "heavy": heavy}))
"""


@pytest.fixture(scope="module")
def walked() -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", _WALK], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


@pytest.mark.smoke
def test_every_help_renders(walked: dict[str, object]) -> None:
    helps = walked["helps"]
    assert isinstance(helps, dict)
    assert {"", "read", "events", "db upgrade", "db history", "queue status"} <= set(helps)
    assert len(helps) > 30
    for path, shown in helps.items():
        assert shown["code"] in (0, None), path
        assert shown["text"].startswith("Usage: sessionstore"), (path, shown["text"][:200])
        if path:
            assert "--help" in shown["text"], path


def test_no_help_imports_a_heavy_module(walked: dict[str, object]) -> None:
    # The registration rule of tasks/cli/__init__.py: heavy imports inside command bodies.
    assert walked["heavy"] == []


@pytest.mark.parametrize("command", ["read", "events"])
def test_the_reported_helps_render_in_full(command: str) -> None:
    result = subprocess.run(
        [EXE, command, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    if command == "read":  # the [/path|?q=…] that rich took for markup
        assert "agent://ID[/path|?q=…]" in result.stdout
    else:  # the [default: …] text that rich swallowed
        assert "none with --follow" in " ".join(result.stdout.split())
        assert "--after-position" in result.stdout and "Ctrl-C" in result.stdout


_EMBEDDED = r"""
import contextlib, io, json, sys
from tasks.cli import main
def run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
    return code, out.getvalue()


codes = [run(["db", "upgrade"])[0]]
code, created = run(["sessions", "create", "--json"])
codes.append(code)
session = json.loads(created)["id"]
codes += [run(["append", session, "-"])[0], run(["sessions", "list", "--json"])[0]]
loaded = sorted(m for m in sys.modules if m.startswith("psycopg"))
print(json.dumps({"codes": codes, "psycopg": loaded}))
"""


def test_embedded_commands_never_load_the_postgresql_driver(tmp_path: Path) -> None:
    """On SQLite no psycopg error can exist, so the error translation does not import psycopg
    to recognize its errors: a tenth of a second of every embedded command."""
    env = clean_env(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", _EMBEDDED],
        input='{"type": "message", "id": "m1"}\n',
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["codes"] == [0, 0, 0, 0], result.stderr
    assert report["psycopg"] == []
