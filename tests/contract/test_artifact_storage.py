"""The artifact storage contract, run on file:// and on s3:// (a real moto server)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import obstore
import pytest

from core.artifacts import objects as object_storage
from core.artifacts.objects import ObjectArtifactStorage
from core.artifacts.storage import (
    ArtifactStorage,
    FileArtifactStorage,
    artifact_storage_for,
    artifact_url_of,
    check_key,
    open_artifact_storage,
)
from core.errors import BadConfig, InvalidArtifactPath, StorageUnavailable, SymlinkRefused
from core.health import check_artifact_storage
from core.settings import Settings

KEY = "t/s/tool-output/1.log"


@pytest.fixture(params=["file", "s3"])
def artifact_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return (tmp_path / "artifacts").as_uri()
    return str(request.getfixturevalue("s3_bucket")) + "/artifacts"


@pytest.fixture
def storage(artifact_url: str, tmp_path: Path) -> ArtifactStorage:
    return open_artifact_storage(artifact_url, spool_dir=tmp_path / "cache" / "spool")


def test_put_read_size_delete(storage: ArtifactStorage) -> None:
    assert storage.read(KEY) is None and storage.size(KEY) is None
    storage.put(KEY, b"one")
    assert storage.read(KEY) == b"one" and storage.size(KEY) == 3
    storage.put(KEY, b"two!")  # a rewrite replaces the whole object
    assert storage.read(KEY) == b"two!"
    assert storage.delete(KEY) is True
    assert storage.delete(KEY) is False
    assert storage.read(KEY) is None


def test_streamed_write_publishes_only_on_success(storage: ArtifactStorage, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), storage.writer(KEY) as out:
        out.write(b"partial")
        raise RuntimeError("crash mid-write")
    assert storage.read(KEY) is None
    big = os.urandom(3 * 1024 * 1024)
    with storage.writer(KEY) as out:
        out.write(big[:1000])
        out.write(big[1000:])
    assert storage.read(KEY) == big
    with storage.open_read(KEY) as src:
        assert src.read(10) == big[:10]
        assert src.read() == big[10:]
    spool = tmp_path / "cache" / "spool"
    assert not spool.exists() or not list(spool.iterdir())  # no spool file left behind


@pytest.mark.parametrize("size", [0, 3 * 1024 * 1024 + 1, 9 * 1024 * 1024 + 512])
def test_put_file_reports_each_chunk_it_sends(
    storage: ArtifactStorage, tmp_path: Path, size: int
) -> None:
    """``on_chunk`` is called once per MiB read to be sent (a rehydrate build's sign of
    progress while it uploads), whether the upload is one PUT or multipart (over 8 MiB on
    S3), and the object is the file's bytes, whole."""
    local = tmp_path / "local.bin"
    data = os.urandom(size)
    local.write_bytes(data)
    chunks: list[int] = []
    storage.put_file(KEY, local, on_chunk=lambda: chunks.append(1))
    assert storage.read(KEY) == data
    assert len(chunks) == -(-size // (1024 * 1024))
    storage.put_file("t/s/plain.bin", local)  # without it, as before
    assert storage.read("t/s/plain.bin") == data


def test_copy_and_delete_prefix(storage: ArtifactStorage) -> None:
    storage.put("t/s/a/1.log", b"a")
    storage.put("t/s/b.json", b"b")
    storage.put("t/s2/c.json", b"c")
    storage.copy("t/s/a/1.log", "t/fork/a/1.log")
    assert storage.read("t/fork/a/1.log") == b"a"
    with pytest.raises(FileNotFoundError):
        storage.copy("t/s/missing", "t/fork/missing")
    with pytest.raises(FileNotFoundError):
        storage.open_read("t/s/missing")
    assert storage.delete_prefix("t/s") == 2
    assert storage.read("t/s/a/1.log") is None and storage.read("t/s/b.json") is None
    assert storage.read("t/s2/c.json") == b"c" and storage.read("t/fork/a/1.log") == b"a"
    assert storage.delete_prefix("t/none") == 0


@pytest.mark.parametrize(
    "key",
    ["../s/x", "t/../x", "t/s/", "/t/s/x", "t//s/x", "t/s/./x", "t\\s\\x", "t/s", "t/s/x\x00"],
)
def test_unsafe_keys_refused(storage: ArtifactStorage, key: str) -> None:
    with pytest.raises(InvalidArtifactPath):
        storage.put(key, b"x")
    with pytest.raises(InvalidArtifactPath):
        storage.read(key)
    with pytest.raises(InvalidArtifactPath):
        storage.copy(KEY, key)


def test_probe(storage: ArtifactStorage) -> None:
    assert storage.probe()


def test_file_storage_refuses_links(tmp_path: Path) -> None:
    storage = FileArtifactStorage(tmp_path / "artifacts")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "artifacts" / "t").mkdir(parents=True)
    (tmp_path / "artifacts" / "t" / "s").symlink_to(outside)
    with pytest.raises(SymlinkRefused):
        storage.put(KEY, b"x")
    with pytest.raises(SymlinkRefused):
        storage.read(KEY)
    assert list(outside.iterdir()) == []


