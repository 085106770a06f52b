"""The test harness's own clean-up of Celery's Redis clients (``tests.support.close_celery_clients``
and the autouse ``_celery_clients_closed`` fixture), checked against the Redis server.

Celery's result backend is per thread and nothing in Celery closes its Redis client; left
to the garbage collector, a socket could be finalized in a later test as a ResourceWarning.
The fixture depends on Celery internals (``Celery._get_backend`` making each thread's
backend, the backend's cached ``client``): these tests fail if an upgrade changes either.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from celery import Celery

from tests.support import close_celery_clients

pytestmark = [pytest.mark.redis]


def _client_ids(backend: Any) -> set[int]:
    """The server-side ids of the connections in a backend's pool, opened by a command."""
    backend.client.ping()
    pool = backend.client.connection_pool
    ids = set()
    for conn in [*pool._available_connections, *pool._in_use_connections]:
        conn.send_command("CLIENT", "ID")
        ids.add(int(conn.read_response()))
    return ids


def _server_ids(url: str) -> set[int]:
    with redis.Redis.from_url(url) as admin:
        return {int(c["id"]) for c in admin.client_list()}


def test_each_threads_backend_is_made_by_get_backend_and_closed(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []
    get_backend = Celery._get_backend  # the fixture's wrapper, itself recording

    def recording(app: Celery) -> Any:
        backend = get_backend(app)
        made.append(backend)
        return backend

    monkeypatch.setattr(Celery, "_get_backend", recording)
    app = Celery("clients-test", broker=redis_url, backend=redis_url)
    here = app.backend
    there: list[Any] = []
    thread = threading.Thread(target=lambda: there.append(app.backend))
    thread.start()
    thread.join(10)

    # one backend per thread, each made through the hook the fixture wraps
    assert len(made) == 2 and {id(b) for b in made} == {id(here), id(there[0])}
    ids = _client_ids(here) | _client_ids(there[0])
    assert len(ids) >= 2 and ids <= _server_ids(redis_url)

    close_celery_clients([app], made)

    assert not ids & _server_ids(redis_url), "a backend's Redis connection is still open"
    for backend in made:
        pool = backend.client.connection_pool
        assert all(c._sock is None for c in pool._available_connections)


def test_a_backend_never_used_is_not_opened_by_the_clean_up(redis_url: str) -> None:
    app = Celery("clients-test-unused", broker=redis_url, backend=redis_url)
    backend = app.backend
    close_celery_clients([app], [backend])
    assert "client" not in backend.__dict__  # the cached client was never created
