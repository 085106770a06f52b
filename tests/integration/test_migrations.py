"""Alembic is the only schema source: head equals the models, and migrations round-trip."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, text

from core import SessionStore, Settings, migrate
from core.db import make_engine
from core.errors import DowngradeRefused, SchemaAhead, SchemaNotCurrent
from core.models import metadata
from tests.conftest import PG_ADMIN_DSN, drop_pg_database, pg_url_for


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    request.getfixturevalue("pg_template")  # skips or fails like every PostgreSQL test
    name = f"ss_m_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_url_for(name)
    drop_pg_database(name)


def _diff(url: str) -> list[object]:
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_engine(url, pool_size=1)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _execute(url: str, *statements: str) -> None:
    """``statements`` in one transaction, as an older release (or a newer one) wrote."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def test_upgrade_head_on_an_empty_database_equals_the_models(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []
    assert migrate.is_current(empty_url)


def test_upgrade_downgrade_upgrade_round_trip(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    assert _tables(empty_url) == set(metadata.tables)
    migrate.downgrade(empty_url, "base")
    assert _tables(empty_url) == set()
    assert migrate.current_revision(empty_url) is None
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == [] and migrate.is_current(empty_url)


def test_a_journal_holding_data_is_upgraded_and_downgraded_through_every_rebuild(
    empty_url: str, tmp_path: Path
) -> None:
    """A journal from an older release, holding a session and its event: upgraded to head
    it reads back, and it goes down and up again with its rows. On SQLite a batch
    migration rebuilds ``sessions`` (copy, drop, rename), and with foreign keys on the
    drop failed: a journal at 0006-0009 holding any event could never be upgraded (nor
    downgraded past 0007): a review of the operator's side, stop 39."""
    migrate.upgrade(empty_url, "0006")
    _execute(
        empty_url,
        "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
        "VALUES ('s1', 'acme', 1, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)",
        "INSERT INTO events (session_id, seq, type, payload, recorded_at) VALUES "
        """('s1', 1, 'message', '{"type": "message", "n": 1}', CURRENT_TIMESTAMP)""",
    )
    migrate.upgrade(empty_url)
    settings = Settings(data_dir=tmp_path / "data", database_url=empty_url)
    with SessionStore.from_settings(settings) as store:
        assert [e.payload for e in store.read("s1")] == [{"type": "message", "n": 1}]
    migrate.downgrade(empty_url, "0006", force=True)  # PostgreSQL: back to jsonb knowingly
    migrate.upgrade(empty_url)
    assert migrate.is_current(empty_url)
    with SessionStore.from_settings(settings) as store:
        assert [e.seq for e in store.read("s1")] == [1]


def test_a_schema_a_newer_release_wrote_is_refused_typed(empty_url: str, tmp_path: Path) -> None:
    """A revision these scripts do not have: SQLite "upgraded" it (a bad-argument error on
    every command), PostgreSQL advised `db upgrade`, history was a traceback. Now each says
    a newer release wrote it, and nothing is changed."""
    migrate.upgrade(empty_url)
    _execute(empty_url, "UPDATE alembic_version SET version_num = '0099'")
    settings = Settings(data_dir=tmp_path / "data", database_url=empty_url)
    for attempt in (
        lambda: SessionStore.from_settings(settings),
        lambda: migrate.upgrade(empty_url),
        lambda: migrate.downgrade(empty_url, "0019"),
        lambda: migrate.history("0099"),
    ):
        with pytest.raises(SchemaAhead, match=r"0099.*newer sessionstore") as ahead:
            attempt()
        assert isinstance(ahead.value, SchemaNotCurrent)  # callers catching that still do
        assert ahead.value.revision == "0099" and "db upgrade" not in ahead.value.message
    assert migrate.current_revision(empty_url) == "0099"


def test_two_upgrades_at_once_on_an_empty_postgresql_both_succeed(tmp_path: Path) -> None:
    """Both created the schema: one failed with a duplicate-key traceback. The second waits
    on the migration lock, then finds nothing to do."""
    name = f"t_mig_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = pg_url_for(name)
    try:
        script = f"from core import migrate; migrate.upgrade({url!r})"
        runs = [
            subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        errors = [run.communicate(timeout=120)[1] for run in runs]
        assert [run.returncode for run in runs] == [0, 0], errors
        assert migrate.is_current(url) and _diff(url) == []
    finally:
        drop_pg_database(name)


def test_a_downgrade_never_forgets_directories_still_to_remove(empty_url: str) -> None:
    """Below 0015 nothing lists a deleted session's directory not removed yet: a downgrade
    that dropped those rows would leave the directories for good. It is refused, changing
    nothing, until the rows are gone, or forced (leaving the directories knowingly)."""
    migrate.upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO session_removals (session_id, kind, tenant_id, deleted_at) "
                    "VALUES ('s1', 'session', 'acme', CURRENT_TIMESTAMP)"
                )
            )
        with pytest.raises(DowngradeRefused, match="1 deleted session"):
            migrate.downgrade(empty_url, "0014")
        assert migrate.current_revision(empty_url) == migrate.HEAD_REVISION
        assert "session_removals" in _tables(empty_url)
        migrate.downgrade(empty_url, "0014", force=True)
        assert migrate.current_revision(empty_url) == "0014"
        assert "session_removals" not in _tables(empty_url)
    finally:
        engine.dispose()
    migrate.upgrade(empty_url)
    migrate.downgrade(empty_url, "0014")  # no row: nothing to refuse
    assert migrate.current_revision(empty_url) == "0014"
    assert "session_removals" not in _tables(empty_url)


