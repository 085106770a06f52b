"""``state`` equals pi's own ``buildSessionContext`` on every pi fixture, at the leaf and at
a sample of entries, on both backends: the message list, the model and the thinking level."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from core.blobs.rehydrate import loaded
from core.errors import ImportConflict, ImportFormatError
from core.interop import pi
from core.interop.importer import parse_file
from core.settings import Settings
from core.store import SessionStore
from tests.fixtures.pi.generate import FIXTURES as GENERATORS
from tests.fixtures.pi.generate import big_tool_output
from tests.pi_support import (
    FIXTURES,
    as_json,
    our_context,
    pi_append,
    pi_context,
    pi_contexts,
    pi_opened,
)

TENANT = "acme"


def _compare(store: SessionStore, path: Path, *, every: int = 1) -> int:
    result = store.import_session(path, tenant_id=TENANT)
    entries = store.read(result.session_id)[1:]  # seq 1 is the header
    sample = list(range(0, len(entries), every))
    oracle = pi_context(path, sample)
    assert len(oracle["entries"]) == len(entries)
    leaf = store.state(result.session_id, rehydrate=True)
    assert as_json(our_context(leaf)) == oracle["leaf"]
    for index in sample:
        state = store.state(result.session_id, at_seq=index + 2, rehydrate=True)
        assert state.leaf_id == entries[index].payload["id"]
        assert as_json(our_context(state)) == oracle["at"][str(index)], f"at entry {index}"
    return len(sample)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_state_equals_pi_context_on_fixture(store: SessionStore, name: str) -> None:
    assert _compare(store, FIXTURES / name) > 5


def test_state_equals_pi_context_with_multi_megabyte_tool_output(
    store: SessionStore, tmp_path: Path
) -> None:
    path = big_tool_output(tmp_path / "big.jsonl", megabytes=3)
    assert path.stat().st_size > 3_000_000
    _compare(store, path)


def test_compaction_keeps_the_model_and_v1_index(store: SessionStore) -> None:
    """The two bugs of issue 17: the model after a compaction, and v1 compactions."""
    result = store.import_session(FIXTURES / "v1.jsonl", tenant_id=TENANT)
    state = store.state(result.session_id)
    assert state.compaction is not None and state.compaction.first_kept_entry_id
    assert state.info.model is not None and state.info.model.model_id == "claude-3-7-sonnet"
    assert state.messages[0].role == "compactionSummary"


def test_round_trip_with_pi(store: SessionStore, tmp_path: Path) -> None:
    """Export; pi opens the file with the same context; pi appends a message through its
    own API; re-import appends exactly that entry, and the contexts still agree."""
    result = store.import_session(FIXTURES / "v3.jsonl", tenant_id=TENANT)
    exported = tmp_path / "exported.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(result.session_id, out)
    ours = store.state(result.session_id, rehydrate=True)
    assert pi_context(exported)["leaf"] == as_json(our_context(ours))

    message = {"role": "user", "content": "Appended by pi.", "timestamp": 1795000099000}
    entry_id = pi_append(exported, message)
    again = store.import_session(exported, tenant_id=TENANT)
    assert (again.session_id, again.appended) == (result.session_id, 1)
    last = store.read(result.session_id, after_seq=ours.seq)
    assert [e.payload["id"] for e in last] == [entry_id]
    assert last[0].payload["message"] == message
    after = store.state(result.session_id, rehydrate=True)
    assert pi_context(exported)["leaf"] == as_json(our_context(after))


@pytest.mark.parametrize("name", ["v1.jsonl", "v2.jsonl"])
def test_older_file_continued_in_pi(store: SessionStore, tmp_path: Path, name: str) -> None:
    """An imported version-1 or -2 file that the user continues in pi: pi migrates it in
    place when it opens it (new random ids for a v1 file's entries, every line written again
    by JSON.stringify) and appends. Each later pass appends only what pi added, hung on the
    imported entries (a branch from an older entry too); state and export are what pi
    loads. An honest change of an imported entry is still a conflict."""
    path = tmp_path / "s.jsonl"
    shutil.copy(FIXTURES / name, path)
    first = store.import_session(path, tenant_id=TENANT)
    pi_append(path, {"role": "user", "content": "continued in pi", "timestamp": 1795000099000})
    # a branch from an older entry, as pi writes one: its parentId is pi's id of that entry
    older = pi_opened([path])[0]["entries"][2]
    branch = {
        "type": "message",
        "id": "b0000001",
        "parentId": older["id"],
        "timestamp": "2026-11-20T11:00:00.000Z",
        "message": {"role": "user", "content": "branched", "timestamp": 1795000100000},
    }
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(branch) + "\n")
    again = store.import_session(path, tenant_id=TENANT)
    assert (again.session_id, again.status, again.appended) == (first.session_id, "appended", 2)
    pi_append(path, {"role": "user", "content": "after the branch", "timestamp": 1795000101000})
    third = store.import_session(path, tenant_id=TENANT)
    assert (third.status, third.appended) == ("appended", 1)
    assert store.import_session(path, tenant_id=TENANT).status == "unchanged"

    oracle = pi_context(path)
    ours = [e.payload for e in store.read(first.session_id)[1:]]
    assert _by_index(ours) == _by_index(oracle["entries"])  # 0.0 == 0: pi wrote 0
    state = store.state(first.session_id, rehydrate=True)
    assert as_json(our_context(state)) == oracle["leaf"]
    exported = tmp_path / "exported.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(first.session_id, out)
    assert pi_context(exported)["leaf"] == oracle["leaf"]

    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    edited = json.loads(lines[2])
    edited["message"]["content"] = "edited"
    lines[2] = json.dumps(edited) + "\n"
    path.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(ImportConflict) as caught:
        store.import_session(path, tenant_id=TENANT)
    assert caught.value.line == 3


# Header versions pi reads as 3 (nothing migrated), as 2 (hookMessage renamed), as 1 (ids
# replaced, the tree made a chain) or as NaN (nothing migrated): JavaScript's
# ``(version ?? 1) >= 3`` on each kind of JSON value.
HEADER_VERSIONS = [
    "3.0", '"3"', '" 3\\n"', '"0x3"', "[3]", '[["3"]]', "2.5", '"2"', "true", "null", "-1",
    '"abc"', "{}", '{"valueOf":3}', "[1,2]", '""', "[]", '"Infinity"', '"1e0"', '"0b11"',
]  # fmt: skip
_ENTRIES = [
    {"type": "message", "id": "a1", "parentId": None, "message": {"role": "user", "content": "q"}},
    {"type": "message", "id": "a2", "parentId": "a1", "message": {"role": "hookMessage"}},
    {"type": "message", "id": "b2", "parentId": "a1", "message": {"role": "user", "content": "b"}},
]


def _by_index(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries with each id replaced by its entry's index (pi draws v1 ids at random)."""
    index = {e["id"]: i for i, e in enumerate(entries)}
    links = ("id", "parentId", "firstKeptEntryId")
    return [{k: index.get(v, v) if k in links else v for k, v in e.items()} for e in entries]


