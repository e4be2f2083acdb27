"""The guest's spawn helper loads on a template image's glibc, not only on the host's."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from warmbox.backends._host import build_spawn_helpers


def test_spawn_so_asks_for_no_glibc_newer_than_2_2_5(tmp_path):
    if not shutil.which("gcc") or not shutil.which("objdump"):
        pytest.fail("gcc and binutils must be here (scripts/bootstrap installs them)")
    build_spawn_helpers(Path(__file__).resolve().parents[2] / "src/warmbox/guest", tmp_path)
    symbols = subprocess.run(["objdump", "-T", str(tmp_path / "spawn.so")], capture_output=True, text=True).stdout
    versions = set(re.findall(r"\(GLIBC_([0-9.]+)\)", symbols))
    assert versions == {"2.2.5"}, symbols  # an image with an older glibc than the host's loads it
    assert (
        "statically linked"
        in subprocess.run(["file", str(tmp_path / "wb-init")], capture_output=True, text=True).stdout
    )
