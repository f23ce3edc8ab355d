"""Quantities: read from cluster files (``"80 GiB"``, ``"200 Gb/s"``, ``"2.5 us"`` into base units)
and written for tables (counts, FLOPs, bytes, seconds)."""

from __future__ import annotations

import re
from typing import Any

from autopar.errors import ClusterSpecError

__all__ = ["parse_quantity", "fmt_count", "fmt_flops", "fmt_bytes", "fmt_seconds"]

_SCALE = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
          "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
#: unit (after the prefix) -> (base unit, factor to it)
_UNITS = {
    "B": ("bytes", 1.0), "byte": ("bytes", 1.0), "bytes": ("bytes", 1.0),
    "b": ("bytes", 1 / 8), "bit": ("bytes", 1 / 8),
    "B/s": ("bytes/s", 1.0), "Bps": ("bytes/s", 1.0), "b/s": ("bytes/s", 1 / 8),
    "bps": ("bytes/s", 1 / 8),
    "FLOP/s": ("flop/s", 1.0), "FLOPS": ("flop/s", 1.0), "flop/s": ("flop/s", 1.0),
    "s": ("s", 1.0), "ms": ("s", 1e-3), "us": ("s", 1e-6), "ns": ("s", 1e-9),
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
                       r"(Ki|Mi|Gi|Ti|[kKMGTP])?\s*([A-Za-z/]+)\s*$")


def parse_quantity(value: Any, base: str, *, what: str = "value") -> float:
    """A number in ``base`` units ("bytes", "bytes/s", "flop/s", "s") from a number or a string
    with a unit: ``"80 GiB"``, ``"200 Gb/s"`` (bits), ``"312 TFLOP/s"``, ``"2.5 us"``."""
    if isinstance(value, bool):
        raise ClusterSpecError(f"{what} is a boolean", expected=f"a number of {base}",
                               found=repr(value))
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise ClusterSpecError(f"{what} has the wrong type", expected=f"a number of {base} or a "
                               f"string with a unit", found=repr(value))
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    m = _QUANTITY.match(text)
    if m is None:
        raise ClusterSpecError(f"cannot read {what} {value!r}",
                               expected=f"a number with a unit, e.g. {_example(base)}",
                               found=repr(value))
    number, prefix, unit = float(m.group(1)), m.group(2) or "", m.group(3)
    if unit in ("ms", "us", "ns") and prefix:
        unit = prefix + unit
        prefix = ""
    if unit not in _UNITS and prefix + unit in _UNITS:
        unit, prefix = prefix + unit, ""
    if unit not in _UNITS or _UNITS[unit][0] != base:
        raise ClusterSpecError(f"{what} {value!r} has the wrong unit",
                               expected=f"{base}, e.g. {_example(base)}", found=repr(unit))
    return number * _SCALE[prefix] * _UNITS[unit][1]


def _example(base: str) -> str:
    return {"bytes": "'80 GiB'", "bytes/s": "'2.039 TB/s' or '200 Gb/s'",
            "flop/s": "'312 TFLOP/s'", "s": "'2.5 us'"}[base]


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def fmt_flops(n: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9),
                        ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    if 0 < t < 1e-6:
        return f"{t * 1e9:.2f} ns"
    return f"{t * 1e6:.1f} us"


def console():
    """A rich Console that stays readable when stdout is a pipe (rich would assume 80 columns)."""
    import shutil
    import sys

    from rich.console import Console

    width = None if sys.stdout.isatty() else max(120, shutil.get_terminal_size((120, 24)).columns)
    return Console(width=width)
