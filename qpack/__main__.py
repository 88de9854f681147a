"""`python -m qpack`: the `qpack` command line."""

from qpack.cli import main

main()
