"""``warmbox bench``: benchmarks of the engine against raw runc, runsc, bwrap and QEMU, measured in the same run.

``container`` holds the container/gVisor benchmarks and the ``command`` the CLI calls; ``microvm``
the microVM tier's; ``common`` what they share. Sandboxes are made through the SDK; the raw
baselines drive the runtimes directly, with the very configurations warmbox generates.
"""

from warmbox.bench.container import command

__all__ = ["command"]
