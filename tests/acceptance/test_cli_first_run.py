"""Issue 18 through the real ``sessionstore`` executable: a first run, every failure as one
line with its documented exit code, and the commands a user expects.

Each test runs the CLI as a subprocess with a fresh HOME and no SESSIONSTORE_* variables
from the caller, so nothing here can touch a developer's data.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from core.errors import SchemaAhead
from core.migrate import head_revision, history
from tasks.cli.failures import ExitCode
from tests.cli_process import run_cli
from tests.conftest import PG_ADMIN_DSN, drop_pg_database, pg_url_for
from tests.support import ROOT, clean_env, free_port


class Cli:
    def __init__(self, home: Path, cwd: Path) -> None:
        self.home = home
        self.cwd = cwd
        self.env: dict[str, str] = {}

    def __call__(
        self, *args: str, stdin: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        env = clean_env(**{"HOME": str(self.home), **self.env})
        env.pop("XDG_DATA_HOME", None)
        return run_cli(*args, env=env, cwd=self.cwd, input=stdin, timeout=timeout)


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    return Cli(tmp_path / "home", tmp_path / "cwd")


def one_line_error(result: subprocess.CompletedProcess[str], code: ExitCode, *needles: str) -> str:
    """The failure printed exactly one line on stderr, no traceback, with ``code``."""
    assert result.returncode == int(code), (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _message(text: str, entry: str) -> dict[str, object]:
    return {
        "type": "message",
        "id": entry,
        "parentId": None,
        "message": {"role": "user", "content": text},
    }


# --- missing commands --------------------------------------------------------------------


@pytest.mark.smoke
def test_version(cli: Cli) -> None:
    result = cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("sessionstore ")


def test_db_history_check_and_downgrade(cli: Cli) -> None:
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    revisions = [r.revision for r in history(None)]
    assert len(revisions) >= 2
    previous = revisions[-2]
    assert cli("db", "upgrade", previous).returncode == 0
    behind = cli("db", "check")
    assert behind.returncode == int(ExitCode.SCHEMA_NOT_CURRENT)
    assert "pending" in behind.stdout and revisions[-1] in behind.stdout
    assert "db upgrade" in behind.stdout
    shown = json.loads(cli("db", "history", "--json").stdout)
    assert [r["applied"] for r in shown][-2:] == [True, False]
    assert cli("db", "upgrade").returncode == 0
    ok = cli("db", "check")
    assert ok.returncode == 0 and "up to date" in ok.stdout
    down = cli("db", "downgrade", previous, "--yes", "--json")
    assert down.returncode == 0 and json.loads(down.stdout)["current"] == previous
    assert head_revision() == revisions[-1]


def test_db_current_exits_8_unless_the_schema_is_at_head(cli: Cli) -> None:
    """`db current` said `current: 0022   head: 0021` and exited 0; it exits 8 (as `db check`)
    whenever the schema is not at head, and --json says where it stands."""
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    head, previous = head_revision(), [r.revision for r in history(None)][-2]
    assert cli("db", "upgrade", previous).returncode == 0
    behind = cli("db", "current")
    assert behind.returncode == int(ExitCode.SCHEMA_NOT_CURRENT), behind.stderr
    assert f"current: {previous}" in behind.stdout and "behind" in behind.stdout
    assert "db upgrade" in behind.stdout
    shown = cli("db", "current", "--json")
    assert shown.returncode == int(ExitCode.SCHEMA_NOT_CURRENT)
    assert json.loads(shown.stdout) == {"current": previous, "head": head, "state": "behind"}
    assert cli("db", "upgrade").returncode == 0
    ok = cli("db", "current", "--json")
    assert ok.returncode == 0
    assert json.loads(ok.stdout) == {"current": head, "head": head, "state": "current"}


def test_a_schema_a_newer_release_wrote_is_not_sent_to_db_upgrade(cli: Cli) -> None:
    """A revision the code does not know: the error said to run that newer release, then the
    CLI added "(run `sessionstore db upgrade`)", the command that had just failed; and `db
    current` exited 0."""
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    assert cli("db", "upgrade").returncode == 0
    journal = cli.home / "data" / "journal.db"
    with sqlite3.connect(journal) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0999'")
    conn.close()
    for args in (("db", "upgrade"), ("sessions", "list"), ("db", "check")):
        line = one_line_error(
            cli(*args), ExitCode.SCHEMA_NOT_CURRENT, "0999", "newer sessionstore", "run that"
        )
        assert "db upgrade" not in line, (args, line)
    ahead = cli("db", "current")
    assert ahead.returncode == int(ExitCode.SCHEMA_NOT_CURRENT)
    assert "current: 0999" in ahead.stdout and "newer sessionstore" in ahead.stdout
    # one text: what the error says to do is what `db current` says
    assert f"(ahead: {SchemaAhead.ADVICE})" in " ".join(ahead.stdout.split())
    assert line.endswith(f"does not know: {SchemaAhead.ADVICE}"), line
    assert "db upgrade" not in ahead.stdout
    shown = cli("db", "current", "--json")
    assert shown.returncode == int(ExitCode.SCHEMA_NOT_CURRENT)
    assert json.loads(shown.stdout) == {
        "current": "0999",
        "head": head_revision(),
        "state": "ahead",
    }


def test_queue_status_embedded(cli: Cli) -> None:
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    assert cli("db", "upgrade").returncode == 0
    result = cli("queue", "status", "--json", "--timeout", "0.5")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["queues"] == {"sessionstore": 0}
    assert status["dead_letters"] == 0 and status["workers"] == {}


def test_queue_status_embedded_counts_claimed_and_set_aside_messages(cli: Cli) -> None:
    """The embedded broker's in-flight messages (its claims) and the files it set aside as
    unreadable: ``unacked`` was n/a and ``bad/`` not shown at all."""
    from core import broker
    from core.settings import Settings
    from tasks.app import create_app
    from tasks.producer import enqueue_append

    data = cli.home / "data"
    cli.env["SESSIONSTORE_DATA_DIR"] = str(data)
    assert cli("db", "upgrade").returncode == 0
    app = create_app(Settings(data_dir=data))
    for n in range(3):  # no worker: they wait in the queue
        enqueue_append("s", [_message("hi", f"e{n}")], app=app)
    queue = data / "queue"
    first = min((queue / "in").iterdir())
    (queue / "claimed").mkdir(exist_ok=True)
    first.rename(queue / "claimed" / broker._claim_name(first.name))  # held by a live consumer
    (queue / "bad").mkdir()
    (queue / "bad" / "1_x.sessionstore.msg").write_text("{")
    status = json.loads(cli("queue", "status", "--json", "--timeout", "0.5").stdout)
    assert status["queues"] == {"sessionstore": 2}
    assert (status["unacked"], status["set_aside"]) == (1, 1)
    table = cli("queue", "status", "--timeout", "0.5").stdout
    assert re.search(r"unacked \(delivered, running\)[\s│]+1\b", table), table
    assert re.search(r"set aside as unreadable \(queue/bad/\)[\s│]+1\b", table), table


@pytest.mark.redis
def test_queue_status_redis_counts_waiting_messages(cli: Cli, redis_url: str) -> None:
    from core.settings import Settings
    from tasks.app import create_app
    from tasks.producer import enqueue_append

    data = cli.home / "data"
    cli.env.update({"SESSIONSTORE_DATA_DIR": str(data), "SESSIONSTORE_BROKER_URL": redis_url})
    assert cli("db", "upgrade").returncode == 0
    app = create_app(Settings(data_dir=data, broker_url=redis_url))
    for n in range(3):  # no worker: they wait in the queue
        enqueue_append("s", [_message("hi", f"e{n}")], app=app)
    status = json.loads(cli("queue", "status", "--json", "--timeout", "0.5").stdout)
    assert status["queues"] == {"sessionstore": 3} and status["unacked"] == 0
    assert status["set_aside"] is None  # the embedded broker's alone


# --- first-failure messages -----------------------------------------------------------------


def test_database_at_a_closed_port_is_one_line(cli: Cli) -> None:
    port = free_port()
    cli.env["SESSIONSTORE_DATABASE_URL"] = f"postgresql+psycopg://postgres@127.0.0.1:{port}/x"
    for args in (("sessions", "list"), ("stats",), ("db", "check")):
        one_line_error(
            cli(*args), ExitCode.STORAGE_UNAVAILABLE, "database unavailable", "DATABASE_URL"
        )


def test_object_store_at_a_closed_port_is_one_short_line_naming_it(cli: Cli) -> None:
    """An unreachable S3 blob store: storage unavailable (6), naming the blob store and its
    settings, not the database; obstore's debug dump (865 bytes) only with --debug."""
    cli.env.update(
        {
            "SESSIONSTORE_DATA_DIR": str(cli.home / "data"),
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "x",
            "AWS_REGION": "us-east-1",
            "SESSIONSTORE_S3_RETRY_SECONDS": "0",
            "SESSIONSTORE_S3_REQUEST_TIMEOUT_SECONDS": "2",
        }
    )
    assert cli("db", "upgrade").returncode == 0
    cli.env["SESSIONSTORE_BLOB_URL"] = "s3://bkt/blobs"
    for args in (("gc",), ("blobs", "verify")):
        line = one_line_error(
            cli(*args),
            ExitCode.STORAGE_UNAVAILABLE,
            "blob store unavailable",
            "SESSIONSTORE_BLOB_URL",
            "AWS_ENDPOINT_URL",
        )
        assert "DATABASE_URL" not in line and "Debug source" not in line
        assert len(line) < 500, line
    assert "Debug source" in cli("--debug", "gc").stderr


