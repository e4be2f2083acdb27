"""The Python SDK: AsyncSandbox is written once; Sandbox (blocking) is derived from it."""

from warmbox.sdk._sync import synchronize
from warmbox.sdk.sandbox import AsyncCommands, AsyncFiles, AsyncSandbox, CodeContext

Commands = synchronize(AsyncCommands)
Files = synchronize(AsyncFiles)
Sandbox = synchronize(AsyncSandbox)

__all__ = ["AsyncSandbox", "AsyncCommands", "AsyncFiles", "Sandbox", "Commands", "Files", "CodeContext"]
