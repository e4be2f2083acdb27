"""warmbox: self-hosted sandboxes for running untrusted, model-generated code."""

from warmbox.errors import (
                            ArtifactCorrupt,
                            BackendUnavailable,
                            CommandFailed,
                            ConfigError,
                            ContextError,
                            FilesError,
                            GuestConnectionError,
                            GuestProtocolError,
                            InvalidArgument,
                            InvalidPath,
                            IsADirectory,
                            NetworkError,
                            NoSpace,
                            NotADirectory,
                            PathExists,
                            PathNotFound,
                            PathPermissionDenied,
                            RegistryError,
                            SandboxError,
                            SandboxNotFound,
                            SandboxStartError,
                            SandboxStateError,
                            SandboxTimeout,
                            SnapshotUnsupported,
                            StorageError,
                            StorageFull,
                            WarmboxError,
)
from warmbox.models import (
                            ApprovalRequest,
                            CommandResult,
                            EntryInfo,
                            Execution,
                            ExecutionError,
                            Limits,
                            NetEvent,
                            PoolStatus,
                            Result,
                            SandboxInfo,
                            SandboxMetrics,
                            SnapshotRef,
                            StageTiming,
                            State,
                            TierStatus,
)
from warmbox.network.policy import Network, Secret
from warmbox.sdk import AsyncSandbox, CodeContext, Sandbox

__version__ = "0.1.0"

__all__ = [
    "ArtifactCorrupt", "ConfigError", "PoolStatus", "SandboxMetrics", "SnapshotRef", "SnapshotUnsupported",
    "StorageError", "StorageFull", "ApprovalRequest", "NetEvent", "Network", "NetworkError", "Secret",
    "AsyncSandbox", "BackendUnavailable", "CodeContext", "CommandFailed", "CommandResult", "ContextError",
    "EntryInfo", "Execution", "ExecutionError", "FilesError", "GuestConnectionError", "GuestProtocolError",
    "InvalidArgument", "InvalidPath", "IsADirectory", "Limits", "NoSpace", "NotADirectory", "PathExists",
    "PathNotFound", "PathPermissionDenied", "RegistryError", "Result", "Sandbox", "SandboxError",
    "SandboxInfo", "SandboxNotFound", "SandboxStartError", "SandboxStateError", "SandboxTimeout",
    "StageTiming", "State", "TierStatus", "WarmboxError", "__version__",
]
