"""A test run that is killed takes its celery workers with it (``tests.support.spawn``).

Orphaned by a SIGKILLed pytest, a worker went on consuming: from the Redis database its
run had leased, handed to the next run, whose writes it then took and failed ("session not
found" in another run's journal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from contextlib import suppress
from pathlib import Path

from core import Settings
from core.migrate import upgrade
from tests.support import ROOT, wait_for

# The run to kill: a worker (prefork, one pool process) started from a thread that then
# ends, as a fixture's helper thread may. The signal is the forking thread's: a worker
# forked by that thread would be signalled as it ended, long before the run.
RUN = """
import threading
import time
from pathlib import Path

from tests.support import WorkerProcess, clean_env

HERE = Path(__file__).parent


def test_a_worker_runs_until_the_run_is_killed() -> None:
    started = []
    thread = threading.Thread(
        target=lambda: started.append(
            WorkerProcess(clean_env(HERE / "data"), HERE / "worker.log", concurrency=1)
        )
    )
    thread.start()
    thread.join()
    # written whole, then named: the test reads the pid as soon as the name appears (an
    # empty file read between its creation and its write failed a CI run)
    (HERE / "worker.tmp").write_text(str(started[0].proc.pid))
    (HERE / "worker.tmp").rename(HERE / "worker.pid")
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """A process that runs (a zombie has ended: its parent, gone, cannot reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with suppress(OSError, IndexError):
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
            ):
                found.append(int(entry.name))
    return found


def test_a_killed_test_run_takes_its_workers_with_it(tmp_path: Path) -> None:
    """SIGKILL a pytest whose test started a worker (and whose starting thread has ended):
    the worker and its pool process are gone within seconds. They ran on before."""
    (tmp_path / "test_run.py").write_text(textwrap.dedent(RUN))
    upgrade(Settings(data_dir=tmp_path / "data").resolved_database_url)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    pid_file, log = tmp_path / "worker.pid", tmp_path / "worker.log"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    run = subprocess.Popen(
        [*command, "--rootdir", str(tmp_path), str(tmp_path / "test_run.py")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = 0
    try:
        wait_for(pid_file.exists, 60, "the run to start its worker")
        worker = int(pid_file.read_text())
        ready = lambda: " ready." in log.read_text(errors="replace")  # noqa: E731
        wait_for(ready, 60, "the worker to be ready")
        # the same children in three reads in a row: a process the worker runs for a moment
        # while it starts can be its only child at one read and gone at the next
        seen: list[list[int]] = []

        def settled() -> bool:
            seen.append(sorted(_children(worker)))
            return bool(seen[-1]) and seen[-3:] == [seen[-1]] * 3

        wait_for(settled, 30, "the worker's pool process", step=0.2)
        pool = seen[-1]
        assert _alive(worker)  # the thread that started it has ended: it runs on
        run.kill()
        run.wait(10)
        wait_for(
            lambda: not any(_alive(pid) for pid in (worker, *pool)),
            15,
            "the killed run's worker and its pool process to end",
        )
    finally:
        run.kill()
        run.wait(10)
        if worker:  # this test leaves nothing behind, whatever happened
            with suppress(ProcessLookupError):
                os.killpg(worker, signal.SIGKILL)
