"""Values ``Settings`` must refuse (or take as unset) at load, naming the setting, rather
than let a command fail later in Celery, kombu or SQLAlchemy."""

from __future__ import annotations

import datetime
import itertools
import subprocess
import sys

import pydantic
import pytest

from core.settings import Settings, crontab_period, default_data_dir, parse_schedule
from tasks.app import _publish_attempts, beat_schedule


def _refused(name: str, value: object) -> str:
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings(**{name: value})
    first = caught.value.errors()[0]
    assert first["loc"] == (name,), first
    return str(first["msg"])


@pytest.mark.parametrize("name", ["gc_schedule", "expire_schedule", "reconcile_schedule"])
@pytest.mark.parametrize(
    "value", ["nan", "inf", "-inf", "0", "-5", "0.001", "1e400", "99 99 * * *", "a b c d e"]
)
def test_a_schedule_celery_cannot_use_is_refused(name: str, value: str) -> None:
    _refused(name, value)


def test_a_bad_crontab_is_refused_with_celerys_reason() -> None:
    assert "99 > 23" in _refused("gc_schedule", "0 99 * * *")


def test_good_schedules_still_load() -> None:
    settings = Settings(gc_schedule="0 3 * * *", expire_schedule="1", reconcile_schedule="2.5")
    assert set(beat_schedule(settings)) == {"gc-blobs", "expire-artifacts", "reconcile-forks"}


def test_every_job_expires_after_its_period_crontab_too() -> None:
    """The README: each job expires after one period, so a backlog never piles up while
    the workers are away; a crontab's period is its shortest time between two runs."""
    settings = Settings(
        gc_schedule="0 3 * * *", expire_schedule="*/5 * * * 1-5", reconcile_schedule="90"
    )
    jobs = beat_schedule(settings)
    assert jobs["gc-blobs"]["options"]["expires"] == 86400
    assert jobs["expire-artifacts"]["options"]["expires"] == 300
    assert jobs["reconcile-forks"]["options"]["expires"] == 90


@pytest.mark.parametrize(
    "value",
    [
        "* * * * *",
        "0 3 * * *",
        "30 1,23 * * *",
        "0 3 * * 1,2",
        "0 0 1 * *",
        "15 12 * * 0",
        "0 0 29 2 *",
        "0 0 31 * *",
        "0 */7 * * *",
        "5,55 * 13 * 5",
    ],
)
def test_a_crontabs_period_is_its_shortest_gap_as_celery_steps_it(value: str) -> None:
    """Celery's own schedule is the oracle: step it run by run over four years from a fixed
    day (its ``nowfun`` moved to each run) and take the shortest gap."""
    from celery.schedules import crontab

    cron = parse_schedule(value)
    assert isinstance(cron, crontab)
    now = [datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)]
    stepped = crontab(
        cron._orig_minute,
        cron._orig_hour,
        cron._orig_day_of_week,
        cron._orig_day_of_month,
        cron._orig_month_of_year,
        nowfun=lambda: now[0],
    )
    runs: list[datetime.datetime] = []
    end = datetime.datetime(2028, 1, 1, tzinfo=datetime.UTC)
    while now[0] < end and len(runs) < 3000:
        now[0] = now[0] + stepped.remaining_estimate(now[0])
        runs.append(now[0])
        now[0] += datetime.timedelta(seconds=1)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(runs)]
    assert crontab_period(cron) == min(gaps)


@pytest.mark.parametrize(
    "name",
    [
        "publish_retry_seconds",
        "fork_copy_timeout_seconds",
        "s3_request_timeout_seconds",
        "s3_retry_seconds",
        "gc_grace_seconds",
        "rehydrate_stall_seconds",
        "staging_max_age_seconds",
    ],
)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e12"])
def test_a_float_setting_is_finite_and_bounded(name: str, value: str) -> None:
    _refused(name, value)


