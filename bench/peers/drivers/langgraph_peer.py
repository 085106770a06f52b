"""LangGraph ``PostgresSaver``: a one-node graph whose ``messages`` channel holds the entries.

``plain``: ``Annotated[list, operator.add]`` (a ``BinaryOperatorAggregate``: every checkpoint
stores the whole list). ``delta``: ``Annotated[list, DeltaChannel(reducer)]`` (checkpoints store
the writes, plus a snapshot every ``snapshot_frequency`` updates, the default 100). An append
is ``graph.update_state(config, {"messages": batch}, "agent")``: one checkpoint, what a caller
adding entries to a thread does. Rebuild = ``graph.get_state(config).values["messages"]``.
The last argv word picks the variant: ``plain`` or ``delta``.
"""

import operator
import sys
from collections.abc import Sequence
from typing import Annotated, Any, TypedDict

from langgraph.channels import DeltaChannel
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import END, START, StateGraph

from bench.peers.drivers.common import SESSION, main


def _concat(state: list[Any], writes: Sequence[list[Any]]) -> list[Any]:
    out = list(state)
    for write in writes:
        out.extend(write)
    return out


class DeltaState(TypedDict):
    messages: Annotated[list[Any], DeltaChannel(_concat)]


class PlainState(TypedDict):
    messages: Annotated[list[Any], operator.add]


def _agent(state: Any) -> dict[str, Any]:
    return {}


class Peer:
    def __init__(self, dsn: str, workdir: str, *, delta: bool) -> None:
        builder: Any = StateGraph(DeltaState if delta else PlainState)
        builder.add_node("agent", _agent)
        builder.add_edge(START, "agent")
        builder.add_edge("agent", END)
        self.cm = PostgresSaver.from_conn_string(dsn)
        saver = self.cm.__enter__()
        saver.setup()
        self.graph = builder.compile(checkpointer=saver)
        self.config = {"configurable": {"thread_id": SESSION}}

    def append(self, events: Sequence[dict[str, Any]]) -> None:
        self.graph.update_state(self.config, {"messages": list(events)}, "agent")

    def read(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.graph.get_state(self.config).values["messages"]
        return messages

    def close(self) -> None:
        self.cm.__exit__(None, None, None)


if __name__ == "__main__":
    DELTA = sys.argv.pop() == "delta"
    main(lambda dsn, workdir: Peer(dsn, workdir, delta=DELTA))