def test_header_version_migrates_as_pi(tmp_path: Path) -> None:
    paths = []
    for n, version in enumerate(HEADER_VERSIONS):
        path = tmp_path / f"{n}.jsonl"
        header = f'{{"type":"session","version":{version},"id":"s","timestamp":"2025-01-01Z"}}'
        path.write_text("\n".join([header, *map(json.dumps, _ENTRIES)]) + "\n")
        paths.append(path)
    kept = [e["id"] for e in _ENTRIES]
    for version, path, oracle in zip(HEADER_VERSIONS, paths, pi_opened(paths), strict=True):
        parsed = pi.parse(path, path.read_bytes())
        ours = as_json([e.entry for e in parsed.entries])
        assert as_json(parsed.header.raw) == oracle["header"], version
        same_ids = [e["id"] for e in oracle["entries"]] == kept
        assert ([e["id"] for e in ours] == kept) == same_ids, version
        assert _by_index(ours) == _by_index(oracle["entries"]), version


def test_header_version_pi_cannot_compare_is_refused(tmp_path: Path) -> None:
    """pi's ``version >= 3`` throws on an object with its own ``toString`` (pi cannot open
    the file): a typed error naming the file, not a guess."""
    path = tmp_path / "v.jsonl"
    path.write_text('{"type":"session","version":{"toString":1},"id":"s"}\n')
    with pytest.raises(ImportFormatError, match="version is not comparable"):
        pi.parse(path, path.read_bytes())


