"""Content-addressed, compressed blobs shared by all sessions: the store, externalization
of large values into blobs on write, and rehydration from the manifest on read."""

from core.blobs.backends import blob_store_for, open_blob_store
from core.blobs.files import FileBlobStore
from core.blobs.store import (
    BlobIndex,
    BlobStats,
    BlobStore,
    PutResult,
    make_ref,
    parse_ref,
    sha256_hex,
)

__all__ = [
    "BlobIndex",
    "BlobStats",
    "BlobStore",
    "FileBlobStore",
    "PutResult",
    "blob_store_for",
    "make_ref",
    "open_blob_store",
    "parse_ref",
    "sha256_hex",
]
