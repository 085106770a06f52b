"""Import of pi session files: idempotent, resumable, refusing changed prefixes; export back
to a version-3 file with the same JSON values; import(export(x)) has x's state. Both backends.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from core.errors import (
    ExternalIdTaken,
    ImportConflict,
    ImportFormatError,
    InvalidEvent,
    SessionNotFound,
    WriteTooLarge,
)
from core.interop import importer, pi
from core.interop.pi import dumps_exact, loads_exact
from core.models import ImportOffsetRow, table_of
from core.settings import Settings
from core.store import SessionStore
from tests.fixtures.pi.generate import assistant, user, v1_lines, v2_lines, v3_lines, write
from tests.pi_support import FIXTURES, pi_opened

TENANT = "acme"


def _lines(path: Path) -> list[Any]:
    return [loads_exact(line) for line in path.read_bytes().splitlines() if line.strip()]


def _exact(a: Any, b: Any, *, ordered: bool = True) -> bool:
    """Equal JSON values with the same number types and signs of zero, and (``ordered``)
    the same key order."""
    if isinstance(a, dict) and isinstance(b, dict):
        same_keys = list(a) == list(b) if ordered else sorted(a) == sorted(b)
        return same_keys and all(_exact(a[k], b[k], ordered=ordered) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(
            _exact(x, y, ordered=ordered) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


def _as_js(value: Any) -> Any:
    """A value as JavaScript writes it back: 0.0 is 0, 2.0 is 2 (one number type)."""
    if isinstance(value, dict):
        return {k: _as_js(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_js(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _export(store: SessionStore, session: str, **kw: Any) -> list[Any]:
    out = io.StringIO()
    store.export_session(session, out, **kw)
    return [loads_exact(line) for line in out.getvalue().splitlines()]


def _grow(path: Path, lines: list[dict[str, Any]], count: int) -> None:
    parent = lines[-1]["id"]
    with path.open("a", encoding="utf-8") as out:
        for n in range(count):
            entry = {
                "type": "message",
                "id": f"e{n:07x}",
                "parentId": parent,
                "timestamp": "2026-11-20T11:00:00.000Z",
                "message": user(100 + n, f"more {n}") if n % 2 else assistant(100 + n, f"a {n}"),
            }
            out.write(dumps_exact(entry) + "\n")
            parent = entry["id"]


def _offset(store: SessionStore, session_id: str) -> Any:
    offsets = table_of(ImportOffsetRow)
    with store.engine.connect() as conn:
        return conn.execute(select(offsets).where(offsets.c.session_id == session_id)).first()


# idempotent and resumable ---------------------------------------------------------------


def test_reimport_twice_appends_nothing(store: SessionStore, tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    write(path, v3_lines())
    first = store.import_session(path, tenant_id=TENANT)
    assert (first.status, first.appended, first.skipped) == ("created", len(v3_lines()), 0)
    again = store.import_session(path, tenant_id=TENANT)
    assert (again.status, again.appended, again.skipped) == ("unchanged", 0, len(v3_lines()))
    assert again.session_id == first.session_id
    assert store.get_session(first.session_id).head_seq == len(v3_lines())


def test_a_fork_imported_through_its_parents_path_is_a_session_of_its_own(
    store: SessionStore, tmp_path: Path
) -> None:
    """One path used for the parent's file, then for a fork of it (its header names the
    parent's file): the fork is its own session, linked to the parent; never taken for the
    session that path was imported into (a Claude Code file's earlier key is no pi rule)."""
    path = tmp_path / "session.jsonl"
    lines = v3_lines()
    write(path, lines)
    parent = store.import_session(path, tenant_id=TENANT)
    header = {**lines[0], "id": "fork-1", "parentSession": f"/x/2026-11-20_{lines[0]['id']}.jsonl"}
    write(path, [header, *lines[1:4]])
    fork = store.import_session(path, tenant_id=TENANT)
    assert (fork.status, fork.external_id) == ("created", "fork-1")
    assert store.get_session(fork.session_id).parent_id == parent.session_id


def test_a_parent_named_with_a_nul_links_nothing_and_refuses_nothing(
    store: SessionStore, tmp_path: Path
) -> None:
    """A header's parent with a U+0000 names no session (none can hold one): the file is
    imported, unlinked, its header kept as written. PostgreSQL refused the import whole
    (the offset row could not hold it) where SQLite stored it."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    header = {**lines[0], "parentSession": f"/x/2026-11-20_{lines[0]['id']}\x00.jsonl"}
    write(path, [header, *lines[1:]])
    done = store.import_session(path, tenant_id=TENANT)
    assert done.status == "created" and store.get_session(done.session_id).parent_id is None
    assert store.read(done.session_id, upto_seq=1, rehydrate=True)[0].payload == header


def test_grown_file_appends_only_the_new_entries(store: SessionStore, tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    first = store.import_session(path, tenant_id=TENANT)
    _grow(path, lines, 10)
    grown = store.import_session(path, tenant_id=TENANT)
    assert (grown.status, grown.appended, grown.skipped) == ("appended", 10, len(lines))
    events = store.read(first.session_id, rehydrate=True)
    assert [e.payload for e in events] == _lines(path)


def _imported_then_labelled(
    store: SessionStore, tmp_path: Path
) -> tuple[Path, list[dict[str, Any]], importer.ImportResult, dict[str, Any]]:
    """The v3 file imported, then an event appended to its session directly."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    first = store.import_session(path, tenant_id=TENANT)
    label = {"type": "label", "id": "L1", "parentId": lines[-1]["id"], "label": "mine"}
    store.append(first.session_id, [label])
    return path, lines, first, label


def test_grown_file_after_a_direct_append_appends_every_new_entry(
    store: SessionStore, tmp_path: Path
) -> None:
    """An event appended to an imported session directly is not one of the file's: a later
    pass appends all the file's new entries after it (it once skipped one per such event)."""
    path, lines, first, label = _imported_then_labelled(store, tmp_path)
    _grow(path, lines, 3)
    grown = store.import_session(path, tenant_id=TENANT)
    assert (grown.status, grown.appended, grown.skipped) == ("appended", 3, len(lines))
    payloads = [e.payload for e in store.read(first.session_id, rehydrate=True)]
    file_events = _lines(path)
    assert payloads == [*file_events[: len(lines)], label, *file_events[len(lines) :]]
    # the bytes changing (another copy of the file) still finds every imported entry
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(v) + "\n" for v in file_events))
    again = store.import_session(other, tenant_id=TENANT)
    assert (again.status, again.appended) == ("unchanged", 0)
    assert store.get_session(first.session_id).head_seq == len(file_events) + 1


