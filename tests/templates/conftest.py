"""Fixtures for image sources: a small Debian root with python3 (the guest agent needs
/usr/bin/python3), made into a two-layer OCI image by umoci, its OCI and docker archives (skopeo),
and a docker-registry on 127.0.0.1 holding it.

The root and the images are built once per host (mmdebstrap from the configured apt mirror, then
umoci) under /var/lib/warmbox/test-cache, keyed by how they are made; tests read them, never
change them. The registry is per session: a temp config and storage, a free port, ended by PID.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TEST_CACHE = Path(os.environ.get("WARMBOX_TEST_CACHE") or "/var/lib/warmbox/test-cache")
PY_PACKAGES = ("python3",)  # the whole stdlib: the guest agent needs json, socket, ...
EXCLUDES = ("/usr/share/man/*", "/usr/share/doc/*", "/usr/share/locale/*", "/usr/share/info/*")
IMAGE_TAG = "py"
IMAGE_ENV = ("WARMBOX_OCI=1", "PATH=/usr/local/bin:/usr/bin:/bin")
IMAGE_WORKDIR = "/srv"
IMAGE_CMD = "/usr/bin/python3"
# the second layer: removes /etc/motd (a whiteout), adds /srv/hello.txt
HELLO = "hello from the second layer\n"


def _run(argv: list[str], timeout: float = 900) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed ({r.returncode}): {r.stderr[-2000:]}")


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: scripts/bootstrap install")


def _cached(name: str, make) -> Path:  # type: ignore[no-untyped-def]
    """TEST_CACHE/name, made once per host by make(tmp_dir) under a lock, then renamed in place."""
    final = TEST_CACHE / name
    if final.exists():
        return final
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists():
            return final
        tmp = TEST_CACHE / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            make(tmp)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def _make_rootfs(tmp: Path) -> None:
    root = tmp / "rootfs"
    argv = ["mmdebstrap", "--variant=essential", "--quiet", "--mode=root", "--include=" + ",".join(PY_PACKAGES)]
    argv += [f"--dpkgopt=path-exclude={x}" for x in EXCLUDES]
    argv += ["bookworm", str(root)]
    _run(argv, timeout=1800)
    for junk in ("var/cache/apt", "var/lib/apt/lists"):
        for p in (root / junk).glob("*"):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for p in (root / "dev").iterdir():  # mmdebstrap's device nodes: no image layer holds devices
        if stat.S_ISCHR(p.lstat().st_mode) or stat.S_ISBLK(p.lstat().st_mode):
            p.unlink()
    (root / "etc/motd").write_text("the first layer's motd\n")


@pytest.fixture(scope="session")
def python_rootfs() -> Path:
    """A Debian bookworm root (essential + python3, no devices), read-only to tests."""
    _need("mmdebstrap")
    return _cached(f"py-rootfs-{_key(PY_PACKAGES, EXCLUDES, 'motd')}", _make_rootfs) / "rootfs"


@pytest.fixture(scope="session")
def oci_layout(python_rootfs: Path) -> Path:
    """An OCI image layout (tag ``py``) made by umoci: layer 1 the root, layer 2 removes /etc/motd
    and adds /srv/hello.txt; config Env IMAGE_ENV, WorkingDir /srv, Cmd python3."""
    _need("umoci")

    def make(tmp: Path) -> None:
        layout, image = tmp / "layout", f"{tmp / 'layout'}:{IMAGE_TAG}"
        _run(["umoci", "init", "--layout", str(layout)])
        _run(["umoci", "new", "--image", image])
        bundle = tmp / "bundle"
        _run(["umoci", "unpack", "--image", image, str(bundle)])
        _run(["cp", "-a", f"{python_rootfs}/.", str(bundle / "rootfs")])
        _run(["umoci", "repack", "--image", image, str(bundle)])
        shutil.rmtree(bundle)
        _run(["umoci", "unpack", "--image", image, str(bundle)])
        (bundle / "rootfs/etc/motd").unlink()
        (bundle / "rootfs/srv/hello.txt").write_text(HELLO)
        _run(["umoci", "repack", "--image", image, str(bundle)])
        shutil.rmtree(bundle)
        argv = ["umoci", "config", "--image", image, "--config.workingdir", IMAGE_WORKDIR]
        argv += [a for e in IMAGE_ENV for a in ("--config.env", e)]
        argv += ["--config.cmd", IMAGE_CMD]
        _run(argv)
        _run(["umoci", "gc", "--layout", str(layout)])

    return _cached(f"py-oci-{_key(python_rootfs.parent.name, IMAGE_ENV, IMAGE_WORKDIR, HELLO)}", make) / "layout"


@pytest.fixture(scope="session")
def oci_archive(oci_layout: Path) -> Path:
    """The image as an OCI archive (``skopeo copy oci:... oci-archive:...``)."""
    _need("skopeo")

    def make(tmp: Path) -> None:
        _run(["skopeo", "copy", "--quiet", f"oci:{oci_layout}:{IMAGE_TAG}", f"oci-archive:{tmp / 'image.tar'}"])

    return _cached(f"py-oci-archive-{_key(oci_layout.parent.name)}", make) / "image.tar"


@pytest.fixture(scope="session")
def docker_archive(oci_layout: Path) -> Path:
    """The image as a ``docker save`` archive (``skopeo copy ... docker-archive:...``)."""
    _need("skopeo")

    def make(tmp: Path) -> None:
        dest = f"docker-archive:{tmp / 'image.tar'}:warmbox/py:1"
        _run(["skopeo", "copy", "--quiet", f"oci:{oci_layout}:{IMAGE_TAG}", dest])

    return _cached(f"py-docker-archive-{_key(oci_layout.parent.name)}", make) / "image.tar"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def local_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A docker-registry (plain HTTP) on 127.0.0.1; its ``host:port``."""
    _need("docker-registry")
    d = tmp_path_factory.mktemp("registry")
    port = _free_port()
    (d / "config.yml").write_text(
        "version: 0.1\n"
        "log:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {d / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = open(d / "registry.log", "wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(d / "config.yml")], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {(d / 'registry.log').read_text()[-1000:]}")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def registry_image(local_registry: str, oci_layout: Path) -> str:
    """The image pushed to the local registry: its reference (``127.0.0.1:PORT/warmbox/py:1``)."""
    ref = f"{local_registry}/warmbox/py:1"
    _run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{oci_layout}:{IMAGE_TAG}", f"docker://{ref}"])
    return ref
