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
# Playwright and its one dependency, pinned by the sha256 of their x86_64 wheels (PyPI's digests):
# pip checks every download against them, so what is installed does not depend on the TLS path to
# PyPI — which is why the hosts may be "trusted" (a TLS-intercepting proxy between the build and
# PyPI, as on hosts behind an egress proxy, then works). Into /usr/local (Debian's place for local
# installs): the system's python3 and a sandbox's own venv (system site packages) import it.
PLAYWRIGHT_REQUIREMENTS = (
    f"{PLAYWRIGHT} --hash=sha256:58932d35f56767ab7ebcdd3d4a733bfb3e62a1a5bc43c08e28b9fa9b3e61cf33",
    "greenlet==3.5.6 --hash=sha256:1c20ea32a73d17b9b60e3371240e17b0068120c98a5ec01a224a7dd8c89733ba",
)
PYPI_HOSTS = ("pypi.org", "files.pythonhosted.org")
PLAYWRIGHT_INSTALL = (
    "set -e\n"
    + "".join(f"echo '{r}' >> /tmp/requirements.txt\n" for r in PLAYWRIGHT_REQUIREMENTS)
    + "PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore python3 -m pip install "
    "--no-input --break-system-packages --only-binary=:all: --require-hashes "
    + " ".join(f"--trusted-host {h}" for h in PYPI_HOSTS)
    + " -r /tmp/requirements.txt\n"
    "playwright --version\n"
)
# the build's egress: the suite's archive (the image's sources.list) and PyPI
BROWSER_BUILD_HOSTS = ("deb.debian.org", "security.debian.org", *PYPI_HOSTS)


@dataclasses.dataclass(frozen=True)
class Builtin:
    """One built-in template.

    warmup_code: Python run in the default code context before a sandbox is handed out (None or
        "": no context is started until the first run_code); warmup_commands: shell commands,
        each must exit 0.
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
    .run(PLAYWRIGHT_INSTALL)
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
