"""Shared fixtures: real SQLite files, real PostgreSQL databases and a real Redis.

PostgreSQL: the schema is built once per run with ``alembic upgrade head`` into a template
database, and one copy of it is shared by the whole run (``pg_url``): after each test that
used it, every other connection to it is terminated (which releases advisory locks and
aborts what a killed worker left open) and every table is emptied with its identities
restarted, so the next test finds it migrated and empty. Creating a database per test cost
about 40% of the suite's time. Tests that change the schema itself (downgrades) take
``fresh_pg_url``: their own ``CREATE DATABASE … TEMPLATE`` copy, dropped afterwards.
SQLite: a migrated template file, copied per test (a file copy, as cheap as emptying it).

Under CI (``CI=true``) or with ``SESSIONSTORE_REQUIRE_SERVICES=1``, a missing PostgreSQL or
Redis fails the tests that need it instead of skipping them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from celery import _state as celery_state
from hypothesis import settings as hypothesis_settings

from core import SessionStore, Settings
from core.migrate import upgrade
from tests.support import close_celery_clients

# CI (``CI=true``) draws one fixed set of examples per property, derived from the test's
# own code (a changed test or Hypothesis version draws a new set), so a landing is never
# turned red by a draw nobody has seen; local runs keep drawing new examples, which is where
# rare inputs are found (and then kept as explicit cases).
hypothesis_settings.register_profile("ci", derandomize=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    hypothesis_settings.load_profile("ci")

PG_ADMIN_DSN = os.environ.get(
    "SESSIONSTORE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)


# Redis databases a pytest process may lease (0 holds the leases; the benchmarks use 8 and
# 10): each process takes a free one, so two runs at once on one machine (a CI clone beside
# a developer's run, two worktrees) never flush each other's queues.
REDIS_POOL = (15, 14, 13, 12, 11, 9, 7, 6, 5, 4, 3, 2, 1)
_LEASE_KEY = "sessionstore-test-redis-db:{}"
_LEASE_SECONDS = 120  # renewed every 30 s while the process lives; a killed run's lapses


def _worker_redis_url(base: str, worker: str | None) -> str:
    """An explicit database, under xdist (``PYTEST_XDIST_WORKER=gwN``) minus N, modulo 16,
    so the run's own workers never share one."""
    if not worker or not worker.startswith("gw"):
        return base
    head, _, db = base.rpartition("/")
    number = int(db) if db.isdigit() else 0
    return f"{head}/{(number - int(worker[2:])) % 16}"


class RedisLease:
    """This process's Redis database: ``SESSIONSTORE_TEST_REDIS_URL`` when set (minus the
    xdist worker's number), else one leased from ``REDIS_POOL`` on first use, held until
    the process exits."""

    def __init__(self, base: str) -> None:
        self.base, self.url, self._token = base, "", f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()

    def get(self) -> str:
        if not self.url:
            explicit = os.environ.get("SESSIONSTORE_TEST_REDIS_URL")
            worker = os.environ.get("PYTEST_XDIST_WORKER")
            self.url = _worker_redis_url(explicit, worker) if explicit else self._lease()
        return self.url

    def _lease(self) -> str:
        client = redis.Redis.from_url(f"{self.base}/0", socket_connect_timeout=3)
        for number in REDIS_POOL:
            key = _LEASE_KEY.format(number)
            if client.set(key, self._token, nx=True, ex=_LEASE_SECONDS):
                threading.Thread(target=self._renew, args=(client, key), daemon=True).start()
                atexit.register(self._release, client, key)
                return f"{self.base}/{number}"
        raise RuntimeError(
            f"every Redis test database ({REDIS_POOL}) is leased by another pytest process"
        )

    def _renew(self, client: redis.Redis, key: str) -> None:
        while not self._stop.wait(_LEASE_SECONDS / 4):
            with contextlib.suppress(redis.RedisError):
                client.set(key, self._token, xx=True, ex=_LEASE_SECONDS)

    def _release(self, client: redis.Redis, key: str) -> None:
        self._stop.set()
        with contextlib.suppress(redis.RedisError):
            if client.get(key) == self._token.encode():
                client.delete(key)


REDIS = RedisLease(os.environ.get("SESSIONSTORE_TEST_REDIS_BASE", "redis://127.0.0.1:6379"))
REQUIRE_SERVICES = (
    os.environ.get("CI", "").lower() == "true"
    or os.environ.get("SESSIONSTORE_REQUIRE_SERVICES") == "1"
)
BACKENDS = ["sqlite", "postgres"]


def _unavailable(what: str, exc: Exception) -> None:
    message = f"{what} is not reachable: {exc}"
    if REQUIRE_SERVICES:
        pytest.fail(f"{message} (required under CI / SESSIONSTORE_REQUIRE_SERVICES=1)")
    pytest.skip(message)


def pg_url_for(dbname: str) -> str:
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{dbname}"


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    name = f"ss_tpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        with _admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        _unavailable("PostgreSQL", exc)
    upgrade(pg_url_for(name))
    yield name
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def clone_pg_database(template: str) -> str:
    name = f"ss_t_{uuid.uuid4().hex[:12]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return name


