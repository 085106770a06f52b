"""The embedded broker (core.broker) giving back the messages of a lost consumer: a
returner killed at any step, returners racing, and a process that replaced its own image
(Celery's worker re-execs itself on SIGHUP: same pid, same start time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from core import SessionStore, Settings, broker
from core.migrate import upgrade
from tasks import enqueue_append
from tasks.app import create_app
from tests.support import ROOT, WorkerProcess, broker_connection, clean_env, run_together

MESSAGE = {"body": "e30=", "headers": {"task": "t"}, "properties": {"delivery_tag": "x"}}


def _gone_owner() -> str:
    """How a process that no longer runs named its claims."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return f"{broker._MACHINE}.{gone.pid}.1"


class _Killed(BaseException):
    """The returning process dies here (a SIGKILL: nothing after it runs, no except)."""


@contextmanager
def _killed_before(step: int, owner: str, root: Path) -> Iterator[list[str]]:
    """Run ``core.broker`` as a process named ``owner`` that is killed before its file
    system change number ``step`` (renames, replaces, unlinks, counted from 0): that change
    is not made, nor any after it. A staging file it was writing is left cut in half, as a
    kill mid-write leaves it. Yields the changes made."""
    made: list[str] = []
    real = {name: getattr(os, name) for name in ("rename", "replace", "unlink")}

    def counted(name: str) -> Callable[..., Any]:
        def change(*args: Any, **kwargs: Any) -> Any:
            if len(made) == step:
                for part in root.rglob(".*.part"):
                    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
                raise _Killed(name)
            made.append(name)
            return real[name](*args, **kwargs)

        return change

    owner_of = broker._owner
    broker._owner = lambda pid: owner  # type: ignore[assignment]
    for name in real:
        setattr(os, name, counted(name))
    try:
        yield made
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
        broker._owner = owner_of  # type: ignore[assignment]


def _copies(*folders: Path) -> list[dict[str, Any]]:
    return [
        json.loads(p.read_text())
        for folder in folders
        for p in folder.iterdir()
        if not p.name.startswith(".")
    ]


def _returns_killed(case: Path, steps: tuple[int, ...]) -> list[list[str]] | None:
    """A lost claim, then one returner per step of ``steps``, each killed before that
    step, each followed by a live consumer that takes what is queued; then a scan by this
    process. None if one of the returners was not killed (it had fewer steps); else the
    changes each made, after checking that the message is there exactly once (queued or
    delivered), its delivery counted once, and that no claim is left."""
    claimed, inbox, delivered = case / "claimed", case / "in", case / "delivered"
    for folder in (claimed, inbox, delivered):
        folder.mkdir(parents=True)
    (claimed / f"{_gone_owner()}~{'a' * 32}~1_m.celery.msg").write_text(json.dumps(MESSAGE))
    made_by: list[list[str]] = []
    for step in steps:
        try:
            with _killed_before(step, _gone_owner(), case) as made:
                broker.reclaim(claimed, inbox, older_than_s=3600)
        except _Killed:
            made_by.append(made[:])
        else:
            return None
        for p in inbox.iterdir():
            if not p.name.startswith("."):
                p.rename(delivered / p.name)
    broker.reclaim(claimed, inbox, older_than_s=3600)
    copies = _copies(inbox, delivered)
    assert [c["headers"][broker.DELIVERIES] for c in copies] == [2], (steps, made_by)
    assert [p.name for p in claimed.iterdir() if not p.name.startswith(".")] == []
    return made_by


def test_a_return_killed_at_any_step_ends_with_the_message_once_counted_once(
    tmp_path: Path,
) -> None:
    """A returner killed at each step of a return (and the next returner killed too, at
    each of its steps): the message ends up exactly once, queued or delivered, its delivery
    counted once, and no scan fails. A kill after the staging file was written made every
    later scan raise FileExistsError out of the consumer (the worker stopped, and the next
    one too); one after the message was queued but before its claim went left it delivered
    twice; two in a row counted it twice."""
    killed = [
        (first, second)
        for first in range(10)
        for second in range(10)
        if _returns_killed(tmp_path / f"{first}-{second}", (first, second)) is not None
    ]
    firsts = {first for first, _ in killed}
    assert len(firsts) >= 3 and all(_returns_killed(tmp_path / f"{f}", (f,)) for f in firsts)


