"""``sessionstore events`` / ``stats`` / ``state``: the real executable in a subprocess for
``--follow`` and stats, and in-process runs for the output formats, on both backends."""

from __future__ import annotations

import base64
import csv
import io
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import typer

from core import SessionStore, Settings
from tasks.cli import main
from tests.cli_process import run_cli
from tests.contract.test_projection import SessionBuilder
from tests.support import store_env

EXECUTABLE = Path(sys.executable).with_name("sessionstore")


def _env(settings: Settings) -> dict[str, str]:
    return store_env(settings, COLUMNS="200")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    main(list(argv))
    return capsys.readouterr().out


@pytest.fixture
def cli_env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key, value in _env(settings).items():
        if key.startswith("SESSIONSTORE_") or key == "COLUMNS":
            monkeypatch.setenv(key, value)
    return settings


def _seed(store: SessionStore) -> tuple[str, str]:
    acme = store.create_session(tenant_id="acme")
    globex = store.create_session(tenant_id="globex")
    for session, turns in ((acme, 2), (globex, 1)):
        b = SessionBuilder()
        for i in range(turns):
            b.turn(f"task {i}")
        store.append(session.id, b.events)
    return acme.id, globex.id


# --follow, with the real executable ------------------------------------------------------


FOLLOW_OPTIONS = ("--output", "jsonl", "--poll-interval", "0.05", "--timeout", "60")


def _follower(settings: Settings, *args: str) -> subprocess.Popen[str]:
    """``events --follow ARGS`` (JSON lines, 50 ms polls, 60 s at most), once it has said
    it follows: every event committed from then on is its to print."""
    proc = subprocess.Popen(
        [str(EXECUTABLE), "events", "--follow", *FOLLOW_OPTIONS, *args],
        env=_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stderr], [], [], 30)
    if not ready:
        proc.kill()
        raise AssertionError("the follower never said it started")
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith("following from position")
    return proc


