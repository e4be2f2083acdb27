"""The built-in template table: every built-in is there once, the built ones are valid specs."""

from __future__ import annotations

import re

import pytest

from warmbox import config
from warmbox.engine import resolve
from warmbox.errors import InvalidArgument, TemplateNotFound
from warmbox.templates import check_name, check_template
from warmbox.templates.builtins import (
    BROWSER,
    BUILTINS,
    CHROMIUM,
    IMAGE_BUILTINS,
    PLAYWRIGHT,
    PLAYWRIGHT_REQUIREMENTS,
    builtin,
)
from warmbox.templates.spec import AptInstall, BuiltSource, Run


def test_every_builtin_is_in_the_table_with_a_valid_name():
    assert set(config.BUILTIN_TEMPLATES) == set(IMAGE_BUILTINS) == {"base", "pydata", "shell"}
    assert set(BUILTINS) == {*IMAGE_BUILTINS, "browser"}
    for name, b in BUILTINS.items():
        assert check_name(name) == b.name == name and b.description
        assert builtin(name) is b
    assert builtin("nope") is None
    # the image ones keep the settings' warm-ups: the table does not drift from what sandboxes run
    assert [BUILTINS[n].warmup_code for n in IMAGE_BUILTINS] == [
        config.BUILTIN_TEMPLATES[n]["warmup_code"] for n in IMAGE_BUILTINS
    ]
    assert all(BUILTINS[n].template() is None for n in IMAGE_BUILTINS)


def test_browser_builds_on_base_with_debian_chromium_and_hash_pinned_playwright():
    t = BROWSER.template()
    assert t is not None and check_template(t) is t
    assert t.source == BuiltSource("base")  # no second Debian tree: on top of the built-in image
    apt, pip = t.layer_steps()
    assert isinstance(apt, AptInstall) and "chromium" in apt.packages and "fonts-liberation" in apt.packages
    # every requirement pinned to one version and its wheel's digest; pip checks them all
    assert isinstance(pip, Run) and "--require-hashes" in pip.shell and "--only-binary=:all:" in pip.shell
    pins = [r.split() for r in PLAYWRIGHT_REQUIREMENTS]
    assert pins[0][0] == PLAYWRIGHT and all("==" in p[0] for p in pins)
    assert all(len(p) == 2 and re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", p[1]) for p in pins)
    assert all(r in pip.shell for r in PLAYWRIGHT_REQUIREMENTS)
    assert t.build_network.mode == "allowlist" and set(t.build_network.allow) == {
        "deb.debian.org", "security.debian.org", "pypi.org", "files.pythonhosted.org"
    }  # fmt: skip
    assert t.warmup_code == "" and CHROMIUM in BROWSER.description


def test_an_unbuilt_browser_names_the_command_that_builds_it(tmp_path):
    from warmbox.engine.engine import Engine

    home = tmp_path / "home"
    home.mkdir()
    engine = Engine.for_home(home)
    try:
        with pytest.raises(TemplateNotFound, match="warmbox template build browser") as e:
            resolve.image_for(engine, "browser")
        assert e.value.template == "browser"
        with pytest.raises(InvalidArgument, match="nope"):  # an unknown name stays what it was
            resolve.image_for(engine, "nope")
    finally:
        Engine._instances.pop(home, None)
