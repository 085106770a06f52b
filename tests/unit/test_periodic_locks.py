"""Every periodic job's run lock lasts as long as a run can: the task's hard time limit and
a margin (a review of the operator's side, stop 39: the fork reconciler's lasted its window,
at least 60 s, so a run longer than that had a second one started beside it, both repairing
the same half-done moves)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core import Settings
from tasks import forks, maintenance
from tasks.app import create_app
from tasks.locks import LOCK_MARGIN_S, longest_run_s


@pytest.mark.parametrize("job", ["reconcile", "gc", "expire"])
def test_a_periodic_runs_lock_outlasts_its_hard_time_limit(
    job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(Settings(data_dir=tmp_path / "data", reconcile_schedule="60"))
    locks: list[float] = []

    @contextlib.contextmanager
    def recorded(*args: Any, max_run_s: float, **kwargs: Any) -> Iterator[bool]:
        locks.append(max_run_s)
        yield False  # another run holds it: nothing else runs

    monkeypatch.setattr(maintenance, "periodic_run", recorded)  # the reconciler's too
    task = {"reconcile": forks.reconcile_forks, "gc": maintenance.gc_blobs}.get(job)
    task = task or maintenance.expire_artifacts
    with app.connection_for_write():  # the app current, as in a worker
        app.tasks[task.name].run()
    hard_limit = float(app.conf.task_time_limit)
    assert locks == [hard_limit + LOCK_MARGIN_S] == [longest_run_s(app)]
    assert locks[0] > 60.0 + LOCK_MARGIN_S
