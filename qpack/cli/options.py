"""Help texts the command line shares where no config field documents the option."""

from __future__ import annotations

MAX_MEMORY_HELP = "Memory the run may use (8GB, 0.5 = half of what is free; default 90% of free)."
