"""engine/idempotency.py's Keys on a real registry, around calls that need no sandbox: one run per
key, a repeat attached to a running call, conflicts, expiry, a holder that died, the ttl setting.
(The same against real sandboxes and servers: tests/attacks/test_idempotency.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from warmbox import operations as ops
from warmbox.config import parse
from warmbox.engine import idempotency
from warmbox.engine.idempotency import Keys
from warmbox.errors import ConfigError, IdempotencyConflict, InvalidArgument, OutcomeUnknown, SandboxNotFound
from warmbox.models import CommandResult
from warmbox.storage.registry import KeyClaim, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

RESULT = CommandResult(0, "out\n", "", False, False, False, 0, 1.5, 42)


def _registry(tmp: Path) -> Registry:
    return Registry(tmp / "r.db", ledger=UidLedger(tmp / "uids", slots=16, first=MAX_SLOTS - 60))


def _run(keys: Keys, key: str, call, cmd: str = "true", scope: str = "sb-000000000001"):
    request = ops.Exec(scope, cmd, idempotency_key=key)
    return keys.run(
        tenant="acme",
        scope=scope,
        key=key,
        op="command",
        fingerprint=idempotency.fingerprint(request),
        timeout_s=60.0,
        result_type=CommandResult,
        call=call,
    )


def test_one_run_per_key_a_repeat_attaches_and_conflicts_are_refused(tmp_path):
    reg = _registry(tmp_path)
    keys = Keys(reg, lambda: 60.0)
    runs = []

    async def call(_claim: KeyClaim) -> CommandResult:
        runs.append(1)
        await asyncio.sleep(0.2)
        return RESULT

    async def go() -> None:
        first = asyncio.ensure_future(_run(keys, "k", call))
        await asyncio.sleep(0.05)
        repeat = asyncio.ensure_future(_run(keys, "k", call))  # while it runs: the same run
        first.cancel()  # the first caller goes away: the call goes on
        assert await repeat == RESULT
        with pytest.raises(IdempotencyConflict, match="other arguments"):
            await _run(keys, "k", call, cmd="false")
        keys.flush()
        other = Keys(reg, lambda: 60.0)  # another process's view: the record
        got = await _run(other, "k", call)
        assert got == RESULT and runs == [1]
        assert await _run(other, "k", call, scope="sb-000000000002") == RESULT and runs == [1, 1]

    asyncio.run(go())
    reg.close()


def test_an_expired_key_runs_again_and_a_refused_call_frees_its_key(tmp_path):
    reg = _registry(tmp_path)
    keys = Keys(reg, lambda: 0.2)
    runs = []

    async def call(_claim: KeyClaim) -> CommandResult:
        runs.append(1)
        return RESULT

    async def refused(_claim: KeyClaim) -> CommandResult:
        runs.append(0)
        raise SandboxNotFound("no sandbox sb-000000000001", "sb-000000000001")

    async def go() -> None:
        await _run(keys, "k", call)
        keys.flush()
        await _run(keys, "k", call)
        assert runs == [1]
        await asyncio.sleep(0.3)
        await _run(keys, "k", call)
        assert runs == [1, 1]
        for _ in range(2):
            with pytest.raises(SandboxNotFound):
                await _run(keys, "gone", refused)
        assert runs == [1, 1, 0, 0]

    asyncio.run(go())
    reg.close()


def test_a_call_whose_holder_died_is_outcome_unknown_and_not_run(tmp_path):
    reg = _registry(tmp_path)
    keys = Keys(reg, lambda: 60.0)
    dead = 2**22 + 7  # above pid_max's default: no such process
    now = time.time()
    request = ops.Exec("sb-000000000001", "true", idempotency_key="k")
    reg.idempotency.claim_key(
        KeyClaim(
            "acme",
            "sb-000000000001",
            "k",
            "command",
            idempotency.fingerprint(request),
            f"{idempotency._HOST}/{dead}/1/x",
            now,
            now + 60,
            0.0,
        )
    )

    async def call(_claim: KeyClaim) -> CommandResult:
        raise AssertionError("run again")

    with pytest.raises(OutcomeUnknown, match="ended before recording its result"):
        asyncio.run(_run(keys, "k", call))
    reg.close()


def test_keys_and_the_ttl_setting_are_checked():
    for bad in ("", "x" * 256, "tab\t", "caf\u00e9", 5):
        with pytest.raises(InvalidArgument, match="idempotency key"):
            idempotency.check_key(bad)
    assert parse({}).idempotency_ttl_s == 86400.0
    assert parse({"lifecycle": {"idempotency_ttl": 600}}).idempotency_ttl_s == 600.0
    with pytest.raises(ConfigError, match="idempotency_ttl"):
        parse({"lifecycle": {"idempotency_ttl": 0}})


def test_recorded_output_is_bounded_per_stream_and_per_sandbox(tmp_path, monkeypatch):
    monkeypatch.setattr(idempotency, "SANDBOX_OUTPUT_BUDGET", 100 << 10)
    reg = _registry(tmp_path)
    keys = Keys(reg, lambda: 86400.0)
    big = CommandResult(0, "x" * (80 << 10), "e", False, False, False, 0, 1.0, 7)

    async def call(_claim: KeyClaim) -> CommandResult:
        return big

    async def go() -> None:
        for key in ("k1", "k2", "auto-1"):
            assert await _run(keys, key, call) == big  # the caller gets all of it
        keys.flush()
        other = Keys(reg, lambda: 60.0)
        first = await _run(other, "k1", call)
        assert len(first.stdout) == idempotency.MAX_RECORDED_OUTPUT and first.truncated and first.stderr == "e"
        second = await _run(other, "k2", call)  # the sandbox's budget left 100 KiB - 64 KiB - 1
        assert len(second.stdout) == (100 << 10) - (64 << 10) - 1 and second.truncated
        assert second.exit_code == 0 and second.pid == 7
        auto = await _run(other, "auto-1", call)  # the transport's own keys: a budget of their own
        assert len(auto.stdout) == idempotency.MAX_RECORDED_OUTPUT
        record = reg.idempotency.key_record("acme", "sb-000000000001", "auto-1")
        assert record is not None and record.claim.expires_at - record.claim.created_at == idempotency.AUTO_TTL_S

    asyncio.run(go())
    reg.close()
