"""A worker whose unrequested stop hangs still exits non-zero (``tasks.worker``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

# Celery's own warm shutdown is replaced by one that never returns, as seen after a broker
# kill; the stop comes from an "Unrecoverable error" (exit code 1, no signal).
_HANGING_STOP = textwrap.dedent(
    """
    import time
    from celery.apps.worker import Worker as CeleryWorker
    import tasks.worker as module

    module.UNREQUESTED_STOP_GRACE = {grace}
    CeleryWorker.stop = lambda self, in_sighandler=False, exitcode=None: time.sleep({hang})
    worker = module.Worker.__new__(module.Worker)
    {request}
    worker.stop(exitcode={exitcode})
    print("stop returned")
    """
)


def _run(
    grace: float, exitcode: int, *, hang: float = 60, requested: bool = False
) -> tuple[int, float, str]:
    request = "from celery.worker import state; state.should_stop = 0" if requested else ""
    code = _HANGING_STOP.format(grace=grace, exitcode=exitcode, request=request, hang=hang)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    return done.returncode, time.monotonic() - started, done.stdout + done.stderr


def test_an_unrequested_stop_that_hangs_exits_1_after_the_grace() -> None:
    code, seconds, output = _run(0.5, 1)
    assert code == 1, output
    assert seconds < 30, output
    assert "did not stop within" in output


def test_a_requested_stop_is_never_cut_short() -> None:
    # A signal asked for it: Celery's own shutdown takes as long as it needs.
    code, seconds, output = _run(0.5, 1, hang=3, requested=True)
    assert (code, "stop returned") == (0, output.strip().splitlines()[-1]), output
    assert seconds >= 3


def test_a_clean_stop_is_never_cut_short() -> None:
    code, _, output = _run(0.5, 0, hang=3)
    assert (code, "stop returned") == (0, output.strip().splitlines()[-1]), output