def test_invalid_utf8_is_read_as_pi_reads_it(store: SessionStore, tmp_path: Path) -> None:
    """pi (Node's UTF-8 decoder) keeps a line with invalid bytes, each maximal invalid
    subsequence read as U+FFFD: the import keeps the same entries, with the same text, and
    says how many lines were read so."""
    bad = [b"caf\xe9!", b"\xed\xa0\x80", b"\xf0\x9f\x98", b"\xc0\xaf\xe2\x82x", b"\xff"]
    path = tmp_path / "bad.jsonl"
    lines = [b'{"type":"session","version":3,"id":"s-bad","timestamp":"2025-01-01Z","cwd":"/"}']
    parent = "null"
    for n, raw in enumerate(bad):
        lines.append(
            b'{"type":"message","id":"m%d","parentId":%s,"message":{"role":"user","content":"%s"}}'
            % (n, parent.encode(), raw)
        )
        parent = f'"m{n}"'
    lines.append(b'{"type":"label","id":"k","parentId":"m4","targetId":"m0","label":"\xe9\xe9"}')
    path.write_bytes(b"\n".join(lines) + b"\n")

    result = store.import_session(path, tenant_id=TENANT)
    assert result.invalid_utf8_lines == len(bad) + 1
    oracle = pi_opened([path])[0]
    assert [e.payload for e in store.read(result.session_id)[1:]] == oracle["entries"]
    leaf = store.state(result.session_id, rehydrate=True)
    assert as_json(our_context(leaf)) == pi_context(path)["leaf"]


def test_v1_index_of_a_later_line_is_dropped_as_pi_drops_it(tmp_path: Path) -> None:
    """pi sets ``firstKeptEntryId`` to the target's id, which a later line does not have yet
    (undefined: no key is written); an earlier target, or a later line with its own id,
    gives one."""
    path = tmp_path / "v1.jsonl"
    lines = [
        {"type": "session", "id": "v1fwd", "timestamp": "2026-11-20T10:00:00.000Z", "cwd": "/w"},
        {"type": "message", "timestamp": "t", "message": {"role": "user", "content": "one"}},
        {"type": "compaction", "timestamp": "t", "summary": "S", "firstKeptEntryIndex": 3},
        {"type": "message", "timestamp": "t", "message": {"role": "user", "content": "two"}},
        {"type": "compaction", "timestamp": "t", "summary": "T", "firstKeptEntryIndex": 5},
        {"type": "label", "id": "own", "timestamp": "t"},
        {"type": "compaction", "timestamp": "t", "summary": "U", "firstKeptEntryIndex": 1},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ours = [e.entry for e in pi.parse(path, path.read_bytes()).entries]
    [oracle] = pi_opened([path])
    assert as_json(_by_index(ours)) == _by_index(oracle["entries"])
    assert "firstKeptEntryId" not in ours[1]


def test_a_file_starting_with_a_blank_line_is_detected_and_read_as_pi(tmp_path: Path) -> None:
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\n" + (FIXTURES / "v3.jsonl").read_bytes())
    parsed = parse_file(path)  # auto-detected
    [oracle] = pi_opened([path])
    assert as_json(parsed.header.raw) == oracle["header"]
    ids = [(e.entry["id"], e.entry["parentId"]) for e in parsed.entries]
    assert ids == [(e["id"], e["parentId"]) for e in oracle["entries"]]


# Lines pi links by id, whatever their order; lines the journal holds only wrapped ----------


def _line(entry: dict[str, Any]) -> str:
    return pi.dumps_exact(entry)  # as JSON.stringify writes it: export gives it back as is


def _message(entry_id: str, parent: Any, text: str, role: str = "user") -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "message", "id": entry_id}
    if parent is not ...:
        entry["parentId"] = parent
    entry["timestamp"] = "2026-11-20T10:00:01.000Z"
    entry["message"] = {"role": role, "content": text, "timestamp": 1795000000000}
    if role == "assistant":
        entry["message"].update(provider="anthropic", model=f"model-{text}")
    return entry


