"""The `kubealign` command (commands: main and the console script; parser: the options; serving: serve,
judge, rollback; summary: a run's one-screen summary). `python -m kubealign.cli` runs it (__main__)."""

from kubealign.cli.commands import console, main

__all__ = ["console", "main"]
