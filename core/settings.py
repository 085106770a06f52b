"""The one configuration class. Built once by the caller and passed down; never at import."""

from __future__ import annotations

import datetime
import difflib
import functools
import itertools
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.errors import BadConfig
from core.urls import (
    EMBEDDED_BROKER_URL,
    check_broker_url,
    check_database_url,
    check_result_backend,
    database_url_of,
    hide_password,
)

if TYPE_CHECKING:
    from celery.schedules import crontab


log = logging.getLogger(__name__)


def default_data_dir() -> Path:
    """The platform's user data directory, never the current directory."""
    import platformdirs  # only when the default is needed

    return Path(platformdirs.user_data_dir("sessionstore", appauthor=False))


# Marks a setting that the worker and beat (and producers) must all see with the same value:
# they address the same database, broker and folders, and beat's schedule and the worker's
# tasks agree on periods and timeouts. The README's settings table shows the mark.
SHARED: dict[str, Any] = {"worker_and_beat": True}


def shared_optional(description: str) -> Any:
    """An optional setting (default: unset) that worker, beat and producers must share."""
    return Field(default=None, json_schema_extra=SHARED, description=description)


# The upper bound of a duration setting: long enough for any use, short enough that no
# datetime arithmetic with it overflows.
A_YEAR = 366 * 86400.0
# The longest TTL (~317 years): any a caller means, and now plus it still a date. An artifact
# stored with a longer one fails (``OversizedOutputs.store``): a setting is refused at start.
MAX_TTL_S = 10**10
# The shortest schedule period: beat sends each job once a period.
MIN_SCHEDULE_SECONDS = 1.0

# Settings renamed, by their older name: still taken as arguments, and their older
# variables still read (each renamed field lists its variables, new first, in _ENV_ALIASES).
_OLDER_NAMES = {"rehydrate_max_build_seconds": "rehydrate_stall_seconds"}
_ENV_ALIASES = {
    # rehydrate_max_build_seconds bounded a build's whole time; now its time without progress
    "rehydrate_stall_seconds": (
        "SESSIONSTORE_REHYDRATE_STALL_SECONDS",
        "SESSIONSTORE_REHYDRATE_MAX_BUILD_SECONDS",
    ),
}


