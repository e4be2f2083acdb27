"""``warmbox bench``: benchmarks of the engine against raw runc, runsc, bwrap and QEMU, measured in the same run.

``main`` holds the ``command`` the CLI calls, which dispatches to one module per benchmark
(``container``: start, burst, exec, snapshot and density of the container/gVisor tiers; ``microvm``
the microVM tier's; ``api``, ``cli``, ``cluster``, ``e2b``, ``isolate``, ``profile``, ``session``,
``template``); ``home`` what every run shares (its private home, a quiet pool, a table), ``raw`` the
raw baselines, ``common`` the commands and statistics. Sandboxes are made through the SDK; the raw
baselines drive the runtimes directly, with the very configurations warmbox generates.
"""

from warmbox.bench.main import command

__all__ = ["command"]
