"""A real PostgreSQL server for tests: Debian's binaries, run as the ``postgres`` user (initdb
refuses root) on a unix socket in a temp dir of its own, never listening on TCP.

    pg = PgServer()            # initdb + start: ~1 s
    pg.dsn                     # postgresql://warmbox@/postgres?host=<dir>
    pg.create_database()       # the DSN of a new empty database (~0.1 s)
    pg.stop()                  # pg_ctl stop -m fast, then the dir is removed

Durability is off (fsync, synchronous_commit, full_page_writes): a test server never outlives
its test session, so nothing is gained by flushing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

PG_ROOT = Path("/usr/lib/postgresql")
USER = "warmbox"  # the database superuser initdb makes (connections are trusted on the socket)


def pg_bin() -> Path:
    """The bin dir of the newest PostgreSQL installed (Debian's /usr/lib/postgresql/<ver>/bin)."""
    versions = sorted(
        (p for p in PG_ROOT.glob("*/bin") if (p / "initdb").exists() and p.parent.name.isdigit()),
        key=lambda p: int(p.parent.name),
    )
    if not versions:
        raise RuntimeError(f"no PostgreSQL under {PG_ROOT} (scripts/bootstrap installs it)")
    return versions[-1]


class PgServer:
    """One PostgreSQL server in its own temp dir (``/tmp/wbpg-<hex>``: the socket path stays short)."""

    def __init__(self, *, timeout_s: float = 30.0) -> None:
        self.bin = pg_bin()
        pw = pwd.getpwnam("postgres")
        self._as = [
            "setpriv",
            f"--reuid={pw.pw_uid}",
            f"--regid={pw.pw_gid}",
            "--clear-groups",
            "--reset-env",
        ]
        self.dir = Path(f"/tmp/wbpg-{secrets.token_hex(4)}")
        self.dir.mkdir(mode=0o755)
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.data = self.dir / "data"
        self.log = self.dir / "pg.log"
        self.pid: int | None = None
        try:
            self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-locale",
                      "--no-sync", "--no-instructions", timeout=timeout_s)  # fmt: skip
            opts = (
                f"-c listen_addresses='' -c unix_socket_directories={self.dir} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c shared_buffers=16MB -c max_connections=200"
            )
            self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(int(timeout_s)),
                      "-o", opts, "start", timeout=timeout_s + 5)  # fmt: skip
            self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except BaseException:
            self.stop()
            raise

    @property
    def dsn(self) -> str:
        """The server's own ``postgres`` database."""
        return self.dsn_of("postgres")

    def dsn_of(self, database: str) -> str:
        return f"postgresql://{USER}@/{database}?host={self.dir}"

    def _run(self, tool: str, *args: str, timeout: float) -> None:
        r = subprocess.run(
            [*self._as, str(self.bin / tool), *args],
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if r.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed ({r.returncode}): {r.stderr.strip()[-2000:]}\n{log}")

    def create_database(self, name: str | None = None) -> str:
        """A new empty database (from template0, by file copy: ~0.1 s); its DSN."""
        import psycopg

        name = name or f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.dsn, autocommit=True) as db:
            db.execute(f'CREATE DATABASE "{name}" TEMPLATE template0 STRATEGY FILE_COPY')
        return self.dsn_of(name)

    def drop_database(self, dsn: str) -> None:
        """Drop a database made by create_database (its connections are ended first)."""
        import psycopg

        name = dsn.rsplit("/", 1)[1].split("?", 1)[0]
        with psycopg.connect(self.dsn, autocommit=True) as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        """Stop the server (fast: open connections are ended) and remove its dir."""
        if self.data.joinpath("postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop", timeout=35)
            except (RuntimeError, subprocess.TimeoutExpired):
                if self.pid is not None:  # the postmaster by its PID (its children follow it)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGQUIT)
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline and _alive(self.pid):
                        time.sleep(0.05)
        self.pid = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


__all__ = ["PgServer", "pg_bin"]