class Settings(BaseSettings):
    """sessionstore configuration, read from ``SESSIONSTORE_*`` environment variables."""

    # No float setting is NaN or infinite (each also has an upper bound): "inf" hung
    # producers in their retry loop, "nan" failed later in Celery or kombu.
    # hide_input_in_errors: a ValidationError's text (a traceback, a log) quoted each bad
    # value, a URL's password with it; the messages of our own checks show it hidden.
    model_config = SettingsConfigDict(
        env_prefix="SESSIONSTORE_",
        extra="ignore",
        populate_by_name=True,
        allow_inf_nan=False,
        hide_input_in_errors=True,
    )

    data_dir: Path = Field(
        json_schema_extra=SHARED,
        default_factory=lambda: default_data_dir(),
        description="Where the embedded defaults live (journal, blobs, artifacts, the "
        "filesystem broker's folders, the beat schedule). Default: the platform's user data "
        "directory (`~/.local/share/sessionstore` on Linux), also when set blank.",
    )
    database_url: str | None = shared_optional(
        "The journal, as a SQLAlchemy URL (sqlite:///… or postgresql+psycopg://…). "
        "Default: SQLite in the data dir.",
    )
    blob_url: str | None = shared_optional(
        "The blob store: file:///… or s3://bucket/prefix (the AWS_* variables "
        "configure S3). Default: file:// in the data dir.",
    )
    artifact_root: Path | None = shared_optional(
        "The artifact directories, as a path (same as artifact_url=file://…). "
        "Default: in the data dir.",
    )
    artifact_url: str | None = shared_optional(
        "The artifact store: file:///… or s3://bucket/prefix (the AWS_* variables "
        "configure S3). Default: artifact_root, else file:// in the data dir.",
    )
    broker_url: str | None = shared_optional(
        "The Celery broker: redis://host:6379/0 (rediss://… needs ssl_cert_reqs=required, "
        "optional or none when it keeps the results too), or amqp://, amqps://, pyamqp:// "
        "(RabbitMQ). Unset (or `filesystem://localhost//`, as `sessionstore settings` shows "
        "it): the embedded broker, kombu's filesystem transport without its races "
        "(core.broker), in the data dir's `queue/` folder.",
    )
    result_backend: str | None = shared_optional(
        "The Celery result backend: redis://host:6379/1 (rediss://… with ssl_cert_reqs), "
        "rpc://, or db+ and a URL the journal runs on (db+sqlite:///…, "
        "db+postgresql+psycopg://…). Unset: the broker's Redis, or an embedded SQLite result "
        "store.",
    )

    # journal limits
    max_batch_events: int = Field(
        default=1000, ge=1, description="Most events one append may carry."
    )
    max_event_depth: int = Field(
        default=64, ge=2, description="Deepest nesting of objects/arrays inside one event."
    )
    max_write_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description="Largest JSON size of one write (all its events) accepted at enqueue.",
    )

    # blob externalization
    image_min_base64_chars: int = Field(
        default=1024, ge=1, description="Image base64 at least this long is externalized."
    )
    inline_string_limit: int = Field(
        default=16 * 1024,
        ge=1,
        description="Strings larger than this many UTF-8 bytes become blobs.",
    )
    gc_grace_seconds: float = Field(
        json_schema_extra=SHARED,
        default=3600.0,
        ge=0,
        le=A_YEAR,
        description="GC deletes unreferenced blobs only when older than this.",
    )

    # object storage (s3:// blob or artifact URLs)
    s3_request_timeout_seconds: float = Field(
        json_schema_extra=SHARED,
        default=30.0,
        gt=0,
        le=A_YEAR,
        description="One S3 request's time limit (its connect phase at most 5 s of it; a "
        "response that stops sending bytes fails after 10 s).",
    )
    s3_retry_seconds: float = Field(
        json_schema_extra=SHARED,
        default=20.0,
        ge=0,
        le=A_YEAR,
        description="How long a failed or timed-out S3 request is retried before the "
        "operation fails as StorageUnavailable (obstore's own default is 3 minutes).",
    )

    # artifacts
    oversized_output_chars: int = Field(
        default=12_000,
        ge=1,
        description="Tool outputs over this many characters become TTL artifacts.",
    )
    oversized_ttl_seconds: int = Field(
        default=3600, ge=1, le=MAX_TTL_S, description="Default TTL of an oversized-output artifact."
    )
    rehydrate_ttl_seconds: int = Field(
        default=3600,
        ge=1,
        le=MAX_TTL_S,
        description="How long a rehydrated export (sessionstore.rehydrate) is kept.",
    )
    rehydrate_stall_seconds: float = Field(
        default=900.0,
        gt=0,
        le=A_YEAR,
        validation_alias=AliasChoices(*_ENV_ALIASES["rehydrate_stall_seconds"]),
        description="Longest a rehydrated export's build may go without progress (an event "
        "read, a blob read, a line written, a chunk uploaded) and still hold its claim. Past "
        "it the builder stops heart-beating, so a request waiting for the same export takes "
        "the build over 10 s later (a build hung on a stalled blob read blocks no one for "
        "longer); the stalled builder, taken over, discards its output if it ever finishes. "
        "A build that keeps moving is never taken over, however long it runs. Longer than "
        "any single step of a build. Older name, still read: "
        "SESSIONSTORE_REHYDRATE_MAX_BUILD_SECONDS.",
    )
    staging_max_age_seconds: float = Field(
        default=6 * 3600.0,
        ge=3600,
        le=A_YEAR,
        description="Artifact expiry also removes temporary files a killed process left "
        "this long ago.",
    )
    output_spill_bytes: int = Field(
        default=50 * 1024, ge=1, description="OutputSink tail window; beyond it output spills."
    )
    quota_file_bytes: int = Field(default=1024 * 1024, ge=1, description="Largest artifact file.")
    quota_session_bytes: int = Field(
        default=50 * 1024 * 1024, ge=1, description="Artifact bytes per session."
    )
    quota_tenant_bytes: int = Field(
        default=500 * 1024 * 1024, ge=1, description="Artifact bytes per tenant."
    )

    # query layer
    snapshot_every: int = Field(
        default=500, ge=0, description="Store a state snapshot every N events (0 disables)."
    )

    # queue and maintenance
    task_visibility_timeout: int = Field(
        json_schema_extra=SHARED,
        default=3600,
        ge=10,
        le=int(A_YEAR),
        description="Seconds before an unacked Redis message is redelivered; longer than any task.",
    )
    publish_retry_seconds: float = Field(
        default=120.0,
        ge=0,
        le=3600,
        description="How long a producer keeps retrying to publish while the broker is "
        "unreachable (reconnecting every 0.5-2 s); then the enqueue raises. At most 3600.",
    )
    task_max_retries: int = Field(
        default=20, ge=0, description="Retries of a transient failure before dead-lettering."
    )
    task_max_deliveries: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="Deliveries of a message that never finishes (killed at the hard "
        "time limit, or its worker lost, each time) before its write is dead-lettered "
        "(counted on Redis and on the embedded broker; on RabbitMQ in a Redis result "
        "backend, and with any other backend not at all).",
    )
    gc_schedule: str = Field(
        json_schema_extra=SHARED,
        default="3600",
        description="Beat schedule of blob GC: seconds (1 to a year), or a crontab like "
        "'0 3 * * *'.",
    )
    expire_schedule: str = Field(
        json_schema_extra=SHARED,
        default="300",
        description="Beat schedule of artifact TTL expiry (seconds or crontab).",
    )
    reconcile_schedule: str = Field(
        json_schema_extra=SHARED,
        default="60",
        description="Beat schedule of the fork-copy reconciler (seconds or crontab).",
    )
    fork_copy_timeout_seconds: float = Field(
        json_schema_extra=SHARED,
        default=300.0,
        gt=0,
        le=A_YEAR,
        description="A fork copy still pending after this long is re-enqueued.",
    )

    @field_validator("database_url", "blob_url", "broker_url", "result_backend", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: Any) -> Any:
        return value or None

    @field_validator("artifact_url")
    @classmethod
    def _artifact_url(cls, value: str | None) -> str | None:
        """One spelling of each place: a bare path is its ``file://`` URL (resolved), an
        ``s3://`` URL loses a trailing ``/``. Every reader of the setting (the storage, the
        artifact root, whether it is on the filesystem) then sees the same directory: a bare
        path used to open that directory as storage while the root stayed in the data dir."""
        if not value:
            return None
        from core.artifacts.storage import artifact_url_of  # no import cycle at load

        try:
            return artifact_url_of(value)
        except BadConfig as exc:
            raise ValueError(str(exc)) from None

    @field_validator("data_dir", mode="before")
    @classmethod
    def _blank_data_dir_is_unset(cls, value: Any) -> Any:
        # Path("") is the current directory: a blank variable (an unset ${VAR} in compose)
        # would put the journal wherever the process started.
        return default_data_dir() if value == "" else value

    @field_validator("data_dir")
    @classmethod
    def _data_dir_can_be_a_directory(cls, value: Path) -> Path:
        """A regular file in its place (or in a parent's) is refused here, rather than by
        whichever command first makes a folder in it, each with an errno of its own."""
        for place in (value, *value.parents):  # the first of them that exists
            try:
                if not place.exists():
                    continue
                if not place.is_dir():
                    where = "" if place == value else f"{value}: "
                    raise ValueError(f"{where}{place} exists and is not a directory")
            except OSError:  # unreadable: whatever uses it reports why
                pass
            break
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if value:
            value = database_url_of(value)
            check_database_url(value)
        return value

    @field_validator("broker_url")
    @classmethod
    def _broker_url(cls, value: str | None) -> str | None:
        if value == EMBEDDED_BROKER_URL:  # as `sessionstore settings` shows the embedded one
            return None
        if value:
            check_broker_url(value)  # as kombu will read it, so a bad one is refused here
        return value

    @field_validator("result_backend")
    @classmethod
    def _result_backend(cls, value: str | None) -> str | None:
        if value:
            if value.startswith("db+"):  # Celery's database backend: the journal's drivers
                value = "db+" + database_url_of(value.removeprefix("db+"))
            check_result_backend(value)
        return value

    @field_validator("gc_schedule", "expire_schedule", "reconcile_schedule")
    @classmethod
    def _check_schedule(cls, value: str) -> str:
        parse_schedule(value)  # as beat will, so a value it cannot use is refused here
        return value

    @model_validator(mode="before")
    @classmethod
    def _older_names(cls, data: Any) -> Any:
        """A setting's older name is still taken as an argument (an argument outranks the
        environment; the new name outranks the old one)."""
        if not isinstance(data, dict) or not _OLDER_NAMES.keys() & data.keys():
            return data
        data = dict(data)
        for older, name in _OLDER_NAMES.items():
            if older in data:
                value = data.pop(older)
                if name not in data:
                    data[name] = value
                    for alias in _ENV_ALIASES.get(name, ()):  # read from the environment
                        data.pop(alias, None)
        return data

    @model_validator(mode="after")
    def _check_urls(self) -> Settings:
        if self.result_backend is None and self.broker_url and self.broker_url.startswith("redis"):
            try:  # the broker's Redis keeps the results too (tasks.app)
                check_result_backend(self.broker_url)
            except ValueError as exc:
                raise ValueError(f"broker_url (also the result backend): {exc}") from None
        if not self.resolved_blob_url.startswith(("file://", "s3://")):
            shown = hide_password(self.resolved_blob_url)
            raise ValueError(f"blob_url must be file:///… or s3://bucket/prefix, got {shown!r}")
        return self

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'journal.db').resolve()}"

    @property
    def resolved_blob_url(self) -> str:
        if self.blob_url:
            return self.blob_url
        return (self.data_dir / "blobs").resolve().as_uri()

    @property
    def resolved_artifact_root(self) -> Path:
        """The filesystem artifact root (with artifact_url=file://…, its path)."""
        if self.artifact_url and self.artifact_url.startswith("file:"):
            from urllib.parse import urlparse
            from urllib.request import url2pathname

            return Path(url2pathname(urlparse(self.artifact_url).path)).resolve()
        if self.artifact_root is not None:
            return self.artifact_root.resolve()
        return (self.data_dir / "artifacts").resolve()

    @property
    def resolved_artifact_url(self) -> str:
        """``artifact_url`` if set, else ``artifact_root`` (or the data dir's) as file://."""
        if self.artifact_url:
            return self.artifact_url
        return self.resolved_artifact_root.as_uri()

    @property
    def artifacts_on_filesystem(self) -> bool:
        return self.resolved_artifact_url.startswith("file:")

    @property
    def s3_limits(self) -> tuple[float, float]:
        """(request timeout, retry window) in seconds, for ``open_s3_store``."""
        return self.s3_request_timeout_seconds, self.s3_retry_seconds

    @property
    def artifact_spool_dir(self) -> Path:
        """Where streamed artifact writes to object storage are spooled (a cache)."""
        return (self.data_dir / "cache" / "artifact-spool").resolve()

    @property
    def rehydrate_max_build_seconds(self) -> float:
        """The older name of ``rehydrate_stall_seconds`` (it is no longer a bound on a
        build's whole time)."""
        return self.rehydrate_stall_seconds

    @property
    def is_embedded_broker(self) -> bool:
        return self.broker_url is None

    def with_overrides(self, **changes: Any) -> Settings:
        """A validated copy with some fields changed (tests and the CLI use it)."""
        for older, name in _OLDER_NAMES.items():
            if older in changes and name not in changes:
                changes[name] = changes.pop(older)
        return type(self).model_validate({**self.model_dump(), **changes})


