"""A blob the preview could not show (missing, corrupt, unreadable) is tried again once
``RETRY_FAILED_S`` has passed: a long ``events --follow`` shows it once it is repaired,
and in the meantime it is read once, however many events name it."""

from __future__ import annotations

import pytest

from core.blobs.store import make_ref, sha256_hex
from core.errors import BlobCorrupted, BlobNotFound, StorageUnavailable
from core.query.preview import RETRY_FAILED_S, Previewer

TEXT = b"the tool's long output " * 20
HASH = sha256_hex(TEXT)


@pytest.mark.parametrize(
    ("failure", "shown"),
    [
        (BlobNotFound(HASH), "[missing blob"),
        (BlobCorrupted(HASH, "digest mismatch"), "[corrupt blob"),
        (StorageUnavailable("blobs", "blobs are unavailable: EIO"), "[unreadable blob"),
    ],
)
def test_a_blob_that_failed_is_read_again_after_the_retry_interval(
    failure: Exception, shown: str
) -> None:
    now = [100.0]
    reads: list[str] = []
    broken = [True]

    def head(blob_hash: str) -> bytes:
        reads.append(blob_hash)
        if broken[0]:
            raise failure
        return TEXT

    preview = Previewer(size=lambda _: len(TEXT), head=head, clock=lambda: now[0])
    view = preview.scoped(lambda: {HASH})
    ref = make_ref(HASH)
    assert view.text(ref).startswith(shown)
    broken[0] = False  # repaired
    now[0] += RETRY_FAILED_S / 2
    assert view.text(ref).startswith(shown) and len(reads) == 1  # not read again yet
    now[0] += RETRY_FAILED_S / 2
    assert view.text(ref).startswith("the tool's long output")
    assert len(reads) == 2
    now[0] += RETRY_FAILED_S * 10
    assert preview.scoped(lambda: {HASH}).text(ref).startswith("the tool's")
    assert len(reads) == 2  # a blob shown is never read again
