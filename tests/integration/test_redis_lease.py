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
    again = RedisLease(BASE)
    try:
        assert again.get() in (first.url, second.url)  # released: free again
    finally:
        _release(again)


def _release(*leases: RedisLease) -> None:
    client = redis.Redis.from_url(f"{BASE}/0")
    for lease in leases:
        lease._release(client, conftest._LEASE_KEY.format(lease.url.rpartition("/")[2]))


def test_a_full_pool_fails_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SESSIONSTORE_TEST_REDIS_URL", raising=False)
    monkeypatch.setattr(conftest, "REDIS_POOL", ())
    with pytest.raises(RuntimeError, match="leased by another pytest process"):
        RedisLease(BASE).get()
