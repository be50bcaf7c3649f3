"""`python -m openforge` runs the `openforge` command."""

from openforge.cli import main

main()
