"""URLs of the broker and the result backend: which ones the queue runs on, and how any URL
is shown (its password hidden) in an error, a log line or a settings dump."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

# The embedded broker's URL (tasks.app gives Celery this with core.broker's transport).
EMBEDDED_BROKER_URL = "filesystem://localhost//"

HIDDEN = "***"

# userinfo with a password: to the LAST "@" of the word, so a password with an unencoded
# "@" or "/" is hidden whole (SQLAlchemy's parser splits "u:p@ss@h" after "p", showing "ss").
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@?#\s]*:)[^\s]*@")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&](?:password|passwd|pwd)=)[^&#\s]*", re.IGNORECASE)


def hide_password(url: str) -> str:
    """``url`` fit to print: the password of its userinfo (``scheme://user:…@``) and of a
    ``password=`` query parameter replaced by ``***``. Any text works (a URL that does
    not parse too), so every message about a setting can show what it got."""
    url = _USERINFO.sub(rf"\g<head>{HIDDEN}@", url)
    return _QUERY_PASSWORD.sub(rf"\g<head>{HIDDEN}", url)


# The journal's backends, with the drivers installed for them (None: the backend's default).
_DATABASES = {"sqlite": (None, "pysqlite"), "postgresql": ("psycopg",)}


def database_url_of(url: str) -> str:
    """The URL most deployments write (libpq's, Heroku's) with the driver installed:
    psycopg (SQLAlchemy's default for it, psycopg2, is not)."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain) :]
    return url


def check_database_url(url: str) -> None:
    """ValueError (password hidden) unless ``url`` names a backend and driver the journal
    runs on (any other passed a prefix check, then failed every command with an import
    error), with a port in range."""
    from sqlalchemy.engine import make_url  # only when a URL is set
    from sqlalchemy.exc import ArgumentError

    accepted = "sqlite:///… or postgresql+psycopg://…"
    _check_text(url, spaces=True)  # a SQLite path may have spaces
    try:
        parsed = make_url(url)
        port = parsed.port
    except ArgumentError:
        raise ValueError(f"must be a URL like {accepted}, got {_shown(url)}") from None
    except ValueError:  # int() of the port
        raise ValueError(f"the port must be a number, got {_shown(url)}") from None
    backend, driver = parsed.get_backend_name(), parsed.drivername.partition("+")[2] or None
    if driver not in _DATABASES.get(backend, ()):
        raise ValueError(
            f"must be {accepted}: SQLite, or PostgreSQL through psycopg (3), got {_shown(url)}"
        )
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"port must be from 1 to 65535, got {_shown(url)}")


BROKER_SCHEMES = ("redis", "rediss", "amqp", "amqps", "pyamqp")
REDIS_SCHEMES = ("redis", "rediss")
# Celery's rule for the URL of a Redis result backend
_SSL_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_CERT_REQS = ("CERT_REQUIRED", "CERT_OPTIONAL", "CERT_NONE", "required", "optional", "none")
_REDIS_DB = re.compile(r"/?|/[0-9]+", re.ASCII)


def check_broker_url(url: str) -> None:
    """ValueError (password hidden) unless the queue runs on broker ``url``: Redis or
    RabbitMQ (AMQP), with a port in range and, for Redis, a database number. A bad one
    used to pass the settings, then fail every enqueue in kombu (or hang)."""
    scheme = _scheme(url, BROKER_SCHEMES, "redis://host:6379/0 or amqp://host:5672//")
    _check_server(url, scheme, results=False)


def check_result_backend(url: str) -> None:
    """ValueError (password hidden) unless Celery can keep results at ``url``: Redis,
    ``rpc://`` (with an AMQP broker), or ``db+`` a database URL the journal also runs on."""
    accepted = "redis://host:6379/1, rpc://, or db+sqlite:///… / db+postgresql+psycopg://…"
    if url.startswith("db+"):
        try:
            check_database_url(url.removeprefix("db+"))
        except ValueError as exc:
            raise ValueError(f"db+ must be followed by a database URL: {exc}") from None
        return
    scheme = _scheme(url, (*REDIS_SCHEMES, "rpc"), accepted)
    if scheme != "rpc":
        _check_server(url, scheme, results=True)


def _scheme(url: str, schemes: tuple[str, ...], accepted: str) -> str:
    _check_text(url)
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in schemes:
        names = ", ".join(f"{name}://" for name in schemes)
        raise ValueError(f"must be a URL like {accepted} ({names}), got {_shown(url)}")
    return scheme


def _check_text(url: str, *, spaces: bool = False) -> None:
    # urllib drops tabs and newlines and strips spaces silently; kombu and redis-py do not
    if any(not ch.isprintable() or (ch.isspace() and not spaces) for ch in url):
        what = "control characters" if spaces else "spaces or control characters"
        raise ValueError(f"must not contain {what}, got {_shown(url)}")


def _check_server(url: str, scheme: str, *, results: bool) -> None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # "Port could not be cast to integer value as 'x'"
        raise ValueError(f"{_reason(exc)}, got {_shown(url)}") from None
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"port must be from 1 to 65535, got {_shown(url)}")
    if scheme not in REDIS_SCHEMES:
        return
    if not _REDIS_DB.fullmatch(parts.path):
        raise ValueError(
            f"the path must be a Redis database number (redis://host:6379/0), got {_shown(url)}"
        )
    if results:  # Celery's Redis result backend checks these when it connects
        _check_redis_ssl(url, scheme, parse_qs(parts.query))


def _check_redis_ssl(url: str, scheme: str, query: dict[str, list[str]]) -> None:
    if scheme == "redis" and any(name in query for name in _SSL_PARAMS):
        raise ValueError(f"ssl_* parameters need rediss://, got {_shown(url)}")
    if scheme == "rediss" and query.get("ssl_cert_reqs", [""])[-1] not in _CERT_REQS:
        raise ValueError(
            "a rediss:// URL needs ssl_cert_reqs=required (or optional, or none), "
            f"got {_shown(url)}"
        )


def _reason(exc: ValueError) -> str:
    """urllib's reason, without the value it quotes (a password where a port was expected:
    ``redis://u:pass/word@h`` reads ``pass`` as the port)."""
    text = str(exc)
    if "Port could not be cast" in text:
        return "the port must be a number"
    if "Port out of range" in text:
        return "port must be from 1 to 65535"
    return text.partition(" as ")[0]


def _shown(url: str) -> str:
    return repr(hide_password(url))
