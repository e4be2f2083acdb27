"""Attacks through an OCI image's layers (container and gVisor tiers).

An image comes from whoever published it. Its layer tars are unpacked on the host as root, so:

- members that would land outside the layer (``..``, an absolute name, a write through a symlink
  the layer planted) and device nodes (a block device would hand the sandbox the host's disk)
  refuse the whole import, and nothing of that layer stays in the store;
- what an image may hold and is kept as data gets the sandbox nothing: an absolute symlink to a
  host file resolves inside the sandbox's own root, and a setuid-root binary runs as the sandbox
  user (the image's root is a layer uid no ordinary sandbox maps).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.attacks.conftest import require_tier
from tests.backends.test_image_root import launch, sh
from warmbox.engine import teardown
from warmbox.errors import TemplateError
from warmbox.models import ImageRef
from warmbox.storage.layers import LayerStore, image_id_of
from warmbox.storage.oci import import_oci

pytestmark = pytest.mark.sandbox


def _member(name: str, kind: bytes, data: bytes | None = None, link: str = "", mode: int = 0o644) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 8, 0  # /dev/sda
    return info, data


def _layout_with(src: Path, dest: Path, *members: tuple) -> Path:
    """The fixture image with one more layer of ``members`` (a new manifest; the index points at it)."""
    shutil.copytree(src, dest, symlinks=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)

    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (dest / "blobs/sha256" / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    index = json.loads((dest / "index.json").read_text())
    manifest = json.loads((dest / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    manifest["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(buf.getvalue())})
    index["manifests"][0].update(blob(json.dumps(manifest).encode()))
    (dest / "index.json").write_text(json.dumps(index))
    return dest


@pytest.mark.parametrize(
    "members",
    [
        [_member("../../../../../tmp/wb-escaped", tarfile.REGTYPE, b"x")],
        [_member("/tmp/wb-escaped", tarfile.REGTYPE, b"x")],
        [_member("tmp", tarfile.SYMTYPE, link="/tmp"), _member("tmp/wb-escaped", tarfile.REGTYPE, b"x")],
        [_member("dev/sda", tarfile.BLKTYPE)],
        [_member("dev/mem", tarfile.CHRTYPE)],
    ],
    ids=["dotdot", "absolute", "through-symlink", "block-device", "char-device"],
)
def test_an_image_layer_that_escapes_or_holds_a_device_is_refused(tmp_path, oci_layout, members):
    layout = _layout_with(oci_layout, tmp_path / "layout", *members)
    store = LayerStore(tmp_path / "cache")
    with pytest.raises(TemplateError, match="refused"):
        import_oci(store, layout)
    assert not Path("/tmp/wb-escaped").exists()
    good = {layer.digest for layer in import_oci(store, oci_layout).layers}
    assert set(store.digests()) == good  # the hostile layer was not kept
    for d in store.digests():
        for _, dirs, files in os.walk(store.get(d).path):
            assert not any(n in ("sda", "mem", "wb-escaped") for n in (*dirs, *files))


def test_an_image_symlink_to_a_host_file_and_a_setuid_root_binary_give_the_sandbox_nothing(
    tier, home, tmp_path, oci_layout, python_rootfs
):
    engine = require_tier(home, tier)
    secret = Path(f"/var/tmp/wb-host-secret-{os.getpid()}")
    secret.write_text("host secret\n")
    try:
        py = os.path.realpath(python_rootfs / "usr/bin/python3").removeprefix(str(python_rootfs))
        layout = _layout_with(
            oci_layout,
            tmp_path / "layout",
            _member("srv/host-secret", tarfile.SYMTYPE, link=str(secret)),
            _member("srv/etc", tarfile.SYMTYPE, link="/etc"),
            _member(
                "usr/local/bin/rootpy", tarfile.REGTYPE, (python_rootfs / py.lstrip("/")).read_bytes(), mode=0o4755
            ),
        )
        tmp_path.chmod(0o755)
        store = LayerStore(tmp_path / "cache")
        img = import_oci(store, layout)
        digests = [layer.digest for layer in img.layers]
        image = ImageRef(
            "hostile", 1, image_id_of(digests, img.env, img.workdir, img.user), tuple(x.path for x in img.layers)
        )
        top = Path(img.layers[-1].path)
        assert os.readlink(top / "srv/host-secret") == str(secret)  # kept as data, never followed
        assert os.stat(top / "usr/local/bin/rootpy").st_mode & 0o4000

        async def go():
            got = await launch(engine, tier, image)
            try:
                rc, out = await sh(got, "cat /srv/host-secret; echo rc=$?")
                assert "host secret" not in out and "rc=1" in out, out
                rc, out = await sh(got, "ls /srv/etc/os-release && echo in-root")
                assert "in-root" in out, out  # /etc of the sandbox's root, not the host's
                rc, out = await sh(got, "/usr/local/bin/rootpy -c 'import os; print(os.geteuid(), os.getuid())'")
                assert rc == 0, out
                euid, uid = (int(x) for x in out.split())
                assert euid == uid != 0, out  # setuid to the image's root: not honoured
                rc, out = await sh(got, "echo x > /usr/local/bin/rootpy; echo rc=$?")
                assert "rc=0" not in out, out
            finally:
                await got.session.close()
                await teardown.destroy(engine, got.sandbox_id, "test over")

        asyncio.run(go())
        assert secret.read_text() == "host secret\n"
    finally:
        secret.unlink(missing_ok=True)
