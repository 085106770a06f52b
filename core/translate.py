"""Driver errors become typed errors here, and nowhere else.

The storage boundary (the journal's writes and reads, the blob index, the dead-letter
table) runs inside ``storage_errors()``. What escapes it is one of:

- ``StorageUnavailable``: transient. The database (or broker) was unreachable, the
  connection dropped, a lock or the pool timed out, SQLite was busy, locked or full.
  Retrying later can succeed.
- ``StorageUnavailable`` too for the blob and artifact files (``storage_errors("blobs")``
  around the file backends' reads, writes, moves and deletes) when the OS error is one a retry can
  outlive: the disk or quota is full (``ENOSPC``, ``EDQUOT``), the device failed or went
  read-only (``EIO``, ``EROFS``: an operator repairs or remounts it), or a resource ran out
  for now (``EAGAIN``, ``ENOMEM``, ``ENOBUFS``, ``ENFILE``, ``EMFILE``, ``EBUSY``,
  ``ETIMEDOUT``, ``ESTALE``). A write is never bad input because the disk is full: the
  queue retries it, and the CLI says the storage is unavailable.
  The other OS errors escape raw: a missing file (``ENOENT``), a refused path
  (``ENAMETOOLONG``, ``ENOTDIR``, ``EISDIR``, ``ELOOP`` of a refused symlink) or a
  permission the deployment lacks (``EACCES``, ``EPERM``) is a bug or a configuration to
  fix, which no retry repairs.
- ``InvalidEvent``: permanent. The database refused the values themselves: a DataError,
  a string it cannot encode (lone surrogates), a NUL where PostgreSQL forbids it, a number
  out of its range. Retrying cannot succeed.
- ``ConcurrencyConflict`` and the other domain errors, which pass through unchanged.

Anything else (a bug) escapes untranslated. Callers such as ``tasks/`` decide whether to
retry from these types alone and never import a driver's exception module.
"""

from __future__ import annotations

import errno
import functools
import sqlite3
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

from sqlalchemy import exc as sa_exc

from core.errors import InvalidEvent, SessionStoreError, StorageUnavailable

P = ParamSpec("P")
R = TypeVar("R")

_TRANSIENT_SQLSTATES = {
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
    "55P03",  # lock_not_available
    "57014",  # query_canceled (statement or lock timeout)
    "57P01",  # admin_shutdown
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now
    "53100",  # disk_full
    "53200",  # out_of_memory
    "53300",  # too_many_connections
}
# SQLite reports these as OperationalError with a message and no code in the exception.
_SQLITE_TRANSIENT = (
    "locked",
    "busy",
    "database or disk is full",
    "disk i/o error",
    "unable to open database file",
)
_SQLITE_PERMANENT = ("too large", "string or blob too big")
# OS errors on the blob and artifact files that a retry can outlive (module docstring).
_TRANSIENT_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EIO,
    errno.EROFS,
    errno.EAGAIN,
    errno.ENOMEM,
    errno.ENOBUFS,
    errno.ENFILE,
    errno.EMFILE,
    errno.EBUSY,
    errno.ETIMEDOUT,
    errno.ESTALE,
}
# Broker (redis-py, kombu) errors are recognised by name, so core imports neither.
_BROKER_MODULES = ("redis", "kombu", "amqp")
_BROKER_TRANSIENT = {"ConnectionError", "TimeoutError", "BusyLoadingError", "OperationalError"}


def reason_of(exc: BaseException) -> str:
    """The first line of a driver's message: obstore, for one, appends a multi-line debug
    dump (``--debug`` shows it, in the traceback of the typed error's cause)."""
    orig = getattr(exc, "orig", None) or exc
    return str(orig).split("\n", 1)[0][:300] or type(orig).__name__


def translate(exc: BaseException, *, component: str = "database") -> SessionStoreError | None:
    """The typed error for ``exc``, or None if it is not a storage error we know."""
    if isinstance(exc, SessionStoreError):
        return exc
    if _is_unavailable(exc):
        return StorageUnavailable(component, f"{component} is unavailable: {reason_of(exc)}")
    if _is_bad_value(exc):
        return InvalidEvent("", f"the {component} refused a value: {reason_of(exc)}")
    if _is_broker_error(exc):
        return StorageUnavailable("broker", f"broker is unavailable: {reason_of(exc)}")
    return None


def is_unavailable(exc: BaseException) -> bool:
    """True for a transient failure, typed or still raw."""
    return isinstance(translate(exc), StorageUnavailable)


def _psycopg(name: str) -> tuple[type[BaseException], ...]:
    """psycopg's exception class ``name``; none while psycopg was never imported, when no
    psycopg error can exist (the embedded CLI and workers on SQLite never load it: a
    tenth of a second of every start)."""
    module = sys.modules.get("psycopg")
    return () if module is None else (getattr(module, name),)


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        orig = exc.orig
        if getattr(orig, "sqlstate", None) in _TRANSIENT_SQLSTATES:
            return True
        if isinstance(orig, sqlite3.OperationalError):
            return any(p in str(orig).lower() for p in _SQLITE_TRANSIENT)
        if isinstance(orig, _psycopg("OperationalError")):
            return True
        return isinstance(exc, sa_exc.OperationalError)
    if isinstance(exc, sqlite3.OperationalError):
        return any(p in str(exc).lower() for p in _SQLITE_TRANSIENT)
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return isinstance(
        exc, (sa_exc.TimeoutError, *_psycopg("OperationalError"), ConnectionError, TimeoutError)
    )


def _is_bad_value(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.DataError):
        return True
    if isinstance(exc, sa_exc.StatementError) and exc.orig is not None:
        exc = exc.orig
    bad_values = (*_psycopg("DataError"), sqlite3.DataError, UnicodeEncodeError, OverflowError)
    if isinstance(exc, bad_values):
        return True
    if isinstance(exc, sqlite3.OperationalError):
        return any(p in str(exc).lower() for p in _SQLITE_PERMANENT)
    # psycopg refuses a NUL in a text parameter with a plain ValueError before sending it.
    return isinstance(exc, ValueError) and "NUL" in str(exc)


def _is_broker_error(exc: BaseException) -> bool:
    for cls in type(exc).__mro__:
        if cls.__module__.split(".")[0] in _BROKER_MODULES and cls.__name__ in _BROKER_TRANSIENT:
            return True
    return False


@contextmanager
def storage_errors(component: str = "database") -> Iterator[None]:
    """Run a storage call; known driver errors leave it typed (see the module docstring)."""
    try:
        yield
    except Exception as exc:
        typed = translate(exc, component=component)
        if typed is None or typed is exc:
            raise
        raise typed from exc


def translated(func: Callable[P, R]) -> Callable[P, R]:
    """``storage_errors()`` around a whole function or method."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with storage_errors():
            return func(*args, **kwargs)

    return wrapper
