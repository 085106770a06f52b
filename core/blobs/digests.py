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
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict


class StoredDigests:
    """blob hash -> SHA-256 of its stored gzip bytes, the most recent ``max_entries``."""

    def __init__(self, *, max_entries: int = 16_384) -> None:
        self.max_entries = max_entries
        self._digests: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, blob_hash: str, codec: str, stored: bytes) -> None:
        if codec != "gzip":
            return
        digest = hashlib.sha256(stored).digest()
        with self._lock:
            self._digests[blob_hash] = digest
            self._digests.move_to_end(blob_hash)
            while len(self._digests) > self.max_entries:
                self._digests.popitem(last=False)

    def matches(self, blob_hash: str, codec: str, stored: bytes) -> bool:
        """Whether ``stored`` are the very gzip bytes recorded for this blob."""
        if codec != "gzip":
            return False
        with self._lock:
            known = self._digests.get(blob_hash)
        return known is not None and hashlib.sha256(stored).digest() == known

    def forget(self, blob_hash: str) -> None:
        with self._lock:
            self._digests.pop(blob_hash, None)