def test_edited_prefix_is_a_conflict_and_writes_nothing(
    store: SessionStore, tmp_path: Path
) -> None:
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    first = store.import_session(path, tenant_id=TENANT)
    before = _offset(store, first.session_id)
    lines[4]["message"]["content"] = "edited"  # line 5 of the file
    write(path, lines)
    _grow(path, lines, 3)
    with pytest.raises(ImportConflict) as caught:
        store.import_session(path, tenant_id=TENANT)
    assert caught.value.line == 5 and caught.value.path == str(path)
    assert store.get_session(first.session_id).head_seq == len(lines)
    assert _offset(store, first.session_id) == before


@pytest.mark.parametrize(
    ("was", "now"),
    [(1, True), (0, False), (0.0, -0.0), (1, 1.0), (2**70, float(2**70)), ({"a": 1}, {"a": 1.0})],
)
def test_a_value_changed_to_one_python_calls_equal_is_a_conflict(
    store: SessionStore, tmp_path: Path, was: Any, now: Any
) -> None:
    """Python's == says 1 == True == 1.0 and 0.0 == -0.0; as JSON they are other values."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    custom = {"type": "custom", "id": "c1", "parentId": lines[-1]["id"], "customType": "x"}
    lines.append({**custom, "data": {"v": was, "keep": "same"}})
    write(path, lines)
    store.import_session(path, tenant_id=TENANT)
    lines[-1] = {**custom, "data": {"keep": "same", "v": now}}  # key order is no change
    write(path, lines)
    _grow(path, lines, 1)
    with pytest.raises(ImportConflict) as caught:
        store.import_session(path, tenant_id=TENANT)
    assert caught.value.line == len(lines)
    lines[-1] = {**custom, "data": {"keep": "same", "v": was}}
    write(path, lines)
    assert store.import_session(path, tenant_id=TENANT).appended == 0


def test_renamed_ids_are_a_conflict(store: SessionStore, tmp_path: Path) -> None:
    """Only pi's own rewrite of an imported version-1 file may change entry ids (to ids of
    its own for the ones the import derived): a version-3 file's ids renamed one to one,
    the tree unchanged, is a changed file."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    store.import_session(path, tenant_id=TENANT)
    renamed = {e["id"]: f"r{n}" for n, e in enumerate(lines[1:])}
    links = ("id", "parentId", "firstKeptEntryId", "targetId", "fromId")
    write(
        path,
        [
            lines[0],
            *({k: renamed.get(v, v) if k in links else v for k, v in e.items()} for e in lines[1:]),
        ],
    )
    with pytest.raises(ImportConflict) as caught:
        store.import_session(path, tenant_id=TENANT)
    assert caught.value.line == 2


@pytest.mark.parametrize("first", ["live", "backup"])
def test_an_older_copy_is_unchanged_in_either_order(
    store: SessionStore, tmp_path: Path, first: str
) -> None:
    """A copy taken before the file grew (a backup) holds no event the session lacks: it
    is unchanged, imported before or after the file it was copied from."""
    lines = v3_lines()
    files = {"live": tmp_path / "live" / "s.jsonl", "backup": tmp_path / "backup" / "s.jsonl"}
    for name, cut in (("live", len(lines)), ("backup", len(lines) - 4)):
        files[name].parent.mkdir()
        write(files[name], lines[:cut])
    store.import_session(files[first], tenant_id=TENANT)
    then = store.import_session(files["live" if first == "backup" else "backup"], tenant_id=TENANT)
    expected = ("appended", 4) if first == "backup" else ("unchanged", 0)
    assert (then.status, then.appended) == expected
    assert [e.payload for e in store.read(then.session_id, rehydrate=True)] == lines
    assert importer.imported_path(store, then.session_id) == str(files["live"].resolve())


def test_a_file_cut_back_is_unchanged_and_what_it_then_holds_else_a_conflict(
    store: SessionStore, tmp_path: Path
) -> None:
    """The file followed, cut back to fewer entries (restored from a backup): nothing of it
    is new, and the offset stays where it was; an entry written after that is not the one
    imported there is a changed imported part, named by its line."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    first = store.import_session(path, tenant_id=TENANT)
    before = _offset(store, first.session_id)
    write(path, lines[:-2])
    again = store.import_session(path, tenant_id=TENANT)
    assert (again.status, again.appended, again.skipped) == ("unchanged", 0, len(lines) - 2)
    assert _offset(store, first.session_id) == before
    other = {**lines[-2], "id": "other1"}
    write(path, [*lines[:-2], other])
    with pytest.raises(ImportConflict) as caught:
        store.import_session(path, tenant_id=TENANT)
    assert caught.value.line == len(lines) - 1


def test_a_bad_entry_fails_the_pass_before_anything_is_written(
    settings: Settings, tmp_path: Path
) -> None:
    """Every event is checked first: a bad one in a later batch names its file line and
    leaves no session (nor, on a re-import, any new event) behind."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    # a key with U+0000: no database text holds one (a type the journal does not take is
    # kept, wrapped: pi keeps the line)
    bad = {"type": "custom", "id": "bad1", "parentId": lines[-1]["id"], "k\x00": 1}
    write(path, [*lines, bad])
    with SessionStore.from_settings(settings.model_copy(update={"max_batch_events": 5})) as store:
        with pytest.raises(InvalidEvent) as caught:
            store.import_session(path, tenant_id=TENANT)
        assert caught.value.field == "/k\x00"
        assert f"{path} line {len(lines) + 1}:" in caught.value.message
        assert store.journal.find_external(TENANT, lines[0]["id"]) is None
        write(path, lines)
        first = store.import_session(path, tenant_id=TENANT)
        before = _offset(store, first.session_id)
        _grow(path, lines, 7)
        with path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(bad) + "\n")
        with pytest.raises(InvalidEvent):
            store.import_session(path, tenant_id=TENANT)
        assert store.get_session(first.session_id).head_seq == len(lines)
        assert _offset(store, first.session_id) == before


