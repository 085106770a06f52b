"""Hostile input against a real prefork worker, Redis and PostgreSQL (issue 15).

Hypothesis draws batches of messages: valid writes mixed with every bad-input class
(deep nesting, lone surrogates in strings, keys and ids, NUL, non-string keys, huge
integers, NaN/inf, out-of-range ``expected_seq``, unknown sessions, non-list events),
sent through ``enqueue_append`` or by name past the door, plus random task arguments and
random raw bodies published with kombu. For every message exactly one holds afterwards:
refused at enqueue; in the journal once; one dead-letter row. No pool child dies, and
the queue drains.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.exceptions import EncodeError
from kombu.utils import json as kombu_json

from core import SessionStore, Settings
from core.errors import InvalidEvent, SessionStoreError
from core.journal.dead_letters import DeadLetter
from tasks import enqueue_append
from tasks.app import QUEUE, create_app
from tasks.outcomes import NEW_KEY, stored_outcome, write_digest, write_task_id
from tests.integration.test_queue_outcomes import child_deaths, deep, queue_drained
from tests.support import WorkerProcess, send_raw, settings_env, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

ODD_TEXT = ["plain", "\ud800", "a\udfffb", "nul\x00", "é→😀", "", "~/"]
texts = st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=8))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(-0.0),
    texts,
)
keys = st.one_of(texts, st.integers(-5, 5))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)),
    max_leaves=8,
)
bad_depth = st.integers(min_value=65, max_value=1500).map(deep)

# what a client may put in the write_digest header: a digest (of anything), the producer's
# mark for a key it made, or values no producer sends
digests = st.one_of(
    st.just(NEW_KEY),
    st.binary(min_size=16, max_size=16).map(bytes.hex),
    st.text(alphabet="0123456789abcdefABCDEF", min_size=31, max_size=33),
    st.just("0" * 10_000),
    values,
)


@st.composite
def events(draw: st.DrawFn, marker: str) -> Any:
    body = draw(st.dictionaries(keys, st.one_of(values, bad_depth), max_size=3))
    first = {**body, "type": draw(st.one_of(st.just("note"), scalars)), "marker": marker}
    batch = [first, *draw(st.lists(st.builds(dict, type=st.just("note")), max_size=2))]
    return draw(st.sampled_from([batch, batch, batch, first, "not a list"]))


@dataclass
class Message:
    kind: str  # enqueue | by_name | raw_task | raw_bytes
    key: str
    session: Any = None
    events: Any = None
    expected_seq: Any = None
    args: Any = None
    body: bytes = b""
    content_type: str = ""
    headers: dict[str, Any] | None = None
    refused: bool = False


@st.composite
def messages(draw: st.DrawFn, sessions: list[str]) -> Message:
    key = str(uuid.uuid4())
    kind = draw(st.sampled_from(["enqueue", "enqueue", "by_name", "raw_task", "raw_bytes"]))
    if kind == "raw_task":
        arity = draw(st.sampled_from([0, 1, 2, 3, 5, 6]))
        return Message(kind, key, args=draw(st.lists(values, min_size=arity, max_size=arity)))
    if kind == "raw_bytes":
        content_type = draw(st.sampled_from(["application/json", "text/plain", "x/y"]))
        body = key.encode() + draw(st.binary(max_size=64))
        return Message(kind, key, body=body, content_type=content_type)
    session = draw(st.sampled_from([*sessions, *sessions, "no-such", "s\ud800", "s\x00", 7]))
    expected = draw(st.sampled_from([None, None, None, 0, 2**63 + 1, -1, 2**64]))
    message = Message(kind, key, session, draw(events(key)), expected)
    if kind == "by_name":  # a client's own digest header: absent, claimed, or anything
        message.headers = draw(st.one_of(st.none(), st.builds(dict, write_digest=digests)))
    return message


def send(app: Celery, message: Message) -> None:
    if message.kind == "enqueue":
        try:
            enqueue_append(
                message.session,
                message.events,
                expected_seq=message.expected_seq,
                idempotency_key=message.key,
                app=app,
            )
        except InvalidEvent:
            message.refused = True
    elif message.kind == "by_name":
        extra = {"expected_seq": message.expected_seq}
        try:
            send_raw(
                app,
                message.session,
                message.events,
                key=message.key,
                headers=message.headers,
                **extra,
            )
        except EncodeError:  # too deep for kombu's own encoder: never published
            message.refused = True
    elif message.kind == "raw_task":
        try:
            app.send_task("sessionstore.append", args=message.args, task_id=message.key)
        except EncodeError:
            message.refused = True
    else:
        with app.connection_for_write() as conn:
            conn.Producer().publish(
                message.body,
                exchange="",
                routing_key=QUEUE,
                content_type=message.content_type,
                content_encoding="binary",
            )


def _journaled(store: SessionStore, message: Message) -> int:
    if message.kind not in ("enqueue", "by_name") or not isinstance(message.session, str):
        return 0
    try:
        return 1 if store.journal.find_write(message.session, message.key) else 0
    except SessionStoreError:  # an id the database cannot even look up
        return 0


def _letters(letters: list[DeadLetter], message: Message) -> int:
    if message.kind == "raw_bytes":
        return sum(1 for x in letters if x.raw_body == message.body)
    # the write's key, or (for a body the worker could not read) its task id
    ids = {message.key, write_task_id(str(message.session), message.key)}
    return sum(1 for x in letters if any(i in x.idempotency_key for i in ids))


def kept_digest(message: Message) -> str | None:
    """The digest a commit's outcome carries: none for a key the producer made, the
    client's own if it is one, else the worker's of the content (a hostile value is not
    kept: it would answer for other content, or refuse the write's own)."""
    sent = (message.headers or {}).get("write_digest")
    if sent == NEW_KEY:
        return None
    if isinstance(sent, str) and re.fullmatch(r"[0-9a-f]{32}", sent):
        return sent
    # of the events as the worker got them: the message's JSON makes integer keys strings
    return write_digest(kombu_json.loads(kombu_json.dumps(message.events)))


def outcomes(store: SessionStore, message: Message, letters: list[DeadLetter]) -> int:
    """How many of the three outcomes ``message`` has (exactly one is right)."""
    return int(message.refused) + _journaled(store, message) + _letters(letters, message)


@pytest.fixture
def hostile_env(
    queue_settings: Settings, tmp_path: Path, redis_url: str
) -> Iterator[tuple[Celery, SessionStore, list[str], Path]]:
    env = settings_env(
        database_url=str(queue_settings.database_url),
        broker_url=redis_url,
        data_dir=tmp_path / "w",
    )
    log = tmp_path / "worker.log"
    worker = WorkerProcess(env, log)
    try:
        with SessionStore.from_settings(queue_settings) as store:
            sessions = [store.create_session(tenant_id="acme").id for _ in range(2)]
            yield create_app(queue_settings), store, sessions, log
    finally:
        worker.stop()


def test_every_hostile_message_has_exactly_one_outcome(
    hostile_env: tuple[Celery, SessionStore, list[str], Path], redis_url: str
) -> None:
    app, store, sessions, log = hostile_env
    sent: list[Message] = []

    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(batch=st.lists(messages(sessions), min_size=1, max_size=6))
    def run(batch: list[Message]) -> None:
        for message in batch:
            send(app, message)
        sent.extend(batch)

        def settled() -> bool:
            letters = store.dead_letters.list(limit=1000)
            return all(outcomes(store, m, letters) >= 1 for m in batch)

        wait_for(settled, 60, "every message to have an outcome", step=0.2)
        letters = store.dead_letters.list(limit=1000)
        for message in batch:
            assert outcomes(store, message, letters) == 1, message
            if message.kind == "by_name" and _journaled(store, message):
                # stored right after the commit the journal shows
                def stored(m: Message = message) -> bool:
                    return stored_outcome(app, m.session, m.key) is not None

                wait_for(stored, 30, "the commit's outcome")
                outcome = stored_outcome(app, message.session, message.key)
                assert outcome is not None and outcome.get("digest") == kept_digest(message)

    run()
    wait_for(lambda: queue_drained(redis_url), 30, "the queue to drain")
    letters = store.dead_letters.list(limit=1000)
    assert [m for m in sent if outcomes(store, m, letters) != 1] == []
    assert child_deaths(log) == 0  # no pool child died on any message
    kinds = {m.kind for m in sent}
    assert kinds == {"enqueue", "by_name", "raw_task", "raw_bytes"}
    assert any(m.refused for m in sent) and any(_journaled(store, m) for m in sent)
