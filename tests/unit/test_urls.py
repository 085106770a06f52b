"""Broker and result-backend URLs are checked when the settings are read, and no message
about any URL shows its password."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from core.settings import Settings
from core.urls import EMBEDDED_BROKER_URL, hide_password

SECRET = "s3cr3t-Pw"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://u:s3cr3t-Pw@h:5432/db", "postgresql+psycopg://u:***@h:5432/db"),
        ("redis://:s3cr3t-Pw@h:6379/0", "redis://:***@h:6379/0"),
        ("amqp://guest:s3cr3t-Pw@rabbit:5672//", "amqp://guest:***@rabbit:5672//"),
        ("db+postgresql+psycopg://u:s3cr3t-Pw@h/db", "db+postgresql+psycopg://u:***@h/db"),
        # an unencoded "@" or "/" in the password: SQLAlchemy's parser shows what follows "@"
        ("postgresql+psycopg://u:s3cr3t@-Pw@h/db", "postgresql+psycopg://u:***@h/db"),
        ("redis://u:s3cr3t/-Pw@h:6379/0", "redis://u:***@h:6379/0"),
        (
            "postgresql+psycopg://u@h/db?password=s3cr3t-Pw&x=1",
            "postgresql+psycopg://u@h/db?password=***&x=1",
        ),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("sqlite:////tmp/a:b@c.db", "sqlite:////tmp/a:b@c.db"),
        ("not a url", "not a url"),
    ],
)
def test_a_url_is_shown_with_its_password_hidden(url: str, shown: str) -> None:
    assert hide_password(url) == shown


def _refused(name: str, value: str) -> str:
    """The one-line reason of a refused setting, with no trace of its password anywhere."""
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings(**{name: value})  # type: ignore[arg-type]
    assert SECRET not in str(caught.value)  # a traceback's text (the worker, celery -A)
    first = caught.value.errors()[0]
    assert first["loc"] == (name,), first
    assert SECRET not in str(first["msg"])  # the CLI's one line
    return str(first["msg"])


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("mysql://u:s3cr3t-Pw@h/db", "postgresql+psycopg://"),
        ("postgresql+psycopg://u:s3cr3t-Pw@h:99999/db", "port must be from 1 to 65535"),
        ("postgresql://u:s3cr3t-Pw@h:port/db", "port must be a number"),
        ("postgresql+psycopg://u:s3cr3t-Pw@h/db\n", "control characters"),
    ],
)
def test_a_bad_database_url_is_refused_without_its_password(url: str, reason: str) -> None:
    message = _refused("database_url", url)
    assert reason in message and "u:***@h" in message


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://:s3cr3t-Pw@h:99999/0", "port must be from 1 to 65535"),
        ("redis://:s3cr3t-Pw@h:0/0", "port must be from 1 to 65535"),
        ("redis://:s3cr3t-Pw@h:63x9/0", "port must be a number"),
        ("redis://u:s3cr3t/-Pw@h:6379/0", "port must be a number"),  # urllib: "s3cr3t" is a port
        ("redis://:s3cr3t-Pw@h:6379/queue", "Redis database number"),
        ("redis://:s3cr3t-Pw@h:6379/0/1", "Redis database number"),
        ("redis://:s3cr3t-Pw@h:6379/\u0663", "Redis database number"),  # a non-ASCII digit
        ("redis://:s3cr3t-Pw@h:6379/0 ", "spaces or control characters"),
        ("REDIS://:s3cr3t-Pw@h:6379/0", "redis://host:6379/0"),
        ("memory://:s3cr3t-Pw@h", "redis://host:6379/0"),
        ("filesystem:///var/queue", "redis://host:6379/0"),
        ("sqla+postgresql://u:s3cr3t-Pw@h/db", "redis://host:6379/0"),
        ("amqp://guest:s3cr3t-Pw@rabbit:70000//", "port must be from 1 to 65535"),
        ("redis://:s3cr3t-Pw@[::1:6379/0", "Invalid IPv6 URL"),
    ],
)
def test_a_bad_broker_url_is_refused_without_its_password(url: str, reason: str) -> None:
    """Each used to pass the settings, then fail every enqueue in kombu (or hang
    reconnecting to a port that cannot exist)."""
    message = _refused("broker_url", url)
    assert reason in message, message
    assert ":***@" in message or "s3cr3t" not in url, message


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://:s3cr3t-Pw@h:99999/1", "port must be from 1 to 65535"),
        ("redis://:s3cr3t-Pw@h:6379/results", "Redis database number"),
        ("rediss://:s3cr3t-Pw@h:6380/1", "ssl_cert_reqs=required"),
        ("rediss://:s3cr3t-Pw@h:6380/1?ssl_cert_reqs=maybe", "ssl_cert_reqs=required"),
        ("redis://:s3cr3t-Pw@h:6379/1?ssl_cert_reqs=none", "need rediss://"),
        ("amqp://guest:s3cr3t-Pw@rabbit//", "rpc://"),
        ("db+mysql://u:s3cr3t-Pw@h/db", "db+ must be followed by a database URL"),
        ("db+postgresql+psycopg2://u:s3cr3t-Pw@h/db", "psycopg (3)"),
        ("s3://u:s3cr3t-Pw@bucket/results", "rpc://"),
    ],
)
def test_a_bad_result_backend_is_refused_without_its_password(url: str, reason: str) -> None:
    message = _refused("result_backend", url)
    assert reason in message and ":***@" in message, message


def test_a_rediss_broker_that_keeps_the_results_needs_celerys_ssl_parameter() -> None:
    """Results go to the broker's Redis when no backend is set: Celery's rule for a
    rediss:// result backend then holds for the broker's URL too."""
    broker = f"rediss://:{SECRET}@h:6380/0"
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings(broker_url=broker)
    assert "ssl_cert_reqs" in str(caught.value) and SECRET not in str(caught.value)
    assert Settings(broker_url=broker, result_backend="rpc://").broker_url == broker
    assert Settings(broker_url=f"{broker}?ssl_cert_reqs=required").result_backend is None


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://redis:6379/0",  # compose.yaml's
        "redis://localhost",
        "redis://:pw@127.0.0.1:6379/",
        "redis://user:pw@127.0.0.1:6379/15?socket_timeout=5",
        "redis://[::1]:6379/0",
        "rediss://h:6380/0?ssl_cert_reqs=required",
        "amqp://guest:guest@localhost:5672//",
        "amqps://rabbit/vhost",
        "pyamqp://rabbit",
    ],
)
def test_the_brokers_the_queue_runs_on_load(url: str) -> None:
    assert Settings(broker_url=url).broker_url == url


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/1",
        "redis://redis:6379/1",  # compose.yaml's
        "rediss://h:6380/1?ssl_cert_reqs=CERT_NONE",
        "rpc://",
        "db+sqlite:////tmp/results.db",
        "db+postgresql+psycopg://u:pw@127.0.0.1:5432/results",
    ],
)
def test_the_result_backends_the_queue_runs_on_load(url: str) -> None:
    assert Settings(result_backend=url).result_backend == url