def test_the_head_constant_is_the_scripts_head() -> None:
    """Stores check the schema against ``HEAD_REVISION`` without loading Alembic: a new
    migration must move it too."""
    assert migrate.HEAD_REVISION == migrate.scripts_head()
    assert [r.revision for r in migrate.history(None)][-1] == migrate.HEAD_REVISION


def test_the_revision_is_read_as_alembic_reads_it_at_every_step(empty_url: str) -> None:
    """None on an empty database, then each revision on the way up, as Alembic's own
    ``MigrationContext`` reports it."""
    engine = make_engine(empty_url, pool_size=1)
    try:
        for step in [None, *(r.revision for r in migrate.history(None))]:
            if step is not None:
                migrate.upgrade(empty_url, step)
            with engine.connect() as conn:
                alembic_says = MigrationContext.configure(conn).get_current_revision()
            assert migrate.engine_revision(engine) == alembic_says == step
        assert step == migrate.HEAD_REVISION and migrate.is_current(empty_url)
        with engine.begin() as conn:  # a second head, as a foreign branch would leave
            conn.execute(text("INSERT INTO alembic_version (version_num) VALUES ('0001')"))
        with pytest.raises(SchemaNotCurrent, match="several heads"):
            migrate.engine_revision(engine)
    finally:
        engine.dispose()


def test_the_rollup_of_models_read_from_any_value_is_forgotten(empty_url: str) -> None:
    """0020: a rollup row written when a model that is a JSON number was named (``5``) would
    disagree with the days read live now (no model): the rollup goes, and is rebuilt."""
    migrate.upgrade(empty_url, "0019")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO event_rollup_blocks (block, rolled) VALUES (0, true)"))
            conn.execute(
                text(
                    "INSERT INTO event_rollups (day, session_id, type, entry_day, model, "
                    "has_model, assistant, inherited, events, payload_bytes, blob_bytes, "
                    "responses) VALUES ('2026-11-27', 's1', 'message', '2026-11-27', '5', true, "
                    "true, false, 1, 10, 0, 1)"
                )
            )
        migrate.upgrade(empty_url)
        with engine.connect() as conn:
            for table in ("event_rollups", "event_rollup_blocks"):
                assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 0
    finally:
        engine.dispose()


