"""The engine: the host context every part of the lifecycle works in (home, settings, backends,
registry, command log, this node), and the lookups and checks they share.

One Engine per WARMBOX_HOME per process; all durable state is in the registry so sandboxes
outlive the process that created them, and any process may reap expired ones. What happens to a
sandbox lives beside it: resolve (templates, images), meters, teardown, duties (timeouts, idle
pauses, the reaper), egress, provision and snapshot.
"""

from __future__ import annotations

import builtins
import logging
import os
import re
import time
from pathlib import Path
from typing import ClassVar

from warmbox import backends, config
from warmbox.backends.base import (
    Backend,
    Configurable,
    Diagnosable,
    HostUids,
    SharedHost,
)
from warmbox.config import Settings
from warmbox.engine import guard
from warmbox.engine.commandlog import CommandLog
from warmbox.engine.idempotency import Keys
from warmbox.engine.session import GuestSession, session_oom
from warmbox.errors import (
    BackendUnavailable,
    ConfigError,
    SandboxNotFound,
    SandboxPaused,
    SandboxStateError,
    WarmboxError,
)
from warmbox.lifecycle import Operation, check
from warmbox.models import (
    BackendHandle,
    Limits,
    ResourceUsage,
    SandboxInfo,
    SandboxQuery,
    State,
    TierStatus,
    validate_timeout,
)
from warmbox.paths import default_home, host_roots, owner_tag, redact, runtime_dir
from warmbox.storage import uidslots
from warmbox.storage.registry import Registry, open_registry

log = logging.getLogger("warmbox.config")


