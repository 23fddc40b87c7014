"""``LocalGrid``: a Flower ``Grid`` that runs each node's ``ClientApp`` in this process, in
order, with no engine (no Ray, no gRPC). For tests, benchmarks and quick experiments: the
strategy code is exactly what runs on the simulation and deployment engines, only the
transport differs. ``drop`` makes nodes fail (no reply, as a timed-out SuperNode)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Set

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid

__all__ = ["LocalGrid"]


class LocalGrid(Grid):
    """``LocalGrid({node_id: client_app, ...})``: ``client_app(message, context)`` gives each
    node's reply (a ``flwr.clientapp.ClientApp`` or any such callable). ``drop``: node ids that
    never reply (a set the caller may change between rounds); ``node_config``: each node's
    ``context.node_config`` (e.g. ``{"partition-id": k}``)."""

    def __init__(
        self,
        clients: Mapping[int, Callable[[Message, Context], Message]],
        *,
        drop: Optional[Set[int]] = None,
        node_config: Optional[Mapping[int, Dict[str, Any]]] = None,
        run_config: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.clients = dict(clients)
        self.drop: Set[int] = set() if drop is None else drop
        self._contexts = {
            nid: Context(run_id=1, node_id=int(nid), node_config=dict((node_config or {}).get(nid, {})),
                         state=RecordDict(), run_config=dict(run_config or {}))
            for nid in self.clients
        }
        self._run: Any = None
        self.sent = 0
        self._next = 0
        self._replies: Dict[str, Message] = {}
        _set_identity()

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: Optional[float] = None) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.clients)

    def get_nodes(self) -> Iterable[Any]:
        return list(self.clients)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Runs each message's node at once and keeps its reply (none for a dropped or unknown
        node) for :meth:`pull_messages`; returns one id per message, in order."""
        ids = []
        for m in messages:
            self._next += 1
            mid = f"local-{self._next}"
            ids.append(mid)
            nid = int(m.metadata.dst_node_id)
            self.sent += 1
            if nid in self.drop or nid not in self.clients:
                continue
            self._replies[mid] = self.clients[nid](m, self._contexts[nid])
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to the given ids that exist (each handed out once)."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


def _set_identity() -> None:
    """Flower stamps every message with the task's identity, which an engine sets; in this
    process there is none, so the server task is run 1, node 0, task 0 (unless already set)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("run_id", 1), ("node_id", 0), ("task_id", 0)):
        try:
            getattr(TaskIdentity, name)
        except RuntimeError:
            setattr(TaskIdentity, name, value)
