"""Fault injection for worker subprocesses, loaded with ``celery worker -I tests.faults``.

With ``SS_FAULT_DIR`` set and a file ``armed`` in it, the first transaction that inserts
events hangs right after its commit (when its connection goes back to the pool): the write
has landed but the task has neither stored its result nor been acked. A SIGKILL now is
the worst case for at-least-once delivery: the message comes back for a write that landed.
``SS_FAULT_TABLE`` names another table to watch instead (``dead_letters``: a rejection
kept, its outcome not yet stored). The hang ends when the test kills the process, or when
it creates ``release`` in the directory (then the task goes on).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.pool import Pool

FAULT_DIR = os.environ.get("SS_FAULT_DIR")
FAULT_TABLE = os.environ.get("SS_FAULT_TABLE", "events")


@event.listens_for(Engine, "before_cursor_execute")
def _note_event_insert(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
    if FAULT_DIR and f"INTO {FAULT_TABLE} " in statement:
        conn.info["inserted_events"] = True


if FAULT_DIR and FAULT_TABLE == "events":
    # PostgreSQL's append runs on the driver's cursor (core.journal.postgres.run_append),
    # where SQLAlchemy's cursor events do not see it: it is noted here instead.
    from core.journal import journal as _journal

    _real_run_append = _journal.run_append

    def _noting_run_append(conn: Any, *args: Any, **kwargs: Any) -> Any:
        conn.info["inserted_events"] = True
        return _real_run_append(conn, *args, **kwargs)

    _journal.run_append = _noting_run_append  # type: ignore[assignment]


@event.listens_for(Pool, "checkin")
def _hang_once_after_commit(dbapi_connection: Any, record: Any) -> None:
    if not FAULT_DIR or record is None or not record.info.pop("inserted_events", False):
        return
    folder = Path(FAULT_DIR)
    try:
        (folder / "armed").rename(folder / "claimed")  # atomic: one transaction wins
    except FileNotFoundError:
        return
    # written whole, then named: a test reads the pid as soon as the name appears
    (folder / "committed.tmp").write_text(str(os.getpid()))
    (folder / "committed.tmp").rename(folder / "committed")
    # until the test kills this process, or lets it go on (a file ``release``)
    deadline = time.monotonic() + 60
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


SLOW_REHYDRATE_S = float(os.environ.get("SS_SLOW_REHYDRATE_S", "0"))
# With SS_SLOW_REHYDRATE_WHILE (a path), only while that file exists: the build to kill is
# slow, the retry that takes it over runs at full speed, well inside its time limit.
SLOW_REHYDRATE_WHILE = os.environ.get("SS_SLOW_REHYDRATE_WHILE")

if SLOW_REHYDRATE_S:
    from core.blobs.rehydrate import Rehydrator

    _real_events = Rehydrator.events

    def _slow_events(self: Rehydrator, *args: Any, **kwargs: Any) -> Any:
        """With ``SS_SLOW_REHYDRATE_S``, every rehydration of events waits: a rehydrate
        build (one call per event with blobs) takes long enough to be killed midway."""
        if SLOW_REHYDRATE_WHILE is None or os.path.exists(SLOW_REHYDRATE_WHILE):
            time.sleep(SLOW_REHYDRATE_S)
        return _real_events(self, *args, **kwargs)

    Rehydrator.events = _slow_events  # type: ignore[method-assign]


# With SS_TASK_FAULTS (a directory), each file in it arms one fault, used once (the
# file is renamed away first, so one process takes it):
# - ``transient``: the next rehydrate fails as the database away for a moment;
# - ``refuse_publish``: the next message the worker publishes (a retry) is refused, as a
#   broker restarting refuses it;
# - ``stuck``: the next build hangs where the soft time limit cannot end it (swallowed, as
#   in C code), until the hard limit kills the pool process;
# - ``slow_after_commit``: the next write that commits is held after its commit, before
#   its outcome is stored, for 30 s (past the soft time limit, which ends the wait).
TASK_FAULTS = os.environ.get("SS_TASK_FAULTS")


def _take(name: str) -> bool:
    assert TASK_FAULTS is not None
    try:
        os.rename(os.path.join(TASK_FAULTS, name), os.path.join(TASK_FAULTS, f"{name}.used"))
    except FileNotFoundError:
        return False
    return True


if TASK_FAULTS:
    import celery.canvas
    from billiard.exceptions import SoftTimeLimitExceeded
    from kombu.exceptions import OperationalError

    import core.interop.rehydrated as _rehydrated
    import tasks.rehydrate as _rehydrate_task
    from core.errors import StorageUnavailable

    _real_rehydrate = _rehydrate_task.rehydrate
    _real_build = _rehydrated._build
    _real_apply_async = celery.canvas.Signature.apply_async

    def _faulty_rehydrate(*args: Any, **kwargs: Any) -> Any:
        if _take("transient"):
            raise StorageUnavailable("database", "injected: away for a moment")
        return _real_rehydrate(*args, **kwargs)

    def _faulty_build(*args: Any, **kwargs: Any) -> Any:
        if _take("stuck"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # the hard limit kills the process first
                try:
                    time.sleep(0.2)
                except SoftTimeLimitExceeded:
                    pass
        return _real_build(*args, **kwargs)

    def _faulty_apply_async(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _take("refuse_publish"):
            raise OperationalError("injected: the broker is restarting")
        return _real_apply_async(self, *args, **kwargs)

    import tasks.writes as _writes

    _real_observe_commit = _writes._observe_commit

    def _slow_observe_commit(*args: Any, **kwargs: Any) -> Any:
        if _take("slow_after_commit"):
            time.sleep(30)
        return _real_observe_commit(*args, **kwargs)

    _writes._observe_commit = _slow_observe_commit  # type: ignore[assignment]
    _rehydrate_task.rehydrate = _faulty_rehydrate  # type: ignore[assignment]
    _rehydrated._build = _faulty_build  # type: ignore[assignment]
    celery.canvas.Signature.apply_async = _faulty_apply_async  # type: ignore[method-assign]


if os.environ.get("SS_KILL_ON_POISON"):
    import signal

    import tasks.writes as _poisoned_writes

    _real_validate_write = _poisoned_writes.validate_write

    def _killed_by_poison(settings: Any, session_id: Any, events: Any, *args: Any) -> Any:
        """A write whose first event has ``"poison"`` kills the pool process running it,
        every time, as the OOM killer would (its count of runs in ``SS_KILL_ON_POISON``)."""
        if isinstance(events, list) and events and isinstance(events[0], dict):
            if events[0].get("poison"):
                with open(os.environ["SS_KILL_ON_POISON"], "a") as runs:
                    runs.write(f"{os.getpid()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        return _real_validate_write(settings, session_id, events, *args)

    _poisoned_writes.validate_write = _killed_by_poison  # type: ignore[assignment]