def test_a_worker_starts_and_consumes_after_a_returner_was_killed_mid_return(
    tmp_path: Path,
) -> None:
    """A real prefork worker on a data dir where a returner was killed after it wrote its
    staging file (as the previous code named it) for a message it had claimed back: the
    worker exited ("Unrecoverable error: FileExistsError") on its first scan, and so did
    each next one. Now it returns the message and runs both writes."""
    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir)
    upgrade(settings.resolved_database_url)
    app = create_app(settings)
    inbox, claimed = data_dir / "queue" / "in", data_dir / "queue" / "claimed"
    with SessionStore.from_settings(settings) as store:
        sid = store.create_session(tenant_id="acme").id
        first = enqueue_append(sid, [{"type": "note", "n": 1}], idempotency_key="k1", app=app)
        [name] = [n for n in os.listdir(inbox) if not n.startswith(".")]
        claimed.mkdir(exist_ok=True)
        os.rename(inbox / name, claimed / f"{_gone_owner()}~{'a' * 32}~{name}")
        (inbox / f".{name}.part").write_bytes(b'{"body": ')  # killed mid-write
        worker = WorkerProcess(clean_env(data_dir), tmp_path / "w.log", concurrency=1)
        try:
            second = enqueue_append(sid, [{"type": "note", "n": 2}], idempotency_key="k2", app=app)
            results = [first.get(timeout=60), second.get(timeout=60)]
        finally:
            worker.stop()
        assert store.get_session(sid).head_seq == 2
    assert sorted(r.last_seq for r in results) == [1, 2]
    assert [n for n in os.listdir(claimed) if not n.startswith(".")] == []


def _race(claimed: str, inbox: str, ready: Any, go: Any, out: Any) -> None:
    ready.put(True)
    go.wait(60)
    out.put(broker.reclaim(Path(claimed), Path(inbox), older_than_s=3600))


def test_returners_racing_return_each_message_exactly_once(tmp_path: Path) -> None:
    """Several processes scan at once and all see the same lost claims: each claims one
    back by a rename before it writes anything, so exactly one returns it."""
    claimed, inbox = tmp_path / "claimed", tmp_path / "in"
    claimed.mkdir()
    inbox.mkdir()
    owner, n = _gone_owner(), 400
    for i in range(n):
        message = {**MESSAGE, "headers": {"task": "t", "i": i}}
        (claimed / f"{owner}~{i:032x}~{i:06d}_m.celery.msg").write_text(json.dumps(message))
    returned = run_together(_race, (str(claimed), str(inbox)), 4)
    copies = _copies(inbox)
    assert sum(returned) == n and sorted(c["headers"]["i"] for c in copies) == list(range(n))
    assert {c["headers"][broker.DELIVERIES] for c in copies} == {2}
    assert os.listdir(claimed) == []


def test_stale_staging_files_are_cleaned_and_fresh_ones_kept(tmp_path: Path) -> None:
    """Hidden staging files left by a killed producer (in the queue folder) or returner
    (in either) accumulated for ever; a scan removes those older than STALE_PART_S."""
    claimed, inbox = tmp_path / "claimed", tmp_path / "in"
    claimed.mkdir()
    inbox.mkdir()
    old = time.time() - broker.STALE_PART_S - 60
    for folder in (claimed, inbox):
        for age in ("old", "fresh"):
            part = folder / f".1_{age}.celery.msg.part"
            part.write_bytes(b"{")
            if age == "old":
                os.utime(part, (old, old))
    (inbox / "1_q.celery.msg").write_text("{}")
    os.utime(inbox / "1_q.celery.msg", (old, old))  # a message waits as long as it must
    broker.reclaim(claimed, inbox, older_than_s=3600)
    assert os.listdir(claimed) == [".1_fresh.celery.msg.part"]
    assert sorted(os.listdir(inbox)) == [".1_fresh.celery.msg.part", "1_q.celery.msg"]


