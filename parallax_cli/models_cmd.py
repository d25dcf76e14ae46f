"""`parallax models`: the built-in named models, one row each."""
from __future__ import annotations

from rich.table import Table

from parallax_cli import app, wide_console
from planner.trace.models.catalog import list_models, summary


@app.command("models")
def models() -> None:
    """List the built-in models (params counted from each config)."""
    table = Table(title="Built-in models")
    for column in ("name", "family", "layers", "hidden", "heads", "kv heads", "params (B)"):
        table.add_column(column, justify="left" if column in ("name", "family") else "right")
    for name in list_models():
        row = summary(name)
        table.add_row(row["name"], row["family"], str(row["layers"]), str(row["hidden"]), str(row["heads"]),
                      str(row["kv_heads"]), f"{row['params_b']:.2f}")
    wide_console().print(table)
