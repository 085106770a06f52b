"""Schema management through Alembic: the only way the schema is created or changed.

Embedded SQLite creates or upgrades its schema when a store opens it (``ensure_schema``);
PostgreSQL is only ever changed by an explicit ``sessionstore db upgrade``, and a store
refuses to open a schema that is missing or behind (SchemaNotCurrent).
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import make_url

from core.db import make_engine
from core.errors import (
    DatabaseMissing,
    DowngradeRefused,
    InvalidArgument,
    SchemaAhead,
    SchemaNotCurrent,
    StorageUnavailable,
)
from core.translate import translate

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

# Alembic is imported only to change the schema or list its history: opening a store (every
# CLI command, every worker) checks the revision with one query against this constant, not
# by loading Alembic and parsing every migration script (~0.1 s of each CLI command's ~1 s).
# A test keeps it equal to the scripts' head; a new migration must update it.
HEAD_REVISION = "0026"
VERSION_TABLE = "alembic_version"

# The scripts beside ``core/``: in a checkout, and in an installed copy, where pyproject
# installs ``migrations`` beside the packages (they were left out, and every schema command
# failed there).
MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


# The name under which a downgrade is forced past a refusal (``DowngradeRefused``): an
# attribute of the Alembic config here, ``-x force=1`` on the ``alembic`` command line.
FORCE = "force"


def alembic_config(url: str, *, force: bool = False) -> Config:
    from alembic.config import Config

    cfg = Config()  # alembic.ini at the project root is for the alembic command only
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    cfg.attributes[FORCE] = force
    return cfg


def refuse_downgrade(revision: str, count: str, reason: Callable[[int], str]) -> None:
    """Inside migration ``revision``'s ``downgrade``, before it changes anything: raise
    ``DowngradeRefused(revision, reason(n))`` when the ``count`` query finds n > 0 rows the
    older code cannot do without, unless the caller forced the downgrade
    (``downgrade(..., force=True)``, ``sessionstore db downgrade --force`` or ``alembic -x
    force=1 downgrade``). The whole downgrade is one transaction: nothing is changed."""
    from alembic import context, op

    found = int(op.get_bind().execute(text(count)).scalar() or 0)
    if not found or context.config.attributes.get(FORCE):
        return
    given = context.get_x_argument(as_dictionary=True).get(FORCE)
    if given is not None and given.strip().lower() not in ("", "0", "false", "no"):
        return
    raise DowngradeRefused(revision, reason(found))


@cache
def _scripts() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    # The migration scripts do not change while a process runs: parse them once.
    return ScriptDirectory.from_config(alembic_config("sqlite://"))


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    with _revision_errors(), _one_migration_at_a_time(url):
        _refuse_unknown(current_revision(url))
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base", *, force: bool = False) -> None:
    """Downgrade to ``revision``, in one transaction. A step that would lose what the older
    code cannot rebuild raises ``DowngradeRefused`` and nothing is changed, unless
    ``force``: the step then goes ahead, as its refusal says it would."""
    from alembic import command

    with _revision_errors(), _one_migration_at_a_time(url):
        _refuse_unknown(current_revision(url))
        command.downgrade(alembic_config(url, force=force), revision)


# Any fixed number: the PostgreSQL advisory lock that migrations of one database take.
_MIGRATION_LOCK = 0x5E55_1075


@contextmanager
def _one_migration_at_a_time(url: str) -> Iterator[None]:
    """On PostgreSQL, a session-level advisory lock around the migration: two ``db
    upgrade`` runs at once on an empty database both created the schema, and one failed
    with a duplicate-key traceback. The second now waits, then finds nothing to do.
    (Embedded SQLite serializes in ``ensure_schema`` with a file lock.)"""
    if make_url(url).get_backend_name() != "postgresql":
        yield
        return
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _MIGRATION_LOCK})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _MIGRATION_LOCK})
                conn.commit()
    finally:
        engine.dispose()


def _refuse_unknown(current: str | None) -> None:
    """SchemaAhead for a schema at a revision these scripts do not have: a newer release
    wrote it (it was upgraded as if behind, or reported as a bad argument)."""
    if schema_state(current) == "ahead":
        assert current is not None
        raise SchemaAhead(current, HEAD_REVISION)


SchemaState = Literal["current", "missing", "behind", "ahead"]


def schema_state(current: str | None) -> SchemaState:
    """Where a schema at ``current`` stands against this code: at its head, missing (no
    schema), behind (a revision these scripts have) or ahead (one they do not: a newer
    release wrote it)."""
    if current == HEAD_REVISION:
        return "current"
    if current is None:
        return "missing"
    from alembic.util.exc import CommandError

    try:
        known = _scripts().get_revision(current) is not None
    except CommandError:  # alembic's ResolutionError included
        known = False
    return "behind" if known else "ahead"


@contextmanager
def _revision_errors() -> Iterator[None]:
    """Alembic's refusal of a revision (none such, not reachable that way) is bad input
    naming the argument, not a traceback."""
    from alembic.util.exc import CommandError

    try:
        yield
    except CommandError as exc:
        raise InvalidArgument("revision", str(exc)) from None


def head_revision(url: str | None = None) -> str | None:
    return HEAD_REVISION


def scripts_head() -> str | None:
    """The head of the migration scripts, by Alembic (what ``HEAD_REVISION`` must be)."""
    return _scripts().get_current_head()


def current_revision(url: str) -> str | None:
    engine = make_engine(url, pool_size=1)
    try:
        return engine_revision(engine)
    finally:
        engine.dispose()


def engine_revision(engine: Engine) -> str | None:
    """The schema's revision (None: no schema), read as Alembic reads it."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(VERSION_TABLE):
            return None
        heads = list(conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())
    if len(heads) > 1:  # never made by this project's linear history
        raise SchemaNotCurrent(f"the database schema has several heads: {sorted(heads)}")
    return str(heads[0]) if heads else None


