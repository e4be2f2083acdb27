"""MkDocs hooks: reference pages generated at build time from the code itself: the CLI's from the
``warmbox`` argparse parser, the MCP tools' from the MCP server's own tool list (names, arguments,
their JSON schemas and descriptions), warmbox.toml's from ``warmbox/config.py`` (each section's keys as
its parser accepts them, with the settings field's default and comment)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import inspect
import io
import json
import os
import re
import textwrap
import tokenize
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

CLI_PAGE = "reference/cli.md"
MCP_PAGE = "reference/mcp.md"
CONFIG_PAGE = "reference/config.md"
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


def _cell(text: str) -> str:
    """Table cell text: plain (no HTML), one line, a pipe as its entity (no cell break)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "&#124;").replace("\n", " ")


def _schema_type(s: dict[str, Any]) -> str:
    """A JSON schema as a short type: ``string | null``, ``"none" | "internet"``, ``list[string]``, ``number > 0``."""
    if "anyOf" in s:
        return " | ".join(_schema_type(x) for x in s["anyOf"])
    if "enum" in s:
        return " | ".join(json.dumps(v) for v in s["enum"])
    if s.get("type") == "array":
        return f"list[{_schema_type(s.get('items', {}))}]"
    out = str(s.get("type", "any"))
    for key, op in (("exclusiveMinimum", ">"), ("minimum", ">="), ("exclusiveMaximum", "<"), ("maximum", "<=")):
        if key in s:
            out += f" {op} {s[key]}"
    if "minLength" in s:
        out += f" (at least {s['minLength']} characters)"
    return out


