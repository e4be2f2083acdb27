"""``sandbox.network``: the sandbox's egress policy, changes to it, and its audit log."""

from __future__ import annotations

from typing import TYPE_CHECKING

from warmbox import operations as ops
from warmbox.models import NetEvent
from warmbox.sdk._ref import SandboxRef

if TYPE_CHECKING:
    from warmbox.network.policy import Network


class AsyncNetwork:
    """The sandbox's egress: its policy, changes to it, and the audit log of every attempt."""

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sb = sandbox

    async def update(self, network: str | Network) -> None:
        """Replace the policy; the next connection and DNS lookup obey it (open ones continue)."""
        await self._sb._run(ops.UpdateNetwork(self._sb.sandbox_id, network))

    async def policy(self) -> str:
        """The policy in force, in words ("none", "internet", "allow a, b; deny c")."""
        return await self._sb._transport.handle(ops.NetworkPolicy(self._sb.sandbox_id))

    async def log(self) -> list[NetEvent]:
        """Every egress attempt so far, oldest first: connections and DNS lookups (the proxy's
        and resolver's), and packets sent around the proxy (raw IPs, other ports, UDP), which
        are refused and logged at most ~50/s per sandbox (then a row counts the rest)."""
        return await self._sb._transport.handle(ops.NetworkLog(self._sb.sandbox_id))


__all__ = ["AsyncNetwork"]
