"""The code's shape: no import circle in the package, the layers point one way, files stay small.

Layers, lowest first: the library (kubealign.*, itself in layers: LIBRARY), the task functions
(kubealign.tasks.*), the KFP component declarations (components/ = kubealign.components), the DAG (pipelines/ =
kubealign.pipelines). A module imports only its own layer or lower ones; kubealign.cli (the package and its
modules) sits above the task functions and may reach the DAG (`kubealign run`, `compile`, `submit`). Imports inside functions count: they are still a
dependency. Modules are filed into packages named by what they hold: few live loose at the package root.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kubealign": ROOT / "kubealign",
    "kubealign.components": ROOT / "components",
    "kubealign.pipelines": ROOT / "pipelines",
}
MAX_LINES = 400
MAX_FUNCTION = 80
# Files still over MAX_LINES: each must shrink under it (then leave this list); none may be added.
OVER: set[str] = set()

pytestmark = pytest.mark.unit


def modules() -> dict[str, Path]:
    found = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if package == "kubealign" and parts[0] in ("components", "pipelines"):
                continue
            found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, or None (iterative DFS, colours: 1 on the stack, 2 done)."""
    colour: dict[str, int] = {}
    for start in sorted(edges):
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(edges[start])))]
        colour[start] = 1
        while stack:
            node, rest = stack[-1]
            nxt = next(rest, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
            elif colour.get(nxt) == 1:
                names = [n for n, _ in stack]
                return names[names.index(nxt) :] + [nxt]
            elif not colour.get(nxt):
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(edges.get(nxt, ())))))
    return None


# The library's own layers, lowest first, folder by folder (a package, or a module at the package root). A
# folder imports only folders of LOWER layers (never one of its own layer but itself): so the drawing of the
# library's imports between folders is the table itself, and an import that would close a loop between two
# folders (or run back up) fails test_layers_point_one_way. The foundation (errors, paths, the DAG's shape)
# imports nothing above it; the core (configs, data, user code, models, the math and rules, tracking, the
# registry) knows no stage; a model's answers and their scores (answers) sit under the online judge's and the
# feedback's users; a stage is reached only from tasks and the command line.
LIBRARY = (
    ("kubealign", "errors", "ranks", "pod", "shape"),
    ("config", "images", "outputs"),
    ("data", "tracking", "usercode", "cluster", "containers", "provenance"),
    ("models", "promotion"),
    ("rewards", "training", "serving", "registry"),
    ("rl", "selection"),
    ("answers",),
    ("feedback",),
    ("stages",),
)
LIBRARY_LAYER = {part: index for index, group in enumerate(LIBRARY) for part in group}


def library_part(name: str) -> str:
    """kubealign.rl.losses -> rl; kubealign.errors -> errors; kubealign -> kubealign."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer(name: str) -> float:
    """The DAG (pipelines/) over the components over the task functions over the library, whose own layers
    (LIBRARY) sit under the task functions: stages 0.8, the lowest group 0.0."""
    if name.startswith("kubealign.pipelines"):
        return 3
    if name.startswith("kubealign.components"):
        return 2
    if name == "kubealign.tasks" or name.startswith("kubealign.tasks."):
        return 1
    if is_cli(name):
        return 1.5  # the command line: above the task functions; its reach up to the DAG is test_layers' exception
    return LIBRARY_LAYER[library_part(name)] / 10


def is_cli(name: str) -> bool:
    """The `kubealign` command: the package kubealign.cli and its modules, the one part allowed up to the DAG."""
    return name == "kubealign.cli" or name.startswith("kubealign.cli.")


def test_no_import_circle():
    assert cycle(graph()) is None


def test_no_import_circle_among_the_benchmarks():
    """The benchmarks import each other as top-level modules (each puts benchmarks/ on sys.path)."""
    known = {path.stem: path for path in (ROOT / "benchmarks").glob("*.py")}
    assert cycle({name: imports(path, known) for name, path in known.items()}) is None


def test_the_circle_check_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def upward(edges: dict[str, set[str]]) -> list[str]:
    """The imports that run up: to a higher layer, or between two folders of one library layer."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in edges.items()
        for target in targets
        if not is_cli(name)
        and (
            layer(target) > layer(name)
            or (layer(name) < 1 and layer(target) == layer(name) and library_part(target) != library_part(name))
        )
    )


