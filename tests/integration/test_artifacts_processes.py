"""Id allocation from two processes at once, against the real database."""

from __future__ import annotations

import multiprocessing
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

from core import SessionStore, Settings

PER_PROCESS = 25
Saved = list[tuple[str, str]]


def _allocate(
    settings: Settings, session_id: str, name: str, start: Barrier, out: Queue[tuple[str, Saved]]
) -> None:
    """Save PER_PROCESS tool outputs and agent outputs; report (url, content) pairs."""
    saved: Saved = []
    with SessionStore.from_settings(settings) as store:
        manager = store.artifacts(session_id)
        start.wait(timeout=60)
        for i in range(PER_PROCESS):
            content = f"{name} output {i}"
            saved.append((f"artifact://{manager.save(content, name)}", content))
            output_id = manager.save_agent_output(name, f"{name} agent {i}")
            saved.append((f"agent://{output_id}", f"{name} agent {i}"))
    out.put((name, saved))


def _numbers(saved: Saved, scheme: str) -> list[int]:
    ids = [url.removeprefix(scheme) for url, _ in saved if url.startswith(scheme)]
    return sorted(int(i.split("-")[0]) for i in ids)


def test_two_processes_allocate_distinct_ids(settings: Settings) -> None:
    with SessionStore.from_settings(settings) as store:
        session_id = store.create_session(tenant_id="acme").id
        context = multiprocessing.get_context("spawn")
        start = context.Barrier(2)
        out: Queue[tuple[str, Saved]] = context.Queue()
        workers = [
            context.Process(target=_allocate, args=(settings, session_id, name, start, out))
            for name in ("left", "right")
        ]
        for worker in workers:
            worker.start()
        results = dict(out.get(timeout=120) for _ in workers)
        for worker in workers:
            worker.join(timeout=30)
            assert worker.exitcode == 0

        saved = results["left"] + results["right"]
        urls = [url for url, _ in saved]
        assert len(set(urls)) == len(urls) == 4 * PER_PROCESS
        # dense: every id handed out exactly once, none lost or reused
        assert _numbers(saved, "artifact://") == list(range(2 * PER_PROCESS))
        assert _numbers(saved, "agent://") == list(range(2 * PER_PROCESS))
        for url, content in saved:
            assert store.resolve(url, session_id=session_id).content == content
