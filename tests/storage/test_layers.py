"""The layer store on real files (root: owners, overlay xattrs, whiteout devices): trees and blobs
in, unpacked directories out, hostile input refused, digests checked, gc keeping what it is told."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
import time
from pathlib import Path

import pytest

from warmbox.errors import CorruptLayer, InvalidArgument, TemplateError
from warmbox.models import TemplateInfo
from warmbox.storage.layers import LayerStore, image_id_of, image_ref
from warmbox.storage.uidslots import LAYER_UID_BASE

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers are unpacked as root (owners, overlay xattrs)")

BASE = 3_000_000  # the tree's owner base (a build sandbox's would be LAYER_UID_BASE)


def _own(path: Path, uid: int, gid: int | None = None) -> None:
    os.chown(path, BASE + uid, BASE + (uid if gid is None else gid), follow_symlinks=False)


def _tree(root: Path) -> Path:
    """An overlay upper-like tree: files, modes, links, a whiteout, an opaque dir, owners."""
    root.mkdir()
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/tool").write_bytes(b"#!/bin/sh\necho tool\n")
    (root / "home/user").mkdir(parents=True)
    (root / "home/user/notes.txt").write_text("hello")
    os.link(root / "home/user/notes.txt", root / "home/user/same.txt")
    os.symlink("/etc/shadow", root / "home/user/shadow")
    os.symlink("../usr/bin/tool", root / "home/tool")
    (root / "tmp").mkdir()
    os.chmod(root / "tmp", 0o1777)
    os.mknod(root / "home/gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # the kernel's whiteout
    (root / "opt/fresh").mkdir(parents=True)
    (root / "opt/fresh/new").write_text("only me")
    os.setxattr(root / "opt/fresh", "trusted.overlay.opaque", b"y")
    for p in [root, *root.rglob("*")]:
        _own(p, 0)
    _own(root / "home/user", 1000)
    _own(root / "home/user/notes.txt", 1000, 1001)
    _own(root / "home/user/shadow", 1000)
    os.chmod(root / "usr/bin/tool", 0o4755)  # after the chown, which clears setuid
    return root


def _names(blob: Path) -> list[str]:
    with tarfile.open(blob) as tar:
        return tar.getnames()


def test_a_tree_round_trips_with_owners_shifted_and_overlay_whiteouts(tmp_path):
    store = LayerStore(tmp_path / "cache")
    info = store.add_tree(_tree(tmp_path / "upper"), owner_base=BASE)
    hexd = info.digest.removeprefix("sha256:")
    blob = store.blobs / hexd
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == hexd
    assert info.size_bytes == blob.stat().st_size
    names = _names(blob)
    assert "home/.wh.gone" in names and "opt/fresh/.wh..wh..opq" in names  # OCI names in the blob
    d = Path(info.path)
    assert d == store.dirs / hexd
    st = os.lstat(d / "home/gone")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0  # an overlay whiteout again
    assert os.getxattr(d / "opt/fresh", "trusted.overlay.opaque") == b"y"
    assert not (d / "opt/fresh/.wh..wh..opq").exists()
    assert (d / "opt/fresh/new").read_text() == "only me"
    assert stat.S_IMODE(os.lstat(d / "usr/bin/tool").st_mode) == 0o4755
    assert stat.S_IMODE(os.lstat(d / "tmp").st_mode) == 0o1777
    notes = os.lstat(d / "home/user/notes.txt")
    assert (notes.st_uid, notes.st_gid) == (LAYER_UID_BASE + 1000, LAYER_UID_BASE + 1001)
    assert os.lstat(d / "usr/bin/tool").st_uid == LAYER_UID_BASE
    assert os.lstat(d / "home/user/same.txt").st_ino == notes.st_ino  # the hardlink kept
    assert os.readlink(d / "home/user/shadow") == "/etc/shadow"  # stored, never followed
    assert os.lstat(d / "home/user/shadow").st_uid == LAYER_UID_BASE + 1000
    assert os.readlink(d / "home/tool") == "../usr/bin/tool"
    assert (os.lstat(d).st_uid, stat.S_IMODE(os.lstat(d).st_mode)) == (LAYER_UID_BASE, 0o755)
    # the same tree is the same layer; an unpacked layer packed again (owner base: the layer's) too
    assert store.add_tree(tmp_path / "upper", owner_base=BASE).digest == info.digest
    time.sleep(1.1)  # directory mtimes are not part of a layer
    assert store.add_tree(d, owner_base=LAYER_UID_BASE).digest == info.digest
    assert store.digests() == [info.digest]


def test_get_remakes_a_missing_directory_and_a_corrupt_blob_is_refused(tmp_path):
    store = LayerStore(tmp_path / "cache")
    info = store.add_tree(_tree(tmp_path / "upper"), owner_base=BASE)
    store.verify(info.digest)
    os.rename(info.path, tmp_path / "moved")
    again = store.get(info.digest)
    assert again == info and (Path(again.path) / "home/user/notes.txt").read_text() == "hello"
    blob = store.blobs / info.digest.removeprefix("sha256:")
    data = bytearray(blob.read_bytes())
    data[700] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptLayer) as e:
        store.verify(info.digest)
    assert e.value.value == info.digest
    import shutil

    shutil.rmtree(info.path)
    with pytest.raises(CorruptLayer) as e:
        store.get(info.digest)
    assert e.value.value == info.digest
    assert not Path(info.path).exists() and not [n for n in os.listdir(store.dirs) if n.startswith(".")]
    blob.unlink()
    with pytest.raises(CorruptLayer, match="missing"):
        store.get(info.digest)
    with pytest.raises(InvalidArgument):
        store.get("sha256:../../etc")


def test_hostile_trees_are_handled_without_following_anything(tmp_path):
    store = LayerStore(tmp_path / "cache", max_layer_bytes=1 << 20)
    victim = tmp_path / "victim"
    victim.write_text("host secret")  # owned by host root: outside any build's range
    up = tmp_path / "upper"
    up.mkdir()
    _own(up, 0)
    os.symlink("/etc/shadow", up / "shadow")
    os.symlink(str(victim), up / "victim-link")
    os.mkfifo(up / "fifo")
    os.mknod(up / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    for p in up.iterdir():
        _own(p, 0)
    info = store.add_tree(up, owner_base=BASE)
    d = Path(info.path)
    assert sorted(os.listdir(d)) == ["shadow", "victim-link"]  # the FIFO and the device skipped
    assert os.path.islink(d / "shadow") and os.path.islink(d / "victim-link")
    assert b"host secret" not in (store.blobs / info.digest.removeprefix("sha256:")).read_bytes()
    # a hardlink to a host file (its owner is no uid of the tree): refused, nothing stored
    os.link(victim, up / "hard")
    with pytest.raises(TemplateError, match="hard"):
        store.add_tree(up, owner_base=BASE)
    (up / "hard").unlink()
    # an owner outside the range
    (up / "stray").write_text("x")
    os.chown(up / "stray", BASE + 70000, BASE)
    with pytest.raises(TemplateError, match="outside the uid range"):
        store.add_tree(up, owner_base=BASE)
    (up / "stray").unlink()
    # more bytes than the bound (a sparse file: the bound is on what would be stored)
    with open(up / "big", "wb") as f:
        f.truncate(2 << 20)
    _own(up / "big", 0)
    with pytest.raises(TemplateError, match="more than"):
        store.add_tree(up, owner_base=BASE)
    assert store.digests() == [info.digest] and os.listdir(store.tmp) == []


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _m(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644, uid: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.uid, info.gid = kind, link, mode, uid, uid
    return info


def test_oci_blobs_unpack_with_whiteouts_and_digest_checks(tmp_path):
    store = LayerStore(tmp_path / "cache")
    raw = _tar(
        [
            (_m("etc/", tarfile.DIRTYPE, mode=0o755), None),
            (_m("etc/hostname"), b"box\n"),
            (_m("etc/.wh.motd"), b""),
            (_m("var/lib/.wh..wh..opq"), b""),
            (_m("home/u/", tarfile.DIRTYPE, mode=0o700, uid=1000), None),
            (_m("home/u/x", uid=1000), b"x"),
            (_m("home/u/y", tarfile.LNKTYPE, link="home/u/x", uid=1000), None),
            (_m("lib64", tarfile.SYMTYPE, link="/usr/lib64"), None),
            (_m("far", uid=100000), b"far"),
        ]
    )
    blob = tmp_path / "layer.tar.gz"
    blob.write_bytes(gzip.compress(raw))
    digest = "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()
    with pytest.raises(CorruptLayer):
        store.add_blob(blob, digest="sha256:" + "0" * 64)
    assert store.digests() == []
    info = store.add_blob(blob, digest=digest, media_type="application/vnd.oci.image.layer.v1.tar+gzip")
    assert info.digest == digest and info.size_bytes == blob.stat().st_size
    d = Path(info.path)
    assert os.lstat(d / "etc/motd").st_rdev == 0 and stat.S_ISCHR(os.lstat(d / "etc/motd").st_mode)
    assert os.getxattr(d / "var/lib", "trusted.overlay.opaque") == b"y"
    assert os.lstat(d / "var/lib").st_uid == LAYER_UID_BASE  # made by the walk: the layer's root owner
    assert os.lstat(d / "home/u/x").st_uid == LAYER_UID_BASE + 1000
    assert os.lstat(d / "home/u/y").st_ino == os.lstat(d / "home/u/x").st_ino
    assert os.readlink(d / "lib64") == "/usr/lib64"
    assert os.lstat(d / "far").st_uid == LAYER_UID_BASE + 65534  # beyond 65535: nobody
    # plain tar, no digest given: computed
    plain = tmp_path / "plain.tar"
    plain.write_bytes(_tar([(_m("a"), b"a")]))
    assert store.add_blob(plain).digest == "sha256:" + hashlib.sha256(plain.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "members, why",
    [
        ([(_m("../escape"), b"x")], "'..'"),
        ([(_m("/abs"), b"x")], "absolute"),
        ([(_m("etc", tarfile.SYMTYPE, link="/etc"), None), (_m("etc/passwd"), b"root::0:0::/:/bin/sh\n")], "symlink"),
        ([(_m("up", tarfile.SYMTYPE, link="../../.."), None), (_m("up/tmp/x"), b"x")], "symlink"),
        ([(_m("null", tarfile.CHRTYPE), None)], "device"),
        ([(_m("fifo", tarfile.FIFOTYPE), None)], "FIFO"),
        ([(_m("h", tarfile.LNKTYPE, link="etc/shadow"), None)], "hardlink"),
        ([(_m("big"), b"x" * 5000)], "more than"),
    ],
)
def test_hostile_layer_blobs_are_refused_and_leave_nothing(tmp_path, members, why):
    store = LayerStore(tmp_path / "cache", max_layer_bytes=4096)
    blob = tmp_path / "evil.tar"
    blob.write_bytes(_tar(members))
    before = Path("/etc/passwd").read_bytes()
    with pytest.raises(TemplateError, match=why):
        store.add_blob(blob)
    assert Path("/etc/passwd").read_bytes() == before
    assert store.digests() == [] and os.listdir(store.dirs) == []
    assert not (tmp_path / "escape").exists() and not Path("/abs").exists()


def test_gc_keeps_what_it_is_told_and_drops_stale_step_entries(tmp_path):
    store = LayerStore(tmp_path / "cache")
    layers = []
    for i in range(3):
        t = tmp_path / f"t{i}"
        t.mkdir()
        (t / "f").write_text(str(i))
        layers.append(store.add_tree(t, owner_base=0))
    store.cache_step("step-a", layers[0].digest)
    store.cache_step("step-b", layers[1].digest)
    assert store.cached_step("step-a") == layers[0].digest and store.cached_step("nope") is None
    assert store.gc([layers[0].digest], min_age_s=3600) == []  # all too recent
    removed = store.gc([layers[0].digest])
    assert removed == sorted([layers[1].digest, layers[2].digest])
    assert store.digests() == [layers[0].digest] and Path(layers[0].path).is_dir()
    assert not Path(layers[1].path).exists()
    assert store.cached_step("step-a") == layers[0].digest and store.cached_step("step-b") is None
    assert os.listdir(store.steps) == [os.listdir(store.steps)[0]]  # b's entry is gone
    assert store.remove(layers[0].digest) and not store.remove(layers[0].digest)
    assert store.digests() == []


def test_image_id_and_image_ref(tmp_path):
    store = LayerStore(tmp_path / "cache")
    t = tmp_path / "t"
    t.mkdir()
    (t / "f").write_text("f")
    layer = store.add_tree(t, owner_base=0)
    iid = image_id_of([layer.digest], [("A", "1")], "/w", "user")
    assert iid.startswith("sha256:") and iid == image_id_of((layer.digest,), (("A", "1"),), "/w", "user")
    assert iid != image_id_of([layer.digest], [("A", "2")], "/w", "user")
    info = TemplateInfo(name="t", version=3, image_id=iid, layers=(layer.digest,), env=(("A", "1"),), workdir="/w")
    ref = image_ref(store, info)
    assert (ref.template, ref.version, ref.image_id, ref.layers) == ("t", 3, iid, (layer.path,))
    assert ref.env == (("A", "1"),) and ref.workdir == "/w"


def test_concurrent_processes_adding_and_unpacking_the_same_layer_agree(tmp_path):
    """Several processes (several warmbox homes share the cache) add one tree and unpack one
    blob at once: one blob, one directory, every process gets it, nothing half-made is left."""
    import subprocess
    import sys

    tree = _tree(tmp_path / "upper")
    for i in range(200):
        (tree / f"usr/bin/f{i}").write_bytes(os.urandom(2048))
        _own(tree / f"usr/bin/f{i}", 0)
    cache = tmp_path / "cache"
    script = (
        "import sys, shutil; from pathlib import Path; from warmbox.storage.layers import LayerStore\n"
        "s = LayerStore(Path(sys.argv[1]))\n"
        "i = s.add_tree(Path(sys.argv[2]), owner_base=int(sys.argv[3]))\n"
        "for _ in range(3):\n"
        "    shutil.rmtree(i.path, ignore_errors=True)\n"
        "    j = s.get(i.digest)\n"
        "print(i.digest, j.path)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(cache), str(tree), str(BASE)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({o[0] for o in outs}) == 1
    store = LayerStore(cache)
    digest = outs[0][0]
    assert store.digests() == [digest]
    store.verify(digest)
    d = Path(store.get(digest).path)
    assert (d / "home/user/notes.txt").read_text() == "hello" and len(os.listdir(d / "usr/bin")) == 201
    assert os.listdir(store.tmp) == [] and [n for n in os.listdir(store.dirs) if n.startswith(".")] == []


def test_pins_keep_layers_through_any_homes_gc(tmp_path):
    store = LayerStore(tmp_path / "cache")
    made = []
    for i in range(3):
        t = tmp_path / f"t{i}"
        t.mkdir()
        (t / "f").write_text(str(i))
        made.append(store.add_tree(t, owner_base=0).digest)
    store.pin("/homes/a/registry.db#/web/1", [made[0], made[1]])
    store.pin("builtin:k1", [made[1]])
    (store.pins / "junk").write_text("{not json")
    other = LayerStore(tmp_path / "cache")  # another home's view of the same cache
    assert other.pinned() == {"/homes/a/registry.db#/web/1": (made[0], made[1]), "builtin:k1": (made[1],)}
    assert other.gc([]) == [made[2]]
    assert store.unpin("/homes/a/registry.db#/web/1") and not store.unpin("/homes/a/registry.db#/web/1")
    assert other.gc([]) == [made[0]]
    store.pin("builtin:k1", [])  # pinned again: replaced
    assert other.gc([]) == [made[1]] and store.digests() == []
    with pytest.raises(InvalidArgument):
        store.pin("x", ["sha256:nothex"])


def test_zstd_and_gzip_blobs_are_remade_from_their_blob_and_checked(tmp_path):
    import shutil
    import subprocess

    assert shutil.which("zstd"), "zstd missing: scripts/bootstrap install"
    store = LayerStore(tmp_path / "cache")
    raw = _tar(
        [
            (_m("etc/", tarfile.DIRTYPE, mode=0o755), None),
            (_m("etc/zz", uid=7), b"zstd layer"),
            (_m("etc/.wh.old"), b""),
        ]
    )
    (tmp_path / "l.tar").write_bytes(raw)
    subprocess.run(["zstd", "-q", "-19", str(tmp_path / "l.tar"), "-o", str(tmp_path / "l.tar.zst")], check=True)
    (tmp_path / "l.tar.gz").write_bytes(gzip.compress(raw))
    for name, media in (("l.tar.zst", "+zstd"), ("l.tar.gz", "+gzip")):
        info = store.add_blob(tmp_path / name, media_type="application/vnd.oci.image.layer.v1.tar" + media)
        d = Path(info.path)
        assert (d / "etc/zz").read_bytes() == b"zstd layer" and os.lstat(d / "etc/zz").st_uid == LAYER_UID_BASE + 7
        assert os.lstat(d / "etc/old").st_rdev == 0
        shutil.rmtree(d)
        assert store.get(info.digest) == info and (d / "etc/zz").exists()  # remade from the blob
        blob = store.blobs / info.digest.removeprefix("sha256:")
        data = bytearray(blob.read_bytes())
        data[-5] ^= 0x55
        blob.write_bytes(bytes(data))
        shutil.rmtree(d)
        with pytest.raises(CorruptLayer):
            store.get(info.digest)
    with pytest.raises(TemplateError, match="not supported"):
        store.add_blob(tmp_path / "l.tar", media_type="application/vnd.oci.image.layer.v1.tar+bzip2")
