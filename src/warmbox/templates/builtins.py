"""The built-in templates, in one table: what each runs, how it is built, what it warms up.

``base``, ``pydata`` and ``shell`` run the built-in image (:mod:`warmbox.images`: one Debian tree,
the same packages on every tier) and differ only in their warm-up. The others are specs on top
of ``base``, built on a host with ``warmbox template build NAME`` (their steps install from
Debian's archive and PyPI, so ``scripts/bootstrap install`` builds them; a sandbox of one that is
not built yet is refused with TemplateNotFound naming that command).
"""

from __future__ import annotations

import dataclasses

from warmbox import config
from warmbox.templates.spec import Template

# the browser template: Debian's chromium (security updates through the suite's archive) driven by
# Playwright from PyPI. The wheel bundles Playwright's driver (its own node); the browsers it would
# download are never used: launch with executable_path=CHROMIUM.
CHROMIUM = "/usr/bin/chromium"
BROWSER_PACKAGES = ("chromium", "fonts-liberation")
PLAYWRIGHT = "playwright==1.65.2"
# the build's egress: the suite's archive (the image's sources.list) and PyPI
BROWSER_BUILD_HOSTS = ("deb.debian.org", "security.debian.org", "pypi.org", "files.pythonhosted.org")


@dataclasses.dataclass(frozen=True)
class Builtin:
    """One built-in template.

    warmup_code: Python run in the default code context before a sandbox is handed out (None: no
        context is started); warmup_commands: shell commands, each must exit 0.
    spec: how it is built; None for the templates that run the built-in image itself.
    """

    name: str
    description: str
    warmup_code: str | None = ""
    warmup_commands: tuple[str, ...] = ()
    spec: Template | None = None

    def template(self) -> Template | None:
        """The spec to build, with this template's warm-up; None for the built-in image's ones."""
        if self.spec is None:
            return None
        return self.spec.warmup(self.warmup_code, self.warmup_commands)


BROWSER = Builtin(
    "browser",
    f"base + Debian's chromium ({CHROMIUM}) and Playwright for Python; launch(executable_path={CHROMIUM!r})",
    spec=Template.from_template("base")
    .apt_install(list(BROWSER_PACKAGES))
    .pip_install([PLAYWRIGHT])
    .network(list(BROWSER_BUILD_HOSTS)),
)
# the templates of the built-in image (their warm-ups: config.BUILTIN_TEMPLATES, which the settings
# start from), then the ones built on top of it
BUILTINS: dict[str, Builtin] = {
    **{n: Builtin(n, str(t["description"]), warmup_code=t["warmup_code"]) for n, t in config.BUILTIN_TEMPLATES.items()},
    BROWSER.name: BROWSER,
}
# the ones that run the built-in image (no build of their own)
IMAGE_BUILTINS = tuple(n for n, b in BUILTINS.items() if b.spec is None)


def builtin(name: str) -> Builtin | None:
    """The built-in template called ``name``, or None."""
    return BUILTINS.get(name)
