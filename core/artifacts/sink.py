"""OutputSink: bounded streaming output for tool executors, spilling the full stream.

The sink keeps what the model will see within a budget:

- a tail window of at most ``spill_bytes`` (cut on a UTF-8 boundary);
- optionally the first ``head_bytes`` too, with ``[… N lines elided (SIZE) …]`` between;
- optionally a per-line cap: a line over ``max_columns`` bytes keeps ``max_columns - 3``
  bytes plus ``…`` and the rest up to the next newline is dropped (state spans chunks).

As soon as anything would be lost (the window overflows, or the cap drops bytes) the full
stream is mirrored into a tool-output artifact: what was buffered so far first, then every
later chunk, verbatim. Output that fits writes no file. If the artifact cannot be written,
the sink keeps going with bounded output and says so in the summary.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from core.artifacts.records import AllocatedPath
from core.errors import ArtifactError, SessionStoreError
from core.nofollow import artifact_root_of, create_new

logger = logging.getLogger(__name__)

DEFAULT_SPILL_BYTES = 50 * 1024
ELLIPSIS = "…"
_ELLIPSIS_BYTES = 3
_ERRORS = "surrogatepass"  # every str round-trips, even lone surrogates


class SpillTarget(Protocol):
    """Where a sink spills (an ArtifactManager)."""

    def allocate_path(self, tool_type: str) -> AllocatedPath: ...

    def finalize_tool_output(self, artifact_id: str) -> int: ...

    def discard_tool_output(self, artifact_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class SinkSummary:
    output: str
    truncated: bool
    total_lines: int
    total_bytes: int
    output_lines: int
    output_bytes: int
    elided_lines: int = 0
    elided_bytes: int = 0
    column_dropped_bytes: int = 0
    column_truncated_lines: int = 0
    artifact_id: str | None = None
    artifact_error: str | None = None


# --- byte helpers -------------------------------------------------------------------------


def byte_len(text: str) -> int:
    return len(text.encode("utf-8", _ERRORS))


def head_within(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` that fits in ``max_bytes`` UTF-8 bytes."""
    data = text.encode("utf-8", _ERRORS)
    if len(data) <= max_bytes:
        return text
    cut = max(0, max_bytes)
    while cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return data[:cut].decode("utf-8", _ERRORS)


def tail_within(text: str, max_bytes: int) -> str:
    """The longest suffix of ``text`` that fits in ``max_bytes`` UTF-8 bytes."""
    data = text.encode("utf-8", _ERRORS)
    if len(data) <= max_bytes:
        return text
    start = len(data) - max(0, max_bytes)
    while start < len(data) and (data[start] & 0xC0) == 0x80:
        start += 1
    return data[start:].decode("utf-8", _ERRORS)


def format_size(size: int) -> str:
    """``NB`` under 1024, else one decimal with KB, MB or GB."""
    if size < 1024:
        return f"{size}B"
    value = float(size)
    for unit in ("KB", "MB", "GB"):
        value /= 1024
        # Promote when rounding would print 1024.0 of this unit.
        if round(value, 1) < 1024 or unit == "GB":
            return f"{value:.1f}{unit}"
    raise AssertionError("unreachable")


def elision_marker(lines: int, size: int) -> str:
    noun = "line" if lines == 1 else "lines"
    return f"[… {lines:,} {noun} elided ({format_size(size)}) …]"


def count_lines(text: str) -> int:
    """Lines in ``text``; a final line without a newline counts."""
    if not text:
        return 0
    return text.count("\n") + (0 if text.endswith("\n") else 1)


# --- the per-line column cap ----------------------------------------------------------------


