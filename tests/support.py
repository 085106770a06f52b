"""Test machinery: a cuttable TCP proxy, a private redis-server, and celery worker processes."""

from __future__ import annotations

import ctypes
import errno
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu import Connection
from sqlalchemy import update

from core import SessionStore, Settings
from core.blobs.store import BlobStore, PutResult
from core.models import ArtifactRow, table_of, utcnow
from tasks import AppendHandle
from tasks.app import celery_config
from tasks.outcomes import write_task_id

ROOT = Path(__file__).resolve().parent.parent


def store_examples(max_examples: int) -> hypothesis.settings:
    """Hypothesis settings for a property of a real store: the store is the test's fixture
    (each example makes a session of its own), and an example takes what its I/O takes."""
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[
            hypothesis.HealthCheck.function_scoped_fixture,
            hypothesis.HealthCheck.too_slow,
        ],
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def json_lines(text: str) -> list[dict[str, Any]]:
    """JSON Lines output (``import --json``): each line one JSON object, nothing else."""
    import json

    found = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert all(isinstance(value, dict) for value in found), found
    return found


def stored_header(store: Any, tenant_id: str, external_id: str) -> dict[str, Any]:
    """The header (the event at seq 1) of the session of ``external_id`` in the tenant."""
    session = store.journal.find_external(tenant_id, external_id)
    assert session is not None, (tenant_id, external_id)
    return dict(store.read(session.id, upto_seq=1)[0].payload)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, step: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class TcpProxy:
    """Forwards 127.0.0.1:<port> to an upstream; ``cut()`` drops every connection and refuses
    new ones until ``restore()``: the database is "unavailable" to whoever uses the proxy."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = free_port()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open = threading.Event()
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._open.set()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        self._open.clear()
        if self._listener is not None:
            with suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            for conn in self._conns:
                with suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self._conns.clear()

    close = cut

    def _accept(self, listener: socket.socket) -> None:
        while self._open.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class DiskFull:
    """While ``full`` is set, every write to a file under ``root`` fails with ENOSPC, as
    on a full disk; other files (the journal, the broker's) are untouched. The fault sits
    at the ``os.write`` boundary, so it needs no mount (and no root); ``refused`` counts
    the writes it failed. Install it with ``monkeypatch.setattr(os, "write", fault.write)``.
    """

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.full = threading.Event()
        self.refused = 0
        self._real_write = os.write

    def write(self, fd: int, data: Any) -> int:
        if self.full.is_set() and self._under_root(fd):
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._real_write(fd, data)

    def _under_root(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root + os.sep)
        except OSError:  # a pipe or socket closed meanwhile: not a file of ours
            return False


class FileFault:
    """While ``failing`` is set, the ``os`` functions it wraps (``wrap``) fail with
    ``code`` (EIO: a failing disk) for paths under ``root``; other files are untouched.
    Paths given relative to a directory descriptor (``dir_fd=``, ``src_dir_fd=``, as
    ``core.nofollow`` passes them) are resolved through ``/proc/self/fd``. ``refused``
    counts the calls it failed. Install: ``fault.install(monkeypatch, "open", "unlink")``, or
    ``os.open = fault.wrap(os.open)`` in a process of its own.
    """

    def __init__(self, root: Path, code: int = errno.EIO) -> None:
        self.root = os.path.realpath(root)
        self.code = code
        self.failing = threading.Event()
        self.failing.set()
        self.refused = 0

    def install(self, monkeypatch: pytest.MonkeyPatch, *calls: str) -> FileFault:
        """Wrap each of the named ``os`` functions for the test; this fault."""
        for name in calls:
            monkeypatch.setattr(os, name, self.wrap(getattr(os, name)))
        return self

    def wrap(self, func: Callable[..., Any]) -> Callable[..., Any]:
        def faulty(path: Any, *args: Any, **kwargs: Any) -> Any:
            if self.failing.is_set() and self._under_root(path, kwargs):
                self.refused += 1
                raise OSError(self.code, os.strerror(self.code), os.fsdecode(path))
            return func(path, *args, **kwargs)

        return faulty

    def _under_root(self, path: Any, kwargs: dict[str, Any]) -> bool:
        if isinstance(path, int):
            return False
        dir_fd = kwargs.get("dir_fd", kwargs.get("src_dir_fd"))
        try:
            base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
        except OSError:
            return False
        full = os.path.join(base, os.fsdecode(path))
        return full == self.root or full.startswith(self.root + os.sep)


class RedisServer:
    """A private, persistent redis-server (AOF, fsync always) that a test may kill -9."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.binary = binary

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_for(up, 20, "redis-server to accept connections")
        client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None


@contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.kill()


# prctl(2)'s PR_SET_PDEATHSIG: the signal a process gets when the thread that forked it ends
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
# The thread every such child is forked from: the signal follows the forking thread, not
# the process, so a child forked by a test's short-lived thread would be signalled when
# that thread ended. This one lives as long as the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")


def spawn(args: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **popen)`` for a child that must not outlive this process:
    on Linux it gets SIGTERM when this process ends, however it ends (a killed pytest left
    its celery workers running, taking messages from other runs' Redis databases)."""
    if _LIBC is None:
        return subprocess.Popen(args, **popen)
    dies_with = partial(_die_with, os.getpid())
    return _SPAWNER.submit(lambda: subprocess.Popen(args, preexec_fn=dies_with, **popen)).result()


def _die_with(parent: int) -> None:
    """In the child, before it execs (the setting survives the exec): SIGTERM when the
    parent ends, and at once if it has already."""
    assert _LIBC is not None
    if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


class CeleryProcess:
    """``celery -A tasks.app ARGS`` as a subprocess in its own process group, logging to a
    file; it ends when this process does (``spawn``)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = spawn(
                [sys.executable, "-m", "celery", "-A", "tasks.app", *args],
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL the whole group: main process and pool children, no goodbye."""
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class WorkerProcess(CeleryProcess):
    """A prefork worker."""

    def __init__(
        self, env: dict[str, str], log: Path, *, concurrency: int = 2, include: str | None = None
    ) -> None:
        args = [
            "worker",
            "--pool",
            "prefork",
            "-c",
            str(concurrency),
            "-l",
            "info",
            "-n",
            f"w{time.monotonic_ns()}@%h",
            "--without-mingle",
            "--without-gossip",
        ]
        super().__init__([*args, "-I", include] if include else args, env, log)


class SupervisedWorker:
    """A prefork worker restarted whenever it exits, as a supervisor (compose's restart
    policy) restarts one: a worker that loses its broker at an unlucky moment may give up
    (kombu's "Unrecoverable error"), and must then have exited non-zero (``exits``)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self._env, self._log = env, log
        self.workers = [WorkerProcess(env, log)]
        self.exits: list[int] = []
        self._failure: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._supervise, daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        try:
            while not self._done.is_set():
                code = self.workers[-1].proc.poll()
                if code is not None:
                    self.exits.append(code)
                    self.workers.append(WorkerProcess(self._env, self._log))
                self._done.wait(0.2)
        except BaseException as exc:  # no worker started again: said at stop, not hidden
            self._failure = exc

    def stop(self) -> None:
        """Stop supervising, then every worker; raises what stopped the supervisor."""
        self._done.set()
        self._thread.join(30)
        for worker in self.workers:
            worker.stop()
        if self._failure is not None:
            raise AssertionError("the supervisor failed to start a worker") from self._failure


class BeatProcess(CeleryProcess):
    """A beat process with its own schedule file."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        args = [
            "beat",
            "-s",
            str(workdir / "schedule"),
            "--pidfile=",
            "--max-interval",
            "1",
            "-l",
            "info",
        ]
        super().__init__(args, env, workdir / "beat.log")

    def sent(self, task: str) -> int:
        """How many times this beat sent ``task`` ("Sending due task <entry> (<task>)")."""
        lines = self.log.read_text(errors="replace").splitlines()
        return sum(1 for line in lines if "Sending due task" in line and f"({task})" in line)


def close_celery_clients(apps: Iterable[Celery], backends: Iterable[Any]) -> None:
    """Close the Redis clients of result ``backends`` (each thread that asks for one has its
    own; nothing else closes them), then ``apps``. Left to the garbage collector, the cycles
    they sit in can finalize a socket before the connection that would close it, and a later
    test fails on the ResourceWarning. (Broker connections are kombu's, pooled per URL for
    the process and shared by apps: they are not garbage.)"""
    for backend in backends:
        consumer = getattr(backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
        client = backend.__dict__.get("client")  # a cached property: None if never used
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            pool.disconnect()
    for app in apps:
        app.close()


@contextmanager
def thread_worker(app: Celery, *, concurrency: int = 2) -> Iterator[None]:
    """A real worker in this process (threads pool), started as celery.contrib.testing does."""
    with start_worker(
        app, pool="threads", concurrency=concurrency, perform_ping_check=False, shutdown_timeout=30
    ):
        yield


def store_env(settings: Settings, **more: str) -> dict[str, str]:
    """This process's environment pointed at ``settings``' journal and data directory: a
    CLI command (``run_cli``) on the test's own store; ``more`` adds or replaces variables."""
    return {
        **os.environ,
        "SESSIONSTORE_DATABASE_URL": settings.resolved_database_url,
        "SESSIONSTORE_DATA_DIR": str(settings.data_dir),
        **more,
    }


def as_a_user(command: list[str]) -> list[str]:
    """``command`` run without root's power to read and search any directory (CAP_DAC_*),
    so that file modes apply to it: under ``setpriv`` when the tests run as root."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: file modes do not apply")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search", *command]


@contextmanager
def unsearchable(directory: Path, mode: int) -> Iterator[Path]:
    """``directory`` with ``mode`` (``0o644``: listed, not searchable) while in the block."""
    directory.chmod(mode)
    try:
        yield directory
    finally:
        directory.chmod(0o755)  # so that the test's directory can be removed


def clean_env(data_dir: Path | None = None, **more: str) -> dict[str, str]:
    """This process's environment without any ``SESSIONSTORE_`` variable of the caller's
    (the suite's own never leak into the command under test), with ``data_dir`` as
    ``SESSIONSTORE_DATA_DIR`` when given; ``more`` adds or replaces variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONSTORE_")}
    if data_dir is not None:
        env["SESSIONSTORE_DATA_DIR"] = str(data_dir)
    return {**env, **more}


def blobs_in_distinct_fanouts(blobs: BlobStore, contents: Iterable[bytes]) -> list[PutResult]:
    """Each of ``contents`` put, no two under one ``<h[0:2]>/<h[2:4]>`` directory: a link
    planted at one blob's fan-out directory then stands over that blob alone."""
    puts = [blobs.put(data) for data in contents]
    assert len({put.hash[:4] for put in puts}) == len(puts)  # no two share a fan-out directory
    return puts


def settings_env(
    *, database_url: str, broker_url: str, data_dir: Path, visibility_timeout: int = 3600
) -> dict[str, str]:
    return {
        "SESSIONSTORE_DATABASE_URL": database_url,
        "SESSIONSTORE_BROKER_URL": broker_url,
        "SESSIONSTORE_RESULT_BACKEND": broker_url,
        "SESSIONSTORE_DATA_DIR": str(data_dir),
        "SESSIONSTORE_TASK_VISIBILITY_TIMEOUT": str(visibility_timeout),
    }


@contextmanager
def queue_worker(
    settings: Settings, tmp_path: Path, *, include: str | None = None, **env: str
) -> Iterator[Path]:
    """A prefork worker subprocess on ``settings``' journal and broker (``env`` added to its
    environment, ``include`` its extra module); yields its log, stops it on the way out."""
    worker_env = settings_env(
        database_url=str(settings.database_url),
        broker_url=str(settings.broker_url),
        data_dir=tmp_path / "w",
    )
    log = tmp_path / "worker.log"
    worker = WorkerProcess({**worker_env, **env}, log, include=include)
    try:
        yield log
    finally:
        worker.stop()


def send_raw(
    app: Celery,
    session_id: Any,
    events: Any,
    *,
    key: str,
    headers: dict[str, Any] | None = None,
    **extra: Any,
) -> AppendHandle:
    """What a client that skips ``enqueue_append`` does: ``send_task`` by name (with
    ``headers`` of its own, if given)."""
    kwargs = {"session_id": session_id, "events": events, "idempotency_key": key, **extra}
    task_id = write_task_id(str(session_id), key)

    def send() -> Any:
        return app.send_task("sessionstore.append", kwargs=kwargs, task_id=task_id, headers=headers)

    return AppendHandle(send(), str(session_id), key, send)


_artifacts = table_of(ArtifactRow)


def set_output_expiry(store: SessionStore, artifact_id: str, from_now: timedelta) -> None:
    """Move an artifact's ``expires_at`` to ``from_now`` from now (negative: expired)."""
    with store.engine.begin() as conn:
        conn.execute(
            update(_artifacts)
            .where(_artifacts.c.local_id == artifact_id)
            .values(expires_at=utcnow() + from_now)
        )


def watch_log(caplog: pytest.LogCaptureFixture, name: str, level: int = logging.WARNING) -> None:
    """Capture logger ``name`` at ``level`` whatever earlier tests in this process did to
    logging: a Celery worker started in-process configures it, which disables every logger
    that existed then (``disabled`` is not reset by ``caplog.set_level``)."""
    logging.getLogger(name).disabled = False
    caplog.set_level(level, logger=name)


def outcome_within(
    action: Callable[[], Any], fifo: Path, deadline_s: float = 10.0
) -> tuple[str, Any]:
    """("returned", value) or ("raised", exception) of ``action``, run in a thread within
    ``deadline_s``; a reader still blocked then on the FIFO at ``fifo`` is released (a writer
    opens it: EOF) and the test fails, instead of the run hanging."""
    result: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            result.append(("returned", action()))
        except Exception as exc:
            result.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        with suppress(OSError):  # ENXIO: nothing reads it (the thread is stuck elsewhere)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(deadline_s)
        pytest.fail(f"a reader blocked on the FIFO at {fifo}")
    return result[0]


def skew_host_clock(monkeypatch: pytest.MonkeyPatch, skew: timedelta) -> None:
    """This process's clock ``skew`` off the database's, for the rest of the test: every
    ``core`` module's ``utcnow`` (the host's clock, imported by name) is replaced."""
    real = utcnow
    for name, module in list(sys.modules.items()):
        if (name == "core" or name.startswith("core.")) and getattr(module, "utcnow", None) is real:
            monkeypatch.setattr(module, "utcnow", lambda: real() + skew)


SPAWN = multiprocessing.get_context("spawn")


def run_together(target: Callable[..., None], args: tuple[Any, ...], count: int) -> list[Any]:
    """``count`` spawned processes each run ``target(*args, ready, go, out)``: it puts to
    ``ready`` once set up, waits for ``go`` (all start together: the first one up does
    not take everything) and puts its result to ``out``. Their results."""
    out, ready, go = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
    processes = [SPAWN.Process(target=target, args=(*args, ready, go, out)) for _ in range(count)]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            ready.get(timeout=60)
        go.set()
        return [out.get(timeout=90) for _ in processes]
    finally:
        for process in processes:
            process.join(10)
            process.kill()


def broker_connection(settings: Settings) -> Connection:
    """A kombu connection exactly as the app's worker and producers open theirs."""
    config = celery_config(settings)
    return Connection(
        config["broker_url"],
        transport=config["broker_transport"],
        transport_options=config["broker_transport_options"],
    )
