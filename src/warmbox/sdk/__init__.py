"""The Python SDK: AsyncSandbox is written once; Sandbox (blocking) is derived from it."""

from warmbox.sdk._sync import synchronize
from warmbox.sdk.sandbox import AsyncCommands, AsyncFiles, AsyncNetwork, AsyncSandbox, CodeContext

Commands = synchronize(AsyncCommands)
Files = synchronize(AsyncFiles)
NetworkAPI = synchronize(AsyncNetwork, "NetworkAPI")
Sandbox = synchronize(AsyncSandbox)

__all__ = ["AsyncSandbox", "AsyncCommands", "AsyncFiles", "AsyncNetwork", "NetworkAPI", "Sandbox", "Commands", "Files", "CodeContext"]
