"""Code contexts: interpreters whose state persists between ``run_code`` calls."""

from __future__ import annotations

from warmbox.models import CodeContext


def context_id(context: CodeContext | str | None) -> str:
    """The id a run_code or remove_code_context call names ("default" for None)."""
    if context is None:
        return "default"
    return context.id if isinstance(context, CodeContext) else context


__all__ = ["CodeContext", "context_id"]
