"""Rehydrate-on-demand claims, on both backends: one request key yields one artifact, a
live build is never taken over, a reused output has life left, and the records of finished
builds do not pile up (an adversarial review of the claim, after e6c50c7)."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert, select, text, update

from core import SessionNotFound, SessionStore, Settings
from core.artifacts.paths import STAGING_DIR, session_dir
from core.artifacts.records import OVERSIZED
from core.interop import exporter, rehydrated
from core.interop.rehydrated import Request, rehydrate
from core.models import ArtifactRow, RehydrationRow, table_of, utcnow
from tests.support import TcpProxy, set_output_expiry, skew_host_clock, wait_for, watch_log

_rows = table_of(RehydrationRow)
_artifacts = table_of(ArtifactRow)


def _session(store: SessionStore) -> str:
    sid = store.create_session(tenant_id="acme", cwd="/work").id
    store.append(
        sid,
        [
            {"type": "message", "id": f"m{i}", "parentId": None, "message": {"role": "user"}}
            for i in range(3)
        ],
    )
    return sid


def _outputs(store: SessionStore, sid: str) -> list[str]:
    with store.engine.connect() as conn:
        return list(
            conn.execute(
                select(_artifacts.c.local_id).where(
                    _artifacts.c.session_id == sid, _artifacts.c.kind == OVERSIZED
                )
            ).scalars()
        )


def _row(store: SessionStore, sid: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(select(_rows).where(_rows.c.session_id == sid)).one()


def _set_row(store: SessionStore, sid: str, **values: Any) -> None:
    with store.engine.begin() as conn:
        conn.execute(update(_rows).where(_rows.c.session_id == sid).values(**values))


class _Gate:
    """Holds the first build's ``publish_staged`` until released; later calls pass."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: SessionStore) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self._first = True
        publish: Callable[..., Any] = store.oversized.publish_staged

        def gated(*args: Any, **kwargs: Any) -> Any:
            if self._first:
                self._first = False
                self.reached.set()
                assert self.release.wait(60)
            return publish(*args, **kwargs)

        monkeypatch.setattr(store.oversized, "publish_staged", gated)