@pytest.mark.parametrize(
    ("name", "largest"),
    [
        ("oversized_ttl_seconds", 10**10),
        ("rehydrate_ttl_seconds", 10**10),
        ("task_visibility_timeout", 366 * 86400),
    ],
)
def test_a_ttl_or_timeout_that_no_date_or_broker_can_hold_is_refused(
    name: str, largest: int
) -> None:
    """An oversized-output TTL past ~317 years was accepted, and then every tool output over
    the threshold failed to store (now plus it is no date); a visibility timeout past a year
    went into Redis expiries. Refused at start, as the seconds given as floats are."""
    _refused(name, str(largest + 1))
    _refused(name, "99999999999999999999999")
    assert getattr(Settings(**{name: largest}), name) == largest


def test_publish_attempts_add_up_to_the_setting() -> None:
    # 0 + 0.5 + 1 + 1.5 = 3 s, then 2 s each: 3 + 2 * 1799 = 3601 >= 3600 (counted, not looped)
    assert _publish_attempts(3600) == 4 + 1799
    waits = (0, 0.5, 1, 3, 3.5, 5, 5.01, 120)
    assert [_publish_attempts(s) for s in waits] == [0, 2, 3, 4, 5, 5, 6, 63]


def test_a_blank_data_dir_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIONSTORE_DATA_DIR", "")
    assert Settings().data_dir == default_data_dir()
    assert Settings(data_dir="").data_dir == default_data_dir()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+asyncpg://x@127.0.0.1/db",
        "postgresql+psycopg2://x@127.0.0.1/db",
        "sqlitefoo:///x.db",
        "sqlite+aiosqlite:///x.db",
        "mysql://x@127.0.0.1/db",
        "not a url",
    ],
)
def test_a_database_url_without_its_driver_is_refused(url: str) -> None:
    assert "postgresql+psycopg://" in _refused("database_url", url)


@pytest.mark.parametrize(
    "url", ["sqlite:///x.db", "sqlite+pysqlite:///x.db", "postgresql+psycopg://x@127.0.0.1/db"]
)
def test_a_supported_database_url_loads(url: str) -> None:
    assert Settings(database_url=url).resolved_database_url == url


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_a_plain_postgresql_url_is_read_through_psycopg(scheme: str) -> None:
    """The URL most deployments write: SQLAlchemy's default driver for it (psycopg2) is not
    installed, so every command failed on an import; psycopg is the one installed."""
    settings = Settings(database_url=f"{scheme}://x@127.0.0.1:5432/db")
    assert settings.resolved_database_url == "postgresql+psycopg://x@127.0.0.1:5432/db"


def test_an_unknown_variable_is_named_with_the_closest_setting() -> None:
    from core.settings import unknown_variables

    environ = {
        "SESSIONSTORE_DATABSE_URL": "postgresql+psycopg://x@h/db",
        "SESSIONSTORE_NOTHING_LIKE_IT": "1",
        "SESSIONSTORE_DATABASE_URL": "sqlite:///x.db",  # known: a field
        "SESSIONSTORE_REHYDRATE_MAX_BUILD_SECONDS": "9",  # known: an older name
        "SESSIONSTORE_DEBUG": "1",  # known: the CLI's
        "SESSIONSTORE_TEST_REDIS_URL": "redis://h",  # known: the test suite's
        "SESSIONSTORE_REQUIRE_SERVICES": "1",
        "OTHER_DATABSE_URL": "x",
    }
    found = unknown_variables(environ)
    assert len(found) == 2, found
    assert "SESSIONSTORE_DATABSE_URL" in found[0] and "SESSIONSTORE_DATABASE_URL?" in found[0]
    assert "SESSIONSTORE_NOTHING_LIKE_IT" in found[1] and "?" not in found[1]


def test_settings_of_seconds_load_no_celery() -> None:
    """A schedule in seconds (every default) is read without Celery: the crontab check
    imported it for every store and CLI command (~0.1 s of each start)."""
    script = (
        "import sys; from core import Settings; Settings(); "
        "assert 'celery.schedules' not in sys.modules, 'celery loaded'"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_bootstraps_own_variable_is_no_typo() -> None:
    from core.settings import unknown_variables

    assert unknown_variables({"SESSIONSTORE_VENV": "/opt/venv"}) == []


def test_the_clis_job_names_are_the_run_logs() -> None:
    from core.maintenance.runs import JOBS
    from tasks.cli import maintenance

    assert maintenance.JOBS == JOBS
