"""Human-readable numbers for tables: counts, FLOPs, bytes, seconds."""

from __future__ import annotations

__all__ = ["fmt_count", "fmt_flops", "fmt_bytes", "fmt_seconds"]


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
