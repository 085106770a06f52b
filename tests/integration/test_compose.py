"""compose.yaml: its structure, and every app service's command run here as a local process.

There is no Docker engine here. The run test translates each app service to this machine the
way compose would run it, with the container names swapped for the test servers: the
``postgres``/``redis`` hosts become the local servers, the database a fresh scratch database,
Redis the test database, ``minio`` a moto S3 server (the bucket the ``bucket`` service
makes, made there), named volumes temporary directories, ``/app`` the checkout. Then:
migrate must exit 0 with the schema at head; the worker must answer a ping (and its compose
healthcheck, ``sessionstore health`` and a ping, must pass) and commit a write whose blob
lands in the S3 bucket; beat must pass its healthcheck, publish its periodic jobs to the
broker queue and record them in its schedule file.
"""

from __future__ import annotations

import json
import os
import re
import shelve
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import redis
import yaml
from sqlalchemy.engine import make_url

from core import SessionStore, Settings, migrate
from tasks import enqueue_append
from tasks.app import QUEUE, beat_schedule, create_app
from tests.conftest import PG_ADMIN_DSN, _unavailable, drop_pg_database, pg_url_for
from tests.support import ROOT, wait_for

COMPOSE_FILE = ROOT / "compose.yaml"
VENV_BIN = Path(sys.executable).parent
APP_SERVICES = {"migrate", "worker", "beat"}
PREFIX = "SESSIONSTORE_"
AWS = "AWS_"  # the standard variables of the S3 client (core/blobs/objects.py)
# What an operator's .env would set to see beat work within a second.
FAST_BEAT = {
    "SESSIONSTORE_GC_SCHEDULE": "1",
    "SESSIONSTORE_EXPIRE_SCHEDULE": "1",
    "SESSIONSTORE_RECONCILE_SCHEDULE": "1",
}
_VARIABLE = re.compile(
    r"\$\$"  # an escaped dollar
    r"|\$\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\}"  # ${NAME}, ${NAME:-default}
    r"|\$(?P<bare>\w+)"  # $NAME
)


# --- reading compose.yaml ------------------------------------------------------------------


