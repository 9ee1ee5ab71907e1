"""The `kubealign` command. parser: the top-level parser, main and the console script; one module per command
family, each its commands' parsers beside their handlers (training, judging, pipeline, images, tools, registry,
serving, feedback); options: the options several families share; summary: a run's one-screen summary.
`python -m kubealign.cli` runs it (__main__)."""

from kubealign.cli.parser import console, main

__all__ = ["console", "main"]