_EXEC = """
import os, sys
from pathlib import Path
from kombu import Connection
from core import Settings
from tasks.app import celery_config

config = celery_config(Settings(data_dir=Path(sys.argv[1])))
conn = Connection(config["broker_url"], transport=config["broker_transport"],
                  transport_options=config["broker_transport_options"])
queue = conn.SimpleQueue("q")
if sys.argv[2] == "before":
    queue.put({"n": 1})
    held = queue.get(timeout=5)  # claimed, never acked: the exec below drops it
    os.execv(sys.executable, [sys.executable, __file__, sys.argv[1], "after", str(os.getpid())])
assert sys.argv[3] == str(os.getpid())  # the same process, a new image
try:
    back = queue.get(timeout=3)
except queue.Empty:
    print("stuck")
else:
    print("back", back.payload["n"], back.headers.get("x-sessionstore-deliveries"))
    back.ack()
conn.release()
"""


def test_a_process_that_execs_itself_gets_back_what_its_earlier_image_claimed(
    tmp_path: Path,
) -> None:
    """A process claims a message, then replaces its image with ``execv`` (as Celery's
    worker restarts on SIGHUP): same pid, same start time, so its claims looked like the
    new image's own and were never given back while it ran. Now each image names its
    claims with a token of its own, and the new one returns the earlier one's."""
    script = tmp_path / "execs.py"
    script.write_text(textwrap.dedent(_EXEC))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "data"), "before"],
        env=clean_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["back", "1", "2"]
    assert os.listdir(tmp_path / "data" / "queue" / "claimed") == []


@pytest.mark.parametrize("earlier", ["this-image", "another-image", "no-image"])
def test_this_process_returns_only_claims_its_earlier_images_made(
    tmp_path: Path, earlier: str
) -> None:
    """A claim named by this pid and start time is this process's: kept when this image
    made it, returned when another image of it did (a token of its own, or none: a claim
    of the version before tokens, which only an exec from it into this one leaves). A live
    process's claims stay whatever their token."""
    claimed, inbox = tmp_path / "claimed", tmp_path / "in"
    claimed.mkdir()
    inbox.mkdir()
    middle = {
        "this-image": f"{broker._IMAGE}-{'a' * 32}",
        "another-image": f"{'f' * len(broker._IMAGE)}-{'a' * 32}",
        "no-image": "a" * 32,
    }[earlier]
    (claimed / f"{broker._owner(os.getpid())}~{middle}~1_mine.celery.msg").write_text("{}")
    alive = subprocess.Popen(["sleep", "60"])
    try:
        for i, token in enumerate((f"{'f' * len(broker._IMAGE)}-{'b' * 32}", "b" * 32)):
            (claimed / f"{broker._owner(alive.pid)}~{token}~{i}_alive.celery.msg").write_text("{}")
        returned = broker.reclaim(claimed, inbox, older_than_s=0)
    finally:
        alive.kill()
        alive.wait()
    assert returned == (earlier != "this-image")
    assert os.listdir(inbox) == ([] if earlier == "this-image" else ["1_mine.celery.msg"])
    assert sorted(p.name.rpartition("~")[2] for p in claimed.iterdir()) == [
        "0_alive.celery.msg",
        "1_alive.celery.msg",
        *(["1_mine.celery.msg"] if earlier == "this-image" else []),
    ]


@pytest.mark.parametrize(
    "hostile",
    [
        {"__type__": "decimal", "__value__": "x"},  # decimal.InvalidOperation
        {"__type__": "datetime", "__value__": [1]},  # TypeError
    ],
)
def test_a_lost_claim_kombu_cannot_decode_goes_back_as_it_was(
    tmp_path: Path, hostile: dict[str, Any]
) -> None:
    """A claim whose JSON kombu's decoders refuse with another error than ValueError made
    ``reclaim`` raise out of the consumer, the claim by then renamed as the scanning
    process's own: each next worker inherited it and died the same way. It goes back
    as it was (uncounted), and the consumer that claims it next sets it aside."""
    claimed, inbox = tmp_path / "claimed", tmp_path / "in"
    claimed.mkdir()
    inbox.mkdir()
    message = {**MESSAGE, "headers": {"task": "t", "odd": hostile}}
    (claimed / f"{_gone_owner()}~a~1_m.celery.msg").write_text(json.dumps(message))
    assert broker.reclaim(claimed, inbox, older_than_s=3600) == 1
    assert [p.name for p in inbox.iterdir()] == ["1_m.celery.msg"]
    assert json.loads((inbox / "1_m.celery.msg").read_text()) == message
    assert list(claimed.iterdir()) == []