def interpolate(value: str, variables: Mapping[str, str]) -> str:
    """Compose's ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$$``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        value = variables.get(name)
        op = match.group("op")
        if op == ":-" and not value:
            return str(match.group("default"))
        if op == "-" and value is None:
            return str(match.group("default"))
        return value or ""

    return _VARIABLE.sub(replace, value)


def resolved(node: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, list):
        return [resolved(item, variables) for item in node]
    if isinstance(node, dict):
        return {key: resolved(item, variables) for key, item in node.items()}
    return node


def load_compose(variables: Mapping[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml with anchors merged (PyYAML) and variables interpolated (as compose does)."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(raw, dict)
    document: dict[str, Any] = resolved(raw, variables or {})
    return document


def argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def option(args: list[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in ``args``."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def named_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> named volume, for ``name:/path[:mode]`` entries."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target = str(entry).split(":")[:2]
        if not source.startswith((".", "/", "~")):
            mounts[target] = source
    return mounts


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = argv(service["healthcheck"]["test"])
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", " ".join(test[1:])]
    assert test[0] == "CMD", test
    return test[1:]


def dockerfile_lines(service: dict[str, Any]) -> list[str]:
    text = service["build"]["dockerfile_inline"].replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


# --- structure -----------------------------------------------------------------------------


def test_declares_the_services(services: dict[str, dict[str, Any]]) -> None:
    assert {"postgres", "redis", "minio", "bucket", "migrate", "worker", "beat"} <= services.keys()
    built = {name for name, svc in services.items() if "build" in svc}
    assert built == APP_SERVICES
    if "flower" in services:  # optional, opt-in
        assert services["flower"].get("profiles")


def test_postgres_is_the_official_image_with_a_pg_isready_healthcheck(
    services: dict[str, dict[str, Any]],
) -> None:
    pg = services["postgres"]
    assert str(pg["image"]).startswith("postgres:")
    check = healthcheck_argv(pg)
    assert "pg_isready" in " ".join(check)
    assert pg["healthcheck"].get("retries", 0) >= 3
    assert "/var/lib/postgresql/data" in named_mounts(pg)


def test_redis_fsyncs_every_write_and_never_evicts(services: dict[str, dict[str, Any]]) -> None:
    rd = services["redis"]
    args = argv(rd["command"])
    assert args[0] == "redis-server"
    assert option(args, "--appendonly") == "yes"
    assert option(args, "--appendfsync") == "always"
    assert option(args, "--maxmemory-policy") == "noeviction"
    assert "/data" in named_mounts(rd), "the AOF must survive the container"
    assert "redis-cli ping" in " ".join(healthcheck_argv(rd))


def test_migrate_runs_alembic_once_after_postgres_is_healthy(
    services: dict[str, dict[str, Any]],
) -> None:
    mig = services["migrate"]
    assert argv(mig["command"]) == ["alembic", "upgrade", "head"]
    assert mig["restart"] == "no"
    assert mig["depends_on"] == {"postgres": {"condition": "service_healthy"}}


@pytest.mark.parametrize("name", ["worker", "beat"])
def test_worker_and_beat_wait_for_healthy_servers_and_a_finished_migrate(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    assert services[name]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
        "bucket": {"condition": "service_completed_successfully"},
    }


@pytest.mark.parametrize("name", ["worker", "beat"])
def test_worker_and_beat_healthchecks_run_sessionstore_health(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    check = " ".join(healthcheck_argv(services[name]))
    assert check.startswith("sessionstore health") or "sh -c sessionstore health" in check
    assert "healthcheck" not in services["migrate"] or services["migrate"]["healthcheck"].get(
        "disable"
    )


def test_minio_is_healthy_before_the_bucket_is_made_and_the_apps_start(
    services: dict[str, dict[str, Any]],
) -> None:
    minio, bucket = services["minio"], services["bucket"]
    assert str(minio["image"]).startswith("minio/minio:")
    assert "/data" in named_mounts(minio), "objects must survive the container"
    assert healthcheck_argv(minio) == ["mc", "ready", "local"]
    assert bucket["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert bucket["restart"] == "no"
    blob_url = urlsplit(services["worker"]["environment"]["SESSIONSTORE_BLOB_URL"])
    assert f"mc mb --ignore-existing s3/{blob_url.hostname}" in " ".join(argv(bucket["command"]))


def test_worker_and_beat_run_our_celery_app(services: dict[str, dict[str, Any]]) -> None:
    """The worker through ``sessionstore worker`` (our app, and the /metrics the dashboard
    scrapes: ``celery worker`` serves none), beat through celery's own command."""
    worker, beat = argv(services["worker"]["command"]), argv(services["beat"]["command"])
    assert worker[:2] == ["sessionstore", "worker"] and option(worker, "--metrics-port")
    assert beat[0] == "celery" and "beat" in beat
    assert option(beat, "--app") == "tasks.app" or option(beat, "-A") == "tasks.app"
    assert option(worker, "--pool") == "prefork"
    assert "inspect ping" in " ".join(healthcheck_argv(services["worker"]))


def test_app_services_share_one_image_built_from_the_repository(
    services: dict[str, dict[str, Any]],
) -> None:
    builds = {json.dumps(services[n]["build"], sort_keys=True) for n in APP_SERVICES}
    assert len(builds) == 1
    assert len({services[n]["image"] for n in APP_SERVICES}) == 1
    lines = dockerfile_lines(services["worker"])
    assert lines[0] == "FROM python:3.11-slim"
    copied: set[str] = set()
    for line in lines:
        if line.startswith("COPY"):
            *sources, _ = line.split()[1:]
            copied |= {s.rstrip("/") for s in sources}
    # What pip install . and alembic need; each must exist, or the build fails.
    assert {"pyproject.toml", "alembic.ini", "core", "tasks", "migrations"} <= copied
    for source in copied:
        assert (ROOT / source).exists(), f"the image COPYs {source}, which is not in the repo"
    workdir = next(line.split()[1] for line in lines if line.startswith("WORKDIR"))
    assert all(services[n]["working_dir"] == workdir for n in APP_SERVICES)


