"""A session's own fields (title, cwd, external id) hold what every backend can: U+0000,
which PostgreSQL ``text`` cannot hold, is refused by name on SQLite too, from the library,
the CLI's ``sessions create`` and an import alike (the header event itself keeps any
string: invariant 7 externalizes such strings to blobs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import InvalidEvent, SessionNotFound, SessionStore
from core.errors import ImportFormatError, InvalidArgument

NUL = "a\x00b"


@pytest.mark.parametrize("field", ["title", "cwd", "external_id"])
def test_a_nul_in_a_session_field_is_refused_by_name(store: SessionStore, field: str) -> None:
    with pytest.raises(InvalidEvent, match=r"U\+0000") as refused:
        store.create_session(tenant_id="t", **{field: NUL})
    assert refused.value.field == field
    assert store.list_sessions(tenant_id="t").items == []


def test_an_id_with_a_nul_finds_nothing(store: SessionStore) -> None:
    """No session has one: the journal finds none, on PostgreSQL too (whose query would
    fail); the store's public calls refuse such an argument by name (test_arguments)."""
    assert store.journal.find_external("t", NUL) is None
    with pytest.raises(SessionNotFound):
        store.journal.get_session(NUL)
    for find in (store.get_session, store.resolve_session):
        with pytest.raises(InvalidArgument):
            find(NUL)


@pytest.mark.parametrize(("key", "field"), [("id", "/id"), ("cwd", "/cwd")])
def test_import_of_a_header_with_a_nul_is_refused_and_the_next_file_imports(
    store: SessionStore, tmp_path: Path, key: str, field: str
) -> None:
    header = {"id": "s-nul", "cwd": "/w"} | {key: "\\u0000"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        f'{{"type":"session","version":3,"id":"{header["id"]}","timestamp":"t",'
        f'"cwd":"{header["cwd"]}"}}\n'
    )
    with pytest.raises(ImportFormatError, match=r"bad.jsonl: the session.s .* U\+0000") as refused:
        store.import_session(bad, tenant_id="t")
    assert refused.value.field == field
    assert store.list_sessions(tenant_id="t").items == []
    good = tmp_path / "good.jsonl"
    good.write_text('{"type":"session","version":3,"id":"s-ok","timestamp":"t","cwd":"/w"}\n')
    assert store.import_session(good, tenant_id="t").status == "created"
