"""Claude Code transcripts through the importer, on both backends: the session, its state,
its stats (tokens and models per day), images in blobs, and re-imports of a growing file."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from core.blobs.store import parse_ref
from core.errors import ImportConflict
from core.interop import importer
from core.query.stats import TokenTotals
from core.store import SessionStore

FIXTURE = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "claude_code"
    / "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60.jsonl"
)
SESSION_ID = "7d3c5e2a-91f4-4b6e-8a0d-2c1f9e8b7a60"
TENANT = "acme"


def test_import_makes_a_named_session_found_by_its_claude_id(store: SessionStore) -> None:
    result = store.import_session(FIXTURE, tenant_id=TENANT, format="claude-code")
    assert (result.status, result.appended, result.format) == ("created", 21, "claude-code")
    session = store.resolve_session(SESSION_ID, tenant_id=TENANT)
    assert session.id == result.session_id and session.external_id == SESSION_ID
    assert session.title == "Fix the leap-year bug in parse_date"
    assert session.cwd == "/home/dev/dateparse"
    header = store.read(session.id, upto_seq=1)[0].payload
    assert header["type"] == "session" and header["id"] == SESSION_ID


def test_state_after_the_compaction(store: SessionStore) -> None:
    result = store.import_session(FIXTURE, tenant_id=TENANT)  # auto-detected
    assert result.format == "claude-code"
    state = store.state(result.session_id)
    assert [m.role for m in state.messages] == [
        "compactionSummary",
        "user",
        "assistant",
        "toolResult",
        "assistant",
    ]
    assert state.compaction is not None and state.compaction.tokens_before == 18250
    assert state.info.model is not None
    assert state.info.model.model_id == "claude-opus-4-5-20251101"
    (call,) = state.tool_calls
    assert (call.name, call.is_error) == ("Write", True)
    before = store.state(result.session_id, at_seq=15)  # a5, before the compaction
    assert before.messages[0].role == "user" and before.compaction is None
    assert before.info.model is not None
    assert before.info.model.model_id == "claude-sonnet-4-5-20250929"


def test_stats_tokens_and_models_per_day(store: SessionStore) -> None:
    store.import_session(FIXTURE, tenant_id=TENANT)
    stats = store.stats(tenant_id=TENANT)
    rows = {(u.day, u.model): u for u in stats.usage_by_day}
    assert sorted(rows) == [
        ("2026-01-20", "claude-haiku-4-5-20251001"),
        ("2026-01-20", "claude-sonnet-4-5-20250929"),
        ("2026-01-21", "claude-opus-4-5-20251101"),
    ]
    sonnet = rows["2026-01-20", "claude-sonnet-4-5-20250929"]
    # msg_01A is three lines with output 3, 12, 40: one response of 40 output tokens
    assert sonnet.responses == 3
    assert sonnet.tokens == TokenTotals(20, 95, 750, 70, 935, 0)
    opus = rows["2026-01-21", "claude-opus-4-5-20251101"]
    assert (opus.responses, opus.tokens) == (2, TokenTotals(17, 78, 900, 900, 1895, 0))
    assert rows["2026-01-20", "claude-haiku-4-5-20251001"].responses == 2  # the sidechain
    assert (stats.tokens.input, stats.tokens.output) == (677, 208)
    first = stats.to_dict()["usage_by_day"][0]
    assert (first["day"], first["responses"], first["output"]) == ("2026-01-20", 2, 35)


def test_the_image_is_a_blob_with_the_original_bytes(store: SessionStore) -> None:
    result = store.import_session(FIXTURE, tenant_id=TENANT)
    stored = store.read(result.session_id, after_seq=3, upto_seq=4)[0]
    ref = stored.payload["message"]["content"][1]["data"]
    blob_hash = parse_ref(ref)
    assert blob_hash is not None
    original = FIXTURE.read_text().split('"data":"')[1].split('"')[0]
    assert store.blobs.get(blob_hash) == base64.b64decode(original)
    exact = store.read(result.session_id, after_seq=3, upto_seq=4, rehydrate=True)[0]
    assert exact.payload["message"]["content"][1]["data"] == original


def test_reimport_appends_nothing_then_only_what_the_file_grew(
    store: SessionStore, tmp_path: Path
) -> None:
    data = FIXTURE.read_bytes()
    lines = data.split(b"\n")
    path = tmp_path / FIXTURE.name
    # up to the compact boundary: it waits for its summary line
    path.write_bytes(b"\n".join(lines[:16]) + b"\n")
    first = store.import_session(path, tenant_id=TENANT)
    assert (first.appended, first.incomplete_tail) == (16, True)  # header + 15 entries
    with path.open("ab") as out:
        out.write(lines[16] + b"\n" + lines[17][:40])  # the summary, half of the next line
    second = store.import_session(path, tenant_id=TENANT)
    assert (second.appended, second.incomplete_tail) == (1, True)  # the compaction
    path.write_bytes(data)
    third = store.import_session(path, tenant_id=TENANT)
    assert (third.appended, third.skipped) == (4, 17)
    again = store.import_session(path, tenant_id=TENANT)
    assert (again.status, again.appended) == ("unchanged", 0)
    whole = store.import_session(FIXTURE, tenant_id="other")
    theirs = [e.payload for e in store.read(whole.session_id)]
    assert [e.payload for e in store.read(first.session_id)] == theirs


def test_a_title_that_comes_after_the_first_pass_is_the_sessions(
    store: SessionStore, tmp_path: Path
) -> None:
    """A file followed as it is written gets its title later (``/rename`` writes a
    ``custom-title`` line): the session takes the last one, as a single pass would (it
    kept the title of the pass that created it, none)."""
    lines = FIXTURE.read_bytes().split(b"\n")
    path = tmp_path / FIXTURE.name
    path.write_bytes(b"\n".join(lines[1:6]) + b"\n")  # without the summary line
    first = store.import_session(path, tenant_id=TENANT)
    assert store.get_session(first.session_id).title is None
    renamed = {"type": "custom-title", "customTitle": "Leap years", "sessionId": SESSION_ID}
    with path.open("ab") as out:
        out.write(json.dumps(renamed).encode() + b"\n" + b"\n".join(lines[6:]))
    store.import_session(path, tenant_id=TENANT)
    assert store.get_session(first.session_id).title == "Leap years"


@pytest.mark.parametrize("first_lines", [1, 2], ids=["summary", "summary+snapshot"])
def test_a_working_directory_that_comes_after_the_first_pass_is_the_sessions(
    store: SessionStore, tmp_path: Path, first_lines: int
) -> None:
    """A file's first lines (a summary, a file-history snapshot) carry no cwd: a first pass
    that read only them left the session without one for good (state, sessions list). The
    cwd a later pass finds is now the session's, as one pass's is. The header stays as the
    first pass stored it: the session's export goes back into it as the same lines."""
    lines = FIXTURE.read_bytes().split(b"\n")
    path = tmp_path / FIXTURE.name
    path.write_bytes(b"\n".join(lines[:first_lines]) + b"\n")
    first = store.import_session(path, tenant_id=TENANT)
    assert store.get_session(first.session_id).cwd is None
    path.write_bytes(FIXTURE.read_bytes())
    store.import_session(path, tenant_id=TENANT)
    whole = store.import_session(FIXTURE, tenant_id="other")
    cwd = store.get_session(whole.session_id).cwd
    assert cwd == "/home/dev/dateparse"
    assert store.get_session(first.session_id).cwd == cwd
    assert store.state(first.session_id).info.cwd == cwd
    exported = tmp_path / "exported.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(first.session_id, out)
    assert store.import_session(exported, tenant_id=TENANT).status == "unchanged"
    assert store.import_session(path, tenant_id=TENANT).status == "unchanged"


