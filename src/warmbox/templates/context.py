"""The build context: a tar of a template's COPY sources, packed on the caller's side (the SDK,
the CLI) and unpacked by the engine with :mod:`warmbox.safetar`. The engine never opens a path the
caller named (a remote caller's paths are not the server's)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

from warmbox import safetar
from warmbox.errors import InvalidArgument
from warmbox.templates import spec as ts

MAX_CONTEXT_BYTES = 11 << 20  # the COPY sources of one build (a request body of at most 16 MiB holds them, base64)
MAX_UNPACKED_BYTES = 1 << 30  # what they may unpack to
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def pack_context(template: ts.Template, max_bytes: int = MAX_CONTEXT_BYTES) -> bytes | None:
    """A tar of every COPY step's sources (``<step index>/<source index>/f/<name>`` for a file,
    ``.../d/...`` for a directory's contents), read on the caller's side relative to
    ``template.context`` (default: the current directory); None if there is no COPY.
    InvalidArgument for a missing source or a context over ``max_bytes``."""
    copies = [(i, s) for i, s in enumerate(template.steps) if isinstance(s, ts.Copy)]
    if not copies:
        return None
    base = template.context or os.getcwd()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i, step in copies:
            for j, src in enumerate(step.sources):
                path = os.path.join(base, src)
                if not os.path.isabs(src) and os.path.relpath(os.path.normpath(path), base).startswith(".."):
                    raise InvalidArgument(f"COPY source {src!r} is outside the build context {base}")
                try:
                    st = os.stat(path)  # the source itself is followed (as Docker does); nothing below it
                except OSError as e:
                    raise InvalidArgument(f"COPY source {src!r}: {e.strerror} ({path})") from None
                prefix = f"{i}/{j}"
                if stat.S_ISDIR(st.st_mode):
                    inner = io.BytesIO()
                    fd = os.open(path, _DIR_FLAGS & ~os.O_NOFOLLOW)
                    try:
                        safetar.pack(fd, inner)
                    finally:
                        os.close(fd)
                    info = tarfile.TarInfo(f"{prefix}/d")
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    tar.addfile(info)
                    inner.seek(0)
                    with tarfile.open(fileobj=inner, mode="r") as sub:
                        for m in sub:
                            m.name = f"{prefix}/d/{m.name}"
                            if m.islnk():
                                m.linkname = f"{prefix}/d/{m.linkname}"
                            tar.addfile(m, sub.extractfile(m) if m.isreg() else None)
                elif stat.S_ISREG(st.st_mode):
                    tar.add(path, f"{prefix}/f/{os.path.basename(os.path.normpath(src))}", recursive=False)
                else:
                    raise InvalidArgument(f"COPY source {src!r} is not a file or directory")
                if buf.tell() > max_bytes:
                    raise InvalidArgument(f"the build context (COPY sources) is larger than {max_bytes >> 20} MiB")
    return buf.getvalue()


def unpack_context(data: bytes, into: Path) -> None:
    into.mkdir(mode=0o700)
    fd = os.open(into, _DIR_FLAGS)
    try:
        # absolute symlinks stay as they are (they point into the image, as Docker copies them);
        # nothing here ever resolves one
        safetar.extract(io.BytesIO(data), fd, layer=safetar.LayerRules(0, max_bytes=MAX_UNPACKED_BYTES))
    except (safetar.UnsafeArchive, tarfile.TarError) as e:
        raise InvalidArgument(f"the build context is not a safe tar archive: {e}") from None
    finally:
        os.close(fd)
