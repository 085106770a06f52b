"""OutputSink: tail window, head retention, column cap, spill to a tool-output artifact."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from core import SessionStore, Settings
from core.artifacts import AllocatedPath, ArtifactManager, OutputSink
from core.artifacts.sink import ColumnCap, elision_marker, format_size
from core.errors import ArtifactError, ResolveNotFound
from tests.contract.artifact_backends import FILE_ONLY, artifact_backend, settings

__all__ = ["FILE_ONLY", "artifact_backend", "settings"]  # each test on file:// and s3://


@pytest.fixture
def store(sqlite_url: str, tmp_path: Path) -> Iterator[SessionStore]:
    with SessionStore.from_settings(
        Settings(data_dir=tmp_path / "data", database_url=sqlite_url)
    ) as s:
        yield s


@pytest.fixture
def manager(store: SessionStore) -> ArtifactManager:
    return store.artifacts(store.create_session(tenant_id="acme").id)


def _sink(manager: ArtifactManager, **kwargs: int) -> OutputSink:
    return OutputSink(target=manager, tool_type="bash", **kwargs)


def _artifact_text(manager: ArtifactManager, artifact_id: str) -> str:
    return (manager.directory() / f"{artifact_id}.bash.log").read_bytes().decode("utf-8")


def _chunks(text: str, rng: random.Random, max_size: int = 9000) -> Iterator[str]:
    i = 0
    while i < len(text):
        step = rng.randint(1, max_size)
        yield text[i : i + step]
        i += step


# --- output that fits ------------------------------------------------------------------------


def test_output_that_fits_writes_no_file(manager: ArtifactManager) -> None:
    sink = _sink(manager, spill_bytes=10)
    sink.push("abcde")
    sink.push("fghij")  # exactly the window
    summary = sink.dump()
    assert summary.output == "abcdefghij"
    assert not summary.truncated and summary.artifact_id is None
    assert summary.total_bytes == summary.output_bytes == 10
    assert manager.list() == []
    assert not manager.directory().exists()


def test_one_byte_over_the_window_spills(manager: ArtifactManager) -> None:
    sink = _sink(manager, spill_bytes=10)
    sink.push("abcdefghij")
    sink.push("k")
    summary = sink.dump()
    assert summary.output == "bcdefghijk"
    assert summary.truncated and summary.artifact_id == "0"
    assert _artifact_text(manager, "0") == "abcdefghijk"
    assert [a.size_bytes for a in manager.list()] == [11]


def test_default_window_is_the_spill_setting(manager: ArtifactManager) -> None:
    sink = manager.output_sink("bash")
    sink.push("x" * 51_200)
    assert sink.dump().artifact_id is None
    sink = manager.output_sink("bash")
    sink.push("x" * 51_201)
    summary = sink.dump()
    assert summary.artifact_id is not None and summary.output_bytes == 51_200


def test_tail_window_is_cut_on_a_utf8_boundary(manager: ArtifactManager) -> None:
    sink = _sink(manager, spill_bytes=5)
    sink.push("é" * 10)  # 20 bytes
    summary = sink.dump()
    assert summary.output == "éé"  # 4 bytes: a third é would need 6
    assert _artifact_text(manager, summary.artifact_id or "") == "é" * 10


def test_without_a_target_overflow_truncates_without_a_file() -> None:
    sink = OutputSink(spill_bytes=4)
    sink.push("abcdef")
    summary = sink.dump()
    assert summary.output == "cdef" and summary.truncated
    assert summary.artifact_id is None and summary.artifact_error is None


def test_dump_prefixes_the_notice_and_counts(manager: ArtifactManager) -> None:
    sink = _sink(manager)
    sink.push("one\ntwo\nthree")
    summary = sink.dump("exit code 1")
    assert summary.output == "[exit code 1]\none\ntwo\nthree"
    assert summary.total_lines == 3 and summary.output_lines == 4
    assert summary.total_bytes == 13 and summary.output_bytes == len(summary.output)
    assert sink.dump("ignored") is summary  # idempotent
    with pytest.raises(ArtifactError):
        sink.push("late")


def test_empty_stream() -> None:
    summary = OutputSink().dump()
    assert summary.output == "" and summary.total_lines == 0 and not summary.truncated


# --- head retention and the elision marker ----------------------------------------------------


def test_head_and_tail_with_elision_marker(manager: ArtifactManager) -> None:
    sink = _sink(manager, spill_bytes=10, head_bytes=10)
    text = "".join(f"{i}\n" for i in range(100))  # 290 bytes, 100 lines
    for line in text.splitlines(keepends=True):
        sink.push(line)
    summary = sink.dump()
    assert summary.output == "0\n1\n2\n3\n4\n[… 91 lines elided (270B) …]\n97\n98\n99\n"
    assert (summary.elided_lines, summary.elided_bytes) == (91, 270)
    assert _artifact_text(manager, summary.artifact_id or "") == text


def test_head_retention_without_elision_shows_everything(manager: ArtifactManager) -> None:
    sink = _sink(manager, spill_bytes=10, head_bytes=10)
    sink.push("a" * 20)  # exactly head + window
    summary = sink.dump()
    assert summary.output == "a" * 20 and not summary.truncated
    assert summary.artifact_id is None


def test_marker_separates_partial_lines(manager: ArtifactManager) -> None:
    sink = _sink(manager, spill_bytes=4, head_bytes=4)
    sink.push("abcdefghijkl")
    summary = sink.dump()
    assert summary.output == "abcd\n[… 0 lines elided (4B) …]\nijkl"


def test_head_keeps_stream_order_after_a_multibyte_split(manager: ArtifactManager) -> None:
    sink = _sink(manager, spill_bytes=100, head_bytes=3)
    sink.push("ab")
    sink.push("é")  # does not fit the 1 byte left: goes to the tail, head closes
    sink.push("c")
    assert sink.dump().output == "abéc"


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1.0KB"),
        (1536, "1.5KB"),
        (1024 * 1024 - 1, "1.0MB"),
        (1024 * 1024, "1.0MB"),
        (int(2.25 * 1024**2), "2.2MB"),
        (5 * 1024**3, "5.0GB"),
        (1024**4, "1024.0GB"),
    ],
)
def test_size_format(size: int, text: str) -> None:
    assert format_size(size) == text


def test_marker_uses_thousands_separators() -> None:
    assert elision_marker(1_234_567, 2048) == "[… 1,234,567 lines elided (2.0KB) …]"
    assert elision_marker(999, 5) == "[… 999 lines elided (5B) …]"


# --- the per-line column cap ------------------------------------------------------------------


def _capped(max_columns: int, *chunks: str) -> str:
    cap = ColumnCap(max_columns)
    return "".join(cap.feed(c) for c in chunks) + cap.flush()


@pytest.mark.parametrize(
    ("chunks", "shown"),
    [
        (["abcdefghij\n"], "abcdefghij\n"),  # exactly max: kept
        (["abcdefghijk\n"], "abcdefg…\n"),  # max + 1: max - 3 bytes and …
        (["abcde", "fghijk", "lmn\nxy"], "abcdefg…\nxy"),  # state spans chunks
        (["abcdefgh", "ij\n"], "abcdefghij\n"),  # held-back bytes shown when the line fits
        (["abcdefghi", "j"], "abcdefghij"),  # ... also at the end of the stream
        (["abcdefghi", "jk", "\n"], "abcdefg…\n"),
        (["ééééééé\n"], "ééé…\n"),  # 14 bytes: 7 kept -> 3 whole é (6 bytes)
        (["\n\n"], "\n\n"),
    ],
)
def test_column_cap(chunks: list[str], shown: str) -> None:
    assert _capped(10, *chunks) == shown


def test_column_cap_never_exceeds_max_under_any_chunking() -> None:
    rng = random.Random(7)
    text = "".join(
        "".join(rng.choice("aé日🙂") for _ in range(rng.randint(0, 40))) + "\n" for _ in range(300)
    )
    whole = _capped(12, text)
    for _ in range(20):
        assert _capped(12, *_chunks(text, rng, 7)) == whole
    for line in whole.split("\n"):
        assert len(line.encode()) <= 12


def test_column_cap_minimum() -> None:
    with pytest.raises(ValueError):
        ColumnCap(3)


def test_dropped_columns_spill_and_report(manager: ArtifactManager) -> None:
    sink = _sink(manager, max_columns=10)
    sink.push("short\n")
    sink.push("a very long line indeed\n")
    summary = sink.dump()
    assert summary.output == "short\na very …\n"
    assert summary.truncated and summary.column_truncated_lines == 1
    assert summary.column_dropped_bytes == len("a very long line indeed") - 7
    assert _artifact_text(manager, summary.artifact_id or "") == "short\na very long line indeed\n"


def test_capped_lines_that_fit_write_no_file(manager: ArtifactManager) -> None:
    sink = _sink(manager, max_columns=10)
    sink.push("abcdefgh")
    sink.push("ij\nok\n")
    summary = sink.dump()
    assert summary.output == "abcdefghij\nok\n" and summary.artifact_id is None


def test_held_back_bytes_at_the_end_still_spill_when_they_overflow(
    manager: ArtifactManager,
) -> None:
    sink = _sink(manager, spill_bytes=10, max_columns=10)
    sink.push("abcdefghij")  # 3 bytes held back until the line's end is known
    sink.push("")
    summary = sink.dump()
    assert summary.output == "abcdefghij" and summary.artifact_id is None
    sink = _sink(manager, spill_bytes=9, max_columns=10)
    sink.push("abcdefghij")
    summary = sink.dump()
    assert summary.output == "bcdefghij" and summary.artifact_id is not None
    assert _artifact_text(manager, summary.artifact_id) == "abcdefghij"


# --- multi-megabyte streams: the artifact equals the input exactly ----------------------------


def _big_text(rng: random.Random, target_bytes: int) -> str:
    words = ["alpha", "βήτα", "γάμμα", "日本語", "🙂🙃", "naïve", "x" * 300, "", "\t"]
    lines, size = [], 0
    while size < target_bytes:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(0, 30))) + "\n"
        lines.append(line)
        size += len(line.encode())
    return "".join(lines)


@pytest.mark.parametrize(
    "options",
    [{}, {"head_bytes": 4096}, {"max_columns": 80}, {"head_bytes": 1000, "max_columns": 120}],
)
def test_multi_megabyte_stream_spills_exactly(
    manager: ArtifactManager, store: SessionStore, options: dict[str, int]
) -> None:
    rng = random.Random(42)
    text = _big_text(rng, 3 * 1024 * 1024)
    sink = manager.output_sink("bash", **options)
    for chunk in _chunks(text, rng):
        sink.push(chunk)
    summary = sink.dump("done")
    assert summary.artifact_id is not None and summary.truncated
    assert _artifact_text(manager, summary.artifact_id) == text
    resolved = store.resolve(f"artifact://{summary.artifact_id}", session_id=manager.session_id)
    assert resolved.content == text and resolved.size == len(text.encode())
    assert summary.total_bytes == len(text.encode())
    assert summary.total_lines == text.count("\n")
    body = summary.output.removeprefix("[done]\n")
    budget = 51_200 + options.get("head_bytes", 0) + 200  # + the marker line
    assert len(body.encode()) <= budget
    assert body.encode().decode() == body  # valid UTF-8, never a split character


# --- failed artifact writes -------------------------------------------------------------------


class _Redirected:
    """A spill target that hands out a path the sink cannot write."""

    def __init__(self, manager: ArtifactManager, path: Path) -> None:
        self.manager = manager
        self.path = path
        self.allocated: list[str] = []

    def allocate_path(self, tool_type: str) -> AllocatedPath:
        slot = self.manager.allocate_path(tool_type)
        self.allocated.append(slot.id)
        return AllocatedPath(slot.id, self.path)

    def finalize_tool_output(self, artifact_id: str) -> int:
        return self.manager.finalize_tool_output(artifact_id)

    def discard_tool_output(self, artifact_id: str) -> None:
        self.manager.discard_tool_output(artifact_id)


@pytest.mark.parametrize("where", ["open", "write"])
def test_failed_artifact_write_falls_back_to_bounded_output(
    manager: ArtifactManager, store: SessionStore, tmp_path: Path, where: str
) -> None:
    path = tmp_path / "missing-dir" / "x.log" if where == "open" else Path("/dev/full")
    if where == "write" and not path.exists():
        pytest.skip("/dev/full is not available")
    target = _Redirected(manager, path)
    sink = OutputSink(target=target, tool_type="bash", spill_bytes=10)
    sink.push("0123456789abcdef")
    summary = sink.dump("exit 0")
    assert summary.output == "[exit 0]\n6789abcdef" and summary.truncated
    assert summary.artifact_id is None
    assert summary.artifact_error and "could not be saved" in summary.artifact_error
    # the half-made artifact is gone, its id is not reused
    with pytest.raises(ResolveNotFound, match="not found"):
        store.resolve(f"artifact://{target.allocated[0]}", session_id=manager.session_id)
    assert manager.save("next", "bash") == str(int(target.allocated[0]) + 1)
