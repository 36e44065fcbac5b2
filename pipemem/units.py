"""Byte sizes: formatting for people, parsing from flags."""

from __future__ import annotations

import re

from .errors import UserError

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": KiB,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": MiB,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": GiB,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def fmt_bytes(n: float, signed: bool = False) -> str:
    """1536 -> '1.50 KiB'; binary units, as GPU memory is reported by PyTorch."""
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    n = abs(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def parse_bytes(text: str, flag: str = "size") -> int:
    """'80GiB', '80 GB', '1.5e9', '512' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"{flag}: cannot read {text!r} as a size; write e.g. 80GiB, 80GB or 85899345920")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 0:
        raise UserError(f"{flag}: size must not be negative")
    return int(value)
