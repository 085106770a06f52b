"""Oversized outputs expire by the database's clock, whichever host writes or judges them.

Workers, the beat and readers run on several hosts that share one PostgreSQL. A TTL
written from one host's clock and judged by another's turned their skew into lost or
extended outputs: a writer whose clock was two hours behind stored an hour-long output
already expired for everyone else, and an expiry run on a host two hours ahead removed
outputs an hour from expiring. Heartbeats already used the database's clock; TTLs do now.
(An embedded SQLite database has one host, whose clock is the database's.)
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from core import SessionStore
from core.maintenance.expiry import expire_artifacts
from tests.support import skew_host_clock

HOUR = 3600
SKEW = timedelta(hours=2)


# hosts sharing one database: PostgreSQL (conftest's store on that backend)
pytestmark = pytest.mark.parametrize("backend", ["postgres"])


def _oversized(store: SessionStore, sid: str, text: str) -> str:
    stored = store.store_oversized(sid, text * 13_000, "bash", ttl_s=HOUR)
    assert stored is not None
    return stored.ref.artifact_id


def test_a_writer_whose_clock_is_behind_stores_an_output_that_lives_its_ttl(
    store: SessionStore,
) -> None:
    sid = store.create_session(tenant_id="acme").id
    with pytest.MonkeyPatch.context() as host:
        skew_host_clock(host, -SKEW)
        artifact_id = _oversized(store, sid, "w")

    # judged on a host whose clock agrees with the database's
    assert store.retrieve(artifact_id, session_id=sid) == "w" * 13_000
    assert store.resolve(artifact_id, session_id=sid).content == "w" * 13_000
    report = expire_artifacts(store.engine, store.oversized, apply=True)
    assert report.expired == 0 and store.retrieve(artifact_id, session_id=sid) is not None
    fork = store.fork(sid)
    assert [a.local_id for a in store.artifacts(fork.id).list()] == [artifact_id]


def test_an_expiry_run_on_a_host_ahead_spares_outputs_not_yet_expired(
    store: SessionStore,
) -> None:
    sid = store.create_session(tenant_id="acme").id
    artifact_id = _oversized(store, sid, "k")

    with pytest.MonkeyPatch.context() as host:
        skew_host_clock(host, SKEW)
        assert store.retrieve(artifact_id, session_id=sid) == "k" * 13_000
        dry = expire_artifacts(store.engine, store.oversized, apply=False)
        applied = expire_artifacts(store.engine, store.oversized, apply=True)
        forked = store.fork(sid)
        inherited = [a.local_id for a in store.artifacts(forked.id).list()]
    assert (dry.expired, applied.deleted) == (0, 0)
    assert store.retrieve(artifact_id, session_id=sid) == "k" * 13_000
    assert inherited == [artifact_id]


def test_an_output_expires_by_the_database_clock_whatever_the_host_says(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other way round: an output past its TTL by the database's clock is gone for a
    host whose clock is behind (it would have kept serving it for two more hours)."""
    sid = store.create_session(tenant_id="acme").id
    artifact_id = _oversized(store, sid, "e")
    # its TTL ran out a minute ago by the database's clock
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE artifacts SET expires_at = clock_timestamp() - interval '1 minute'"
            " WHERE local_id = %(id)s",
            {"id": artifact_id},
        )
    skew_host_clock(monkeypatch, -SKEW)
    assert store.retrieve(artifact_id, session_id=sid) is None
    assert expire_artifacts(store.engine, store.oversized, apply=True).deleted == 1
