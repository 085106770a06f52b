"""Which blob backend a URL names: ``file:///absolute/path`` or ``s3://bucket/prefix``."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from sqlalchemy import Engine

from core.blobs.files import FileBlobStore
from core.blobs.store import BlobIndex, BlobStore
from core.errors import BlobError
from core.settings import Settings
from core.urls import hide_password


def open_blob_store(
    url: str, engine: Engine, *, s3_limits: tuple[float, float] | None = None
) -> BlobStore:
    """The blob backend for a URL: ``file:///absolute/path`` or ``s3://bucket/prefix``
    (``s3_limits``: ``Settings.s3_limits``, else the defaults)."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        from core.blobs.objects import (  # obstore loads lazily
            DEFAULT_S3_LIMITS,
            ObjectBlobStore,
            open_s3_store,
        )

        store = open_s3_store(url, "blobs", s3_limits or DEFAULT_S3_LIMITS)
        return ObjectBlobStore(store, BlobIndex(engine))
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise BlobError(
            f"unsupported blob URL {hide_password(url)!r}: expected file:///absolute/path or s3://bucket/prefix"
        )
    return FileBlobStore(Path(url2pathname(parsed.path)), BlobIndex(engine))


def blob_store_for(settings: Settings, engine: Engine) -> BlobStore:
    """The blob backend ``settings`` name, with their S3 limits."""
    return open_blob_store(settings.resolved_blob_url, engine, s3_limits=settings.s3_limits)
