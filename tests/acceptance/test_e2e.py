"""A newcomer's first minutes: clone, then the README's two commands exactly as written."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Two commands\s+```bash\n(.*?)```", readme, re.S)
    assert block, "README has no 'Two commands' block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_fresh_clone_runs_the_readme_commands(tmp_path: Path) -> None:
    demo_cmd, test_cmd = _readme_commands()
    assert "demo" in demo_cmd and "test" in test_cmd
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SESSIONSTORE_", "VIRTUAL_ENV", "PYTHONPATH"))
    }
    env["PATH"] = os.pathsep.join(
        p
        for p in env.get("PATH", "").split(os.pathsep)
        if ".venv" not in p and "/tmp/venv" not in p
    )

    demo = subprocess.run(
        demo_cmd,
        shell=True,
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    for needle in (
        "sessionstore demo",
        "events written",
        "bytes in",
        "blobs",
        "artifacts",
        "fork",
        "rebuilt transcript",
    ):
        assert needle in demo.stdout, demo.stdout[-3000:]
    again = subprocess.run(
        demo_cmd,
        shell=True,
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-3000:]  # safe to run twice

    # The inner run re-runs only the smoke tests (running the whole suite inside itself
    # would recurse and double CI time), in one process: four workers would each import
    # and collect all 1,600 tests to run five (37 s of CPU instead of 15, taken from the
    # tests running beside this one). The command itself is exactly the README's.
    inner = subprocess.run(
        test_cmd,
        shell=True,
        cwd=clone,
        env={**env, "SESSIONSTORE_E2E_INNER": "1", "PYTEST_ADDOPTS": "-n 0"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert inner.returncode == 0, inner.stdout[-3000:] + inner.stderr[-3000:]
    assert re.search(r"\d+ passed", inner.stdout), inner.stdout[-2000:]
