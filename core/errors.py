"""One exception root. Each class's docstring is its default message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class SessionStoreError(Exception):
    """sessionstore failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def to_dict(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "message": self.message}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as it is (its args and attributes), not through ``__init__``, whose
        # parameters differ per class: a process pool or a task result gets the same error.
        return (_rebuilt, (type(self), self.args, self.__dict__))


def _rebuilt(
    cls: type[SessionStoreError], args: tuple[Any, ...], state: dict[str, Any]
) -> SessionStoreError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class StoreClosed(SessionStoreError):
    """A ``SessionStore`` (or its engine) was used after ``close()``."""


class SessionNotFound(SessionStoreError):
    """No such session (or not visible to this tenant)."""

    def __init__(self, session_id: str, message: str | None = None) -> None:
        self.session_id = session_id
        super().__init__(message or f"session not found: {session_id}")


class ConcurrencyConflict(SessionStoreError):
    """The session's head is not the expected seq."""

    def __init__(self, session_id: str, expected_seq: int, current_seq: int) -> None:
        self.session_id = session_id
        self.expected_seq = expected_seq
        self.current_seq = current_seq
        super().__init__(
            f"session {session_id}: expected head {expected_seq}, current head is {current_seq}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "expected_seq": self.expected_seq,
            "current_seq": self.current_seq,
        }


class InvalidEvent(SessionStoreError):
    """An event was rejected."""

    def __init__(self, field: str, reason: str, *, index: int | None = None) -> None:
        self.field = field
        self.reason = reason
        self.index = index
        where = f"event[{index}]" if index is not None else "event"
        super().__init__(f"invalid {where} at {field or '/'}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "field": self.field,
            "reason": self.reason,
            "index": self.index,
        }