def test_half_written_last_line_waits_for_its_end(store: SessionStore, tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    lines = v3_lines()
    write(path, lines)
    extra = {
        "type": "message",
        "id": "f0000001",
        "parentId": lines[-1]["id"],
        "timestamp": "2026-11-20T12:00:00.000Z",
        "message": user(200, "half"),
    }
    text = dumps_exact(extra)
    with path.open("a", encoding="utf-8") as out:
        out.write(text[:20])
    first = store.import_session(path, tenant_id=TENANT)
    assert first.incomplete_tail and first.appended == len(lines)
    with path.open("a", encoding="utf-8") as out:
        out.write(text[20:] + "\n")
    done = store.import_session(path, tenant_id=TENANT)
    assert (done.appended, done.incomplete_tail) == (1, False)
    assert store.read(first.session_id, after_seq=len(lines))[0].payload == extra


def test_reserialized_file_with_same_values_resumes(store: SessionStore, tmp_path: Path) -> None:
    """Another file of the same session (an export, pretty-printed keys) is not a conflict."""
    path = tmp_path / "s.jsonl"
    write(path, v3_lines())
    first = store.import_session(path, tenant_id=TENANT)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(v) + "\n" for v in v3_lines()))
    again = store.import_session(other, tenant_id=TENANT)
    assert (again.session_id, again.appended) == (first.session_id, 0)


def test_not_a_session_file(store: SessionStore, tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"type": "message"}\n')
    with pytest.raises(ImportFormatError):
        store.import_session(path, tenant_id=TENANT)


def test_refused_entry_is_named_by_its_file_line(settings: Settings, tmp_path: Path) -> None:
    """A key holding U+0000 is refused by the journal (no database text holds one, and a key
    cannot become a blob); the error names the file's line and field, not the event's index
    in its batch, also after a resumed pass and across batches."""
    path = tmp_path / "s.jsonl"
    lines = v3_lines()[:5]
    write(path, lines)
    with SessionStore.from_settings(settings.model_copy(update={"max_batch_events": 2})) as store:
        first = store.import_session(path, tenant_id=TENANT)
        _grow(path, lines, 2)  # file lines 6, 7
        with path.open("a", encoding="utf-8") as out:  # lines 8, 9
            out.write('{"type":"custom","id":"x","parentId":null,"data":{"a\\u0000":1}}\n')
            out.write('{"type":"custom","id":"y","parentId":"x","data":"fine"}\n')
        with pytest.raises(InvalidEvent, match=rf"{path} line 8: .*U\+0000") as refused:
            store.import_session(path, tenant_id=TENANT)
        assert refused.value.field == "/data/a\x00"
        # the pass is checked whole before it writes: lines 6 and 7 are not in either
        assert store.get_session(first.session_id).head_seq == 5


# pi fidelity ------------------------------------------------------------------------------


def test_header_fields_external_id_and_images(store: SessionStore) -> None:
    result = store.import_session(FIXTURES / "v3.jsonl", tenant_id=TENANT)
    session = store.get_session(result.session_id)
    assert (session.external_id, session.cwd) == ("0f3c2a10-v3", "/home/dev/project")
    assert store.resolve_session("0f3c2a10-v3", tenant_id=TENANT).id == session.id
    with pytest.raises(SessionNotFound):
        store.resolve_session("0f3c2a10-v3", tenant_id="other")
    header = store.read(session.id, upto_seq=1)[0].payload
    assert header["timestamp"] == "2026-11-20T10:00:00.000Z"
    raw = json.dumps([e.payload for e in store.read(session.id)])
    assert "blob:sha256:" in raw  # the image went to the blob store
    types = {e.type for e in store.read(session.id)}
    assert types >= {
        "message",
        "model_change",
        "thinking_level_change",
        "compaction",
        "branch_summary",
        "custom",
        "custom_message",
        "label",
        "session_info",
    }


def test_external_id_unique_per_tenant(store: SessionStore) -> None:
    store.create_session(tenant_id=TENANT, external_id="x1")
    with pytest.raises(ExternalIdTaken):
        store.create_session(tenant_id=TENANT, external_id="x1")
    store.create_session(tenant_id="other", external_id="x1")


def test_named_empty_session_is_adopted_by_import(store: SessionStore) -> None:
    named = store.create_session(tenant_id=TENANT, external_id="0f3c2a10-v2")
    result = store.import_session(FIXTURES / "v2.jsonl", tenant_id=TENANT)
    assert result.session_id == named.id and result.status == "created"


