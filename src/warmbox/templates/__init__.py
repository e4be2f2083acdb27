"""Template definitions (core: imports only models, errors and the standard library): the fluent
:class:`Template` spec, its step records, the Dockerfile subset, and step cache keys."""

from warmbox.templates.dockerfile import parse_dockerfile
from warmbox.templates.keys import spec_hash, step_key
from warmbox.templates.spec import (
    VENV,
    AptInstall,
    BuildNetwork,
    BuiltSource,
    Copy,
    DebianSource,
    NpmInstall,
    OciSource,
    PipInstall,
    RegistrySource,
    Run,
    SetEnv,
    SetUser,
    SetWorkdir,
    Source,
    Step,
    Template,
    check_name,
    check_template,
    describe,
)

__all__ = [
    "VENV",
    "AptInstall",
    "BuildNetwork",
    "BuiltSource",
    "Copy",
    "DebianSource",
    "NpmInstall",
    "OciSource",
    "PipInstall",
    "RegistrySource",
    "Run",
    "SetEnv",
    "SetUser",
    "SetWorkdir",
    "Source",
    "Step",
    "Template",
    "check_name",
    "check_template",
    "describe",
    "parse_dockerfile",
    "spec_hash",
    "step_key",
]
