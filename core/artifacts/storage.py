"""Where artifact bytes live: one small interface, a filesystem and an S3 implementation.

A key is a relative POSIX path below the artifact root, ``<tenant>/<session>/<name…>``
(components built by ``paths``: encoded ids, sanitized names). ``check_key`` refuses
anything else on every backend, so the path-safety rules of the filesystem hold for object
keys too (no ``..``, no empty or dot components, no backslash, NUL or absolute key).

Guarantees, on each backend by its own means:

- ``put``/``put_file``/``writer`` publish a key whole or not at all (file: a fsynced
  temporary file in the session's staging directory renamed into place; S3: one PUT, or a
  multipart upload that only appears when completed). A writer that raises, or a process
  that dies, never publishes a partial object.
- ``copy`` never moves bytes through this process on S3 (a server-side ``CopyObject``).
- Nothing lists to count: quotas come from the database rows (``rows``), never from here.
- Nothing follows a symlink on the filesystem (``nofollow``).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

from core import nofollow
from core.artifacts.paths import STAGING_DIR
from core.errors import BadConfig, InvalidArtifactPath, StorageUnavailable
from core.fsio import yet_to_make
from core.settings import Settings
from core.translate import storage_errors
from core.urls import hide_password

_COPY_CHUNK = 1024 * 1024


def check_key(key: str) -> str:
    """``key`` if it is a safe relative key of at least ``<tenant>/<session>/<name>``."""
    parts = key.split("/")
    if (
        len(parts) < 3
        or key.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or "\\" in key
        or "\x00" in key
    ):
        raise InvalidArtifactPath(key, "not a safe artifact key")
    return key


def key_of(root: Path, path: Path) -> str:
    """The key of a path below a filesystem artifact root (callers that still hold paths)."""
    try:
        return check_key(PurePosixPath(Path(path).relative_to(root)).as_posix())
    except ValueError:
        raise InvalidArtifactPath(str(path), "outside the artifact root") from None


def key_prefix_of(root: Path, directory: Path) -> str:
    """The key prefix of a tenant or session directory below ``root``."""
    try:
        return check_prefix(PurePosixPath(Path(directory).relative_to(root)).as_posix())
    except ValueError:
        raise InvalidArtifactPath(str(directory), "outside the artifact root") from None


class ArtifactStorage(Protocol):
    """Artifact bytes by key. Missing keys: ``read``/``size`` give None, ``open_read``
    raises ``FileNotFoundError``, ``delete`` returns False, ``copy`` raises
    ``FileNotFoundError``. Backend failures raise ``StorageUnavailable("artifacts")``."""

    url: str

    def read(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...

    def put_file(
        self, key: str, local: Path | BinaryIO, *, on_chunk: Callable[[], None] | None = None
    ) -> tuple[int, str]:
        """Publish the local file's bytes at ``key`` (whole or not at all): a path, or a
        file already open for reading (read from its start; a caller that opened it without
        following links keeps that guarantee). ``on_chunk``, if given, is called as each
        chunk of the file is read to be sent (a long upload's sign of progress). Returns
        (size, SHA-256) of the bytes published, hashed as they were read to be sent: a
        file still growing is published as far as that one read went, and measured so."""

    def writer(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A binary stream whose bytes are published at ``key`` when the block ends
        cleanly, and discarded when it raises."""

    def delete(self, key: str) -> bool: ...

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix/`` (a session's directory); the count removed."""

    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix/`` (a session's directory), sorted. Moves and repair
        use it; quotas never do (they come from the rows)."""

    def copy(self, source: str, target: str) -> None:
        """``target`` gets ``source``'s bytes; server-side where the backend allows."""

    def size(self, key: str) -> int | None: ...

    def open_read(self, key: str) -> BinaryIO: ...

    def probe(self) -> str:
        """Write, read back and delete a small object; a line saying what answered."""


class FileArtifactStorage:
    """The artifact directories on a local filesystem: a thin layer over ``nofollow``. An
    OS error a retry can outlive (a full or failing disk) is ``StorageUnavailable``, on
    reads and deletes as on writes; a missing file keeps its meaning (None, False,
    ``FileNotFoundError``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _staging_temp(self, key: str, suffix: str = ".tmp") -> Path:
        tenant, session = check_key(key).split("/")[:2]
        return self.root / tenant / session / STAGING_DIR / f"{uuid.uuid4().hex}{suffix}"

    @storage_errors("artifacts")
    def read(self, key: str) -> bytes | None:
        return nofollow.read_bytes(self.root, self.path(key))

    @storage_errors("artifacts")
    def put(self, key: str, data: bytes) -> None:
        tmp = self._staging_temp(key)
        nofollow.write_new(self.root, tmp, data)
        self._publish(tmp, key)

    def put_file(
        self, key: str, local: Path | BinaryIO, *, on_chunk: Callable[[], None] | None = None
    ) -> tuple[int, str]:
        tally = Tally()
        with opened_source(local) as source, self.writer(key) as out:
            for chunk in tally.chunks(source, _COPY_CHUNK, on_chunk):
                out.write(chunk)
        return tally.measured

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        tmp = self._staging_temp(key)
        with storage_errors("artifacts"):  # a full disk is StorageUnavailable, as on S3
            fd = nofollow.create_new(self.root, tmp)
            try:
                with os.fdopen(fd, "wb") as out:
                    yield out
                    out.flush()
                    os.fsync(out.fileno())
            except BaseException:
                nofollow.unlink(self.root, tmp)
                raise
            self._publish(tmp, key)

    def _publish(self, tmp: Path, key: str) -> None:
        try:
            nofollow.replace(self.root, tmp, self.path(key))
        except BaseException:
            nofollow.unlink(self.root, tmp)
            raise

    @storage_errors("artifacts")
    def delete(self, key: str) -> bool:
        existed = nofollow.exists(self.root, self.path(key))
        nofollow.unlink(self.root, self.path(key))
        return existed

    @storage_errors("artifacts")
    def keys(self, prefix: str) -> list[str]:
        directory = self.root / check_prefix(prefix)
        found = []
        for base, _dirs, files in os.walk(directory):  # links are listed, never followed
            found += [Path(base, f).relative_to(self.root).as_posix() for f in files]
        return sorted(found)

    @storage_errors("artifacts")
    def delete_prefix(self, prefix: str) -> int:
        # One walk, by descriptor, that counts what it removes and follows no link.
        return nofollow.rmtree(self.root, self.root / check_prefix(prefix))

    @storage_errors("artifacts")
    def copy(self, source: str, target: str) -> None:
        check_key(target)
        with self.open_read(source) as src, self.writer(target) as out:
            while chunk := src.read(_COPY_CHUNK):
                out.write(chunk)

    @storage_errors("artifacts")
    def size(self, key: str) -> int | None:
        try:
            return nofollow.size(self.root, self.path(key))
        except FileNotFoundError:
            return None

    @storage_errors("artifacts")
    def open_read(self, key: str) -> BinaryIO:
        fd = nofollow.open_file(self.root, self.path(key))
        if fd is None:
            raise FileNotFoundError(key)
        return os.fdopen(fd, "rb")

    @storage_errors("artifacts")
    def probe(self) -> str:
        missing = yet_to_make(self.root, "artifact directory")  # a check makes nothing
        if missing is not None:
            return missing
        probe = self.root / f".health-{uuid.uuid4().hex}"
        nofollow.write_new(self.root, probe, b"ok")
        if nofollow.read_bytes(self.root, probe) != b"ok":
            raise StorageUnavailable("artifacts", "the artifact directory returned other bytes")
        nofollow.unlink(self.root, probe)
        return f"artifact directory {self.root} is writable"


class Tally:
    """Size and SHA-256 of the chunks passed through ``chunks``."""

    def __init__(self) -> None:
        self.size = 0
        self.hashed = hashlib.sha256()

    def chunks(
        self, source: BinaryIO, chunk_bytes: int, on_chunk: Callable[[], None] | None = None
    ) -> Iterator[bytes]:
        """``source`` read to its end, ``chunk_bytes`` at a time, each chunk counted before
        it is yielded (and ``on_chunk`` called once it was taken)."""
        while chunk := source.read(chunk_bytes):
            yield self.add(chunk)
            if on_chunk is not None:
                on_chunk()

    def add(self, chunk: bytes) -> bytes:
        """``chunk``, counted."""
        self.hashed.update(chunk)
        self.size += len(chunk)
        return chunk

    @property
    def measured(self) -> tuple[int, str]:
        """(size, SHA-256 hex) of what passed."""
        return self.size, self.hashed.hexdigest()


def check_prefix(prefix: str) -> str:
    """A session (or tenant) prefix: ``<tenant>`` or ``<tenant>/<session>``."""
    check_key(prefix.rstrip("/") + "/x/x")
    return prefix.rstrip("/")


def artifact_url_of(value: str) -> str:
    """``file:///abs``/``s3://bucket[/prefix]`` as given, a bare path as a file URL; else
    ``BadConfig``."""
    parsed = urlparse(value)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise BadConfig(
                f"artifact_url {hide_password(value)!r}: s3:// needs a bucket (s3://bucket/prefix)"
            )
        return value.rstrip("/")
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise BadConfig(
                f"artifact_url {hide_password(value)!r}: expected file:///absolute/path"
            )
        return value
    if parsed.scheme == "" and value:
        return Path(value).resolve().as_uri()
    shown = hide_password(value)
    raise BadConfig(f"artifact_url {shown!r}: expected file:///absolute/path or s3://bucket/prefix")


@contextmanager
def opened_source(local: Path | BinaryIO) -> Iterator[BinaryIO]:
    """``local`` open for reading from its start: a path is opened (and closed after); an
    open file is rewound and left open (its owner closes it)."""
    if isinstance(local, Path):
        with open(local, "rb") as source:
            yield source
        return
    local.seek(0)
    yield local


def open_artifact_storage(
    url: str, *, spool_dir: Path | None = None, s3_limits: tuple[float, float] | None = None
) -> ArtifactStorage:
    """The backend a URL names. ``spool_dir`` (S3): where streamed writes are spooled
    locally before their upload (a cache directory; a crash leaves only a spool file).
    ``s3_limits``: ``Settings.s3_limits``, else the defaults."""
    url = artifact_url_of(url)
    if url.startswith("s3://"):
        from core.artifacts.objects import ObjectArtifactStorage  # obstore loads lazily

        if s3_limits is None:
            return ObjectArtifactStorage.from_url(url, spool_dir=spool_dir)
        return ObjectArtifactStorage.from_url(url, spool_dir=spool_dir, s3_limits=s3_limits)
    return FileArtifactStorage(Path(url2pathname(urlparse(url).path)))


def artifact_storage_for(settings: Settings) -> ArtifactStorage:
    """The artifact backend ``settings`` name: their URL, spool directory and S3 limits."""
    return open_artifact_storage(
        settings.resolved_artifact_url,
        spool_dir=settings.artifact_spool_dir,
        s3_limits=settings.s3_limits,
    )
