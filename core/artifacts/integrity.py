"""What an artifact read serves is what was written: its size and SHA-256 against its row.

A row records ``size_bytes`` and (where the bytes were in hand when written) ``sha256`` of
the bytes a reader is served. A file or object overwritten in place, cut short or extended
no longer matches them, and is ``ArtifactCorrupt`` instead of data (the spirit of
invariant 13, which blobs keep by their hash). A row that is not ``complete`` (a tool
output still being written, or what a dead writer left) is served only as partial, and is
not checked: its bytes are not meant to be whole. An agent output's ``size_bytes`` counts
its JSONL sidecar too, so only its digest is checked; the sidecar has a digest of its own
(``sidecar_sha256``), checked where it is served (``sidecar_mismatch``).

A whole read that mismatches is read once more from a fresh row before it is called
corrupt: a path-addressed file (or an agent output, or a tool output put under a kept id)
is rewritten by renaming new content over the old inside the transaction that updates its
row, so a read can see the new file with the old row. ``fresh_row`` takes the tenant's
quota lock, which every such write holds until it commits, so what it reads is settled.
"""

from __future__ import annotations

import logging
from typing import BinaryIO

from sqlalchemy import Engine

from core.artifacts import rows
from core.artifacts.paths import agent_output_names
from core.artifacts.records import AGENT_OUTPUT, ArtifactInfo
from core.artifacts.storage import Tally
from core.blobs.store import sha256_hex
from core.db import write_transaction
from core.errors import ArtifactCorrupt

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024  # what a streamed read yields at a time


def mismatch(row: ArtifactInfo, size: int, digest: str) -> str | None:
    """Why bytes of ``size`` and SHA-256 ``digest`` are not ``row``'s; None if they are (or
    the row is not complete: nothing whole to compare with)."""
    if not row.complete:
        return None
    if row.kind != AGENT_OUTPUT and size != row.size_bytes:
        return f"{size:,} bytes stored, {row.size_bytes:,} recorded"
    if row.sha256 is not None and digest != row.sha256:
        return f"SHA-256 {digest[:16]}… stored, {row.sha256[:16]}… recorded"
    return None


# ``sidecar_sha256`` of an agent output written without a sidecar: none is served, whatever
# file an earlier write left (None: a row from before sidecar digests, served unchecked)
NO_SIDECAR = ""


def sidecar_mismatch(row: ArtifactInfo, data: bytes | None) -> str | None:
    """Why ``data`` (None: no file) is not the JSONL sidecar ``row`` recorded; None if it
    is, or the row recorded none (no sidecar was written with it, or before digests)."""
    if row.sidecar_sha256 is None or row.sidecar_sha256 == NO_SIDECAR:
        return None
    if data is None:
        return "its JSONL sidecar is missing"
    return _sidecar_digest_mismatch(row, digest(data))


def _sidecar_digest_mismatch(row: ArtifactInfo, got: str) -> str | None:
    if row.sidecar_sha256 is None or got == row.sidecar_sha256:
        return None
    return f"its JSONL sidecar's SHA-256 {got[:16]}… stored, {row.sidecar_sha256[:16]}… recorded"


def file_mismatch(row: ArtifactInfo, name: str, size: int, sha256: str) -> str | None:
    """``mismatch`` for the file ``name`` (its last component) of ``row``'s artifact: an
    agent output's JSONL sidecar is checked against ``sidecar_sha256``, any other file
    against the row."""
    if row.kind == AGENT_OUTPUT and name == agent_output_names(row.local_id)[1]:
        return _sidecar_digest_mismatch(row, sha256)
    return mismatch(row, size, sha256)


def corrupt(row: ArtifactInfo, reason: str) -> ArtifactCorrupt:
    what = f"{row.kind} {row.local_id!r} of session {row.session_id}"
    log.warning(
        "artifact corrupt: refused",
        extra={
            "session_id": row.session_id,
            "kind": row.kind,
            "local_id": row.local_id,
            "reason": reason,
        },
    )
    return ArtifactCorrupt(what, reason)


digest = sha256_hex  # what a row records of its bytes as ``sha256``


def check(row: ArtifactInfo, data: bytes) -> str | None:
    """``mismatch`` for bytes in hand."""
    return mismatch(row, len(data), digest(data))


def fresh_row(engine: Engine, row: ArtifactInfo) -> ArtifactInfo | None:
    """``row`` as it is now, read under its tenant's quota lock: a rewrite that published
    its file has committed its row (None: the artifact is gone)."""
    with write_transaction(engine) as conn:
        rows.lock_quota(conn, row.session_id)
        return rows.get_artifact(conn, row.session_id, row.kind, row.local_id)


def measure(source: BinaryIO) -> tuple[int, str]:
    """(size, SHA-256) of what ``source`` holds from where it is (read in chunks)."""
    tally = Tally()
    for _chunk in tally.chunks(source, CHUNK_BYTES):
        pass
    return tally.measured


class VerifiedChunks:
    """The bytes of ``source``, ``chunk_bytes`` at a time, hashed as they pass;
    ``ArtifactCorrupt`` after the last one when they are not ``row``'s. The check can
    only come at the end: a consumer keeps nothing as whole until the iterator is
    exhausted without raising.

    It owns ``source`` from the start: closed at the end, when a read fails, and by
    ``close()`` (or leaving a ``with`` block), whether or not iteration began. A
    generator closed it only once its body had run, so one never started (its caller
    failing first) held the file or S3 reader open for as long as it was held. Nothing
    closes it on collection: its holder does."""

    def __init__(self, row: ArtifactInfo, source: BinaryIO, chunk_bytes: int) -> None:
        self._row = row
        self._source = source
        self._chunk_bytes = chunk_bytes
        self._tally = Tally()

    def __iter__(self) -> VerifiedChunks:
        return self

    def __next__(self) -> bytes:
        if self._source.closed:
            raise StopIteration
        try:
            chunk = self._source.read(self._chunk_bytes)
        except BaseException:
            self.close()
            raise
        if chunk:
            return self._tally.add(chunk)
        self.close()
        reason = mismatch(self._row, *self._tally.measured)
        if reason is not None:
            raise corrupt(self._row, reason)
        raise StopIteration

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> VerifiedChunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verified_chunks(
    row: ArtifactInfo, source: BinaryIO, *, chunk_bytes: int = CHUNK_BYTES
) -> VerifiedChunks:
    """``VerifiedChunks`` of ``source`` (which it closes) against ``row``."""
    return VerifiedChunks(row, source, chunk_bytes)
