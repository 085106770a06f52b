"""pi itself as the oracle: ``tests/pi_oracle`` (package.json + lockfile, ``npm ci``) and a
node script that runs pi's ``SessionManager`` on a copy of a session file.

A missing node or package FAILS the tests (CI must not pass without the oracle)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from core.interop.pi import agent_message
from core.query import SessionState

ORACLE_DIR = Path(__file__).parent / "pi_oracle"
FIXTURES = Path(__file__).parent / "fixtures" / "pi"
_PACKAGE = ORACLE_DIR / "node_modules" / "@mariozechner" / "pi-coding-agent" / "package.json"
_lock = threading.Lock()


def ensure_oracle() -> None:
    """Install the oracle from its lockfile once (``npm ci``); fail if node or npm is missing."""
    with _lock:
        if _PACKAGE.exists():
            return
        node, npm = shutil.which("node"), shutil.which("npm")
        if node is None or npm is None:
            pytest.fail("node and npm are required: pi is the oracle of these tests")
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
            cwd=ORACLE_DIR,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0 or not _PACKAGE.exists():
            pytest.fail(f"npm ci in {ORACLE_DIR} failed: {done.stderr[-2000:]}")


def _node(*args: str) -> Any:
    ensure_oracle()
    node = shutil.which("node")
    assert node is not None
    done = subprocess.run(
        [node, "oracle.mjs", *args], cwd=ORACLE_DIR, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        pytest.fail(f"pi oracle failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def pi_context(path: Path, at: list[int] | None = None) -> dict[str, Any]:
    """{header, entries, leaf, at: {index: context}} as pi builds them (on a copy of
    ``path``); ``at`` are entry indexes (header excluded)."""
    result: dict[str, Any] = _node("context", str(path), *map(str, at or []))
    return result


def pi_contexts(paths: list[Path]) -> list[dict[str, Any]]:
    """``pi_context`` of each file (no ``at``), in one node process."""
    result: list[dict[str, Any]] = _node("contexts", *map(str, paths))
    return result


def pi_opened(paths: list[Path]) -> list[dict[str, Any]]:
    """[{header, entries}] of each file as pi opens it (on copies), in one node process."""
    result: list[dict[str, Any]] = _node("opened", *map(str, paths))
    return result


def pi_append(path: Path, message: dict[str, Any]) -> str:
    """Append a message to the file itself through pi's SessionManager; its entry id."""
    return str(_node("append", str(path), json.dumps(message))["id"])


def our_context(state: SessionState) -> dict[str, Any]:
    """Our state in the shape of pi's ``SessionContext`` (messages as pi's AgentMessages)."""
    model = state.info.model
    return {
        "messages": [agent_message(m.role, m.data) for m in state.messages],
        "thinkingLevel": state.info.thinking_level or "off",
        "model": None if model is None else {"provider": model.provider, "modelId": model.model_id},
    }


def as_json(value: Any) -> Any:
    """A value as it comes back from JSON.stringify / JSON.parse (None keys dropped)."""
    return json.loads(json.dumps(value))
