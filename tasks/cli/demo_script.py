"""The demo's script (``sessionstore demo`` imports it when it runs): the whole system in
well under a minute.

It writes a realistic coding-agent session through the queue (a real Celery worker in this
process), spills big tool outputs into artifacts, stores screenshots as deduplicated blobs,
forks the session at an earlier turn, runs GC and TTL expiry, and rebuilds the state.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from core.settings import Settings
from core.store import SessionStore
from tasks.app import create_app
from tasks.cli.common import console
from tasks.cli.samples import SUBAGENT_REPORT, EntryBuilder, grep_output, pytest_log, screenshot_png
from tasks.embedded import embedded_worker
from tasks.producer import AppendHandle, enqueue_append
from tasks.runtime import attach_fork_copier


@dataclass
class Tally:
    events: int = 0
    bytes_in: int = 0
    images_sent: int = 0
    handles: list[AppendHandle] = field(default_factory=list)


class DemoSession:
    """Writes one scripted session turn by turn through the queue."""

    def __init__(self, store: SessionStore, celery_app: Any, session_id: str) -> None:
        self.store = store
        self.celery_app = celery_app
        self.session_id = session_id
        self.entries = EntryBuilder()
        self.tally = Tally()
        self.artifacts = store.artifacts(session_id)

    def send(self, *events: dict[str, Any]) -> None:
        """Queue the session's next write once the previous one is confirmed: writes queued
        together may commit in any order (two pool processes take them), and a session's
        turns must land in theirs (README: Order)."""
        self.wait()
        self.tally.events += len(events)
        encoded = orjson.dumps(list(events))
        self.tally.bytes_in += len(encoded)
        self.tally.images_sent += encoded.count(b'"type":"image"')
        self.tally.handles.append(
            enqueue_append(self.session_id, list(events), app=self.celery_app)
        )

    def wait(self) -> None:
        """Every write confirmed. As the README's delivery contract says, the producer owns
        a write until its outcome is known: one without an outcome after 15 s is sent again
        under the same key (idempotent), four times at most."""
        from core.errors import NotFinishedInTime

        for handle in self.tally.handles:
            for attempt in range(4):
                try:
                    handle.get(timeout=15)
                    break
                except NotFinishedInTime:
                    if attempt == 3:
                        raise
                    handle.resend()
        self.tally.handles.clear()

    def run_tool(self, tool: str, output: str) -> str:
        """Stream a tool's output through a bounded sink; big output spills to an artifact."""
        sink = self.artifacts.output_sink(tool)
        for start in range(0, len(output), 8192):
            sink.push(output[start : start + 8192])
        summary = sink.dump()
        if summary.artifact_id is not None:
            return f"{summary.output}\n[Full output: artifact://{summary.artifact_id}]"
        return summary.output