def test_file_delete_prefix_counts_what_it_removes_through_no_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One walk by descriptor: it counts what it removes (a link planted inside is removed
    and counted, never followed) and lists nothing through a link at the prefix itself."""
    storage = FileArtifactStorage(tmp_path / "artifacts")
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "x.log").write_bytes(b"x")
    for key in ("t/s/1.log", "t/s/a/2.log", "t/s/a/b/3.log"):
        storage.put(key, b"k")
    (tmp_path / "artifacts" / "t" / "s" / "a" / "dir-link").symlink_to(outside)
    (tmp_path / "artifacts" / "t" / "s" / "file-link").symlink_to(outside / "deep" / "x.log")
    (tmp_path / "artifacts" / "t" / "linked").symlink_to(outside)
    listed: list[str] = []
    real_scandir = os.scandir

    def scandir(path: Any = ".") -> Any:
        if not isinstance(path, int):
            listed.append(os.path.realpath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert storage.delete_prefix("t/s") == 5  # three files and two links
    with pytest.raises(SymlinkRefused):
        storage.delete_prefix("t/linked")
    assert not any(p.startswith(str(outside.resolve())) for p in listed), listed
    assert (outside / "deep" / "x.log").read_bytes() == b"x"
    assert not (tmp_path / "artifacts" / "t" / "s").exists()


def test_s3_copy_is_server_side(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fork copy on S3 reads no bytes through the worker: no GET, only a CopyObject."""
    storage = open_artifact_storage(s3_bucket + "/a")
    assert isinstance(storage, ObjectArtifactStorage)
    data = os.urandom(2 * 1024 * 1024)
    storage.put(KEY, data)
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            real = getattr(obstore, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                calls.append(name)
                return real(*args, **kwargs)

            return counted

    monkeypatch.setattr(object_storage, "obstore", Counting())
    storage.copy(KEY, "t/fork/tool-output/1.log")
    assert calls == ["copy"]
    monkeypatch.undo()
    assert storage.read("t/fork/tool-output/1.log") == data


def test_s3_unreachable_is_storage_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_RETRIES", "0")
    storage = open_artifact_storage("s3://nobucket/p")
    with pytest.raises(StorageUnavailable) as err:
        storage.probe()
    assert err.value.component == "artifacts"


@pytest.mark.parametrize("url", ["http://x/y", "s3://", "file://host/x", "ftp://a/b", ""])
def test_bad_artifact_url(url: str) -> None:
    with pytest.raises(BadConfig):
        artifact_url_of(url)


def test_settings_artifact_url(tmp_path: Path, s3_bucket: str) -> None:
    base = Settings(data_dir=tmp_path)
    assert base.resolved_artifact_url == (tmp_path / "artifacts").resolve().as_uri()
    assert base.artifacts_on_filesystem
    rooted = base.with_overrides(artifact_root=tmp_path / "elsewhere")
    assert rooted.resolved_artifact_url == (tmp_path / "elsewhere").resolve().as_uri()
    by_url = base.with_overrides(artifact_url=(tmp_path / "u").as_uri())
    assert by_url.resolved_artifact_root == (tmp_path / "u").resolve()
    on_s3 = base.with_overrides(artifact_url=s3_bucket + "/p/")
    assert not on_s3.artifacts_on_filesystem and on_s3.resolved_artifact_url == s3_bucket + "/p"
    # a bare path (SESSIONSTORE_ARTIFACT_URL=/srv/artifacts) is that directory everywhere:
    # the storage, the root and the filesystem check (the root stayed in the data dir)
    for bare in (str(tmp_path / "bare"), "relative/arts"):
        by_path = base.with_overrides(artifact_url=bare)
        assert by_path.resolved_artifact_root == Path(bare).resolve()
        assert by_path.resolved_artifact_url == Path(bare).resolve().as_uri()
        assert by_path.artifacts_on_filesystem
    with pytest.raises(ValueError, match="artifact_url 'ftp://a/b'"):
        base.with_overrides(artifact_url="ftp://a/b")
    with pytest.raises(ValueError, match="artifact_url"):
        base.with_overrides(artifact_url="http://nope")


def test_health_checks_artifact_storage(tmp_path: Path, s3_bucket: str) -> None:
    base = Settings(data_dir=tmp_path)
    # not there yet: said so, not made by the check; there: probed with a file
    assert "is not there yet: it can be made" in check_artifact_storage(base)
    storage = artifact_storage_for(base)
    assert isinstance(storage, FileArtifactStorage)
    root = storage.root
    assert not root.exists()
    root.mkdir(parents=True)
    assert "writable" in check_artifact_storage(base)
    assert "answers" in check_artifact_storage(base.with_overrides(artifact_url=s3_bucket + "/p"))


def test_check_key() -> None:
    assert check_key("a/b/c") == "a/b/c"
