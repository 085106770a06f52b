"""The one translation layer: driver errors in, typed errors out (no database needed)."""

from __future__ import annotations

import errno
import os
import sqlite3

import psycopg
import pytest
import redis.exceptions
from kombu.exceptions import OperationalError as KombuOperationalError
from sqlalchemy import exc as sa_exc

from core.blobs.objects import storage_call
from core.errors import ConcurrencyConflict, InvalidEvent, StorageUnavailable
from core.translate import storage_errors, translate
from tasks.retry import is_transient


def _wrapped(cls: type[sa_exc.DBAPIError], orig: BaseException) -> sa_exc.DBAPIError:
    return cls("INSERT ...", {}, orig)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "component"),
    [
        (
            _wrapped(sa_exc.OperationalError, sqlite3.OperationalError("database is locked")),
            "database",
        ),
        (
            _wrapped(sa_exc.OperationalError, sqlite3.OperationalError("database or disk is full")),
            "database",
        ),
        (
            _wrapped(sa_exc.OperationalError, psycopg.OperationalError("connection refused")),
            "database",
        ),
        (sa_exc.TimeoutError("QueuePool limit reached"), "database"),
        (ConnectionRefusedError(), "database"),
        (redis.exceptions.ConnectionError("Connection closed by server."), "broker"),
        (redis.exceptions.TimeoutError(), "broker"),
        (KombuOperationalError("broker gone"), "broker"),
    ],
)
def test_transient_errors_become_storage_unavailable(error: Exception, component: str) -> None:
    typed = translate(error)
    assert isinstance(typed, StorageUnavailable) and typed.component == component
    assert is_transient(error) and is_transient(typed)


@pytest.mark.parametrize(
    "error",
    [
        _wrapped(sa_exc.DataError, psycopg.DataError("PostgreSQL text fields cannot contain NUL")),
        _wrapped(sa_exc.DataError, psycopg.errors.NumericValueOutOfRange("bigint out of range")),
        OverflowError("Python int too large to convert to SQLite INTEGER"),
        UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
        _wrapped(sa_exc.OperationalError, sqlite3.OperationalError("string or blob too big")),
    ],
)
def test_refused_values_become_invalid_event(error: Exception) -> None:
    assert isinstance(translate(error), InvalidEvent)
    assert not is_transient(error)


def test_domain_errors_pass_and_bugs_stay_raw() -> None:
    conflict = ConcurrencyConflict("s", 1, 2)
    with pytest.raises(ConcurrencyConflict) as info, storage_errors():
        raise conflict
    assert info.value is conflict
    with pytest.raises(KeyError), storage_errors():
        raise KeyError("a bug is not a storage error")
    unique = _wrapped(sa_exc.IntegrityError, sqlite3.IntegrityError("UNIQUE failed"))
    assert translate(unique) is None  # the journal turns it into a domain answer itself
    with pytest.raises(StorageUnavailable) as typed, storage_errors():
        raise ConnectionResetError("peer reset")
    assert isinstance(typed.value.__cause__, ConnectionResetError)


@pytest.mark.parametrize(
    "code",
    [
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        errno.EROFS,
        errno.EAGAIN,
        errno.ENOMEM,
        errno.EMFILE,
        errno.ESTALE,
    ],
)
def test_file_errors_a_retry_can_outlive_are_storage_unavailable(code: int) -> None:
    """A full disk (or quota, or a failed device) under the blob store is not bad input."""
    error = OSError(code, os.strerror(code))
    with pytest.raises(StorageUnavailable) as typed, storage_errors("blobs"):
        raise error
    assert typed.value.component == "blobs" and typed.value.__cause__ is error
    assert os.strerror(code) in typed.value.message
    assert is_transient(error) and is_transient(typed.value)


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError(errno.ENOENT, "No such file or directory"),
        PermissionError(errno.EACCES, "Permission denied"),
        OSError(errno.ENAMETOOLONG, "File name too long"),
        OSError(errno.ELOOP, "Too many levels of symbolic links"),
        OSError("no errno: a bug, not the disk"),
    ],
)
def test_file_errors_no_retry_repairs_stay_raw(error: OSError) -> None:
    assert translate(error, component="blobs") is None
    assert not is_transient(error)
    with pytest.raises(OSError) as raw, storage_errors("blobs"):
        raise error
    assert raw.value is error


def test_an_object_store_error_keeps_its_first_line_not_the_debug_dump() -> None:
    """obstore appends a debug dump of dozens of lines (865 bytes for a refused connection);
    the typed error keeps the summary, and the dump stays on its cause (``--debug``)."""
    dump = "Generic S3 error: Error performing HEAD http://h/b/k - HTTP error\n\nDebug source:\n{"

    def refused() -> None:
        raise RuntimeError(dump)

    with pytest.raises(StorageUnavailable) as typed:
        storage_call("blobs", refused)
    assert typed.value.message == "blobs is unavailable: " + dump.split("\n")[0]
    assert str(typed.value.__cause__) == dump