def test_a_later_pass_leaves_a_moved_sessions_working_directory(
    store: SessionStore, tmp_path: Path
) -> None:
    """Only a session without a cwd is given the file's: one set since (``sessions move
    --cwd``) stands through the passes that follow."""
    lines = FIXTURE.read_bytes().split(b"\n")
    path = tmp_path / FIXTURE.name
    path.write_bytes(lines[0] + b"\n")
    first = store.import_session(path, tenant_id=TENANT)
    store.move(first.session_id, cwd="/moved")
    path.write_bytes(FIXTURE.read_bytes())
    assert store.import_session(path, tenant_id=TENANT).status == "appended"
    assert store.get_session(first.session_id).cwd == "/moved"


RESUMED_ID = "0b9e4f31-5c2d-4e8a-9f17-6a3b2c1d0e9f"


CHAINED_ID = "1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f"


def _earlier_and_resumed(folder: Path, *, chained: bool = False) -> tuple[Path, Path]:
    """The fixture's session, and a session resumed from it: its file begins with the
    earlier one's first lines (their sessionId the earlier session's), then one of its own.
    ``chained``: resumed from that one in turn (a line of it, then one of its own)."""
    earlier = folder / FIXTURE.name
    shutil.copyfile(FIXTURE, earlier)
    lines = FIXTURE.read_bytes().split(b"\n")[:8]
    own = [(RESUMED_ID, "And the century years?")]
    if chained:
        own.append((CHAINED_ID, "And negative years?"))
    parent = "a4-0000"
    for n, (session, text) in enumerate(own, 1):
        new = json.loads(lines[2])  # a user line: the resumed session's own, under its id
        new.update(
            uuid=f"r{n}-0000", parentUuid=parent, sessionId=session, timestamp="2026-01-21T10:00Z"
        )
        new["message"] = {"role": "user", "content": text}
        lines.append(json.dumps(new).encode())
        parent = f"r{n}-0000"
    resumed = folder / f"{own[-1][0]}.jsonl"
    resumed.write_bytes(b"\n".join(lines) + b"\n")
    return earlier, resumed