def drop_pg_database(name: str) -> None:
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_shared(pg_template: str) -> Iterator[str]:
    """The run's one migrated PostgreSQL database, emptied after each test by ``pg_url``."""
    name = clone_pg_database(pg_template)
    yield name
    drop_pg_database(name)


def empty_pg_database(name: str) -> None:
    """Back to just migrated: no other connection, every table empty, identities at 1.

    Terminating the other backends first is what ``DROP DATABASE … WITH (FORCE)`` did: a
    test's engines, worker processes and killed processes' half-open transactions all go,
    with the advisory locks they held, so emptying the tables cannot wait on them.
    """
    dsn = PG_ADMIN_DSN.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        conn.execute(_EMPTY_PUBLIC_SCHEMA)


# DELETE rather than TRUNCATE: a test leaves a few rows, and TRUNCATE creates new files for
# every table and index (2-3 times slower here). Foreign-key triggers are off for this one
# transaction (replica role), so the order of the tables does not matter.
_EMPTY_PUBLIC_SCHEMA = """
DO $$
DECLARE r record;
BEGIN
    SET LOCAL session_replication_role = replica;
    FOR r IN SELECT tablename FROM pg_tables
             WHERE schemaname = 'public' AND tablename <> 'alembic_version' LOOP
        EXECUTE format('DELETE FROM public.%I', r.tablename);
    END LOOP;
    FOR r IN SELECT sequencename FROM pg_sequences
             WHERE schemaname = 'public' AND last_value IS NOT NULL LOOP
        EXECUTE format('ALTER SEQUENCE public.%I RESTART', r.sequencename);
    END LOOP;
END $$
"""


@pytest.fixture
def pg_url(pg_shared: str) -> Iterator[str]:
    """The shared migrated database, empty at the start of the test."""
    yield pg_url_for(pg_shared)
    empty_pg_database(pg_shared)


@pytest.fixture
def fresh_pg_url(pg_template: str) -> Iterator[str]:
    """A database of the test's own, for tests that change the schema (migrations)."""
    name = clone_pg_database(pg_template)
    yield pg_url_for(name)
    drop_pg_database(name)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "journal.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(backend: str, request: pytest.FixtureRequest) -> str:
    """A migrated, empty database of the parametrized backend."""
    fixture = "sqlite_url" if backend == "sqlite" else "pg_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=database_url)


@pytest.fixture
def store(settings: Settings) -> Iterator[SessionStore]:
    with SessionStore.from_settings(settings) as s:
        yield s


@pytest.fixture
def queue_settings(pg_url: str, redis_url: str, tmp_path: Path) -> Settings:
    """The production shape: PostgreSQL journal, Redis broker and result backend."""
    return Settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        broker_url=redis_url,
        result_backend=redis_url,
    )


@pytest.fixture
def redis_url() -> Iterator[str]:
    try:
        url = REDIS.get()
        client = redis.Redis.from_url(url, socket_connect_timeout=3)
        client.ping()
    except redis.RedisError as exc:
        _unavailable("Redis", exc)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


RABBITMQ = os.environ.get("SESSIONSTORE_TEST_AMQP_BASE", "amqp://guest:guest@127.0.0.1:5672")


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def amqp_url() -> Iterator[str]:
    """A RabbitMQ virtual host of the module's own (a test empties its queue first)."""
    vhost = f"sstest_{uuid.uuid4().hex[:12]}"
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=3):
            pass
        _rabbitmqctl("add_vhost", vhost)
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    except (OSError, subprocess.SubprocessError) as exc:
        _unavailable("RabbitMQ", exc)
    yield f"{RABBITMQ}/{vhost}"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(autouse=True)
def _celery_clients_closed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every Celery app a test creates, and every result backend it opens (in any thread,
    workers' included), is closed when the test ends (``close_celery_clients``)."""
    before = set(celery_state._get_active_apps())
    backends: list[Any] = []
    get_backend = Celery._get_backend

    def tracked(app: Celery) -> Any:
        backend = get_backend(app)
        backends.append(backend)
        return backend

    monkeypatch.setattr(Celery, "_get_backend", tracked)
    yield
    close_celery_clients(set(celery_state._get_active_apps()) - before, backends)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 HTTP API: moto's server mode in a thread, for the whole run (no mocks
    in-process: clients talk HTTP to it). The standard AWS variables point at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in _AWS_TEST_ENV}
    os.environ.update({**_AWS_TEST_ENV, "AWS_ENDPOINT_URL": endpoint})
    yield endpoint
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


_AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
    "AWS_ENDPOINT_URL": "",
}


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the moto server; returns ``s3://<bucket>``."""
    import urllib.request

    name = f"t-{uuid.uuid4().hex[:16]}"
    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/{name}", method="PUT"))
    return f"s3://{name}"


@pytest.fixture
def s3_store(database_url: str, s3_bucket: str, tmp_path: Path) -> Iterator[SessionStore]:
    """A store of the parametrized journal with its blobs on the moto server."""
    settings = Settings(
        data_dir=tmp_path / "data", database_url=database_url, blob_url=f"{s3_bucket}/blobs"
    )
    with SessionStore.from_settings(settings) as store:
        yield store


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An endpoint that accepts connections and never answers: a hung S3 service, the case
    where the client's own retries and timeouts would take minutes."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    listener.close()
