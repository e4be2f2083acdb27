"""EgressStore: each sandbox's network link and policy, and the audit log of its egress (net_events)."""

from __future__ import annotations

import builtins
import time

from warmbox.models import NetEvent
from warmbox.storage.registry.db import Store, _retried
from warmbox.storage.registry.schema import _NET_LINK_COLUMNS

_NET_EVENT_INSERT = (
    "INSERT INTO net_events (sandbox_id, at, kind, host, address, port, decision, rule,"
    " bytes_up, bytes_down, detail) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
)


def _net_event_row(e: NetEvent) -> tuple:
    """One audit record as add_net_event(s) insert it (its detail bounded)."""
    return (
        e.sandbox_id,
        e.at,
        e.kind,
        e.host,
        e.address,
        e.port,
        e.decision,
        e.rule,
        e.bytes_up,
        e.bytes_down,
        e.detail[:500],
    )


class EgressStore(Store):
    """Sandboxes' network links, egress policies and network events."""

    def egress_of(self, sandbox_id: str) -> str:
        """A paused sandbox's egress, kept for its resume (JSON: policy and secret placeholders)."""
        row = self._read("SELECT egress FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return row[0] if row else ""

    @_retried
    def set_egress(self, sandbox_id: str, egress: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET egress=? WHERE sandbox_id=?", (egress, sandbox_id))

    @_retried
    def set_link(self, sandbox_id: str, address: str, ifname: str, policy: str) -> None:
        with self._tx() as db:
            # what SQLite's REPLACE did for the UNIQUE (node, address) too (PostgreSQL's upsert would not)
            db.execute(
                "DELETE FROM net_links WHERE node=? AND address=? AND sandbox_id<>?", (self.node, address, sandbox_id)
            )
            db.execute(
                self._sql.upsert("net_links", tuple(_NET_LINK_COLUMNS.split(", ")), ("sandbox_id",)),
                (sandbox_id, address, ifname, policy, time.time(), self.node),
            )

    @_retried
    def set_policy(self, sandbox_id: str, policy: str) -> bool:
        with self._tx() as db:
            return (
                db.execute(
                    "UPDATE net_links SET policy=?, updated_at=? WHERE sandbox_id=?", (policy, time.time(), sandbox_id)
                ).rowcount
                == 1
            )

    def link(self, sandbox_id: str) -> tuple[str, str, str] | None:
        """(address, ifname, policy json) of a sandbox's network link, if it has one."""
        return self._read("SELECT address, ifname, policy FROM net_links WHERE sandbox_id=?", (sandbox_id,))

    def link_by_address(self, address: str) -> tuple[str, str] | None:
        """(sandbox_id, policy json) of this node's live sandbox holding ``address``."""
        return self._read(
            "SELECT l.sandbox_id, l.policy FROM net_links l JOIN sandboxes s USING (sandbox_id) "
            "WHERE l.address=? AND l.node=? AND s.state NOT IN ('destroyed','failed','lost')",
            (address, self.node),
        )

    def link_node(self, sandbox_id: str) -> str | None:
        """The node whose link a sandbox's link record is (None: it has none)."""
        row = self._read("SELECT node FROM net_links WHERE sandbox_id=?", (sandbox_id,))
        return None if row is None else row[0]

    @_retried
    def drop_link(self, sandbox_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM net_links WHERE sandbox_id=?", (sandbox_id,))

    def live_links(self) -> int:
        """How many of this node's sandboxes have a network link (the egress proxy runs for them)."""
        return self._read(
            "SELECT COUNT(*) FROM net_links l JOIN sandboxes s USING (sandbox_id) "
            "WHERE l.node=? AND s.state NOT IN ('destroyed','failed','lost')",
            (self.node,),
        )[0]

    @_retried
    def add_net_event(self, e: NetEvent) -> int:
        with self._tx() as db:
            return int(db.execute(_NET_EVENT_INSERT + " RETURNING id", _net_event_row(e)).fetchone()[0])

    @_retried
    def add_net_events(self, events: builtins.list[NetEvent]) -> None:
        """Append several audit records in one transaction."""
        with self._tx() as db:
            db.executemany(_NET_EVENT_INSERT, [_net_event_row(e) for e in events])

    @_retried
    def finish_net_event(self, event_id: int, bytes_up: int, bytes_down: int, detail: str = "") -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE net_events SET bytes_up=?, bytes_down=?, detail=CASE WHEN ?='' THEN detail ELSE ? END"
                " WHERE id=?",
                (bytes_up, bytes_down, detail, detail[:500], event_id),
            )

    @_retried
    def deny_net_event(self, event_id: int, rule: str, detail: str) -> None:
        """Turn an attempt first allowed by name into a denial (e.g. its TLS SNI did not match)."""
        with self._tx() as db:
            db.execute(
                "UPDATE net_events SET decision='deny', rule=?, detail=? WHERE id=?", (rule, detail[:500], event_id)
            )

    def net_events(self, sandbox_id: str, limit: int = 10000) -> builtins.list[NetEvent]:
        rows = self._read(
            "SELECT sandbox_id, at, kind, host, address, port, decision, rule, bytes_up, bytes_down,"
            " detail FROM net_events WHERE sandbox_id=? ORDER BY id LIMIT ?",
            (sandbox_id, limit),
            many=True,
        )
        return [NetEvent(*r) for r in rows]
