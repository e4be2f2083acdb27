"""Cache keys of template steps: each is sha256(previous key, the step's canonical form, the content
hash of what it copies), so a changed step (or anything before it) changes every key after it.

A step that runs code (RUN, apt, pip, npm) is keyed on who builds it and with what egress too
(:func:`run_key`): its output is whatever the code fetched or made, so it is reused only by the
same owner with the same build network. A COPY's key stays the content's (:func:`step_key`): both
sides of a cross-owner hit hold those bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from collections.abc import Sequence

from warmbox.templates import spec

MAX_TREE_ENTRIES = 1 << 20


def canonical(record: object) -> str:
    """A record as sorted, compact JSON (its ``kind`` included): the same step, the same text."""
    assert dataclasses.is_dataclass(record) and not isinstance(record, type)
    return json.dumps(dataclasses.asdict(record), sort_keys=True, separators=(",", ":"))


def source_key(source: spec.Source, resolved: str) -> str:
    """The key under the first step: the source and what it resolved to (an image id, the digests
    of an archive's layers), so a rebuilt ``base`` or a new archive starts a new chain."""
    return hashlib.sha256(f"source\n{canonical(source)}\n{resolved}".encode()).hexdigest()


HOST_OWNER = "host"  # the in-process engine (no tenant: the host's operator), one owner of its own


def owner(tenant: str | None) -> str:
    """Who a build step belongs to: ``tenant:<name>``, or :data:`HOST_OWNER` without a tenant (the
    in-process SDK, root on the unix socket). Never equal for two different callers."""
    return HOST_OWNER if tenant is None else f"tenant:{tenant}"


def network_text(net: spec.BuildNetwork) -> str:
    """A build network as it enters a key: its mode and its allow list, sorted and deduplicated
    (the same policy written in another order is the same policy)."""
    return json.dumps([net.mode, sorted(set(net.allow))], separators=(",", ":"))


def step_key(previous: str, step: spec.Step, content: str = "") -> str:
    """The key of a config step (ENV, WORKDIR, USER) or a COPY (``content``: its tree hash)."""
    return hashlib.sha256(f"{previous}\n{canonical(step)}\n{content}".encode()).hexdigest()


def run_key(previous: str, step: spec.Step, owner: str, net: spec.BuildNetwork, runs: Sequence[str] = ()) -> str:
    """The key of a step that runs code: the step, its owner (:func:`owner`) and the build network,
    so another tenant, or the same one with another egress, never gets its layer; ``runs``, the
    command the builder runs for it (its wrapper: what a RUN's pip installs into), so a builder
    that runs a step otherwise never takes a layer an older one made."""
    text = f"{previous}\n{canonical(step)}\nowner {owner}\nnetwork {network_text(net)}"
    if runs:
        text += "\nruns " + json.dumps(list(runs))
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def spec_hash(t: spec.Template) -> str:
    """The spec's own hash (source, steps, build network, warm-up): what TemplateInfo records."""
    parts = [canonical(t.source), *(canonical(s) for s in t.steps), canonical(t.build_network)]
    parts.append(json.dumps([t.warmup_code, list(t.warmup_commands)]))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def tree_hash(root: str) -> str:
    """sha256 over a tree's names, types, modes, symlink targets and file contents, sorted; walked
    with directory fds, never following a symlink. ``root`` may be a file."""
    return tree_hashes(root)[0]


def tree_hashes(root: str) -> tuple[str, str]:
    """(:func:`tree_hash`, the same with the files' and links' mtimes, in whole seconds as a layer
    keeps them): the second is everything a COPY layer takes from the tree, so a layer shared by
    it is the very layer the other side would have made (a layer copied from the same bytes with
    other mtimes would tell a tenant when another one's files changed). One walk."""
    h, ht = hashlib.sha256(), hashlib.sha256()
    count = 0

    def add(line: str, mtime: float) -> None:
        data = line.encode("utf-8", "surrogateescape")
        h.update(data)
        ht.update((data[:-1] + f" {max(0, int(mtime))}\n".encode()) if mtime >= 0 else data)

    def entry(dir_fd: int | None, name: str, rel: str) -> None:
        nonlocal count
        count += 1
        if count > MAX_TREE_ENTRIES:
            raise OSError(f"more than {MAX_TREE_ENTRIES} files")
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            add(f"L {rel} {os.readlink(name, dir_fd=dir_fd)}\n", st.st_mtime)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(f"{rel} changed while hashed")
                fh = hashlib.sha256()
                while chunk := os.read(fd, 1 << 20):
                    fh.update(chunk)
            finally:
                os.close(fd)
            add(f"F {rel} {mode:o} {fh.hexdigest()}\n", st.st_mtime)
        elif stat.S_ISDIR(st.st_mode):
            add(f"D {rel} {mode:o}\n", -1)  # a layer keeps no directory mtime
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                for child in sorted(os.listdir(fd)):
                    entry(fd, child, f"{rel}/{child}")
            finally:
                os.close(fd)
        # FIFOs, devices, sockets: not copied, not hashed

    entry(None, root, ".")
    return h.hexdigest(), ht.hexdigest()
