"""The Python SDK: AsyncSandbox is written once over a Transport; Sandbox (blocking) is derived from it."""

from __future__ import annotations

from pathlib import Path

from warmbox.models import Requirements, TierChoice
from warmbox.sdk._sync import synchronize
from warmbox.sdk.code import CodeContext
from warmbox.sdk.commands import AsyncCommandHandle, AsyncCommands, CommandHandle
from warmbox.sdk.files import AsyncFiles, AsyncFileStream, AsyncWatchHandle, FileStream, WatchHandle
from warmbox.sdk.network import AsyncNetwork
from warmbox.sdk.pty import AsyncPty, AsyncPtyHandle, Pty, PtyHandle
from warmbox.sdk.sandbox import AsyncSandbox
from warmbox.sdk.templates import AsyncTemplates
from warmbox.sdk.transport import LocalTransport, Transport

Commands = synchronize(AsyncCommands)
Files = synchronize(AsyncFiles)
NetworkAPI = synchronize(AsyncNetwork, "NetworkAPI")
Sandbox = synchronize(AsyncSandbox)
Templates = synchronize(AsyncTemplates)


def choose_tier(
    requirements: Requirements | None = None,
    *,
    home: str | Path | None = None,
    transport: Transport | None = None,
    api_url: str | None = None,
    api_key: str | None = None,
) -> TierChoice:
    """The tier for code of ``requirements`` on this host, why, and why not each other tier
    (blocking; ``AsyncSandbox.choose_tier`` is the async form, documented there)."""
    return Sandbox.choose_tier(  # type: ignore[attr-defined, no-any-return]
        requirements, home=home, transport=transport, api_url=api_url, api_key=api_key
    )


__all__ = [
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFileStream",
    "AsyncFiles",
    "AsyncWatchHandle",
    "AsyncNetwork",
    "AsyncPty",
    "AsyncPtyHandle",
    "AsyncSandbox",
    "AsyncTemplates",
    "CodeContext",
    "CommandHandle",
    "Commands",
    "FileStream",
    "Files",
    "LocalTransport",
    "NetworkAPI",
    "Pty",
    "PtyHandle",
    "Sandbox",
    "Templates",
    "Transport",
    "WatchHandle",
    "choose_tier",
]
