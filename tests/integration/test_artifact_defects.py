"""Issue 16, item 7: a failed spill leaves no row; "1 line elided"."""

from __future__ import annotations

from sqlalchemy import func, select

from core import SessionStore
from core.artifacts.sink import OutputSink, elision_marker
from core.models import ArtifactRow


def _artifact_rows(store: SessionStore, session_id: str) -> int:
    table = ArtifactRow.__table__  # type: ignore[attr-defined]
    with store.engine.connect() as conn:
        query = select(func.count()).select_from(table).where(table.c.session_id == session_id)
        return int(conn.execute(query).scalar_one())


def test_a_spill_whose_directory_cannot_be_made_leaves_no_row(store: SessionStore) -> None:
    session = store.create_session(tenant_id="acme")
    manager = store.artifacts(session.id)
    directory = manager.directory()
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.write_bytes(b"a file where the session directory belongs")
    sink = OutputSink(target=manager, tool_type="bash", spill_bytes=10)
    sink.push("0123456789abcdef")
    summary = sink.dump("exit 0")
    assert summary.artifact_id is None and summary.artifact_error
    assert _artifact_rows(store, session.id) == 0


def test_one_elided_line_is_singular() -> None:
    assert elision_marker(1, 3) == "[… 1 line elided (3B) …]"
    assert elision_marker(2, 3) == "[… 2 lines elided (3B) …]"
    assert elision_marker(0, 3) == "[… 0 lines elided (3B) …]"
