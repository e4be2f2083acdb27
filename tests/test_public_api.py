import warmbox
from warmbox import errors


def test_exported_members():
    assert sorted(warmbox.__all__) == sorted(
        [
            "AsyncSandbox",
            "BackendUnavailable",
            "CodeContext",
            "CommandFailed",
            "CommandResult",
            "CommandRecord",
            "SnapshotRecord",
            "Transcript",
            "ContextError",
            "PortNotListening",
            "EntryInfo",
            "Execution",
            "ExecutionError",
            "FilesError",
            "GuestConnectionError",
            "GuestProtocolError",
            "InvalidArgument",
            "InvalidPath",
            "IdempotencyConflict",
            "OutcomeUnknown",
            "IsADirectory",
            "Limits",
            "Logs",
            "NoSpace",
            "NotADirectory",
            "PathExists",
            "PathNotFound",
            "PathPermissionDenied",
            "RegistryBusy",
            "RegistryError",
            "Result",
            "Sandbox",
            "SandboxError",
            "SandboxInfo",
            "SandboxLost",
            "SandboxNotFound",
            "SandboxPaused",
            "SecretsRequired",
            "Lifecycle",
            "SandboxQuery",
            "SandboxStartError",
            "SandboxStateError",
            "SandboxTimeout",
            "StageTiming",
            "State",
            "TierStatus",
            "TierChoice",
            "Requirements",
            "NoSuitableTier",
            "NoCapacity",
            "NodeFenced",
            "ClusterError",
            "choose_tier",
            "UnsupportedLanguage",
            "WarmboxError",
            "__version__",
            "ArtifactCorrupt",
            "CorruptLayer",
            "DockerfileError",
            "TemplateBuildError",
            "AsyncTemplates",
            "Template",
            "TemplateBuildEvent",
            "TemplateInfo",
            "Templates",
            "TemplateError",
            "TemplateInUse",
            "TemplateMismatch",
            "ImageRegistryUnreachable",
            "TemplateNotFound",
            "VolumeError",
            "VolumeElsewhere",
            "VolumeInUse",
            "VolumeNotFound",
            "Volume",
            "VolumeInfo",
            "ConfigError",
            "PoolStatus",
            "SandboxMetrics",
            "SnapshotRef",
            "SnapshotUnsupported",
            "SnapshotRuntimeMismatch",
            "StorageError",
            "StorageFull",
            "ApprovalRequest",
            "Approval",
            "ApprovalClosed",
            "ApprovalDenied",
            "ApprovalError",
            "ApprovalNotFound",
            "BudgetStatus",
            "UsageBucket",
            "NetEvent",
            "Network",
            "NetworkError",
            "Secret",
            "QuotaExceeded",
            "Forbidden",
            "WriteEntry",
            "CommandHandle",
            "ProcessInfo",
            "ProcessNotFound",
            "Unsupported",
            "UnsafeArchive",
            "FilesystemEvent",
            "FilesystemEventType",
        ]
    )
    for name in warmbox.__all__:
        assert hasattr(warmbox, name)


def test_every_error_is_rooted_and_drawn_in_the_tree():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    for cls in classes:
        assert issubclass(cls, errors.WarmboxError)
        assert cls.__name__ in errors.__doc__, f"{cls.__name__} missing from the tree in errors.__doc__"


def test_sync_api_is_derived_not_written():
    from warmbox.sdk import AsyncSandbox, Sandbox
    from warmbox.sdk._sync import either

    for name in (
        "create",
        "connect",
        "kill",
        "run_code",
        "set_timeout",
        "create_code_context",
        "resume",
        "snapshot",
        "pause",
        "metrics",
    ):
        raw = AsyncSandbox.__dict__.get(name)
        if isinstance(raw, either):  # kill: on the class (by id) and on a sandbox, both derived
            sync = Sandbox.__dict__[name]
            assert sync.on_class.__wrapped__ is raw.on_class and sync.on_instance.__wrapped__ is raw.on_instance
            continue
        assert (
            getattr(Sandbox, name).__wrapped__ is getattr(AsyncSandbox, name).__func__
            if isinstance(AsyncSandbox.__dict__.get(name), classmethod)
            else getattr(Sandbox, name).__wrapped__
        )


def test_the_sync_stubs_are_current():
    from warmbox.sdk import _stubgen

    assert _stubgen.main(["--check"]) == 0, "run: python -m warmbox.sdk._stubgen"
