"""The sandbox user's install locations, made by the agent at boot: a venv and an npm prefix.

The image is read-only and Debian marks its Python externally managed, so ``pip install`` needs
a place of the sandbox's own: ``/home/user/.venv``, a venv over the system's packages (NumPy,
pandas, matplotlib stay importable) made by hand in well under a millisecond (``python3 -m venv``
costs ~100 ms). Debian's pip installs into it unchanged (pip refuses only outside a venv).
``npm install -g`` goes to ``/home/user/.npm-global``. Both are first on PATH, for commands and
code contexts alike.

Until the host links the sandbox to the egress proxy (a policy other than "none"), the proxy
variables name a host that cannot resolve and says why, and pip and npm do not retry: a download
fails at once, e.g. ``Could not resolve proxy: no-network.sandbox-policy-is-none.invalid``,
instead of npm's minute of retries. Linking sets the real proxy (and the retry defaults) over these.
"""

from __future__ import annotations

import os
import sys

VENV = "/home/user/.venv"
NPM_PREFIX = "/home/user/.npm-global"
OFFLINE_PROXY = "http://no-network.sandbox-policy-is-none.invalid:9"
# what the host's egress link overrides (engine/egress.py proxy_env), all of it
OFFLINE_ENV = {
    **dict.fromkeys(
        ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "npm_config_proxy", "npm_config_https_proxy"),
        OFFLINE_PROXY,
    ),
    # the sandbox's own servers stay reachable (as under a policy: engine/egress.py proxy_env)
    "NO_PROXY": "localhost,127.0.0.1,::1",
    "no_proxy": "localhost,127.0.0.1,::1",
    "PIP_RETRIES": "0",
    "npm_config_fetch_retries": "0",
}
NOTE = "warmbox: no network: this sandbox's network policy is none (only local files can be installed)\n"

# the venv's pip: Debian's pip module run by the venv's interpreter (so it installs there)
_PIP = """#!{venv}/bin/python3
import os
import sys

from pip._internal.cli.main import main

if __name__ == "__main__":
    rc = main()
    if rc and os.environ.get("https_proxy") == {offline!r}:
        sys.stderr.write({note!r})
    sys.exit(rc)
"""
_ACTIVATE = """# the sandbox's venv is active in every command already; this is for habit's sake
VIRTUAL_ENV={venv}
export VIRTUAL_ENV
case ":$PATH:" in *":$VIRTUAL_ENV/bin:"*) ;; *) PATH="$VIRTUAL_ENV/bin:$PATH"; export PATH ;; esac
deactivate () {{ :; }}
"""


def make_venv(venv: str = VENV, python: str = sys.executable) -> None:
    """What ``python3 -m venv --system-site-packages --without-pip`` makes, plus pip scripts."""
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    os.makedirs(f"{venv}/bin", 0o755)
    os.makedirs(f"{venv}/lib/{ver}/site-packages", 0o755)
    os.makedirs(f"{venv}/include", 0o755)
    os.symlink("lib", f"{venv}/lib64")
    v = sys.version_info
    files = {
        "pyvenv.cfg": f"home = {os.path.dirname(python)}\ninclude-system-site-packages = true\n"
        f"version = {v[0]}.{v[1]}.{v[2]}\nexecutable = {os.path.realpath(python)}\n",
        "bin/activate": _ACTIVATE.format(venv=venv),
    }
    pip = _PIP.format(venv=venv, offline=OFFLINE_PROXY, note=NOTE)
    for name in ("pip", "pip3", f"pip{v[0]}.{v[1]}"):
        files[f"bin/{name}"] = pip
    for rel, text in files.items():
        fd = os.open(f"{venv}/{rel}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, text.encode())
            if rel.startswith("bin/pip"):
                os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
    os.symlink(python, f"{venv}/bin/python3")
    os.symlink("python3", f"{venv}/bin/python")
    os.symlink("python3", f"{venv}/bin/{ver}")


def setup(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """Make the venv (unless there: a restored sandbox keeps its own) and put it, and the npm
    prefix, first on ``environ``'s PATH; add the offline defaults the environment does not set.
    A home that is not writable (or not there) leaves everything as it was."""
    if environ.get("HOME") != "/home/user":
        return
    try:
        if not os.path.isdir(VENV):
            make_venv(VENV)
    except OSError:
        return
    environ.setdefault("VIRTUAL_ENV", VENV)
    environ.setdefault("npm_config_prefix", NPM_PREFIX)
    path = environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    if f"{VENV}/bin" not in path.split(":"):
        environ["PATH"] = f"{VENV}/bin:{NPM_PREFIX}/bin:{path}"
    for k, v in OFFLINE_ENV.items():
        environ.setdefault(k, v)


def python(env: dict[str, str]) -> str:
    """The interpreter a code context runs: the venv's when ``env`` has one, else the agent's."""
    venv = env.get("VIRTUAL_ENV")
    if venv and os.path.isfile(f"{venv}/bin/python3"):
        return f"{venv}/bin/python3"
    return sys.executable
