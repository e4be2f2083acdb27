"""The Python SDK: AsyncSandbox is written once over a Transport; Sandbox (blocking) is derived from it."""

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
]