@pytest.fixture
def in_thread() -> Iterator[Callable[[Callable[[], Any]], dict[str, Any]]]:
    threads: list[threading.Thread] = []

    def start(work: Callable[[], Any]) -> dict[str, Any]:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = work()
            except BaseException as exc:  # reported by the test
                box["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        threads.append(thread)
        thread.start()
        return box

    yield start
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()


def test_a_builder_taken_over_discards_its_output_and_serves_the_winners(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, in_thread: Any
) -> None:
    """Builder A stalls with its heartbeat stopped; B takes the build over and finishes; A,
    released, must not finish too (it did: two artifacts for one request key)."""
    monkeypatch.setattr(rehydrated, "_HEARTBEAT_S", 3600.0)  # A's heartbeat never comes
    sid = _session(store)
    gate = _Gate(monkeypatch, store)
    a = in_thread(lambda: rehydrate(store, Request(sid, "acme")))
    assert gate.reached.wait(60)
    _set_row(store, sid, heartbeat_at=utcnow() - timedelta(minutes=1))  # A looks dead
    b = rehydrate(store, Request(sid, "acme"), wait_s=30)
    assert not b["reused"]
    gate.release.set()
    wait_for(lambda: "result" in a or "error" in a, 60, "builder A")
    assert "error" not in a, a
    assert a["result"]["ref"] == b["ref"] and a["result"]["reused"]
    assert _outputs(store, sid) == [b["ref"]]  # A's published output was discarded
    row = _row(store, sid)
    assert (row.status, row.artifact_id, row.builds) == ("done", b["ref"], 1)
    assert store.retrieve(b["ref"], session_id=sid) is not None


def test_a_stalled_build_keeps_its_claim_and_its_waiter_waits(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch, in_thread: Any
) -> None:
    """The heartbeat comes from a thread of the build, so a build stalled outside its event
    loop (a slow upload, an fsync) for longer than the staleness limit is not taken over."""
    monkeypatch.setattr(rehydrated, "_HEARTBEAT_S", 0.05)
    monkeypatch.setattr(rehydrated, "STALE_AFTER_S", 0.5)
    sid = _session(store)
    gate = _Gate(monkeypatch, store)
    a = in_thread(lambda: rehydrate(store, Request(sid, "acme")))
    assert gate.reached.wait(60)
    b = in_thread(lambda: rehydrate(store, Request(sid, "acme"), wait_s=60))
    time.sleep(2.0)  # four times the staleness limit
    assert "result" not in b and "error" not in b  # B still waits for A
    gate.release.set()
    wait_for(lambda: all("result" in x or "error" in x for x in (a, b)), 60, "both requests")
    assert "error" not in a and "error" not in b, (a, b)
    assert not a["result"]["reused"] and b["result"]["reused"]
    assert a["result"]["ref"] == b["result"]["ref"]
    assert _outputs(store, sid) == [a["result"]["ref"]] and _row(store, sid).builds == 1


@pytest.mark.postgres
def test_a_heartbeat_failing_while_the_database_is_away_resumes_and_the_build_finishes(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_thread: Any
) -> None:
    """The database is unreachable for a while, shorter than the staleness limit, in the
    middle of a build: heartbeats fail, the next ones land again, the claim is never lost,
    and the build finishes once (its own next queries reconnect)."""
    monkeypatch.setattr(rehydrated, "_HEARTBEAT_S", 0.05)
    failed: list[BaseException] = []
    beat = rehydrated._Heartbeat.beat

    def counted(self: Any) -> bool:
        try:
            return beat(self)
        except BaseException as exc:
            failed.append(exc)
            raise

    monkeypatch.setattr(rehydrated._Heartbeat, "beat", counted)
    proxy = TcpProxy(("127.0.0.1", 5432))
    proxied = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    settings = Settings(data_dir=tmp_path / "data", database_url=proxied)
    try:
        with SessionStore.from_settings(settings) as store:
            sid = _session(store)
            gate = _Gate(monkeypatch, store)
            a = in_thread(lambda: rehydrate(store, Request(sid, "acme")))
            assert gate.reached.wait(60)
            proxy.cut()
            time.sleep(1.5)
            proxy.restore()
            cut_over = utcnow()
            wait_for(lambda: _row(store, sid).heartbeat_at > cut_over, 10, "a heartbeat")
            assert _row(store, sid).status == "building"
            gate.release.set()
            wait_for(lambda: "result" in a or "error" in a, 60, "the build")
            assert "error" not in a, a
            assert not a["result"]["reused"] and _outputs(store, sid) == [a["result"]["ref"]]
            row = _row(store, sid)
            assert (row.status, row.artifact_id, row.builds) == ("done", a["result"]["ref"], 1)
            assert store.retrieve(a["result"]["ref"], session_id=sid) is not None
    finally:
        proxy.close()
    assert failed, "no heartbeat failed while the database was away"


@pytest.mark.postgres
def test_a_host_whose_clock_runs_ahead_does_not_take_a_live_build_over(
    pg_store: SessionStore, monkeypatch: pytest.MonkeyPatch, in_thread: Any
) -> None:
    """Heartbeats are written and judged by the database's clock: a request on a host whose
    clock runs 30 s ahead (three staleness limits) waits for a build whose last heartbeat is
    a few seconds old, instead of taking it over (by its own clock it looked dead)."""
    store = pg_store
    monkeypatch.setattr(rehydrated, "_HEARTBEAT_S", 3600.0)  # only the claim's own beat
    sid = _session(store)
    gate = _Gate(monkeypatch, store)
    a = in_thread(lambda: rehydrate(store, Request(sid, "acme")))
    assert gate.reached.wait(60)
    ahead = timedelta(seconds=3 * rehydrated.STALE_AFTER_S)
    skew_host_clock(monkeypatch, ahead)
    b = in_thread(lambda: rehydrate(store, Request(sid, "acme"), wait_s=60))
    time.sleep(1.0)
    assert "result" not in b and "error" not in b, b  # B waits for A
    assert _row(store, sid).builds == 0
    gate.release.set()
    wait_for(lambda: all("result" in x or "error" in x for x in (a, b)), 60, "both requests")
    assert "error" not in a and "error" not in b, (a, b)
    assert not a["result"]["reused"] and b["result"]["ref"] == a["result"]["ref"]
    assert _outputs(store, sid) == [a["result"]["ref"]] and _row(store, sid).builds == 1


@contextlib.contextmanager
def _bounded(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, stall_s: float, stale_s: float
) -> Iterator[SessionStore]:
    """Builds stop heart-beating after ``stall_s`` without progress, and are stale
    ``stale_s`` later."""
    monkeypatch.setattr(rehydrated, "_HEARTBEAT_S", 0.05)
    monkeypatch.setattr(rehydrated, "STALE_AFTER_S", stale_s)
    bounded = settings.with_overrides(rehydrate_stall_seconds=stall_s)
    with SessionStore.from_settings(bounded) as s:
        yield s


@pytest.fixture
def bounded_store(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[SessionStore]:
    """Half a second to stall, half a second more to go stale."""
    with _bounded(settings, monkeypatch, 0.5, 0.5) as s:
        yield s


@pytest.fixture
def roomy_store(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[SessionStore]:
    """A second to stall and a second more to go stale: for a build that must NOT be taken
    over while it reads one blob each 0.2 s. With half-second bounds a thread starved by a
    loaded machine (4 test processes on 2 cores, SQLite's lock) for about a second between
    two reads was taken for a stalled one: the test flaked under CI."""
    with _bounded(settings, monkeypatch, 1.0, 1.0) as s:
        yield s


class _HungRead:
    """The first blob read waits until released (an endpoint that stopped answering, with
    the builder's process and its heartbeat thread alive); later reads pass."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: SessionStore) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self._first = True
        get: Callable[[str], bytes] = store.blobs.get

        def hung(blob_hash: str) -> bytes:
            if self._first:
                self._first = False
                self.reached.set()
                assert self.release.wait(60)
            return get(blob_hash)

        monkeypatch.setattr(store.blobs, "get", hung)


def _session_with_a_blob(store: SessionStore) -> str:
    sid = _session(store)
    big = {"type": "message", "id": "big", "parentId": "m2", "message": {"content": "x" * 20_000}}
    store.append(sid, [big])
    return sid


def _exported(store: SessionStore, sid: str) -> str:
    out = io.StringIO()
    exporter.export_pi(store, sid, out)
    return out.getvalue()


def test_a_build_hung_past_its_bound_is_taken_over_and_its_late_output_discarded(
    bounded_store: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
    in_thread: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Builder A hangs in a blob read with its heartbeat thread alive: it kept its claim
    forever, every identical request timed out waiting and none built. Past the build bound
    its heartbeat stops, B takes over and serves the right content, and A, released, finds
    its claim gone, discards what it built and serves B's output."""
    watch_log(caplog, rehydrated.__name__)
    store = bounded_store
    sid = _session_with_a_blob(store)
    hung = _HungRead(monkeypatch, store)
    try:
        started = time.monotonic()
        a = in_thread(lambda: rehydrate(store, Request(sid, "acme")))
        assert hung.reached.wait(30)
        b = rehydrate(store, Request(sid, "acme"), wait_s=8)  # was RehydrateInProgress
        assert time.monotonic() - started >= 0.5  # not before A's bound
        assert "result" not in a and "error" not in a  # A still hangs
        assert not b["reused"] and store.retrieve(b["ref"], session_id=sid) == _exported(store, sid)
        row = _row(store, sid)
        assert (row.status, row.artifact_id, row.builds) == ("done", b["ref"], 1)
    finally:
        hung.release.set()
    wait_for(lambda: "result" in a or "error" in a, 30, "builder A")
    assert "error" not in a, a
    assert a["result"]["reused"] and a["result"]["ref"] == b["ref"]
    assert _outputs(store, sid) == [b["ref"]]  # A published nothing, or discarded it
    row = _row(store, sid)
    assert (row.status, row.artifact_id, row.builds) == ("done", b["ref"], 1)
    staging = session_dir(store.settings.resolved_artifact_root, "acme", sid) / STAGING_DIR
    assert not staging.exists() or not any(staging.iterdir())  # A's staged file is gone
    said = [r.getMessage() for r in caplog.records if r.name == rehydrated.__name__]
    assert "rehydrate build taken over; waiting for the other's result" in said  # A lost it


def test_a_build_past_its_bound_that_no_one_took_over_still_finishes(
    bounded_store: SessionStore, monkeypatch: pytest.MonkeyPatch, in_thread: Any
) -> None:
    """The bound frees the claim for a waiter; it does not abort a build nobody waits for:
    the builder, still holding its claim when it finishes, publishes its output once."""
    store = bounded_store
    sid = _session_with_a_blob(store)
    hung = _HungRead(monkeypatch, store)
    a = in_thread(lambda: rehydrate(store, Request(sid, "acme")))
    assert hung.reached.wait(30)
    time.sleep(1.5)  # past the bound and the staleness limit
    hung.release.set()
    wait_for(lambda: "result" in a or "error" in a, 30, "builder A")
    assert "error" not in a, a
    ref = a["result"]["ref"]
    assert not a["result"]["reused"] and _outputs(store, sid) == [ref]
    assert store.retrieve(ref, session_id=sid) == _exported(store, sid)
    assert rehydrate(store, Request(sid, "acme"))["ref"] == ref


class _SlowThenHungReads:
    """Blob reads of a slow endpoint that keeps answering: each of the first ``slow`` reads
    takes ``delay`` seconds (less than the stall bound, so the build keeps moving); with
    ``hang``, the read after them waits until released (the endpoint stopped answering);
    later reads pass at once."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        store: SessionStore,
        *,
        slow: int,
        delay: float,
        hang: bool = False,
    ) -> None:
        self.first = threading.Event()
        self.hung = threading.Event()
        self.release = threading.Event()
        self.reads = 0
        lock = threading.Lock()
        get: Callable[[str], bytes] = store.blobs.get

        def slow_get(blob_hash: str) -> bytes:
            with lock:
                self.reads += 1
                n = self.reads
            self.first.set()
            if n <= slow:
                time.sleep(delay)
            elif n == slow + 1 and hang:
                self.hung.set()
                assert self.release.wait(60)
            return get(blob_hash)

        monkeypatch.setattr(store.blobs, "get", slow_get)


def _session_with_blobs(store: SessionStore, count: int) -> str:
    sid = _session(store)
    store.append(
        sid,
        [
            {
                "type": "message",
                "id": f"b{i}",
                "parentId": "m2",
                "message": {"content": f"{i:04d}" + "x" * 20_000},
            }
            for i in range(count)
        ],
    )
    return sid


def _claims(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every claim's outcome, in order (True: that request became the builder)."""
    outcomes: list[bool] = []
    claim = rehydrated._claim

    def counted(*args: Any) -> bool:
        took = claim(*args)
        outcomes.append(took)
        return took

    monkeypatch.setattr(rehydrated, "_claim", counted)
    return outcomes


def test_a_slow_build_that_keeps_moving_past_the_bound_is_not_taken_over(
    roomy_store: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
    in_thread: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every blob read of the build is slow (a big session on a slow S3) but the build
    keeps moving, for several times the bound plus the staleness limit: it keeps its
    claim, builds once, and both waiters get its output. Its heartbeat stopped at the
    bound whatever the build was doing, so a waiter took it over, and the taker, as slow,
    would have been taken over in turn: the build repeated for ever."""
    watch_log(caplog, rehydrated.__name__)
    store = roomy_store
    sid = _session_with_blobs(store, 15)
    claims = _claims(monkeypatch)
    reads = _SlowThenHungReads(monkeypatch, store, slow=15, delay=0.2)  # 3 s of reads
    started = time.monotonic()
    a = in_thread(lambda: rehydrate(store, Request(sid, "acme")))
    assert reads.first.wait(30)
    b = in_thread(lambda: rehydrate(store, Request(sid, "acme"), wait_s=60))
    c = in_thread(lambda: rehydrate(store, Request(sid, "acme"), wait_s=60))
    wait_for(lambda: all("result" in x or "error" in x for x in (a, b, c)), 60, "all three")
    assert all("error" not in x for x in (a, b, c)), (a, b, c)
    # the case under test: the build ran past the bound plus the staleness limit
    assert reads.reads >= 15 and time.monotonic() - started >= 1.0 + 1.0
    ref = a["result"]["ref"]
    assert not a["result"]["reused"]  # A finished its own build, never taken over
    assert b["result"]["reused"] and c["result"]["reused"]
    assert b["result"]["ref"] == ref and c["result"]["ref"] == ref
    assert claims.count(True) == 1  # no waiter ever became a builder
    assert _outputs(store, sid) == [ref]
    row = _row(store, sid)
    assert (row.status, row.artifact_id, row.builds) == ("done", ref, 1)
    assert store.retrieve(ref, session_id=sid) == _exported(store, sid)
    said = [r.getMessage() for r in caplog.records if r.name == rehydrated.__name__]
    assert not [m for m in said if "taken over" in m or "no progress" in m], said


def test_a_build_that_moves_then_hangs_is_taken_over_only_once_it_stops(
    bounded_store: SessionStore,
    monkeypatch: pytest.MonkeyPatch,
    in_thread: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Builder A reads slowly but steadily past the bound (not taken over), then blocks in
    a blob read that never answers: after the bound without progress its heartbeat stops
    and waiter B takes over and serves the right content; A, woken, finds its claim gone,
    discards what it built and serves B's output. One artifact for the request key."""
    watch_log(caplog, rehydrated.__name__)
    store = bounded_store
    sid = _session_with_blobs(store, 8)
    claims = _claims(monkeypatch)
    reads = _SlowThenHungReads(monkeypatch, store, slow=6, delay=0.2, hang=True)
    try:
        a = in_thread(lambda: rehydrate(store, Request(sid, "acme")))
        assert reads.first.wait(30)
        b = in_thread(lambda: rehydrate(store, Request(sid, "acme"), wait_s=60))
        assert reads.hung.wait(30)  # 1.2 s of slow reads: past the bound and staleness
        assert claims.count(True) == 1 and "result" not in b and "error" not in b
        row = _row(store, sid)
        assert (row.status, row.builds) == ("building", 0)  # still A's
        wait_for(lambda: "result" in b or "error" in b, 30, "B to take over and finish")
        assert "error" not in b, b
        assert claims.count(True) == 2 and "result" not in a and "error" not in a  # A hangs
        assert not b["result"]["reused"]
        assert store.retrieve(b["result"]["ref"], session_id=sid) == _exported(store, sid)
    finally:
        reads.release.set()
    wait_for(lambda: "result" in a or "error" in a, 30, "builder A")
    assert "error" not in a, a
    ref = b["result"]["ref"]
    assert a["result"]["reused"] and a["result"]["ref"] == ref
    assert _outputs(store, sid) == [ref]  # A published nothing
    row = _row(store, sid)
    assert (row.status, row.artifact_id, row.builds) == ("done", ref, 1)
    staging = session_dir(store.settings.resolved_artifact_root, "acme", sid) / STAGING_DIR
    assert not staging.exists() or not any(staging.iterdir())  # A's staged file is gone
    said = [r.getMessage() for r in caplog.records if r.name == rehydrated.__name__]
    assert any(m.startswith("rehydrate build made no progress for 0.5s") for m in said), said
    assert "rehydrate build taken over; waiting for the other's result" in said  # A lost it


def test_the_stall_bound_keeps_its_older_names(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SESSIONSTORE_REHYDRATE_MAX_BUILD_SECONDS (and the keyword of that name) still set
    the bound, now rehydrate_stall_seconds; the new name wins when both are given."""
    monkeypatch.delenv("SESSIONSTORE_REHYDRATE_STALL_SECONDS", raising=False)
    monkeypatch.setenv("SESSIONSTORE_REHYDRATE_MAX_BUILD_SECONDS", "42")
    assert Settings().rehydrate_stall_seconds == 42.0
    assert Settings().rehydrate_max_build_seconds == 42.0
    monkeypatch.setenv("SESSIONSTORE_REHYDRATE_STALL_SECONDS", "7")
    assert Settings().rehydrate_stall_seconds == 7.0
    assert Settings(rehydrate_max_build_seconds=3).rehydrate_stall_seconds == 3.0
    both = Settings(rehydrate_max_build_seconds=3, rehydrate_stall_seconds=4)
    assert both.rehydrate_stall_seconds == 4.0
    assert settings.with_overrides(rehydrate_max_build_seconds=2).rehydrate_stall_seconds == 2.0
    assert settings.with_overrides(rehydrate_stall_seconds=1).rehydrate_stall_seconds == 1.0


def test_an_output_about_to_expire_is_built_anew_not_served(store: SessionStore) -> None:
    sid = _session(store)
    first = rehydrate(store, Request(sid, "acme"))
    set_output_expiry(store, first["ref"], timedelta(seconds=1))
    again = rehydrate(store, Request(sid, "acme"))
    assert not again["reused"] and again["ref"] != first["ref"]
    assert rehydrate(store, Request(sid, "acme"))["ref"] == again["ref"]  # it has life left


def test_a_file_artifact_with_the_outputs_name_is_not_taken_for_it(store: SessionStore) -> None:
    """Artifact ids are unique per kind: a file artifact named like the output (listed
    first, living long) must not make an expired output look alive."""
    sid = _session(store)
    first = rehydrate(store, Request(sid, "acme"))
    output = _artifacts.c.local_id == first["ref"]
    with store.engine.begin() as conn:
        row = dict(conn.execute(select(_artifacts).where(output)).one()._mapping)
        row.pop("id")
        conn.execute(_artifacts.delete().where(output))
        far = utcnow() + timedelta(days=30)
        conn.execute(insert(_artifacts).values({**row, "kind": "file", "expires_at": far}))
        gone = utcnow() - timedelta(seconds=1)
        conn.execute(insert(_artifacts).values({**row, "expires_at": gone}))
    again = rehydrate(store, Request(sid, "acme"), wait_s=10)
    assert not again["reused"] and again["ref"] != first["ref"]


def test_expiry_prunes_records_no_request_can_use_and_delete_removes_all(
    store: SessionStore,
) -> None:
    """Pruned: finished with the output gone (once settled), a build whose heartbeat
    stopped as long ago as staged files are kept, a record whose session is gone. Kept: a
    live output, a build dead only for minutes, a just-finished record (a rebuild racing
    the prune), whatever its output."""
    hour = timedelta(hours=1)
    max_age = timedelta(seconds=store.settings.staging_max_age_seconds)
    names = ("gone", "just_done", "live", "dead", "recent")
    sids = {name: _session(store) for name in names}
    refs = {name: rehydrate(store, Request(sid, "acme"))["ref"] for name, sid in sids.items()}
    for name in ("gone", "just_done"):
        set_output_expiry(store, refs[name], timedelta(seconds=-1))
    _set_row(store, sids["gone"], heartbeat_at=utcnow() - hour)
    _set_row(store, sids["live"], heartbeat_at=utcnow() - 24 * hour)
    _set_row(store, sids["dead"], status="building", heartbeat_at=utcnow() - max_age - hour)
    _set_row(store, sids["recent"], status="building", heartbeat_at=utcnow() - timedelta(minutes=5))
    orphan = store.create_session(tenant_id="acme").id
    with store.engine.connect() as conn:
        live_row = conn.execute(select(_rows).where(_rows.c.session_id == sids["live"])).one()
    store.delete_session(orphan)
    with store.engine.begin() as conn:  # a request that raced the session's delete
        conn.execute(insert(_rows).values({**live_row._mapping, "session_id": orphan}))

    dry = store.expire_artifacts(apply=False)  # what an apply run prunes, nothing removed
    assert dry.deleted == 2 and dry.rehydrations_pruned == 3
    deletes: list[str] = []  # each DELETE of records, marked once its transaction commits

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM REHYDRATIONS"):
            deletes.append(statement)

    def on_commit(conn: Any) -> None:
        if deletes and not deletes[-1].endswith("-- committed"):
            deletes[-1] += " -- committed"

    event.listen(store.engine, "before_cursor_execute", on_execute)
    event.listen(store.engine, "commit", on_commit)
    try:
        report = store.expire_artifacts(apply=True, batch_size=1)  # a batch per record
    finally:
        event.remove(store.engine, "before_cursor_execute", on_execute)
        event.remove(store.engine, "commit", on_commit)
    # three batches of one, then one that finds nothing: each DELETE committed on its own
    assert len(deletes) == 4 and all(d.endswith("-- committed") for d in deletes)

    assert report.deleted == 2 and report.rehydrations_pruned == 3
    assert report.to_dict()["rehydrations_pruned"] == 3
    with store.engine.connect() as conn:
        left = set(conn.execute(select(_rows.c.session_id)).scalars())
    assert left == {sids[name] for name in ("just_done", "live", "recent")}
    for name in names:
        store.delete_session(sids[name])
    with store.engine.connect() as conn:
        assert conn.execute(select(_rows)).all() == []
    assert store.expire_artifacts(apply=False).rehydrations_pruned == 0


@pytest.fixture
def pg_store(pg_url: str, tmp_path: Path) -> Iterator[SessionStore]:
    with SessionStore.from_settings(Settings(data_dir=tmp_path / "data", database_url=pg_url)) as s:
        yield s


@pytest.mark.postgres
def test_a_claim_waiting_on_the_row_sees_the_output_committed_with_it(
    pg_store: SessionStore, in_thread: Any
) -> None:
    """PostgreSQL: a claim that starts while the builder's last transaction (its output and
    its DONE) is uncommitted, and reaches the row after it commits, must see that output.

    One UPDATE re-checked the row's new version but its NOT EXISTS subquery with its own
    older snapshot, and took the finished build. The claim now locks the row, then looks.
    """
    store = pg_store
    sid = _session(store)
    first = rehydrate(store, Request(sid, "acme"))
    key = (sid, "pi", first["head_seq"])
    _set_row(
        store,
        sid,
        status="building",
        artifact_id=None,
        builder="builder",
        heartbeat_at=utcnow() - timedelta(minutes=1),
    )
    with store.engine.begin() as conn:
        mine = _artifacts.c.session_id == sid
        conn.execute(update(_artifacts).where(mine).values(local_id="art_0000000000000001"))
        artifact = dict(conn.execute(select(_artifacts).where(mine)).one()._mapping)
        conn.execute(_artifacts.delete().where(mine))
    artifact.pop("id")
    with store.engine.connect() as builder:
        tx = builder.begin()
        # The builder holds the row (no new version yet: the claim's INSERT fails at once
        # and its next statement starts before the builder's output exists) ...
        builder.execute(select(_rows).where(_rows.c.session_id == sid).with_for_update())
        claim = in_thread(lambda: rehydrated._claim(store, key, "waiter"))

        def claim_waits_for_the_row() -> bool:
            with store.engine.connect() as look:  # a transaction of its own: fresh stats
                waiting = look.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                    )
                ).scalar_one()
            return bool(waiting)

        wait_for(claim_waits_for_the_row, 30, "the claim to wait on the row lock")
        # ... then publishes its output and marks the build done, in one commit.
        builder.execute(insert(_artifacts).values(artifact))
        builder.execute(
            update(_rows)
            .where(_rows.c.session_id == sid)
            .values(status="done", artifact_id=artifact["local_id"])
        )
        tx.commit()
    wait_for(lambda: "result" in claim or "error" in claim, 30, "the claim")
    assert claim == {"result": False}
    assert rehydrate(store, Request(sid, "acme"))["reused"]


def _header(store: SessionStore, sid: str, ref: str) -> dict[str, Any]:
    served = store.resolve(ref, session_id=sid, tenant_id="acme").content
    assert isinstance(served, str)
    header = json.loads(served.splitlines()[0])
    assert isinstance(header, dict)
    return header


def test_a_build_from_before_a_cwd_move_is_not_served_after_it(store: SessionStore) -> None:
    """The export's header names the session's cwd: a build from before a cwd move (the
    head unchanged) was served after it, naming the old cwd, where ``export_session``
    named the new one (a review of the read path, stop 39)."""
    sid = _session(store)
    first = rehydrate(store, Request(sid, "acme"))
    assert _header(store, sid, first["ref"])["cwd"] == "/work"
    store.move(sid, cwd="/elsewhere")
    again = rehydrate(store, Request(sid, "acme"))
    assert not again["reused"] and again["ref"] != first["ref"]
    assert _header(store, sid, again["ref"])["cwd"] == "/elsewhere"
    exported = io.StringIO()
    store.export_session(sid, exported)
    assert json.loads(exported.getvalue().splitlines()[0])["cwd"] == "/elsewhere"
    assert rehydrate(store, Request(sid, "acme"))["reused"]  # and that one is reused


def test_a_session_moved_to_another_tenant_during_its_build_is_answered_typed(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session moves to another tenant while its export is written (its directory,
    the build's staging place, renamed under it): the caller's tenant no longer sees it,
    SessionNotFound, not the build's FileNotFoundError; the new tenant's request builds."""
    sid = _session(store)
    write = rehydrated._write

    def moved_while_writing(*args: Any, **kwargs: Any) -> int:
        entries = write(*args, **kwargs)
        with SessionStore.from_settings(store.settings) as other:
            other.move(sid, tenant_id="globex")
        return entries

    monkeypatch.setattr(rehydrated, "_write", moved_while_writing)
    with pytest.raises(SessionNotFound):
        rehydrate(store, Request(sid, "acme"), wait_s=5)
    monkeypatch.setattr(rehydrated, "_write", write)
    built = rehydrate(store, Request(sid, "globex"), wait_s=5)
    assert not built["reused"]
    served = store.resolve(built["ref"], session_id=sid, tenant_id="globex").content
    assert isinstance(served, str) and json.loads(served.splitlines()[0])["id"] == sid