_LINKED_HEADER = {
    "type": "session",
    "version": 3,
    "id": "s-links",
    "timestamp": "2026-11-20T10:00:00.000Z",
    "cwd": "/w",
}
# every way pi links a line: a parent later in the file (over several lines), no parentId,
# null, empty, a parent that never comes, lines without a string type (or an empty one) and
# of unknown types (with and without a parent), a compaction keeping a late-linked entry
_LINKED = [
    _message("a", None, "root"),
    _message("d", "c", "four", "assistant"),
    {"id": "u1", "parentId": "d", "note": "no type"},
    _message("c", "b", "three"),
    _message("lone", ..., "no parentId"),
    _message("b", "a", "two", "assistant"),
    {"type": "model_change", "id": "mc", "parentId": "u1", "provider": "x", "modelId": "y"},
    _message("e", "", "empty parent"),
    _message("f", "zzz", "never comes"),
    {"type": 7, "id": "u2", "parentId": "mc"},
    {"type": "future_kind", "id": "k", "data": 1},
    _message("g", "u2", "after odd lines", "assistant"),
    {
        "type": "compaction",
        "id": "cp",
        "parentId": "g",
        "timestamp": "2026-11-20T10:00:02.000Z",
        "summary": "S",
        "firstKeptEntryId": "c",
        "tokensBefore": 5,
    },
    _message("h", "cp", "after the compaction"),
    {"type": "", "id": "u3", "parentId": "h"},  # a type the journal does not take
    {"no": "type", "at": "the end", "parentId": "u3"},
]


