"""Container and gVisor sandboxes run a template image: an overlay root of its layers under the tier's
agent layer, with a per-sandbox upper layer; and template build sandboxes (container tier) write
into their build's upper layer as the image's root. Real sandboxes, real layers (a Debian tree with
owners shifted into the layer range, made by hand: tests/backends/conftest.py)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.backends.conftest import NOTHING, leftovers
from warmbox.backends import rootfs, workspace_disk
from warmbox.engine import provision, teardown
from warmbox.engine.engine import Engine
from warmbox.engine.start import StartRecord
from warmbox.errors import SandboxStartError, Unsupported
from warmbox.models import LAYER_UID_BASE, ImageRef, Limits

pytestmark = pytest.mark.sandbox


def image_of(*layers: str, env: tuple[tuple[str, str], ...] = (), workdir: str = "") -> ImageRef:
    ident = hashlib.sha256(repr((layers, env, workdir)).encode()).hexdigest()  # as the store's: one per content
    return ImageRef("test", 1, "sha256:" + ident, tuple(layers), env, workdir, "")


async def launch(engine: Engine, tier: str, image: ImageRef, build_upper: str = "", limits: Limits | None = None):
    tmpl = engine.settings().template("shell")  # no code context: the image's Python runs only the agent
    rec = StartRecord.internal(tier, tmpl.name, 600, limits or Limits())
    spec = provision.LaunchSpec(rec, image=image, build_upper=build_upper)
    return await provision.launch(engine, spec, provision.Cold(tmpl))


async def sh(got, script: str, timeout: float = 120) -> tuple[int, str]:
    r = await got.session.exec(["/bin/sh", "-c", script], timeout_s=timeout)
    return r.exit_code, (r.stdout + r.stderr).strip()


def layer(tmp_path: Path, name: str, files: dict[str, str]) -> str:
    """A small layer made by hand: ``files`` (path -> text), owned by the image's root."""
    root = tmp_path / name
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for parent, dirs, names in os.walk(root):
        for n in (*dirs, *names):
            os.lchown(os.path.join(parent, n), LAYER_UID_BASE, LAYER_UID_BASE)
    os.chown(root, LAYER_UID_BASE, LAYER_UID_BASE)
    tmp_path.chmod(0o755)
    return str(root)


@pytest.fixture(params=["container", "gvisor"])
def tier(request, home, runc_ready):
    return request.param


def assert_failed_starts_left_nothing(engine: Engine, before: set[str]) -> None:
    """The sandboxes started since ``before`` (the ids the registry listed) failed and left no mount or state
    dir (the session's pools fill meanwhile: their sandboxes are not looked at)."""
    new = [(i, h) for i, h in engine.registry.sandboxes.list(include_dead=True) if i.sandbox_id not in before]
    assert new and all("start failed" in engine.registry.sandboxes.ended_reason(i.sandbox_id) for i, _ in new), new
    for _, handle in new:
        assert workspace_disk.mounts_under(handle.state_dir) == [] and not os.path.exists(handle.state_dir)


def test_a_sandbox_runs_the_image_not_the_hosts_usr(tier, home, debian_layer, tmp_path):
    engine = Engine.for_home(home)
    top = layer(
        tmp_path,
        "top",
        {
            "opt/app/hello.txt": "from the top layer\n",
            # a user a Dockerfile added, and one that tries to be the sandbox user
            "etc/passwd": "root:x:0:0:root:/root:/bin/bash\napp:x:1500:1500::/home/app:/bin/sh\n"
            "impostor:x:1000:1000::/tmp:/bin/sh\n",
        },
    )
    image = image_of(
        debian_layer, top, env=(("GREETING", "from the image"), ("PATH", "/opt/app:/usr/bin:/bin")), workdir="/opt/app"
    )

    async def go():
        got = await launch(engine, tier, image)
        try:
            rc, out = await sh(
                got,
                "id -u; pwd; echo $GREETING; echo $HOME; cat hello.txt; "
                "test -e /usr/bin/runc && echo host-usr || echo no-host-usr; "
                "python3 -c 'import sys; print(sys.version_info[:2])'; "
                "stat -c %U /usr/bin/python3; cat /etc/debian_version",
            )
            assert rc == 0, out
            lines = out.splitlines()
            assert lines[:6] == [
                "1000",
                "/opt/app",
                "from the image",
                "/home/user",
                "from the top layer",
                "no-host-usr",
            ]
            assert lines[6].startswith("(3,") and lines[7] == "nobody"  # the layers' owners are not the sandbox's
            assert lines[8][:2].isdigit()
            rc, out = await sh(got, "getent passwd app user 1000 | cut -d: -f1,3,6; whoami")
            assert out.splitlines() == ["app:1500:/home/app", "user:1000:/home/user", "user:1000:/home/user", "user"]
            # the sandbox's writes go to its own upper layer, never into a shared layer
            rc, out = await sh(got, "echo mine > /var/tmp/written && cat /var/tmp/written")
            assert (rc, out) == (0, "mine")
            assert not os.path.exists(os.path.join(debian_layer, "var/tmp/written"))
            state = got.handle.state_dir
            assert os.path.ismount(os.path.join(state, rootfs.ROOT))
        finally:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "test over")
        assert leftovers(engine.backend(tier), got.handle) == NOTHING

    asyncio.run(go())


def test_an_image_without_python_is_a_clear_start_error(tier, home, tmp_path):
    engine = Engine.for_home(home)
    image = image_of(layer(tmp_path, "bare", {"etc/os-release": "ID=bare\n"}))

    async def go():
        with pytest.raises(
            SandboxStartError, match=r"template test:1 cannot run the guest agent: it has no /usr/bin/python3"
        ):
            await launch(engine, tier, image)

    before = {info.sandbox_id for info, _ in engine.registry.sandboxes.list(include_dead=True)}
    asyncio.run(go())
    assert_failed_starts_left_nothing(engine, before)


