"""A template's build spec as a ``[templates.NAME]`` table of ``warmbox.toml``.

One source, then the steps in a fixed order (installs, then files, then commands, then config)::

    [templates.mytools]
    from = "base"                      # or: dockerfile = "tools/Dockerfile" (relative to the file),
                                       #     debian = "bookworm", oci = "img.tar",
                                       #     registry = "127.0.0.1:5000/tools:1"
    apt = ["cowsay"]                   # apt_install
    pip = ["requests"]                 # pip_install (into /opt/venv, on PATH)
    pip_find_links = "/opt/wheels"     # optional: --find-links (a path in the image, or a URL)
    pip_index_url = ""                 # optional: --index-url
    npm = ["left-pad"]                 # npm_install, global
    copy = [["app/", "/opt/app/"]]     # [local, remote] pairs (local: relative to the file)
    run = ["make -C /opt/app"]         # shell commands, one step each
    env = { APP_MODE = "prod" }
    workdir = "/opt/app"
    user = "user"
    network = ["deb.debian.org"]       # the build's egress: "none" (default), "internet", hosts
    warmup_code = "import requests"    # as for any template
    warmup_commands = []

A ``dockerfile`` source takes no other build keys (the Dockerfile says it all).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from warmbox.errors import InvalidArgument
from warmbox.templates.spec import NO_BUILD_SECRETS, Template

SOURCE_KEYS = ("from", "dockerfile", "debian", "oci", "registry")
STEP_KEYS = (
    "apt",
    "pip",
    "pip_find_links",
    "pip_index_url",
    "npm",
    "copy",
    "run",
    "env",
    "workdir",
    "user",
    "network",
)
BUILD_KEYS = frozenset(SOURCE_KEYS + STEP_KEYS)


def _strings(value: object, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{key} must be a list of strings")
    return value


def _str(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{key} must be a string")
    return value


def spec_from_table(table: Mapping[str, Any], base_dir: str) -> Template | None:
    """The Template a table's build keys describe (None if it has none); InvalidArgument naming the
    key otherwise. Relative paths are relative to ``base_dir`` (the file's directory)."""
    given = [k for k in SOURCE_KEYS if k in table]
    if not given:
        extra = sorted(set(table) & set(STEP_KEYS))
        if extra:
            raise InvalidArgument(f"{extra[0]} needs a source: from, dockerfile, debian, oci or registry")
        return None
    if len(given) > 1:
        raise InvalidArgument(f"give one source, not {' and '.join(given)}")
    if "secrets" in table:  # refused, never ignored
        raise InvalidArgument(NO_BUILD_SECRETS)
    key = given[0]
    value = _str(table[key], key)
    if key == "dockerfile":
        extra = sorted(set(table) & set(STEP_KEYS))
        if extra:
            raise InvalidArgument(f"{extra[0]}: a dockerfile template takes its steps from the Dockerfile")
        return Template.from_dockerfile(os.path.join(base_dir, value))
    if key == "from":
        t = Template.from_template(value)
    elif key == "debian":
        t = Template.debian(value)
    elif key == "oci":
        t = Template.from_oci(os.path.join(base_dir, value))
    else:
        t = Template.from_registry(value)
    if "apt" in table:
        t = t.apt_install(_strings(table["apt"], "apt"))
    if "pip" in table:
        links = _str(table.get("pip_find_links", ""), "pip_find_links")
        t = t.pip_install(
            _strings(table["pip"], "pip"),
            index_url=_str(table.get("pip_index_url", ""), "pip_index_url") or None,
            find_links=links or None,
        )
    elif "pip_find_links" in table or "pip_index_url" in table:
        raise InvalidArgument("pip_find_links / pip_index_url go with pip")
    if "npm" in table:
        t = t.npm_install(_strings(table["npm"], "npm"))
    for pair in table.get("copy", []):
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise InvalidArgument("copy must be a list of [local, remote] pairs")
        t = t.copy(pair[0], pair[1])
    for cmd in _strings(table.get("run", []), "run"):
        t = t.run(cmd)
    if "env" in table:
        env = table["env"]
        if not isinstance(env, Mapping):
            raise InvalidArgument("env must be a table of names to strings")
        t = t.env(env)
    if "workdir" in table:
        t = t.workdir(_str(table["workdir"], "workdir"))
    if "user" in table:
        t = t.user(_str(table["user"], "user"))
    if "network" in table:
        net = table["network"]
        t = t.network(net if isinstance(net, str) else _strings(net, "network"))
    return t.with_context(base_dir)