def test_layers_point_one_way():
    assert upward(graph()) == []


def test_an_import_back_between_two_folders_of_one_layer_runs_up():
    """The two loops the old group-wise check missed: config <-> selection (then one group), feedback <-> stages."""
    assert upward({"kubealign.config.schema": {"kubealign.selection.candidates"}}) != []
    assert upward({"kubealign.stages.judge": {"kubealign.feedback.push"}}) == []
    assert upward({"kubealign.feedback.push": {"kubealign.stages.evaluate"}}) != []
    assert upward({"kubealign.rl.losses": {"kubealign.rl.advantages"}, "kubealign.errors": set()}) == []
    assert upward({"kubealign.rewards.scorer": {"kubealign.training.loop"}}) != []


def test_every_library_package_has_a_layer():
    parts = {library_part(name) for name in modules() if layer(name) < 1}
    assert parts <= set(LIBRARY_LAYER), sorted(parts - set(LIBRARY_LAYER))
    assert set(LIBRARY_LAYER) <= parts | {"kubealign"}, "a layer names a package that is gone"


def test_the_library_layers_order_what_may_import_what():
    assert layer("kubealign.errors") < layer("kubealign.config.schema") < layer("kubealign.serving.carry_out")
    assert layer("kubealign.cluster.secrets") < layer("kubealign.training.loop") < layer("kubealign.rl.losses")
    assert layer("kubealign.serving.deploy") < layer("kubealign.stages.ppo") < layer("kubealign.tasks.launch")
    assert layer("kubealign.tasks") < layer("kubealign.cli.training") < layer("kubealign.components.stages")


def test_the_cli_exception_covers_its_package_only():
    assert is_cli("kubealign.cli") and is_cli("kubealign.cli.training")
    assert not is_cli("kubealign.client") and not is_cli("kubealign.tasks")


def test_few_modules_live_at_the_package_root():
    # registry.py among them is only the old import path of registered versions (its docstring says why)
    root_modules = sorted(path.stem for path in (ROOT / "kubealign").glob("*.py"))
    assert len(root_modules) <= 8, root_modules  # kubealign/*.py, __init__.py included


def test_library_files_stay_small():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines()) for path in modules().values()
    }
    over = {name for name, lines in sizes.items() if lines > MAX_LINES}
    assert over - OVER == set(), "new files over the limit"
    assert OVER - over == set(), "under the limit now: remove them from OVER"


def test_functions_stay_readable():
    """No function over MAX_FUNCTION lines (a pipeline function's body counts: it is read like any other)."""
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_components_package_exports_every_component():
    from kfp.dsl.base_component import BaseComponent

    from kubealign import components
    from kubealign.components import stages

    declared = {name for name, value in vars(stages).items() if isinstance(value, BaseComponent)}
    assert set(components.__all__) == declared and len(declared) == 16


def test_tests_are_laid_out_like_the_library() -> None:
    """Each folder of tests/ is a package of the library, faults (the fault-injection tests) or support (helpers
    shared by several folders: no tests there); at the top only the tests of the whole repository."""
    library = {p.name for p in (ROOT / "kubealign").iterdir() if (p / "__init__.py").is_file()}
    library |= {"pipelines", "components", "configs"}  # top-level folders installed as kubealign.<name>
    tests = ROOT / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - library <= {"faults", "support"}, folders - library
    assert not list((tests / "support").glob("test_*.py"))
    top = {p.stem for p in tests.glob("test_*.py")}
    whole = {"test_layout", "test_repo_hygiene", "test_package", "test_errors", "test_config"}
    whole |= {"test_gpu_harness", "test_policy_losses_benchmark"}  # the benchmarks' own tests
    assert top <= whole, top - whole


def test_library_files_say_what_they_mean_not_which_issue() -> None:
    """A reference to an issue number means nothing to a reader of the repository (the tracker is not in it):
    a comment or docstring says what the thing is, or links the doc section that does."""
    cited = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in modules().values()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if re.search(r"\b[Ii]ssues? #?\d+", line)
    ]
    assert cited == []
