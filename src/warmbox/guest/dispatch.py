"""Which handler answers each request, and the agent's own requests (ping, usage, quiesce)."""

from __future__ import annotations

import _socket as socket
import os

from warmbox import protocol as p
from warmbox.guest import background, commands, contexts, files, ports
from warmbox.guest.base import _Fail

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from typing import Any

    from warmbox.guest.agent import Agent
    from warmbox.guest.connection import Connection


def _ping(agent: Agent, conn: Connection, msg: p.Ping) -> None:
    conn.send(p.Pong(id=msg.id, version=p.PROTOCOL_VERSION, pid=os.getpid()))


def _get_usage(agent: Agent, conn: Connection, msg: p.GetUsage) -> None:
    conn.send(agent.busy.report(msg.id))


def _quiesce(agent: Agent, conn: Connection, msg: p.Quiesce) -> None:
    if agent.serial is not None:  # a VM: its memory snapshot holds the port; nothing to drop
        conn.send(p.Ok(id=msg.id))
        return
    if agent.path is None:
        raise _Fail(p.ErrorCode.INVALID, "this agent listens on an inherited socket: nothing to quiesce")
    agent.quiesce(keep=conn)
    conn.send(p.Ok(id=msg.id))
    try:  # the host waits for this connection's end before its checkpoint
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


_HANDLERS: dict[type[p.Message], Any] = {
    p.Ping: _ping,
    p.Exec: commands._exec,
    p.Signal: commands._signal,
    p.ReadFile: files._read_file,
    p.WriteFile: files._write_file,
    p.Rename: files._rename,
    p.TarCreate: files._tar_create,
    p.TarExtract: files._tar_extract,
    p.WatchDir: files._watch_dir,
    p.ListDir: files._list_dir,
    p.Stat: files._stat,
    p.MakeDir: files._make_dir,
    p.Remove: files._remove,
    p.ContextCreate: contexts._context_create,
    p.ContextRun: contexts._context_run,
    p.ContextRunEnv: contexts._context_run,
    p.ContextDelete: contexts._context_delete,
    p.ContextList: contexts._context_list,
    p.ContextRestart: contexts._context_restart,
    p.Configure: contexts._configure,
    p.GetUsage: _get_usage,
    p.Quiesce: _quiesce,
    p.Reseed: contexts._reseed,
    p.PortConnect: ports._port_connect,
    p.Spawn: background._spawn_bg,
    p.Attach: background._attach,
    p.SpawnFollow: background._spawn_follow,
    p.ProcInput: background._proc_input,
    p.ProcResize: background._proc_resize,
    p.ProcList: background._proc_list,
}
# requests whose inbox exists before their worker starts: their data, acks or Cancel may come first
_PREPARED = (p.ReadFile, p.PortConnect, p.WriteFile, p.Attach, p.SpawnFollow, p.TarCreate, p.TarExtract, p.WatchDir)
_INLINE = frozenset({p.Ping, p.GetUsage, p.Signal})  # never block: handled on the reader thread
