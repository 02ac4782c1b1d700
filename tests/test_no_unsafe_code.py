"""No pickle, no eval: the source of every shipped package, read line by line and as syntax.

The only dynamic imports: the `module:app` target given on the command line (`mersal run`,
`--app` of `mersal status` and `mersal dlq`; loaded in mersal/cli/helpers.py, an exact
allow-list) and the adapters installed packages declare as entry points (mersal/plugins.py).
Nothing derived from a message can reach either.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mersal", "mersal_rabbitmq", "mersal_sqlalchemy")

# The forms searched for, as regular expressions, and the only lines allowed to match.
PATTERNS = {
    "pickle": re.compile(r"pickle", re.IGNORECASE),
    "marshal": re.compile(r"marshal", re.IGNORECASE),
    "eval(": re.compile(r"\beval\("),
    "exec(": re.compile(r"\bexec\("),
    "importlib.import_module(": re.compile(r"\bimportlib\.import_module\("),
}
ALLOWED_LINES = {
    ("mersal/cli/helpers.py", "module = importlib.import_module(module_name)"),
}

# Modules whose loading functions run code chosen by the data they load.
UNSAFE_MODULES = frozenset(
    {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "jsonpickle", "marshal", "shelve"}
)
UNSAFE_BUILTINS = frozenset({"eval", "exec", "compile", "__import__", "breakpoint"})
# (file, enclosing function, the argument as source): the only import_module calls allowed.
ALLOWED_IMPORT_MODULE = {
    ("mersal/cli/helpers.py", "find_app", "module_name"),
}
# The modules a delivery passes through before a handler: no dynamic lookup of any kind.
DECODE_PATH = (
    "mersal/messages.py",
    "mersal/pipeline.py",
    "mersal/serialization.py",
    "mersal/retry.py",
    "mersal/transport/__init__.py",
    "mersal/transport/limits.py",
    "mersal/transport/memory.py",
    "mersal_rabbitmq/transport.py",
    "mersal_rabbitmq/consuming.py",
    "mersal_rabbitmq/wire.py",
)
DYNAMIC_NAMES = frozenset({"importlib", "__import__", "pydoc", "runpy", "globals", "locals"})


def sources() -> Iterator[tuple[str, str]]:
    """(path relative to the repository, text) of every Python file in the shipped packages."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def grep(path: str, source: str) -> list[str]:
    """Lines that match one of the patterns and are not on the allow-list."""
    hits = []
    for number, line in enumerate(source.splitlines(), 1):
        for label, pattern in PATTERNS.items():
            if pattern.search(line) and (path, line.strip()) not in ALLOWED_LINES:
                hits.append(f"{path}:{number}: {label}: {line.strip()}")
    return hits


class _Scanner(ast.NodeVisitor):
    """Finds unsafe imports and calls in one module."""

    def __init__(self, path: str, decode_path: bool) -> None:
        self.path = path
        self.decode_path = decode_path
        self.functions: list[str] = []
        self.findings: list[str] = []

    def report(self, node: ast.AST, what: str) -> None:
        self.findings.append(f"{self.path}:{getattr(node, 'lineno', 0)}: {what}")

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_module(node, alias.name)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._check_module(node, node.module or "")
        if node.module == "importlib":
            self.report(node, "from importlib import ... (call importlib.import_module instead)")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in UNSAFE_MODULES:
            self.report(node, f"the string {node.value!r} (a dynamic import of it?)")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in UNSAFE_BUILTINS:
            self.report(node, f"{node.id}")
        if self.decode_path and node.id in DYNAMIC_NAMES:
            self.report(node, f"{node.id} on the decode path")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        target = ast.unparse(node)
        if target in {f"builtins.{name}" for name in UNSAFE_BUILTINS}:
            self.report(node, target)
        if self.decode_path and target == "sys.modules":
            self.report(node, "sys.modules on the decode path")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else None
        if isinstance(function, ast.Name):
            name = function.id
        if name == "import_module":
            place = (
                self.path,
                self.functions[-1] if self.functions else "",
                ", ".join(ast.unparse(argument) for argument in node.args),
            )
            if place not in ALLOWED_IMPORT_MODULE:
                self.report(node, f"import_module({place[2]}) in {place[1] or 'the module'}")
        self.generic_visit(node)

    def _check_module(self, node: ast.AST, module: str) -> None:
        if module.partition(".")[0] in UNSAFE_MODULES:
            self.report(node, f"import {module}")


