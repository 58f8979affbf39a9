"""Sizes and counts on the command line and in recipes: one parser and one formatter, one rule for every flag.

- Counts (documents, tokens, rows): SI suffixes K, M, G, T, P (x1000), scientific notation and underscores:
  `2.5M`, `11.2T`, `5e9`, `2_359_296`. `B` is refused: B means bytes here, never billion (write `100G` or `100e9`).
- Bytes: SI `KB MB GB TB` (x1000, `100MB` = 1e8) and IEC `KiB MiB GiB TiB` (x1024); `B` alone is bytes (`100B` is 100
  bytes), a bare number too; `K M G T` without the B are SI, as for counts.
- benchmark-nccl's message sizes keep nccl-tests' `-b/-e` convention on purpose, so that its users' sizes mean the same:
  a bare `K M G T` is x1024 (`1M` = 1 MiB). Sizes written with a B follow the bytes rule above (`1MB` = 1e6).

    >>> parse_count("2.5M", "--tokens"), parse_bytes("1GiB", "--bytes"), parse_nccl_bytes("1M", "--max-bytes")
    (2500000, 1073741824, 1048576)
"""

from __future__ import annotations

import math
import re

from smolctl.errors import UserError

SI = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
IEC = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
NCCL = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

COUNT_HELP = "SI suffixes K M G T (x1000) or 5e9; not B (B is bytes)"
BYTES_HELP = "bytes: SI KB MB GB (x1000) or IEC KiB MiB GiB (x1024)"
NCCL_HELP = "bytes; K M G = x1024 as in nccl-tests -b/-e (1M = 1 MiB), 1MB = 1e6"

_NUMBER = r"([0-9][0-9_]*\.?[0-9_]*(?:e[+-]?[0-9]+)?|\.[0-9]+)"
_AMOUNT = re.compile(rf"\s*{_NUMBER}\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)


def _split(text: str | int | float, flag: str, example: str) -> tuple[float, str, bool, bool]:
    """'1.5 GiB' → (1.5, 'G', True, True): the number, its prefix, an 'i' (IEC) and a 'B' (bytes)."""
    match = _AMOUNT.fullmatch(str(text))
    if not match:
        raise UserError(flag, f"cannot read {text!r} as an amount", f"write e.g. {example}")
    number, prefix, iec, byte = match.groups()
    if iec and not (prefix and byte):  # IEC is always written whole: KiB, MiB, GiB, TiB
        raise UserError(flag, f"cannot read {text!r} as an amount", f"write e.g. {example}")
    value = float(number.replace("_", ""))
    if not math.isfinite(value) or value <= 0:
        raise UserError(flag, f"{text!r} must be positive", f"write e.g. {example}")
    return value, prefix.upper(), bool(iec), bool(byte)


def _whole(value: float, text: str | int | float, flag: str) -> int:
    """The amount rounded to a whole number, at least 1 (0.4 documents would be none at all)."""
    whole = round(value)
    if whole < 1:
        raise UserError(flag, f"{text!r} rounds to 0", "write an amount of at least 1")
    return whole


def parse_count(text: str | int | float, flag: str) -> int:
    """'2.5M' → 2_500_000, '11.2T', '5e9', '2_359_296'; an int from a recipe passes through."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text) or text <= 0:
            raise UserError(flag, f"{text!r} must be a positive count", "write e.g. 2.5M, 11.2T or 5e9")
        return _whole(text, text, flag)
    value, prefix, iec, byte = _split(text, flag, "2.5M, 11.2T or 5e9")
    if byte or iec:
        billions = f"{value:g}G or {value:g}e9" if prefix == "" else "a number with K, M, G or T"
        raise UserError(flag, f"{text!r} is a count, and B means bytes", f"for {value:g} billion write {billions}")
    return _whole(value * SI[prefix], text, flag)


def parse_bytes(text: str | int | float, flag: str) -> int:
    """'100MB' → 100_000_000, '1GiB' → 2**30, '100B' → 100, '4096' → 4096."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return parse_count(text, flag)
    value, prefix, iec, _ = _split(text, flag, "100MB, 1GiB or 4096")
    if iec and prefix + "I" not in IEC:
        raise UserError(flag, f"cannot read {text!r} as bytes", "write e.g. 100MB, 1GiB or 4096")
    return _whole(value * (IEC[prefix + "I"] if iec else SI[prefix]), text, flag)


def parse_nccl_bytes(text: str, flag: str) -> int:
    """nccl-tests' -b/-e sizes: '8', '64K', '1M' = 2**20, '8G'; with a B the bytes rule: '1MiB' = 2**20, '1MB' = 1e6."""
    value, prefix, iec, byte = _split(text, flag, "8, 64K, 1M or 8G (x1024, as nccl-tests)")
    if iec or byte:
        return parse_bytes(text, flag)
    if prefix not in NCCL:
        raise UserError(flag, f"cannot read {text!r} as a message size", "write e.g. 8, 64K, 1M or 8G")
    return _whole(value * NCCL[prefix], text, flag)


def parse_shard_size(text: str, flag: str = "--shard-size") -> tuple[int | None, int | None]:
    """A shard limit: '256MB' / '1GiB' → (bytes, None); '50000rows' / '50Krows' → (None, rows). A bare number is
    bytes, as with every byte flag."""
    match = re.fullmatch(r"\s*(.*?)\s*rows?\s*", str(text), re.IGNORECASE)
    if match:
        try:
            return None, parse_count(match.group(1), flag)
        except UserError:  # its message would name the bare number and offer counts of tokens
            raise UserError(
                flag, f"{text!r} is not a number of rows of at least 1", "write e.g. 50000rows or 50Krows"
            ) from None
    return parse_bytes(text, flag), None


def format_count(n: float) -> str:
    """2_500_000 → '2.5M' (SI, three significant digits; parse_count reads it back)."""
    for prefix in ("", "K", "M", "G", "T"):
        shown = f"{n:.0f}" if prefix == "" else f"{n:.3g}"
        if abs(float(shown)) < 1000:  # 999,800 rounds to 1000 at three digits: it is 1M, not '1e+03K'
            return shown + prefix
        n /= 1000
    return f"{n:.3g}P"


def format_bytes(n: float) -> str:
    """2**30 → '1.00 GiB' (IEC; parse_bytes reads it back)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
