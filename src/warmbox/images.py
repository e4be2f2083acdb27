"""The built-in image: one Debian tree, the same packages on every tier (templates base, pydata, shell).

Built with ``mmdebstrap`` from Debian's archive (``scripts/bootstrap install`` builds it once per
:func:`builtin_key`), stored as a layer in the host's layer store; the container and gVisor
tiers run it as an overlay root, the microVM tier as an ext4 made from the same layer. The
templates differ only in their warm-up (config.BUILTIN_TEMPLATES); ``pydata``'s SciPy is in the
same tree, so one image serves all three.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

# What agents run in a sandbox: Python with pip, venv, pytest, build, NumPy, pandas, SciPy,
# matplotlib (+ fonts: charts of the code interpreter) and requests; Node.js with npm and npx; gcc,
# make, git, curl, jq, ripgrep, tmux and the shell tools. pip and npm install from the network the
# sandbox's policy allows.
BUILTIN_PACKAGES = (
    "python3-minimal",
    "libpython3-stdlib",
    "bash",
    "coreutils",
    "tar",
    "procps",
    "util-linux",
    "ca-certificates",
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    "python3-pip",
    "python3-venv",
    "nodejs",
    "npm",
    "curl",
    "tmux",
    "gcc",
    "libc6-dev",
    "git",
    "findutils",
    "grep",
    "sed",
    "gzip",
    "xz-utils",
    # issue 17: base gets make and pytest, pydata SciPy, the code interpreter its fonts
    "make",
    "python3-pytest",
    "python3-scipy",
    "python3-requests",
    "fonts-dejavu-core",
    # issue 34: a coding agent's turn also runs `python -m build` (wheel: --no-isolation works
    # offline), jq, rg, unzip and patch (about 7 MB installed, ripgrep 4.5 of it)
    "python3-build",
    "python3-wheel",
    "jq",
    "ripgrep",
    "unzip",
    "patch",
)
# documentation, translations and leap-second zones: nothing a sandbox reads (~100 MB less)
BUILTIN_EXCLUDES = (
    "/usr/share/man/*",
    "/usr/share/doc/*",
    "/usr/share/locale/*",
    "/usr/share/info/*",
    "/usr/share/lintian/*",
    "/usr/share/zoneinfo/right/*",
)
# the built-in templates (config.BUILTIN_TEMPLATES) that run the built-in image
BUILTIN_TEMPLATES = ("base", "pydata", "shell")
BUILTIN_VERSION = 0  # what sandboxes of a built-in template record as their template version
BUILD_VERSION = "builtin-image-v1"  # bump when the tree's making changes beyond its package list


def suite() -> str:
    """The Debian release of the host (its apt mirror serves it): the image's suite."""
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return "bookworm"
    m = re.search(r"^VERSION_CODENAME=(\w+)", text, re.M)
    return m.group(1) if m else "bookworm"


def debian_key() -> str:
    """The name of the plain mmdebstrap tree of the built-in packages (before warmbox's files)."""
    return "debian-" + hashlib.sha256(repr((suite(), BUILTIN_PACKAGES, BUILTIN_EXCLUDES)).encode()).hexdigest()[:16]


def builtin_key() -> str:
    """What the built-in image is built from (suite, packages, excludes, build version): the
    image is rebuilt when this changes, and only then."""
    raw = repr((BUILD_VERSION, suite(), BUILTIN_PACKAGES, BUILTIN_EXCLUDES))
    return "builtin-" + hashlib.sha256(raw.encode()).hexdigest()[:16]
