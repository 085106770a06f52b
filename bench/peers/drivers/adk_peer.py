"""Google ADK ``DatabaseSessionService`` on PostgreSQL (asyncpg). ADK has no batch append:
a batch is ``append_event`` per entry. Each entry travels as the event's ``custom_metadata``
(stored as JSON, images as base64, exactly as sent). Rebuild = ``get_session``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from bench.peers.drivers.common import SESSION, main


def _open(dsn: str, workdir: str) -> Any:
    from google.adk.events import Event
    from google.adk.sessions import DatabaseSessionService

    url = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
    loop = asyncio.new_event_loop()

    class Peer:
        def __init__(self) -> None:
            self.service = DatabaseSessionService(db_url=url)
            self.session = loop.run_until_complete(self._session())

        async def _session(self) -> Any:
            found = await self.service.get_session(
                app_name="bench", user_id="u", session_id=SESSION
            )
            return found or await self.service.create_session(
                app_name="bench", user_id="u", session_id=SESSION
            )

        async def _append(self, events: Sequence[dict[str, Any]]) -> None:
            for entry in events:
                await self.service.append_event(
                    self.session,
                    Event(author="user", invocation_id="bench", custom_metadata={"entry": entry}),
                )

        def append(self, events: Sequence[dict[str, Any]]) -> None:
            loop.run_until_complete(self._append(events))

        def read(self) -> list[dict[str, Any]]:
            session = loop.run_until_complete(
                self.service.get_session(app_name="bench", user_id="u", session_id=SESSION)
            )
            return [e.custom_metadata["entry"] for e in session.events]

        def close(self) -> None:
            loop.run_until_complete(self.service.close())
            loop.close()

    return Peer()


if __name__ == "__main__":
    main(_open)