class InvalidArgument(InvalidEvent):
    """A bad argument to a read or write call (a seq, a position, a page size), named.
    An ``InvalidEvent``, as bad input is, so a caller that handles one handles both."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason, self.index = field, reason, None
        SessionStoreError.__init__(self, f"invalid argument {field}: {reason}")


class WriteTooLarge(InvalidEvent):
    """A write exceeds a documented size limit."""


class IdempotencyKeyReused(InvalidEvent):
    """An idempotency key that committed one write was sent again with other content.

    A replay of the same write is answered with its result (invariant 5); this is not
    one, and answering it as one would drop the new content without a word. The new write
    is not appended: send it under a new key. ``first_seq``..``last_seq`` (at
    ``positions``) are the events the key committed."""

    def __init__(
        self,
        session_id: str,
        idempotency_key: str,
        first_seq: int,
        last_seq: int,
        positions: Sequence[int] = (),
    ) -> None:
        self.field, self.index = "idempotency_key", None
        self.session_id = session_id
        self.idempotency_key = idempotency_key
        self.first_seq = first_seq
        self.last_seq = last_seq
        self.positions = list(positions)
        self.reason = (
            f"key {idempotency_key!r} already committed other content to session "
            f"{session_id} (seq {first_seq}..{last_seq}); send new content under a new key"
        )
        SessionStoreError.__init__(self, f"idempotency key reused: {self.reason}")

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "session_id": self.session_id,
            "idempotency_key": self.idempotency_key,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
        }


class BlobError(SessionStoreError):
    """A blob operation failed."""


class InvalidBlobHash(BlobError):
    """A blob hash must be 64 lowercase hex characters."""

    def __init__(self, value: str) -> None:
        self.value = value
        super().__init__(f"invalid blob hash {value[:80]!r}: expected 64 lowercase hex characters")


class BlobNotFound(BlobError):
    """No blob with that hash."""

    def __init__(self, blob_hash: str) -> None:
        self.blob_hash = blob_hash
        super().__init__(f"blob not found: {blob_hash}")


class BlobCorrupted(BlobError):
    """A stored blob does not match its hash."""

    def __init__(self, blob_hash: str, reason: str) -> None:
        self.blob_hash = blob_hash
        super().__init__(f"blob {blob_hash} is corrupted: {reason}")


class ExportIncomplete(BlobError):
    """An export was written whole, but blobs it needed could not be read (missing, or
    corrupt and refused): their refs stand in the output in place of their values. Raised
    once the output is complete; ``result`` is what the export returned otherwise."""

    def __init__(self, hashes: Sequence[str], result: Any) -> None:
        self.hashes, self.result = sorted(set(hashes)), result
        shown = ", ".join(h[:12] for h in self.hashes[:5]) + (", …" if len(self.hashes) > 5 else "")
        super().__init__(
            f"{len(self.hashes)} blob(s) could not be read (missing or corrupt): {shown}; "
            "the export holds their refs in place of their values (`sessionstore blobs "
            "verify` reports them, `--repair-from DIR` restores them)"
        )


class BlobsMissing(BlobError):
    """Blobs referenced by a write are not registered (garbage-collected in between)."""

    def __init__(self, hashes: set[str]) -> None:
        self.hashes = hashes
        super().__init__(
            f"{len(hashes)} referenced blob(s) are not registered: {sorted(hashes)[:3]}"
        )


class ArtifactError(SessionStoreError):
    """An artifact operation failed."""


class ArtifactNotFound(ArtifactError):
    """No such artifact."""


class ArtifactBusy(ArtifactError):
    """An artifact could not be removed now: its session was being moved meanwhile. Its
    row stays, so a later run (the next expiry) removes it."""


class ArtifactIncomplete(ArtifactError):
    """An artifact's bytes are not the whole output: its writer has not finished it, or
    died, or the session is a fork taken while it was written (``state``: ``writing`` or
    ``truncated``). ``size_bytes`` is what is saved."""

    def __init__(self, url: str, state: str, size_bytes: int) -> None:
        self.url = url
        self.state = state
        self.size_bytes = size_bytes
        if state == "writing":
            why = "its writer has not finished it (or died; expiry marks it truncated later)"
        else:
            why = (
                f"its writer did not finish it here: {size_bytes:,} bytes were saved (the "
                "writer died, or the session is a fork taken while it was being written)"
            )
        super().__init__(
            f"{url} is incomplete: {why}; read it with --partial (partial=True) to see "
            "what was saved"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "state": self.state, "size_bytes": self.size_bytes}


class ArtifactCorrupt(ArtifactError):
    """An artifact's stored bytes are not what its row recorded (their size, or their
    SHA-256): overwritten or cut short in place. Refused, never served (invariant 13)."""

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(
            f"{what} is corrupt: {reason}; its stored bytes are not what was written, and "
            "are not served"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "artifact": self.what, "reason": self.reason}


class InvalidArtifactPath(ArtifactError):
    """An artifact path was rejected by the sanitizer."""

    def __init__(self, path: str = "", reason: str = "") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"invalid artifact path {path[:300]!r}: {reason}" if reason else None)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "path": self.path, "reason": self.reason}


class SymlinkRefused(ArtifactError):
    """A symlink under the data root was refused: none is ever followed."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        super().__init__(f"refusing a symlink under the data root: {path}" if path else None)


class BlobLinked(BlobCorrupted, SymlinkRefused):
    """A symlink stands where a blob's file should be: a damaged copy, never followed.
    Readers take it as ``BlobCorrupted`` (reported, the ref kept; a put of the content
    renames a new file over the link), ``blobs verify`` as ``SymlinkRefused`` (reported
    for the operator, left in place)."""

    def __init__(self, blob_hash: str, path: str) -> None:
        self.blob_hash = blob_hash
        self.path = path
        SessionStoreError.__init__(
            self, f"blob {blob_hash} is corrupted: a symlink stands at {path} (not followed)"
        )


class QuotaExceeded(ArtifactError):
    """An artifact write would exceed a quota."""

    def __init__(
        self, scope: str = "", *, limit: int = 0, used: int = 0, requested: int = 0
    ) -> None:
        self.scope = scope
        self.limit = limit
        self.used = used
        self.requested = requested
        message = (
            f"{scope} quota exceeded: {used} bytes used + {requested} bytes requested "
            f"> limit {limit} bytes"
            if scope
            else None
        )
        super().__init__(message)

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "scope": self.scope,
            "limit": self.limit,
            "used": self.used,
            "requested": self.requested,
        }


class ResolveError(SessionStoreError):
    """A URL could not be resolved."""


class ResolveNotFound(ResolveError):
    """The URL names nothing visible to this caller."""


class DeadLetterNotFound(SessionStoreError):
    """No such dead letter."""


class MoveFailed(SessionStoreError):
    """A session move failed and was rolled back."""


