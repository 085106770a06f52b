"""Oversized tool outputs: stored as ``art_<16 hex>`` artifacts with a TTL.

A tool output over ``oversized_output_chars`` is kept on disk and the model gets a compact
hint instead. ``retrieve`` answers None once the TTL passed or the file is gone; expiry
itself (``expire``) is run by the maintenance beat.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Collection
from contextlib import suppress
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError

from core import nofollow
from core.artifacts import integrity, rows
from core.artifacts.fsio import old_oversized_files
from core.artifacts.inherited import (
    open_artifact_file,
    preserve_for_forks,
    read_artifact_file,
)
from core.artifacts.paths import (
    encode_component,
    oversized_name,
    sanitize_tool_type,
    session_dir,
)
from core.artifacts.records import (
    OVERSIZED,
    ArtifactInfo,
    ArtifactRef,
    ArtifactStats,
    ExpireReport,
    OversizedHint,
    OversizedStored,
)
from core.artifacts.staging import Staged, staged_in
from core.artifacts.storage import FileArtifactStorage, artifact_storage_for, key_of
from core.db import read_connection, write_transaction
from core.errors import (
    ArtifactBusy,
    ArtifactError,
    SessionNotFound,
    SessionStoreError,
    SymlinkRefused,
)
from core.models import database_now, utcnow
from core.settings import MAX_TTL_S, Settings
from core.translate import storage_errors

logger = logging.getLogger(__name__)

SUMMARY_CHARS = 200
# Rounds of ``discard`` before it gives up on a session that keeps moving under it.
DISCARD_ATTEMPTS = 5
OVERSIZED_ID = re.compile(r"^art_[0-9a-f]{16}$")
_NEWLINES = re.compile(r"[\r\n]")
_OWNERS_BATCH = 500  # ids per query when sweeping files no row names (bound parameters)


def new_oversized_id() -> str:
    return "art_" + secrets.token_hex(8)


def summarize(content: str) -> str:
    """The first 200 characters, with newlines turned into spaces."""
    return _NEWLINES.sub(" ", content[:SUMMARY_CHARS])


def _hint(ref: ArtifactRef, chars: int) -> OversizedHint:
    text = (
        f"The {ref.tool_name} output was {chars:,} characters ({ref.size_bytes:,} bytes), "
        f"too large to show. The full text is stored as {ref.artifact_id} for "
        f"{ref.ttl_s} s: resolve {ref.artifact_id}, with offset/limit to page through it."
    )
    return OversizedHint(ref.artifact_id, ref.summary, text, ref.size_bytes)


class OversizedOutputs:
    """Oversized outputs of every session; each call names its session."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.root = settings.resolved_artifact_root
        self.storage = artifact_storage_for(settings)

    def store(
        self, session_id: str, content: str, tool_name: str, ttl_s: int | None = None
    ) -> OversizedStored | None:
        """Store ``content`` if it is over the threshold; None when it is small enough."""
        if len(content) <= self.settings.oversized_output_chars:
            return None
        ttl = self.settings.oversized_ttl_seconds if ttl_s is None else ttl_s
        if type(ttl) is not int or not 0 < ttl <= MAX_TTL_S:  # now + ttl must be a date
            raise ArtifactError(f"ttl_s must be positive, at most {MAX_TTL_S:,} s, got {ttl!r}")
        data = content.encode("utf-8", "surrogatepass")
        with read_connection(self.engine) as conn:
            tenant_id = rows.session_info(conn, session_id).tenant_id
        directory = session_dir(self.root, tenant_id, session_id)
        with staged_in(self.storage, self.root, directory, data) as staged:
            ref = self._insert(
                session_id,
                sanitize_tool_type(tool_name),
                staged,
                summarize(content),
                ttl,
                (len(data), integrity.digest(data)),
            )
        logger.info(
            "oversized output stored",
            extra={"session_id": session_id, "artifact_id": ref.artifact_id, "size": len(data)},
        )
        return OversizedStored(ref, _hint(ref, len(content)))

    def publish_staged(
        self,
        session_id: str,
        staged: Staged,
        *,
        tool_name: str,
        summary: str,
        size: int,
        sha256: str,
        ttl_s: int,
        media_type: str = "text/plain",
    ) -> ArtifactRef:
        """A TTL artifact from a file already staged (streamed) in the session's directory,
        of ``size`` bytes with SHA-256 ``sha256`` (as they were written); expired and
        resolved like any oversized output."""
        try:
            ref = self._insert(
                session_id,
                sanitize_tool_type(tool_name),
                staged,
                summary,
                ttl_s,
                (size, sha256),
                media_type,
            )
        except BaseException:
            staged.discard()
            raise
        staged.commit()
        return ref

    def _insert(
        self,
        session_id: str,
        tool: str,
        staged: Staged,
        summary: str,
        ttl: int,
        content: tuple[int, str],
        media_type: str = "text/plain",
    ) -> ArtifactRef:
        """The row, and the staged file published, under the session's tenant lock (which a
        move takes too: the file lands in the directory the session has at commit); never
        while a move of the session is pending (``SessionMoving``).

        A commit that fails after the publish removes the published file: ``art_`` ids are
        random and never reused, so no one else owns it, and no row will ever name it (were
        the commit done and only its reply lost, the row reads as expired without its file,
        and expiry removes it). A crash there leaves it to ``sweep_unnamed``. ``content``:
        the staged bytes' size and SHA-256."""
        size, sha256 = content
        for _ in range(3):
            published: Path | None = None
            try:
                with write_transaction(self.engine) as conn:
                    info = rows.lock_for_write(conn, session_id)  # SessionMoving
                    # expires by the database's clock, as every host judges it: a host
                    # whose clock is behind would otherwise write an output already expired
                    ref = ArtifactRef(
                        artifact_id=new_oversized_id(),
                        session_id=session_id,
                        tool_name=tool,
                        size_bytes=size,
                        summary=summary,
                        created_at=utcnow(),
                        ttl_s=ttl,
                        expires_at=database_now(conn) + timedelta(seconds=ttl),
                    )
                    values = self._values(ref, info.head_seq, media_type)
                    rows.insert_artifact(conn, {**values, "sha256": sha256})
                    directory = session_dir(self.root, info.tenant_id, session_id)
                    published = directory / oversized_name(ref.artifact_id)
                    staged.publish(directory, published)
                return ref
            except IntegrityError:
                if published is not None:  # the staged file is gone: no other id for it
                    self._unpublish(published)
                    raise
                # A 64-bit random id collided within the session: draw another.
                continue
            except BaseException:
                if published is not None:
                    self._unpublish(published)
                raise
        raise ArtifactError("could not allocate an oversized-output id")

    def _unpublish(self, path: Path) -> None:
        """Remove a file published for a row that did not commit; on failure it is left to
        ``sweep_unnamed`` (the caller's error is the one that matters)."""
        try:
            self._remove(path)
        except (OSError, SessionStoreError) as exc:
            logger.warning(
                "could not remove an oversized output whose row did not commit",
                extra={"path": str(path), "error": repr(exc)},
            )

    @staticmethod
    def _values(ref: ArtifactRef, head_seq: int, media_type: str) -> dict[str, object]:
        return {
            "session_id": ref.session_id,
            "kind": OVERSIZED,
            "local_id": ref.artifact_id,
            "name": oversized_name(ref.artifact_id),
            "tool_type": ref.tool_name,
            "size_bytes": ref.size_bytes,
            "media_type": media_type,
            "created_at": ref.created_at,
            "created_seq": head_seq,
            "expires_at": ref.expires_at,
            "summary": ref.summary,
        }

    def retrieve(
        self, artifact_id: str, *, session_id: str, tenant_id: str | None = None
    ) -> str | None:
        """The stored text; None if unknown here, expired, or its file is missing;
        ``ArtifactCorrupt`` if it is not what was stored."""
        found = self._alive(artifact_id, session_id, tenant_id)
        if found is None:
            return None
        own, row = found
        data = read_artifact_file(self.engine, self.root, own, row, self.storage)
        return data.decode("utf-8", "surrogatepass") if data is not None else None

    def retrieve_chunks(
        self,
        artifact_id: str,
        *,
        session_id: str,
        tenant_id: str | None = None,
        chunk_bytes: int = integrity.CHUNK_BYTES,
    ) -> integrity.VerifiedChunks | None:
        """``retrieve`` as its stored bytes, ``chunk_bytes`` at a time, for an output too
        large to hold (a rehydrated export): None (decided before any byte) if unknown
        here, expired or missing. The bytes are checked as they pass, so a corrupt output
        is ``ArtifactCorrupt`` only after its last chunk: keep nothing as whole before the
        iterator is exhausted. It holds its file open until then: close it (``with``)
        however the reading ends. Ids are never reused, so no rewrite races the read."""
        found = self._alive(artifact_id, session_id, tenant_id)
        if found is None:
            return None
        own, row = found
        source = open_artifact_file(self.engine, self.root, own, row, self.storage)
        if source is None:
            return None
        return integrity.verified_chunks(row, source, chunk_bytes=chunk_bytes)

    def _alive(
        self, artifact_id: str, session_id: str, tenant_id: str | None
    ) -> tuple[Path, ArtifactInfo] | None:
        """(its own path, its row) of an oversized output that has not expired."""
        if not OVERSIZED_ID.match(artifact_id):
            return None
        with read_connection(self.engine) as conn:
            info = rows.session_info(conn, session_id, tenant_id=tenant_id)
            row = rows.get_artifact(conn, session_id, OVERSIZED, artifact_id)
            if row is None or rows.has_expired(conn, row):
                return None
        own = session_dir(self.root, info.tenant_id, session_id) / oversized_name(artifact_id)
        return own, row

    def cleanup_session(self, session_id: str) -> int:
        """Remove every oversized output of a session, each as ``discard`` does (file, then
        row: a crash or a failing disk between the two leaves a row to retry, never a file
        no row names); returns how many."""
        with read_connection(self.engine) as conn:
            rows.session_info(conn, session_id)  # SessionNotFound
            ids = rows.local_ids(conn, session_id, OVERSIZED)
        return sum(1 for artifact_id in ids if self.discard(session_id, artifact_id))

    @storage_errors("artifacts")
    def _remove(self, path: Path) -> None:
        if isinstance(self.storage, FileArtifactStorage):
            nofollow.unlink(self.root, path)
        else:
            self.storage.delete(key_of(self.root, path))

    def discard(self, session_id: str, artifact_id: str) -> bool:
        """Remove one oversized output, file then row; whether it had a row.

        File first: a row without its file already reads as expired, and the next expiry
        (or discard) removes it; a file without its row (a failing disk, or a crash between
        the two) would be found by nothing and kept forever. A file that cannot be removed
        keeps its row, so it is retried. A symlink planted on the way is refused, and stays
        (it is no file of ours); the row then goes.

        The file is removed where the session is now, but outside any database lock: on S3
        it is a network call, and on SQLite a write transaction is the database's one write
        lock (every append of every session waited on a slow or hung endpoint; on
        PostgreSQL the tenant's quota lock was held across it). Three steps:

        1. under the tenant's quota lock, a short transaction reads the session's place:
           its tenant, its move epoch (``rows.MOVE_EPOCH``, raised by every move attempt in
           the transaction that records its intent) and whether a move is pending;
        2. with no lock held, the file is removed there;
        3. under the lock again, the place is read once more. Same tenant, same epoch and no
           move pending at either read: no move touched the session's files between the two
           reads, so the removal in step 2 was at the session's one place, and the row is
           deleted in this transaction. Otherwise the three steps run again (at most
           ``DISCARD_ATTEMPTS`` times, then ``ArtifactBusy``: the row stays, and the next
           expiry removes it).

        Why each interleaving with a concurrent move ends with the file gone where the
        session is (a move records its intent and raises the epoch in one commit, then
        relocates under the tenants' locks: on disk one directory rename, on S3 copy every
        object, write a marker, delete the sources; a failed commit undoes that outside
        the lock, then drops the intent; a crash leaves the intent to ``repair``):

        - a move wholly before step 1, or wholly after step 3: the file is removed where
          it is, or was removed before the move (which then has nothing of it to move);
        - a move that starts (intent, epoch) after step 1: step 3 sees another epoch, even
          if the move failed and was undone meanwhile (its rename or copy back may have
          brought the file back to where step 2 found nothing), and it runs again at the
          session's new place;
        - a move pending at step 1 (between its intent and its commit, in its undo, or
          crashed and not yet repaired): the files' place is not settled, so nothing is
          removed and it runs again (a crashed one's ``repair`` settles it);
        - on S3, step 2 deleting an object the move has listed but not copied yet: the move
          skips it (``ObjectMove.run``); copied already: the copy is removed at the target
          in the next round, as the epoch changed.

        Each round holds the lock twice, briefly, and never across a removal."""
        name = oversized_name(artifact_id)
        for _ in range(DISCARD_ATTEMPTS):
            place = self._place(session_id, artifact_id)
            if place is None:  # deleted meanwhile, with its outputs
                return False
            if place.moving:
                continue  # a move's undo or repair may still bring files back: not yet
            path = session_dir(self.root, place.tenant_id, session_id) / name
            try:
                self._remove(path)
            except SymlinkRefused as exc:  # a planted link is no file of ours: it stays
                logger.warning(
                    "oversized output removal refused a symlink", extra={"path": exc.path}
                )
            deleted = self._forget(session_id, artifact_id, place)
            if deleted is not None:
                return deleted
        raise ArtifactBusy(
            f"oversized output {artifact_id} of session {session_id}: the session kept "
            "moving while it was removed; its row stays for the next expiry"
        )

    def _place(self, session_id: str, artifact_id: str) -> rows.SessionPlace | None:
        """Step 1: where the session's files are; None if the session is gone. A fork whose
        copy is unfinished and that inherited this output gets its own link to the file
        first (``preserve_for_forks``, as a file's delete does): its copy would otherwise
        find the output gone and fail, though the fork's row says it is there. On S3 that
        is a server-side copy under the lock, paid only while such a fork exists."""
        with write_transaction(self.engine) as conn:
            try:
                place = rows.session_place(conn, session_id)
            except SessionNotFound:
                return None
            row = rows.get_artifact(conn, session_id, OVERSIZED, artifact_id)
            if row is not None and not place.moving:
                name = oversized_name(artifact_id)
                path = session_dir(self.root, place.tenant_id, session_id) / name
                # No storage call unless an unfinished fork exists (the common case); a
                # planted link is no file of ours: nothing to keep for anyone.
                with suppress(SymlinkRefused):
                    preserve_for_forks(conn, self.root, session_id, row, path, storage=self.storage)
            return place

    def _forget(self, session_id: str, artifact_id: str, seen: rows.SessionPlace) -> bool | None:
        """Step 3: delete the row if the session is where ``seen`` says, with no move since;
        whether there was a row, or None when the session moved (the file is to be removed
        again, at its new place)."""
        with write_transaction(self.engine) as conn:
            try:
                place = rows.session_place(conn, session_id)
            except SessionNotFound:  # deleted meanwhile, with its outputs
                return False
            if place != seen or place.moving:
                return None
            return rows.delete_artifact(conn, session_id, OVERSIZED, artifact_id)

    def sweep_unnamed(self, *, older_than_s: float, apply: bool, now: float) -> tuple[int, int]:
        """Oversized-output files no row names, older than ``older_than_s``: (files, bytes),
        removed when ``apply``. They are what a process killed between a publish and its
        commit leaves (nothing runs after it to remove the file), or a failed commit whose
        removal failed too.

        The age keeps a file whose row is about to commit: the file is published (renamed,
        which sets its change time; copied, on S3) in the transaction that inserts its row,
        just before the commit, so a file that old with no row has no commit to come. Rows
        are read after the files are listed: a row committed meanwhile is seen. A file is
        named by a row of its session (the directory's name) whatever the tenant directory
        (a move's repair settles that), and a fork's copy has rows of the fork's own."""
        if isinstance(self.storage, FileArtifactStorage):
            found: list[tuple[str, str, Path | str, int]] = list(
                old_oversized_files(self.root, older_than_s=older_than_s, now=now)
            )
        else:
            from core.artifacts.objects import ObjectArtifactStorage  # obstore loads lazily

            assert isinstance(self.storage, ObjectArtifactStorage)
            found = list(
                self.storage.old_oversized_objects(
                    older_than_s=older_than_s, now=now, required=apply
                )
            )
        unnamed = []
        for start in range(0, len(found), _OWNERS_BATCH):
            batch = found[start : start + _OWNERS_BATCH]
            with read_connection(self.engine) as conn:
                owners = rows.oversized_owners(conn, {a for _s, a, _p, _n in batch})
            named = {(encode_component(s), a) for s, a in owners}
            unnamed += [(p, n) for s, a, p, n in batch if (s, a) not in named]
        if apply:
            for where, _size in unnamed:
                self._remove_found(where)
        if unnamed:
            logger.info(
                "oversized outputs no row names swept",
                extra={"files": len(unnamed), "applied": apply},
            )
        return len(unnamed), sum(size for _where, size in unnamed)

    @storage_errors("artifacts")
    def _remove_found(self, where: Path | str) -> None:
        if isinstance(where, Path):
            nofollow.unlink(self.root, where)
        else:
            self.storage.delete(where)

    def stats(self, *, tenant_id: str | None = None) -> ArtifactStats:
        """How many oversized outputs are stored, and their bytes (all tenants by default)."""
        with read_connection(self.engine) as conn:
            return rows.stats(conn, OVERSIZED, tenant_id=tenant_id)

    def expire(
        self,
        *,
        now: datetime | None = None,
        apply: bool = False,
        limit: int = 1000,
        skip: Collection[tuple[str, str]] = (),
    ) -> ExpireReport:
        """Oversized outputs past their TTL, but those ``skip`` names (session id, artifact
        id); with ``apply``, remove them (files, then rows). One whose file cannot be removed
        is reported in ``failed`` and the others still go; ``StorageUnavailable`` (the
        storage itself failing) ends the call."""
        with read_connection(self.engine) as conn:
            moment = now or database_now(conn)
            listed = rows.expired_oversized(conn, moment, limit + len(skip))
        expired = [(s, t, a) for s, t, a in listed if (s, a) not in skip][:limit]
        if not apply:
            return ExpireReport([(s, a) for s, _, a in expired], 0, False)
        deleted, failed = 0, []
        for session_id, _tenant, artifact_id in expired:
            try:
                deleted += self.discard(session_id, artifact_id)
            except (OSError, ArtifactError) as exc:  # this file only (a directory in the way)
                failed.append((session_id, artifact_id, str(exc)))
        logger.info(
            "oversized outputs expired",
            extra={"expired": len(expired), "deleted": deleted, "failed": len(failed)},
        )
        return ExpireReport([(s, a) for s, _, a in expired], deleted, True, failed)