def test_a_sqlite_path_may_have_spaces() -> None:
    url = "sqlite:////home/me/My Documents/journal.db"
    assert Settings(database_url=url).database_url == url
    assert Settings(result_backend=f"db+{url}").result_backend == f"db+{url}"


def test_a_plain_postgresql_result_backend_is_read_through_psycopg() -> None:
    settings = Settings(result_backend="db+postgres://u@127.0.0.1/results")
    assert settings.result_backend == "db+postgresql+psycopg://u@127.0.0.1/results"


def test_the_embedded_brokers_url_is_the_embedded_broker(tmp_path: Path) -> None:
    """What `sessionstore settings` shows as celery_broker_url, given back, is the embedded
    broker (its folders in the data dir), not kombu's racy transport in the cwd."""
    from tasks.app import celery_config

    settings = Settings(data_dir=tmp_path, broker_url=EMBEDDED_BROKER_URL)
    assert settings.is_embedded_broker and settings.broker_url is None
    config = celery_config(settings)
    assert config["broker_url"] == EMBEDDED_BROKER_URL
    assert config["broker_transport"] == "core.broker:Transport"
    assert config["result_backend"].startswith("db+sqlite:///")
    assert config["broker_transport_options"]["data_folder_in"] == str(tmp_path / "queue/in")