class ColumnCap:
    """Caps each line at ``max_bytes``: ``max_bytes - 3`` bytes, then ``…``.

    Bytes past ``max - 3`` are held back until the line either ends within ``max`` (they
    are shown) or overflows (they are dropped for the ellipsis), so a capped line is never
    wider than ``max`` however the stream is chunked.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 4:
            raise ValueError(f"max_columns must be 0 (off) or at least 4, got {max_bytes}")
        self.max = max_bytes
        self.keep = max_bytes - _ELLIPSIS_BYTES
        self.shown = 0  # bytes of the current line already passed on (<= keep)
        self.pending = ""  # raw text past `keep` that may still fit in `max`
        self.pending_bytes = 0
        self.capped = False  # current line was cut: drop until newline
        self.dropped_bytes = 0
        self.truncated_lines = 0

    def feed(self, chunk: str) -> str:
        out: list[str] = []
        start = 0
        while start < len(chunk):
            newline = chunk.find("\n", start)
            end = len(chunk) if newline == -1 else newline
            if end > start:
                out.append(self._segment(chunk[start:end]))
            if newline == -1:
                break
            out.append(self.flush() + "\n")
            start = newline + 1
        return "".join(out)

    def flush(self) -> str:
        """End the current line (newline or end of stream); returns held-back text."""
        held = "" if self.capped else self.pending
        self.shown = 0
        self.pending = ""
        self.pending_bytes = 0
        self.capped = False
        return held

    def _segment(self, segment: str) -> str:
        size = byte_len(segment)
        if self.capped:
            self.dropped_bytes += size
            return ""
        room = self.keep - self.shown
        if not self.pending and size <= room:
            self.shown += size
            return segment
        combined = self.pending + segment
        combined_bytes = self.pending_bytes + size
        shown = head_within(combined, room)
        shown_bytes = byte_len(shown)
        if self.shown + combined_bytes <= self.max:
            self.shown += shown_bytes
            self.pending = combined[len(shown) :]
            self.pending_bytes = combined_bytes - shown_bytes
            return shown
        self.dropped_bytes += combined_bytes - shown_bytes
        self.truncated_lines += 1
        self.capped = True
        self.shown += shown_bytes + _ELLIPSIS_BYTES
        self.pending = ""
        self.pending_bytes = 0
        return shown + ELLIPSIS


# --- the sink ---------------------------------------------------------------------------------


class OutputSink:
    """Collect a tool's streamed output; ``dump`` returns the bounded text and totals."""

    def __init__(
        self,
        *,
        target: SpillTarget | None = None,
        tool_type: str = "tool",
        spill_bytes: int = DEFAULT_SPILL_BYTES,
        head_bytes: int = 0,
        max_columns: int = 0,
    ) -> None:
        if spill_bytes < 1 or head_bytes < 0 or max_columns < 0:
            raise ValueError("spill_bytes must be >= 1; head_bytes and max_columns >= 0")
        self._target = target
        self._tool_type = tool_type
        self._limit = spill_bytes
        self._head_limit = head_bytes
        self._cap = ColumnCap(max_columns) if max_columns else None
        self._head = ""
        self._head_bytes = 0
        self._head_closed = head_bytes == 0
        self._tail: list[str] = []
        self._tail_bytes = 0
        self._total_bytes = 0
        self._total_newlines = 0
        self._last_char = ""
        self._kept_bytes = 0  # bytes that passed the column cap (what head+tail sample)
        self._file: BinaryIO | None = None
        self._artifact_id: str | None = None
        self._spilled = False
        self._error: str | None = None
        self._summary: SinkSummary | None = None

    # streaming -------------------------------------------------------------------------------

    def push(self, chunk: str) -> None:
        if self._summary is not None:
            raise ArtifactError("the sink was already dumped")
        if not chunk:
            return
        self._total_bytes += byte_len(chunk)
        self._total_newlines += chunk.count("\n")
        self._last_char = chunk[-1]
        if self._cap is None:
            self._accept(chunk, "", chunk, dropped=False)
            return
        held_before = self._cap.pending
        dropped_before = self._cap.dropped_bytes
        kept = self._cap.feed(chunk)
        self._accept(kept, held_before, chunk, dropped=self._cap.dropped_bytes > dropped_before)

    def _accept(self, kept: str, held_before: str, raw: str, *, dropped: bool) -> None:
        """Retain ``kept`` (the capped form of ``raw``), spilling first if anything is lost."""
        head_part, tail_part = self._split_head(kept)
        overflow = self._tail_bytes + byte_len(tail_part) > self._limit
        if self._spilled:
            self._mirror(raw)
        elif overflow or dropped:
            # Nothing was lost yet: head + tail + held-back text is the stream so far.
            self._start_spill(self._head + "".join(self._tail) + held_before + raw)
        self._retain(head_part, tail_part)

    def dump(self, notice: str | None = None) -> SinkSummary:
        """Finish: the bounded text (``[notice]\\n`` first), totals and the artifact id."""
        if self._summary is None:
            self._summary = self._finish(notice)
        return self._summary

    # retention -------------------------------------------------------------------------------

    def _split_head(self, text: str) -> tuple[str, str]:
        if self._head_closed or not text:
            return "", text
        head = head_within(text, self._head_limit - self._head_bytes)
        return head, text[len(head) :]

    def _retain(self, head_part: str, tail_part: str) -> None:
        if head_part:
            size = byte_len(head_part)
            self._head += head_part
            self._head_bytes += size
            self._kept_bytes += size
        if tail_part:
            # Once text goes to the tail, later text must too, or the order would break.
            self._head_closed = True
            size = byte_len(tail_part)
            self._tail.append(tail_part)
            self._tail_bytes += size
            self._kept_bytes += size
            if self._tail_bytes > 2 * self._limit:  # trim lazily: amortized cost
                self._trim_tail()

    def _trim_tail(self) -> None:
        text = tail_within("".join(self._tail), self._limit)
        self._tail = [text] if text else []
        self._tail_bytes = byte_len(text)

    # spilling --------------------------------------------------------------------------------

    def _start_spill(self, text: str) -> None:
        self._spilled = True
        if self._target is None:
            return
        try:
            slot = self._target.allocate_path(self._tool_type)
            self._artifact_id = slot.id
            self._file = open(
                create_new(artifact_root_of(slot.path.parent), slot.path), "wb", buffering=1 << 20
            )
            self._file.write(text.encode("utf-8", _ERRORS))
        except (OSError, SessionStoreError) as exc:
            self._fail(exc)
        else:
            logger.debug(
                "output spilled to artifact",
                extra={"artifact_id": self._artifact_id, "tool_type": self._tool_type},
            )

    def _mirror(self, chunk: str) -> None:
        if self._file is None:
            return
        try:
            self._file.write(chunk.encode("utf-8", _ERRORS))
        except OSError as exc:
            self._fail(exc)

    def _close_file(self) -> None:
        if self._file is None or self._artifact_id is None or self._target is None:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            self._target.finalize_tool_output(self._artifact_id)
        except (OSError, SessionStoreError) as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Stop mirroring, drop the incomplete artifact, and remember why."""
        self._error = f"the full output could not be saved: {exc}"
        logger.warning(
            "output spill failed; keeping bounded output only",
            extra={"artifact_id": self._artifact_id, "error": str(exc)},
        )
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        if self._artifact_id is not None and self._target is not None:
            try:
                self._target.discard_tool_output(self._artifact_id)
            except (OSError, SessionStoreError):
                logger.warning(
                    "could not discard a failed spill", extra={"artifact_id": self._artifact_id}
                )
        self._artifact_id = None

    # the summary -----------------------------------------------------------------------------

    def _finish(self, notice: str | None) -> SinkSummary:
        if self._cap is not None and self._cap.pending:
            # The stream ended inside a line that fits: its held-back bytes are shown.
            # They were mirrored already if spilling, so the raw part is empty.
            held = self._cap.flush()
            self._accept(held, "", "" if self._spilled else held, dropped=False)
        self._close_file()
        self._trim_tail()
        tail = "".join(self._tail)
        body, elided_lines, elided_bytes = self._compose(tail)
        dropped = self._cap.dropped_bytes if self._cap else 0
        truncated = (
            elided_bytes > 0
            or dropped > 0
            or self._kept_bytes > self._head_bytes + self._tail_bytes
        )
        output = f"[{notice}]\n{body}" if notice else body
        return SinkSummary(
            output=output,
            truncated=truncated,
            total_lines=self._total_newlines + (1 if self._last_char not in ("", "\n") else 0),
            total_bytes=self._total_bytes,
            output_lines=count_lines(output),
            output_bytes=byte_len(output),
            elided_lines=elided_lines,
            elided_bytes=elided_bytes,
            column_dropped_bytes=dropped,
            column_truncated_lines=self._cap.truncated_lines if self._cap else 0,
            artifact_id=self._artifact_id,
            artifact_error=self._error,
        )

    def _compose(self, tail: str) -> tuple[str, int, int]:
        elided_bytes = self._kept_bytes - self._head_bytes - self._tail_bytes
        if self._head_bytes == 0 or elided_bytes <= 0:
            return self._head + tail, 0, 0
        elided_lines = self._total_newlines - self._head.count("\n") - tail.count("\n")
        before = "" if self._head.endswith("\n") else "\n"
        after = "" if tail.startswith("\n") else "\n"
        marker = elision_marker(elided_lines, elided_bytes)
        return f"{self._head}{before}{marker}{after}{tail}", elided_lines, elided_bytes
