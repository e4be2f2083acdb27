"""``sandbox.commands``: run processes inside the sandbox."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from warmbox import operations as ops
from warmbox.errors import CommandFailed
from warmbox.models import CommandResult

if TYPE_CHECKING:
    from warmbox.sdk.sandbox import AsyncSandbox

DEFAULT_COMMAND_TIMEOUT_S = 60.0
DEFAULT_MAX_OUTPUT = 10 << 20


class AsyncCommands:
    """``sandbox.commands``: run processes inside the sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def run(
        self,
        cmd: str | list[str],
        *,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        stdin: str | bytes | None = None,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        check: bool = False,
    ) -> CommandResult:
        """Run ``cmd`` (a shell string for bash, or an argv list) and wait for it.

        timeout: seconds, wall clock (None or 0: no limit); on expiry every process the command
        started is killed, double-forked and setsid()ed ones included, and ``timed_out`` is set.
        What it starts and leaves running when it exits normally (``nohup server &``) stays;
        a runaway one is bounded by limits.pids and limits.cpus. On gVisor a command runs in its
        own PID namespace: ``$$`` counts from 2 there while ``ps`` shows the sandbox's pids, and a
        command cannot signal what another one started (agent.Scopes).
        Output beyond ``max_output`` bytes (stdout+stderr) is dropped and ``truncated`` set.
        ``check=True`` raises CommandFailed on a non-zero exit.
        """
        sb = self._sb
        result = await sb._run(
            ops.Exec(
                sb.sandbox_id,
                cmd,
                envs=envs,
                cwd=cwd,
                timeout=timeout,
                stdin=stdin,
                max_output=max_output,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
            )
        )
        if check and not result.ok:
            raise CommandFailed(f"command exited with {result.exit_code}", sb.sandbox_id, result)
        return result


__all__ = ["AsyncCommands"]
