"""`python -m parallax_cli`: the `parallax` command (what generated batch scripts call)."""
from parallax_cli import entry

entry()
