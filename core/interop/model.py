"""The neutral shape every converter produces and every importer/exporter consumes.

A converter reads one session file (pi v1-v3, oh-my-pi, Claude Code) and yields pi
version-3 shaped entries: dicts with ``type``, ``id``, ``parentId`` and ``timestamp``, in
file order, each tagged with the 1-based line of the source file it came from (so a
re-import can compare prefixes and report the first differing line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Format = Literal["pi", "omp", "claude-code"]


@dataclass(frozen=True, slots=True)
class SessionHeader:
    """pi's ``{"type": "session", ...}`` first line, or what stands for it."""

    external_id: str  # pi header ``id`` / Claude Code ``sessionId``
    version: int  # the source's pi version (1, 2, 3); 3 for converted formats
    cwd: str | None = None
    timestamp: str | None = None  # ISO-8601 text as written
    parent_session: str | None = None  # pi ``parentSession`` (a path or an id)
    # Claude Code's ``summary`` or custom title; pi's latest ``session_info`` name ("": that
    # entry clears it)
    title: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)  # the header object as read
    # the parent session by its external id, not by a file's path (the session a Claude
    # Code transcript resumes)
    parent_id: str | None = None
    # external ids earlier versions keyed this file by: a session imported from this very
    # file under one of them is the file's session
    former_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ParsedEntry:
    line: int  # 1-based line of the source file (the last one, if several were merged)
    entry: dict[str, Any]  # pi v3 entry: type, id, parentId, timestamp, ...


@dataclass(frozen=True, slots=True)
class ArtifactFile:
    """A file that belongs to the session (oh-my-pi's artifacts directory)."""

    kind: Literal["tool_output", "agent_output", "sidecar"]
    artifact_id: str  # "3" for 3.bash.log (artifact://3); "1-explore" for agent://1-explore
    path: Path
    tool_type: str | None = None  # "bash" for 3.bash.log


@dataclass(frozen=True, slots=True)
class IgnoredLine:
    """A line of the file that holds no entry (not JSON, or JSON that is no entry): not
    imported, and reported by its line."""

    line: int  # 1-based
    reason: str


@dataclass(slots=True)
class ParsedSession:
    format: Format
    header: SessionHeader
    entries: list[ParsedEntry]
    artifacts: list[ArtifactFile] = field(default_factory=list)
    # blob:sha256 refs found in the file whose bytes were not found (kept as refs)
    missing_blobs: list[str] = field(default_factory=list)
    # a last line without its newline (an agent mid-write): left for the next pass
    incomplete_tail: bool = False
    # bytes of the file consumed by ``entries`` (up to and including the last newline)
    consumed_bytes: int = 0
    # lines whose invalid UTF-8 was read as U+FFFD (as pi reads them): not the file's bytes
    invalid_utf8_lines: int = 0
    # lines that hold no entry, not imported (pi skips the malformed ones too)
    ignored_lines: list[IgnoredLine] = field(default_factory=list)
    # no line gave the header its time or its working directory yet (a Claude Code file
    # that holds only a summary, a file-history snapshot, a queue operation so far): a
    # follower may wait for one
    header_pending: bool = False
