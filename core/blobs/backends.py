"""Which blob backend a URL names: ``file:///absolute/path`` or ``s3://bucket/prefix``."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from sqlalchemy import Engine

from core.blobs.files import FileBlobStore
from core.blobs.store import BlobIndex, BlobStore
from core.errors import BlobError


def open_blob_store(url: str, engine: Engine) -> BlobStore:
    """The blob backend for a URL: ``file:///absolute/path`` or ``s3://bucket/prefix``."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        from core.blobs.objects import ObjectBlobStore, open_s3_store  # obstore loads lazily

        return ObjectBlobStore(open_s3_store(url), BlobIndex(engine))
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise BlobError(
            f"unsupported blob URL {url!r}: expected file:///absolute/path or s3://bucket/prefix"
        )
    return FileBlobStore(Path(url2pathname(parsed.path)), BlobIndex(engine))