def scan(path: str, source: str) -> list[str]:
    """Unsafe imports, calls and (on the decode path) dynamic lookups in one module."""
    scanner = _Scanner(path, path in DECODE_PATH)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.findings


def test_the_packages_have_python_files_to_scan() -> None:
    paths = [path for path, _ in sources()]

    assert "mersal/messages.py" in paths
    assert "mersal_rabbitmq/transport.py" in paths
    assert all(path in paths for path in DECODE_PATH)


def test_no_line_mentions_pickle_marshal_eval_exec_or_import_module_beyond_the_allow_list() -> None:
    hits = [hit for path, source in sources() for hit in grep(path, source)]

    assert hits == []


UNSAFE_SAMPLE = """
import pickle
import marshal as m
from dill import loads
from importlib import import_module
import importlib, sys

def decode(body, name):
    eval(name)
    exec(body)
    compile(body, "x", "exec")
    __import__(name)
    builtins.eval(name)
    importlib.import_module(name)
    sys.modules[name]
    return "shelve", globals()[name]
"""


def scan_report() -> dict[str, list[Any]]:
    """What the syntax tests look at, parsed in this process."""
    return {
        "findings": [finding for path, source in sources() for finding in scan(path, source)],
        "sample": scan("mersal/pipeline.py", UNSAFE_SAMPLE),
        "load_app_calls": [
            [path, ast.unparse(node)]
            for path, source in sources()
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith(("load_app", "open_app"))
        ],
    }


@functools.cache
def fresh_report() -> dict[str, list[Any]]:
    """`scan_report()` in a new interpreter.

    CPython 3.11 can be left unable to parse (`SystemError: AST constructor recursion depth
    mismatch`) by a RecursionError earlier in the process, such as the decode fuzz provokes.
    """
    result = subprocess.run(
        [sys.executable, "-m", "tests.test_no_unsafe_code"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, list[Any]] = json.loads(result.stdout)
    return report


def test_no_module_imports_or_calls_anything_that_runs_code_from_data() -> None:
    assert fresh_report()["findings"] == []


def test_the_scanners_find_every_unsafe_form() -> None:
    findings = fresh_report()["sample"]
    hits = grep("mersal/pipeline.py", UNSAFE_SAMPLE)

    for expected in (
        "import pickle",
        "import marshal",
        "import dill",
        "from importlib import",
        ": eval",
        ": exec",
        ": compile",
        ": __import__",
        "builtins.eval",
        "import_module(name) in decode",
        "sys.modules on the decode path",
        "'shelve'",
        "globals on the decode path",
        "importlib on the decode path",
    ):
        assert any(expected in finding for finding in findings), (expected, findings)
    assert [hit.split(": ")[1] for hit in hits] == [
        "pickle",
        "marshal",
        "eval(",
        "exec(",
        "eval(",
        "importlib.import_module(",
    ]


def test_the_command_line_import_takes_only_the_target_given_on_the_command_line() -> None:
    assert sorted(fresh_report()["load_app_calls"]) == [
        ["mersal/cli/dlq.py", "load_app(args.app)"],
        ["mersal/cli/run.py", "open_app(args.target)"],
        ["mersal/cli/status.py", "load_app(args.app)"],
        ["mersal_rabbitmq/migrating.py", "load_app(args.app)"],
        ["mersal_sqlalchemy/failure_commands.py", "load_app(args.app)"],
    ]


if __name__ == "__main__":
    print(json.dumps(scan_report()))
