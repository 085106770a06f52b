"""Redis results read by polling their key, with no pub/sub subscription per sent task.

Celery's Redis result backend subscribes to a channel for every task a process sends, on
one pub/sub connection shared by all of the process's threads. Producers are
multi-threaded services: concurrent subscribes interleave on that socket and results go
missing (and every publish pays for a subscribe). ``AppendHandle.get`` polls instead.
"""

from __future__ import annotations

from typing import Any

from celery.backends.redis import RedisBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError

from core.errors import NotFinishedInTime


class QueueTimeout(NotFinishedInTime, CeleryTimeoutError):  # type: ignore[misc]
    """``NotFinishedInTime`` that is also Celery's ``TimeoutError``, so code written
    against ``AsyncResult.get`` keeps catching it."""


class PollingRedisBackend(RedisBackend):  # type: ignore[misc]
    def on_task_call(self, producer: Any, task_id: str) -> None:
        """No subscription: results are fetched by key."""

    def _set(self, key: str, value: Any, expires: int | None = None) -> None:
        # SET … EX instead of the SETEX that redis-py 8 deprecates; still published, so a
        # plain Celery client waiting on pub/sub gets the result too.
        expires = self.expires if expires is None else expires
        with self.client.pipeline() as pipe:
            pipe.set(key, value, ex=expires or None)
            pipe.publish(key, value)
            pipe.execute()


def polling_redis_url(url: str) -> str:
    """The result-backend URL that selects this class for a ``redis://`` URL."""
    return f"tasks.results:PollingRedisBackend+{url}"
