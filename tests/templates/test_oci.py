"""OCI images into the layer store with real tools: an umoci-made layout, its OCI and docker
archives (skopeo), a pull from a docker-registry on 127.0.0.1; hostile layouts and layers refused."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import stat
import tarfile
from pathlib import Path

import pytest

from tests.templates.conftest import HELLO, IMAGE_CMD, IMAGE_WORKDIR
from warmbox.errors import CorruptLayer, ImageRegistryUnreachable, InvalidArgument, TemplateError
from warmbox.models import OciImage
from warmbox.storage.layers import LayerStore
from warmbox.storage.oci import import_oci, pull
from warmbox.storage.uidslots import LAYER_UID_BASE

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers are unpacked as root (owners, overlay xattrs)")


def _check_python_image(img: OciImage) -> None:
    """The fixture image: python3 in the bottom layer, the top one removes /etc/motd, adds /srv/hello.txt."""
    assert len(img.layers) == 2
    bottom, top = (Path(layer.path) for layer in img.layers)
    py = os.readlink(bottom / "usr/bin/python3")  # a symlink to python3.X, as Debian ships it
    assert (bottom / "usr/bin" / py).is_file() and os.lstat(bottom / "usr/bin" / py).st_uid == LAYER_UID_BASE
    assert (bottom / "etc/motd").is_file()
    motd = os.lstat(top / "etc/motd")
    assert stat.S_ISCHR(motd.st_mode) and motd.st_rdev == 0  # an overlay whiteout
    assert (top / "srv/hello.txt").read_text() == HELLO
    assert ("WARMBOX_OCI", "1") in img.env and img.workdir == IMAGE_WORKDIR
    assert img.cmd[-1] == IMAGE_CMD and img.user == ""


def test_an_oci_layout_and_its_archive_import_to_the_same_layers(tmp_path, oci_layout, oci_archive):
    store = LayerStore(tmp_path / "cache")
    img = import_oci(store, oci_layout)
    _check_python_image(img)
    for layer in img.layers:
        store.verify(layer.digest)
    again = import_oci(store, oci_archive)
    assert again == img  # the same blobs: the same digests and directories
    assert os.listdir(store.tmp) == []


def test_a_docker_save_archive_imports(tmp_path, docker_archive):
    store = LayerStore(tmp_path / "cache")
    _check_python_image(import_oci(store, docker_archive))
    assert os.listdir(store.tmp) == []


def test_pull_from_a_local_registry(tmp_path, registry_image, local_registry):
    store = LayerStore(tmp_path / "cache")
    img = pull(store, registry_image, tls_verify=False)
    _check_python_image(img)
    with pytest.raises(TemplateError, match="pulling"):
        pull(store, f"{local_registry}/warmbox/nothing:1", tls_verify=False)
    with pytest.raises(InvalidArgument):
        pull(store, "--src-creds=x:y")
    # a registry nothing listens on: a typed error naming it, not skopeo's text alone
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ImageRegistryUnreachable, match=f"cannot reach the image registry {closed}") as e:
        pull(store, f"{closed}/library/python:3.11-slim", tls_verify=False)
    assert e.value.registry == closed
    assert os.listdir(store.tmp) == []


# ---- hostile layouts: the good layout copied, one part changed (JSON written here is test input)


def _copy_layout(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def _blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs/sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _manifest_path(layout: Path) -> tuple[dict, dict]:
    index = json.loads((layout / "index.json").read_text())
    desc = index["manifests"][0]
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"].removeprefix("sha256:")).read_bytes())
    return index, manifest


def _with_layer(layout: Path, layer_tar: bytes) -> None:
    """Add a layer on top of the image: a new manifest blob, the index pointing at it."""
    index, manifest = _manifest_path(layout)
    d = _blob(layout, layer_tar)
    manifest["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar", **d})
    m = _blob(layout, json.dumps(manifest).encode())
    index["manifests"][0].update(m)
    (layout / "index.json").write_text(json.dumps(index))


def _tar(*members: tuple[str, bytes, bytes | None, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, link in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.mark.parametrize(
    "layer, why",
    [
        (_tar(("../../../../tmp/warmbox-escape", tarfile.REGTYPE, b"x", "")), "'..'"),
        (
            _tar(
                ("etc", tarfile.SYMTYPE, None, "/etc"), ("etc/cron.d/evil", tarfile.REGTYPE, b"* * * * * root id", "")
            ),
            "symlink",
        ),
        (_tar(("dev/sda", tarfile.BLKTYPE, None, "")), "device"),
        (_tar(("h", tarfile.LNKTYPE, None, "/etc/shadow")), "absolute"),
    ],
)
def test_a_hostile_layer_is_refused_and_leaves_nothing(tmp_path, oci_layout, layer, why):
    layout = _copy_layout(oci_layout, tmp_path / "layout")
    _with_layer(layout, layer)
    store = LayerStore(tmp_path / "cache")
    with pytest.raises(TemplateError, match=why):
        import_oci(store, layout)
    assert not Path("/tmp/warmbox-escape").exists() and not Path("/etc/cron.d/evil").exists()
    assert len(store.digests()) == 2  # the two good layers below it; the hostile one is not kept
    assert [n for n in os.listdir(store.dirs) if n.startswith(".")] == []


def test_a_blob_not_matching_its_digest_is_corrupt(tmp_path, oci_layout):
    layout = _copy_layout(oci_layout, tmp_path / "layout")
    _, manifest = _manifest_path(layout)
    top = layout / "blobs/sha256" / manifest["layers"][-1]["digest"].removeprefix("sha256:")
    data = bytearray(top.read_bytes())
    data[len(data) // 2] ^= 0xFF
    top.write_bytes(bytes(data))
    store = LayerStore(tmp_path / "cache")
    with pytest.raises(CorruptLayer) as e:
        import_oci(store, layout)
    assert e.value.value == manifest["layers"][-1]["digest"]


def test_layout_json_is_bounded_and_blobs_are_never_reached_through_links(tmp_path, oci_layout):
    layout = _copy_layout(oci_layout, tmp_path / "layout")
    (layout / "index.json").write_bytes(b'{"manifests": [' + b" " * (2 << 20) + b"]}")
    with pytest.raises(TemplateError, match="over"):
        import_oci(LayerStore(tmp_path / "cache"), layout)
    layout2 = _copy_layout(oci_layout, tmp_path / "layout2")
    _, manifest = _manifest_path(layout2)
    top = layout2 / "blobs/sha256" / manifest["layers"][-1]["digest"].removeprefix("sha256:")
    top.unlink()
    os.symlink("/etc/shadow", top)
    with pytest.raises(TemplateError, match="cannot be read"):
        import_oci(LayerStore(tmp_path / "cache2"), layout2)


def test_hostile_or_foreign_archives_are_typed_errors(tmp_path):
    store = LayerStore(tmp_path / "cache")
    evil = tmp_path / "evil.tar"
    evil.write_bytes(
        _tar(
            ("oci-layout", tarfile.REGTYPE, b'{"imageLayoutVersion": "1.0.0"}', ""), ("../x", tarfile.REGTYPE, b"x", "")
        )
    )
    with pytest.raises(TemplateError, match="refused"):
        import_oci(store, evil)
    assert not (tmp_path / "x").exists()
    junk = tmp_path / "junk.tar"
    junk.write_bytes(_tar(("hello.txt", tarfile.REGTYPE, b"hi", "")))
    with pytest.raises(TemplateError, match="neither"):
        import_oci(store, junk)
    (tmp_path / "text").write_text("not a tar")
    with pytest.raises(TemplateError):
        import_oci(store, tmp_path / "text")
    with pytest.raises(TemplateError, match="no OCI image"):
        import_oci(store, tmp_path / "missing")
    assert os.listdir(store.tmp) == []