def test_broker_stopped_is_one_line(cli: Cli) -> None:
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    cli.env["SESSIONSTORE_BROKER_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    cli.env["SESSIONSTORE_PUBLISH_RETRY_SECONDS"] = "0"
    assert cli("db", "upgrade").returncode == 0
    assert cli("sessions", "create", "--id", "s1").returncode == 0
    one_line_error(cli("queue", "status"), ExitCode.BROKER_UNAVAILABLE, "broker unavailable")
    events = json.dumps(_message("hi", "e1")) + "\n"
    one_line_error(
        cli("append", "s1", "--enqueue", stdin=events),
        ExitCode.BROKER_UNAVAILABLE,
        "broker unavailable",
    )


@pytest.mark.slow
def test_publish_retries_as_long_as_the_setting_says(cli: Cli) -> None:
    """The README's promise: a producer with no broker keeps retrying for
    SESSIONSTORE_PUBLISH_RETRY_SECONDS (it used to give up after kombu's 4-5 s)."""
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    cli.env["SESSIONSTORE_BROKER_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    assert cli("db", "upgrade").returncode == 0
    assert cli("sessions", "create", "--id", "s1").returncode == 0
    events = json.dumps(_message("hi", "e1")) + "\n"
    for setting in (1, 8):
        cli.env["SESSIONSTORE_PUBLISH_RETRY_SECONDS"] = str(setting)
        started = time.monotonic()
        result = cli("append", "s1", "--enqueue", stdin=events)
        elapsed = time.monotonic() - started
        # first what it is doing (it was silent for the whole wait), then the one error line
        notice, error = result.stderr.splitlines()
        assert notice.startswith("the broker is unreachable") and f"up to {setting} s" in notice
        assert result.returncode == int(ExitCode.BROKER_UNAVAILABLE)
        assert error.startswith("error: broker unavailable"), result.stderr
        assert setting <= elapsed < setting + 15, (setting, elapsed)


def test_debug_shows_the_traceback(cli: Cli) -> None:
    result = cli("--debug", "sessions", "list")
    assert result.returncode == int(ExitCode.DATABASE_MISSING)
    assert "Traceback" in result.stderr
    cli.env["SESSIONSTORE_DEBUG"] = "1"
    assert "Traceback" in cli("sessions", "list").stderr


def test_bad_url_bad_id_bad_input(cli: Cli) -> None:
    cli.env["SESSIONSTORE_DATABASE_URL"] = "mysql://nope"
    one_line_error(cli("sessions", "list"), ExitCode.BAD_CONFIG, "database_url")
    cli.env.pop("SESSIONSTORE_DATABASE_URL")
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    assert cli("db", "upgrade").returncode == 0
    one_line_error(cli("sessions", "show", "no-such-session"), ExitCode.NOT_FOUND)
    one_line_error(cli("dead-letters", "show", "42"), ExitCode.NOT_FOUND)
    assert cli("sessions", "create", "--id", "s1").returncode == 0
    one_line_error(cli("append", "s1", stdin="{not json\n"), ExitCode.BAD_INPUT, "line 1")


def test_a_setting_celery_or_sqlalchemy_cannot_use_is_a_bad_setting(cli: Cli) -> None:
    """Refused at load, naming the setting: each used to pass validation, then fail every
    command later (a traceback, a hang, or Celery's reason without the variable's name)."""
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    for variable, value in [
        ("SESSIONSTORE_GC_SCHEDULE", "nan"),
        ("SESSIONSTORE_EXPIRE_SCHEDULE", "99 99 * * *"),
        ("SESSIONSTORE_PUBLISH_RETRY_SECONDS", "inf"),
        ("SESSIONSTORE_DATABASE_URL", "postgresql+asyncpg://x@127.0.0.1/db"),
    ]:
        cli.env[variable] = value
        name = variable.removeprefix("SESSIONSTORE_").lower()
        one_line_error(cli("worker", timeout=60), ExitCode.BAD_CONFIG, f"bad setting {name}")
        del cli.env[variable]


SECRET = "s3cr3t-Pw"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SESSIONSTORE_DATABASE_URL", f"mysql://u:{SECRET}@127.0.0.1/db"),
        ("SESSIONSTORE_DATABASE_URL", f"postgresql://u:{SECRET}@127.0.0.1:99999/db"),
        ("SESSIONSTORE_BROKER_URL", f"redis://:{SECRET}@127.0.0.1:99999/0"),
        ("SESSIONSTORE_BROKER_URL", f"redis://:{SECRET}@127.0.0.1:6379/queue"),
        ("SESSIONSTORE_BROKER_URL", f"memory://:{SECRET}@localhost"),
        ("SESSIONSTORE_RESULT_BACKEND", f"db+mysql://u:{SECRET}@127.0.0.1/db"),
        ("SESSIONSTORE_RESULT_BACKEND", f"redis://:{SECRET}@127.0.0.1:6379/x"),
    ],
)
def test_a_bad_url_is_a_bad_setting_without_its_password(
    cli: Cli, variable: str, value: str
) -> None:
    """One line naming the setting, with the URL's password hidden: the database's printed
    the whole URL, and a bad broker or backend passed, then failed in kombu (a traceback
    with the URL) or hung reconnecting to a port that cannot exist."""
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    cli.env[variable] = value
    name = variable.removeprefix("SESSIONSTORE_").lower()
    for args in (("settings", "--json"), ("worker",), ("health",)):
        result = cli(*args, timeout=60)
        one_line_error(result, ExitCode.BAD_CONFIG, f"bad setting {name}", ":***@")
        assert SECRET not in result.stdout + result.stderr