def test_a_start_that_fails_after_the_root_is_mounted_leaves_no_mount(tier, home, debian_layer, tmp_path):
    engine = Engine.for_home(home)
    broken = layer(tmp_path, "broken", {"usr/bin/python3": "#!/bin/sh\necho broken interpreter >&2\nexit 3\n"})
    os.chmod(os.path.join(broken, "usr/bin/python3"), 0o755)
    image = image_of(debian_layer, broken)
    before = {info.sandbox_id for info, _ in engine.registry.sandboxes.list(include_dead=True)}

    async def go():
        with pytest.raises(SandboxStartError):
            await launch(engine, tier, image)

    asyncio.run(go())
    assert_failed_starts_left_nothing(engine, before)  # the overlay and its tmpfs went too


def test_a_build_sandbox_needs_the_container_tier(home, runc_ready, debian_layer, tmp_path):
    engine = Engine.for_home(home)
    upper = tmp_path / "upper"
    upper.mkdir()

    async def go():
        with pytest.raises(Unsupported, match="container tier"):
            await launch(engine, "gvisor", image_of(debian_layer), build_upper=str(upper))

    asyncio.run(go())


def _deb(tmp_path: Path) -> Path:
    """A tiny .deb: /usr/share/wbdemo/hello and /usr/bin/wbdemo."""
    pkg = tmp_path / "wbdemo"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text(
        "Package: wbdemo\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t.invalid>\nDescription: demo\n"
    )
    (pkg / "usr/share/wbdemo").mkdir(parents=True)
    (pkg / "usr/share/wbdemo/hello").write_text("hello from a package\n")
    (pkg / "usr/bin").mkdir(parents=True)
    (pkg / "usr/bin/wbdemo").write_text("#!/bin/sh\ncat /usr/share/wbdemo/hello\n")
    (pkg / "usr/bin/wbdemo").chmod(0o755)
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-b", str(pkg), str(tmp_path / "wbdemo.deb")],
        check=True,
        capture_output=True,
    )
    return tmp_path / "wbdemo.deb"


def _tree(root: Path) -> dict[str, os.stat_result]:
    out = {}
    for parent, dirs, files in os.walk(root):
        for n in (*dirs, *files):
            p = os.path.join(parent, n)
            out[os.path.relpath(p, root)] = os.lstat(p)
    return out


def test_a_build_sandbox_installs_as_the_images_root_into_its_upper_layer(home, runc_ready, debian_layer, tmp_path):
    engine = Engine.for_home(home)
    upper = tmp_path / "build" / "upper"
    upper.mkdir(parents=True)
    deb = _deb(tmp_path)
    status = Path(debian_layer) / "var/lib/dpkg/status"
    status_before = (status.stat().st_mtime_ns, status.stat().st_size)

    async def go():
        got = await launch(engine, "container", image_of(debian_layer), build_upper=str(upper))
        try:
            assert got.handle.uid_base == LAYER_UID_BASE
            rc, out = await sh(got, "id -u; echo $HOME; pwd; grep CapEff /proc/self/status")
            assert rc == 0, out
            lines = out.splitlines()
            assert lines[:3] == ["0", "/root", "/"], out
            assert int(lines[3].split()[1], 16) != 0  # Docker's default set
            await got.session.write("/tmp/wbdemo.deb", deb.read_bytes())  # the files API, as the builder does
            rc, out = await sh(
                got,
                "set -e; apt-get install -y -q /tmp/wbdemo.deb; wbdemo; "
                "useradd -u 1234 -m bob; mkdir /srv/data; echo x > /srv/data/f; chown -R bob:bob /srv/data; "
                "rm /tmp/wbdemo.deb; rm -rf /var/cache/apt/*.bin",
                timeout=300,
            )
            assert rc == 0, out
            assert "hello from a package" in out
            rc, out = await sh(got, "stat -c '%u %g' /srv/data/f /home/bob")
            assert out.splitlines() == ["1234 1234", "1234 1234"], out
        finally:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "test over")
        assert leftovers(engine.backend("container"), got.handle) == NOTHING
        assert not upper.with_name("upper.work").exists()  # the overlay's workdir goes with the sandbox

    asyncio.run(go())
    tree = _tree(upper)
    for rel, uid in (
        ("usr/share/wbdemo/hello", 0),
        ("usr/bin/wbdemo", 0),
        ("srv/data/f", 1234),
        ("home/bob", 1234),
        ("etc/passwd", 0),
    ):
        assert rel in tree, (rel, sorted(tree))
        assert (tree[rel].st_uid, tree[rel].st_gid) == (LAYER_UID_BASE + uid, LAYER_UID_BASE + uid), rel
    assert "bob:x:1234:1234" in (upper / "etc/passwd").read_text()
    # exactly the build's changes: nothing of the agent, its mounts or the files API's scratch
    tops = {rel.split("/")[0] for rel in tree}
    assert tops <= {"usr", "srv", "home", "etc", "var"}, sorted(tops)  # /tmp and /run are tmpfs
    assert not any(rel.startswith(("opt", "workspace", "proc", "etc/hosts", "etc/resolv.conf")) for rel in tree)
    assert all(st.st_uid >= LAYER_UID_BASE for st in tree.values())
    # the lower layer is untouched
    assert (status.stat().st_mtime_ns, status.stat().st_size) == status_before
    assert not (Path(debian_layer) / "usr/share/wbdemo").exists()
    assert "bob" not in (Path(debian_layer) / "etc/passwd").read_text()
    shutil.rmtree(tmp_path / "build")
