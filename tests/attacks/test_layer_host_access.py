"""A template layer (and the microVM root made of it) gives the host's other users nothing.

Layers on the host are owned by the layer uid range (an image's root is host uid
LAYER_UID_BASE), modes and setuid/setgid bits kept. A build's RUN step (untrusted) plants a
setuid and a setgid copy of ``id`` and a file with a tenant's secret in its layer. A host user
(uid nobody here) who could reach the layer's directory would run the setuid copy as host uid
LAYER_UID_BASE — the owner of every layer of every template, which could then rewrite them all —
and read any tenant's files. The store keeps its unpacked layers where only root reaches them;
sandboxes of the image, whose overlay reads its layers with the mounter's (root's) rights, still
see everything.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.attacks.conftest import require_tier
from tests.backends.test_image_root import image_of, launch, sh
from warmbox.engine import teardown
from warmbox.models import LAYER_UID_BASE

pytestmark = pytest.mark.sandbox


def nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run by a host user (nobody) through a shell: setpriv itself execs its command before
    its capabilities are gone, the shell's exec is a plain user's."""
    cmd = " ".join(shlex.quote(a) for a in argv)
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "/bin/sh", "-c", cmd],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=30,
    )


@pytest.fixture
def open_dir():
    """A directory every host user may traverse (as /var/lib/warmbox/images is)."""
    d = Path(tempfile.mkdtemp(prefix="wb-layers-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_setuid_file_planted_by_a_build_gives_host_users_nothing(home, runc_ready, debian_layer, open_dir):
    from warmbox.storage.layers import LayerStore

    engine = require_tier(home, "container")
    upper = open_dir / "upper"
    upper.mkdir()

    async def plant():
        got = await launch(engine, "container", image_of(debian_layer), build_upper=str(upper))
        try:
            rc, out = await sh(
                got,
                "mkdir -p /srv && cp /usr/bin/id /srv/suid-id && chmod 4755 /srv/suid-id && "
                "cp /usr/bin/id /srv/sgid-id && chmod 2755 /srv/sgid-id && "
                "echo TENANT SECRET > /srv/secret && chmod 644 /srv/secret && ls -l /srv",
            )
            assert rc == 0 and "-rwsr-xr-x" in out and "-rwxr-sr-x" in out, out
        finally:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "test over")

    asyncio.run(plant())
    store = LayerStore(open_dir / "cache")
    info = store.add_tree(upper, owner_base=LAYER_UID_BASE)
    srv = Path(info.path) / "srv"
    assert srv.joinpath("suid-id").stat().st_mode & 0o4000  # kept: the image is what the build made
    assert srv.joinpath("suid-id").stat().st_uid == LAYER_UID_BASE
    for name in ("suid-id", "sgid-id"):
        r = nobody(str(srv / name))
        assert str(LAYER_UID_BASE) not in r.stdout, f"a host user ran {name} as the layers' owner: {r.stdout}"
        assert r.returncode != 0 and "Permission denied" in r.stderr, (r.stdout, r.stderr)
    r = nobody("cat", str(srv / "secret"))
    assert r.returncode != 0 and "TENANT SECRET" not in r.stdout
    r = nobody("ls", str(store.dirs))
    assert r.returncode != 0, r.stdout

    # nor the microVM root made of the image (an ext4 of all its layers)
    from warmbox.backends import microvm_image

    root = microvm_image.image_root(open_dir / "images", image_of(debian_layer, info.path))
    r = nobody("cat", str(root))
    assert r.returncode != 0 and "Permission denied" in r.stderr and root.stat().st_size > 0

    # the image's sandboxes still read the layer (container and gVisor), setuid powerless inside
    async def use(tier: str):
        got = await launch(engine, tier, image_of(debian_layer, info.path))
        try:
            rc, out = await sh(got, "cat /srv/secret; /srv/suid-id -u")
            assert rc == 0 and out.splitlines() == ["TENANT SECRET", "1000"], out
        finally:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "test over")

    for tier in ("container", "gvisor"):
        require_tier(home, tier)
        asyncio.run(use(tier))