def test_follow_prints_events_committed_after_it_started_exactly_once(
    store: SessionStore, settings: Settings
) -> None:
    acme_id, globex_id = _seed(store)
    expected_count = 3 * 4 + 2 * 3  # what the writers below append to acme
    proc = _follower(settings, "--tenant", "acme", "--limit", str(expected_count))
    try:

        def writer(session_id: str, batches: int, size: int) -> None:
            for i in range(batches):
                store.append(session_id, [{"type": "tick", "i": i}] * size)

        threads = [
            threading.Thread(target=writer, args=(acme_id, 3, 4)),
            threading.Thread(target=writer, args=(acme_id, 2, 3)),
            threading.Thread(target=writer, args=(globex_id, 3, 5)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err

    printed = [orjson.loads(line) for line in out.splitlines()]
    committed = [
        e.position
        for e in store.read_all(limit=10_000)
        if e.session_id == acme_id and e.type == "tick"
    ]
    assert [p["position"] for p in printed] == committed  # all of them, in order, once
    assert {p["tenant_id"] for p in printed} == {"acme"}


def test_stats_json_from_the_executable(store: SessionStore, settings: Settings) -> None:
    _seed(store)
    done = run_cli("stats", "--json", "--tenant", "acme", env=_env(settings), timeout=60)
    assert done.returncode == 0, done.stderr
    stats = orjson.loads(done.stdout)
    assert stats["events"] == 8 and stats["sessions"] == 1
    assert stats["events_by_type"] == {"message": 8}
    assert stats["tokens"]["input"] == 4 * 100
    assert stats["top_sessions_by_events"][0]["tenant_id"] == "acme"
    assert set(stats) >= {"events_by_day", "top_sessions_by_bytes", "blobs", "artifacts"}


# output formats, in-process -------------------------------------------------------------


def test_events_jsonl_csv_table_and_json_pages(
    store: SessionStore, cli_env: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    acme_id, globex_id = _seed(store)

    lines = _run(capsys, "events", "-o", "jsonl", "--session", acme_id, "--role", "user")
    users = [orjson.loads(line) for line in lines.splitlines()]
    assert [(u["role"], u["payload"]["message"]["content"]) for u in users] == [
        ("user", "task 0"),
        ("user", "task 1"),
    ]

    rows = list(
        csv.DictReader(io.StringIO(_run(capsys, "events", "-o", "csv", "--type", "message")))
    )
    assert len(rows) == 12 and {r["tenant_id"] for r in rows} == {"acme", "globex"}
    assert orjson.loads(rows[0]["payload"])["message"]["role"] == "user"

    first = orjson.loads(_run(capsys, "events", "--json", "--limit", "5"))
    assert len(first["items"]) == 5 and first["next_cursor"] == str(first["items"][-1]["position"])
    rest = orjson.loads(
        _run(capsys, "events", "--json", "--limit", "100", "--after-position", first["next_cursor"])
    )
    assert rest["next_cursor"] is None
    assert len(first["items"]) + len(rest["items"]) == 12

    main(["events", "--tenant", "globex", "--limit", "2"])
    captured = capsys.readouterr()
    assert globex_id[:8] in captured.out and acme_id[:8] not in captured.out
    assert "more: --after-position" in captured.err

    window = _run(capsys, "events", "-o", "jsonl", "--since", "2000-01-01", "--until", "2001-01-01")
    assert window == ""


def test_csv_cells_never_run_as_formulas(
    store: SessionStore, cli_env: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hostile producer's ``type`` or ``role`` that a spreadsheet would run (``=``, ``+``,
    ``-``, ``@``, tab, CR first) is a text cell in ``-o csv``; the payload column is exact."""
    session = store.create_session(tenant_id="acme").id
    hostile = ['=HYPERLINK("http://x","y")', "+1+1", "-2", "@SUM(A1)", "\t=1", "\r=1"]
    plain_ones = ["ok=1", "a\rb", "a\nb", 'say "hi"']
    store.append(
        session,
        [{"type": t, "message": {"role": t, "content": "x"}} for t in hostile + plain_ones],
    )
    rows = list(csv.DictReader(io.StringIO(_run(capsys, "events", "-o", "csv"), newline="")))
    assert [r["type"] for r in rows] == ["'" + t for t in hostile] + plain_ones
    assert [orjson.loads(r["payload"])["type"] for r in rows] == hostile + plain_ones
    assert all(not r[c].startswith(("=", "+", "-", "@")) for r in rows for c in r)


def test_events_rejects_a_bad_date(cli_env: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    # typer's own (vendored) click errors reach main() un-handled today; accept both shapes
    with pytest.raises((SystemExit, typer.BadParameter)) as raised:
        main(["events", "--since", "yesterday-ish"])
    if isinstance(raised.value, SystemExit):
        assert raised.value.code == 2
        assert "not an ISO 8601" in capsys.readouterr().err
    else:
        assert "not an ISO 8601" in str(raised.value)


@pytest.mark.parametrize(
    "gone", ["deleted", "moved to another tenant", "followed by its external id"]
)
def test_following_a_session_that_is_gone_ends_with_not_found(
    store: SessionStore, settings: Settings, gone: str
) -> None:
    """events --follow --session went on in silence after the session was deleted (and a
    session made again under its external id is another, never shown), or moved out of the
    tenant given: it now prints what came before, then stops with the one line and exit 4
    that events --session gives then. Followed by its external id, the line names it so
    (it named the internal id alone)."""
    acme_id, _ = _seed(store)
    ref = acme_id
    if gone == "followed by its external id":
        acme_id = store.create_session(tenant_id="acme", external_id="agent-7").id
        ref = "agent-7"
    proc = _follower(settings, "--session", ref, "--tenant", "acme")
    try:
        store.append(acme_id, [{"type": "tick", "i": 1}])
        assert proc.stdout is not None
        assert orjson.loads(proc.stdout.readline())["payload"] == {"type": "tick", "i": 1}
        if gone != "moved to another tenant":
            store.delete_session(acme_id)
        else:
            store.move(acme_id, tenant_id="globex")
            store.append(acme_id, [{"type": "tick", "i": 2}])
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 4, err
    shown = acme_id if ref == acme_id else f"{ref} ({acme_id})"
    assert out == "" and err.splitlines() == [f"error: session not found: {shown}"], err


@pytest.mark.parametrize("value", ["1e300", "inf", "3601"])
def test_events_follow_refuses_a_poll_interval_it_cannot_sleep(
    cli_env: Settings, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """A usage error (exit 2) where time.sleep raised OverflowError (a traceback)."""
    with pytest.raises(SystemExit) as raised:
        main(["events", "--follow", "--poll-interval", value, "--timeout", "1"])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and "--poll-interval" in err and "Traceback" not in err


def test_stats_and_state_human_and_json(
    store: SessionStore, cli_env: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    acme_id, _ = _seed(store)
    text = _run(capsys, "stats")
    assert "Events per type" in text and "blob dedup ratio" in text

    state: dict[str, Any] = orjson.loads(_run(capsys, "state", acme_id, "--json"))
    assert state["seq"] == 8 and len(state["messages"]) == 8
    # --messages limits the JSON's messages too (it was ignored): the last N, as in the table
    last = orjson.loads(_run(capsys, "state", acme_id, "--json", "--messages", "3"))
    assert last["messages"] == state["messages"][-3:]
    assert (
        orjson.loads(_run(capsys, "state", acme_id, "--json", "--messages", "0"))["messages"] == []
    )
    assert {k: v for k, v in last.items() if k != "messages"} == {
        k: v for k, v in state.items() if k != "messages"
    }
    assert [t["name"] for t in state["tool_calls"]] == ["bash", "bash"]
    earlier = orjson.loads(_run(capsys, "state", acme_id, "--json", "--at-seq", "2"))
    assert earlier["seq"] == 2 and earlier["leaf_id"] == earlier["branch"][-1]
    assert "Last messages" in _run(capsys, "state", acme_id)

    with pytest.raises(SystemExit):
        main(["state", acme_id, "--tenant", "globex"])
    assert "session not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("provider", "model", "shown"),
    [("anthropic", "m1", "anthropic/m1"), (None, "m1", "m1"), ("anthropic", None, "anthropic")],
)
def test_state_names_the_model_as_the_session_does(
    store: SessionStore,
    cli_env: Settings,
    capsys: pytest.CaptureFixture[str],
    provider: str | None,
    model: str | None,
    shown: str,
) -> None:
    """A message naming a model and no provider (or the reverse) is shown as what it names
    (a review's finding: ``None/m1``)."""
    session = store.create_session(tenant_id="acme")
    message: dict[str, Any] = {"role": "assistant", "content": [], "timestamp": 1}
    message.update({k: v for k, v in (("provider", provider), ("model", model)) if v})
    store.append(
        session.id, [{"type": "message", "id": "a1", "parentId": None, "message": message}]
    )
    [row] = [line for line in _run(capsys, "state", session.id).splitlines() if " model " in line]
    assert [cell.strip() for cell in row.split("│") if cell.strip()] == ["model", shown], row


def test_out_of_range_values_exit_3_with_one_line(
    store: SessionStore, cli_env: Settings, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    acme_id, _ = _seed(store)  # a head of 8
    naive_cursor = base64.urlsafe_b64encode(b"2024-01-01T00:00:00|x").decode()
    for argv in (
        # past the option's own bound (a position is a BIGINT): a usage error, as -1 is
        ["events", "--after-position", str(2**63), "--json"],
        ["events", "--follow", "--after-position", str(2**63), "--timeout", "1"],
    ):
        with pytest.raises(SystemExit) as raised:
            main(argv)
        err = capsys.readouterr().err
        assert raised.value.code == 2, (argv, err)
        assert err.startswith("error: ") and "--after-position" in err and err.count("\n") == 1
    for argv in (
        ["sessions", "list", "--cursor", naive_cursor, "--json"],
        ["export", acme_id, "--at-seq", "9", "-o", str(tmp_path / "x.jsonl")],
        ["sessions", "fork", acme_id, "--at-seq", "9", "--inline"],
        ["state", acme_id, "--at-seq", "9", "--json"],  # shown at the head before
    ):
        with pytest.raises(SystemExit) as raised:
            main(argv)
        err = capsys.readouterr().err
        assert raised.value.code == 3, (argv, err)
        last = err.splitlines()[-1]  # --follow says where it starts first
        assert last.startswith("error: ") and "Traceback" not in err, (argv, err)
    for bound in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"):
        for argv in (["stats", "--since", bound], ["events", "--recorded-until", bound]):
            _run(capsys, *argv, "--json")  # the ends of time, no OverflowError
