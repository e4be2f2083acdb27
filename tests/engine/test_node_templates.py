"""A template built on one cluster node is created from on another: two homes on this host as
nodes "a" and "b" sharing one registry and one object store (a real S3 API: moto's server), each
with its own image cache, so b fetches the layers it lacks from the object store (sha256 checked)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
from pathlib import Path

import pytest

from tests import layershare
from warmbox import Sandbox
from warmbox import operations as ops
from warmbox.engine.front import EngineFront
from warmbox.models import Tenant
from warmbox.storage import templates
from warmbox.storage.layers import LayerStore
from warmbox.templates import Template
from warmbox.templates.context import pack_context

pytestmark = pytest.mark.sandbox


@pytest.fixture
def cache_b():
    yield from layershare.node_cache()


@pytest.fixture
def shared(s3_server, monkeypatch, cache_b):  # after cache_b: its mounts go before the directory
    yield from layershare.shared_store(s3_server, monkeypatch)


def test_a_template_built_on_node_a_runs_on_node_b_from_the_object_store(
    shared, node_homes, monkeypatch, cache_b, runc_ready
):
    a = node_homes.add("a")
    b = node_homes.add("b", share=a)
    builtin = shared.seed_builtin(cache_b)
    token = secrets.token_hex(8)
    info = layershare.build(a, f"t-shared-{os.getpid()}", token)
    # a uploaded every layer of the version before recording it (the big one was there already)
    keys = set(shared.objects.list(templates.LAYER_PREFIX))
    assert {templates.layer_key(d) for d in info.layers} <= keys
    travel = [d for d in info.layers if d not in builtin]
    assert travel and set(info.layers) - set(travel) == set(builtin)  # b has the built-in ones
    b_store = LayerStore(cache_b)
    assert not any(b_store.has(d) for d in travel)

    monkeypatch.setenv("WARMBOX_IMAGE_CACHE", str(cache_b))  # from here on: node b's host
    sb = Sandbox.create(template=info.name, tier="container", timeout=120, pool=False, home=b.home)
    try:
        assert b.registry.nodes.node_of(sb.sandbox_id) == "b"
        assert sb.commands.run("cat /etc/shared-token").stdout == f"{token}\n"
        for d in travel:  # fetched: real files in b's store whose bytes are the digest's
            blob = b_store.blobs / d[7:]
            assert blob.is_file() and not blob.is_symlink()
            assert hashlib.sha256(blob.read_bytes()).hexdigest() == d[7:]
            assert Path(b_store.get(d).path).is_dir()
        assert os.listdir(b_store.tmp) == []
    finally:
        sb.kill()


def _build_as(engine, tenant, name: str, t):  # type: ignore[no-untyped-def]
    events: list = []

    async def go():  # type: ignore[no-untyped-def]
        front = EngineFront(engine, tenant)
        try:
            return await front.handle(ops.TemplateBuild(name, t, pack_context(t), events.append))
        finally:
            await front.close()

    info = asyncio.run(go())
    return info, {e.status for e in events if e.step == 1}


def test_a_tenants_step_cache_is_the_clusters_and_another_tenants_is_not(
    shared, node_homes, monkeypatch, cache_b, runc_ready
):
    """A tenant's step rows live in the shared registry: its step built on node a is a cache hit on
    node b (the layer fetched from the object store); another tenant's same step runs on b."""
    a = node_homes.add("a")
    b = node_homes.add("b", share=a)
    shared.seed_builtin(cache_b)
    tok = secrets.token_hex(4)
    alice, bob = Tenant(f"alice-{tok}"), Tenant(f"bob-{tok}")
    t = Template.from_template("base").run(f"head -c 16 /dev/urandom | base64 > /etc/step-{tok}")
    info, statuses = _build_as(a, alice, f"t-step-{tok}", t)
    assert statuses == {"running", "done"}
    mine = info.layers[-1]

    monkeypatch.setenv("WARMBOX_IMAGE_CACHE", str(cache_b))  # from here on: node b's host
    assert not LayerStore(cache_b).has(mine)
    again, statuses = _build_as(b, alice, f"t-step-{tok}", t)
    assert statuses == {"cached"} and again.layers == info.layers
    assert LayerStore(cache_b).has(mine)  # fetched, checked against its digest
    other, statuses = _build_as(b, bob, f"t-step-{tok}", t)
    assert statuses == {"running", "done"} and other.layers[-1] != mine
