"""Templates from the SDK: build a :class:`warmbox.Template` spec into a named template, list,
show and remove them (E2B's ``Template.build(template, alias=...)``; Modal's images).

>>> from warmbox import Template, Templates
>>> t = Template.from_template("base").apt_install(["cowsay"]).pip_install(["requests"])
>>> info = Templates.build(t, "mytools", on_progress=print)
>>> sb = Sandbox.create(template="mytools")

The spec travels as typed records; the COPY sources are packed here, on the caller's side
(relative to the spec's context directory, or the current one), and sent with it.
"""

from __future__ import annotations

import builtins
from os import PathLike, fspath
from pathlib import Path

from warmbox import operations as ops
from warmbox.errors import InvalidArgument
from warmbox.models import TemplateInfo
from warmbox.operations import ProgressSink
from warmbox.sdk.sandbox import _once, _transport
from warmbox.sdk.transport import Transport
from warmbox.templates import Template
from warmbox.templates.context import pack_context


class AsyncTemplates:
    """Build and manage templates (class methods; the blocking twin is ``Templates``).

    Each call takes where the engine is as ``Sandbox.create`` does: ``home`` (the in-process
    engine), ``api_url``/``api_key`` (a server; WARMBOX_API_URL), or a ``transport``."""

    @classmethod
    async def build(
        cls,
        template: Template | str | PathLike[str],
        name: str | None = None,
        *,
        alias: str | None = None,
        on_progress: ProgressSink | None = None,
        home: str | Path | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        transport: Transport | None = None,
    ) -> TemplateInfo:
        """Build ``template`` (a Template, or a Dockerfile's path) as the next version of ``name``
        (``alias`` is E2B's word for it). on_progress: a TemplateBuildEvent per step. The same spec
        built again reuses every cached layer (no sandbox is started)."""
        if isinstance(template, (str, PathLike)):
            template = Template.from_dockerfile(fspath(template))
        if not isinstance(template, Template):
            raise InvalidArgument(
                f"template must be a warmbox.Template or a Dockerfile path, got {type(template).__name__}"
            )
        if name is not None and alias is not None and name != alias:
            raise InvalidArgument("give the template's name once (name or alias)")
        target = name if name is not None else alias
        if target is None:
            raise InvalidArgument("a template build needs a name (name= or alias=)")
        context = pack_context(template)
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.TemplateBuild(target, template, context, on_progress), transport is None)

    @classmethod
    async def list(
        cls,
        *,
        home: str | Path | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        transport: Transport | None = None,
    ) -> builtins.list[TemplateInfo]:
        """Every built template version (by name, then version)."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.TemplateList(), transport is None)

    @classmethod
    async def get(
        cls,
        name: str,
        version: int | None = None,
        *,
        home: str | Path | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        transport: Transport | None = None,
    ) -> TemplateInfo:
        """A template's latest version (or ``version``); TemplateNotFound if none."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.TemplateGet(name, version), transport is None)

    @classmethod
    async def delete(
        cls,
        name: str,
        version: int | None = None,
        *,
        home: str | Path | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        transport: Transport | None = None,
    ) -> builtins.list[TemplateInfo]:
        """Remove a template (every version, or ``version``); TemplateInUse while something uses it."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.TemplateDelete(name, version), transport is None)


__all__ = ["AsyncTemplates"]
