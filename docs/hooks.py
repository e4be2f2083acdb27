"""MkDocs hooks: the CLI reference page, generated at build time from the ``warmbox`` argparse parser."""

from __future__ import annotations

import argparse
import os
from typing import Any

from mkdocs.structure.files import File, Files

CLI_PAGE = "reference/cli.md"
WIDTH = "80"  # argparse wraps help text to $COLUMNS: fixed, so every build writes the same page


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of a parser's subcommands, in the order they were added."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias (ls and ps) shares its parser
                    continue
                seen.add(id(sub))
                out.append((name, sub, helps.get(name, "")))
    return out


def _render(prog: str, parser: argparse.ArgumentParser, summary: str, level: int, lines: list[str]) -> None:
    lines += [f"{'#' * level} `{prog}`", ""]
    if summary:
        lines += [summary.replace("<", "&lt;"), ""]
    lines += ["```text", parser.format_help().rstrip(), "```", ""]
    for name, sub, help_ in _subparsers(parser):
        _render(f"{prog} {name}", sub, help_, min(level + 1, 4), lines)


def cli_reference() -> str:
    """The page: the top parser's help, then each subcommand's (nested ones under their parent)."""
    from warmbox.cli import main

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = main._parser()
        lines = [
            "# CLI reference",
            "",
            "Generated from the `warmbox` command's argparse parser when the site is built "
            "(`warmbox COMMAND --help` prints the same). Every error is one line on stderr and exit status 125.",
            "",
        ]
        lines += ["## `warmbox`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub, help_ in _subparsers(parser):
            _render(f"warmbox {name}", sub, help_, 3, lines)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    return files