def _write(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.write_text("".join(_line(e) + "\n" for e in [_LINKED_HEADER, *entries]))
    return path


def test_entries_link_as_pi_links_them_at_every_prefix(store: SessionStore, tmp_path: Path) -> None:
    """The state at each seq is what pi builds from the file as it was then (pi opening
    the file cut after that line): every line an entry, each with pi's parent, pi's branch
    and pi's context."""
    result = store.import_session(_write(tmp_path / "s.jsonl", _LINKED), tenant_id=TENANT)
    assert (result.appended, result.ignored_lines) == (len(_LINKED) + 1, [])
    ends = range(1, len(_LINKED) + 1)
    oracles = pi_contexts([_write(tmp_path / f"{end}.jsonl", _LINKED[:end]) for end in ends])
    for end, oracle in zip(ends, oracles, strict=True):
        state = store.state(result.session_id, at_seq=end + 1, rehydrate=True)
        assert len(oracle["entries"]) == len(state.tree) == end
        by_id = {e.get("id"): e for e in oracle["entries"]}
        for entry in oracle["entries"]:
            if "id" in entry:
                parent = entry.get("parentId")
                expected = parent if parent and parent in by_id else None
                assert state.tree.parent_id(entry["id"]) == expected, (end, entry["id"])
        if "id" in oracle["entries"][-1]:
            assert state.branch == oracle["branch"], end
        else:  # pi's leaf id is then undefined: getBranch() is empty, but its context is
            # built from the last entry (``buildSessionContext``'s fallback), as ours is
            assert oracle["branch"] == [] and state.branch[-1] == f"seq:{end + 1}"
        assert as_json(our_context(state)) == oracle["leaf"], end


def test_lines_kept_wrapped_are_exported_as_they_were(store: SessionStore, tmp_path: Path) -> None:
    """A line without a string type is kept (pi keeps it) and exported as it was; pi reads
    the export as it read the file; a second pass finds the file unchanged."""
    path = _write(tmp_path / "s.jsonl", _LINKED)
    result = store.import_session(path, tenant_id=TENANT)
    kept = [e.payload for e in store.read(result.session_id)]
    assert kept[3] == {"type": pi.UNTYPED_LINE, "line": _LINKED[2]}
    exported = tmp_path / "exported.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(result.session_id, out)
    assert exported.read_bytes() == path.read_bytes()
    assert store.import_session(path, tenant_id=TENANT).status == "unchanged"


def test_a_lone_surrogate_is_kept_and_exported_exactly(store: SessionStore, tmp_path: Path) -> None:
    """pi reads a line holding a lone surrogate (JSON.stringify writes one for a string cut
    inside an emoji); no database text holds one. The line is kept escaped (``ESCAPED_LINE``:
    the string as its pieces), in pi's tree by its id and parentId; the rest of the file is
    imported; the export gives the line back byte for byte, and pi reads the export as it
    read the file."""
    entries = [
        _message("a", None, "before"),
        _message("b", "a", "cut \ud83d"),
        {"type": "custom", "id": "c", "parentId": "b", "data": {"\udc00key": ["\udfff", 1]}},
        _message("d", "c", "after"),
    ]
    path = _write(tmp_path / "s.jsonl", entries)
    assert b"\\ud83d" in path.read_bytes()
    result = store.import_session(path, tenant_id=TENANT)
    assert result.appended == len(entries) + 1
    stored = [e.payload for e in store.read(result.session_id)]
    message = {**entries[1]["message"], "content": {pi.ESCAPED_STRING: ["cut ", 0xD83D]}}
    assert stored[2] == {
        "type": pi.ESCAPED_LINE,
        "id": "b",
        "parentId": "a",
        "value": {**entries[1], "message": message},
    }
    state = store.state(result.session_id, rehydrate=True)
    assert state.branch == pi_context(path)["branch"] == ["a", "b", "c", "d"]
    exported = tmp_path / "exported.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(result.session_id, out)
    assert exported.read_bytes() == path.read_bytes()
    original, again = pi_opened([path, exported])
    assert again == original
    assert store.import_session(path, tenant_id=TENANT).status == "unchanged"


_CUT = "\ud83d"  # half an emoji: JSON.stringify writes a string cut inside one so
_T = "2026-11-20T10:00:02.000Z"


def _surrogate_lines(big: int) -> list[dict[str, Any]]:
    """A line of every kind pi's context reads, each holding a lone surrogate; one of them
    (a tool result) with a string over the inline limit, so that it is stored as a blob."""
    call = {"type": "toolCall", "id": f"call{_CUT}", "name": "bash", "arguments": {"c": _CUT}}
    result = {"type": "text", "text": "x" * big + _CUT}
    return [
        _message("a", None, "before"),
        _message("b", "a", f"cut {_CUT}", "assistant"),  # its model holds one too
        {"type": "session_info", "id": "n", "parentId": "b", "name": f"name {_CUT}"},
        {"type": "label", "id": "l", "parentId": "n", "targetId": "a", "label": f"l {_CUT}"},
        {"type": "thinking_level_change", "id": "t", "parentId": "l", "thinkingLevel": _CUT},
        {"type": "custom_message", "id": "cm", "parentId": "t", "customType": f"x{_CUT}",
         "content": f"cm {_CUT}", "display": True, "timestamp": _T},
        {"type": "branch_summary", "id": "bs", "parentId": "cm", "fromId": "a",
         "summary": f"bs {_CUT}", "timestamp": _T},
        {"type": "message", "id": "c", "parentId": "bs", "timestamp": _T,
         "message": {"role": "assistant", "content": [call], "provider": "p", "model": "m"}},
        {"type": "message", "id": "r", "parentId": "c", "timestamp": _T,
         "message": {"role": "toolResult", "toolCallId": call["id"], "toolName": "bash",
                     "content": [result], "isError": False}},
        {"type": "compaction", "id": "cp", "parentId": "r", "timestamp": _T,
         "summary": f"S {_CUT}", "firstKeptEntryId": "b", "tokensBefore": 5},
        _message("d", "cp", "after"),
    ]  # fmt: skip


def _agrees_with_pi_at_every_entry(
    store: SessionStore, session_id: str, path: Path, count: int
) -> dict[str, Any]:
    """The state at each of the file's ``count`` entries is pi's context there, read twice
    (the second time from the snapshots the first wrote); pi's answer."""
    oracle = pi_context(path, list(range(count)))
    for read in range(2):
        for index in range(count):
            state = store.state(session_id, at_seq=index + 2, rehydrate=True)
            expected = oracle["at"][str(index)]
            assert as_json(our_context(state)) == expected, (read, index)
    return oracle


@pytest.mark.parametrize("every", [0, 3])
def test_lines_holding_a_lone_surrogate_are_in_pi_s_context(
    settings: Settings, tmp_path: Path, every: int
) -> None:
    """pi reads a line holding a lone surrogate like any other: the state reads the line
    kept escaped (``ESCAPED_LINE``) as the line itself, lone surrogates and all, and
    equals pi's context at every entry (messages, model, thinking level), with snapshots or
    without; a line with a string stored as a blob (over the inline limit) is too. The
    export gives the file back byte for byte."""
    entries = _surrogate_lines(big=settings.inline_string_limit + 1)
    path = _write(tmp_path / "s.jsonl", entries)
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=every)) as store:
        result = store.import_session(path, tenant_id=TENANT)
        stored = store.read(result.session_id)
        assert {e.type for e in stored[1:]} == {"message", pi.ESCAPED_LINE}
        assert len(store.journal.blob_hashes(result.session_id)) == 1  # the tool result
        oracle = _agrees_with_pi_at_every_entry(store, result.session_id, path, len(entries))
        state = store.state(result.session_id, rehydrate=True)
        assert as_json(our_context(state)) == oracle["leaf"]
        assert state.branch == oracle["branch"]
        assert (state.info.name, state.labels) == (f"name {_CUT}", {"a": f"l {_CUT}"})
        [call] = state.tool_calls
        assert (call.id, call.result_entry_id) == (f"call{_CUT}", "r")
        lazy = store.state(result.session_id)  # the blob read when asked for
        assert [m.text for m in lazy.messages] == [m.text for m in state.messages]
        exported = tmp_path / f"exported-{every}.jsonl"
        with exported.open("w", encoding="utf-8") as out:
            store.export_session(result.session_id, out)
        assert exported.read_bytes() == path.read_bytes()
        assert store.import_session(path, tenant_id=TENANT).status == "unchanged"


