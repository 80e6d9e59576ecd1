"""Index-range specs used by per-layer and per-head config keys.

``"*"`` is everything, ``"3"`` one index, ``"0-3"`` an inclusive range, ``"0-3,8,10-11"`` a union.
Per-layer sections key on ``"<layers>"`` and attention patterns on ``"<layers>:<heads>"``.
"""

from __future__ import annotations

from .errors import ConfigError


def parse_range(spec: str | int, n: int, key: str) -> list[int]:
    """Indices in ``[0, n)`` named by ``spec``; raises ConfigError naming ``key`` if out of
    range."""
    spec = str(spec).strip()
    if spec in ("*", "all"):
        return list(range(n))
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(p) for p in part.split("-", 1))
            else:
                lo = hi = int(part)
        except ValueError:
            raise ConfigError(
                key, f"bad range {spec!r}; use '*', 'i', 'i-j' or a comma list"
            ) from None
        if not (0 <= lo <= hi < n):
            raise ConfigError(key, f"range {part!r} outside 0..{n - 1}")
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


def assign_ranges(table: dict, n: int, key: str, default=None) -> list:
    """Expand ``{range_spec: value}`` to a list of length ``n``; overlapping ranges are an error."""
    out = [default] * n
    owner: dict[int, str] = {}
    for spec, value in table.items():
        for i in parse_range(spec, n, f"{key}.{spec}"):
            if i in owner and spec not in ("*", "all") and owner[i] not in ("*", "all"):
                raise ConfigError(f"{key}.{spec}", f"overlaps {owner[i]!r} at index {i}")
            # "*" is a default that specific ranges override, whichever order they appear in.
            if i in owner and spec in ("*", "all"):
                continue
            owner[i] = spec
            out[i] = value
    return out
