"""What only RabbitMQ's management API tells about queues: a quorum queue's leader, its
members and those online (so whether it still has its quorum), a classic queue's node
and state, unacknowledged messages.

Optional: AMQP has no way to ask any of it. ``status`` and the console ask once per
look (one ``GET /api/queues/<vhost>`` with the columns needed, under a deadline) when
a management URL is given (``--management-url``, ``$DELIVERY_MANAGEMENT_URL``, the
deployment file's ``management_url``); without one they show whether each queue can be
read and say that leaders and members are unknown. Rationale in docs/system-view.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

#: The columns asked for (the API's ``columns`` parameter keeps its answer small).
COLUMNS = "name,type,state,node,leader,members,online,messages_unacknowledged"


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """One queue as the management API describes it."""

    name: str
    type: str | None
    state: str | None
    #: The leader of a quorum queue, the home node of a classic one.
    leader: str | None
    #: A quorum queue's members and those of them online; empty for a classic queue.
    members: tuple[str, ...]
    online: tuple[str, ...]
    unacked: int | None

    @property
    def quorum_lost(self) -> bool | None:
        """Whether fewer than a majority of its members are online (None: not a quorum queue)."""
        if not self.members:
            return None
        return len(set(self.online) & set(self.members)) < len(self.members) // 2 + 1

    @property
    def down(self) -> bool:
        """A classic queue whose node the cluster sees as down (the API's ``state``)."""
        return self.state in ("down", "crashed", "stopped")

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "state": self.state, "leader": self.leader, "members": list(self.members),
                "online": list(self.online), "quorumLost": self.quorum_lost, "unacked": self.unacked}


def parse_queue(raw: dict[str, Any]) -> QueueInfo:
    """A :class:`QueueInfo` from one queue object of the API's answer (missing fields: unknown)."""
    def nodes(value: Any) -> tuple[str, ...]:
        return tuple(str(v) for v in value) if isinstance(value, list) else ()

    leader = raw.get("leader") or raw.get("node")
    unacked = raw.get("messages_unacknowledged")
    return QueueInfo(name=str(raw.get("name")), type=raw.get("type"), state=raw.get("state"),
                     leader=str(leader) if leader else None, members=nodes(raw.get("members")),
                     online=nodes(raw.get("online")), unacked=unacked if isinstance(unacked, int) else None)


def _first_address(amqp_url: str) -> str:
    """The first address of the AMQP URL (a cluster's nodes share their vhosts and users)."""
    from .topology import AddressError, addresses

    try:
        return addresses(amqp_url)[0]
    except (AddressError, IndexError):
        return amqp_url


def credentials(management_url: str, amqp_url: str) -> tuple[str, tuple[str, str]]:
    """The management URL without its user and password, and the user and password to use:
    the management URL's own, else the AMQP URL's (its first address), else guest."""
    parts = urlsplit(management_url)
    amqp = urlsplit(_first_address(amqp_url))
    user = unquote(parts.username or amqp.username or "guest")
    password = unquote(parts.password or amqp.password or "guest")
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl().rstrip("/"), (user, password)


def vhost_of(amqp_url: str) -> str:
    """The AMQP URL's virtual host, as it appears (quoted) in a management API path."""
    path = urlsplit(_first_address(amqp_url)).path
    return quote(unquote(path[1:]) if len(path) > 1 else "/", safe="")


def queue_infos(management_url: str, amqp_url: str, *, timeout_s: float = 5.0) -> dict[str, QueueInfo]:
    """Every queue of the AMQP URL's vhost, by name; :class:`ManagementError` when the API
    does not answer within *timeout_s* or refuses."""
    import httpx

    base, auth = credentials(management_url, amqp_url)
    url = f"{base}/api/queues/{vhost_of(amqp_url)}"
    try:
        answer = httpx.get(url, params={"columns": COLUMNS, "disable_stats": "false"}, auth=auth,
                           timeout=timeout_s)
        answer.raise_for_status()
        rows = answer.json()
    except httpx.TimeoutException:
        raise ManagementError(f"the management API ({base}) did not answer within {timeout_s:g}s") from None
    except httpx.HTTPStatusError as exc:
        raise ManagementError(f"the management API ({base}) answered {exc.response.status_code}") from None
    except (httpx.HTTPError, ValueError) as exc:
        raise ManagementError(f"the management API ({base}) cannot be read: {exc}") from None
    if not isinstance(rows, list):
        raise ManagementError(f"the management API ({base}) gave no list of queues")
    return {info.name: info for info in (parse_queue(row) for row in rows if isinstance(row, dict))}


class ManagementError(Exception):
    """The management API could not be asked."""


__all__ = ["ManagementError", "QueueInfo", "credentials", "parse_queue", "queue_infos", "vhost_of"]
