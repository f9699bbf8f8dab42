"""The `humanline` command. Every entry point (the console script, `python -m humanline_cli`, a torchrun rank
running the command) imports this package first, so process-wide settings are made here, before the first large
allocation."""
from humanline_cli.memory import keep_freed_memory

keep_freed_memory()