def test_no_output_shows_a_url_password(cli: Cli) -> None:
    """Good URLs with passwords: the settings dump, health and the demo's question show
    each password as ***."""
    cli.env.update(
        {
            "SESSIONSTORE_DATA_DIR": str(cli.home / "data"),
            "SESSIONSTORE_DATABASE_URL": f"postgresql://u:{SECRET}@127.0.0.1:{free_port()}/db",
            "SESSIONSTORE_BROKER_URL": f"redis://:{SECRET}@127.0.0.1:{free_port()}/0",
            "SESSIONSTORE_RESULT_BACKEND": f"db+postgresql://u:{SECRET}@127.0.0.1:1/results",
            "SESSIONSTORE_BLOB_URL": "s3://bucket/blobs",
        }
    )
    shown = cli("settings", "--json")
    assert shown.returncode == 0, shown.stderr
    assert SECRET not in shown.stdout + shown.stderr
    values = json.loads(shown.stdout)
    assert values["broker_url"] == values["celery_broker_url"]
    assert values["broker_url"].startswith("redis://:***@127.0.0.1:")
    assert values["resolved_database_url"].startswith("postgresql+psycopg://u:***@127.0.0.1:")
    assert values["result_backend"] == "db+postgresql+psycopg://u:***@127.0.0.1:1/results"
    for args, stdin in [(("settings",), None), (("demo", "--use-settings"), "n\n")]:
        result = cli(*args, stdin=stdin, timeout=60)
        assert SECRET not in result.stdout + result.stderr
        assert ":***@" in result.stdout + result.stderr
    health = cli("health", "--timeout", "5", timeout=90)
    assert health.returncode == 1, health.stderr
    assert SECRET not in health.stdout + health.stderr


