"""Digests of stored blob bytes this process wrote or verified in full.

Invariant 13: a stored object is verified against its hash before a put trusts it. For a
gzip blob that means inflating it and hashing the content: the cost of a re-put of a large
text blob, which the put itself hashed a moment ago. Once this process has verified (or
written) the stored bytes of a blob, hashing those bytes again and comparing them with the
recorded digest is the same proof at a fraction of the cost (a third of the bytes, no
inflate): the stored bytes are exactly those that decoded to the content, and decoding is
deterministic. Nothing is trusted without reading and hashing what is stored now; a file
changed in any way no longer matches and gets the full check (and, on a put, the repair).
Identity blobs need no entry: their stored bytes are the content, and the full check is
already a single hash.

A digest is recorded only for bytes known to decode to the blob's content: bytes this
process encoded from content it hashed (the same copy), or bytes it inflated and hashed.
The content's size is kept beside it, so a caller that states another size gets the full
check, and its answer, in every process alike.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections import OrderedDict


class StoredDigests:
    """blob hash -> SHA-256 of its stored gzip bytes (and the content's size), the most
    recently used ``max_entries``."""

    def __init__(self, *, max_entries: int = 16_384) -> None:
        self.max_entries = max_entries
        self._digests: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._lock = threading.Lock()
        _instances.add(self)

    def record(self, blob_hash: str, codec: str, stored: bytes, size: int) -> None:
        """``stored`` are gzip bytes known to decode to the content (``size`` bytes)."""
        if codec == "gzip":
            self.record_digest(blob_hash, codec, hashlib.sha256(stored).digest(), size)

    def record_digest(self, blob_hash: str, codec: str, digest: bytes, size: int) -> None:
        """As ``record``, given the SHA-256 of the stored bytes (hashed as they streamed)."""
        if codec != "gzip":
            return
        with self._lock:
            self._digests[blob_hash] = (digest, size)
            self._digests.move_to_end(blob_hash)
            while len(self._digests) > self.max_entries:
                self._digests.popitem(last=False)

    def matches(self, blob_hash: str, codec: str, stored: bytes, size: int | None = None) -> bool:
        """Whether ``stored`` are the very gzip bytes recorded for this blob, and (when
        given) ``size`` the size of its content."""
        if codec != "gzip" or not self.has(blob_hash):
            return False
        return self.matches_digest(blob_hash, codec, hashlib.sha256(stored).digest(), size)

    def matches_digest(
        self, blob_hash: str, codec: str, digest: bytes, size: int | None = None
    ) -> bool:
        """As ``matches``, given the SHA-256 of the stored bytes."""
        if codec != "gzip":
            return False
        with self._lock:
            known = self._digests.get(blob_hash)
            if known is not None:
                self._digests.move_to_end(blob_hash)
        if known is None or (size is not None and size != known[1]):
            return False
        return digest == known[0]

    def has(self, blob_hash: str) -> bool:
        """Whether a digest is recorded for this blob (a cheap look before hashing)."""
        with self._lock:
            return blob_hash in self._digests

    def forget(self, blob_hash: str) -> None:
        with self._lock:
            self._digests.pop(blob_hash, None)

    def _after_fork(self) -> None:
        # A thread of the parent may have held the lock when it forked; in the child that
        # thread does not exist and would never release it. The digests stay valid.
        self._lock = threading.Lock()


_instances: weakref.WeakSet[StoredDigests] = weakref.WeakSet()


def _reset_locks_in_child() -> None:
    for digests in list(_instances):
        digests._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_in_child)