def test_a_resumed_sessions_file_is_the_session_its_name_says(
    store: SessionStore, tmp_path: Path
) -> None:
    """Claude Code writes a resumed session to a file of its own, named by the new id, that
    begins with the lines it resumes (their sessionId the earlier session's). Keyed by the
    first sessionId, it was taken for the earlier session: a conflict with that session's
    own file, whichever came second. Each is now the session its file names."""
    earlier, resumed = _earlier_and_resumed(tmp_path)
    for first, second in ((resumed, earlier), (earlier, resumed)):
        tenant = f"t-{first.stem[:4]}"
        a = store.import_session(first, tenant_id=tenant)
        b = store.import_session(second, tenant_id=tenant)
        assert a.session_id != b.session_id and {a.status, b.status} == {"created"}
        by_id = {r.external_id: r for r in (a, b)}
        assert set(by_id) == {SESSION_ID, RESUMED_ID}
        mine = store.read(by_id[RESUMED_ID].session_id, upto_seq=1)[0].payload
        assert mine["id"] == RESUMED_ID
        state = store.state(by_id[RESUMED_ID].session_id)
        assert state.messages[-1].text == "And the century years?"
        # the session it resumes is its parent (linked by whichever pass came second)
        resumed_session = store.get_session(by_id[RESUMED_ID].session_id)
        assert resumed_session.parent_id == by_id[SESSION_ID].session_id
        assert resumed_session.forked_from_seq is None  # nothing inherited
    # a copy under a name that is no session id still goes by the id inside it
    copy = tmp_path / "backup.jsonl"
    shutil.copyfile(FIXTURE, copy)
    assert store.import_session(copy, tenant_id="copies").external_id == SESSION_ID


def test_a_resumed_sessions_parent_id_with_a_nul_links_nothing(
    store: SessionStore, tmp_path: Path
) -> None:
    """The sessionId of the lines a file resumes is the parent's id: one with a U+0000 names
    no session, so the file is imported unlinked (PostgreSQL refused it whole)."""
    line = json.loads(FIXTURE.read_bytes().split(b"\n")[2])
    own = {**line, "uuid": "r1-0000", "parentUuid": line["uuid"], "sessionId": RESUMED_ID}
    resumed = tmp_path / f"{RESUMED_ID}.jsonl"
    resumed.write_text(json.dumps({**line, "sessionId": "a\x00b"}) + "\n" + json.dumps(own) + "\n")
    done = store.import_session(resumed, tenant_id=TENANT)
    assert (done.status, done.external_id) == ("created", RESUMED_ID)
    assert store.get_session(done.session_id).parent_id is None


