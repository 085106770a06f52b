"""The real ``sessionstore`` executable: ``import`` of a directory holding an oh-my-pi tree
and a Claude Code project (auto-detected), ``stats`` per day and model, ``export --format
omp``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from core.artifacts.paths import encode_component
from tests.acceptance.test_cli import data_dir, run
from tests.cli_process import EXE
from tests.fixtures.pi.generate import v3_lines, write
from tests.support import clean_env, json_lines

__all__ = ["data_dir"]  # the fixture, used by name

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OMP_STEM = "2026-01-22T08-30-00-000Z_9b1e4c7a2f3d4e5f"
CLAUDE_ID = "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60"


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
    results = json_lines(done.stdout)
    # the subagent's explore.jsonl inside the artifacts directory is not a session of its own
    assert sorted(r["external_id"] for r in results) == [CLAUDE_ID, "9b1e4c7a2f3d4e5f"]
    assert {r["status"] for r in results} == {"created"}
    omp = next(r for r in results if r["external_id"] == "9b1e4c7a2f3d4e5f")
    assert omp["missing_blobs"] == ["blob:sha256:" + hashlib.sha256(b"gone").hexdigest()]
    again = run(data_dir, "import", str(root), "--tenant", "acme", "--json")
    assert [r["appended"] for r in json_lines(again.stdout)] == [0, 0]

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


def test_blobs_dir_is_passed_only_to_the_format_that_takes_it(
    data_dir: Path, tmp_path: Path
) -> None:
    """``--blobs-dir`` over a run of several formats: oh-my-pi reads its blobs there, and
    the pi and Claude Code files next to it import as without it (they once crashed the
    run with a TypeError)."""
    root = _tree(tmp_path)
    blobs = tmp_path / "moved-blobs"
    shutil.move(root / "omp" / "agent" / "blobs", blobs)
    shutil.copy(FIXTURES / "pi" / "v3.jsonl", root / "v3.jsonl")
    done = run(data_dir, "import", str(root), "--blobs-dir", str(blobs), "--json")
    assert done.returncode == 0, done.stderr
    results = {r["external_id"]: r for r in json_lines(done.stdout)}
    assert {r["status"] for r in results.values()} == {"created"}
    assert set(results) == {CLAUDE_ID, "9b1e4c7a2f3d4e5f", "0f3c2a10-v3"}
    omp = results["9b1e4c7a2f3d4e5f"]
    assert omp["missing_blobs"] == ["blob:sha256:" + hashlib.sha256(b"gone").hexdigest()]


def test_import_format_errors_are_one_line(data_dir: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"hello": 1}\n')
    done = run(data_dir, "import", str(junk), "--format", "claude-code")
    assert done.returncode == 3 and "Traceback" not in done.stderr
    assert "Claude Code transcript" in " ".join(done.stderr.split())
    auto = run(data_dir, "import", str(junk), "--json")
    assert json_lines(auto.stdout)[0]["status"] == "error"


def _files(root: Path, *, skip: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and skip not in p.parents}


def test_export_omp_names_come_from_the_header_but_stay_inside_the_directory(
    data_dir: Path, tmp_path: Path
) -> None:
    """An absolute ``timestamp`` or a ``/`` in the id (a Claude Code subagent's
    ``<sessionId>/agent-<id>``) makes one file name inside ``-o``, and nothing is written
    anywhere else."""
    hostile = tmp_path / "in" / "hostile.jsonl"
    hostile.parent.mkdir()
    header = {"type": "session", "version": 3, "id": "evil", "cwd": "/w"}
    header["timestamp"] = str(tmp_path / "escaped")
    entry = {"type": "message", "id": "a1", "parentId": None, "message": {"role": "user"}}
    hostile.write_text("".join(json.dumps(v) + "\n" for v in (header, entry)))
    agent = tmp_path / "in" / "project" / "agent-abc.jsonl"
    agent.parent.mkdir()
    line = {"type": "user", "uuid": "u1", "parentUuid": None, "sessionId": "main-sess"}
    line |= {"agentId": "abc", "isSidechain": True, "cwd": "/w"}
    line |= {"timestamp": "2025-01-01T00:00:00.000Z", "message": {"role": "user", "content": "go"}}
    agent.write_text(json.dumps(line) + "\n")
    for path in (hostile, agent):
        assert run(data_dir, "import", str(path)).returncode == 0

    out = tmp_path / "out"
    before = _files(tmp_path, skip=data_dir)
    for external_id in ("evil", "main-sess/agent-abc"):
        done = run(data_dir, "export", external_id, "--format", "omp", "-o", str(out), "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        session_file = Path(report["session_file"])
        assert session_file.parent == out
        assert Path(report["artifacts_dir"]).parent == out
        assert json.loads(session_file.read_text().splitlines()[0])["id"] == external_id
    written = _files(tmp_path, skip=data_dir) - before
    assert {p.parent for p in written} == {out}
    assert {p.name for p in written} == {
        "2025-01-01T00-00-00-000Z_main-sess%2Fagent-abc.jsonl",
        encode_component(f"{str(tmp_path / 'escaped').replace('.', '-')}_evil") + ".jsonl",
    }


def test_import_names_a_file_whose_name_is_not_utf8_or_holds_controls(
    data_dir: Path, tmp_path: Path
) -> None:
    """A file name reaches the terminal escaped (a byte that is not UTF-8 as ``\\xff``, a
    control as ``\\x1b``) and ``--json`` as valid UTF-8 whose strings give the name back
    (a lone surrogate as its JSON escape: ``json.loads`` then ``os.fsencode``)."""
    root = tmp_path / "in"
    root.mkdir()
    good = os.fsencode(root) + b"/s\xff_0f3c2a10-v3.jsonl"
    junk = os.fsencode(root) + b"/e\x1b[2J\xfe.jsonl"
    write(Path(os.fsdecode(good)), v3_lines())
    Path(os.fsdecode(junk)).write_bytes(b'{"hello": 1}\n')
    gone = os.fsencode(root) + b"/gone\xff\x1b.jsonl"

    def cli(*args: bytes) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [EXE, "import", *args], env=clean_env(data_dir), capture_output=True, check=False
        )

    as_json = cli(os.fsencode(root), b"--json")
    assert as_json.returncode == 3  # the junk file failed: bad input
    results = [json.loads(line) for line in as_json.stdout.decode("utf-8").splitlines()]
    assert {os.fsencode(r["path"]) for r in results} == {good, junk}
    assert sorted(r["status"] for r in results) == ["created", "error"]

    human = cli(os.fsencode(root))
    out, err = human.stdout.decode("utf-8"), human.stderr.decode("utf-8")
    unwrapped = "".join((out + err).split())  # rich wraps long lines
    assert "unchanged:" in unwrapped and "/s\\xff_0f3c2a10-v3.jsonl->" in unwrapped
    assert "/e\\x1b[2J\\xfe.jsonl" in unwrapped and "\x1b" not in out + err

    missing = cli(gone)
    assert missing.returncode == 3
    line = "".join(missing.stderr.decode("utf-8").split())
    assert "/gone\\xff\\x1b.jsonl" in line and "\x1b" not in line and "Traceback" not in line
