"""Price per GPU-hour, by GPU type, with the source and date of each figure.

Prices are data (`hardware/prices.json`), because they go stale faster than
code: a user passes their own table (`load_price_table`) to replace them.
A GPU with no known price gets a quote with `usd=None`, never a guess.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hardware.catalog_io import canonical_name, read_json
from hardware.errors import HardwareError

DEFAULT_TABLE = Path(__file__).parent / "prices.json"


@dataclass(frozen=True)
class PriceQuote:
    """USD per GPU-hour (None when unknown), where the figure comes from, and when."""

    usd: float | None
    source: str
    date: str | None = None


def _quote(name: str, raw: object, origin: str) -> PriceQuote:
    """Validate one table row: a bare number, or {usd, source, date}."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        raw = {"usd": raw, "source": f"price table {origin}"}
    if not isinstance(raw, dict):
        raise HardwareError(f"prices.{name}", f"must be a number or an object with usd/source/date in {origin}")
    usd = raw.get("usd")
    if usd is not None and (isinstance(usd, bool) or not isinstance(usd, (int, float))
                            or not math.isfinite(usd) or usd < 0):
        raise HardwareError(f"prices.{name}.usd", f"{usd!r} is not a price in {origin}",
                            "give a non-negative number of USD per GPU-hour, or null")
    source = raw.get("source") or f"price table {origin}"
    date = raw.get("date")
    return PriceQuote(None if usd is None else float(usd), str(source), None if date is None else str(date))


def _table_key(name: str) -> str:
    """Catalog name for catalog GPUs and aliases; the lower-cased name otherwise."""
    return canonical_name(name) or name.strip().lower()


def load_price_table(path: str | Path) -> dict[str, PriceQuote]:
    """Read a price table: {"prices": {gpu: quote}} or a flat {gpu: quote} mapping."""
    path = Path(path)
    data = read_json(path)
    if isinstance(data, dict) and isinstance(data.get("prices"), dict):
        data = data["prices"]
    if not isinstance(data, dict):
        raise HardwareError("prices", f"{path} must hold a JSON object mapping GPU names to prices")
    return {_table_key(str(name)): _quote(str(name), raw, str(path)) for name, raw in data.items()}


@lru_cache(maxsize=None)
def default_price_table() -> dict[str, PriceQuote]:
    """The shipped table, parsed once."""
    return load_price_table(DEFAULT_TABLE)


def price_per_gpu_hour(gpu_name: str, table: dict[str, PriceQuote] | str | Path | None = None) -> PriceQuote:
    """Quote for `gpu_name` (catalog name or alias); a user `table` overrides the shipped one."""
    if table is not None and not isinstance(table, dict):
        table = load_price_table(table)
    key = _table_key(gpu_name)
    quote = (table or {}).get(key) or default_price_table().get(key)
    if quote is None:
        return PriceQuote(None, f"no price known for {gpu_name!r}")
    return quote
