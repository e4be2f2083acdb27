"""Idempotency keys: a keyed create, command or code run runs once; a repeat gets its result.

A call with a key is recorded in the registry (state "started") and committed *before* it starts:
the one durable claim of that key, whichever server process or node takes the repeat. When the
call ends, its result (or typed error) is recorded on the same row. A repeat with the same key
(same tenant; same sandbox for a command or code run):

- finished: gets the recorded result (output up to ``MAX_RECORDED_OUTPUT`` bytes per stream, and
  SANDBOX_OUTPUT_BUDGET for all of a sandbox's records; ``truncated`` set when it was cut for the
  record) or the same typed error;
- still running in this process: waits for that same run (a client that went away does not stop a
  keyed call: it is shielded from its caller's cancellation);
- still running in another process: polls the record until it ends;
- started but never recorded (the process that ran it ended: a crash, a restart): OutcomeUnknown
  with what is known. It is never run again. The guest agent runs such a command on to its end or
  timeout but keeps no record of it for a repeat to collect (docs/idempotency.md says why).

The same key with other arguments (a hash of the request without its key) is IdempotencyConflict.
Keys expire after ``[lifecycle] idempotency_ttl`` (default 24 h; the HTTP transport's own keys,
``auto-...``, after AUTO_TTL_S: they serve its retries only); a sandbox's command keys are deleted
when it ends, a create's key is kept (its repeat names the ended sandbox).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from warmbox import operations as ops
from warmbox import wire
from warmbox.errors import (
    BackendUnavailable,
    IdempotencyConflict,
    InvalidArgument,
    OutcomeUnknown,
    QuotaExceeded,
    RateLimited,
    RegistryBusy,
    SandboxNotFound,
    Unsupported,
    WarmboxError,
)
from warmbox.models import CommandResult, Execution
from warmbox.storage.registry import KeyClaim, KeyRecord, Registry

T = TypeVar("T")
log = logging.getLogger("warmbox.idempotency")
MAX_KEY = 255  # characters of a key (Stripe's bound too)
MAX_RECORDED_OUTPUT = 64 << 10  # bytes of stdout and of stderr kept in a command's or cell's record
# the output one server process records for one sandbox's keys, at most (then records keep the
# exit code, flags and timings, output cut to nothing and ``truncated``): a tenant's keyed
# commands cannot fill the registry's disk (the command log's bound is 40 MiB a sandbox). The
# transport's own keys have a budget of their own, counted again every AUTO_TTL_S (they expire)
SANDBOX_OUTPUT_BUDGET = 32 << 20
AUTO_PREFIX = "auto-"  # the HTTP transport's own keys: only for its retries, kept AUTO_TTL_S
AUTO_TTL_S = 600.0
MAX_BUDGETS = 4096  # sandboxes whose recorded output this process counts (the oldest forgotten)
GRACE_S = 60.0  # past a started call's own timeout, how long a repeat waits for its record
FINISH_AFTER_S = 0.05  # an outcome reaches the registry this long after its call returned, at most
POLL_S = (0.02, 0.05, 0.1, 0.2, 0.5)  # a repeat's pauses between reads of another process's record


def _process_start() -> str:
    """This process's start time in clock ticks since boot (/proc/self/stat field 22): with the pid,
    what tells it from a later process that got the same pid."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read(4096)
        return stat.rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return "0"


