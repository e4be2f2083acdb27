"""What every benchmark shares: the commands it runs and how it summarises timings."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable

EMPTY = ["python3", "-c", "print(2+2)"]
AGENT_CODE = (
    "import numpy, pandas\n"
    "rng = numpy.random.default_rng(0)\n"
    "pandas.DataFrame(rng.normal(size=(1000, 4)), columns=list('abcd')).to_csv('/tmp/d.csv', index=False)\n"
    "print(pandas.read_csv('/tmp/d.csv').describe().loc['mean'].round(3).to_dict())"
)
AGENT = ["python3", "-c", AGENT_CODE]
VARIANTS = {"empty": (EMPTY, "print(2+2)", "base"), "agent": (AGENT, AGENT_CODE, "pydata")}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _stats(v: list[float]) -> dict[str, float]:
    return {
        "p50_ms": statistics.median(v),
        "p95_ms": _pct(v, 0.95),
        "p99_ms": _pct(v, 0.99),
        "min_ms": min(v),
        "n": len(v),
    }


def check_ranges(args: argparse.Namespace, ranges: Iterable[tuple[str, float, float]]) -> None:
    """InvalidArgument naming the first option of ``ranges`` (attribute, lowest, highest) outside its range."""
    from warmbox.errors import InvalidArgument

    for name, lo, hi in ranges:
        v = getattr(args, name)
        if not lo <= v <= hi:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {v}")
