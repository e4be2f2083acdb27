"""The microVM tier runs a template image: an ext4 root per image, made from its layers with the image's
own owners (mkfs.ext4 in a user namespace mapping the layer range back), under the guest agent.
Run under ``flock /work/vm.lock`` (one VM test run at a time on the host)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.backends.test_image_root import image_of, launch, layer, sh
from warmbox.backends import microvm_image
from warmbox.engine import teardown
from warmbox.errors import SandboxStartError, Unsupported

pytestmark = pytest.mark.sandbox


def test_a_vm_runs_the_image_with_its_own_owners(engine, debian_layer, tmp_path):
    top = layer(
        tmp_path,
        "top",
        {
            "opt/app/hello.txt": "from the top layer\n",
            "etc/passwd": "root:x:0:0:root:/root:/bin/bash\napp:x:1500:1500::/home/app:/bin/sh\n",
        },
    )
    image = image_of(debian_layer, top, env=(("GREETING", "from the image"),))
    backend = engine.backend("microvm")
    root = microvm_image.image_root_path(microvm_image.cache_dir(), image)
    assert backend.template_fingerprint(image) != backend.template_fingerprint()
    assert backend.template_fingerprint(image) != backend.template_fingerprint(image_of(debian_layer))

    async def go():
        got = await launch(engine, "microvm", image)
        try:
            rc, out = await sh(
                got,
                "id -u; cat /opt/app/hello.txt; getent passwd app user | cut -d: -f1,3; "
                "stat -c '%u %g %a' /usr/bin/su /home/user; test -e /usr/bin/runc && echo host || echo image",
            )
            assert rc == 0, out
            assert out.splitlines() == [
                "1000",
                "from the top layer",
                "app:1500",
                "user:1000",
                "0 0 4755",  # the image's root owns its files inside the VM (not nobody)
                "1000 1000 755",
                "image",
            ], out
        finally:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "test over")

    asyncio.run(go())
    assert root.is_file()
    # made once: the next sandbox of the image reuses it
    assert microvm_image.image_root(microvm_image.cache_dir(), image) == root
    # the ext4's owners are the image's (0, 1000), mapped back from the layer range
    out = subprocess.run(["debugfs", "-R", "stat /home/user", str(root)], capture_output=True, text=True).stdout
    assert "User:  1000   Group:  1000" in out
    root.unlink()  # a test image: nothing else will use it


def test_an_image_the_init_cannot_run_and_a_build_sandbox_are_refused(engine, tmp_path, debian_layer):
    bare = image_of(layer(tmp_path, "bare", {"usr/bin/python3": "not really\n"}))

    async def go():
        with pytest.raises(SandboxStartError, match="has no /usr/bin/env, /usr/bin/prlimit, /usr/bin/setpriv"):
            await launch(engine, "microvm", bare)
        upper = tmp_path / "upper"
        upper.mkdir()
        with pytest.raises(Unsupported, match="container tier"):
            await launch(engine, "microvm", image_of(debian_layer), build_upper=str(upper))

    asyncio.run(go())
    assert not Path(microvm_image.image_root_path(microvm_image.cache_dir(), bare)).exists()
