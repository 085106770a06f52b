"""The real ``sessionstore`` executable: ``import`` of a directory holding an oh-my-pi tree
and a Claude Code project (auto-detected), ``stats`` per day and model, ``export --format
omp``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from tests.acceptance.test_cli import data_dir, run

__all__ = ["data_dir"]  # the fixture, used by name

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OMP_STEM = "2026-01-22T08-30-00-000Z_9b1e4c7a2f3d4e5f"
CLAUDE_ID = "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60"


def _objects(text: str) -> list[dict[str, object]]:
    """The JSON objects printed one after another (pretty-printed)."""
    decoder, found, index = json.JSONDecoder(), [], 0
    while index < len(text.rstrip()):
        value, end = decoder.raw_decode(text, index)
        found.append(value)
        index = end + (len(text[end:]) - len(text[end:].lstrip()))
    return found


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "in"
    shutil.copytree(FIXTURES / "omp" / "agent", root / "omp" / "agent")
    (root / "claude" / "-home-dev-dateparse").mkdir(parents=True)
    shutil.copy(
        FIXTURES / "claude_code" / f"{CLAUDE_ID}.jsonl", root / "claude" / "-home-dev-dateparse"
    )
    return root


def test_import_stats_and_export_omp(data_dir: Path, tmp_path: Path) -> None:
    root = _tree(tmp_path)
    done = run(data_dir, "import", str(root), "--tenant", "acme", "--json")
    assert done.returncode == 0, done.stderr
    results = _objects(done.stdout)
    # the subagent's explore.jsonl inside the artifacts directory is not a session of its own
    assert sorted(r["external_id"] for r in results) == [CLAUDE_ID, "9b1e4c7a2f3d4e5f"]
    assert {r["status"] for r in results} == {"created"}
    omp = next(r for r in results if r["external_id"] == "9b1e4c7a2f3d4e5f")
    assert omp["missing_blobs"] == ["blob:sha256:" + hashlib.sha256(b"gone").hexdigest()]
    again = run(data_dir, "import", str(root), "--tenant", "acme", "--json")
    assert [r["appended"] for r in _objects(again.stdout)] == [0, 0]

    stats = run(data_dir, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    usage = json.loads(stats.stdout)["usage_by_day"]
    days = {(u["day"], u["model"]): u["responses"] for u in usage}
    assert days["2026-01-21", "claude-opus-4-5-20251101"] == 2
    assert days["2026-01-22", "claude-sonnet-4-5"] == 3  # the oh-my-pi session's day
    human = run(data_dir, "stats")
    assert "Tokens per day" in human.stdout and "2026-01-21" in human.stdout

    out = tmp_path / "out" / "agent" / "sessions" / "--home-dev-webapp--"
    exported = run(
        data_dir, "export", "9b1e4c7a2f3d4e5f", "--format", "omp", "-o", str(out), "--json"
    )
    assert exported.returncode == 0, exported.stderr
    report = json.loads(exported.stdout)
    source = root / "omp" / "agent" / "sessions" / "--home-dev-webapp--"
    assert Path(report["session_file"]).read_bytes() == (source / f"{OMP_STEM}.jsonl").read_bytes()
    assert Path(report["blobs_dir"]) == (tmp_path / "out" / "agent" / "blobs").resolve()
    assert sorted(p.name for p in Path(report["blobs_dir"]).iterdir()) == sorted(
        p.name for p in (root / "omp" / "agent" / "blobs").iterdir()
    )
    assert sorted(p.name for p in (out / OMP_STEM).iterdir()) == [
        "0.bash.log",
        "1.read.log",
        "explore.jsonl",
        "explore.md",
    ]


def test_import_format_errors_are_one_line(data_dir: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"hello": 1}\n')
    done = run(data_dir, "import", str(junk), "--format", "claude-code")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "Claude Code transcript" in " ".join(done.stderr.split())
    auto = run(data_dir, "import", str(junk), "--json")
    assert _objects(auto.stdout)[0]["status"] == "error"