class StorageUnavailable(SessionStoreError):
    """A backend (database, broker, blob or artifact storage) is unreachable or busy; retry.

    Transient by definition: callers retry on this type alone. ``component`` names the
    backend (``database``, ``broker``, ``blobs``, ``artifacts``).
    """

    def __init__(self, component: str = "database", message: str | None = None) -> None:
        self.component = component
        super().__init__(message or f"{component} is unavailable")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "component": self.component}


class SessionMoving(StorageUnavailable):
    """A move of the session is under way, or was interrupted and not yet repaired: its
    artifact files have no settled place, so nothing is written to them until the move
    commits or is repaired (by the reconciler, or `sessionstore sessions repair`); retry."""

    def __init__(self, session_id: str = "") -> None:
        self.session_id = session_id
        super().__init__(
            "artifacts",
            f"session {session_id} is being moved: the move completes by the reconciler or "
            f"`sessionstore sessions repair {session_id}`; retry then",
        )

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "session_id": self.session_id}


class SchemaNotCurrent(SessionStoreError):
    """The database schema is missing or behind the code: run `sessionstore db upgrade`."""


class SchemaAhead(SchemaNotCurrent):
    """The database schema is at a revision this code does not know: a newer release wrote
    it, and only that release can use it or downgrade it (`db upgrade` cannot help)."""

    # what to do, as this error and `db current` say it
    ADVICE = "a newer sessionstore wrote it; run that release (or downgrade the schema with it)"

    def __init__(self, revision: str, head: str) -> None:
        self.revision = revision
        self.head = head
        super().__init__(
            f"the database schema is at {revision}, which this code (at {head}) does not "
            f"know: {self.ADVICE}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "revision": self.revision, "head": self.head}


class DowngradeRefused(SessionStoreError):
    """A schema downgrade that would lose what the older code cannot do without (see the
    message); nothing was changed by the refused step."""

    def __init__(self, revision: str, reason: str) -> None:
        self.revision = revision
        super().__init__(f"downgrade past {revision} refused: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "revision": self.revision}


class DatabaseMissing(SessionStoreError):
    """The embedded database file does not exist (read-only commands never create one)."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"no database at {path}")


class UnreadableFile(SessionStoreError):
    """A file could not be read."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot read {path}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "path": self.path, "reason": self.reason}


class UnlistableDirectory(UnreadableFile):
    """A directory could not be listed: the session files in it were not imported."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        SessionStoreError.__init__(
            self, f"cannot list {path}: {reason} (its session files are not imported)"
        )


class UnwritableFile(SessionStoreError):
    """A file could not be written (its directory missing, not writable, or full)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write {path}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "path": self.path, "reason": self.reason}


class ImportConflict(SessionStoreError):
    """An already-imported part of a session file changed; nothing was written. Names the
    session that holds the file (by id and external id) when there is one."""

    def __init__(
        self,
        path: str,
        line: int,
        reason: str,
        *,
        session_id: str | None = None,
        external_id: str | None = None,
    ) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        self.session_id = session_id
        self.external_id = external_id
        super().__init__(f"{path}:{line}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "path": self.path,
            "line": self.line,
            "reason": self.reason,
            "session_id": self.session_id,
            "external_id": self.external_id,
        }


class ImportInterrupted(SessionStoreError):
    """An import pass failed after it had started writing: what it appended stays, and
    importing the file again continues after it."""

    def __init__(
        self,
        path: str,
        *,
        session_id: str,
        external_id: str,
        appended: int,
        skipped: int,
        cause: Exception,
    ) -> None:
        self.path = path
        self.session_id = session_id
        self.external_id = external_id
        self.appended = appended
        self.skipped = skipped
        self.cause = cause
        reason = cause.message if isinstance(cause, SessionStoreError) else str(cause)
        super().__init__(
            f"{path}: {reason} (session {session_id} kept the {appended} event(s) appended "
            "before this; importing the file again continues after them)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "path": self.path,
            "session_id": self.session_id,
            "external_id": self.external_id,
            "appended": self.appended,
            "skipped": self.skipped,
        }


class ExternalIdTaken(SessionStoreError):
    """Another session of the tenant already has this external id."""

    def __init__(self, tenant_id: str, external_id: str) -> None:
        self.tenant_id = tenant_id
        self.external_id = external_id
        super().__init__(f"tenant {tenant_id} already has a session with external id {external_id}")


class ImportFormatError(InvalidEvent):
    """A session file could not be read in the requested format."""


class SessionFileNotStarted(ImportFormatError):
    """A session file holds no line yet: it is empty, or its first line is still being
    written (an agent opens the file first, and writes a large first line in pieces).
    Nothing to import and nothing lost: pi takes such a file for a session not begun. An
    ``ImportFormatError``, for a caller that handles those; the CLI reports it as a skip."""

    def __init__(
        self, path: str, *, empty: bool, blank: bool = False, header_pending: bool = False
    ) -> None:
        self.empty = empty
        self.blank = blank
        # lines, but none that gives the session its time and working directory yet
        self.header_pending = header_pending
        if header_pending:
            reason = "no line gives the session its time and working directory yet"
        elif blank:
            reason = "the file holds only white space"
        elif empty:
            reason = "the file is empty"
        else:
            reason = "its first line is not complete (still being written, or cut short)"
        super().__init__(path, reason)


class InvalidForkPoint(SessionStoreError):
    """A fork point must be a seq from 0 to the session's head."""

    def __init__(self, session_id: str, at_seq: int, head_seq: int) -> None:
        self.session_id = session_id
        self.at_seq = at_seq
        self.head_seq = head_seq
        super().__init__(
            f"session {session_id}: cannot fork at seq {at_seq}; the head is {head_seq}"
        )


class ForkCopiesInProgress(SessionStoreError):
    """New forks of the session kept starting their artifact copies; retry."""


class ForkCopyBlocked(SessionStoreError):
    """A fork's artifact copy cannot finish (a symlink where it would read or write, never
    followed): the session its files come from cannot be moved or deleted until it does.
    ``fork_id`` names the fork, ``paths`` the links; remove them, then retry."""

    def __init__(self, session_id: str, fork_id: str, paths: list[str], action: str) -> None:
        self.session_id, self.fork_id, self.paths = session_id, fork_id, paths
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        whose = "its own" if fork_id == session_id else f"its fork {fork_id}'s"
        super().__init__(
            f"session {session_id}: cannot {action} it while {whose} artifact copy cannot "
            f"finish: {shown} (a symlink, not followed); remove it, then retry"
        )


class SnapshotFormatError(SessionStoreError):
    """A stored snapshot could not be decoded (it is ignored and rebuilt from events)."""


class WriteRejected(SessionStoreError):
    """The worker rejected the write; it is kept as a dead letter."""

    def __init__(self, outcome: dict[str, Any]) -> None:
        self.dead_letter_id = int(outcome["dead_letter_id"])
        self.session_id = str(outcome.get("session_id"))
        self.error_type = str(outcome.get("error_type"))
        self.reason = str(outcome.get("error"))
        super().__init__(
            f"write rejected ({self.error_type}: {self.reason}); "
            f"kept as dead letter {self.dead_letter_id}"
        )


class DeliveriesExhausted(SessionStoreError):
    """A queued write was delivered again and again without finishing (killed at the hard
    time limit, or its worker lost, each time): it is kept as a dead letter."""

    def __init__(self, deliveries: int) -> None:
        self.deliveries = deliveries
        super().__init__(
            f"delivered {deliveries} times without finishing (killed at the hard time limit, "
            "or its worker lost, each time)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "deliveries": self.deliveries}


class NotFinishedInTime(SessionStoreError, TimeoutError):
    """A queued job gave no outcome within the caller's timeout. Nothing is lost: the job
    is still queued or running (a write is idempotent by its key: wait again or resend)."""


class RehydrateInProgress(SessionStoreError):
    """Another worker is building this rehydrated export; ask again shortly."""


class RehydrateTooLong(SessionStoreError):
    """A rehydrate build on a worker reached the task's soft time limit while still making
    progress: building it again would end the same way, so it is refused, not retried."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        super().__init__(
            f"the build did not finish within the task's soft time limit ({limit_s:g} s): "
            "raise SESSIONSTORE_TASK_VISIBILITY_TIMEOUT (the limits are 0.4x and 0.5x of it, "
            "up to 720 s and 900 s), or export without --via-queue"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "limit_s": self.limit_s}


class BadConfig(SessionStoreError):
    """The configuration (SESSIONSTORE_* variables) is invalid."""
