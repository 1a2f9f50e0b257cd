"""Sizes and durations as people read and type them: ``format_bytes``, ``format_duration``,
``parse_size``. Every stage reports sizes (the vLLM glue's log lines, the command line's
table), so they live below the stages rather than in ``cli``."""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "format_duration", "parse_size"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _unit_of(n: float) -> int:
    index = 0
    while abs(n) >= 1024 and index < len(_UNITS) - 1:
        n /= 1024
        index += 1
    return index


def format_bytes(n: float, *, unit_of: float | None = None) -> str:
    """``67488768`` -> ``"64.4 MiB"``. ``unit_of`` picks the unit from another number, so
    ``done/total`` pairs share one unit."""
    index = _unit_of(n if unit_of is None else unit_of)
    if index == 0:
        return f"{int(n)} B"
    return f"{n / 1024**index:.1f} {_UNITS[index]}"


def format_duration(seconds: float | None) -> str:
    """``0.42`` -> ``"0.42s"``, ``75`` -> ``"1m15s"``, ``None`` -> ``"--"``."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--"  # an ETA at a rate of zero is as unknown as none
    # The unit is chosen after rounding: 9.999 is "10s", 59.6 is "1m00s" (not "60s").
    text = f"{seconds:.2f}"
    if float(text) < 10:
        return f"{text}s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


_SIZE = re.compile(
    r"\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>(?P<prefix>[kmgtp])?(?P<binary>i)?(?P<b>b)?)\s*",
    re.IGNORECASE,
)
_PREFIXES = "kmgtp"


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864. ``KiB/MiB/GiB/TiB`` (and bare ``K/M/G/T``) are powers of
    1024, ``KB/MB/GB/TB`` powers of 1000; no unit or ``B`` means bytes. Case-insensitive."""
    match = _SIZE.fullmatch(text)
    unit_ok = match is not None and (match["prefix"] is not None or (match["binary"] is None))
    if match is None or not unit_ok:
        raise ValueError(
            f"invalid size {text!r}: expected a number with an optional unit, "
            "like 64MiB, 1GiB, 3GB or 500M"
        )
    number = float(match["number"])
    prefix = match["prefix"]
    if prefix is None:
        multiplier = 1
    else:
        power = _PREFIXES.index(prefix.lower()) + 1
        decimal = match["b"] is not None and match["binary"] is None
        multiplier = (1000 if decimal else 1024) ** power
    size = int(round(number * multiplier))
    if size < 1:
        raise ValueError(f"invalid size {text!r}: must be at least one byte")
    return size