@pytest.mark.parametrize("chained", [False, True], ids=["resumed", "resumed twice"])
def test_a_resumed_file_imported_under_the_earlier_id_goes_on_there(
    store: SessionStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chained: bool
) -> None:
    """A resumed session's file imported before the file's name keyed it (under the first
    sessionId in it) goes on in that session: not copied into a second one linked to it as
    its child. Twice resumed (A -> B -> C), its file was keyed by A too."""
    earlier, resumed = _earlier_and_resumed(tmp_path, chained=chained)
    real = importer.parse_file_data

    def keyed_the_old_way(*args: Any, **kwargs: Any) -> Any:
        parsed = real(*args, **kwargs)
        old = dataclasses.replace(parsed.header, external_id=SESSION_ID, parent_id=None)
        return dataclasses.replace(parsed, header=old)

    monkeypatch.setattr(importer, "parse_file_data", keyed_the_old_way)
    before = store.import_session(resumed, tenant_id=TENANT)
    monkeypatch.setattr(importer, "parse_file_data", real)
    last = json.loads(resumed.read_bytes().splitlines()[-1])
    more = {**last, "uuid": "r9-0000", "parentUuid": last["uuid"]}
    resumed.write_bytes(resumed.read_bytes() + json.dumps(more).encode() + b"\n")
    again = store.import_session(resumed, tenant_id=TENANT)
    assert (again.session_id, again.external_id) == (before.session_id, SESSION_ID)
    assert (again.status, again.appended) == ("appended", 1)
    assert [s.id for s in store.list_sessions(tenant_id=TENANT).items] == [before.session_id]
    assert store.get_session(before.session_id).parent_id is None
    with pytest.raises(ImportConflict):  # what the old keying left: delete, import again
        store.import_session(earlier, tenant_id=TENANT)


@pytest.mark.parametrize("sub", ["agent-4a1f.jsonl"])
def test_a_subagent_file_is_its_own_session(store: SessionStore, tmp_path: Path, sub: str) -> None:
    main = tmp_path / FIXTURE.name
    shutil.copyfile(FIXTURE, main)
    side = b"\n".join(FIXTURE.read_bytes().split(b"\n")[8:12]) + b"\n"
    (tmp_path / sub).write_bytes(side)
    a = store.import_session(main, tenant_id=TENANT)
    b = store.import_session(tmp_path / sub, tenant_id=TENANT)
    assert a.session_id != b.session_id
    assert b.external_id == f"{SESSION_ID}/agent-4a1f"
    assert store.state(b.session_id).messages[-1].text.startswith("Two callers")


def test_a_subagent_file_whose_name_is_not_utf8(store: SessionStore, tmp_path: Path) -> None:
    """The file's name goes into the session's external id as its escaped text
    (``path_text``): a lone surrogate there would be refused."""
    side = b"\n".join(FIXTURE.read_bytes().split(b"\n")[8:12]) + b"\n"
    sub = tmp_path / os.fsdecode(b"agent-4a\xff.jsonl")
    sub.write_bytes(side)
    done = store.import_session(sub, tenant_id=TENANT)
    assert done.external_id == f"{SESSION_ID}/agent-4a\\xff"
    assert (
        store.resolve_session(f"{SESSION_ID}/agent-4a\\xff", tenant_id=TENANT).id == done.session_id
    )
    assert store.import_session(sub, tenant_id=TENANT).status == "unchanged"


def test_a_file_keyed_by_its_name_before_any_line_named_a_session_goes_on_there(
    store: SessionStore, tmp_path: Path
) -> None:
    """A copy not named by a session id whose first pass saw no sessionId (only a summary
    line) was keyed by its name; once a line naming a session is written to it, the next
    pass goes on in that session. Fails before: it made a second session, keyed by the id,
    holding the summary line again."""
    path = tmp_path / "copy.jsonl"
    summary = {"type": "summary", "summary": "A title", "leafUuid": "u0"}
    path.write_bytes(json.dumps(summary).encode() + b"\n")
    first = store.import_session(path, tenant_id=TENANT)
    assert (first.status, first.external_id) == ("created", "copy")
    line = {
        "type": "user",
        "uuid": "u1",
        "parentUuid": None,
        "sessionId": SESSION_ID,
        "cwd": "/w",
        "timestamp": "2026-01-20T09:00:01Z",
        "message": {"role": "user", "content": "hi"},
    }
    path.write_bytes(path.read_bytes() + json.dumps(line).encode() + b"\n")
    again = store.import_session(path, tenant_id=TENANT)
    assert (again.status, again.session_id, again.appended) == ("appended", first.session_id, 1)
    assert [s.id for s in store.list_sessions(tenant_id=TENANT).items] == [first.session_id]
    assert store.import_session(path, tenant_id=TENANT).status == "unchanged"
