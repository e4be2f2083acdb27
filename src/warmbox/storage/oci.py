"""OCI images into the layer store: an OCI image layout directory, an OCI archive (``podman save
--format oci-archive``, ``skopeo copy ... oci-archive:``), a ``docker save`` archive (converted by
``skopeo copy docker-archive:``) or a registry (``skopeo copy docker://``).

Only the layout's JSON (``oci-layout``, ``index.json``, manifests, config) is read here, each
bounded and, past the index, checked against its digest; every layer blob is checked against its
digest and unpacked under :class:`warmbox.safetar.LayerRules` by the store. Nothing in a layout
is reached through a symlink. Registries are spoken to by skopeo only (a failed pull checks
that the registry's port accepts a TCP connection, to say whether it was reachable at all).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from warmbox import safetar
from warmbox.errors import CorruptLayer, ImageRegistryUnreachable, InvalidArgument, TemplateError
from warmbox.models import LayerInfo, OciImage
from warmbox.storage.layers import LayerStore

MAX_INDEX = 1 << 20  # bytes of index.json, a manifest or an image index
MAX_CONFIG = 8 << 20  # bytes of an image config (its history can be long)
MAX_LAYERS = 128  # overlay stacks this many lower directories with room to spare
MAX_DEPTH = 3  # nested image indexes followed
SKOPEO_TIMEOUT_S = 1800.0
PROBE_TIMEOUT_S = 10.0  # a TCP connect to a registry after a failed pull
DOCKER_HUB_HOST = "registry-1.docker.io"  # where skopeo goes for docker.io

_MANIFEST = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
_INDEX = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
_LAYER = re.compile(
    r"^application/vnd\.(oci\.image\.layer(\.nondistributable)?\.v1\.tar(\+gzip|\+zstd)?"
    r"|docker\.image\.rootfs\.(foreign\.)?diff\.tar(\.gzip)?)$"
)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def import_oci(store: LayerStore, path: Path | str) -> OciImage:
    """The image in ``path``: an OCI layout directory, or a tar archive (an OCI archive, gzip'ed
    or not, or a ``docker save`` archive). TemplateError for anything else, a hostile or broken
    archive or layer (the message names what), CorruptLayer for a blob not matching its digest."""
    p = Path(path)
    if p.is_dir():
        return _from_layout(store, p, f"OCI layout {p}")
    if not p.is_file():
        raise TemplateError(f"no OCI image at {p} (neither a layout directory nor an archive)")
    kind = _archive_kind(p)
    store._ensure()
    work = store._temp("oci")
    try:
        os.mkdir(work, 0o700)
        if kind == "oci":
            _extract_archive(p, work)
            return _from_layout(store, work, f"OCI archive {p}")
        _skopeo(["copy", f"docker-archive:{p}", f"oci:{work / 'layout'}:import"], f"converting {p}")
        return _from_layout(store, work / "layout", f"docker archive {p}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pull(store: LayerStore, ref: str, *, tls_verify: bool = True, host_credentials: bool = False) -> OciImage:
    """The image ``ref`` (``host[:port]/name[:tag|@digest]``) from its registry, fetched by
    ``skopeo copy docker://REF oci:...`` (the host's platform), then imported. tls_verify=False
    allows a plain-HTTP or self-signed registry. host_credentials: use the registry logins of the
    host (``skopeo login``'s auth file); by default none are sent, so whoever names the image
    (a tenant) gets nothing the host's credentials would open. TemplateError if skopeo fails."""
    if not isinstance(ref, str) or not _REF.match(ref) or ".." in ref:
        raise InvalidArgument(f"not an image reference (host[:port]/name[:tag]): {str(ref)[:200]!r}")
    store._ensure()
    work = store._temp("pull")
    try:
        os.mkdir(work, 0o700)
        argv = ["copy"]
        if not tls_verify:
            argv.append("--src-tls-verify=false")
        if not host_credentials:
            argv.append("--src-no-creds")
        argv += [f"docker://{ref}", f"oci:{work / 'layout'}:pull"]
        try:
            _skopeo(argv, f"pulling {ref}")
        except TemplateError:
            _check_reachable(ref, tls_verify)
            raise
        return _from_layout(store, work / "layout", f"image {ref}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- the layout


def _from_layout(store: LayerStore, root: Path, shown: str) -> OciImage:
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as e:
        raise TemplateError(f"cannot open {shown}: {e.strerror}") from None
    try:
        layout = _json(_read_file(fd, "oci-layout", 4096, shown), f"{shown}: oci-layout")
        version = layout.get("imageLayoutVersion")
        if not isinstance(version, str) or not version.startswith("1."):
            raise TemplateError(f"{shown}: not an OCI image layout (imageLayoutVersion {version!r})")
        index = _json(_read_file(fd, "index.json", MAX_INDEX, shown), f"{shown}: index.json")
        manifest = _manifest(fd, index, shown, 0)
        config_desc = _descriptor(manifest.get("config"), f"{shown}: the manifest's config")
        config = _json(_read_blob(fd, config_desc, MAX_CONFIG, shown), f"{shown}: the image config")
        layers = manifest.get("layers")
        if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
            raise TemplateError(f"{shown}: the manifest's layers are not a list of at most {MAX_LAYERS}")
        infos = tuple(_layer(store, fd, _descriptor(d, f"{shown}: a layer"), shown) for d in layers)
    finally:
        os.close(fd)
    return _image(infos, config, shown)


def _manifest(fd: int, index: dict[str, Any], shown: str, depth: int) -> dict[str, Any]:
    """The image manifest an index leads to: the only one, or the one for this host's platform."""
    entries = index.get("manifests")
    if not isinstance(entries, list) or not entries:
        raise TemplateError(f"{shown}: the index lists no manifests")
    descs = [_descriptor(e, f"{shown}: an index entry") for e in entries[:1000]]
    descs = [d for d in descs if d.get("mediaType") in (*_MANIFEST, *_INDEX)]
    if not descs:
        raise TemplateError(f"{shown}: the index lists no image manifest")
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    mine = [d for d in descs if _platform(d) in (("linux", arch), None)]
    if not mine:
        raise TemplateError(f"{shown}: no manifest for linux/{arch}")
    d = mine[0]
    doc = _json(_read_blob(fd, d, MAX_INDEX, shown), f"{shown}: manifest {d['digest']}")
    if d.get("mediaType") in _INDEX or doc.get("mediaType") in _INDEX:
        if depth >= MAX_DEPTH:
            raise TemplateError(f"{shown}: image indexes nested deeper than {MAX_DEPTH}")
        return _manifest(fd, doc, shown, depth + 1)
    return doc


def _platform(d: dict[str, Any]) -> tuple[str, str] | None:
    p = d.get("platform")
    if not isinstance(p, dict):
        return None
    return (str(p.get("os", "")), str(p.get("architecture", "")))


def _descriptor(d: object, what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise TemplateError(f"{what} is not a descriptor")
    digest, size = d.get("digest"), d.get("size")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise TemplateError(f"{what}: digest {str(digest)[:100]!r} is not sha256:<64 hex>")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TemplateError(f"{what}: size {size!r} is not a byte count")
    return d


def _layer(store: LayerStore, fd: int, d: dict[str, Any], shown: str) -> LayerInfo:
    media = d.get("mediaType")
    if not isinstance(media, str) or not _LAYER.match(media):
        raise TemplateError(f"{shown}: layer {d['digest']} has an unsupported media type {media!r}")
    if d["size"] > store.max_layer_bytes:
        raise TemplateError(f"{shown}: layer {d['digest']} is {d['size']} bytes (at most {store.max_layer_bytes})")
    if media.endswith("+zstd"):
        media_type = "application/vnd.oci.image.layer.v1.tar+zstd"
    elif media.endswith(("+gzip", ".gzip")):
        media_type = "application/vnd.oci.image.layer.v1.tar+gzip"
    else:
        media_type = "application/vnd.oci.image.layer.v1.tar"
    with _open_blob(fd, d["digest"], shown) as f:
        return store.add_stream(f, digest=d["digest"], media_type=media_type, shown=f"{shown}: layer {d['digest']}")


def _image(layers: tuple[LayerInfo, ...], config: dict[str, Any], shown: str) -> OciImage:
    c = config.get("config") or {}
    if not isinstance(c, dict):
        raise TemplateError(f"{shown}: the image config's 'config' is not an object")
    env: list[tuple[str, str]] = []
    for item in _strings(c.get("Env"), f"{shown}: Env"):
        name, eq, value = item.partition("=")
        if eq and name:
            env.append((name, value))
    workdir, user = c.get("WorkingDir") or "", c.get("User") or ""
    if not isinstance(workdir, str) or not isinstance(user, str):
        raise TemplateError(f"{shown}: WorkingDir and User must be strings")
    cmd = _strings(c.get("Entrypoint"), f"{shown}: Entrypoint") + _strings(c.get("Cmd"), f"{shown}: Cmd")
    return OciImage(layers=layers, env=tuple(env), workdir=workdir, user=user, cmd=cmd)


def _strings(v: object, what: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TemplateError(f"{what} is not a list of strings")
    return tuple(v)


# ---- bounded, link-free reads


def _read_file(fd: int, name: str, limit: int, shown: str) -> bytes:
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError as e:
        raise TemplateError(f"{shown}: cannot read {name}: {e.strerror}") from None
    with os.fdopen(f, "rb") as fo:
        _regular(fo.fileno(), name, shown)
        data = fo.read(limit + 1)
    if len(data) > limit:
        raise TemplateError(f"{shown}: {name} is over {limit} bytes")
    return data


def _regular(fd: int, name: str, shown: str) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise TemplateError(f"{shown}: {name} is not a regular file")


@contextlib.contextmanager
def _open_blob(fd: int, digest: str, shown: str) -> Iterator[BinaryIO]:
    """The blob of ``digest`` in the layout ``fd``, opened without following any link."""
    alg, _, hexd = digest.partition(":")
    name = f"blobs/{alg}/{hexd}"
    try:
        blobs = safetar.open_dir("blobs", fd, name, "blobs", create=False)
        try:
            algs = safetar.open_dir(alg, blobs, name, f"blobs/{alg}", create=False)
        finally:
            os.close(blobs)
        try:
            f = os.open(hexd, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=algs)
        finally:
            os.close(algs)
    except (OSError, safetar.UnsafeArchive) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise TemplateError(f"{shown}: blob {digest} cannot be read: {why}") from None
    with os.fdopen(f, "rb") as fo:
        _regular(fo.fileno(), name, shown)
        yield fo


def _read_blob(fd: int, d: dict[str, Any], limit: int, shown: str) -> bytes:
    """A JSON blob, bounded, checked against its descriptor's digest (and size)."""
    if d["size"] > limit:
        raise TemplateError(f"{shown}: blob {d['digest']} is {d['size']} bytes (at most {limit})")
    with _open_blob(fd, d["digest"], shown) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TemplateError(f"{shown}: blob {d['digest']} is over {limit} bytes")
    if "sha256:" + hashlib.sha256(data).hexdigest() != d["digest"]:
        raise CorruptLayer(f"{shown}: blob {d['digest']} does not match its digest", value=d["digest"])
    return data


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        v = json.loads(data)
    except (ValueError, RecursionError):
        raise TemplateError(f"{what} is not valid JSON") from None
    if not isinstance(v, dict):
        raise TemplateError(f"{what} is not a JSON object")
    return v


# ---- archives


def _archive_kind(path: Path) -> str:
    """ "oci" (an oci-layout file at the top) or "docker" (a manifest.json only), from the names of
    the archive's first members; TemplateError for anything else."""
    names: set[str] = set()
    try:
        with _opened(path) as raw, tarfile.open(fileobj=raw, mode="r|", tarinfo=safetar._bounded_info()) as tar:
            for i, m in enumerate(tar):
                tar.members.clear()  # type: ignore[attr-defined]
                names.add(m.name.removeprefix("./"))
                if "oci-layout" in names or i > 100_000:
                    break
    except (tarfile.TarError, EOFError, OSError, safetar.UnsafeArchive) as e:
        raise TemplateError(f"{path} is not a readable image archive: {e}") from None
    if "oci-layout" in names:
        return "oci"
    if "manifest.json" in names:
        return "docker"
    raise TemplateError(f"{path} is neither an OCI archive (oci-layout) nor a docker save archive (manifest.json)")


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[BinaryIO]:
    with open(path, "rb") as f:
        magic = f.read(2)
        f.seek(0)
        if magic == b"\x1f\x8b":
            import gzip

            with gzip.GzipFile(fileobj=f, mode="rb") as g:
                yield g  # type: ignore[misc]
        else:
            yield f


def _extract_archive(path: Path, dest: Path) -> None:
    """An OCI archive's files into ``dest`` (safetar's rules: nothing lands outside, no devices)."""
    fd = os.open(dest, _DIR_FLAGS)
    try:
        with _opened(path) as raw:
            safetar.extract(raw, fd)
    except safetar.UnsafeArchive as e:
        raise TemplateError(f"OCI archive {path} refused: {e}") from None
    except (tarfile.TarError, EOFError) as e:
        raise TemplateError(f"OCI archive {path} is not a readable tar archive: {e}") from None
    finally:
        os.close(fd)


def _check_reachable(ref: str, tls_verify: bool) -> None:
    """ImageRegistryUnreachable if no port skopeo would have used on ``ref``'s registry accepts a
    TCP connection (nothing is sent). Through a proxy (HTTPS_PROXY/HTTP_PROXY) nothing is known."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return
    host = ref.split("/", 1)[0]
    name, _, port = host.partition(":")
    if name == "docker.io":
        name = DOCKER_HUB_HOST
    ports = [int(port)] if port else [443] if tls_verify else [443, 80]
    why = ""
    for p in ports:
        try:
            socket.create_connection((name, p), timeout=PROBE_TIMEOUT_S).close()
            return
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
    where = f"{name}:{ports[-1]}" if len(ports) == 1 else f"{name} (ports {', '.join(map(str, ports))})"
    raise ImageRegistryUnreachable(
        f"cannot reach the image registry {where} to pull {ref}: {why}", registry=f"{name}:{ports[0]}"
    )


def _skopeo(args: list[str], what: str) -> None:
    if shutil.which("skopeo") is None:
        raise TemplateError("skopeo is not installed (scripts/bootstrap install)")
    argv = ["skopeo"]
    if not Path("/etc/containers/policy.json").exists():
        argv.append("--insecure-policy")  # no host policy: digests are still checked here
    argv += args
    try:
        r = subprocess.run(
            argv, capture_output=True, text=True, errors="replace", timeout=SKOPEO_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise TemplateError(f"{what}: skopeo took over {SKOPEO_TIMEOUT_S:.0f} s") from None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip()[-1500:]
        raise TemplateError(f"{what} failed (skopeo exit {r.returncode}): {tail}")


__all__ = ["import_oci", "pull"]