def _write_session(demo: DemoSession) -> dict[str, str]:
    """The scripted session; returns entry ids worth remembering (fork points)."""
    e = demo.entries
    home, failing = screenshot_png(1), screenshot_png(2)
    demo.send(
        e.session_info("Fix the flaky upload test"),
        e.model_change("anthropic", "claude-sonnet-4"),
        e.thinking_level("medium"),
        e.user(
            "test_upload_retries_once fails about one run in five. Can you fix it? "
            "Here is what the dashboard shows.",
            images=[home, failing],
        ),
    )
    demo.send(
        e.assistant(
            "Let me run the test suite first.",
            thinking="Flaky means timing or ordering. Run the whole suite to see.",
            tool_calls=[("call_1", "bash", {"command": "pytest -q"})],
        ),
        e.tool_result("call_1", "bash", demo.run_tool("bash", pytest_log()), is_error=True),
    )
    marks = {"after_tests": e.leaf or ""}
    oversized = demo.store.store_oversized(demo.session_id, grep_output(), "grep", ttl_s=1)
    hint = oversized.hint.to_dict() if oversized else {}
    demo.send(
        e.assistant(
            "Searching for every storage call.",
            tool_calls=[("call_2", "grep", {"pattern": "storage.put", "path": "src"})],
        ),
        e.tool_result("call_2", "grep", orjson.dumps(hint).decode(), details=hint),
    )
    agent_id = demo.artifacts.save_agent_output(
        "explore", SUBAGENT_REPORT, jsonl='{"type":"message","role":"assistant"}\n'
    )
    demo.send(
        e.assistant(
            "I'll ask a subagent to trace the retry logic.",
            tool_calls=[("call_3", "task", {"agent": "explore", "task": "trace retries"})],
        ),
        e.tool_result("call_3", "task", f"Subagent finished: agent://{agent_id}"),
        e.assistant(
            "Opening the upload page to reproduce.",
            tool_calls=[("call_4", "screenshot", {"url": "http://localhost:3000"})],
        ),
        e.tool_result("call_4", "screenshot", "Captured the upload page.", images=[failing]),
    )
    demo.send(
        e.assistant(
            "Found it: `upload.py` retries on top of `with_retries`, so a slow first "
            "attempt is called twice. Removing the outer retry.",
            thinking="The subagent's report matches the failure: 2 == 1 calls.",
            tool_calls=[("call_5", "edit", {"path": "src/app/upload.py"})],
            tokens=(4200, 650),
        ),
        e.tool_result("call_5", "edit", "Applied 1 edit to src/app/upload.py"),
        e.assistant("Fixed. The test now passes 50 runs in a row.", tokens=(5100, 120)),
        e.user("Great, thanks! Here is the dashboard now.", images=[home]),
    )
    demo.wait()
    return marks


def _fork_and_continue(demo: DemoSession, at_seq: int) -> str:
    fork = demo.store.fork(demo.session_id, at_seq=at_seq)
    e = demo.entries
    e.branch_from(_entry_id_at(demo.store, demo.session_id, at_seq))
    branch = DemoSession(demo.store, demo.celery_app, fork.id)
    branch.entries = e
    branch.send(
        e.assistant(
            "Alternative: make the fake storage deterministic instead.",
            tool_calls=[("call_9", "edit", {"path": "tests/conftest.py"})],
        ),
        e.tool_result("call_9", "edit", "Applied 1 edit to tests/conftest.py"),
    )
    branch.wait()
    deadline = time.monotonic() + 20
    while demo.store.get_session(fork.id).copy_status == "pending" and time.monotonic() < deadline:
        time.sleep(0.05)
    return fork.id


def _entry_id_at(store: SessionStore, session_id: str, seq: int) -> str:
    event = store.read(session_id, after_seq=seq - 1, upto_seq=seq)[0]
    return str(event.payload.get("id"))


def _manifest(store: SessionStore, session_id: str) -> dict[int, list[Any]]:
    return dict(store.journal.manifest([e.position for e in store.read(session_id)]))


def _journal_bytes(store: SessionStore, session_id: str) -> int:
    events = store.read(session_id)
    return sum(len(orjson.dumps(e.payload)) for e in events)


def _count_events(store: SessionStore) -> int:
    return int(store.stats(top=1).to_dict()["events"])


def run(settings: Settings, tenant: str, *, as_json: bool = False) -> None:
    """Write a realistic agent session through the queue, fork it, clean up, rebuild it;
    print a summary (one JSON document with ``as_json``)."""
    started = time.monotonic()
    celery_app = create_app(settings)
    # a worker for the demo's run alone: no mailbox left on the embedded broker after it
    worker = embedded_worker(celery_app, remote_control=not settings.is_embedded_broker)
    with SessionStore.from_settings(settings) as store, worker:
        attach_fork_copier(store, celery_app)
        session = store.create_session(
            tenant_id=tenant, title="Fix the flaky upload test", cwd="/work/upload-service"
        )
        script = DemoSession(store, celery_app, session.id)
        with console.status("writing the session through the queue…"):
            _write_session(script)
        head = store.get_session(session.id).head_seq
        with console.status("forking at an earlier turn…"):
            fork_id = _fork_and_continue(script, at_seq=min(5, head))
        time.sleep(1.1)  # the grep output's 1 s TTL passes
        gc_report = store.gc_blobs(apply=True)
        expired = store.expire_artifacts(apply=True)
        state = store.state(session.id)
        fork_state = store.state(fork_id)
        if as_json:
            from tasks.cli.common import print_json

            print_json(
                {
                    "session_id": session.id,
                    "fork_id": fork_id,
                    "events_written": script.tally.events,
                    "events": state.counters.events,
                    "fork_events": fork_state.counters.events,
                    "gc": _report_line(gc_report),
                    "expiry": _report_line(expired),
                    "seconds": round(time.monotonic() - started, 3),
                }
            )
            return
        _print_summary(
            store,
            script.tally,
            session.id,
            fork_id,
            state,
            fork_state,
            gc_report,
            expired,
            time.monotonic() - started,
        )