def test_the_embedded_brokers_url_as_shown_is_the_embedded_broker(cli: Cli) -> None:
    """`settings` shows the embedded broker as filesystem://localhost//; that URL set as
    SESSIONSTORE_BROKER_URL stays the embedded broker (a bad URL is refused now)."""
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    cli.env["SESSIONSTORE_BROKER_URL"] = "filesystem://localhost//"
    shown = cli("settings", "--json")
    assert shown.returncode == 0, shown.stderr
    values = json.loads(shown.stdout)
    assert values["broker_url"] is None
    assert values["celery_broker_url"] == "filesystem://localhost//"


def test_a_mistyped_variable_is_named_on_stderr(cli: Cli) -> None:
    cli.env["SESSIONSTORE_DATABSE_URL"] = "postgresql+psycopg://x@127.0.0.1/db"
    result = cli("settings", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["database_url"] is None  # stdout stays the document
    assert result.stderr == (
        "warning: SESSIONSTORE_DATABSE_URL is no setting and is ignored "
        "(did you mean SESSIONSTORE_DATABASE_URL?)\n"
    )


def test_a_blank_data_dir_is_the_default_not_cwd(cli: Cli) -> None:
    cli.env["SESSIONSTORE_DATA_DIR"] = ""
    assert cli("db", "upgrade").returncode == 0
    assert (cli.home / ".local/share/sessionstore/journal.db").exists()
    assert list(cli.cwd.iterdir()) == []


# --- embedded mode ----------------------------------------------------------------------


@pytest.fixture
def pg_cli(cli: Cli, pg_template: str) -> Iterator[Cli]:
    """``cli`` on an empty PostgreSQL database of its own (no schema)."""
    name = f"ss_cli_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    cli.env["SESSIONSTORE_DATABASE_URL"] = pg_url_for(name)
    cli.env["SESSIONSTORE_DATA_DIR"] = str(cli.home / "data")
    try:
        yield cli
    finally:
        drop_pg_database(name)


@pytest.mark.postgres
def test_postgres_schema_missing_needs_db_upgrade(pg_cli: Cli) -> None:
    one_line_error(pg_cli("sessions", "list"), ExitCode.SCHEMA_NOT_CURRENT, "missing", "db upgrade")
    assert pg_cli("db", "upgrade").returncode == 0
    assert pg_cli("sessions", "list", "--json").returncode == 0


@pytest.mark.postgres
def test_a_downgrade_to_jsonb_is_refused_unless_forced(pg_cli: Cli) -> None:
    """`db downgrade` below 0009 on PostgreSQL holding events rewrote every payload through
    jsonb for good; it is refused (changing nothing) unless --force."""
    assert pg_cli("db", "upgrade").returncode == 0
    assert pg_cli("sessions", "create", "--id", "s1").returncode == 0
    events = json.dumps(_message("hi", "e1")) + "\n"
    assert pg_cli("append", "s1", stdin=events).returncode == 0
    one_line_error(
        pg_cli("db", "downgrade", "0006", "--yes"), ExitCode.FAILED, "past 0009", "--force"
    )
    assert json.loads(pg_cli("db", "current", "--json").stdout)["state"] == "current"
    forced = pg_cli("db", "downgrade", "0006", "--yes", "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout) == {"current": "0006"}


def test_embedded_schema_is_created_on_first_write(cli: Cli) -> None:
    # an append needs a session, so an existing database: none is made for it
    events = json.dumps(_message("hi", "e1")) + "\n"
    one_line_error(cli("append", "s1", stdin=events), ExitCode.DATABASE_MISSING, "no database")
    assert cli("sessions", "create", "--id", "s1").returncode == 0
    assert cli("db", "check").returncode == 0


def test_default_data_dir_is_the_user_data_dir_not_cwd(cli: Cli) -> None:
    shown = json.loads(cli("settings", "--json").stdout)
    assert Path(shown["data_dir"]) == cli.home / ".local/share/sessionstore"
    assert cli("db", "upgrade").returncode == 0
    assert (cli.home / ".local/share/sessionstore/journal.db").exists()
    assert list(cli.cwd.iterdir()) == []


def test_settings_creates_nothing(cli: Cli, tmp_path: Path) -> None:
    """Showing the settings makes no folder: not the data dir, nor the embedded queue's."""
    data = tmp_path / "not-yet"
    cli.env["SESSIONSTORE_DATA_DIR"] = str(data)
    shown = cli("settings", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["celery_broker_url"] == "filesystem://localhost//"
    assert not data.exists()


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_data_dir_that_is_a_file_is_a_bad_setting(cli: Cli, tmp_path: Path, below: str) -> None:
    """Every command says the one thing wrong, as a bad setting, and nothing is made: before,
    each said an errno of its own ("File exists", "Not a directory: .../queue/in")."""
    plain_file = tmp_path / "data"
    plain_file.write_text("not a folder")
    cli.env["SESSIONSTORE_DATA_DIR"] = str(plain_file / below if below else plain_file)
    for args in (("settings",), ("db", "upgrade"), ("sessions", "list"), ("gc",)):
        error = one_line_error(cli(*args), ExitCode.BAD_CONFIG, "data_dir")
        assert f"{plain_file} exists and is not a directory" in error
    assert plain_file.read_text() == "not a folder"


def test_read_only_commands_never_create_a_database(cli: Cli, tmp_path: Path) -> None:
    typo = tmp_path / "typo" / "jounral.db"
    cli.env["SESSIONSTORE_DATABASE_URL"] = f"sqlite:///{typo}"
    for args in (
        ("sessions", "list"),
        ("stats",),
        ("events",),
        ("state", "s1"),
        ("db", "check"),
        ("db", "history"),
        ("dead-letters", "list"),
        ("maintenance-runs",),
    ):
        one_line_error(cli(*args), ExitCode.DATABASE_MISSING, str(typo))
    assert not typo.exists() and not typo.parent.exists()


def test_read_only_commands_never_create_a_data_dir(cli: Cli, tmp_path: Path) -> None:
    """A mistyped data dir is told, and left uncreated: queue status made the embedded
    broker's folders in it before it found no database there."""
    typo = tmp_path / "typo-data"
    cli.env["SESSIONSTORE_DATA_DIR"] = str(typo)
    for args in (
        ("queue", "status"),
        ("sessions", "list"),
        ("blobs", "verify"),
        ("events",),
        ("read", "artifact://1", "--session", "s1"),
        ("export", "s1", "-o", str(tmp_path / "out.jsonl")),
    ):
        one_line_error(cli(*args), ExitCode.DATABASE_MISSING, str(typo / "journal.db"))
        assert not typo.exists(), args
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.postgres
def test_queue_status_of_an_embedded_broker_never_used_makes_no_folder(
    cli: Cli, tmp_path: Path, pg_url: str
) -> None:
    """With the journal on PostgreSQL, a mistyped data dir opens no journal file to fail
    on: queue status made the embedded broker's folders there. A broker no producer nor
    worker has used holds nothing: said so, and nothing is made."""
    typo = tmp_path / "typo-data"
    cli.env.update({"SESSIONSTORE_DATA_DIR": str(typo), "SESSIONSTORE_DATABASE_URL": pg_url})
    done = cli("queue", "status", "--json", "--timeout", "0.5")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert (status["queues"], status["unacked"], status["set_aside"]) == (
        {"sessionstore": 0},
        0,
        0,
    )
    assert status["workers"] == {} and status["broker"] == "filesystem://localhost//"
    assert not typo.exists()


# --- the demo ---------------------------------------------------------------------------


@pytest.fixture
def user_data(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "user-data"
    yield folder


@pytest.mark.slow
def test_demo_never_touches_the_configured_data(cli: Cli, user_data: Path) -> None:
    user_db = user_data / "precious.db"
    cli.env.update(
        {
            "SESSIONSTORE_DATA_DIR": str(user_data),
            "SESSIONSTORE_DATABASE_URL": f"sqlite:///{user_db}",
            "SESSIONSTORE_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
        }
    )
    result = cli("demo", timeout=300)
    assert result.returncode == 0, result.stderr
    where = Path(result.stderr.split("demo data dir: ", 1)[1].split()[0])
    assert not where.exists()
    assert not user_data.exists() and not user_db.exists()
    assert list(cli.cwd.iterdir()) == []

    kept = cli("demo", "--keep", timeout=300)
    assert kept.returncode == 0, kept.stderr
    where = Path(kept.stderr.split("demo data dir: ", 1)[1].split()[0])
    assert (where / "journal.db").exists()
    shutil.rmtree(where)


def test_demo_use_settings_asks_first(cli: Cli, user_data: Path) -> None:
    cli.env["SESSIONSTORE_DATA_DIR"] = str(user_data)
    result = cli("demo", "--use-settings", stdin="n\n")
    assert result.returncode != 0 and "run the demo against" in result.stderr  # not stdout
    assert not user_data.exists()


# --- repository hygiene -----------------------------------------------------------------


def test_no_transport_folders_in_the_repository() -> None:
    assert not (ROOT / "control").exists()
    tracked = subprocess.run(
        ["git", "ls-files", "*.exchange"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout
    assert tracked == ""
