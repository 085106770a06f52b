"""Artifact bytes on S3-compatible object storage (``s3://bucket/prefix``), through obstore.

The store is built by ``core.blobs.objects.open_s3_store`` (one place reads the URL and the
standard AWS variables). By object-storage means:

- a put is whole-object: one PUT, or a multipart upload that appears only once completed;
- a streamed write (the output sink, a rehydrate build) is spooled to a local file under
  ``spool_dir`` (a cache) and uploaded when it finishes: a crash leaves at most a spool
  file, never a partial object;
- ``copy`` is a server-side ``CopyObject``: no bytes through the worker;
- ``delete_prefix`` lists only the prefix it removes; quotas never list.
"""

from __future__ import annotations

import io
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import obstore
from obstore.store import S3Store

from core.artifacts.paths import OVERSIZED_DIR, STAGING_DIR, oversized_id_of
from core.artifacts.storage import Tally, check_key, check_prefix, opened_source
from core.blobs.objects import DEFAULT_S3_LIMITS, clock_offset, open_s3_store, storage_call
from core.errors import StorageUnavailable
from core.urls import hide_password

_T = TypeVar("_T")
# Below this, one PUT; above, obstore's multipart upload (atomic on completion too).
_SINGLE_PUT_BYTES = 8 * 1024 * 1024
_CHUNK_BYTES = 1024 * 1024  # what put_file reads (and hashes, and reports) at a time


class ObjectArtifactStorage:
    def __init__(self, store: S3Store, url: str, *, spool_dir: Path | None = None) -> None:
        self.store = store
        self.url = url
        self.spool_dir = spool_dir

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        spool_dir: Path | None = None,
        s3_limits: tuple[float, float] = DEFAULT_S3_LIMITS,
    ) -> ObjectArtifactStorage:
        return cls(open_s3_store(url, "artifacts", s3_limits), url, spool_dir=spool_dir)

    def _call(self, call: Callable[[], _T]) -> _T:
        return storage_call("artifacts", call)

    def read(self, key: str) -> bytes | None:
        check_key(key)
        try:
            return self._call(lambda: obstore.get(self.store, key).bytes().to_bytes())
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        self._call(lambda: obstore.put(self.store, key, data, use_multipart=False))

    def put_file(
        self, key: str, local: Path | BinaryIO, *, on_chunk: Callable[[], None] | None = None
    ) -> tuple[int, str]:
        check_key(key)

        def upload() -> tuple[int, str]:  # each attempt reads the file from its start
            tally = Tally()
            with opened_source(local) as source:
                multipart = os.fstat(source.fileno()).st_size > _SINGLE_PUT_BYTES
                # Chunks as obstore takes them to send (a part at a time in flight, so
                # memory stays bounded), each one measured as it goes and reported: what
                # is measured is what was sent, though the file grow meanwhile
                body = tally.chunks(source, _CHUNK_BYTES, on_chunk)
                obstore.put(self.store, key, body, use_multipart=multipart)
            return tally.measured

        return self._call(upload)

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        check_key(key)
        if self.spool_dir is not None:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="spool-", suffix=".part", dir=self.spool_dir)
        spool = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                yield out
            self.put_file(key, spool)
        finally:
            spool.unlink(missing_ok=True)

    def delete(self, key: str) -> bool:
        check_key(key)
        if self.size(key) is None:
            return False
        self._call(lambda: obstore.delete(self.store, key))
        return True

    def delete_prefix(self, prefix: str) -> int:
        prefix = check_prefix(prefix) + "/"
        keys = [str(m["path"]) for m in self._list(prefix)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys a call
            batch = keys[start : start + 1000]
            self._call(lambda batch=batch: obstore.delete(self.store, batch))  # type: ignore[misc]
        return len(keys)

    def keys(self, prefix: str) -> list[str]:
        return sorted(str(m["path"]) for m in self._list(check_prefix(prefix) + "/"))

    def copy(self, source: str, target: str) -> None:
        check_key(source)
        check_key(target)
        self._call(lambda: obstore.copy(self.store, source, target))

    def size(self, key: str) -> int | None:
        check_key(key)
        try:
            return int(self._call(lambda: obstore.head(self.store, key))["size"])
        except FileNotFoundError:
            return None

    def open_read(self, key: str) -> BinaryIO:
        check_key(key)
        reader = self._call(lambda: obstore.open_reader(self.store, key))
        return cast(BinaryIO, _Reader(reader))

    def sweep_staging(self, *, older_than_s: float, apply: bool, now: float) -> tuple[int, int]:
        """Staged uploads (``<tenant>/<session>/.tmp/*.tmp``) a killed process left, older
        than ``older_than_s`` by object time: (objects, bytes), removed when ``apply``.
        ``.bak``/``.del`` rollback copies are left for an operator, as on disk. A
        maintenance job: it lists the whole artifact prefix."""
        found, before = [], self._store_time(now - older_than_s, required=apply)
        for meta in self._list(None):
            parts = str(meta["path"]).split("/")
            if len(parts) == 4 and parts[2] == STAGING_DIR and parts[3].endswith(".tmp"):
                if meta["last_modified"].timestamp() <= before:
                    found.append((str(meta["path"]), int(meta["size"])))
        if apply:
            for key, _size in found:
                self._call(lambda key=key: obstore.delete(self.store, key))  # type: ignore[misc]
        return len(found), sum(size for _key, size in found)

    def old_oversized_objects(
        self, *, older_than_s: float, now: float, required: bool = True
    ) -> list[tuple[str, str, str, int]]:
        """Oversized-output objects (``<tenant>/<session>/oversized/art_*.txt``) older than
        ``older_than_s`` by object time (set by their publish, a server-side copy): (session
        directory name, artifact id, key, size) of each. A maintenance job: it lists the
        whole artifact prefix."""
        found, before = [], self._store_time(now - older_than_s, required=required)
        for meta in self._list(None):
            parts = str(meta["path"]).split("/")
            if len(parts) != 4 or parts[2] != OVERSIZED_DIR:
                continue
            artifact_id = oversized_id_of(parts[3])
            if artifact_id is not None and meta["last_modified"].timestamp() <= before:
                found.append((parts[1], artifact_id, str(meta["path"]), int(meta["size"])))
        return found

    def _store_time(self, moment: float, *, required: bool) -> float:
        """``moment`` of this host's clock by the store's, which stamps objects' times: a
        host hours ahead of it swept a staged upload, or an output published in a
        transaction about to commit, as if they were that old."""
        return moment + clock_offset(self.store, "artifacts", required=required)

    def probe(self) -> str:
        key = f".health/{uuid.uuid4().hex}"
        self._call(lambda: obstore.put(self.store, key, b"ok"))
        got = self._call(lambda: obstore.get(self.store, key).bytes().to_bytes())
        if got != b"ok":
            raise StorageUnavailable("artifacts", "the object store returned other bytes")
        self._call(lambda: obstore.delete(self.store, key))
        return f"object store {hide_password(self.url)} answers"

    def _list(self, prefix: str | None) -> Iterator[Any]:
        stream = self._call(lambda: obstore.list(self.store, prefix=prefix, chunk_size=1000))
        while True:
            try:
                page = self._call(lambda: next(stream))
            except StopIteration:
                return
            yield from page


class _Reader(io.RawIOBase):
    """obstore's buffered reader as a binary file object (``read``, ``readinto``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = storage_call("artifacts", lambda: bytes(self._inner.read(len(view))))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()
