"""Attacks on template builds: a RUN step's files steering the host-side COPY, a hostile build
context, and a tenant naming a host path as its image source."""

from __future__ import annotations

import asyncio
import io
import os
import secrets
import tarfile
from pathlib import Path

import pytest

from warmbox import operations as ops
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.errors import Forbidden, InvalidArgument, TemplateBuildError, TemplateNotFound
from warmbox.models import Tenant
from warmbox.templates import Template
from warmbox.templates.context import pack_context

pytestmark = pytest.mark.sandbox


def _handle(engine: Engine, request: ops.Request, tenant: Tenant | None = None):  # type: ignore[type-arg]
    async def go():  # type: ignore[no-untyped-def]
        front = EngineFront(engine, tenant)
        try:
            return await front.handle(request)
        finally:
            await front.close()

    return asyncio.run(go())


def test_a_planted_symlink_does_not_steer_a_later_copy(home: Path, runc_ready: None, tmp_path: Path):
    """A RUN step makes /opt/escape a link to / (and /opt/file a link to a host-looking path); a
    later COPY through it is refused, COPY onto the link replaces the link in the layer, and the
    host writes nothing outside its own temporary tree."""
    engine = Engine.for_home(home)
    marker = f"wb-pwned-{secrets.token_hex(4)}"
    (tmp_path / "payload").write_text("payload\n")
    t = (
        Template.from_template("base")
        .run("ln -s / /opt/escape && ln -s /etc/hostname /opt/file")
        .copy("payload", f"/opt/escape/tmp/{marker}")
        .with_context(tmp_path)
    )
    name = f"atk-{os.getpid()}-link"
    with pytest.raises(TemplateBuildError, match="not a directory in the image"):
        _handle(engine, ops.TemplateBuild(name, t, pack_context(t)))
    assert not Path(f"/tmp/{marker}").exists()
    with pytest.raises(TemplateNotFound):
        _handle(engine, ops.TemplateGet(name))
    # COPY onto the link itself: the layer holds the file, the host's /etc/hostname is untouched
    before = Path("/etc/hostname").read_bytes()
    t2 = (
        Template.from_template("base")
        .run("ln -s /etc/hostname /opt/file")
        .copy("payload", "/opt/file")
        .with_context(tmp_path)
    )
    info = _handle(engine, ops.TemplateBuild(name, t2, pack_context(t2)))
    try:
        assert Path("/etc/hostname").read_bytes() == before
        from warmbox import Sandbox

        with Sandbox.create(template=name, pool=False, timeout=120) as sb:
            r = sb.commands.run("test ! -L /opt/file && cat /opt/file")
            assert r.exit_code == 0 and r.stdout == "payload\n", r.stderr
    finally:
        _handle(engine, ops.TemplateDelete(name))
    assert info.version >= 1


def test_a_hostile_build_context_is_refused_before_any_sandbox(home: Path, runc_ready: None, tmp_path: Path):
    engine = Engine.for_home(home)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        m = tarfile.TarInfo(f"0/0/f/../../../../../../tmp/wb-ctx-{os.getpid()}")
        m.size = 3
        tar.addfile(m, io.BytesIO(b"bad"))
    t = Template.from_template("base").copy("x", "/x")
    before = engine.list(include_dead=True)
    with pytest.raises(InvalidArgument, match="not a safe tar"):
        _handle(engine, ops.TemplateBuild(f"atk-{os.getpid()}-ctx", t, buf.getvalue()))
    assert not Path(f"/tmp/wb-ctx-{os.getpid()}").exists()
    assert engine.list(include_dead=True) == before  # no build sandbox was started


def test_a_tenant_cannot_build_from_a_host_path(home: Path, runc_ready: None):
    engine = Engine.for_home(home)
    t = Template.from_oci("/var/lib/warmbox/images")
    with pytest.raises(Forbidden):
        _handle(engine, ops.TemplateBuild(f"atk-{os.getpid()}-oci", t), Tenant(name="mallory"))


def test_a_build_step_filling_its_disk_gets_enospc_not_the_hosts_disk(home: Path, runc_ready: None):
    """A RUN step writing more than the build's disk (64 MiB here) fails with ENOSPC inside its
    own filesystem; the build fails naming the step, and no mount or file is left behind."""
    from warmbox.engine import builder

    engine = Engine.for_home(home)
    t = Template.from_template("base").run(f"echo {secrets.token_hex(4)}; dd if=/dev/zero of=/big bs=1M count=200")

    async def go() -> None:
        await builder.build(engine, f"atk-{os.getpid()}-fill", t, disk_mb=64)

    with pytest.raises(TemplateBuildError, match="No space left on device"):
        asyncio.run(go())
    builds = builder.image_cache() / "builds"
    from warmbox.backends import workspace_disk

    assert not workspace_disk.mounts_under(builds)
    assert not list(builds.iterdir()) if builds.is_dir() else True
