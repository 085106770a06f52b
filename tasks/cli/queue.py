"""``sessionstore queue status``: what is waiting, what is running, what was rejected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from tasks.cli.common import JsonOption, console, new_app, new_table, open_store, print_json

cli = new_app()

queue_app = new_app(help="The task queue: status.")
cli.add_typer(queue_app, name="queue")


def _broker_counts(celery_app: Any, queue: str, embedded: Path | None) -> dict[str, Any]:
    """Messages waiting in ``queue``, delivered but not yet acked (Redis: the unacked
    index, every queue; the embedded broker: its claims; None on AMQP, which does not say),
    and (embedded broker, its folder ``embedded``) message files set aside as unreadable."""
    from core import broker

    with celery_app.connection_for_read() as conn:
        # One attempt: an unreachable broker is reported at once, not retried for minutes.
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=5)
        channel = conn.default_channel
        try:
            depth = int(channel.queue_declare(queue=queue, passive=True).message_count)
        except Exception as exc:
            if type(exc).__name__ != "ChannelError":  # NOT_FOUND: never used, so empty
                raise
            depth = 0
        unacked = set_aside = None
        client = getattr(channel, "client", None)  # the Redis transport's client
        unacked_key = getattr(channel, "unacked_key", None)
        if client is not None and unacked_key is not None:
            unacked = int(client.hlen(unacked_key))
        elif embedded is not None:
            unacked, set_aside = broker.held(embedded)
        return {
            "broker": conn.as_uri(),
            "queues": {queue: depth},
            "unacked": unacked,
            "set_aside": set_aside,
        }


def _workers(celery_app: Any, timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Workers that answered within ``timeout``, each with its active tasks."""
    inspect = celery_app.control.inspect(timeout=timeout)
    active = inspect.active() or {}
    alive = inspect.ping() or {}
    return {
        name: [
            {"id": t.get("id"), "name": t.get("name"), "started": t.get("time_start")}
            for t in active.get(name, [])
        ]
        for name in sorted(set(alive) | set(active))
    }


@queue_app.command("status")
def status(
    timeout: float = typer.Option(
        1.0, min=0.1, help="Seconds to wait for workers to answer the inspection."
    ),
    as_json: bool = JsonOption,
) -> None:
    """Depth per queue, unacked messages (the embedded broker: its claims), message files
    the embedded broker set aside as unreadable, dead letters, and the workers alive with
    their active tasks (workers that do not answer within --timeout are not listed)."""
    from core.urls import EMBEDDED_BROKER_URL
    from tasks.app import QUEUE, create_app, embedded_broker_dir
    from tasks.cli.common import load_settings

    settings = load_settings()
    with open_store() as store:  # first: no database (exit 9) creates no broker folder
        dead = store.dead_letters.count()
    embedded = None if settings.broker_url else embedded_broker_dir(settings)
    if embedded is not None and not embedded.is_dir():
        # No producer nor worker has used this embedded broker (each makes its folder): it
        # holds nothing, and a look is no reason to make it (a mistyped data dir, with the
        # journal on PostgreSQL, got the broker's folders).
        counts: dict[str, Any] = {
            "broker": EMBEDDED_BROKER_URL,
            "queues": {QUEUE: 0},
            "unacked": 0,
            "set_aside": 0,
        }
        workers: dict[str, list[dict[str, Any]]] = {}
    else:
        celery_app = create_app(settings)
        counts = _broker_counts(celery_app, QUEUE, embedded)
        workers = _workers(celery_app, timeout)
    result = {**counts, "dead_letters": dead, "workers": workers}
    if as_json:
        print_json(result)
        return
    table = new_table("", "", show_header=False, title="queue", title_justify="left")
    table.add_row("broker", counts["broker"])
    for name, depth in counts["queues"].items():
        table.add_row(f"waiting in {name}", f"{depth:,}")
    unacked, set_aside = counts["unacked"], counts["set_aside"]
    table.add_row("unacked (delivered, running)", "n/a" if unacked is None else f"{unacked:,}")
    if set_aside is not None:
        table.add_row("set aside as unreadable (queue/bad/)", f"{set_aside:,}")
    table.add_row("dead letters", f"{dead:,}")
    table.add_row("workers alive", f"{len(workers)}")
    console.print(table)
    for name, tasks in workers.items():
        running = ", ".join(f"{t['name']}[{t['id']}]" for t in tasks) or "idle"
        console.print(f"{name}: {running}", markup=False, highlight=False)