class LedgerSlots:
    """The host-wide uid ledger for a tier's own host processes (``backends.base.UidSlots``),
    recorded under this home's registry."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def claim(self, holder: str) -> int:
        return uidslots.uid_base(self.registry.sandboxes.claim_host_slot(holder))

    def release(self, holder: str, uid_base: int) -> None:
        slot = uidslots.slot_of_uid(uid_base)
        if slot is not None:
            self.registry.sandboxes.release_host_slot(holder, slot)

    def forget_gone(self, holder: str) -> bool:
        with self.registry.ledger.locked() as ledger:
            return ledger.forget_gone(holder)


def _cluster(home: Path) -> config.ClusterSettings:
    """This home's ``[cluster]`` (none: one host, also when the config cannot be read: the
    operations that need it load the config again and report what is wrong)."""
    try:
        return config.load(home).cluster
    except WarmboxError:
        return config.ClusterSettings()


class Engine:
    _instances: ClassVar[dict[Path, Engine]] = {}

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.runtime = runtime_dir(home)  # made when a backend first needs it
        self._roots = host_roots(home)  # what redact() hides
        # every allocation (create, pool refill, restore of a snapshot) checks its limits first;
        # the rows it creates are this node's ([cluster] node, "" on one host); [cluster]
        # registry: the cluster's shared PostgreSQL registry instead of the home's file
        self.registry = open_registry(home, _cluster(home), check_limits=self.check_limits)
        self.node = self.registry.node
        self.command_log = CommandLog(self.registry)  # the fronts' command records, written in batches
        # keyed creates, commands and code runs (engine/idempotency.py): the ttl as last read
        self.keys = Keys(self.registry, lambda: (self._good or self.settings()).idempotency_ttl_s)
        self._backends: dict[str, Backend] = {}
        self.owner = owner_tag(os.getpid(), self.node)  # node/pid:start on a cluster node
        self._good: Settings | None = None  # the last settings read without error
        self._config_error = ""  # why the current warmbox.toml is not in use ("": it is)

    @classmethod
    def for_home(cls, home: Path | str | None = None) -> Engine:
        path = Path(home).expanduser().resolve() if home is not None else default_home()
        engine = cls._instances.get(path)
        if engine is None:
            engine = cls._instances[path] = cls(path)
        return engine

    def backend(self, tier: str) -> Backend:
        tier = backends.canonical_tier(tier)
        b = self._backends.get(tier)
        if b is None:
            self.runtime.mkdir(parents=True, exist_ok=True, mode=0o711)
            os.chmod(self.runtime, 0o711)  # traversable, not listable
            b = self._backends[tier] = backends.load(tier, self.runtime)
            if isinstance(b, Configurable):
                b.configure(self.settings())
            if isinstance(b, HostUids):
                b.use_home(self.home, LedgerSlots(self.registry))
        return b

    def stop_shared_hosts(self) -> None:
        """Stop the host process of each tier that has one (``SharedHost``) and no live or pooled
        sandbox left."""
        live = {i.tier for i, _ in self.registry.sandboxes.list(include_pooled=True, local=True)}
        for tier in backends.TIERS:
            if tier in live:
                continue
            try:
                b = self.backend(tier)
            except WarmboxError:
                continue
            if isinstance(b, SharedHost):
                b.stop_host()

    def doctor(self) -> builtins.list[TierStatus]:
        """Each tier: whether this host runs it and why (not); an available one also says
        whether the built-in image every tier runs is built."""
        from warmbox.engine import images

        rec = images.builtin_record()
        image = (
            f"built-in image {rec.key} built ({rec.image_id[:19]}, {len(rec.layers)} layers)"
            if rec is not None
            else "built-in image not built yet: scripts/bootstrap install builds it (else the first sandbox "
            "waits minutes for it)"
        )
        out = []
        for tier in backends.TIERS:
            try:
                b = self.backend(tier)
                avail = b.diagnose() if isinstance(b, Diagnosable) else b.probe()
                reason = f"{avail.reason}; {image}" if avail.available else avail.reason
                out.append(TierStatus(tier, avail.available, reason))
            except BackendUnavailable as e:
                out.append(TierStatus(tier, False, e.reason))
        return out

    def logs(self, sandbox_id: str) -> str:
        """The tails of a sandbox's runtime logs (runtime, agent, a gVisor Sentry panic, QEMU),
        live while it runs, kept after it ended (the last 500 ended sandboxes)."""
        from warmbox.backends import hostfs

        info, handle = self.info(sandbox_id)
        data = b""
        if Path(handle.state_dir).is_dir():
            data = hostfs.log_tails(handle.state_dir, self.backend(info.tier).runtime_logs)
        if not data:
            try:
                with open(self.runtime / "logs" / f"{sandbox_id}.log", "rb") as f:
                    data = f.read(1 << 20)
            except OSError:
                pass
        return self.redact(data.decode("utf-8", "replace"))  # the runtimes name host paths: never shown

    def redact(self, text: str) -> str:
        """``text`` (a runtime log, an error's message) as a caller may read it: the host
        directories of this engine (its home, runtime dir, the image cache) replaced by words."""
        return redact(text, self._roots)

    def redact_error(self, e: WarmboxError) -> WarmboxError:
        """``e`` with its message and string attributes redacted (in place: its class, traceback
        and attributes stay); the same object."""
        if e.args and isinstance(e.args[0], str):
            e.args = (self.redact(e.args[0]), *e.args[1:])
        for name, v in vars(e).items():
            if isinstance(v, str):
                setattr(e, name, self.redact(v))
            elif isinstance(v, tuple) and all(isinstance(x, str) for x in v):
                setattr(e, name, tuple(self.redact(x) for x in v))
        return e

    def settings(self) -> Settings:
        """warmbox.toml's settings, read again when it changes. A file broken after a good one
        was read keeps the good one in use (a running server or daemon goes on serving) and is
        reported: logged once, and :meth:`config_error`; ConfigError if none was ever good."""
        try:
            s = config.load(self.home)
        except ConfigError as e:
            if self._good is None:
                raise
            if str(e) != self._config_error:
                log.warning("%s: keeping the last good settings", e)
                self._config_error = str(e)
            return self._good
        self._good, self._config_error = s, ""
        return s

    def config_error(self) -> str:
        """Why warmbox.toml (or a WARMBOX_* override) is not in use, "" when it is: the settings in
        use are then the last good ones (ConfigError if there were none)."""
        self.settings()
        return self._config_error

    def check_limits(self, limits: Limits) -> None:
        """LimitTooHigh if ``limits`` ask for more than this host has or ``[limits]`` allows, or
        for a disk larger than what is free where the sandboxes live (every allocation)."""
        self.settings().limits.check(limits)
        config.check_disk_free(limits, self.runtime)

    # ---- guest

    async def connect(self, handle: BackendHandle) -> GuestSession:
        """A session to a running sandbox's agent (GuestConnectionError if it does not listen)."""
        backend = self.backend(handle.tier)
        return await GuestSession.connect(handle.socket_path, handle.sandbox_id, session_oom(backend, handle))

    # ---- lookup

    def info(self, sandbox_id: str) -> tuple[SandboxInfo, BackendHandle]:
        if not isinstance(sandbox_id, str) or not re.fullmatch(r"sb-[0-9a-f]{12}", sandbox_id):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} (ids look like sb-0123456789ab)", str(sandbox_id))
        return self.registry.sandboxes.get(sandbox_id)

    def check(self, op: Operation, info: SandboxInfo, handle: BackendHandle | None = None) -> None:
        """A typed error if ``op`` is illegal in the sandbox's state (a destroyed one that ran
        out of time: SandboxNotFound saying it expired; a lost one: SandboxLost naming its node).
        handle: given, a live sandbox of another node is refused (SandboxStateError): its
        processes and directories are that node's, never judged or touched from here."""
        lost = info.state in (State.DESTROYED, State.LOST)
        ended = self.registry.sandboxes.ended_reason(info.sandbox_id) if lost else ""
        node = self.registry.nodes.node_of(info.sandbox_id) if info.state is State.LOST else ""
        check(op, info.state, info.sandbox_id, ended, node)
        if handle is not None and handle.node != self.node and info.state is not State.PAUSED:
            raise SandboxStateError(
                f"sandbox {info.sandbox_id} runs on node {handle.node or '(none)'!r}, not on this one "
                f"({self.node or '(none)'!r})",
                info.sandbox_id,
            )

    def paused_error(self, sandbox_id: str) -> SandboxPaused:
        """The error for an operation on a paused sandbox that does not resume by itself."""
        why = self.registry.sandboxes.ended_reason(sandbox_id)
        return SandboxPaused(
            f"sandbox {sandbox_id} is paused ({why or 'paused'}); Sandbox.connect(id) or resume(id) runs it "
            "again (or create it with lifecycle=Lifecycle(auto_resume=True))",
            sandbox_id,
        )

    def holding(self) -> builtins.list[SandboxInfo]:
        """Live (also pooled) sandboxes plus failed ones whose teardown is still owed."""
        return [info for info, _ in self.registry.sandboxes.holding()]

    def list(
        self,
        include_dead: bool = False,
        *,
        include_pooled: bool = False,
        tenant: str | None = None,
        query: SandboxQuery | None = None,
    ) -> builtins.list[SandboxInfo]:
        """tenant: only that tenant's sandboxes (None: everyone's); query: see SandboxQuery."""
        q = query or SandboxQuery()
        rows = self.registry.sandboxes.list(
            include_dead, include_pooled=include_pooled, tenant=tenant, states=q.state, metadata=q.metadata
        )
        return [info for info, _ in rows]

    def timings(self, sandbox_id: str) -> dict[str, float]:
        return {t.stage: t.duration_ms for t in self.registry.sandboxes.timings(sandbox_id)}

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        return await self.backend(handle.tier).usage(handle)

    def set_timeout(self, sandbox_id: str, timeout: float) -> float:
        timeout = validate_timeout(timeout)
        info, _ = self.info(sandbox_id)
        self.check(Operation.SET_TIMEOUT, info)
        expires = time.time() + timeout
        self.registry.sandboxes.set_expiry(sandbox_id, expires, timeout)  # its lifetime now: a resume renews this one
        self.ensure_daemon()  # someone must enforce the new deadline
        return expires

    def ensure_daemon(self) -> None:
        """Start this home's daemon (reaper, pools, meters) unless one runs (it holds an flock).

        Started through its guard, which restarts it whenever it dies without meaning to (and
        which it restarts in turn): see engine/guard.py for what that guarantees."""
        guard.ensure(self.home)