def _big_surrogate_lines(big: int) -> list[dict[str, Any]]:
    """Lines over the inline string limit, each holding a lone surrogate (a string cut
    inside an emoji, the common case in a long text): an assistant message with its model
    and usage, a tool call and its result, a compaction (its summary the long text), and a
    label whose label alone is long (its lone surrogate elsewhere in the line)."""

    def long(c: str) -> str:
        return c * (big + 1)

    call = {"type": "toolCall", "id": "call1", "name": "bash", "arguments": {"c": _CUT}}
    usage = {
        "input": 11,
        "output": 22,
        "cacheRead": 3,
        "cacheWrite": 4,
        "totalTokens": 40,
        "cost": {"total": 0.5},
    }
    return [
        _message("a", None, "before"),
        {"type": "message", "id": "b", "parentId": "a", "timestamp": _T,
         "message": {"role": "assistant", "content": [{"type": "text", "text": long("a") + _CUT}],
                     "provider": "big-provider", "model": "big-model", "usage": usage,
                     "stopReason": "stop", "timestamp": 1795000000000}},
        _message("c", "b", "next"),
        {"type": "message", "id": "d", "parentId": "c", "timestamp": _T,
         "message": {"role": "assistant", "content": [call], "provider": "p", "model": "m2",
                     "usage": usage}},
        {"type": "message", "id": "r", "parentId": "d", "timestamp": _T,
         "message": {"role": "toolResult", "toolCallId": "call1", "toolName": "bash",
                     "content": [{"type": "text", "text": _CUT + long("t")}], "isError": False}},
        {"type": "label", "id": "l", "parentId": "r", "targetId": "a", "label": long("l"),
         "note": _CUT},
        {"type": "compaction", "id": "cp", "parentId": "l", "timestamp": _T,
         "summary": f"S {long('s')} {_CUT}", "firstKeptEntryId": "c", "tokensBefore": 12345},
        _message("e", "cp", "after", "assistant"),
    ]  # fmt: skip


@pytest.mark.parametrize("every", [0, 3])
def test_long_lines_holding_a_lone_surrogate_are_folded_as_pi_reads_them(
    settings: Settings, tmp_path: Path, every: int
) -> None:
    """A line holding a lone surrogate over the inline string limit is folded like any line:
    the state equals pi's context at every entry (the long assistant message's model, the
    compaction), with snapshots or without; its usage is counted, its compaction and label
    read; each long string is a blob of its own. Export gives the file back byte for byte,
    and a session imported from the export exports the same bytes."""
    big = settings.inline_string_limit
    entries = _big_surrogate_lines(big)
    path = _write(tmp_path / "s.jsonl", entries)
    with SessionStore.from_settings(settings.with_overrides(snapshot_every=every)) as store:
        result = store.import_session(path, tenant_id=TENANT)
        assert len(store.journal.blob_hashes(result.session_id)) == 4
        oracle = _agrees_with_pi_at_every_entry(store, result.session_id, path, len(entries))
        for rehydrate in (True, "lazy"):
            state = store.state(result.session_id, rehydrate=rehydrate)
            if rehydrate is True:
                assert as_json(our_context(state)) == oracle["leaf"]
            model = store.state(result.session_id, at_seq=3, rehydrate=rehydrate).info.model
            assert model is not None and (model.provider, model.model_id) == (
                "big-provider",
                "big-model",
            )
            usage = state.counters.usage
            assert (usage.input, usage.output, usage.total_tokens, usage.cost) == (22, 44, 80, 1)
            assert state.counters.tool_calls == state.counters.tool_results == 1
            assert state.labels == {"a": "l" * (big + 1)}
            assert state.compaction is not None
            assert (state.compaction.entry_id, state.compaction.tokens_before) == ("cp", 12345)
            assert state.compaction.first_kept_entry_id == "c"
            assert loaded(state.compaction.summary) == entries[6]["summary"]
            [call] = state.tool_calls
            assert call.result_entry_id == "r"
        exported = tmp_path / f"exported-{every}.jsonl"
        with exported.open("w", encoding="utf-8") as out:
            store.export_session(result.session_id, out)
        assert exported.read_bytes() == path.read_bytes()
        assert store.import_session(path, tenant_id=TENANT).status == "unchanged"
        again = store.import_session(exported, tenant_id="other")
        twice = tmp_path / f"twice-{every}.jsonl"
        with twice.open("w", encoding="utf-8") as out:
            store.export_session(again.session_id, out)
        assert twice.read_bytes() == path.read_bytes()