def test_an_installed_copy_manages_its_schema_without_the_checkout(tmp_path: Path) -> None:
    """What ``pip install .`` (the compose image) installs, and nothing else: the packages
    pyproject.toml's setuptools rules select, with their package data, copied alone. Its CLI
    creates, upgrades, checks and lists the schema (the scripts were left out of the
    install, and every schema command failed there with a traceback)."""
    import shutil
    import subprocess
    import sys
    import tomllib

    from setuptools import find_namespace_packages

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    site = tmp_path / "site"
    for package in find_namespace_packages(
        str(root), include=config["packages"]["find"]["include"]
    ):
        source = root.joinpath(*package.split("."))
        data = config.get("package-data", {}).get(package, [])
        for path in source.iterdir():
            if path.is_file() and (path.suffix == ".py" or any(path.match(p) for p in data)):
                target = site.joinpath(*package.split("."), path.name)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(site),
        "SESSIONSTORE_DATA_DIR": str(tmp_path / "data"),
        "HOME": str(tmp_path),
    }
    code = (
        "import sys; from tasks.cli import main; sys.argv = ['sessionstore', *sys.argv[1:]]; main()"
    )
    for argv in (["db", "upgrade"], ["db", "check"], ["db", "history"], ["sessions", "create"]):
        done = subprocess.run(
            [sys.executable, "-c", code, *argv],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (argv, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
    imported = subprocess.run(
        [sys.executable, "-c", "import core; print(core.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert imported.stdout.strip().startswith(str(site))  # the copy, not the checkout


def _old_artifact_row(url: str) -> None:
    """A session with one tool output, as an older release wrote them."""
    _execute(
        url,
        "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
        "VALUES ('s1', 'acme', 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)",
        "INSERT INTO artifacts (session_id, kind, local_id, name, size_bytes, created_at, "
        "created_seq) VALUES ('s1', 'tool_output', '0', '0.bash.log', 5, CURRENT_TIMESTAMP, 0)",
    )


def test_artifacts_written_before_their_state_was_kept_are_complete(empty_url: str) -> None:
    """0021: every artifact row an older release wrote reads as complete (whole writes, or
    a streamed output no one can tell apart any more); the downgrade drops the column and
    keeps the rows (an older release cannot tell a partial one: it comes back complete)."""
    migrate.upgrade(empty_url, "0020")
    _old_artifact_row(empty_url)
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            assert conn.execute(text("SELECT state FROM artifacts")).scalars().all() == ["complete"]
            conn.execute(
                text(
                    "INSERT INTO artifacts (session_id, kind, local_id, name, size_bytes, "
                    "created_at, created_seq, state) VALUES ('s1', 'tool_output', '1', "
                    "'1.bash.log', 0, CURRENT_TIMESTAMP, 0, 'writing')"
                )
            )
    finally:
        engine.dispose()
    migrate.downgrade(empty_url, "0020")
    columns = {c["name"] for c in _inspect_columns(empty_url, "artifacts")}
    assert "state" not in columns
    migrate.upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            found = conn.execute(text("SELECT local_id, state FROM artifacts ORDER BY local_id"))
            assert [tuple(r) for r in found] == [("0", "complete"), ("1", "complete")]
    finally:
        engine.dispose()


def test_artifact_digests_start_empty_and_the_downgrade_keeps_the_rows(empty_url: str) -> None:
    """0022: rows written before digests were recorded have none (their size is still
    checked on read); the downgrade drops the column and keeps the rows."""
    migrate.upgrade(empty_url, "0021")
    _old_artifact_row(empty_url)
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []
    assert _artifact_column(empty_url, "sha256") == [None]
    _execute(empty_url, f"UPDATE artifacts SET sha256 = '{'a' * 64}'")
    assert _artifact_column(empty_url, "sha256") == ["a" * 64]
    migrate.downgrade(empty_url, "0021")
    assert "sha256" not in {c["name"] for c in _inspect_columns(empty_url, "artifacts")}
    assert _artifact_column(empty_url, "local_id") == ["0"]
    migrate.upgrade(empty_url)
    assert _artifact_column(empty_url, "sha256") == [None]


def test_sidecar_digests_start_empty_and_the_downgrade_keeps_the_rows(empty_url: str) -> None:
    """0023: rows written before sidecar digests were recorded have none (their sidecar is
    not checked); the downgrade drops the column and keeps the rows."""
    migrate.upgrade(empty_url, "0022")
    _old_artifact_row(empty_url)
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []
    assert _artifact_column(empty_url, "sidecar_sha256") == [None]
    _execute(empty_url, f"UPDATE artifacts SET sidecar_sha256 = '{'b' * 64}'")
    assert _artifact_column(empty_url, "sidecar_sha256") == ["b" * 64]
    migrate.downgrade(empty_url, "0022")
    assert "sidecar_sha256" not in {c["name"] for c in _inspect_columns(empty_url, "artifacts")}
    assert _artifact_column(empty_url, "local_id") == ["0"]
    migrate.upgrade(empty_url)
    assert _artifact_column(empty_url, "sidecar_sha256") == [None]


def test_writes_are_indexed_by_session_and_first_seq_from_0024(empty_url: str) -> None:
    """0024 adds the index an import's resume reads along (the latest batch of a session),
    on a journal holding writes, and its downgrade drops it and keeps the rows."""
    migrate.upgrade(empty_url, "0023")
    _execute(
        empty_url,
        "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
        "VALUES ('s1', 'acme', 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)",
        "INSERT INTO writes (session_id, idempotency_key, first_seq, last_seq, positions, "
        "created_at) VALUES ('s1', 'k', 1, 2, '[1, 2]', CURRENT_TIMESTAMP)",
    )
    assert "ix_writes_session_first_seq" not in _indexes(empty_url, "writes")
    migrate.upgrade(empty_url)
    assert _indexes(empty_url, "writes")["ix_writes_session_first_seq"] == [
        "session_id",
        "first_seq",
    ]
    migrate.downgrade(empty_url, "0023")
    assert "ix_writes_session_first_seq" not in _indexes(empty_url, "writes")
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == [] and _count(empty_url, "writes") == 1


def test_a_forks_inherited_artifacts_are_marked_as_they_were_judged_before_0025(
    empty_url: str,
) -> None:
    """0025: the rows of a fork whose copy is unfinished, created at or before the fork
    point and not after the fork's creation, read as inherited (what the copy judged by the
    clocks before), every other row (a finished copy's too: it never runs again) as the
    session's own; the downgrade drops the column and keeps the rows."""
    migrate.upgrade(empty_url, "0024")
    fork_time, before, after = "2026-01-01 10:00:00", "2026-01-01 09:59:00", "2026-01-01 10:01:00"
    _execute(
        empty_url,
        "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
        f"VALUES ('p', 'acme', 3, '{before}', '{before}')",
        *(
            "INSERT INTO sessions (id, tenant_id, parent_id, forked_from_seq, head_seq, "
            f"copy_status, created_at, updated_at) VALUES ('{fork}', 'acme', 'p', 1, 2, "
            f"'{status}', '{fork_time}', '{fork_time}')"
            for fork, status in (("f", "pending"), ("g", "failed"), ("c", "copied"))
        ),
        *(
            "INSERT INTO artifacts (session_id, kind, local_id, name, size_bytes, created_at, "
            f"created_seq) VALUES ('{session}', 'tool_output', '{local_id}', "
            f"'{local_id}.bash.log', 1, '{created}', {seq})"
            for session, local_id, created, seq in (
                ("p", "0", before, 0),  # no fork's
                ("f", "0", before, 1),  # inherited
                ("f", "1", before, 2),  # allocated after the fork's first append
                ("f", "2", after, 1),  # allocated before it, after the fork
                ("g", "0", before, 1),  # inherited
                ("c", "0", before, 1),  # inherited, but copied already
            )
        ),
    )
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []
    with _engine(empty_url) as engine, engine.connect() as conn:
        marked = conn.execute(
            text("SELECT session_id, local_id FROM artifacts WHERE inherited ORDER BY session_id")
        ).all()
        assert [tuple(r) for r in marked] == [("f", "0"), ("g", "0")]
    migrate.downgrade(empty_url, "0024")
    assert "inherited" not in {c["name"] for c in _inspect_columns(empty_url, "artifacts")}
    assert _count(empty_url, "artifacts") == 6
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []


def test_0026_makes_an_unfinished_forks_rows_of_unfinished_outputs_its_own(
    empty_url: str,
) -> None:
    """0026: in a fork whose copy is unfinished, an inherited tool output not complete
    (``writing``, or ``truncated`` by expiry) becomes ``truncated`` at 0 bytes and an
    inherited agent output never written an unwritten slot, both the fork's own (its copy
    failed on them once the parent finished them); a row identical to the parent's that
    0025's clocks left unmarked is marked inherited (reads and copies go by the marks
    alone); the fork's own rows, a copied fork's, and the parent's stay as they were."""
    migrate.upgrade(empty_url, "0025")
    at = "2026-01-01 10:00:00"
    true, false = ("true", "false") if empty_url.startswith("postgresql") else ("1", "0")
    _execute(
        empty_url,
        "INSERT INTO sessions (id, tenant_id, head_seq, created_at, updated_at) "
        f"VALUES ('p', 'acme', 3, '{at}', '{at}')",
        *(
            "INSERT INTO sessions (id, tenant_id, parent_id, forked_from_seq, head_seq, "
            f"copy_status, created_at, updated_at) VALUES ('{fork}', 'acme', 'p', 1, 2, "
            f"'{status}', '{at}', '{at}')"
            for fork, status in (("f", "pending"), ("g", "failed"), ("c", "copied"))
        ),
        *(
            "INSERT INTO artifacts (session_id, kind, local_id, name, size_bytes, sha256, "
            f"state, inherited, created_at, created_seq) VALUES ('{session}', '{kind}', "
            f"'{local_id}', '{local_id}.x', {size}, {sha}, '{state}', {marked}, '{at}', 1)"
            for session, kind, local_id, size, sha, state, marked in (
                ("p", "tool_output", "0", 5, "NULL", "writing", false),  # the parent's own
                ("f", "tool_output", "0", 5, "NULL", "writing", true),  # -> truncated, own
                ("f", "tool_output", "2", 4, "NULL", "truncated", true),  # -> 0 bytes, own
                ("f", "tool_output", "1", 5, "'ab'", "complete", true),  # written: kept
                ("f", "agent_output", "1-a", 0, "NULL", "complete", true),  # -> own slot
                ("f", "agent_output", "2-a", 7, "'cd'", "complete", true),  # written: kept
                ("g", "agent_output", "1-a", 0, "NULL", "complete", true),  # -> own slot
                ("c", "tool_output", "0", 5, "NULL", "writing", true),  # copied: kept
                # files: identical to the parent's, left unmarked by 0025's clocks (the
                # parent's writer ahead) -> inherited; the fork's own put; no parent's
                ("p", "file", "a", 3, "'ef'", "complete", false),
                ("f", "file", "a", 3, "'ef'", "complete", false),  # -> inherited
                ("c", "file", "a", 3, "'ef'", "complete", false),  # copied: kept
                ("p", "file", "b", 3, "'ef'", "complete", false),
                ("f", "file", "b", 4, "'gh'", "complete", false),  # its own: kept
                ("f", "file", "c", 3, "'ef'", "complete", false),  # its own: kept
            )
        ),
    )
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []
    query = (
        "SELECT session_id, local_id, state, size_bytes, inherited FROM artifacts "
        "ORDER BY session_id, local_id"
    )

    def rows() -> list[tuple[str, str, str, int, bool]]:
        with _engine(empty_url) as engine, engine.connect() as conn:
            return [(r[0], r[1], r[2], r[3], bool(r[4])) for r in conn.execute(text(query))]

    found = rows()
    assert found == [
        ("c", "0", "writing", 5, True),
        ("c", "a", "complete", 3, False),
        ("f", "0", "truncated", 0, False),
        ("f", "1", "complete", 5, True),
        ("f", "1-a", "complete", 0, False),
        ("f", "2", "truncated", 0, False),
        ("f", "2-a", "complete", 7, True),
        ("f", "a", "complete", 3, True),
        ("f", "b", "complete", 4, False),
        ("f", "c", "complete", 3, False),
        ("g", "1-a", "complete", 0, False),
        ("p", "0", "writing", 5, False),
        ("p", "a", "complete", 3, False),
        ("p", "b", "complete", 3, False),
    ]
    # the downgrade keeps the data (0025 reads it as it is), and a second upgrade over the
    # converted rows changes nothing
    migrate.downgrade(empty_url, "0025")
    assert migrate.current_revision(empty_url) == "0025"
    assert rows() == found
    migrate.upgrade(empty_url)
    assert rows() == found


def _indexes(url: str, table: str) -> dict[str | None, list[str | None]]:
    with _engine(url) as engine:
        return {i["name"]: i["column_names"] for i in inspect(engine).get_indexes(table)}


def _count(url: str, table: str) -> int:
    with _engine(url) as engine, engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


@contextmanager
def _engine(url: str) -> Iterator[Engine]:
    engine = make_engine(url, pool_size=1)
    try:
        yield engine
    finally:
        engine.dispose()


def _artifact_column(url: str, column: str) -> list[object]:
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(f"SELECT {column} FROM artifacts")).scalars())
    finally:
        engine.dispose()


def _inspect_columns(url: str, table: str) -> list[dict[str, object]]:
    engine = make_engine(url, pool_size=1)
    try:
        return list(inspect(engine).get_columns(table))  # type: ignore[arg-type]
    finally:
        engine.dispose()
