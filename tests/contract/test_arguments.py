"""Every public call that takes a seq, a position, an id, a page size or an age checks it
before any SQL: a bad one is ``InvalidArgument`` naming it, the same on SQLite and
PostgreSQL. (Before, a negative limit read nothing on one backend and raised psycopg's
own error on the other, ``after_seq="a"`` read nothing on SQLite, ``limit=0`` returned one
session from ``list_sessions`` and none from ``read``, ``batch_size=0`` expired nothing and
``pending_forks(older_than_s=nan)`` raised a bare ValueError.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from core import SessionStore
from core.errors import InvalidArgument, InvalidEvent
from core.query import EventFilter, analytics

SEQS = [-1, 2**63, True, "1", 1.0, None]  # None only where the argument is not optional
LIMITS = [0, -1, 2**63, True, "2", 2.0]
SECONDS = [-1, float("nan"), float("inf"), 1e300, True, "5"]

Call = Callable[[SessionStore, str, Any], object]

CALLS: dict[str, tuple[Call, list[Any]]] = {
    "read after_seq": (lambda st, sid, v: st.read(sid, after_seq=v), SEQS),
    "read upto_seq": (lambda st, sid, v: st.read(sid, upto_seq=v), SEQS[:-1]),
    "read limit": (lambda st, sid, v: st.read(sid, limit=v), LIMITS),
    "read_all after_position": (lambda st, sid, v: st.read_all(after_position=v), SEQS),
    "read_all limit": (lambda st, sid, v: st.read_all(limit=v), LIMITS),
    "list_sessions limit": (lambda st, sid, v: st.list_sessions(limit=v), LIMITS),
    "list_events limit": (lambda st, sid, v: st.list_events(limit=v), LIMITS),
    "dead_letters.list after_id": (lambda st, sid, v: st.dead_letters.list(after_id=v), SEQS),
    "dead_letters.list limit": (lambda st, sid, v: st.dead_letters.list(limit=v), LIMITS),
    "dead_letters.get letter_id": (lambda st, sid, v: st.dead_letters.get(v), SEQS),
    "dead_letters.discard letter_id": (lambda st, sid, v: st.dead_letters.discard(v), SEQS),
    "pending_forks limit": (lambda st, sid, v: st.pending_forks(older_than_s=0, limit=v), LIMITS),
    "pending_forks older_than_s": (lambda st, sid, v: st.pending_forks(older_than_s=v), SECONDS),
    "repair_moves older_than_s": (lambda st, sid, v: st.repair_moves(older_than_s=v), SECONDS),
    "fork at_seq": (lambda st, sid, v: st.fork(sid, at_seq=v), [True, "1", 1.0]),
    "gc_blobs grace": (lambda st, sid, v: st.gc_blobs(grace=v), SECONDS),
    "gc_blobs batch_size": (lambda st, sid, v: st.gc_blobs(batch_size=v), LIMITS),
    "expire_artifacts batch_size": (lambda st, sid, v: st.expire_artifacts(batch_size=v), LIMITS),
    "follow_events poll_interval": (
        lambda st, sid, v: next(
            analytics.follow_events(st.engine, after_position=0, poll_interval=v)
        ),
        [-1, float("nan"), float("inf"), 1e300, 3601, True, "5"],
    ),
}
FIELDS = {
    "read_all after_position": "after_position",
    "dead_letters.get letter_id": "letter_id",
    "dead_letters.discard letter_id": "letter_id",
    "gc_blobs grace": "grace",
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_bad_argument_is_refused_by_name_before_any_sql(store: SessionStore, call: str) -> None:
    sid = store.create_session(tenant_id="acme").id
    store.append(sid, [{"type": "note", "text": "kept"}])
    fn, bad_values = CALLS[call]
    field = FIELDS.get(call, call.rpartition(" ")[2])
    for value in bad_values:
        with pytest.raises(InvalidArgument) as caught:
            fn(store, sid, value)
        assert caught.value.field == field, (call, value)
        assert str(caught.value).startswith(f"invalid argument {field}: "), caught.value
        assert isinstance(caught.value, InvalidEvent)  # bad input, as the CLI's exit 3 says
    assert [e.seq for e in store.read(sid)] == [1]  # nothing was touched


def test_the_bounds_themselves_are_accepted(store: SessionStore) -> None:
    sid = store.create_session(tenant_id="acme").id
    store.append(sid, [{"type": "note"}, {"type": "note"}])
    top = 2**63 - 1
    assert [e.seq for e in store.read(sid, after_seq=0, upto_seq=top, limit=1)] == [1]
    assert store.read(sid, after_seq=top, limit=top) == []
    assert len(store.read_all(after_position=0, limit=top)) == 2  # cut to one page, not refused
    assert store.read_all(after_position=top, limit=1) == []
    assert len(store.list_sessions(limit=1).items) == 1
    assert len(store.list_events(limit=1).items) == 1
    assert store.dead_letters.list(after_id=top, limit=top) == []
    assert store.pending_forks(older_than_s=0.0, limit=1) == []
    assert store.repair_moves(older_than_s=1e10) == []
    assert store.gc_blobs(grace=0, batch_size=1).applied is False


NUL_CALLS: dict[str, tuple[str, Call]] = {
    "get_session": ("session_id", lambda st, sid, v: st.get_session(v)),
    "resolve_session": ("ref", lambda st, sid, v: st.resolve_session(v)),
    "read session": ("session_id", lambda st, sid, v: st.read(v)),
    "read tenant": ("tenant_id", lambda st, sid, v: st.read(sid, tenant_id=v)),
    "read_all tenant": ("tenant_id", lambda st, sid, v: st.read_all(tenant_id=v)),
    "read_all types": ("types", lambda st, sid, v: st.read_all(types=["note", v])),
    "list_sessions": ("tenant_id", lambda st, sid, v: st.list_sessions(tenant_id=v)),
    "list_events": ("session_id", lambda st, sid, v: st.list_events(EventFilter(session_id=v))),
    "list_events roles": ("roles", lambda st, sid, v: st.list_events(EventFilter(roles=(v,)))),
    "state": ("session_id", lambda st, sid, v: st.state(v)),
    "stats": ("tenant_id", lambda st, sid, v: st.stats(tenant_id=v)),
    "fork": ("session_id", lambda st, sid, v: st.fork(v)),
    "move": ("tenant_id", lambda st, sid, v: st.move(sid, tenant_id=v)),
    "move cwd": ("cwd", lambda st, sid, v: st.move(sid, cwd=v)),
    "delete_session": ("session_id", lambda st, sid, v: st.delete_session(v)),
    "artifacts": ("session_id", lambda st, sid, v: st.artifacts(v)),
    "resolve": ("session_id", lambda st, sid, v: st.resolve("artifact://1", session_id=v)),
    "retrieve": ("tenant_id", lambda st, sid, v: st.retrieve("x", session_id=sid, tenant_id=v)),
    "artifact_stats": ("tenant_id", lambda st, sid, v: st.artifact_stats(tenant_id=v)),
    "copy_fork_artifacts": ("fork_id", lambda st, sid, v: st.copy_fork_artifacts(v)),
}


@pytest.mark.parametrize("call", sorted(NUL_CALLS))
def test_a_nul_in_a_name_is_refused_by_name_on_every_backend(
    store: SessionStore, call: str
) -> None:
    """PostgreSQL's text cannot hold U+0000: such a lookup raised psycopg's DataError from
    inside the driver on some paths and 'the database refused a value' on others, where
    SQLite matched nothing. Now both refuse it, naming the argument."""
    sid = store.create_session(tenant_id="acme").id
    field, fn = NUL_CALLS[call]
    with pytest.raises(InvalidArgument) as caught:
        fn(store, sid, "a\x00b")
    assert (caught.value.field, caught.value.reason) == (field, "cannot contain U+0000")
    assert store.get_session(sid).tenant_id == "acme"  # nothing moved or deleted


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("session_id", 5, "must be a string"),
        ("session_id", "s\x00", "U+0000"),
        ("session_id", "s\ud800", "surrogate"),
        ("idempotency_key", 5, "must be a string"),
        ("idempotency_key", "k\x00", "U+0000"),
        ("idempotency_key", "k\ud800", "surrogate"),
        ("idempotency_key", "", "1.."),
    ],
)
def test_append_refuses_a_bad_session_id_or_key_by_name_on_every_backend(
    store: SessionStore, field: str, value: Any, reason: str
) -> None:
    """As the queue's path checks them: before, an int raised a bare TypeError (or psycopg's
    own error), a lone surrogate was refused naming "/", and a NUL key was kept by SQLite
    where PostgreSQL refused it."""
    sid = store.create_session(tenant_id="acme").id
    args: dict[str, Any] = {"session_id": sid, "idempotency_key": "k"} | {field: value}
    with pytest.raises(InvalidEvent) as caught:
        store.append(
            args["session_id"], [{"type": "custom"}], idempotency_key=args["idempotency_key"]
        )
    assert caught.value.field == field and reason in str(caught.value), caught.value
    assert store.get_session(sid).head_seq == 0


@pytest.mark.parametrize("call", ["read_all", "list_events"])
def test_types_as_one_string_is_refused_not_read_as_its_characters(
    store: SessionStore, call: str
) -> None:
    sid = store.create_session(tenant_id="acme").id
    store.append(sid, [{"type": "msg"}])
    with pytest.raises(InvalidArgument) as caught:
        if call == "read_all":
            store.read_all(types="msg")  # type: ignore[arg-type]
        else:
            store.list_events(EventFilter(types="msg"))  # type: ignore[arg-type]
    assert caught.value.field == "types"
    assert [e.type for e in store.read_all(types=["msg"])] == ["msg"]