def _print_summary(
    store: SessionStore,
    tally: Tally,
    session_id: str,
    fork_id: str,
    state: Any,
    fork_state: Any,
    gc_report: Any,
    expired: Any,
    elapsed: float,
) -> None:
    journal = _journal_bytes(store, session_id)
    blobs = store.blob_stats()
    artifacts = store.artifacts(session_id).list()
    fork = store.get_session(fork_id)
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_row("session", f"{session_id} ({state.counters.events} events)")
    table.add_row("events written", f"{tally.events} through the queue (real worker)")
    table.add_row(
        "bytes in → journal",
        f"{tally.bytes_in:,} B sent → {journal:,} B in the journal "
        f"({journal / max(tally.bytes_in, 1):.1%}); the rest is in blobs",
    )
    refs = [ref for entries in _manifest(store, session_id).values() for ref in entries]
    unique = {ref.hash for ref in refs}
    table.add_row(
        "blobs",
        f"{tally.images_sent} screenshots sent → {len(refs)} blob refs, {len(unique)} unique "
        f"blobs ({len(refs) - len(unique)} deduplicated); store-wide "
        f"{blobs.saved_by_dedup:,} B saved by dedup, {blobs.saved_by_compression:,} B by "
        "compression",
    )
    table.add_row(
        "artifacts",
        ", ".join(f"{a.kind}:{a.local_id} ({a.size_bytes:,} B)" for a in artifacts) or "none",
    )
    table.add_row(
        "fork",
        f"{fork.id} at seq {fork.forked_from_seq}, "
        f"artifact copy: {fork.copy_status}; {fork_state.counters.events} events",
    )
    table.add_row("gc", _report_line(gc_report) + " (1 h grace: young blobs stay)")
    table.add_row("ttl expiry", _report_line(expired) + " (the grep output had a 1 s TTL)")
    table.add_row("journal total", f"{_count_events(store)} events in all sessions")
    # as wide as the table: piped, the console is as wide as a line of any length
    panel = Panel(table, title="sessionstore demo", subtitle=f"{elapsed:.1f} s", expand=False)
    console.print(panel)
    console.print("[bold]rebuilt transcript (active branch, last messages):[/]")
    for message in state.messages[-6:]:
        line = escape(_excerpt(message.content))
        console.print(f"  [cyan]{message.role:>10}[/] {line}", highlight=False)
    last = escape(_excerpt(fork_state.messages[-1].content))
    console.print(f"[bold]fork's transcript ends with:[/] {last}", highlight=False)


_REPORT_KEYS = ("referenced", "candidates", "deleted", "bytes_freed", "orphans", "errors")


def _report_line(report: Any) -> str:
    data = report.to_dict() if hasattr(report, "to_dict") else dataclasses.asdict(report)
    shown = {k: v for k, v in data.items() if k in _REPORT_KEYS}
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "nothing to do"


def _excerpt(content: Any, width: int = 90) -> str:
    if isinstance(content, list):
        parts = []
        for block in content:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text":
                parts.append(str(block.get("text", "")))
            elif kind == "toolCall":
                parts.append(
                    f"→ {block.get('name')}({orjson.dumps(block.get('arguments')).decode()})"
                )
            elif kind == "image":
                parts.append("[image]")
        content = " ".join(parts)
    text = " ".join(str(content).split())
    return text if len(text) <= width else text[: width - 1] + "…"