def _alive(pid: int, start: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        return stat.rsplit(b")", 1)[1].split()[19].decode() == start
    except (OSError, IndexError):
        return False


_HOST = socket.gethostname()
_PROCESS = f"{_HOST}/{os.getpid()}/{_process_start()}"


# errors of a command or code run that say it never started: its key is freed, not recorded
# (SandboxPaused is not one: a pause under a running call may have let it do part of its work)
NOTHING_DONE: tuple[type[WarmboxError], ...] = (
    InvalidArgument,
    SandboxNotFound,
    RegistryBusy,
    RateLimited,
    QuotaExceeded,
    Unsupported,
    BackendUnavailable,
)


def check_key(key: object) -> str:
    """A key as given (1 to MAX_KEY printable ASCII characters), else InvalidArgument."""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not key.isascii() or not key.isprintable():
        shown = key[:40] if isinstance(key, str) else type(key).__name__
        raise InvalidArgument(f"an idempotency key is 1 to {MAX_KEY} printable ASCII characters, got {shown!r}")
    return key


def fingerprint(request: object) -> str:
    """What a key's repeat must ask again: the request's data fields but its key, hashed."""
    data = wire.encode(dataclasses.replace(request, idempotency_key=None), tag_bytes=True)  # type: ignore[type-var]
    raw = json.dumps(data, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()


def _cut(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit // 4:
        return text, False
    raw = text.encode("utf-8", "surrogateescape")
    if len(raw) <= limit:
        return text, False
    return raw[:limit].decode("utf-8", "ignore"), True


def recorded(result: object, limit: int = MAX_RECORDED_OUTPUT) -> tuple[str, int]:
    """A result as its record: JSON, each output stream cut at ``limit`` bytes (then ``truncated``);
    and the output bytes kept."""
    kept = 0
    if isinstance(result, (CommandResult, Execution)):
        out, cut_out = _cut(result.stdout, limit)
        err, cut_err = _cut(result.stderr, limit)
        if cut_out or cut_err:
            result = dataclasses.replace(result, stdout=out, stderr=err, truncated=True)
        kept = sum(len(t) if t.isascii() else len(t.encode("utf-8", "surrogateescape")) for t in (out, err))
    return json.dumps(wire.encode(result), separators=(",", ":")), kept


@dataclasses.dataclass
class _Running:
    fingerprint: str
    op: str
    task: asyncio.Future[Any]


class Keys:
    """The keyed calls of one engine: their records in the registry, and the ones running in this
    process (a repeat waits for the same run). Use on one event loop.

    An outcome is written FINISH_AFTER_S after its call returned, with the others of that moment
    (one transaction, off the caller's path: ``warmbox bench exec`` measures what a key adds); until
    then a repeat in this process gets it from memory, one in another process waits for it."""

    def __init__(self, registry: Registry, ttl_s: Callable[[], float]) -> None:
        self.registry = registry
        self._ttl_s = ttl_s
        self._running: dict[tuple[str, str, str], _Running] = {}
        self._outcomes: list[tuple[KeyClaim, str, str, str]] = []
        self._flush: asyncio.TimerHandle | None = None
        # (sandbox, auto key?) -> (since, output bytes its records hold): this process's; the
        # transport's own keys expire in AUTO_TTL_S, so their count starts again each AUTO_TTL_S
        self._spent: dict[tuple[str, bool], tuple[float, int]] = {}
        self._lock = threading.Lock()  # the queue, between the loop and an exit-time flush
        _ALL.add(self)

    async def run(
        self,
        *,
        tenant: str,
        scope: str,
        key: str,
        op: str,
        fingerprint: str,
        timeout_s: float,
        result_type: Any,
        call: Callable[[KeyClaim], Awaitable[T]],
    ) -> T:
        """Run ``call`` once for the tenant's ``key`` in ``scope`` (see the module docstring).
        timeout_s: the call's own bound (0: none), for how long a repeat waits on another process."""
        ident = (tenant, scope, key)
        here = self._running.get(ident)
        if here is not None:
            _same(key, here.op, here.fingerprint, op, fingerprint)
            return await asyncio.shield(here.task)  # type: ignore[no-any-return]
        now = time.time()
        claim = KeyClaim(
            tenant=tenant,
            scope=scope,
            key=key,
            op=op,
            fingerprint=fingerprint,
            holder=f"{_PROCESS}/{secrets.token_hex(6)}",
            created_at=now,
            expires_at=now + (min(self._ttl_s(), AUTO_TTL_S) if key.startswith(AUTO_PREFIX) else self._ttl_s()),
            deadline=now + timeout_s + GRACE_S if timeout_s > 0 else 0.0,
        )
        got = self.registry.idempotency.claim_key(claim)  # committed before the call starts
        if got is None:
            task = asyncio.ensure_future(self._first(claim, call))
            self._running[ident] = _Running(fingerprint, op, task)
            task.add_done_callback(lambda t: self._ended(ident, t))
            return await asyncio.shield(task)  # the caller going away does not stop the call
        return await self._repeat(got, op, fingerprint, result_type)

    async def _first(self, claim: KeyClaim, call: Callable[[KeyClaim], Awaitable[T]]) -> T:
        """The first run, its result or typed error queued for the registry. An error that says
        nothing was done (a create that failed leaves no sandbox; a command refused before it
        started) frees the key instead: a repeat runs it then, as Stripe's keys do."""
        try:
            result = await call(claim)
        except WarmboxError as e:
            if claim.op == "create" or isinstance(e, NOTHING_DONE):
                self._running.pop((claim.tenant, claim.scope, claim.key), None)
                try:
                    self.registry.idempotency.release_key(claim)
                except WarmboxError as busy:
                    log.warning("freeing idempotency key %r failed: %s", claim.key, busy)
            else:
                self._queue(claim, "failed", json.dumps(wire.error_to_wire(e)), "")
            raise
        self._queue(claim, "done", self._record(claim, result), _sandbox_of(result))
        return result

    def _record(self, claim: KeyClaim, result: object) -> str:
        """The record of a result, its output within the sandbox's SANDBOX_OUTPUT_BUDGET."""
        auto = claim.key.startswith(AUTO_PREFIX)
        since, spent = self._spent.pop((claim.scope, auto), (claim.created_at, 0))  # put back: last use last
        if auto and claim.created_at - since > AUTO_TTL_S:  # what counted then has expired
            since, spent = claim.created_at, 0
        text, kept = recorded(result, max(0, min(MAX_RECORDED_OUTPUT, SANDBOX_OUTPUT_BUDGET - spent)))
        self._spent[(claim.scope, auto)] = (since, spent + kept)
        if len(self._spent) > MAX_BUDGETS:
            del self._spent[next(iter(self._spent))]
        return text

    def _ended(self, ident: tuple[str, str, str], task: asyncio.Future[Any]) -> None:
        """A first run that ended without an outcome (cancelled at shutdown, or an error outside the
        tree): no longer here; its record stays "started" (a repeat: OutcomeUnknown)."""
        if task.cancelled() or not isinstance(task.exception(), (WarmboxError, type(None))):
            self._running.pop(ident, None)

    def _queue(self, claim: KeyClaim, state: str, result: str, sandbox_id: str) -> None:
        with self._lock:
            self._outcomes.append((claim, state, result, sandbox_id))
            if self._flush is None:
                self._flush = asyncio.get_running_loop().call_later(FINISH_AFTER_S, self.flush)

    def flush(self) -> None:
        """Write the queued outcomes now (a failed write leaves them "started": OutcomeUnknown).
        Also called at interpreter exit (an in-process SDK's last outcomes), off the loop."""
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
            timer, self._flush = self._flush, None
        if timer is not None:
            try:
                asyncio.get_running_loop()
                timer.cancel()  # on its loop (one Keys is used on one loop)
            except RuntimeError:
                pass  # at exit: the timer, if it ever runs, finds nothing to write
        if not outcomes:
            return
        try:
            self.registry.idempotency.finish_keys(outcomes)
        except WarmboxError as e:
            log.warning("recording %d idempotency key outcomes failed: %s", len(outcomes), e)
        for c, _, _, _ in outcomes:
            here = self._running.get((c.tenant, c.scope, c.key))
            if here is not None and here.task.done():
                del self._running[(c.tenant, c.scope, c.key)]

    async def _repeat(self, got: KeyRecord, op: str, fingerprint: str, result_type: Any) -> Any:
        _same(got.claim.key, got.claim.op, got.claim.fingerprint, op, fingerprint)
        pauses = iter(POLL_S)
        pause = POLL_S[0]
        while True:
            if got.state == "done":
                return wire.decode(result_type, json.loads(got.result), "recorded result")
            if got.state == "failed":
                raise wire.error_from_wire(json.loads(got.result))
            self._check_alive(got)
            pause = next(pauses, pause)
            await asyncio.sleep(pause)
            again = self.registry.idempotency.key_record(got.claim.tenant, got.claim.scope, got.claim.key)
            if again is None or again.claim.holder != got.claim.holder:
                raise _unknown(got, "its record expired or ended with its sandbox while this repeat waited")
            got = again

    def _check_alive(self, got: KeyRecord) -> None:
        """OutcomeUnknown if the started call can no longer record its result."""
        host, pid, start, _ = [*got.claim.holder.split("/"), "", "", "", ""][:4]
        if f"{host}/{pid}/{start}" == _PROCESS:  # this process: not running here any more
            raise _unknown(got, "the call ended in this server without its result being recorded")
        if host == _HOST and pid.isdigit() and not _alive(int(pid), start):
            raise _unknown(got, f"the server process that ran it (pid {pid}) ended before recording its result")
        if got.claim.deadline and time.time() > got.claim.deadline:
            raise _unknown(got, "its result was not recorded by the end of its timeout")


_ALL: weakref.WeakSet[Keys] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    for keys in list(_ALL):
        keys.flush()


def _same(key: str, op: str, fp: str, op2: str, fp2: str) -> None:
    if op != op2:
        raise IdempotencyConflict(f"idempotency key {key!r} was used for a {op}, not a {op2}: use a new key")
    if fp != fp2:
        raise IdempotencyConflict(
            f"idempotency key {key!r} was used for a {op} with other arguments: a new call needs a new key"
        )


def _unknown(got: KeyRecord, why: str) -> OutcomeUnknown:
    where = f"sandbox {got.claim.scope}" if got.claim.scope else "a create"
    made = f" (it had made sandbox {got.sandbox_id})" if got.sandbox_id else ""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(got.claim.created_at))
    return OutcomeUnknown(
        f"the {got.claim.op} with idempotency key {got.claim.key!r} in {where} was accepted at {at}{made} "
        f"but {why}: its outcome is unknown (in the sandbox it may have run in part or whole, or still run "
        "until its timeout), and it was not run again"
    )


def _sandbox_of(result: object) -> str:
    return result.info.sandbox_id if isinstance(result, ops.Opened) else ""