def test_app_configuration_is_sessionstore_settings_only(
    services: dict[str, dict[str, Any]],
) -> None:
    envs = [services[n]["environment"] for n in APP_SERVICES]
    assert all(env == envs[0] for env in envs), "one shared (anchored) environment"
    env = envs[0]
    ours = {k for k in env if not k.startswith(AWS)}
    unknown = {k for k in ours if not k.startswith(PREFIX)} | {
        k for k in ours if k.removeprefix(PREFIX).lower() not in Settings.model_fields
    }
    assert not unknown, f"not a Settings field: {sorted(unknown)}"
    assert urlsplit(env["AWS_ENDPOINT_URL"]).hostname == "minio"
    assert make_url(env["SESSIONSTORE_DATABASE_URL"]).host == "postgres"
    assert urlsplit(env["SESSIONSTORE_BROKER_URL"]).hostname == "redis"
    assert urlsplit(env["SESSIONSTORE_RESULT_BACKEND"]).hostname == "redis"
    settings = settings_from(env)  # the interpolated defaults validate
    assert settings.resolved_database_url.startswith("postgresql+psycopg://")


def test_blobs_and_artifacts_on_s3_and_the_data_dir_on_one_shared_named_volume(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    env = services["worker"]["environment"]
    blobs, artifacts = (
        urlsplit(env["SESSIONSTORE_BLOB_URL"]),
        urlsplit(env["SESSIONSTORE_ARTIFACT_URL"]),
    )
    assert blobs.scheme == artifacts.scheme == "s3"
    assert blobs.hostname == artifacts.hostname  # the one bucket the `bucket` service makes
    assert blobs.path != artifacts.path
    assert "SESSIONSTORE_ARTIFACT_ROOT" not in env
    data_dir = env["SESSIONSTORE_DATA_DIR"]
    volume = named_mounts(services["worker"]).get(data_dir)
    assert volume, "the data dir (caches, upload spools) must be a named volume"
    assert volume in compose["volumes"]
    for name in APP_SERVICES:
        assert named_mounts(services[name]).get(data_dir) == volume


def test_beat_keeps_its_schedule_file_on_a_volume(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    beat = services["beat"]
    schedule = option(argv(beat["command"]), "--schedule") or option(argv(beat["command"]), "-s")
    assert schedule, "beat needs --schedule (the image's /app is not writable)"
    mounts = named_mounts(beat)
    on = [m for m in mounts if Path(schedule).is_relative_to(m)]
    assert on and mounts[on[0]] in compose["volumes"]


def test_interpolation_follows_compose_rules() -> None:
    assert interpolate("${A:-x}|${B-y}|$$H|${C}", {"A": "", "B": ""}) == "x||$H|"
    assert interpolate("${A:-0 3 * * *}", {}) == "0 3 * * *"


# --- running the services here ---------------------------------------------------------------


@dataclass
class LocalService:
    name: str
    args: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None


class Translation:
    """Container world -> this machine."""

    def __init__(
        self, *, database_url: str, redis_url: str, s3_endpoint: str, volumes_dir: Path
    ) -> None:
        self.database = make_url(database_url)
        self.redis_url = redis_url
        self.s3_endpoint = s3_endpoint
        self.volumes_dir = volumes_dir

    def value(self, value: str, mounts: Mapping[str, str]) -> str:
        if value.startswith("postgresql"):
            url = make_url(value)
            assert url.host == "postgres", value
            return url.set(
                username=self.database.username,
                password=self.database.password,
                host=self.database.host,
                port=self.database.port,
                database=self.database.database,
            ).render_as_string(hide_password=False)
        if value.startswith(("redis://", "rediss://")):
            assert urlsplit(value).hostname == "redis", value
            return self.redis_url
        if value.startswith("http://minio:"):
            return self.s3_endpoint
        for target, volume in mounts.items():
            # A mount point at the start of a path (also inside file:///…), not a suffix.
            pattern = rf"(?<![\w.-]){re.escape(target)}(?=/|$)"
            value = re.sub(pattern, str(self.volume(volume)), value)
        return value

    def volume(self, name: str) -> Path:
        path = self.volumes_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def service(self, name: str, spec: dict[str, Any]) -> LocalService:
        mounts = named_mounts(spec)
        env = {k: self.value(str(v), mounts) for k, v in spec["environment"].items()}
        args = [self.value(a, mounts) for a in argv(spec["command"])]
        binary = shutil.which(args[0], path=str(VENV_BIN))
        assert binary, f"{name}: {args[0]} is not installed with the project"
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        path = f"{VENV_BIN}{os.pathsep}{inherited.get('PATH', '')}"
        enabled = "healthcheck" in spec and not spec["healthcheck"].get("disable")
        check = healthcheck_argv(spec) if enabled else None
        return LocalService(name, [binary, *args[1:]], {**inherited, **env, "PATH": path}, check)


def settings_from(env: Mapping[str, str]) -> Settings:
    fields = {k.removeprefix(PREFIX).lower(): v for k, v in env.items() if k.startswith(PREFIX)}
    return Settings.model_validate(fields)


def tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@contextmanager
def running(service: LocalService, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            service.args,
            cwd=ROOT,  # the image's /app
            env=service.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # what `docker compose stop` sends
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def alive(proc: subprocess.Popen[bytes], log: Path) -> None:
    if proc.poll() is not None:
        raise AssertionError(f"exited with {proc.returncode}:\n{tail(log)}")


@pytest.fixture
def scratch_database_url() -> Iterator[str]:
    """A fresh, empty database: migrate has to build the schema itself."""
    name = f"ss_compose_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        _unavailable("PostgreSQL", exc)
    yield pg_url_for(name)
    drop_pg_database(name)


@pytest.fixture
def local(
    scratch_database_url: str, redis_url: str, s3_endpoint: str, tmp_path: Path
) -> dict[str, LocalService]:
    translation = Translation(
        database_url=scratch_database_url,
        redis_url=redis_url,
        s3_endpoint=s3_endpoint,
        volumes_dir=tmp_path / "volumes",
    )
    specs = load_compose(FAST_BEAT)["services"]
    make_bucket(specs["bucket"], s3_endpoint)
    return {name: translation.service(name, specs[name]) for name in sorted(APP_SERVICES)}


def make_bucket(spec: dict[str, Any], endpoint: str) -> None:
    """What the ``bucket`` service does (``mc mb --ignore-existing s3/NAME``), on moto."""
    import urllib.error
    import urllib.request

    found = re.search(r"mc mb --ignore-existing s3/([\w.-]+)", " ".join(argv(spec["command"])))
    assert found, spec["command"]
    try:
        urllib.request.urlopen(
            urllib.request.Request(f"{endpoint}/{found.group(1)}", method="PUT"), timeout=10
        )
    except urllib.error.HTTPError as exc:
        assert exc.code == 409, exc  # already there: --ignore-existing


def bucket_keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    import urllib.request

    url = f"{endpoint}/{bucket}?list-type=2&prefix={prefix}"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return re.findall(r"<Key>([^<]+)</Key>", body)


def run_migrate(service: LocalService, log: Path) -> str:
    with log.open("wb") as out:
        done = subprocess.run(
            service.args,
            cwd=ROOT,
            env=service.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=90,
            check=False,
        )
    assert done.returncode == 0, tail(log)
    url = service.env["SESSIONSTORE_DATABASE_URL"]
    assert migrate.current_revision(url) is not None
    assert migrate.is_current(url)
    return url


def check_worker(service: LocalService, log: Path, tmp_path: Path) -> None:
    settings = settings_from(service.env)
    node = f"worker@{socket.gethostname()}"  # --hostname=worker@%h
    app = create_app(settings)
    try:
        with running(service, log) as proc:

            def answers() -> bool:
                alive(proc, log)
                return bool(app.control.ping(destination=[node], timeout=0.5))

            wait_for(answers, 45, f"{node} to answer a ping", step=0.2)
            assert service.healthcheck is not None
            # The compose healthcheck itself; in a container HOSTNAME is the container's name.
            health = subprocess.run(
                service.healthcheck,
                cwd=ROOT,
                env={**service.env, "HOSTNAME": socket.gethostname()},
                capture_output=True,
                timeout=60,
                check=False,
            )
            assert health.returncode == 0, health.stdout + health.stderr

            # A real write through the worker: the schema, the broker, the results and the
            # blob directory are all the ones compose configured.
            event = {"type": "custom", "customType": "note", "data": "x" * 100_000}
            with SessionStore.from_settings(settings) as store:
                session = store.create_session(tenant_id="compose")
                result = enqueue_append(session.id, [event], app=app).get(timeout=30)
                assert (result.first_seq, result.last_seq) == (1, 1)
                assert store.read(session.id, rehydrate=True)[0].payload == event
                blob_url = urlsplit(settings.resolved_blob_url)
                assert blob_url.scheme == "s3"
                endpoint = service.env["AWS_ENDPOINT_URL"]
                keys = bucket_keys(endpoint, str(blob_url.hostname), "blobs/")
                ref = store.read(session.id)[0].payload["data"]
                assert any(ref.rsplit(":", 1)[-1] in key for key in keys), (ref, keys)
                # an artifact through the configured artifact storage lands in the bucket too
                artifact_id = store.artifacts(session.id).save("compose tool output", "bash")
            art = urlsplit(settings.artifact_url or "")
            listed = bucket_keys(endpoint, str(art.hostname), art.path.strip("/") + "/")
            assert any(k.endswith(f"/{artifact_id}.bash.log") for k in listed), listed
            # the worker's /metrics, on the port compose gives it, counts that write
            port = option(service.args, "--metrics-port")
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
            text = scraped.read().decode()
            assert re.search(r'sessionstore_writes_total\{[^}]*outcome="committed"[^}]*\} 1', text)
    finally:
        app.close()


def check_beat(service: LocalService, log: Path, redis_url: str) -> None:
    jobs = beat_schedule(settings_from(service.env))
    wanted = {job["task"] for job in jobs.values()}
    client = redis.Redis.from_url(redis_url)

    def queued_tasks() -> set[str]:
        return {json.loads(m)["headers"]["task"] for m in client.lrange(QUEUE, 0, -1)}

    try:
        with running(service, log) as proc:

            def published() -> bool:
                alive(proc, log)
                return wanted <= queued_tasks()

            wait_for(published, 45, f"beat to publish {sorted(wanted)}", step=0.2)
            assert service.healthcheck is not None
            health = subprocess.run(
                service.healthcheck, cwd=ROOT, env=service.env, capture_output=True, timeout=60
            )
            assert health.returncode == 0, health.stdout + health.stderr
        assert "Sending due task" in log.read_text()
    finally:
        client.close()
    schedule = Path(str(option(service.args, "--schedule") or option(service.args, "-s")))
    with shelve.open(str(schedule), flag="r") as db:
        entries = db["entries"]
        assert set(jobs) <= entries.keys()
        assert all(entries[name].total_run_count >= 1 for name in jobs)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(150)
def test_each_app_service_comes_up_against_local_servers(
    local: dict[str, LocalService], redis_url: str, tmp_path: Path
) -> None:
    run_migrate(local["migrate"], tmp_path / "migrate.log")
    check_worker(local["worker"], tmp_path / "worker.log", tmp_path)
    # Beat runs with the worker gone, so what it publishes stays in the queue to be seen.
    check_beat(local["beat"], tmp_path / "beat.log", redis_url)
