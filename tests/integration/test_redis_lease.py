"""Two pytest runs at once on one machine (a CI clone beside a developer's run) each lease
their own Redis database: neither flushes the other's queues."""

from __future__ import annotations

import os

import pytest
import redis

from tests import conftest
from tests.conftest import REDIS_POOL, RedisLease

pytestmark = pytest.mark.redis

BASE = os.environ.get("SESSIONSTORE_TEST_REDIS_BASE", "redis://127.0.0.1:6379")


def test_each_process_leases_a_database_of_its_own(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SESSIONSTORE_TEST_REDIS_URL", raising=False)
    first, second = RedisLease(BASE), RedisLease(BASE)
    second._token += ":other"  # another process
    try:
        urls = {first.get(), second.get(), redis_url}
        assert len(urls) == 3  # this run's own database included
        assert {int(u.rpartition("/")[2]) for u in urls} <= set(REDIS_POOL)
    finally:
        _release(first, second)
    # released: both databases are free again (their keys gone; re-leasing one to see it
    # would race another pytest process that starts at that instant and takes it)
    client = redis.Redis.from_url(f"{BASE}/0")
    for lease in (first, second):
        assert client.get(_key(lease)) != lease._token.encode()


def test_a_release_never_frees_another_process_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease that expired (a process stopped renewing) and was taken by another process:
    the first process's release at exit leaves the other's lease in place."""
    monkeypatch.delenv("SESSIONSTORE_TEST_REDIS_URL", raising=False)
    mine = RedisLease(BASE)
    mine.get()
    client = redis.Redis.from_url(f"{BASE}/0")
    theirs = b"elsewhere:1"
    try:
        client.set(_key(mine), theirs, ex=60)  # the key now holds another process's token
        _release(mine)
        assert client.get(_key(mine)) == theirs
    finally:
        if client.get(_key(mine)) == theirs:
            client.delete(_key(mine))


def _key(lease: RedisLease) -> str:
    return conftest._LEASE_KEY.format(lease.url.rpartition("/")[2])


def _release(*leases: RedisLease) -> None:
    client = redis.Redis.from_url(f"{BASE}/0")
    for lease in leases:
        lease._release(client, _key(lease))


def test_a_full_pool_fails_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SESSIONSTORE_TEST_REDIS_URL", raising=False)
    monkeypatch.setattr(conftest, "REDIS_POOL", ())
    with pytest.raises(RuntimeError, match="leased by another pytest process"):
        RedisLease(BASE).get()