# SESSIONSTORE_* variables that are no setting but are read elsewhere: the CLI's, and the
# test suite's and the benchmarks' (theirs also by prefix).
_OTHER_VARIABLES = {
    "SESSIONSTORE_DEBUG",
    "SESSIONSTORE_VENV",  # ./bootstrap's
    "SESSIONSTORE_REQUIRE_SERVICES",
    "SESSIONSTORE_CRASH_LOOP_RUNS",
    "SESSIONSTORE_GC_RACE_SECONDS",
    "SESSIONSTORE_BEAT_TEST_SECONDS",
}
_OTHER_PREFIXES = ("SESSIONSTORE_TEST_", "SESSIONSTORE_BENCH_")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each ``SESSIONSTORE_*`` variable in ``environ`` that nothing reads, naming
    the closest setting: a mistyped one (SESSIONSTORE_DATABSE_URL) was silently ignored."""
    names = {f"SESSIONSTORE_{name.upper()}" for name in Settings.model_fields}
    names.update(*_ENV_ALIASES.values())
    known = {name.removeprefix("SESSIONSTORE_") for name in names}
    lines = []
    for variable in sorted(environ, key=str.upper):
        upper = variable.upper()  # pydantic-settings reads them case-insensitively
        if not upper.startswith("SESSIONSTORE_") or upper.startswith(_OTHER_PREFIXES):
            continue
        if upper in names or upper in _OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(upper.removeprefix("SESSIONSTORE_"), known, n=1)
        hint = f" (did you mean SESSIONSTORE_{close[0]}?)" if close else ""
        lines.append(f"{variable} is no setting and is ignored{hint}")
    return lines


@functools.cache
def warn_unknown_variables() -> None:
    """Log each line of ``unknown_variables`` of this process's environment, once (on
    stderr where logging is not configured, as in the CLI)."""
    for line in unknown_variables(os.environ):
        log.warning(line)


def parse_schedule(value: str) -> float | crontab:
    """Seconds (``"300"``, from MIN_SCHEDULE_SECONDS to A_YEAR) or a five-field crontab
    (``"0 3 * * *"``); ValueError with the reason otherwise."""
    fields = value.split()
    if len(fields) == 5:
        # only for a crontab: seconds (every default) need no Celery, and a store or a CLI
        # command that never schedules loads none (~0.1 s of a command's start)
        from celery.schedules import crontab

        minute, hour, day_of_month, month_of_year, day_of_week = fields
        try:
            # celery refuses one that never runs too ("0 0 30 2 *"): every (day, month) pair
            # it allows falls on each weekday within 28 years
            return crontab(minute, hour, day_of_week, day_of_month, month_of_year)
        except ValueError as exc:  # celery's reason: "Invalid end range: 99 > 23."
            raise ValueError(f"bad crontab {value!r}: {exc}") from None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"must be seconds or a five-field crontab, got {value!r}") from None
    if not MIN_SCHEDULE_SECONDS <= seconds <= A_YEAR:  # NaN too
        raise ValueError(
            f"schedule seconds must be from {MIN_SCHEDULE_SECONDS:g} to {A_YEAR:.0f} (a year), "
            f"got {value!r}"
        )
    return seconds


def crontab_period(cron: crontab) -> float | None:
    """The shortest time between two runs of ``cron``, in seconds (None if it never runs):
    a crontab job's message expires after it, as a seconds job's expires after its interval.

    Counted over 2000-2027, a whole cycle of weekdays and leap years (Celery matches a date
    when its day of month, month and day of week all match)."""
    times = tuple(sorted(h * 3600 + m * 60 for h in cron.hour for m in cron.minute))
    fields = cron.month_of_year, cron.day_of_month, cron.day_of_week
    return _period(times, *map(frozenset, fields))


@functools.lru_cache(maxsize=64)  # ~5 ms a crontab; each app's beat schedule asks again
def _period(
    times: tuple[int, ...],
    months: frozenset[int],
    days: frozenset[int],
    weekdays: frozenset[int],
) -> float | None:
    shortest = min((b - a for a, b in itertools.pairwise(times)), default=None)
    first = datetime.date(2000, 1, 1).toordinal()
    runs = [
        n
        for n in range(first, datetime.date(2028, 1, 1).toordinal())
        if (d := datetime.date.fromordinal(n)).month in months
        and d.day in days
        and n % 7 in weekdays  # Celery: Sunday is 0, and date(1, 1, 1), ordinal 1, a Monday
    ]
    if not runs:
        return None
    for a, b in itertools.pairwise(runs):
        gap = (b - a) * 86400 + times[0] - times[-1]
        shortest = gap if shortest is None else min(shortest, gap)
    return float(shortest) if shortest is not None else 28 * A_YEAR  # one run in 28 years


def settings_markdown() -> str:
    """The configuration table of the README, generated from ``Settings`` (a test keeps the
    README in sync with it)."""
    rows = [
        "| variable | default | same on worker and beat | what it sets |",
        "|---|---|---|---|",
    ]
    for name, info in Settings.model_fields.items():
        default = info.default
        if info.default_factory is not None:
            shown = "(see text)"
        else:
            shown = "—" if default is None else f"`{default}`"
        extra = info.json_schema_extra
        shared = "yes" if isinstance(extra, dict) and extra.get("worker_and_beat") else ""
        rows.append(
            f"| `SESSIONSTORE_{name.upper()}` | {shown} | {shared} | {info.description or ''} |"
        )
    return "\n".join(rows)
