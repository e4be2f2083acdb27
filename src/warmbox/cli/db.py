"""``warmbox db migrate|status``: the registry's schema (a cluster's shared PostgreSQL registry is
migrated by this command, once, before its nodes start on a new warmbox; a SQLite file migrates
itself at every open)."""

from __future__ import annotations

import argparse
from typing import Any

from warmbox.cli.context import MODULE_COMMANDS


def add_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("db", help=MODULE_COMMANDS["db"])
    dsub = p.add_subparsers(dest="db_command", required=True, parser_class=parser_class)
    for name, help_ in (
        ("migrate", "bring the registry's schema to this warmbox's (nodes starting at once: one migrates)"),
        ("status", "the registry's schema version and this warmbox's"),
    ):
        q = dsub.add_parser(name, help=help_)
        q.add_argument(
            "--registry",
            help="a postgresql:// URL or a SQLite file (default: [cluster] registry, else the home's registry.db)",
        )


async def command(args: argparse.Namespace) -> int:
    from warmbox.engine.db import SCHEMA_VERSION, location, migrate, schema_version
    from warmbox.paths import default_home

    where, shown = location(default_home(), args.registry)
    if args.db_command == "migrate":
        before, after = migrate(where)
        if before == after:
            print(f"registry {shown}: schema version {after} (up to date)")
        else:
            print(f"registry {shown}: schema version {before or 'none'} -> {after}")
        return 0
    found = schema_version(where)
    if found is None:
        print(f"registry {shown}: empty (no schema yet; this warmbox's is {SCHEMA_VERSION})")
        return 0
    if found == SCHEMA_VERSION:
        state = "up to date"
    else:
        state = "older: run `warmbox db migrate`" if found < SCHEMA_VERSION else "newer: upgrade warmbox"
    print(f"registry {shown}: schema version {found}, this warmbox's {SCHEMA_VERSION} ({state})")
    return 0 if found == SCHEMA_VERSION else 1