def test_a_message_returned_from_a_lost_consumer_counts_its_delivery(tmp_path: Path) -> None:
    claimed, inbox = tmp_path / "claimed", tmp_path / "in"
    claimed.mkdir()
    inbox.mkdir()
    owner = _gone_owner()
    (claimed / f"{owner}~a~1_m.celery.msg").write_text(json.dumps(MESSAGE))
    (claimed / f"{owner}~b~2_m.celery.msg").write_text(
        json.dumps({**MESSAGE, "headers": {broker.DELIVERIES: 4}})
    )
    assert broker.reclaim(claimed, inbox, older_than_s=3600) == 2
    # back where they were in the queue, under a name of the return
    names = sorted(os.listdir(inbox))
    assert [(n[:4], n[-11:]) for n in names] == [("1_m+", ".celery.msg"), ("2_m+", ".celery.msg")]
    counts = [json.loads((inbox / n).read_text())["headers"][broker.DELIVERIES] for n in names]
    assert counts == [2, 5] and list(claimed.iterdir()) == []


def test_a_lost_claim_that_cannot_be_read_stays_for_the_next_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the claim that fails (EIO) is no verdict on the message: it went back to
    the queue uncounted, as a file that does not parse does. It stays claimed as it was, and
    the next scan returns it counted."""
    claimed, inbox = tmp_path / "claimed", tmp_path / "in"
    claimed.mkdir()
    inbox.mkdir()
    lost = claimed / f"{_gone_owner()}~a~1_m.celery.msg"
    lost.write_text(json.dumps(MESSAGE))
    real = broker._message_bytes

    def failing(path: Path) -> bytes:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(broker, "_message_bytes", failing)
    assert broker.reclaim(claimed, inbox, older_than_s=3600) == 0
    assert [p.name for p in claimed.iterdir()] == [lost.name] and list(inbox.iterdir()) == []
    monkeypatch.setattr(broker, "_message_bytes", real)
    assert broker.reclaim(claimed, inbox, older_than_s=3600) == 1
    (back,) = inbox.iterdir()
    assert json.loads(back.read_text())["headers"][broker.DELIVERIES] == 2


def _restore_killed(case: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> list[str] | None:
    """A consumer holding a message restores it (a warm shutdown, a requeue) and is killed
    before its file system change number ``step``; then a scan by a later process. None if
    the restore was not killed (it had fewer steps); else the changes it made, after
    checking that the message is queued exactly once, its delivery counted once, and that
    no claim is left."""
    settings = Settings(data_dir=case)
    claimed, inbox = case / "queue" / "claimed", case / "queue" / "in"
    with broker_connection(settings) as conn:
        conn.SimpleQueue("restore").put({"n": 1})
        channel = conn.default_channel
        message = channel.Message(channel._get("restore"), channel=channel)
        try:
            with _killed_before(step, _gone_owner(), case) as made:
                channel._restore(message)
        except _Killed:
            pass
        else:
            return None
        # the process is gone: its claims are a lost consumer's to the next one
        with monkeypatch.context() as m:
            m.setattr(broker, "_owner", lambda pid: _gone_owner())
            m.setattr(broker, "_process_start", lambda pid: None)
            broker.reclaim(claimed, inbox, older_than_s=3600)
    copies = _copies(inbox)
    assert [c["headers"].get(broker.DELIVERIES) for c in copies] == [2], (step, made)
    assert [p.name for p in claimed.iterdir() if not p.name.startswith(".")] == [], step
    return made


def test_a_restore_killed_at_any_step_leaves_the_message_queued_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer restoring an unacked message (kombu restores them at a warm shutdown, and
    a requeue is one) killed at each step: the message is back in the queue exactly once,
    counted once. The restore published a copy, then dropped its claim: killed between, the
    message was both queued and claimed, and the scan after it delivered it twice."""
    steps = [s for s in range(10) if _restore_killed(tmp_path / str(s), s, monkeypatch)]
    assert len(steps) >= 2
