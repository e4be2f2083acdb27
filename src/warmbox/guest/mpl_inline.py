"""matplotlib backend of Python code contexts: figures become PNG results, as Jupyter's inline one.

Selected by the kernel when a cell imports matplotlib (never through ``MPLBACKEND``, which
processes started from a cell would inherit without being able to import this module).
``plt.show()`` turns every open figure into a result at that point; the kernel does the same
with figures still open at the end of a cell. Imported only by matplotlib itself, so only then.
"""

from __future__ import annotations

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from warmbox.guest import kernel

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(close: object = None, block: object = None) -> None:
    """Every open figure as a result of the running cell, then closed (``close``/``block`` ignored)."""
    kernel.show_figures()