def mcp_reference() -> str:
    """The page: the server's instructions, then each tool with a table of its arguments."""
    from warmbox.server import mcp

    server = mcp.build_mcp(lambda ctx: None)  # the transport is asked for only when a tool runs
    tools = asyncio.run(server.list_tools())
    lines = [
        "# MCP tools",
        "",
        "`warmbox mcp` serves these tools on stdin/stdout and `warmbox serve` at `/mcp` (streamable HTTP, "
        "the same API keys). Generated from the MCP server's own tool list when the site is built: each "
        "tool's arguments are its JSON schema's. An error is a tool error whose text starts with the warmbox "
        "error code (`sandbox_not_found: ...`).",
        "",
        "The instructions the server gives a client:",
        "",
        f"> {mcp.INSTRUCTIONS}",
        "",
    ]
    for tool in tools:
        schema = tool.input_schema
        required = set(schema.get("required", ()))
        lines += [f"## `{tool.name}`", "", inspect.cleandoc(tool.description or ""), ""]
        hints = tool.annotations
        if hints is not None:
            flags = [n for n in ("read_only_hint", "destructive_hint", "idempotent_hint") if getattr(hints, n, None)]
            if flags:
                lines += ["Hints: " + ", ".join(f"`{f}`" for f in flags) + ".", ""]
        props = schema.get("properties", {})
        if not props:
            lines += ["No arguments.", ""]
            continue
        lines += ["| Argument | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for name, s in props.items():
            default = "required" if name in required else f"`{json.dumps(s.get('default'))}`"
            # (a pipe inside a code span breaks no cell: the type stays as it is)
            row = [f"`{name}`", f"`{_schema_type(s)}`", default, _cell(s.get("description", ""))]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


# warmbox.toml's sections: the settings class each one fills, and how a key names its field there
# (a key of seconds is the field's name less "_s": timeout -> timeout_s)
SECTIONS = {
    "defaults": "Defaults",
    "templates.NAME": "Template",
    "pools.NAME": "PoolConfig",
    "limits": "LimitSettings",
    "server": "ServerSettings",
    "network": "NetworkSettings",
    "approvals": "ApprovalSettings",
    "cluster": "ClusterSettings",
    "microvm": "MicroVMSettings",
    "cost": "CostSettings",
    "daemon": "Settings",
    "lifecycle": "Settings",
}
FIELD_OF = {("daemon", "idle_exit"): "daemon_idle_exit_s", ("lifecycle", "paused_retention"): "paused_retention_s"}


def _allowed_keys(tree: ast.Module, config: Any) -> dict[str, list[str]]:
    """Each section's keys, read from the ``_only(table, {keys}, section, source)`` calls of config.py:
    the check that refuses any other key, so the page lists exactly what the parser takes."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_only"):
            continue
        keys_node, where = node.args[1], node.args[2]
        if isinstance(keys_node, ast.Set) and all(isinstance(e, ast.Constant) for e in keys_node.elts):
            keys = [e.value for e in keys_node.elts if isinstance(e, ast.Constant)]
        elif isinstance(keys_node, ast.Set):  # {"warmup_code", ..., *template_toml.BUILD_KEYS}
            keys = [e.value for e in keys_node.elts if isinstance(e, ast.Constant)]
            keys += sorted(config.template_toml.BUILD_KEYS)
        elif isinstance(keys_node, ast.Call) and ast.unparse(keys_node) == "set(LIMIT_KEYS)":
            keys = list(config.LIMIT_KEYS)
        elif isinstance(where, ast.Constant) and where.value == "cluster":
            keys = [f.name for f in dataclasses.fields(config.ClusterSettings)]
        else:
            continue  # a pool's limits table: the fields of Limits (the Python API's reference)
        if isinstance(where, ast.Constant):
            section = str(where.value)
        elif "warmup_code" in keys:
            section = "templates.NAME"
        elif "refill_concurrency" in keys:
            section = "pools.NAME"
        else:
            continue
        out[section] = keys
    return out


def _field_comments(source: str, tree: ast.Module) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment on the field's line, or the comment lines right above it."""
    comments: dict[int, str] = {}  # line -> its comment
    alone: set[int] = set()  # lines that are only a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if tok.line.strip().startswith("#"):
                alone.add(tok.start[0])
    out = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                line = item.lineno
                text = comments.get(line, "")
                if not text:
                    above = []
                    n = line - 1
                    while n in alone:
                        above.insert(0, comments[n])
                        n -= 1
                    text = " ".join(above)
                out[(cls.name, item.target.id)] = text.replace("type: ignore[assignment]", "").strip(" #")
    return out


def _module_doc(doc: str) -> str:
    """A module docstring as Markdown: its ``::`` literal block a TOML code block, Sphinx roles plain code."""
    text = inspect.cleandoc(doc)
    head, sep, rest = text.partition("::\n\n")
    if sep:
        lines = rest.split("\n")
        n = next((i for i, line in enumerate(lines) if line and not line.startswith(" ")), len(lines))
        block, tail = "\n".join(lines[:n]).rstrip(), "\n".join(lines[n:])
        text = f"{head}:\n\n```toml\n{textwrap.dedent(block)}\n```\n\n{tail}"
    return re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", text)


def config_reference() -> str:
    """The page: config.py's module docstring (one file, an example), then each section's keys."""
    from warmbox import config

    path = Path(inspect.getfile(config))
    source = path.read_text()
    tree = ast.parse(source)
    allowed = _allowed_keys(tree, config)
    comments = _field_comments(source, tree)
    lines = [
        "# Configuration: warmbox.toml",
        "",
        "Generated from `warmbox/config.py` when the site is built: its description, then every key each "
        "section accepts (any other key is a `ConfigError` naming it), with the default and the meaning "
        "written beside the setting in the code. `warmbox config` prints the effective settings and where "
        "each came from.",
        "",
        _module_doc(config.__doc__ or ""),
        "",
    ]
    for section, cls_name in SECTIONS.items():
        keys = allowed.get(section)
        if not keys:
            continue
        cls = getattr(config, cls_name)
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        lines += [f"## `[{section}]`", ""]
        doc = inspect.getdoc(cls) or ""
        if doc and cls_name != "Settings" and not doc.startswith(f"{cls_name}("):  # (a dataclass's own)
            lines += [doc.split("\n\n")[0], ""]
        if section == "templates.NAME":
            lines += [
                "The keys after `description` are the template's build spec: see [Templates](../guides/templates.md).",
                "",
            ]
        if section == "limits":
            lines += [
                "Each default is this host's (the example above says how); `warmbox config` shows the values.",
                "",
            ]
        lines += ["| Key | Default | Meaning |", "| --- | --- | --- |"]
        for key in keys:
            field = FIELD_OF.get((section, key)) or next(
                (f for f in (key, f"{key}_s") if (cls_name, f) in comments), key
            )
            default = defaults.get(field)
            shown = f"`{json.dumps(default)}`" if isinstance(default, (str, int, float, bool)) else ""
            lines.append(f"| `{key}` | {shown} | {_cell(comments.get((cls_name, field), ''))} |")
        lines.append("")
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, CONFIG_PAGE, content=config_reference()))
    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    files.append(File.generated(config, MCP_PAGE, content=mcp_reference()))
    return files


SPHINX_ROLE = re.compile(r":(?:py:)?(?:meth|class|func|attr|exc|mod|data|obj|const):<code>~?")


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """Docstrings name things with Sphinx roles (:meth:`create`): the rendered page keeps the name, as code."""
    return SPHINX_ROLE.sub("<code>", html)
