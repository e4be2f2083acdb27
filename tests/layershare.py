"""Two cluster nodes on this host sharing a template through a real S3 API (moto): node a builds
(image cache = the host's), node b creates from it with its own empty image cache, so b's layers
really come from the object store. Used by tests/engine/test_node_templates.py and
tests/attacks/test_shared_layers.py."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.s3server import BUCKET, S3Server
from warmbox import operations as ops
from warmbox.engine import images
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.models import TemplateInfo
from warmbox.storage import templates
from warmbox.storage.layers import LayerStore
from warmbox.storage.objects import S3ObjectStore
from warmbox.templates import Template
from warmbox.templates.context import pack_context

BIG = 8 << 20  # a built-in layer this large is not sent through moto (kept in its memory)


class SharedStore:
    def __init__(self, s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prefix = f"nt-{secrets.token_hex(4)}"
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("WARMBOX_IMAGE_CACHE", raising=False)  # node a: the host's image cache
        # every engine of this process (both nodes) and the daemons they start share it
        monkeypatch.setenv("WARMBOX_CLUSTER__OBJECT_STORE", f"s3://{BUCKET}/{self.prefix}")
        # a safety net: nothing here may reach a package mirror (were a node to build its built-in
        # image, apt would fail at once); the S3 API on loopback bypasses it
        for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
            monkeypatch.setenv(k, "http://127.0.0.1:9")
        for k in ("no_proxy", "NO_PROXY"):
            monkeypatch.setenv(k, "127.0.0.1,localhost")
        self.objects = S3ObjectStore(BUCKET, self.prefix, endpoint_url=s3.url)
        self.monkeypatch = monkeypatch
        self.mounts: list[Path] = []

    def close(self) -> None:
        for m in reversed(self.mounts):
            subprocess.run(["umount", str(m)], check=True)
        self.mounts.clear()

    def seed_builtin(self, cache_b: Path) -> list[str]:
        """Make node b's image cache a bootstrapped host's: the built-in image's record and layers
        (each node builds its own: they never travel). The host's blobs are hard-linked, their
        unpacked directories bind-mounted read-only (a layer directory may not be a symlink). The
        big one (1.4 GB here) also gets a placeholder under its object key (never read: reading it
        would fail its digest), so a's build does not push 1.4 GB into moto; the small built-in
        layer is uploaded for real, and the template's own layers travel. The built-in digests."""
        host = images.store()
        rec = images.builtin_record()
        assert rec is not None, "the built-in image must be built here (scripts/bootstrap install)"
        b_store = LayerStore(cache_b)
        b_store.work_file("init")  # makes its directories
        placeholder = cache_b / "placeholder"
        placeholder.write_bytes(b"a placeholder, not this layer's bytes\n")
        for d in rec.layers:
            os.link(host.blobs / d[7:], b_store.blobs / d[7:])
            target = b_store.dirs / d[7:]
            target.mkdir()
            subprocess.run(["mount", "--bind", host.get(d).path, str(target)], check=True)
            self.mounts.append(target)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
            if (host.blobs / d[7:]).stat().st_size >= BIG:
                self.objects.put_file(templates.layer_key(d), placeholder)
        placeholder.unlink()
        shutil.copyfile(images.cache() / f"{rec.key}.json", cache_b / f"{rec.key}.json")
        return list(rec.layers)


def build(engine: Engine, name: str, token: str) -> TemplateInfo:
    t = Template.from_template("base").run(f"echo {token} > /etc/shared-token")

    async def go() -> TemplateInfo:
        front = EngineFront(engine)
        try:
            return await front.handle(ops.TemplateBuild(name, t, pack_context(t)))
        finally:
            await front.close()

    return asyncio.run(go())


def shared_store(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[SharedStore]:
    shared = SharedStore(s3, monkeypatch)
    try:
        yield shared
    finally:
        shared.close()


def node_cache() -> Iterator[Path]:
    cache = Path(f"/tmp/wbic-{secrets.token_hex(3)}")
    cache.mkdir(mode=0o700)
    try:
        yield cache
    finally:
        shutil.rmtree(cache, ignore_errors=True)  # links are removed, never followed
