"""How many S3 requests a blob put and get cost (issue 20, the S3 benchmark's finding).

Each request is a network round trip (milliseconds on S3, against microseconds for a stat on
disk), so a new blob must cost its conditional PUT plus the one presence check that
``_register`` makes under the row lock (invariant 6), and a read one GET of the registered
codec's key. The calls go to a real moto server; the test only counts them on the way.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import obstore
import pytest

from core import SessionStore

TEXT = b"".join(b"line %d: the quick brown fox\n" % i for i in range(3000))  # gzip codec
MEDIA = b"\x89PNG\r\n\x1a\n" + os.urandom(20_000)  # identity codec


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    counts: Counter[str] = Counter()

    def counted(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return call(*args, **kwargs)

        return wrapper

    for name in ("put", "get", "head", "delete", "copy", "list"):
        monkeypatch.setattr(obstore, name, counted(name, getattr(obstore, name)))
    return counts


@pytest.mark.parametrize("content", [TEXT, MEDIA], ids=["gzip", "identity"])
def test_a_new_blob_costs_one_put_and_a_read_one_get(
    s3_store: SessionStore, requests: Counter[str], content: bytes
) -> None:
    postgres = s3_store.engine.dialect.name == "postgresql"
    result = s3_store.blobs.put(content)
    assert result.written
    # PostgreSQL: the PUT happens under the row lock, so nothing needs re-checking.
    # SQLite: the PUT comes first (its lock is database-wide), then one presence check.
    assert dict(requests) == ({"put": 1} if postgres else {"put": 1, "head": 1})

    requests.clear()
    assert s3_store.blobs.get(result.hash) == content
    assert dict(requests) == {"get": 1}

    requests.clear()
    again = s3_store.blobs.put(content)  # a re-put verifies what is stored, writes nothing
    assert not again.written
    assert dict(requests) == ({"get": 1} if postgres else {"head": 2, "get": 1})


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_re_put_repairs_a_registered_object_that_is_missing_or_corrupt(
    s3_store: SessionStore, damage: str
) -> None:
    blobs = s3_store.blobs
    first = blobs.put(TEXT)
    key = blobs.key_for(first.hash, first.codec)  # type: ignore[attr-defined]
    if damage == "missing":
        obstore.delete(blobs.store, key)  # type: ignore[attr-defined]
    else:
        obstore.put(blobs.store, key, b"\x1f\x8b not the content")  # type: ignore[attr-defined]
    again = blobs.put(TEXT)
    assert again.written and again.hash == first.hash
    assert blobs.get(first.hash) == TEXT
    assert blobs.info(first.hash) is not None
