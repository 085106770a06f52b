"""The embedded broker: kombu's filesystem transport, made safe to share.

kombu's own filesystem transport (5.7) has two races that lose writes silently:

- ``_put`` creates the message file in the queue folder, then serializes and writes it. A
  consumer polling in that window moves away a file that is empty or half written; its
  JSON does not parse, the exception escapes the consumer, and the worker stops consuming:
  that write and every later one wait forever (seen as a demo write PENDING for a minute
  on a loaded machine).
- ``_get`` claims a message by moving it into the system temp folder. When that is another
  filesystem (a tmpfs ``/tmp``), the move is a copy then an unlink, so two consumers can
  both copy one message, and one of them reads the file while the other truncates it.

Here a message is written under a hidden name and renamed into the queue folder whole, and
a consumer claims it with one ``rename`` inside the broker's own folder (atomic: exactly one
consumer wins). A message file that still does not parse (written by hand, or by an older
producer that crashed mid-write) is set aside in ``bad/`` with a warning, and consuming
goes on. And each broker folder has its own binding state: kombu shares one per process,
so a process that used two data dirs (a test suite, an app with two stores) published the
second one's messages to no queue.

Selected by ``tasks.app`` as ``broker_transport = "core.broker:Transport"`` with the
``filesystem://`` URL; nothing else changes (same folders, same file names).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any, cast

from kombu.exceptions import ChannelError
from kombu.transport import filesystem, virtual
from kombu.utils import json as kombu_json

log = logging.getLogger(__name__)

TRANSPORT = "core.broker:Transport"


_dumps = cast(Callable[[Any], str], kombu_json.dumps)
_loads = cast(Callable[[str], Any], kombu_json.loads)


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        body = _dumps(payload).encode()
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        folder = Path(self.data_folder_out)
        # A hidden name does not match "<stamp>_<uuid>.<queue>.msg", so no consumer
        # (nor _size, nor _purge) sees the file until the rename publishes it whole.
        staging = folder / f".{name}.part"
        try:
            with open(staging, "xb") as f:
                f.write(body)
            os.replace(staging, folder / name)
        except OSError as exc:
            staging.unlink(missing_ok=True)
            raise ChannelError(f"cannot add a message to {folder}") from exc

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        wanted = f"{queue}.msg"
        inbox = Path(self.data_folder_in)
        claimed = inbox.parent / "claimed"
        for name in sorted(os.listdir(inbox)):
            if name.partition(".")[2] != wanted:
                continue
            mine = claimed / f"{os.getpid()}-{uuid.uuid4().hex}-{name}"
            try:
                claimed.mkdir(exist_ok=True)
                os.rename(inbox / name, mine)  # atomic: one consumer wins it
            except FileNotFoundError:
                continue  # another consumer claimed it first
            except OSError as exc:
                raise ChannelError(f"cannot claim {name} in {inbox}") from exc
            try:
                body = mine.read_bytes()
            except OSError as exc:
                raise ChannelError(f"cannot read the message {mine}") from exc
            try:
                message = _loads(body.decode())
            except ValueError:
                _set_aside(mine, inbox.parent / "bad", name)
                continue
            mine.unlink(missing_ok=True)
            return message
        raise Empty()


def _set_aside(path: Path, bad: Path, name: str) -> None:
    bad.mkdir(exist_ok=True)
    os.replace(path, bad / name)
    log.warning("the embedded broker set aside an unreadable message file: %s", bad / name)


_states: dict[str, virtual.BrokerState] = {}


class Transport(filesystem.Transport):
    Channel = Channel

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)  # type: ignore[no-untyped-call]
        # kombu keeps one in-memory binding table per process for every folder. A second
        # data dir in the same process then skips writing its queue's binding file (it
        # looks declared already) and its messages go to no queue. One table per folder.
        folder = str(Path(client.transport_options.get("control_folder", "control")).resolve())
        self.state = _states.setdefault(folder, virtual.BrokerState())  # type: ignore[no-untyped-call]
