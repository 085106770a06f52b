"""Values round-trip exactly on both backends (issue 16, item 5; DESIGN invariant 11).

``read(append(x)) == x`` compared strictly: object key order, the type of every number
(``1.0`` is not ``1``), the sign of zero, floats bit for bit, integers of any size.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy import text

from core import SessionStore, exact_json
from core.blobs.externalize import content_digest
from core.errors import IdempotencyKeyReused, InvalidEvent
from core.journal.validation import MAX_INT_BITS

Strict = tuple[str, Any]


def strict(value: Any) -> Strict:
    """A form of ``value`` in which every difference the journal must keep is visible."""
    if value is None or isinstance(value, (bool, str)):
        return (type(value).__name__, value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value.hex())  # -0.0 and 0.0 differ; 1e16 stays a float
    if isinstance(value, list):
        return ("array", [strict(v) for v in value])
    assert isinstance(value, dict)
    return ("object", [(k, strict(v)) for k, v in value.items()])  # in order


numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([-0.0, 0.0, 1e16, -1e16, 1e300, 2.0**64, 2**64, 2**64 + 1, -(2**63) - 1]),
)
# Keys with U+0000 are refused at write (invariant 8); strings with it become blobs.
keys = st.text(max_size=6).filter(lambda k: "\x00" not in k)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=24,
)
events = st.builds(
    lambda kind, fields: {"type": kind, **fields},
    st.sampled_from(["message", "custom", "x"]),
    st.dictionaries(keys.filter(lambda k: k != "type"), values, max_size=5),
)


@hsettings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(events, min_size=1, max_size=3))
def test_read_returns_exactly_what_was_appended(
    store: SessionStore, batch: list[dict[str, Any]]
) -> None:
    session = store.create_session(tenant_id="acme")
    store.append(session.id, batch)
    read = [e.payload for e in store.read(session.id, rehydrate=True)]
    assert [strict(e) for e in read] == [strict(e) for e in batch]


def _flip_first_number(value: Any) -> tuple[Any, bool]:
    """``value`` with its first number changed to one Python's ``==`` holds equal (1 and
    1.0, 0.0 and -0.0), or to the next integer where there is none; and whether one was."""
    if type(value) is int:
        return (float(value) if abs(value) < 2**53 else value + 1), True
    if type(value) is float:
        return (-value if value == 0 else int(value) if value.is_integer() else value * 2), True
    if isinstance(value, list):
        for i, item in enumerate(value):
            flipped, done = _flip_first_number(item)
            if done:
                return [*value[:i], flipped, *value[i + 1 :]], True
    if isinstance(value, dict):
        for key, item in value.items():
            flipped, done = _flip_first_number(item)
            if done:
                return {**value, key: flipped}, True
    return value, False


@hsettings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    batch=st.lists(events, min_size=1, max_size=3),
    change=st.sampled_from(["same", "number", "key order", "other batch"]),
    other=st.lists(events, min_size=1, max_size=3),
)
def test_a_key_replays_exactly_its_own_content(
    store: SessionStore, batch: list[dict[str, Any]], change: str, other: list[dict[str, Any]]
) -> None:
    """Under a committed key, a batch that would store the same JSON text is a replay and
    any other is refused (IdempotencyKeyReused), with the strictness reads have: key
    order, ``1`` against ``1.0``, ``-0.0`` against ``0.0``, integers of any size."""
    if change == "number":
        other = _flip_first_number(batch)[0]
    elif change == "key order":
        other = [dict(reversed(event.items())) for event in batch]
    elif change == "same":
        other = batch
    session = store.create_session(tenant_id="acme")
    first = store.append(session.id, batch, idempotency_key="k")
    if [strict(e) for e in other] == [strict(e) for e in batch]:
        assert store.append(session.id, other, idempotency_key="k") == first.__class__(
            **{**first.to_dict(), "replayed": True}
        )
    else:
        with pytest.raises(IdempotencyKeyReused):
            store.append(session.id, other, idempotency_key="k")
    assert store.get_session(session.id).head_seq == len(batch)


@hsettings(max_examples=300, deadline=None)
@given(
    batch=st.lists(events, min_size=1, max_size=3),
    change=st.sampled_from(["same", "number", "key order", "other batch"]),
    other=st.lists(events, min_size=1, max_size=3),
)
def test_the_queue_digest_tells_content_apart_as_strictly_as_the_journal(
    batch: list[dict[str, Any]], change: str, other: list[dict[str, Any]]
) -> None:
    """The producer's digest (``content_digest``) is equal for two batches exactly when the
    journal would answer the second as a replay of the first: wide integers, ``-0.0``,
    ``1.0`` against ``1``, key order and NUL strings included."""
    if change == "number":
        other = _flip_first_number(batch)[0]
    elif change == "key order":
        other = [dict(reversed(event.items())) for event in batch]
    elif change == "same":
        other = copy.deepcopy(batch)
    same = [strict(e) for e in other] == [strict(e) for e in batch]
    assert (content_digest(other) == content_digest(batch)) is same


@pytest.mark.parametrize(
    "value",
    [
        -0.0,
        1e16,
        1.5e300,
        2**64,
        -(2**64) - 7,
        10**40,
        2**MAX_INT_BITS - 1,  # the widest integer accepted: 4,001 digits
        -(2**MAX_INT_BITS) + 1,
        {"z": 1, "a": 2, "m": {"y": -0.0, "b": [2**70, 1e16]}},
    ],
    ids=lambda v: f"int{v.bit_length()}{'-' if v < 0 else ''}" if type(v) is int else None,
)
def test_values_jsonb_would_change_come_back_unchanged(store: SessionStore, value: Any) -> None:
    session = store.create_session(tenant_id="acme")
    event = {"type": "custom", "z_first": 1, "value": value, "a_last": True}
    store.append(session.id, [event])
    (stored,) = store.read(session.id)
    assert strict(stored.payload) == strict(event)
    assert list(stored.payload) == ["type", "z_first", "value", "a_last"]


@pytest.mark.parametrize(
    "wide", [2**MAX_INT_BITS, -(2**MAX_INT_BITS), 10**5000], ids=["2^max", "-2^max", "10^5000"]
)
def test_an_integer_no_json_reader_can_read_back_is_refused_by_name(
    store: SessionStore, wide: int
) -> None:
    """Past MAX_INT_BITS (about 4,000 digits) Python cannot turn an integer into JSON text
    or back (sys.get_int_max_str_digits): the append failed inside the insert with an
    untyped StatementError whose own message raised. Now the write is refused, typed,
    naming the value; nothing is written."""
    session = store.create_session(tenant_id="acme")
    with pytest.raises(InvalidEvent, match=r"at /value/1: integer of [\d,]+ bits"):
        store.append(session.id, [{"type": "custom", "value": [1, wide]}])
    assert store.read(session.id) == []


def test_the_stored_text_is_what_the_writer_encoded(store: SessionStore) -> None:
    """The database holds the writer's JSON text itself, so SQL sees the same values."""
    session = store.create_session(tenant_id="acme")
    event = {"type": "custom", "b": -0.0, "a": 1e16, "n": 2**70}
    store.append(session.id, [event])
    with store.engine.connect() as conn:
        stored = conn.execute(
            text("SELECT CAST(payload AS TEXT) FROM events WHERE session_id = :s"),
            {"s": session.id},
        ).scalar_one()
    assert stored.encode() == exact_json.dumps(event)
    assert math.copysign(1, exact_json.loads(stored)["b"]) == -1


def test_state_and_its_snapshots_keep_wide_integers(store: SessionStore) -> None:
    """A folded number beyond 64 bits (a compaction's tokensBefore) survives a snapshot."""
    settings = store.settings.model_copy(update={"snapshot_every": 2})
    session = store.create_session(tenant_id="acme")
    entries: list[dict[str, Any]] = [
        {"type": "message", "id": "a", "parentId": None, "message": {"role": "user"}},
        {
            "type": "compaction",
            "id": "b",
            "parentId": "a",
            "summary": "s",
            "firstKeptEntryId": "a",
            "tokensBefore": 2**70,
        },
        {"type": "message", "id": "c", "parentId": "b", "message": {"role": "user"}},
    ]
    store.append(session.id, entries)
    with SessionStore.from_settings(settings) as snapshotting:
        first = snapshotting.state(session.id)  # folds, stores the snapshot at seq 2
        again = snapshotting.state(session.id)  # starts from that snapshot
    assert first.compaction is not None and again.compaction is not None
    assert first.compaction.tokens_before == again.compaction.tokens_before == 2**70
