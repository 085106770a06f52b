"""A session move on object storage: the directory rename becomes copy, mark, delete.

The intent row (invariant 12) is committed before any object is touched, as on disk. Then:

1. every object under the source prefix is copied (server-side) under the target prefix;
2. a marker object ``<target>/.tmp/move-complete`` says the target is whole;
3. the source objects are deleted.

``repair`` reads the marker: present means the copy finished, so the move completes (the
remaining source objects are copied over and deleted, then the marker); absent means it
rolls back (the target's objects are deleted, those missing at the source copied back
first). Either way the source or the target is whole at every step, and nothing is lost,
not even what was written at the source after a crash.
"""

from __future__ import annotations

import logging
from pathlib import Path

from core.artifacts.paths import STAGING_DIR
from core.artifacts.storage import ArtifactStorage, key_of, key_prefix_of
from core.errors import MoveFailed

log = logging.getLogger(__name__)

MARKER = "move-complete"


class ObjectMove:
    """``_DirectoryMove``'s protocol (``run``, ``undo``) on object storage."""

    def __init__(self, storage: ArtifactStorage, root: Path, source: Path, target: Path) -> None:
        self.storage = storage
        self.source = key_prefix_of(root, source)
        self.target = key_prefix_of(root, target)
        self.marker = key_of(root, target / STAGING_DIR / MARKER)
        self._moved = False

    def run(self) -> None:
        if self.source == self.target:
            return
        keys = self.storage.keys(self.source)
        if not keys:
            return  # nothing stored yet, or an earlier crashed move already moved it all
        if self._clear_leftovers(keys):
            keys = self.storage.keys(self.source)
        try:
            for key in keys:
                try:
                    self.storage.copy(key, self.target + key[len(self.source) :])
                except FileNotFoundError:
                    # Removed since the listing: an oversized output's discard deletes its
                    # object outside the tenant lock (it then removes it at the target too,
                    # if it was copied). Gone is gone: nothing to move.
                    log.info("an object vanished while its session moved", extra={"key": key})
            self.storage.put(self.marker, b"")
        except BaseException:
            # The source is whole: what was copied so far is removed (best effort; what
            # stays is cleared by this session's next move, see _clear_leftovers)
            try:
                self._remove_target()
            except Exception as exc:
                log.error(
                    "could not remove a failed move's partial copy",
                    extra={"target": self.target, "error": str(exc)},
                )
            raise
        self._moved = True
        for key in keys:
            self.storage.delete(key)
        self.storage.delete(self.marker)

    def _clear_leftovers(self, source_keys: list[str]) -> bool:
        """Settle what an earlier move of this session that failed part way left at the
        target, before copying; whether objects were put back at the source.

        The target prefix is this session's own directory under the other tenant, so no
        other session's objects are ever there, and no intent is pending (``repair``
        settles a crashed move before another starts): the session lives at the source.
        A leftover whose source object exists is a partial copy (a copy that failed and
        could not clean up); one whose source object is missing is the only copy of it (an
        undo that failed after the source objects were deleted): it is copied back first.
        Then the target is emptied. Left there, they made every later move to that tenant
        fail ("the target artifact prefix is not empty"), for good."""
        leftovers = [k for k in self.storage.keys(self.target) if k != self.marker]
        if not leftovers:
            return False
        present = set(source_keys)
        restored = 0
        try:
            for key in leftovers:
                back = self.source + key[len(self.target) :]
                if back not in present:
                    self.storage.copy(key, back)
                    restored += 1
            self._remove_target()
        except Exception as exc:
            raise MoveFailed(
                f"the target artifact prefix holds a failed earlier move's objects that could "
                f"not be settled: {self.target}"
            ) from exc
        log.warning(
            "settled a failed earlier move's objects at its target",
            extra={"target": self.target, "objects": len(leftovers), "restored": restored},
        )
        return restored > 0

    def _remove_target(self) -> None:
        for key in self.storage.keys(self.target):
            self.storage.delete(key)

    def undo(self) -> bool:
        """After a failed commit: copy the objects back, then remove the target's; whether
        the objects are where the session's row says (back, or never moved)."""
        if not self._moved:
            return True
        try:
            for key in self.storage.keys(self.target):
                if key != self.marker:
                    self.storage.copy(key, self.source + key[len(self.target) :])
            self.storage.delete_prefix(self.target)
            self._moved = False
        except Exception as exc:
            log.error(
                "could not move a session's artifact objects back after a failed move",
                extra={"source": self.source, "target": self.target, "error": str(exc)},
            )
            return False
        return True

    def settle(self) -> bool:
        """For ``repair``: finish or roll back what a crash left; True if the move is to be
        completed (the target is whole). Objects at the source beside a whole target were
        written after the copy (or are not deleted yet): copied over the target's, never
        dropped; objects at the target only, when the move rolls back, are their only copy
        (an undo that failed part way, or sources written after they were all deleted):
        copied back before the target is emptied."""
        if self.source == self.target:
            return True
        if self.storage.size(self.marker) is not None:
            for key in self.storage.keys(self.source):
                self._copy(key, self.target + key[len(self.source) :])
                self.storage.delete(key)
            self.storage.delete(self.marker)
            return True
        at_source = self.storage.keys(self.source)
        at_target = self.storage.keys(self.target)
        if not at_source and at_target:
            return True  # the marker went last: every source object had been deleted
        present = set(at_source)
        for key in at_target:
            back = self.source + key[len(self.target) :]
            if back not in present:
                self._copy(key, back)
            self.storage.delete(key)
        return False

    def _copy(self, key: str, to: str) -> None:
        try:
            self.storage.copy(key, to)
        except FileNotFoundError:  # removed since the listing (an oversized output's discard)
            log.info("an object vanished while its session's move was repaired", extra={"key": key})
