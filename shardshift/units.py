"""Sizes, rates and durations: parsed from the command line and from files in one place.

Sizes are bytes with binary units, as memory is counted: ``64M`` = 64 × 2**20, ``1.5G``,
``512K``, ``4096``; a trailing ``B`` or ``iB`` is allowed (``64MiB``). Lists of sizes are a comma
list or ``LO:HI``, the powers of two from LO up to HI (nccl-tests' ``-b LO -e HI -f 2``).

Rates are bytes per second. A number is bytes/s; with a unit, upper-case ``B`` is bytes and
``bit`` or lower-case ``b`` is bits; k, M, G, T are powers of 1000 and Ki, Mi, Gi powers of 1024
(bytes only):

    25 GB/s   10 GiB/s   1 Gbit/s   200Mbit/s   8 b/s   1gbit   200mbit (tc's spelling)

``bps`` is refused: tc reads ``25mbps`` as megabytes per second, most other tools as megabits,
and a rate off by a factor of 8 would be silently wrong.

Durations are seconds: a number, or ``5 us``, ``2ms``, ``0.25 s``.
"""

from __future__ import annotations

import re

_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")
_BYTE_RATE = {f"{p}B/s": scale for p, scale in _DECIMAL.items()} | {
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30, "TiB/s": 2.0**40,
}  # fmt: skip
_BIT_RATE = {f"{p}b/s": scale / 8 for p, scale in _DECIMAL.items()}
_BITS = re.compile(r"^([kmgt]?)bit(/s)?$", re.IGNORECASE)  # 1gbit, 200Mbit, 1 Gbit/s
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
RATE_EXAMPLES = "'25 GB/s', '10 GiB/s', '1 Gbit/s' or '200mbit'"


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``"64M"``, ``"1G"``, ``"512K"``, ``"64MiB"`` or a number; `what` names the
    quantity in the error (e.g. ``"--switch-budget"``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        body = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        unit = body[-1:] if body[-1:] in "KMGT" else ""
        try:
            value = float(body[: len(body) - len(unit)]) * _BINARY[unit]
        except ValueError:
            raise ValueError(f"{what} {text!r} is not a number of bytes; write e.g. 64M, 1G or 1048576") from None
    if value < 1:
        raise ValueError(f"{what} {text!r} must be at least 1 byte")
    return int(value)


def parse_size_list(text: str, what: str = "sizes") -> list[int]:
    """``"1M:64M"`` → 1 MiB, 2 MiB, …, 64 MiB (powers of two from LO up to HI); ``"1M,3M"`` → those."""
    if ":" in text:
        lo, hi = (parse_size(word, what) for word in text.split(":", 1))
        if hi < lo:
            raise ValueError(f"{what} {text}: the upper end is below the lower one")
        sizes = [lo]
        while sizes[-1] * 2 <= hi:
            sizes.append(sizes[-1] * 2)
        return sizes
    sizes = [parse_size(word, what) for word in text.split(",") if word.strip()]
    if not sizes:
        raise ValueError(f"{what} {text!r} names no size; write e.g. 1M:64M or 512K,3M")
    return sizes


def parse_rate(value: float | int | str) -> float:
    """Bytes/s from a number (bytes/s) or a string with a unit (see the module docstring)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _NUMBER_UNIT.match(str(value))
    if match:
        number, unit = float(match.group(1)), match.group(2)
        bits = _BITS.match(unit)
        if unit.lower().endswith("bps"):
            raise ValueError(f"rate {value!r} is ambiguous: tc reads 'bps' as bytes/s, most tools as "
                             f"bits/s; write {number:g}{unit[:-3]}B/s for bytes or {number:g}{unit[:-3]}bit/s for bits")
        if unit == "":
            return number
        if bits:
            return number * _DECIMAL[bits.group(1).upper() if bits.group(1) else ""] / 8
        scale = _BYTE_RATE.get(unit, _BIT_RATE.get(unit))
        if scale is not None:
            return number * scale
    raise ValueError(f"cannot read rate {value!r}; write bytes/s as a number, or e.g. {RATE_EXAMPLES}")


def parse_duration(value: float | int | str) -> float:
    """Seconds from a number or a string: ``"5 us"``, ``"1.5ms"``, ``"0.2 s"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _NUMBER_UNIT.match(str(value))
    if match and match.group(2) in ("", *_TIME):
        return float(match.group(1)) * _TIME.get(match.group(2), 1.0)
    raise ValueError(f"cannot read duration {value!r}; write seconds or e.g. '5 us', '2 ms'")


def format_size(nbytes: float, digits: int = 1) -> str:
    """1536 → '1.5 KiB' (`digits` after the point); below 1 KiB, whole bytes ('512 B')."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """125e6 → '1000.0 Mbit/s' (for messages and tables)."""
    return f"{bytes_per_s * 8 / 1e6:.1f} Mbit/s"
