"""The engine's side of egress: give a sandbox its link and policy, change it, take it away.

The proxy process (:mod:`warmbox.network.proxy`) enforces; this module attaches the veth into
the egress namespace, stores the policy the proxy reads, hands the proxy the sandbox's secrets
(over a root-only unix socket; they are never written to disk or into the sandbox), and sets
the sandbox's proxy environment so pip, npm, git, curl and requests work unchanged.

The proxy's supervisor restarts a proxy that dies; a network operation that finds nothing
serving (the supervisor died too, or gave up) starts it once more and otherwise raises
:class:`NetworkError` rather than report a policy nothing enforces (:func:`require_serving`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets as _secrets
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox.config import NetworkSettings
from warmbox.engine.session import GuestSession
from warmbox.errors import BackendUnavailable, InvalidArgument, NetworkError, SecretsRequired, Unsupported
from warmbox.lifecycle import Operation
from warmbox.models import ApprovalRequest, BackendHandle, NetEvent, StageTiming, validate_envs
from warmbox.network import netns, supervisor
from warmbox.network.policy import Policy, Secret
from warmbox.storage.registry import UID_BASE, UID_RANGE

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

PROXY_URL = f"http://{netns.GATEWAY}:{netns.PROXY_PORT}"

CA_PATH = "/home/user/.warmbox/ca-bundle.pem"
_PROXY_START_S = 15.0
_SERVE_WAIT_S = 10.0  # how long a network operation waits for a dead proxy to serve again


EgressError = NetworkError


def validate_secrets(secrets: object) -> dict[str, Secret]:
    if secrets is None:
        return {}
    if not isinstance(secrets, dict):
        raise InvalidArgument("secrets must be a dict of env name to warmbox.Secret")
    for k, v in secrets.items():
        validate_envs({k: "x"})
        if not isinstance(v, Secret):
            raise InvalidArgument(f"secret {k} must be a warmbox.Secret(value, hosts=[...]), got {type(v).__name__}")
    return dict(secrets)


def check_tier(engine: Engine, tier: str, policy: Policy) -> None:
    """Can ``policy`` be served on ``tier`` now? Raises BackendUnavailable or NetworkError.

    Called before a sandbox is created with a policy and before a policy update is stored, so
    it is also where an update learns that nothing would enforce it: with sandboxes linked,
    the proxy must answer (restarted if it died) or the update fails loudly.
    """
    if policy.enabled and policy.mode not in engine.backend(tier).capabilities().network_modes:
        raise BackendUnavailable(
            tier,
            f"network policy {policy.mode!r} is not supported on this tier "
            f"(supported: {', '.join(engine.backend(tier).capabilities().network_modes)})",
        )
    if policy.enabled and engine.registry.egress.live_links():
        require_serving(engine.home)


def policy_of(settings: NetworkSettings, network: object) -> Policy:
    """The policy ``network`` asks for under the host's settings: preset names (pypi, npm, ...,
    and ``[network.presets]``) become their hosts, and an allowlist reaches the package mirrors."""
    return Policy.of(network, settings.preset_map(), settings.mirror_hosts())


def trust_bundle(settings: NetworkSettings, ca_pem: str) -> str:
    """What a linked sandbox trusts ("" when that is only its image's store): the host's system
    CAs, ``[network] extra_ca`` and the sandbox's own proxy CA (``ca_pem``, when it has secrets)."""
    extra = ""
    if settings.extra_ca:
        try:
            extra = Path(settings.extra_ca).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise EgressError(f"[network] extra_ca {settings.extra_ca} cannot be read: {e}") from None
    pems = "\n".join(p for p in (extra, ca_pem) if p)
    if not pems:
        return ""
    from warmbox.network.tls import bundle_with_system

    return bundle_with_system(pems)


def proxy_env(placeholders: dict[str, str], ca: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict.fromkeys(
        ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "npm_config_proxy", "npm_config_https_proxy"),
        PROXY_URL,
    )
    env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    # the tools' own retry defaults again: a sandbox without a link has them at 0 (guest/userenv.py)
    env["PIP_RETRIES"] = "5"
    env["npm_config_fetch_retries"] = "2"
    if ca:
        for k in (
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "PIP_CERT",
            "GIT_SSL_CAINFO",
            "NODE_EXTRA_CA_CERTS",
            "npm_config_cafile",
        ):
            env[k] = CA_PATH
    env.update(extra or {})
    env.update(placeholders)
    return env


# ---- the proxy process and its control socket


class Control:
    """One connection to the proxy's control socket (newline-delimited JSON)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, home: Path, timeout: float = 2.0) -> Control:
        r, w = await asyncio.wait_for(
            asyncio.open_unix_connection(str(supervisor.control_path(home)), limit=1 << 20), timeout
        )
        return cls(r, w)

    async def call(self, msg: dict, timeout: float = 10.0) -> dict:
        self.writer.write((json.dumps(msg) + "\n").encode())
        await self.writer.drain()
        line = await asyncio.wait_for(self.reader.readline(), timeout)
        if not line:
            raise EgressError("the egress proxy closed its control connection")
        return json.loads(line)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (OSError, ConnectionError):
            pass


async def ensure_proxy(home: Path) -> None:
    """Make sure this home's proxy runs and answers (starting it if needed)."""
    await asyncio.to_thread(require_serving, home, _PROXY_START_S)


def require_serving(home: Path, bound: float = _SERVE_WAIT_S) -> None:
    """Return once this home's proxy answers; start it if nothing runs; else :class:`NetworkError`.

    Blocking (at most ``bound`` seconds, about a millisecond when the proxy is up). A running
    supervisor restarts a proxy that died by itself; this covers the supervisor's own death
    (or its giving up): it is started once more, and if that does not serve either, the error
    says so, with the last line of ``netproxy.log``.
    """
    deadline = time.monotonic() + bound
    started: subprocess.Popen | None = None
    while True:
        if _hello(home):
            return
        if started is None and not _proxy_locked(home):
            with open(home / "netproxy.log", "ab") as log:
                started = subprocess.Popen(
                    [*supervisor.launch_argv(), str(home)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                    close_fds=True,
                )
        gave_up = started is not None and started.poll() is not None and not _proxy_locked(home)
        if gave_up or time.monotonic() > deadline:
            if gave_up and _hello(home):
                return
            tail = ""
            try:
                tail = (home / "netproxy.log").read_text(errors="replace").strip().splitlines()[-1][:300]
            except (OSError, IndexError):
                pass
            raise EgressError(
                (
                    "the egress proxy could not be restarted"
                    if gave_up
                    else f"the egress proxy did not answer within {bound:.0f} s"
                )
                + " (egress is down; every destination is unreachable)"
                + (f": {tail}" if tail else "")
            )
        time.sleep(0.05)


def _hello(home: Path, timeout: float = 1.0) -> bool:
    """Does the proxy itself (not just its supervisor's socket) answer on the control socket?"""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(supervisor.control_path(home)))
            s.sendall(b'{"op": "hello"}\n')
            buf = b""
            while not buf.endswith(b"\n") and len(buf) < 4096:
                data = s.recv(4096)
                if not data:
                    return False
                buf += data
        return bool(json.loads(buf).get("ok"))
    except (OSError, ValueError, AttributeError):
        return False


def _proxy_locked(home: Path) -> bool:
    """Does a proxy supervisor hold this home (running, or restarting its proxy)?"""
    import fcntl

    fd = os.open(home / "netproxy.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def proxy_pid(home: Path) -> int | None:
    """PID of the serving proxy (None while none serves, e.g. between a death and its restart)."""
    try:
        pid = int((home / "netproxy.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if _proxy_locked(home) else None


def supervisor_pid(home: Path) -> int | None:
    """PID of the process that supervises (and restarts) the proxy."""
    try:
        pid = int(supervisor.supervisor_pid_path(home).read_text())
    except (OSError, ValueError):
        return None
    return pid if _proxy_locked(home) else None


async def stop_proxy(home: Path, timeout: float = 10.0) -> None:
    """Stop the proxy (which removes the egress namespace on its way out) and wait for it."""
    if not _proxy_locked(home):
        return
    try:
        c = await Control.open(home)
        try:
            await c.call({"op": "stop"})
        finally:
            await c.close()
    except (TimeoutError, OSError, ValueError, EgressError):
        pid = supervisor_pid(home)
        if pid is not None:
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while _proxy_locked(home) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


# ---- per sandbox


def _slot(handle: BackendHandle) -> int:
    return (handle.uid_base - UID_BASE) // UID_RANGE


async def prepare(engine: Engine, handle: BackendHandle) -> str:
    """The network namespace, with its link into the egress namespace, that a sandbox of a
    ``link_before_start`` tier starts in (``SandboxSpec.netns``); returns its path.

    The link is recorded at once, under the policy a paused sandbox kept (a resume), else "none"
    until :func:`attach` gives it the sandbox's policy: from then on the proxy counts it as live
    (it does not stop while the runtime starts) and enforces that policy on the address. Undone
    by :func:`unprepare` (a failed start) or with the link (:func:`release`, :func:`suspend`)."""
    sid = handle.sandbox_id
    await ensure_proxy(engine.home)  # it makes the egress namespace
    link = netns.link_for(sid, _slot(handle))
    kept = paused_record(engine, sid)
    engine.registry.egress.set_link(
        sid, link.address, link.host_ifname, kept.policy if kept is not None else Policy("none").to_json()
    )
    try:
        return await netns.prepare(netns.egress_name(engine.runtime), link, netns.sandbox_netns_name(sid))
    except BaseException:
        await unprepare(engine, sid)
        raise


async def unprepare(engine: Engine, sandbox_id: str) -> None:
    """Remove what :func:`prepare` made for a start that failed, keeping what a paused sandbox
    keeps for its resume (its record). Idempotent; nothing to do for a sandbox whose tier
    attaches its link to the running sandbox."""
    name = netns.sandbox_netns_name(sandbox_id)
    if not os.path.exists(netns.netns_path(name)):
        return
    row = engine.registry.egress.link(sandbox_id)
    if row is not None:
        await netns.detach(netns.egress_name(engine.runtime), netns.Link(sandbox_id, row[0], row[1]))
        engine.registry.egress.drop_link(sandbox_id)
    await netns.remove_sandbox_netns(name)


async def renew_prepared(engine: Engine, sandbox_id: str) -> None:
    """A runtime continued in place (a checkpoint whose storing failed) reads its namespace again:
    the one it ran in lost eth0's address to the runtime that exited, so the same link (address,
    veth name, policy, the proxy's state) is made again in a new namespace at the same path.
    Nothing to do for a sandbox without a prepared namespace."""
    name = netns.sandbox_netns_name(sandbox_id)
    row = engine.registry.egress.link(sandbox_id)
    if row is None or not os.path.exists(netns.netns_path(name)):
        return
    link = netns.Link(sandbox_id, row[0], row[1])
    egress = netns.egress_name(engine.runtime)
    await netns.detach(egress, link)
    await netns.prepare(egress, link, name)


def _prepared_link(engine: Engine, handle: BackendHandle) -> netns.Link:
    """The link :func:`prepare` made for this sandbox's start; Unsupported if it was started
    without one (its tier cannot add an interface to a running sandbox)."""
    row = engine.registry.egress.link(handle.sandbox_id)
    if row is None or not os.path.exists(netns.netns_path(netns.sandbox_netns_name(handle.sandbox_id))):
        raise Unsupported(
            f"sandbox {handle.sandbox_id} was started without a network link, and tier {handle.tier!r} "
            "fixes a sandbox's network interfaces when it starts: create it with the network policy "
            "(any policy, even one that allows nothing, keeps its link for later updates)",
            handle.tier,
            "network interfaces are fixed at start (Capabilities.link_before_start)",
        )
    return netns.Link(handle.sandbox_id, row[0], row[1])


@dataclasses.dataclass(frozen=True)
class SecretSlot:
    """One brokered secret as warmbox keeps it: its env name, the placeholder the sandbox's env
    holds and the hosts it is for. Never its value (the caller supplies that again on a resume)."""

    name: str
    placeholder: str
    hosts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class EgressRecord:
    """What a sandbox's network is, kept with it while linked or paused (registry) and in its
    snapshots (manifest): the policy (JSON) and its secrets' slots, never their values."""

    policy: str
    secrets: tuple[SecretSlot, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {"policy": self.policy, "secrets": [[s.name, s.placeholder, list(s.hosts)] for s in self.secrets]}
        )

    @classmethod
    def from_json(cls, text: str) -> EgressRecord | None:
        """The record in ``text`` (None: empty, or no policy kept). Reads the older form
        ``{"placeholders": {name: placeholder}, "policy": ...}`` too (its secrets' hosts unknown)."""
        try:
            raw = json.loads(text) if text else None
        except ValueError:
            return None
        if not isinstance(raw, dict) or not isinstance(raw.get("policy"), str):
            return None
        slots: list[SecretSlot] = []
        for item in raw.get("secrets") or ():
            if (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[0], str)
                and isinstance(item[1], str)
                and isinstance(item[2], list)
                and all(isinstance(h, str) for h in item[2])
            ):
                slots.append(SecretSlot(item[0], item[1], tuple(item[2])))
        old = raw.get("placeholders")
        if isinstance(old, dict):
            slots.extend(SecretSlot(k, v, ()) for k, v in old.items() if isinstance(k, str) and isinstance(v, str))
        return cls(raw["policy"], tuple(slots))

    def policy_of(self) -> Policy:
        return Policy.from_json(self.policy)


def record_of(engine: Engine, sandbox_id: str) -> EgressRecord | None:
    """The sandbox's network as a snapshot keeps it: its current policy (a live link's, updates
    included) and secret slots; None without network."""
    kept = EgressRecord.from_json(engine.registry.egress.egress_of(sandbox_id))
    row = engine.registry.egress.link(sandbox_id)
    if row is not None:
        return EgressRecord(row[2], kept.secrets if kept is not None else ())
    return kept


def secrets_for(record: EgressRecord | None, supplied: object, sandbox_id: str, what: str) -> dict[str, Secret]:
    """The values a resume or fork of a sandbox with ``record`` was given for its secrets.

    Checked before anything is done: a missing value is :class:`SecretsRequired` naming every
    one missing (a paused sandbox stays paused), a name the sandbox had no secret for, or a bad
    value, :class:`InvalidArgument`. A value may be a plain string (the recorded hosts) or a
    warmbox.Secret (its own hosts). what: "sandbox sb-…" or "snapshot snap-…", for the messages.
    """
    if supplied is None:
        supplied = {}
    if not isinstance(supplied, dict):
        raise InvalidArgument("secrets must be a dict of env name to value (str) or warmbox.Secret")
    slots = {s.name: s for s in record.secrets} if record is not None else {}
    extra = sorted(str(k) for k in supplied if k not in slots)
    if extra:
        had = ", ".join(sorted(slots)) or "none"
        raise InvalidArgument(f"{what} has no secret named {', '.join(extra)} (its secrets: {had})")
    missing = tuple(sorted(n for n in slots if n not in supplied))
    if missing:
        raise SecretsRequired(
            f"{what} had secrets {', '.join(missing)}; their values are never stored, so pass them "
            f"again: secrets={{{', '.join(repr(n) + ': ...' for n in missing)}}} (nothing was changed)",
            sandbox_id,
            missing=missing,
        )
    out: dict[str, Secret] = {}
    for name, slot in slots.items():
        value = supplied[name]
        if isinstance(value, str):
            if not slot.hosts:
                raise InvalidArgument(
                    f"secret {name}: pass warmbox.Secret(value, hosts=[...]) (its hosts were not kept)"
                )
            value = Secret(value, list(slot.hosts))
        elif not isinstance(value, Secret):
            raise InvalidArgument(f"secret {name} must be a string or a warmbox.Secret, got {type(value).__name__}")
        out[name] = value
    return out


async def attach(
    engine: Engine,
    handle: BackendHandle,
    session: GuestSession,
    policy: Policy,
    secrets: dict[str, Secret],
    *,
    placeholders: dict[str, str] | None = None,
    prepared_ms: float = 0.0,
) -> StageTiming:
    """Link a running sandbox to the egress proxy under ``policy`` (stage ``network``): its veth
    and address (its uid slot's), the secrets' values handed to the proxy (and a CA of its own
    when there are any), the CA bundle and proxy env written into the sandbox. On a tier with
    ``link_before_start`` the veth is the one :func:`prepare` made before the sandbox started.

    placeholders: env name -> placeholder to keep (a resumed or forked sandbox's, which its env
    and processes hold already); other secrets get new ones.
    prepared_ms: what :func:`prepare` took of the stage, before the sandbox started."""
    t0 = time.perf_counter()
    sid = handle.sandbox_id
    backend = engine.backend(handle.tier)
    prepared = backend.capabilities().link_before_start
    if prepared:  # its link was made before its runtime started (prepare)
        link, ns_path = _prepared_link(engine, handle), ""
    else:
        link, ns_path = netns.link_for(sid, _slot(handle)), backend.netns_path(handle)
    await ensure_proxy(engine.home)
    egress = netns.egress_name(engine.runtime)
    kept = placeholders or {}
    named = {n: kept.get(n) or f"warmbox-secret-{_secrets.token_hex(16)}" for n in secrets}
    before = engine.registry.egress.egress_of(sid)  # a resumed sandbox's record: kept if this fails
    try:
        if not prepared:
            await netns.attach(egress, link, ns_path)
        engine.registry.egress.set_link(sid, link.address, link.host_ifname, policy.to_json())
        # placeholders are not secrets (the sandbox's env holds them): kept for a resume or fork
        slots = tuple(SecretSlot(n, named[n], tuple(s.hosts)) for n, s in sorted(secrets.items()))
        engine.registry.egress.set_egress(sid, EgressRecord(policy.to_json(), slots).to_json())
        msg = {
            "op": "register",
            "sandbox_id": sid,
            "secrets": [
                {"placeholder": named[n], "value": s.value, "hosts": list(s.hosts)} for n, s in secrets.items()
            ],
        }
        c = await Control.open(engine.home)
        try:
            r = await c.call(msg)
        finally:
            await c.close()
        if not r.get("ok"):
            raise EgressError(f"the egress proxy refused sandbox {sid}: {r.get('error')}")
        net = engine.settings().network
        bundle = trust_bundle(net, r.get("ca_pem") or "")
        if bundle:
            await session.write(CA_PATH, bundle.encode())
        env = proxy_env(named, bool(bundle), net.mirror_env())
        await asyncio.wait_for(session.configure(env, reset_counts=False), 10)
    except BaseException:
        await release(engine, sid)
        if before:
            engine.registry.egress.set_egress(sid, before)
        raise
    timing = StageTiming(sid, "network", prepared_ms + (time.perf_counter() - t0) * 1e3, True)
    engine.registry.sandboxes.add_timings([timing])
    return timing


async def suspend(engine: Engine, sandbox_id: str) -> None:
    """A sandbox is paused: its link and rule element go, its record (policy, secret slots) stays
    in the registry for :func:`reestablish`, and the proxy forgets its secrets' values and CA
    (a resume is given the values again). Idempotent."""
    row = engine.registry.egress.link(sandbox_id)
    if row is None:
        await netns.remove_sandbox_netns(netns.sandbox_netns_name(sandbox_id))
        return
    record = record_of(engine, sandbox_id)
    if record is not None:
        engine.registry.egress.set_egress(sandbox_id, record.to_json())
    await netns.detach(netns.egress_name(engine.runtime), netns.Link(sandbox_id, row[0], row[1]))
    engine.registry.egress.drop_link(sandbox_id)
    await netns.remove_sandbox_netns(netns.sandbox_netns_name(sandbox_id))  # a resume prepares a new one
    await _forget(engine, sandbox_id)


def paused_record(engine: Engine, sandbox_id: str) -> EgressRecord | None:
    """A paused sandbox's kept network (None: it had none)."""
    return EgressRecord.from_json(engine.registry.egress.egress_of(sandbox_id))


async def reestablish(
    engine: Engine, handle: BackendHandle, session: GuestSession, record: EgressRecord, secrets: dict[str, Secret]
) -> StageTiming:
    """A resumed or forked sandbox, running with its files in place, gets the network ``record``
    describes: a link of its own (its slot's address), the recorded policy, ``secrets`` (from
    :func:`secrets_for`) under the recorded placeholders, a new CA if it has secrets.

    Tier-independent: called by snapshot.resume and snapshot.fork for every tier."""
    policy = record.policy_of()
    check_tier(engine, handle.tier, policy)
    kept = {s.name: s.placeholder for s in record.secrets}
    return await attach(engine, handle, session, policy, secrets, placeholders=kept)


async def release(engine: Engine, sandbox_id: str) -> None:
    """Remove the sandbox's link, rule element, kept record and proxy state (idempotent)."""
    await unprepare(engine, sandbox_id)
    row = engine.registry.egress.link(sandbox_id)
    if row is None:  # never linked (attach registers with the proxy only after recording the link)
        if not engine.registry.egress.egress_of(sandbox_id):
            return
    else:
        await netns.detach(netns.egress_name(engine.runtime), netns.Link(sandbox_id, row[0], row[1]))
        engine.registry.egress.drop_link(sandbox_id)
    engine.registry.egress.set_egress(sandbox_id, "")
    await _forget(engine, sandbox_id)


async def discard(engine: Engine, sandbox_id: str) -> None:
    """The network a sandbox this node no longer runs left here (a node's reconcile): its prepared
    namespace, and its link if the registry records one on this node (then that record goes). What
    the row keeps for a resume (its egress record) is left alone. Idempotent."""
    row = engine.registry.egress.link(sandbox_id)
    if row is not None and engine.registry.egress.link_node(sandbox_id) == engine.node:
        await netns.detach(netns.egress_name(engine.runtime), netns.Link(sandbox_id, row[0], row[1]))
        engine.registry.egress.drop_link(sandbox_id)
    await netns.remove_sandbox_netns(netns.sandbox_netns_name(sandbox_id))
    await _forget(engine, sandbox_id)


async def _forget(engine: Engine, sandbox_id: str) -> None:
    """The proxy (and its supervisor) drop the sandbox's secret values, CA and approval hooks."""
    if _proxy_locked(engine.home):  # (a proxy being restarted takes the message when it serves)
        try:
            c = await Control.open(engine.home)
            try:
                await c.call({"op": "forget", "sandbox_id": sandbox_id})
            finally:
                await c.close()
        except (TimeoutError, OSError, ValueError, EgressError):
            pass


async def approval_answered(home: Path, approval_id: str) -> None:
    """Tell this home's proxy that a network question of the approval queue was answered, so the
    waiting connection goes on at once (without this it sees the answer within asks.POLL_S)."""
    if not _proxy_locked(home):
        return  # no proxy: nothing waits for the answer
    try:
        c = await Control.open(home)
        try:
            await c.call({"op": "approval_answered", "approval_id": approval_id}, timeout=2.0)
        finally:
            await c.close()
    except (TimeoutError, OSError, ValueError, EgressError):
        pass


def current_policy(engine: Engine, sandbox_id: str) -> Policy:
    row = engine.registry.egress.link(sandbox_id)
    return Policy.from_json(row[2]) if row is not None else Policy("none")


async def update(engine: Engine, sandbox_id: str, network: object, session: GuestSession) -> Policy:
    """Replace a running sandbox's egress policy; new connections and lookups obey it at once.

    Legal while ready/running. A sandbox without a link gets one (and its proxy env, through
    ``session``, the caller's open session to it) first.
    """
    policy = policy_of(engine.settings().network, network)
    info, handle = engine.info(sandbox_id)
    engine.check(Operation.EXEC, info, handle)
    check_tier(engine, info.tier, policy)
    if engine.registry.egress.link(sandbox_id) is not None:
        engine.registry.egress.set_policy(sandbox_id, policy.to_json())
    elif policy.enabled:
        await attach(engine, handle, session, policy, {})
    return policy


def policy(engine: Engine, sandbox_id: str) -> Policy:
    """The sandbox's egress policy now (SandboxNotFound for an unknown id)."""
    engine.info(sandbox_id)
    return current_policy(engine, sandbox_id)


def log(engine: Engine, sandbox_id: str) -> list[NetEvent]:
    """Every egress attempt of the sandbox (kept after it is destroyed), oldest first."""
    engine.info(sandbox_id)
    return engine.registry.egress.net_events(sandbox_id)


async def approvals(
    home: Path, sandbox_id: str, hook: Callable[[ApprovalRequest], Awaitable[str] | str], subscribed: asyncio.Event
) -> None:
    """Answer the proxy's approval questions for one sandbox until cancelled (runs as a task).

    ``hook`` returns (or resolves to) "allow_once", "allow_always" or "deny"; anything else,
    or an exception, denies. ``subscribed`` is set once the proxy will ask this process.
    """
    answering: set[asyncio.Task] = set()
    while True:
        c = None
        try:
            c = await Control.open(home)
            r = await c.call({"op": "approvals", "sandbox_id": sandbox_id})
            if not r.get("ok"):
                raise EgressError(str(r.get("error")))
            subscribed.set()
            while True:
                line = await c.reader.readline()
                if not line:
                    break
                msg = json.loads(line)
                if msg.get("op") != "ask":
                    continue
                req = ApprovalRequest(
                    sandbox_id, str(msg.get("host", "")), int(msg.get("port", 0)), str(msg.get("kind", ""))
                )
                answering.add(asyncio.ensure_future(_answer(c, hook, req, msg.get("req"))))  # concurrently
                answering = {t for t in answering if not t.done()}
        except asyncio.CancelledError:
            raise
        except (TimeoutError, OSError, ValueError, EgressError):
            pass
        finally:
            for t in answering:
                t.cancel()
            if c is not None:
                await c.close()
        await asyncio.sleep(0.5)  # the proxy restarted or is starting: subscribe again


async def _answer(c: Control, hook: Callable, req: ApprovalRequest, req_id: object) -> None:
    try:
        if asyncio.iscoroutinefunction(hook):
            answer = await hook(req)
        else:  # a blocking hook must not stall the caller's event loop
            answer = await asyncio.to_thread(hook, req)
            if asyncio.iscoroutine(answer):
                answer = await answer
        answer = getattr(answer, "value", answer)
    except Exception:
        answer = "deny"  # a failing hook denies
    try:
        c.writer.write(
            (json.dumps({"req": req_id, "decision": answer if answer in _DECISIONS else "deny"}) + "\n").encode()
        )
        await c.writer.drain()
    except (OSError, ConnectionError, RuntimeError):
        pass


_DECISIONS = ("allow_once", "allow_always", "deny")
