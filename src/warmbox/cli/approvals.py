"""``warmbox approvals ls|approve ID|deny ID``: the questions steps wait on (a start over budget, a
large create, a pool resize, a network destination), answered once each."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from warmbox import operations as ops
from warmbox.cli.context import MODULE_COMMANDS


def add_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("approvals", help=MODULE_COMMANDS["approvals"])
    asub = p.add_subparsers(dest="approvals_command", required=True, parser_class=parser_class)
    q = asub.add_parser("ls", help="questions, newest first (pending ones only unless --all)")
    q.add_argument("--all", action="store_true", help="answered and timed-out ones too")
    q.add_argument("--limit", type=int, default=200, metavar="N")
    q.add_argument("--json", action="store_true")
    q = asub.add_parser("approve", help="let the waiting step go on (a network question: allow once)")
    q.add_argument("approval_id")
    q.add_argument("--always", action="store_true", help="a network question: allow that host from now on")
    q = asub.add_parser("deny", help="refuse: the waiting step fails with ApprovalDenied")
    q.add_argument("approval_id")


def _clean(text: str, width: int = 0) -> str:
    """Sandbox-made text (a host name it dialed) without control characters (no terminal escapes)."""
    out = "".join(c if c.isprintable() else "?" for c in text)
    return out[:width] if width else out


async def command(args: argparse.Namespace, transport: Any) -> int:
    if args.approvals_command == "ls":
        rows = await transport.handle(ops.ApprovalsList(pending_only=not args.all, limit=args.limit))
        if args.json:
            print(json.dumps([dataclasses.asdict(a) for a in rows]))
            return 0
        now = time.time()
        print(f"{'ID':<20} {'TENANT':<14} {'KIND':<11} {'STATE':<9} {'LEFT':>5}  SUBJECT — REASON")
        for a in rows:
            left = f"{max(0, a.deadline - now):.0f}s" if a.state == "pending" else a.decision or "-"
            print(
                f"{a.approval_id:<20} {_clean(a.tenant, 14) or '-':<14} {a.kind:<11} {a.state:<9} {left:>5}  "
                f"{_clean(a.subject, 120)} — {_clean(a.reason, 160)}"
            )
        return 0
    if args.approvals_command == "approve":
        current = await _find(transport, args.approval_id)
        if current is not None and current.kind == "network":
            decision = "allow_always" if args.always else "allow_once"
        else:
            decision = "approve"
    else:
        decision = "deny"
    a = await transport.handle(ops.ApprovalAnswer(args.approval_id, decision))
    print(f"{a.approval_id}: {a.state} ({a.decision})")
    return 0


async def _find(transport: Any, approval_id: str) -> Any:
    for a in await transport.handle(ops.ApprovalsList(limit=1000)):
        if a.approval_id == approval_id:
            return a
    return None