def test_an_import_checks_each_event_once(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass is checked whole before anything is written, and the appends take the
    checked events: no event is checked twice (it was, ~10% of an import's time)."""
    from core.journal import validation

    calls: list[object] = []
    real = validation.check_usage  # what every check_event runs, whoever holds its name

    def counting(event: object, **kwargs: Any) -> None:
        calls.append(event)
        real(event, **kwargs)

    monkeypatch.setattr(validation, "check_usage", counting)
    result = store.import_session(FIXTURES / "v2.jsonl", tenant_id=TENANT)
    assert result.appended == len(calls) == len({id(e) for e in calls}) > 1
    with pytest.raises(WriteTooLarge):  # checked events still keep the batch limit
        store.append(
            result.session_id,
            validation.checked([{"type": "x"}] * 1001, max_depth=10),
        )


def test_a_named_session_is_adopted_once(store: SessionStore) -> None:
    """Of two imports adopting one named session at once, one adopts it (its row stands)
    and the other does not (on PostgreSQL both said they had: rowcount -1 is true)."""
    named = store.create_session(tenant_id=TENANT, external_id="0f3c2a10-v2")
    path = FIXTURES / "v2.jsonl"
    parsed = pi.parse(path, path.read_bytes())
    assert importer._adopt(store, named.id, path, parsed) is True
    assert importer._adopt(store, named.id, path, parsed) is False


@pytest.mark.parametrize("parent_first", [True, False])
@pytest.mark.parametrize("moved", [False, True])
def test_parent_session_becomes_a_fork_link(
    store: SessionStore, tmp_path: Path, parent_first: bool, moved: bool
) -> None:
    """One pass over each file links the child, whichever is imported first; by the parent
    file's path, or (the file moved since) by the session id its name ends with."""
    parent_path = tmp_path / "2026-11-20T10-00-00-000Z_0f3c2a10-v3.jsonl"
    write(parent_path, v3_lines())
    named = tmp_path / "elsewhere" / parent_path.name if moved else parent_path
    child = v3_lines()[:6]
    child[0] = {**child[0], "id": "child-1", "parentSession": str(named)}
    child_path = tmp_path / "child.jsonl"
    write(child_path, child)
    order = [parent_path, child_path] if parent_first else [child_path, parent_path]
    parent, imported = (store.import_session(p, tenant_id=TENANT) for p in order)
    if not parent_first:
        parent, imported = imported, parent
    session = store.get_session(imported.session_id)
    assert session.parent_id == parent.session_id and session.forked_from_seq is None
    assert store.get_session(parent.session_id).parent_id is None


@pytest.mark.parametrize("name", ["work.jsonl", "2026-11-20T10-00-00-000Z_old-1.jsonl"])
def test_a_path_used_again_links_a_fork_to_the_session_it_names(
    store: SessionStore, tmp_path: Path, name: str
) -> None:
    """A path imported for one session, then used for another (the old file removed: pi
    --session PATH, or pi restarting a file it could not read): a fork naming the path is
    linked to the one whose id the file name ends with, else to the one it holds now (it
    was whichever row the database gave first)."""
    path = tmp_path / name
    lines = v3_lines()
    write(path, [{**lines[0], "id": "old-1"}, *lines[1:4]])
    old = store.import_session(path, tenant_id=TENANT)
    path.unlink()
    write(path, [{**lines[0], "id": "new-1"}, *lines[1:4]])
    new = store.import_session(path, tenant_id=TENANT)
    child_path = tmp_path / "child.jsonl"
    write(child_path, [{**lines[0], "id": "child-1", "parentSession": str(path)}, *lines[1:3]])
    child = store.import_session(child_path, tenant_id=TENANT)
    expected = old if name.endswith("_old-1.jsonl") else new
    assert store.get_session(child.session_id).parent_id == expected.session_id


def test_a_file_name_that_is_not_utf8_is_imported(store: SessionStore, tmp_path: Path) -> None:
    """A name with a byte that is not UTF-8 (``os.fsdecode`` keeps it as a lone surrogate,
    which no database stores) is recorded as its escaped text, imports again as unchanged,
    and a fork that names it links to it. pi (node) reads such a byte as U+FFFD, so the
    fork's ``parentSession`` cannot match the path: the link is the id the name ends with."""
    folder = tmp_path / os.fsdecode(b"dir\xfe")
    folder.mkdir()
    parent_path = folder / os.fsdecode(b"2026-11-20T10-00-00-000Z\xff_0f3c2a10-v3.jsonl")
    write(parent_path, v3_lines())
    child = v3_lines()[:6]
    as_pi_names_it = str(parent_path).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    child[0] = {**child[0], "id": "child-1", "parentSession": as_pi_names_it}
    child_path = folder / os.fsdecode(b"child\x80.jsonl")
    write(child_path, child)

    imported = store.import_session(child_path, tenant_id=TENANT)
    parent = store.import_session(parent_path, tenant_id=TENANT)
    assert (parent.status, parent.appended) == ("created", len(v3_lines()))
    stored = _offset(store, parent.session_id).path
    assert (
        stored == f"{tmp_path.resolve()}/dir\\xfe/2026-11-20T10-00-00-000Z\\xff_0f3c2a10-v3.jsonl"
    )
    assert _offset(store, imported.session_id).parent_path.endswith("\ufffd_0f3c2a10-v3.jsonl")
    assert store.import_session(parent_path, tenant_id=TENANT).status == "unchanged"
    assert store.get_session(imported.session_id).parent_id == parent.session_id


def test_a_parent_session_holding_a_lone_surrogate_is_imported(
    store: SessionStore, tmp_path: Path
) -> None:
    """A ``parentSession`` with a lone surrogate (a JSON escape, which pi reads) is imported
    (it was an InvalidEvent that failed the file): the header is kept as its text and
    exported byte for byte, and the parent is linked by the id its file name ends with."""
    parent_lines = v3_lines()
    parent_lines[0] = {**parent_lines[0], "id": "x"}
    parent_path = tmp_path / "parent.jsonl"
    write(parent_path, parent_lines)
    lines = v3_lines()
    lines[0] = {**lines[0], "id": "child-1", "parentSession": "/p/s\udcff_x.jsonl"}
    path = tmp_path / "s.jsonl"
    path.write_text("".join(dumps_exact(line) + "\n" for line in lines), encoding="utf-8")
    imported = store.import_session(path, tenant_id=TENANT)
    assert (imported.status, imported.appended) == ("created", len(lines))
    assert store.read(imported.session_id)[0].type == pi.ESCAPED_LINE
    parent = store.import_session(parent_path, tenant_id=TENANT)
    assert store.get_session(imported.session_id).parent_id == parent.session_id
    out = io.StringIO()
    store.export_session(imported.session_id, out)
    assert out.getvalue().encode() == path.read_bytes()
    assert store.import_session(path, tenant_id=TENANT).status == "unchanged"


# export -------------------------------------------------------------------------------------


def _export_v3_pairs(store: SessionStore) -> list[tuple[Any, Any]]:
    """(exported line, input line) of the v3 fixture, imported then exported."""
    path = FIXTURES / "v3.jsonl"
    result = store.import_session(path, tenant_id=TENANT)
    exported, source = _export(store, result.session_id), _lines(path)
    assert len(exported) == len(source)
    return list(zip(exported, source, strict=True))


def test_export_of_v3_has_the_input_values(store: SessionStore) -> None:
    """Equal values line by line on both backends (exactness: the next test)."""
    for number, (ours, theirs) in enumerate(_export_v3_pairs(store), start=1):
        assert ours == theirs, f"line {number}"


def test_export_of_v3_is_exact(store: SessionStore) -> None:
    """Same key order, number types and -0.0."""
    for number, (ours, theirs) in enumerate(_export_v3_pairs(store), start=1):
        assert _exact(ours, theirs), f"line {number}"


def test_export_of_v3_keeps_huge_integers(store: SessionStore, tmp_path: Path) -> None:
    lines = v3_lines()
    lines[8]["data"]["huge"] = 12345678901234567890123
    path = tmp_path / "huge.jsonl"
    write(path, lines)
    assert _lines(path)[8]["data"]["huge"] == 12345678901234567890123  # read exactly
    result = store.import_session(path, tenant_id=TENANT)
    assert _exact(_export(store, result.session_id)[8], _lines(path)[8])


@pytest.mark.parametrize("make", [v1_lines, v2_lines], ids=["v1", "v2"])
def test_export_of_v1_v2_is_pis_migration(store: SessionStore, tmp_path: Path, make: Any) -> None:
    from tests.pi_support import pi_context

    path = tmp_path / "old.jsonl"
    write(path, make())
    result = store.import_session(path, tenant_id=TENANT)
    exported = _export(store, result.session_id)
    oracle = pi_context(path)
    migrated = [oracle["header"], *oracle["entries"]]
    # pi draws v1 ids at random: compare with the ids mapped position by position
    ids = {
        theirs.get("id"): ours.get("id")
        for ours, theirs in zip(exported[1:], migrated[1:], strict=True)
    }
    mapped = json.loads(
        json.dumps(migrated),
        object_hook=lambda d: {
            k: ids.get(v, v) if k in ("id", "parentId", "firstKeptEntryId") else v
            for k, v in d.items()
        },
    )
    assert len(exported) == len(mapped)
    for number, (ours, theirs) in enumerate(zip(exported, mapped, strict=True), start=1):
        assert _exact(_as_js(ours), theirs), f"line {number}"


def test_a_later_session_line_does_not_change_the_header_state_reports(
    store: SessionStore, tmp_path: Path
) -> None:
    """pi's header is the first ``session`` line (``getHeader``); a later one, kept as a
    line of the file, changes neither the cwd, the header's id nor its parent session
    (state took each from the latest session line that had it)."""
    lines = v3_lines()
    lines.insert(4, {**lines[0], "id": "other", "cwd": "/elsewhere", "parentSession": "/p.jsonl"})
    path = tmp_path / "two-headers.jsonl"
    write(path, lines)
    session_id = store.import_session(path, tenant_id=TENANT).session_id
    assert session_id is not None
    for state in (store.state(session_id), store.state(session_id, at_seq=8)):
        info = state.info
        assert (info.cwd, info.header_session_id) == (lines[0]["cwd"], lines[0]["id"])
        assert info.parent_session == lines[0].get("parentSession")


def test_a_session_line_after_seq_1_is_no_header_for_state_or_export(
    store: SessionStore,
) -> None:
    """A session appended to directly: a message at seq 1, then a ``session`` line. Export
    builds the header from the session row, and pi takes that one; state agrees (it took the
    later line's cwd, id and parent session)."""
    session = store.create_session(tenant_id=TENANT, cwd="/row/cwd")
    store.append(
        session.id,
        [
            {"type": "message", "id": "m1", "parentId": None, "message": {"role": "user"}},
            {"type": "session", "version": 3, "id": "LATER", "cwd": "/later", "parentSession": "p"},
        ],
    )
    info = store.state(session.id).info
    assert (info.cwd, info.header_session_id, info.parent_session) == ("/row/cwd", None, None)
    assert _export(store, session.id)[0]["cwd"] == info.cwd


def test_a_later_session_line_is_exported_where_it_was(
    store: SessionStore, tmp_path: Path, backend: str
) -> None:
    """pi keeps a second ``session`` line in its file (an entry of ``fileEntries``; its header
    is the first), so the export writes it back in place instead of dropping it."""
    lines = v3_lines()
    lines.insert(4, {**lines[0], "id": "other", "cwd": "/elsewhere"})
    path = tmp_path / "two-headers.jsonl"
    write(path, lines)
    result = store.import_session(path, tenant_id=TENANT)
    assert _export(store, result.session_id) == _lines(path)
    out = io.StringIO()
    store.export_session(result.session_id, out)
    if backend == "sqlite":  # jsonb does not keep key order
        assert out.getvalue().encode() == path.read_bytes()


def test_export_at_seq(store: SessionStore) -> None:
    result = store.import_session(FIXTURES / "v3.jsonl", tenant_id=TENANT)
    assert len(_export(store, result.session_id, at_seq=5)) == 5


def test_import_of_export_has_the_same_state(store: SessionStore, tmp_path: Path) -> None:
    for name in ("v1.jsonl", "v2.jsonl", "v3.jsonl"):
        result = store.import_session(FIXTURES / name, tenant_id=TENANT)
        out = tmp_path / name
        with out.open("w", encoding="utf-8") as f:
            store.export_session(result.session_id, f)
        again = store.import_session(out, tenant_id="other")
        a = store.state(result.session_id, rehydrate=True)
        b = store.state(again.session_id, rehydrate=True)
        assert [m.to_dict() for m in a.messages] == [m.to_dict() for m in b.messages]
        assert (a.info.model, a.info.thinking_level, a.leaf_id, a.labels) == (
            b.info.model,
            b.info.thinking_level,
            b.leaf_id,
            b.labels,
        )


def test_an_export_holding_direct_appends_adds_nothing_and_the_file_goes_on(
    store: SessionStore, tmp_path: Path
) -> None:
    """The export of an imported session holds what was appended to it directly, in its
    place. Imported back into the session, it is the session already (that event was
    appended a second time), and the session still follows its own file (the export took
    its place, and the agent's next line was then a conflict)."""
    path, lines, first, label = _imported_then_labelled(store, tmp_path)
    out = tmp_path / "export.jsonl"
    with out.open("w", encoding="utf-8") as f:
        store.export_session(first.session_id, f)
    again = store.import_session(out, tenant_id=TENANT)
    assert (again.session_id, again.status, again.appended) == (first.session_id, "unchanged", 0)
    assert store.get_session(first.session_id).head_seq == len(lines) + 1
    _grow(path, lines, 2)
    grown = store.import_session(path, tenant_id=TENANT)
    assert (grown.status, grown.appended) == ("appended", 2)
    file_events = _lines(path)
    payloads = [e.payload for e in store.read(first.session_id, rehydrate=True)]
    assert payloads == [*file_events[: len(lines)], label, *file_events[len(lines) :]]


def test_the_export_of_a_fork_names_the_fork(store: SessionStore, tmp_path: Path) -> None:
    """A fork of an imported session inherits its header (seq 1): exported as it was, the
    file named the parent, and importing it continued the parent with the fork's entries.
    The fork's file names the fork, its start, and its parent's file, as pi's forks do."""
    path = tmp_path / "2026-11-20T10-00-00-000Z_parent.jsonl"
    lines = v3_lines()
    write(path, lines)
    parent = store.import_session(path, tenant_id=TENANT)
    fork = store.fork(parent.session_id)
    mine = {"type": "label", "id": "F1", "parentId": lines[-1]["id"], "label": "fork"}
    store.append(fork.id, [mine])
    out = tmp_path / "fork.jsonl"
    with out.open("w", encoding="utf-8") as f:
        store.export_session(fork.id, f)
    exported = _lines(out)
    assert exported[0] == {
        **lines[0],
        "id": fork.id,
        "timestamp": exported[0]["timestamp"],
        "parentSession": str(path.resolve()),
    }
    assert exported[0]["timestamp"] != lines[0]["timestamp"] and exported[1:] == [*lines[1:], mine]
    opened = pi_opened([out])[0]  # pi's own reader takes it as that session, whole
    assert opened["header"] == exported[0]
    assert [e["id"] for e in opened["entries"]] == [e["id"] for e in exported[1:]]
    again = store.import_session(out, tenant_id=TENANT)
    assert again.status == "created" and again.session_id not in (parent.session_id, fork.id)
    assert store.get_session(again.session_id).parent_id == parent.session_id
    assert store.get_session(parent.session_id).head_seq == len(lines)


# Each case is one file; pi opens them all in one node process (a process per case made
# these two tests ~40 s of CI's CPU), and each is named in the assertion that fails.
BOM_STARTS = {
    "bom": "\ufeff",
    "bom-newline": "\ufeff\n",
    "two-boms": "\ufeff\ufeff",
    "space-bom": " \ufeff",
    "lines-nbsp-bom": "\n\u00a0\ufeff ",
}


def test_a_byte_order_mark_is_read_where_pi_reads_one(store: SessionStore, tmp_path: Path) -> None:
    """pi drops what ``content.trim()`` drops at the start of the file (JavaScript's
    whitespace, byte order marks among it, over several lines) and skips a line that begins
    with a BOM elsewhere (``JSON.parse`` refuses it): the import took such lines, and
    refused a file whose start was anything but one BOM."""
    lines = [json.dumps(line) for line in v3_lines()[:4]]
    paths = {}
    for name, start in BOM_STARTS.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        text = start + "\n\ufeff".join(lines[:3]) + "\n" + lines[3] + "\n"
        paths[name].write_bytes(text.encode())
    theirs = dict(zip(paths, pi_opened(list(paths.values())), strict=True))
    for name, path in paths.items():
        done = store.import_session(path, tenant_id=f"{TENANT}-{name}")
        assert len(done.ignored_lines) == 2, name
        ours = [e.payload["id"] for e in store.read(done.session_id)[1:]]
        pis = [e["id"] for e in theirs[name]["entries"]]
        assert ours == pis == [v3_lines()[3]["id"]], name


TRAILING_ENDS = {
    "nbsp": "\u00a0\n",
    "line-separator": "\u2028",
    "bom": "\ufeff\n",
    "vertical-tab": "\x0b\n",
    "nbsp-no-newline": "\u00a0",
    "lines": "\n\u00a0\n \n",
    "ideographic": "\u3000",
}


def test_javascript_whitespace_at_the_end_is_dropped_as_pi_trims_it(
    store: SessionStore, tmp_path: Path
) -> None:
    """pi's ``content.trim()`` drops JavaScript's whitespace at the end of the file too:
    the last line followed by a no-break space (or U+2028, a BOM...) is read. The import
    ignored it as not JSON, or waited for ever for its newline; a header alone followed by
    one was refused as no pi file. pi itself is the oracle."""
    cases: dict[str, tuple[Path, int]] = {}
    for header_only in (False, True):
        count = 1 if header_only else 4
        lines = [json.dumps(line) for line in v3_lines()[:count]]
        for name, end in TRAILING_ENDS.items():
            case = f"{'header-only' if header_only else 'entries'}-{name}"
            path = tmp_path / f"{case}.jsonl"
            path.write_bytes(("\n".join(lines) + end).encode())
            cases[case] = (path, count)
    opened = pi_opened([path for path, _ in cases.values()])
    for (case, (path, count)), theirs in zip(cases.items(), opened, strict=True):
        done = store.import_session(path, tenant_id=f"{TENANT}-{case}")
        assert (done.ignored_lines, done.incomplete_tail) == ([], False), case
        ours = [e.payload["id"] for e in store.read(done.session_id)[1:]]
        pis = [e["id"] for e in theirs["entries"]]
        assert ours == pis == [line["id"] for line in v3_lines()[1:count]], case


def test_a_file_that_is_one_line_after_javascript_whitespace_is_read_as_pi_reads_it(
    store: SessionStore, tmp_path: Path
) -> None:
    """pi's ``content.trim()`` drops a byte order mark (or a no-break space, blank lines)
    before the file's first line. A header that was the file's only line, with no line
    break, after one was refused ("the first line is not a pi session header"): its line
    was taken for one still being written. pi itself is the oracle."""
    header = json.dumps(v3_lines()[0]).encode()
    cases = {}
    for name, lead in {
        "bom": b"\xef\xbb\xbf",
        "nbsp": "\u00a0".encode(),
        "blank": b"\n \n",
    }.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(lead + header)
        cases[name] = path
    opened = pi_opened(list(cases.values()))
    for (name, path), theirs in zip(cases.items(), opened, strict=True):
        assert theirs["header"]["id"] == v3_lines()[0]["id"], name  # pi opens it
        done = store.import_session(path, tenant_id=f"{TENANT}-lead-{name}")
        assert (done.status, done.external_id, done.incomplete_tail) == (
            "created",
            v3_lines()[0]["id"],
            False,
        ), name


def test_a_pi_session_named_with_session_info_has_that_title(
    store: SessionStore, tmp_path: Path
) -> None:
    """pi names a session with ``session_info`` entries (``/name``): the latest one's name,
    trimmed, is the session's (an empty one clears it). The import left every pi session
    untitled (sessions list, sessions show). pi itself is the oracle; a later pass that
    renames or clears the session is its title too."""
    header, *entries = v3_lines()[:4]

    def info(n: int, name: str) -> dict[str, Any]:
        return {"type": "session_info", "id": f"n{n}", "parentId": None, "name": name}

    cases = {
        "none": [],
        "one": [info(1, "  Fix the leap year\u00a0")],
        "renamed": [info(1, "first"), info(2, "second")],
        "cleared": [info(1, "first"), info(2, " \u3000")],
    }
    paths = {}
    for name, infos in cases.items():
        path = tmp_path / f"{name}.jsonl"
        lines = [{**header, "id": f"named-{name}"}, *entries, *infos]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths[name] = path
    names = [opened["name"] for opened in pi_opened(list(paths.values()))]
    assert names == [None, "Fix the leap year", "second", None]
    for (case, path), name in zip(paths.items(), names, strict=True):
        done = store.import_session(path, tenant_id=TENANT)
        assert store.get_session(done.session_id).title == name, case
        # state reads the name as pi does too (it kept "  Fix the leap year\u00a0", and
        # "first" once cleared)
        assert store.state(done.session_id).info.name == name, case
    grown = paths["one"]
    with grown.open("a") as out:
        out.write(json.dumps(info(3, "Renamed later")) + "\n")
    done = store.import_session(grown, tenant_id=TENANT)
    assert store.get_session(done.session_id).title == "Renamed later"
    with grown.open("a") as out:
        out.write(json.dumps(info(4, "")) + "\n")
    done = store.import_session(grown, tenant_id=TENANT)
    assert store.get_session(done.session_id).title is None
    # a review's cases: null clears it too (pi: name?.trim() || undefined); a name with
    # U+0000, which no row holds, leaves it (the file refused whole before)
    with grown.open("a") as out:
        out.write(json.dumps(info(5, "Named again")) + "\n")
    store.import_session(grown, tenant_id=TENANT)
    with grown.open("a") as out:
        out.write(json.dumps({**info(6, ""), "name": None}) + "\n")
    done = store.import_session(grown, tenant_id=TENANT)
    assert store.get_session(done.session_id).title is None
    assert store.state(done.session_id).info.name is None
    with grown.open("a") as out:
        out.write(json.dumps(info(7, "Kept")) + "\n" + json.dumps(info(8, "bad\0name")) + "\n")
    done = store.import_session(grown, tenant_id=TENANT)
    assert (done.appended, store.get_session(done.session_id).title) == (2, None)


def test_the_export_of_a_titled_session_made_here_names_it_as_pi_does(
    store: SessionStore, tmp_path: Path
) -> None:
    """A session made here has its title in its row alone, and its export lost it: the
    file's header holds none, and an import of the file (elsewhere) was untitled. Its file
    names it with a session_info entry (pi's own way), first, a root of its own, dated as
    the header: pi reads that name, an import takes it, and each export is the same; a
    later export (after more events) extends the earlier one, so an import of that one
    continues (a review found an entry put last conflicted with the next export). No
    entry with --at-seq 0 (the header alone), nor for a title of white space."""
    session = store.create_session(tenant_id=TENANT, title=" Leap years ", external_id="titled")
    entries = v3_lines()[1:6]
    store.append(session.id, entries[:3])

    def exported(name: str, **options: Any) -> list[dict[str, Any]]:
        out = tmp_path / name
        with out.open("w", encoding="utf-8") as f:
            store.export_session(session.id, f, **options)
        return [json.loads(line) for line in out.read_text().splitlines()]

    first = exported("first.jsonl")
    header, named, *rest = first
    assert rest == entries[:3]
    assert named == {
        "type": "session_info",
        "id": named["id"],
        "parentId": None,
        "timestamp": header["timestamp"],
        "name": "Leap years",
    }
    assert [opened["name"] for opened in pi_opened([tmp_path / "first.jsonl"])] == ["Leap years"]
    again = store.import_session(tmp_path / "first.jsonl", tenant_id="elsewhere")
    assert store.get_session(again.session_id).title == "Leap years"
    store.move(session.id, tenant_id="moved")  # its row's updated_at: nothing in the file
    assert exported("same.jsonl") == first
    store.append(session.id, entries[3:])
    later = exported("first.jsonl")  # over the file imported: pi's own file grows so
    assert later[: len(first)] == first
    grown = store.import_session(tmp_path / "first.jsonl", tenant_id="elsewhere")
    assert (grown.session_id, grown.status, grown.appended) == (again.session_id, "appended", 2)
    assert exported("header.jsonl", at_seq=0) == [header]
    blank = store.create_session(tenant_id=TENANT, title=" \u3000", external_id="blank")
    store.append(blank.id, entries[:1])
    out = tmp_path / "blank.jsonl"
    with out.open("w", encoding="utf-8") as f:
        store.export_session(blank.id, f)
    assert [json.loads(line)["type"] for line in out.read_text().splitlines()] == [
        "session",
        entries[0]["type"],
    ]
    # a titled session without an event yet has its name too (a probe found it lost)
    empty = store.create_session(tenant_id=TENANT, title="Empty", external_id="empty-titled")
    with out.open("w", encoding="utf-8") as f:
        store.export_session(empty.id, f)
    kinds = [
        (json.loads(line)["type"], json.loads(line).get("name"))
        for line in out.read_text().splitlines()
    ]
    assert kinds == [("session", None), ("session_info", "Empty")]


def test_export_of_a_session_made_here(store: SessionStore, tmp_path: Path) -> None:
    session = store.create_session(tenant_id=TENANT, cwd="/w", external_id="made-here")
    entries = v3_lines()[1:8]
    store.append(session.id, entries)
    exported = _export(store, "made-here", tenant_id=TENANT)
    assert exported[0]["type"] == "session" and exported[0]["id"] == "made-here"
    assert exported[0]["cwd"] == "/w" and exported[0]["version"] == 3
    assert exported[1:] == entries
    out = tmp_path / "made.jsonl"
    with out.open("w", encoding="utf-8") as f:
        store.export_session(session.id, f)
    again = store.import_session(out, tenant_id="other")

    def messages(session_id: str) -> list[tuple[Any, ...]]:  # seqs differ: header at seq 1
        state = store.state(session_id, rehydrate=True)
        return [(m.entry_id, m.role, m.content, m.data) for m in state.messages]

    assert messages(again.session_id) == messages(session.id)


def test_deleted_session_is_imported_again(store: SessionStore) -> None:
    first = store.import_session(FIXTURES / "v2.jsonl", tenant_id=TENANT)
    store.delete_session(first.session_id)
    again = store.import_session(FIXTURES / "v2.jsonl", tenant_id=TENANT)
    assert again.session_id != first.session_id and again.status == "created"
    assert _offset(store, first.session_id) is None


def test_an_id_with_a_lone_surrogate_is_never_another_ids_key(
    store: SessionStore, tmp_path: Path
) -> None:
    """pi ids ``"p" + U+D800`` (a JSON escape) and ``"p\\ud800"`` (a backslash, then "ud800")
    are two sessions, and a child whose parent is the first is not linked to the second:
    the escape that stores the first (no database holds a lone surrogate) spelled the
    second, so the second file imported was refused as the first one changed, and the child
    was linked to an unrelated session."""
    literal, surrogate = v3_lines(), v3_lines()
    literal[0] = {**literal[0], "id": "p\\ud800"}
    surrogate[0] = {**surrogate[0], "id": "p\ud800"}
    child = v3_lines()
    child[0] = {**child[0], "id": "child", "parentSession": "/gone/2026_p\ud800.jsonl"}
    for name, lines in (("literal", literal), ("surrogate", surrogate), ("child", child)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(dumps_exact(line) + "\n" for line in lines), encoding="utf-8"
        )
    first = store.import_session(tmp_path / "literal.jsonl", tenant_id=TENANT)
    kid = store.import_session(tmp_path / "child.jsonl", tenant_id=TENANT)
    second = store.import_session(tmp_path / "surrogate.jsonl", tenant_id=TENANT)
    assert (first.status, second.status) == ("created", "created")
    assert first.session_id != second.session_id and first.external_id == "p\\ud800"
    assert store.get_session(kid.session_id).parent_id == second.session_id
    # each found by its id as stored, the literal one by its text
    assert store.resolve_session(second.external_id, tenant_id=TENANT).id == second.session_id
    assert store.resolve_session("p\\ud800", tenant_id=TENANT).id == first.session_id
    again = store.import_session(tmp_path / "surrogate.jsonl", tenant_id=TENANT)
    assert (again.status, again.session_id) == ("unchanged", second.session_id)


@pytest.mark.parametrize("spelled", ["plain", "escaped"])
def test_an_image_whose_data_reads_as_a_blob_ref_comes_back_as_written(
    store: SessionStore, tmp_path: Path, spelled: str
) -> None:
    """pi writes an image's base64 as its data; a pi file whose image data reads
    ``blob:sha256:<hex>`` holds that text, which the journal would take for a ref to a
    stored blob (a file holding a ref is detected as oh-my-pi's, which resolves its refs
    from its blobs directory: this is the pi format named). Fails before: one naming a
    blob of another session of the tenant was served as that blob's image."""
    image = base64.b64encode(bytes(range(256)) * 8).decode()
    other = store.create_session(tenant_id=TENANT)
    store.append(other.id, [{"type": "custom", "content": [{"type": "image", "data": image}]}])
    stored = "blob:sha256:" + hashlib.sha256(base64.b64decode(image)).hexdigest()
    absent = "blob:sha256:" + "f" * 64
    lines = v3_lines()
    content = [{"type": "image", "data": ref, "mimeType": "image/png"} for ref in (stored, absent)]
    message = {"role": "user", "content": content, "timestamp": 1}
    odd = {"type": "message", "id": "img1", "parentId": lines[-1]["id"], "message": message}
    odd["timestamp"] = lines[-1]["timestamp"]
    path = tmp_path / "s.jsonl"
    write(path, [*lines, odd])
    if spelled == "escaped":  # the same text, spelled with a JSON escape
        path.write_bytes(path.read_bytes().replace(b"blob:sha256:", b"blob\\u003asha256:"))
    # named: a file holding a ref is taken for oh-my-pi's, whose refs name its blob files
    result = store.import_session(path, tenant_id=TENANT, format="pi")
    assert (result.status, result.appended) == ("created", len(lines) + 1)
    last = pi.line_value(store.read(result.session_id, rehydrate=True)[-1].payload)
    assert last == odd
    out = io.StringIO()
    store.export_session(result.session_id, out)
    assert out.getvalue().splitlines()[-1] == pi.line_text(odd)
    assert image not in out.getvalue()
    again = tmp_path / "again.jsonl"
    again.write_text(out.getvalue(), encoding="utf-8")
    assert store.import_session(again, tenant_id=TENANT, format="pi").status == "unchanged"


# What a version-1 file's migration copies from one line into another: the compaction's
# ``firstKeptEntryId`` is its kept entry's own ``id``, which a file may give any JSON value.
_COPIED_IDS = {
    "ref": {"content": [{"type": "image", "data": "blob:sha256:" + "f" * 64}]},
    "surrogate": "\ud83d",
    "transient": {"partialJson": "kept"},
}


@pytest.mark.parametrize("held", sorted(_COPIED_IDS))
def test_a_value_a_migration_copies_to_another_line_is_kept_there(
    store: SessionStore, tmp_path: Path, held: str
) -> None:
    """A version-1 compaction takes its kept entry's ``id`` (a later line's own): a lone
    surrogate, an image whose data reads as a blob ref, or (in a line exported from Claude
    Code) a key the journal drops, found on the kept entry's line, ends up on the
    compaction's line, whose own bytes hold none of them. Fails before (a review's
    finding): the surrogate refused the file, the ref failed the import after creating its
    session (or named a stored blob), the key was dropped."""
    lines = v1_lines()
    compaction = next(i for i, line in enumerate(lines) if line["type"] == "compaction")
    kept = compaction + 1  # a later line: its own id is not replaced yet when pi copies it
    lines[kept] = {**lines[kept], "id": _COPIED_IDS[held]}
    lines[compaction] = {**lines[compaction], "firstKeptEntryIndex": kept}
    if held == "transient":
        lines[compaction][pi.CLAUDE_CODE_KEY] = {}
    path = tmp_path / "s.jsonl"  # JSON escapes: a lone surrogate has no UTF-8
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="ascii")
    migrated = [json.loads(json.dumps(line)) for line in lines]
    assert pi.migrate(migrated)
    assert migrated[compaction]["firstKeptEntryId"] == _COPIED_IDS[held]
    result = store.import_session(path, tenant_id=TENANT, format="pi")
    assert result.status == "created"
    events = store.read(result.session_id, rehydrate=True)
    assert [pi.line_value(e.payload) for e in events[1:]] == migrated[1:]


def test_a_header_holding_an_image_whose_data_reads_as_a_blob_ref_keeps_it(
    store: SessionStore, tmp_path: Path
) -> None:
    """The header is kept as its line is (the event at seq 1): an image in it whose data
    reads ``blob:sha256:<hex>`` is that text, not a ref to a blob of the store (a review
    asked: the journal takes no ref in a header)."""
    lines = v3_lines()
    image = {"type": "image", "data": "blob:sha256:" + "f" * 64, "mimeType": "image/png"}
    lines[0] = {**lines[0], "icon": image}
    path = tmp_path / "s.jsonl"
    write(path, lines)
    result = store.import_session(path, tenant_id=TENANT, format="pi")
    assert result.status == "created"
    events = store.read(result.session_id, rehydrate=True)
    assert pi.line_value(events[0].payload) == lines[0]
