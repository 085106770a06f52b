"""``sessionstore health`` through the real CLI: each backend checked, failures named."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli_process import run_cli
from tests.support import free_port


def _health(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    run = run_cli(
        "health", "--json", "--timeout", "8", *args, env={**os.environ, **env}, timeout=60
    )
    return run.returncode, json.loads(run.stdout)


def _failed(report: dict[str, Any]) -> list[str]:
    return [c["name"] for c in report["checks"] if not c["ok"]]


def test_embedded_defaults_are_healthy_once_migrated(tmp_path: Path) -> None:
    env = {"SESSIONSTORE_DATA_DIR": str(tmp_path / "data")}
    code, report = _health(env)
    assert code == 1 and _failed(report) == ["database"]  # never created by a check
    assert "no database at" in report["checks"][0]["detail"]
    # nor anything else: the storage and broker folders were made in the data dir
    assert not (tmp_path / "data").exists()
    details = {c["name"]: c["detail"] for c in report["checks"]}
    assert details["blobs"].startswith(f"blob directory {tmp_path / 'data'}")
    assert details["broker"].startswith(f"embedded broker folder {tmp_path / 'data'}")
    assert all(
        details[name].endswith(f"is not there yet: it can be made in {tmp_path}")
        for name in ("blobs", "artifacts", "broker")
    ), details
    assert run_cli("db", "upgrade", env={**os.environ, **env}).returncode == 0
    code, report = _health(env)
    assert (code, _failed(report)) == (0, [])
    assert {c["name"] for c in report["checks"]} == {"database", "blobs", "artifacts", "broker"}


def test_a_timeout_no_check_can_wait_is_a_usage_error(tmp_path: Path) -> None:
    """1e400 (inf) passed the option's minimum and every check then failed on an
    OverflowError, reported as the storage being down."""
    env = {**os.environ, "SESSIONSTORE_DATA_DIR": str(tmp_path / "data")}
    for value in ("1e400", "3601"):
        run = run_cli("health", "--timeout", value, env=env)
        assert run.returncode == 2 and "--timeout" in run.stderr, (value, run.stderr)


def test_a_dead_broker_and_a_dead_database_are_named(tmp_path: Path) -> None:
    closed = free_port()
    env = {
        "SESSIONSTORE_DATA_DIR": str(tmp_path / "data"),
        "SESSIONSTORE_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:{closed}/x",
        "SESSIONSTORE_BROKER_URL": f"redis://127.0.0.1:{closed}/0",
    }
    code, report = _health(env)
    assert code == 1 and sorted(_failed(report)) == ["broker", "database"]


@pytest.mark.postgres
def test_postgres_redis_and_s3_healthy_then_s3_stopped(
    pg_url: str, redis_url: str, s3_bucket: str, tmp_path: Path
) -> None:
    env = {
        "SESSIONSTORE_DATA_DIR": str(tmp_path / "data"),
        "SESSIONSTORE_DATABASE_URL": pg_url,
        "SESSIONSTORE_BROKER_URL": redis_url,
        "SESSIONSTORE_BLOB_URL": f"{s3_bucket}/blobs",
    }
    code, report = _health(env)
    assert (code, _failed(report)) == (0, [])
    blobs = next(c for c in report["checks"] if c["name"] == "blobs")
    assert blobs["detail"].startswith("object store s3://")
    stopped = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, report = _health({**env, "AWS_ENDPOINT_URL": stopped, "AWS_MAX_RETRIES": "0"})
    assert code == 1 and _failed(report) == ["blobs"]


def test_an_s3_endpoint_that_never_answers_fails_blob_storage_within_the_timeout(
    black_hole: str, tmp_path: Path
) -> None:
    env = {
        "SESSIONSTORE_DATA_DIR": str(tmp_path / "data"),
        "SESSIONSTORE_BLOB_URL": "s3://hung/blobs",
        "SESSIONSTORE_ARTIFACT_URL": "s3://hung/artifacts",
        "AWS_ENDPOINT_URL": black_hole,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    assert run_cli("db", "upgrade", env={**os.environ, **env}).returncode == 0
    started = time.monotonic()
    run = run_cli("health", "--json", "--timeout", "3", env={**os.environ, **env}, timeout=60)
    elapsed = time.monotonic() - started
    report = json.loads(run.stdout)
    assert run.returncode == 1 and sorted(_failed(report)) == ["artifacts", "blobs"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["blobs"]["detail"] == "no answer within 3 s"
    assert checks["blobs"]["seconds"] < 4
    # The command itself ends with its report: a hung check does not keep the process up
    # (obstore retries a silent endpoint for minutes). Start-up under load gets the slack.
    assert elapsed < 3 + 12, f"health took {elapsed:.1f} s with --timeout 3"
