"""Issue 18, item 6 (output people can use), through the real ``sessionstore`` executable:
whole ids in tables on an 80-column terminal, text previews with ``--refs`` for the raw refs,
``--since/--until`` on the entry's own time against ``--recorded-*`` on journal time, and
``--json`` on every command. Both journal backends.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from core import SessionStore
from core.settings import Settings
from tests.acceptance.test_cli_help import _WALK
from tests.cli_process import run_cli
from tests.support import clean_env

BIG_TEXT = "HEAD-OF-BIG-TEXT " + "x" * 40_000
IMAGE = bytes(range(256)) * 400  # 100 KiB, shown as [image 100 KB]
REF = re.compile(r"blob:sha256:[0-9a-f]{64}")


def run(settings: Settings, *args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = clean_env(
        settings.data_dir,
        COLUMNS=str(columns),
        SESSIONSTORE_DATABASE_URL=str(settings.database_url),
    )
    result = run_cli(*args, env=env)
    assert result.returncode == 0, (args, result.stderr)
    return result


def _entry(entry: str, message: dict[str, Any], timestamp: Any) -> dict[str, Any]:
    return {
        "type": "message",
        "id": entry,
        "parentId": {"a1": None, "a2": "a1", "a3": "a2"}[entry],
        "timestamp": timestamp,
        "message": message,
    }


@pytest.fixture
def session_id(store: SessionStore) -> str:
    session = store.create_session(tenant_id="acme-tenant-with-a-long-name", title="t")
    assert len(session.id) == 36
    image = {"type": "image", "mimeType": "image/png", "data": base64.b64encode(IMAGE).decode()}
    store.append(
        session.id,
        [
            # entry time: 2024 (ISO text), recorded now
            _entry("a1", {"role": "user", "content": "hello there"}, "2024-01-02T03:04:05.000Z"),
            _entry(
                "a2",
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "let me look"},
                        {"type": "toolCall", "id": "c1", "name": "read_file", "arguments": {}},
                    ],
                },
                "2024-06-01T00:00:00Z",
            ),
            # entry time: 2025-03-01 as epoch milliseconds, as pi writes it
            _entry(
                "a3",
                {
                    "role": "toolResult",
                    "toolName": "read_file",
                    "toolCallId": "c1",
                    "content": [{"type": "text", "text": BIG_TEXT}, image],
                },
                int(datetime(2025, 3, 1, tzinfo=UTC).timestamp() * 1000),
            ),
        ],
    )
    return session.id


def test_tables_show_whole_ids_at_80_columns(
    settings: Settings, store: SessionStore, session_id: str
) -> None:
    listed = run(settings, "sessions", "list").stdout
    assert session_id in listed and "acme-tenant-with-a-long-name" in listed
    events = run(settings, "events").stdout
    assert events.count(session_id) == 3, events
    assert "…" not in events.split("summary")[0]
    stats = run(settings, "stats").stdout
    assert session_id in stats
    assert session_id in run(settings, "sessions", "show", session_id).stdout


def test_state_and_events_preview_text_and_refs_on_demand(
    settings: Settings, session_id: str
) -> None:
    state = run(settings, "state", session_id).stdout
    assert "hello there" in state and "read_file" in state
    assert "HEAD-OF-BIG-TEXT" in state and "[image 100 KB]" in state
    assert not REF.search(state)
    raw = run(settings, "state", session_id, "--refs").stdout
    assert REF.search(raw.replace("\n", "").replace("│", "").replace(" ", "")), raw
    assert "HEAD-OF-BIG-TEXT" not in raw

    events = re.sub(r"[\s│]", "", run(settings, "events", "--session", session_id).stdout)
    assert "[image100KB]" in events and "HEAD-OF-BIG-TEXT" in events and "read_file()" in events
    assert not REF.search(events)
    raw_events = run(settings, "events", "--session", session_id, "--refs").stdout
    flat = re.sub(r"[\s│]", "", raw_events)
    assert REF.search(flat) and "HEAD-OF-BIG-TEXT" not in raw_events


def test_previews_resolve_only_refs_the_events_own_manifest_names(
    settings: Settings, store: SessionStore, session_id: str
) -> None:
    """Another tenant writes the first tenant's blob hash as plain text (a producer may
    write any string): its previews show that text, never the blob's content or size. A
    fork previews what it inherited (its own manifest names those blobs)."""
    text_hash = next(h for h in store.journal.blob_hashes(session_id) if h != _sha(IMAGE))
    quoting = store.create_session(tenant_id="other")
    ref = f"blob:sha256:{text_hash}"  # (as an image's data it is refused: not this tenant's)
    message = {"role": "user", "content": [{"type": "text", "text": ref}]}
    store.append(quoting.id, [_entry("a1", message, 1), {"type": "custom", "note": ref}])
    assert store.journal.blob_hashes(quoting.id) == set()  # plain text: no manifest row

    state = run(settings, "state", quoting.id, "--tenant", "other", columns=400).stdout
    events = run(settings, "events", "--tenant", "other", columns=400).stdout
    follow = run(
        settings,
        "events",
        "--tenant",
        "other",
        "--follow",
        "--after-position",
        "0",
        "--timeout",
        "1",
        columns=400,
    ).stdout
    for shown in (state, events, follow):
        assert "HEAD-OF-BIG-TEXT" not in shown and "[text" not in shown, shown
        assert text_hash[:12] in shown, shown  # the text as written

    fork = store.fork(session_id)
    inherited = run(settings, "state", fork.id).stdout
    assert "HEAD-OF-BIG-TEXT" in inherited and "[image 100 KB]" in inherited


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _entries(settings: Settings, *args: str) -> list[str]:
    out = json.loads(run(settings, "events", "--json", *args).stdout)
    return [e["payload"]["id"] for e in out["items"]]


def test_since_until_filter_entry_time_and_recorded_filter_journal_time(
    settings: Settings, session_id: str
) -> None:
    assert _entries(settings, "--since", "2024-03-01") == ["a2", "a3"]
    assert _entries(settings, "--until", "2024-06-01T00:00:00+00:00") == ["a1"]
    assert _entries(settings, "--since", "2024-05-31T23:59:59", "--until", "2025-01-01") == ["a2"]
    # epoch-ms timestamps compare as instants too
    assert _entries(settings, "--since", "2025-02-28T23:00:00+02:00") == ["a3"]
    assert _entries(settings, "--since", "2025-02-28T23:00:00-02:00") == []
    # every entry was recorded just now: journal time ignores the entries' own 2024 dates
    hour_ago = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    assert _entries(settings, "--recorded-since", hour_ago) == ["a1", "a2", "a3"]
    assert _entries(settings, "--recorded-until", hour_ago) == []
    assert _entries(settings, "--since", "2026-01-01") == []


# Long-running processes: they hand over to Celery (worker, beat) or run a scripted demo;
# their help says why they print no JSON.
NO_JSON = {"worker", "beat"}


def test_every_command_offers_json() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WALK], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    helps = json.loads(result.stdout)["helps"]
    leaves = [
        path for path in helps if path and not any(other.startswith(path + " ") for other in helps)
    ]
    assert len(leaves) > 25
    missing = [p for p in leaves if p not in NO_JSON and "--json" not in helps[p]["text"]]
    assert missing == []
    for path in NO_JSON:
        assert "No --json" in helps[path]["text"], path


def test_json_output_is_exact_for_integers_beyond_64_bits(
    settings: Settings, store: SessionStore
) -> None:
    """``--json`` once crashed (orjson refuses integers beyond 64 bits: a traceback, exit 1)
    on a value the journal stores and ``-o jsonl`` prints; now every JSON output writes it
    exactly, with key order and -0.0 as stored."""
    big = 123456789012345678901234567890
    session = store.create_session(tenant_id="t1")
    message = {"role": "user", "content": "hi", "z": -0.0, "n": big, "a": -big}
    store.append(
        session.id, [{"type": "message", "id": "a1", "parentId": None, "message": message}]
    )

    listed = json.loads(run(settings, "events", "--json").stdout)["items"]
    shown = listed[0]["payload"]["message"]
    assert shown == message and list(shown) == list(message)
    assert shown["n"] == big and math.copysign(1, shown["z"]) == -1
    state = json.loads(run(settings, "state", session.id, "--json").stdout)
    assert f'"n": {big}, "a": -{big}' in json.dumps(state)
    assert json.loads(run(settings, "stats", "--json").stdout)["events"] == 1


# Stored text that is rich markup, a terminal escape sequence (colour, window title, the C1
# CSI) and a bell: shown literally, the control characters as their escapes.
HOSTILE = "[/x] [bold]b[/bold] [link=file:///etc/passwd]l[/link] \x1b[31mred\x1b]0;t\x07 \x9b2J"
SHOWN = "[/x][bold]b[/bold][link=file:///etc/passwd]l[/link]\\x1b[31mred\\x1b]0;t\\x07\\x9b2J"


# A stored value that would forge a line of its own (a newline, a tab, the Unicode line
# separator) or reorder what the terminal shows (U+202E: "/w\u202egnp.exe" reads
# "/wexe.png"), and an invisible mark: each shown as its escape.
FORGED = "innocent\nparent_id: 0000\tcopy_status: done\u2028x\u202egnp.exe\u200bz"
FORGED_SHOWN = "innocent\\x0aparent_id:0000\\x09copy_status:done\\u2028x\\u202egnp.exe\\u200bz"


def test_a_stored_value_never_starts_a_line_or_turns_the_text_around(
    settings: Settings, store: SessionStore
) -> None:
    """``sessions show`` printed a title's newline as is: the next line read as a forged
    ``parent_id:`` field; an event type with a newline forged a whole event line in
    ``events --follow``; U+202E reordered what the terminal showed."""
    session = store.create_session(tenant_id="acme", title=FORGED, cwd="/w/" + FORGED)
    store.append(session.id, [{"type": FORGED, "note": FORGED}])
    followed = run(settings, "events", "--follow", "--after-position", "0", "--limit", "1")
    outputs = [
        run(settings, "sessions", "show", session.id, columns=400).stdout,
        run(settings, "sessions", "list", columns=400).stdout,
        run(settings, "events", columns=400).stdout,
        followed.stdout,
    ]
    for out in outputs:
        assert not any(line.lstrip().startswith("parent_id: 0000") for line in out.splitlines())
        assert not set("\u2028\u202e\u200b\t") & set(out), out
        assert FORGED_SHOWN in _flat(out), out
    assert len(followed.stdout.strip().splitlines()) == 1  # one event, one line


def _flat(out: str) -> str:
    return re.sub(r"[\s│┃]", "", out)


def test_stored_markup_and_terminal_escapes_are_printed_literally(
    settings: Settings, store: SessionStore
) -> None:
    """Markup in a stored title, cwd, tenant or model once crashed the table output
    (``MarkupError``: a traceback, exit 1, after a fork or move had committed) or was
    silently applied; a stored escape sequence reached the terminal raw. Now every command
    prints stored values literally and exits 0, and a fork happens once."""
    session = store.create_session(tenant_id=HOSTILE, title=HOSTILE, cwd="/w/" + HOSTILE)
    message = {"role": "assistant", "model": HOSTILE, "content": HOSTILE, "usage": {"input": 1}}
    store.append(session.id, [{"type": "message", "id": "a", "parentId": None, "message": message}])
    commands = [
        ("sessions", "show", session.id),
        ("sessions", "list"),
        ("stats",),
        ("events",),
        ("events", "--refs"),
        ("state", session.id),
        ("state", session.id, "--refs"),
        ("sessions", "fork", session.id, "--inline"),
        ("sessions", "move", session.id, "--cwd", "/w2"),
    ]
    for command in commands:
        out = run(settings, *command, columns=400).stdout  # run() asserts exit 0
        assert "\x1b" not in out and "\x9b" not in out and "\x07" not in out, command
        assert SHOWN in _flat(out), (command, out)
    forks = [s for s in store.list_sessions(limit=100).items if s.parent_id == session.id]
    assert len(forks) == 1
    followed = run(settings, "events", "--follow", "--after-position", "0", "--limit", "1")
    assert SHOWN in _flat(followed.stdout) and "\x1b" not in followed.stdout
