"""Which stored outcome answers which write (``tasks.outcomes.answer_for``)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from core.blobs.store import make_ref, sha256_hex
from core.errors import IdempotencyKeyReused
from core.records import AppendResult
from tasks.outcomes import KEY_REUSED, answer_for, committed, digest_in, write_digest
from tasks.producer import to_result

OK = committed("k", AppendResult("s", 3, 4, [7, 8]), "a" * 32)
REJECTED = {"status": "dead_lettered", "dead_letter_id": 1, "digest": "a" * 32}


@pytest.mark.parametrize(
    ("outcome", "digest", "answer"),
    [
        (None, "a" * 32, None),
        (OK, None, OK),  # a write under a new key sends no digest: any outcome is its own
        (OK, "a" * 32, OK),
        ({**OK, "digest": None}, "b" * 32, {**OK, "digest": None}),  # a client sent none
        (REJECTED, "a" * 32, REJECTED),
        (REJECTED, "b" * 32, None),  # another write's rejection: no answer for this one
    ],
)
def test_an_outcome_answers_the_write_whose_content_it_names(
    outcome: dict[str, Any] | None, digest: str | None, answer: dict[str, Any] | None
) -> None:
    assert answer_for(outcome, digest) == answer


def test_a_commit_of_other_content_refuses_the_write_typed() -> None:
    answer = answer_for(OK, "b" * 32)
    assert answer is not None and answer["status"] == KEY_REUSED
    with pytest.raises(IdempotencyKeyReused) as caught:
        to_result(answer)
    assert (caught.value.session_id, caught.value.idempotency_key) == ("s", "k")
    assert (caught.value.first_seq, caught.value.last_seq) == (3, 4)


def test_the_digest_names_the_content_not_how_it_is_stored() -> None:
    """Two sends of one write share a digest (transient fields, an image as bytes or as its
    ref, a data URL or its ref); other content, key order or number types do not."""
    events = [{"type": "n", "v": 1}]
    assert write_digest(events) == write_digest([{"type": "n", "v": 1}])
    for other in ([{"type": "n", "v": 1.0}], [{"v": 1, "type": "n"}], [{"type": "n", "v": 2}]):
        assert write_digest(other) != write_digest(events)
    raw = b"\x89PNG" + bytes(range(256)) * 4
    b64 = base64.b64encode(raw).decode()
    ref = make_ref(sha256_hex(raw))

    def shot(data: str, **extra: Any) -> list[dict[str, Any]]:
        block = {"type": "image", "data": data, "mimeType": "image/png"}
        return [{"type": "message", "message": {"content": [block]}, **extra}]

    assert write_digest(shot(b64)) == write_digest(shot(ref))
    assert write_digest(shot(b64, partialJson="{")) == write_digest(shot(b64))
    assert write_digest(shot(b64)) != write_digest(shot(base64.b64encode(raw + b"!").decode()))
    url = "data:image/png;base64," + b64
    as_url = [{"type": "custom", "image_url": url}]
    assert write_digest(as_url) == write_digest(
        [{"type": "custom", "image_url": make_ref(sha256_hex(url.encode()))}]
    )
    assert digest_in(write_digest(events)) is not None
    assert [digest_in(v) for v in (None, 7, "", "new", "x" * 32, "a" * 33)] == [None] * 6


def test_outcomes_are_replaced_only_where_every_process_reads_them() -> None:
    """A commit clears an earlier rejection where outcomes are kept by task id (Redis, a
    database); rpc:// replies to the sender only (reading there would drain the worker's
    own reply queue), and a disabled backend keeps nothing."""
    from celery.backends.base import DisabledBackend
    from celery.backends.database import DatabaseBackend
    from celery.backends.redis import RedisBackend
    from celery.backends.rpc import RPCBackend

    from tasks.outcomes import keeps_outcomes
    from tasks.results import PollingRedisBackend

    kinds = (RedisBackend, PollingRedisBackend, DatabaseBackend, RPCBackend, DisabledBackend)
    kept = {kind: keeps_outcomes(object.__new__(kind)) for kind in kinds}
    assert kept == {
        RedisBackend: True,
        PollingRedisBackend: True,
        DatabaseBackend: True,
        RPCBackend: False,
        DisabledBackend: False,
    }