def test_a_header_holding_a_lone_surrogate_is_imported_and_exported_exactly(
    store: SessionStore, tmp_path: Path
) -> None:
    """pi opens a file whose header holds a lone surrogate (its cwd, its id): the import
    keeps the header escaped (``ESCAPED_LINE`` at seq 1), the state has pi's header
    fields and context, the session row holds the text with the surrogate escaped (no
    database text holds one), and the export gives the file back byte for byte."""
    header = {**_LINKED_HEADER, "id": f"s-{_CUT}", "cwd": f"/w/{_CUT}", "parentSession": _CUT}
    entries = [_message("a", None, "one"), _message("b", "a", "two", "assistant")]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(_line(e) + "\n" for e in [header, *entries]))
    result = store.import_session(path, tenant_id=TENANT)
    # keyed by the id's own text: escaped, after a mark no unescaped id begins with
    assert (result.status, result.appended, result.external_id) == ("created", 3, "\ufeffs-\\ud83d")
    first = store.read(result.session_id)[0]
    assert first.type == pi.ESCAPED_LINE and pi.line_text(first.payload) == _line(header)
    assert first.payload["value"]["cwd"] == {pi.ESCAPED_STRING: ["/w/", 0xD83D]}
    session = store.get_session(result.session_id)
    assert (session.external_id, session.cwd) == ("\ufeffs-\\ud83d", "/w/\\ud83d")
    assert store.resolve_session("s-\\ud83d", tenant_id=TENANT).id == result.session_id
    oracle = pi_context(path)
    assert oracle["header"] == header
    state = store.state(result.session_id, rehydrate=True)
    assert as_json(our_context(state)) == oracle["leaf"]
    info = state.info
    assert (info.cwd, info.header_session_id, info.parent_session) == (
        header["cwd"],
        header["id"],
        header["parentSession"],
    )
    exported = tmp_path / "exported.jsonl"
    with exported.open("w", encoding="utf-8") as out:
        store.export_session(result.session_id, out)
    assert exported.read_bytes() == path.read_bytes()
    assert store.import_session(path, tenant_id=TENANT).status == "unchanged"
    with path.open("a", encoding="utf-8") as out:
        out.write(_line(_message("c", "b", "three")) + "\n")
    assert store.import_session(path, tenant_id=TENANT).appended == 1


def test_a_line_kept_wrapped_in_an_older_file_continued_in_pi(
    store: SessionStore, tmp_path: Path
) -> None:
    """pi gives a version-1 file's line without a type an id and a parent too, and writes
    it again with new random ids when it opens the file: a later pass accepts that rewrite
    and appends only what pi added."""
    path = tmp_path / "v1.jsonl"
    lines = [
        {"type": "session", "id": "v1odd", "timestamp": "2026-11-20T10:00:00.000Z", "cwd": "/"},
        {"type": "message", "timestamp": "t", "message": {"role": "user", "content": "one"}},
        {"no": "type"},
        {
            "type": "message",
            "timestamp": "t",
            "message": {"role": "assistant", "content": [], "provider": "p", "model": "m"},
        },
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    first = store.import_session(path, tenant_id=TENANT)
    pi_append(path, {"role": "user", "content": "continued in pi", "timestamp": 1795000099000})
    again = store.import_session(path, tenant_id=TENANT)
    assert (again.session_id, again.status, again.appended) == (first.session_id, "appended", 1)
    state = store.state(first.session_id, rehydrate=True)
    assert as_json(our_context(state)) == pi_context(path)["leaf"]
