"""The egress proxy's wait for answers to its questions in the approval queue (registry table ``approvals``).

A question nobody answers live (no SDK subscriber, no webhook decision) becomes a ``kind="network"``
row; the operator answers it from the dashboard, the CLI or the API (each only writes the row).
One thread with its own registry connection watches every open row of this proxy, so the proxy's
event loop never waits on the database: it checks them every :data:`POLL_S` seconds, or at once
when nudged (the engine's answer sends the proxy a control message). A row unanswered at its
deadline is timed out (the registry reads it so, and refuses a later answer).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

from warmbox.errors import ApprovalNotFound, WarmboxError
from warmbox.models import Approval
from warmbox.storage.registry import Registry

POLL_S = 0.5  # an answer written without a nudge is seen within this


def close(registry: Registry, approval_id: str) -> None:
    """Withdraw a question nothing waits for any more (it reads as timed out), unless answered."""
    try:
        registry.approvals.withdraw_approval(approval_id)
    except WarmboxError as e:  # best effort: unanswered, it times out at its deadline anyway
        print(f"warmbox proxy: cannot withdraw approval question {approval_id}: {e}", file=sys.stderr, flush=True)


class AnswerWatch:
    """Futures for queue rows, resolved (on the loop) with the row once it is no longer pending.
    db: the registry's location (Registry.location: a file, or a PostgreSQL URL).

    A row still pending at its deadline resolves as it is (the registry reads it as timed out
    from then on, as it does once the proxy is gone); ``cancel`` withdraws one the proxy stopped
    waiting for (its sandbox stopped).
    Thread-safe; the thread starts with the first row.
    """

    def __init__(self, db: Path | str, loop: asyncio.AbstractEventLoop) -> None:
        self.db = db
        self.loop = loop
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.waiting: dict[str, tuple[asyncio.Future[Approval], float]] = {}  # id -> (future, deadline)
        self.closing: set[str] = set()  # rows to withdraw: no longer waited for
        self.thread: threading.Thread | None = None
        self.stopped = False

    def wait(self, approval_id: str, deadline: float) -> asyncio.Future[Approval]:
        """A future for the row's final state (called on the loop; ``deadline``: unix seconds)."""
        fut: asyncio.Future[Approval] = self.loop.create_future()
        with self.lock:
            self.waiting[approval_id] = (fut, deadline)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="approval-watch", daemon=True)
                self.thread.start()
        self.wake.set()
        return fut

    def cancel(self, approval_id: str, *, withdraw: bool = True) -> None:
        """Stop waiting for a row; withdraw it (if nobody answered it meanwhile)."""
        with self.lock:
            if self.waiting.pop(approval_id, None) is not None and withdraw:
                self.closing.add(approval_id)
        self.wake.set()

    def nudge(self) -> None:
        """Look at the open rows now (an answer was written)."""
        self.wake.set()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    def _run(self) -> None:
        registry: Registry | None = None
        while not self.stopped:
            with self.lock:
                idle = not self.waiting and not self.closing
                nearest = min((d for _, d in self.waiting.values()), default=0.0)
            self.wake.wait(None if idle else max(0.0, min(POLL_S, nearest - time.time())))
            self.wake.clear()
            if self.stopped:
                break
            try:
                if registry is None:
                    registry = Registry(self.db)
                self._check(registry)
            except WarmboxError:
                registry = None  # opened again at the next round
                time.sleep(POLL_S)
        if registry is not None:
            registry.close()

    def _check(self, registry: Registry) -> None:
        with self.lock:
            waiting = dict(self.waiting)
            closing, self.closing = self.closing, set()
        for approval_id in closing:
            close(registry, approval_id)
        now = time.time()
        for approval_id, (_fut, deadline) in waiting.items():
            try:
                row: Approval | None = registry.approvals.approval(approval_id)
            except ApprovalNotFound:
                row = None
            if row is None or row.state != "pending" or now >= deadline:
                self._resolve(approval_id, row)  # a row still pending at its deadline: timed out

    def _resolve(self, approval_id: str, row: Approval | None) -> None:
        with self.lock:
            got = self.waiting.pop(approval_id, None)
        if got is None:
            return
        fut = got[0]

        def settle() -> None:
            if fut.done():
                return
            if row is None:  # the row was removed: nobody can answer it any more
                fut.set_exception(LookupError(approval_id))
            else:
                fut.set_result(row)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: the proxy is stopping
            pass
