"""Every README code block runs, as written, in a fresh temporary directory with a fresh HOME.

Shell blocks run line by line with ``bash -e`` (the venv's ``sessionstore`` on PATH);
Python blocks run in a new interpreter; SQL blocks run on a migrated PostgreSQL database.
Placeholders in capitals (SESSION, ARTIFACT) are replaced by real ids, and the broker of
the Celery-client block by the test Redis. The only lines not run are listed in
``NOT_RUN`` with the reason; the test fails if one of them leaves the README.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from core.settings import Settings
from core.store import SessionStore
from tests.support import ROOT, clean_env

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(bash|sh|python|sql)\n(.*?)^```", README, re.S | re.M)
NOT_RUN = {
    "./bootstrap test": "it is this test suite",
    "docker compose up -d": "needs Docker (tests/test_compose.py checks compose.yaml)",
    "docker compose run --rm worker sessionstore sessions list": "needs Docker",
}


def _blocks(kind: str) -> list[str]:
    return [body for lang, body in BLOCKS if lang in kind.split("|")]


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = clean_env(HOME=str(home), PATH=path)
    env.pop("XDG_DATA_HOME", None)
    return cwd, env


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    assert len(_blocks("python")) >= 3 and len(_blocks("bash|sh")) >= 3 and _blocks("sql")
    for line in NOT_RUN:
        assert line in README, f"NOT_RUN lists a line the README lost: {line}"


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
@pytest.mark.redis
def test_python_block(index: int, sandbox: tuple[Path, dict[str, str]], redis_url: str) -> None:
    cwd, env = sandbox
    code = _blocks("python")[index].replace("redis://localhost:6379/0", redis_url)
    result = _run([sys.executable, "-c", code], cwd, env)
    assert result.returncode == 0, f"README python block {index}:\n{code}\n{result.stderr}"
    assert list(cwd.iterdir()) == [], "a README block wrote into the current directory"


def _seed(home: Path) -> dict[str, str]:
    """A session with a few events and an artifact in the default data dir of ``home``."""
    data = home / ".local/share/sessionstore"
    with SessionStore.from_settings(Settings(data_dir=data)) as store:
        session = store.create_session(tenant_id="acme", title="readme")
        store.append(
            session.id,
            [
                {
                    "type": "message",
                    "id": f"m{n}",
                    "parentId": None if n == 0 else f"m{n - 1}",
                    "message": {"role": "assistant" if n % 2 else "user", "content": "hi"},
                }
                for n in range(41)
            ],
        )
        big = store.store_oversized(session.id, "a long tool log\n" * 2000, "bash")
        assert big is not None
        return {"SESSION": session.id, "ARTIFACT": big.ref.artifact_id}


def _shell_lines() -> list[str]:
    lines = []
    for body in _blocks("bash|sh"):
        for raw in body.splitlines():
            line = raw.split("  #")[0].strip()
            if line and not line.startswith("#") and line not in NOT_RUN:
                lines.append(line)
    return lines


@pytest.mark.slow
def test_shell_blocks(sandbox: tuple[Path, dict[str, str]]) -> None:
    cwd, env = sandbox
    ids = _seed(Path(env["HOME"]))
    for line in _shell_lines():
        command = line.replace("./bootstrap", str(ROOT / "bootstrap"))
        for name, value in ids.items():
            command = re.sub(rf"\b{name}\b", value, command)
        if "--follow" in command:
            command += " --limit 5 --timeout 20"
        result = _run(["bash", "-e", "-c", command], cwd, env)
        assert result.returncode == 0, f"README line failed: {line}\n{result.stderr[-2000:]}"
    assert list(cwd.iterdir()) == [], "a README command wrote into the current directory"


@pytest.mark.postgres
def test_sql_blocks(pg_url: str) -> None:
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as conn:
        for body in _blocks("sql"):
            for statement in body.split(";"):
                if statement.strip() and not all(
                    line.strip().startswith("--") or not line.strip()
                    for line in statement.splitlines()
                ):
                    conn.execute(statement)
