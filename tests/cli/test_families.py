"""The command line's convention: each command family is one module of kubealign.cli holding its commands'
parsers and the handlers they dispatch to (set_defaults(func=...)); kubealign.cli.parser only assembles the
families and dispatches. The check follows every parser to the module whose code added it, so a family split
again into a parser module and a handler module fails it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable

import pytest

from kubealign.cli import feedback, parser

pytestmark = pytest.mark.unit


def mismatches(build: Callable[[], argparse.ArgumentParser], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """'COMMAND: parser in MODULE, handler in MODULE' for every parser (subcommands too) whose handler, its own
    func default or the nearest enclosing command's, lives in another module than the code that added it."""
    added_by: dict[int, str] = {}
    add_parser = argparse._SubParsersAction.add_parser

    def recording(self, name, **kwargs):
        made = add_parser(self, name, **kwargs)
        added_by[id(made)] = sys._getframe(1).f_globals["__name__"]
        return made

    with monkeypatch.context() as patch:
        patch.setattr(argparse._SubParsersAction, "add_parser", recording)
        root = build()
    found = []

    def walk(node: argparse.ArgumentParser, path: list[str], handler: Callable | None) -> None:
        for action in node._actions:
            if not isinstance(action, argparse._SubParsersAction):
                continue
            for name, child in action.choices.items():
                func = child._defaults.get("func", handler)
                where = getattr(func, "__module__", None)
                if where != added_by[id(child)]:
                    found.append(f"{' '.join([*path, name])}: parser in {added_by[id(child)]}, handler in {where}")
                walk(child, [*path, name], func)

    walk(root, [], None)
    return found


def test_every_command_is_handled_in_the_module_that_added_its_parser(monkeypatch):
    assert mismatches(parser.build_parser, monkeypatch) == []


def test_every_family_adds_its_own_commands_and_the_assembly_none(monkeypatch):
    top = next(a for a in parser.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    modules = {sys.modules[child._defaults["func"].__module__] for child in top.choices.values()}
    assert modules == set(parser.FAMILIES)
    assert (
        "feedback" in top.choices and "reproduce" in top.choices and "round" in top.choices and len(top.choices) == 23
    )


def test_the_check_finds_a_parser_split_from_its_handler(monkeypatch):
    """A parser added here (as parser.py once added them all) whose handler is in kubealign.cli.feedback."""

    def split() -> argparse.ArgumentParser:
        root = argparse.ArgumentParser(prog="kubealign")
        sub = root.add_subparsers(dest="command")
        sub.add_parser("feedback").set_defaults(func=feedback.command)
        sub.add_parser("orphan")
        return root

    assert mismatches(split, monkeypatch) == [
        f"feedback: parser in {__name__}, handler in kubealign.cli.feedback",
        f"orphan: parser in {__name__}, handler in None",
    ]


def test_the_help_imports_no_heavy_library():
    """The handlers import their stages inside themselves: `kubealign --help` stays fast."""
    code = (
        "import sys; from kubealign.cli import parser; parser.build_parser().format_help(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'mlflow', 'kfp', "
        "'datasets', 'pydantic', 'yaml', 'deepspeed'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