def is_current(url: str) -> bool:
    return current_revision(url) == head_revision(url)


@dataclass(frozen=True)
class Revision:
    revision: str
    down_revision: str | None
    doc: str
    applied: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "revision": self.revision,
            "down_revision": self.down_revision,
            "doc": self.doc,
            "applied": self.applied,
        }


def history(current: str | None) -> list[Revision]:
    """Every migration, oldest first, each marked applied or pending against ``current``."""
    _refuse_unknown(current)
    scripts = _scripts()
    applied: set[str] = set()
    if current is not None:
        applied = {s.revision for s in scripts.iterate_revisions(current, "base")}
    ordered = list(reversed(list(scripts.walk_revisions())))
    return [
        Revision(
            revision=s.revision,
            down_revision=s.down_revision if isinstance(s.down_revision, str) else None,
            doc=(s.doc or "").strip(),
            applied=s.revision in applied,
        )
        for s in ordered
    ]


def pending(current: str | None) -> list[Revision]:
    return [r for r in history(current) if not r.applied]


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None: not SQLite, or in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).resolve()


def require_database(url: str) -> None:
    """Raise DatabaseMissing when a SQLite URL names a file that does not exist (read-only
    openers call this before the engine would create the file)."""
    path = sqlite_path(url)
    if path is not None and not path.exists():
        raise DatabaseMissing(str(path))


def ensure_schema(engine: Engine, url: str) -> None:
    """Embedded SQLite: create or upgrade the schema now. PostgreSQL: raise SchemaNotCurrent
    unless the schema is at head (it is only changed by an explicit ``db upgrade``)."""
    head = head_revision()
    current = engine_revision(engine)
    if current == head:
        return
    _refuse_unknown(current)
    path = sqlite_path(url)
    if path is None:
        what = "missing" if current is None else f"at {current}"
        raise SchemaNotCurrent(
            f"the database schema is {what}, the code needs {head}: run `sessionstore db upgrade`"
        )
    # Two processes opening a new embedded database at once: one upgrades, the other waits
    # and then finds the schema current (Alembic's SQLite DDL is not transactional).
    with (path.parent / f"{path.name}.migrate-lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if engine_revision(engine) != head:
            upgrade(url)


def open_engine(url: str, *, create: bool = True) -> Engine:
    """An engine on a journal whose schema is current: ``ensure_schema`` (SQLite created or
    upgraded, PostgreSQL checked); ``create=False``: a missing SQLite file is DatabaseMissing.

    A database unreachable right now still opens: the first query reports the outage, and a
    worker's write retries instead of failing here, outside its retry loop.
    """
    if not create:
        require_database(url)
    engine = make_engine(url)
    try:
        ensure_schema(engine, url)
    except Exception as exc:
        if not isinstance(translate(exc), StorageUnavailable):
            engine.dispose()
            raise
    return engine
