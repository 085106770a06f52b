"""A newcomer's first minutes: clone, then the README's two commands exactly as written.

CI is that newcomer: ``.ci/run`` runs on a fresh clone, reads the two commands from the
README's "Two commands" block, runs the demo command first (it creates ``.venv`` from
nothing), twice, and the test command last. (This test used to make a clone of its own and
install it again inside the suite: a second install of every dependency, 40 s of CPU, on
every run.) Here: that ``.ci/run`` reads the README as a newcomer would, and refuses a
README whose block is not the demo command, then the test command.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT


def _readme_commands(readme: str) -> list[str]:
    block = re.search(r"## Two commands\s+```bash\n(.*?)```", readme, re.S)
    assert block, "README has no 'Two commands' block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]


def _ci_reads(tmp_path: Path, readme: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(readme)
    return subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run"), "--print-readme-commands"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_ci_runs_the_readme_commands_as_written(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    demo_cmd, test_cmd = _readme_commands(readme)
    assert "demo" in demo_cmd and "test" in test_cmd
    done = _ci_reads(tmp_path, readme)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [demo_cmd, test_cmd]
    ci = (ROOT / ".ci" / "run").read_text()
    # the demo command (it creates .venv) comes before anything else uses .venv
    assert ci.index('bash -c "${readme[0]}"') < ci.index(".venv/bin/"), "demo first"
    assert ci.rstrip().endswith('bash -c "${readme[1]}"'), "the test command last"
    # ...with the service tests mandatory: under CI a PostgreSQL, Redis, node or S3 test
    # fails instead of skipping (tests/conftest.py reads this variable)
    code = [line.strip() for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    assert code[-2:] == ["export SESSIONSTORE_REQUIRE_SERVICES=1", 'bash -c "${readme[1]}"']


@pytest.mark.parametrize(
    "block",
    [
        "./bootstrap demo\n",  # one command
        "./bootstrap test\n./bootstrap demo\n",  # the wrong order
        "./bootstrap demo\n./bootstrap test\n./bootstrap lint\n",  # three
    ],
)
def test_ci_refuses_a_readme_without_the_two_commands(tmp_path: Path, block: str) -> None:
    done = _ci_reads(tmp_path, f"# x\n\n## Two commands\n\n```bash\n{block}```\n")
    assert done.returncode == 1 and "'Two commands' block" in done.stderr
