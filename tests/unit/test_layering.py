"""The import rules of the package layout, checked on the source (every `import` and
`from ... import`, those inside functions included) and by importing the engine with
TensorFlow made unimportable.

- Nothing outside prophet_tf/bench/ and prophet_tf/tools/ imports them: training, the
  transport and the engine do not depend on the benchmark or the command-line tools
  (the CLI names their modules as strings and imports the one asked for).
- No import cycles between modules (a package's own modules importing the package
  aside), except those in CYCLES_ALLOWED, each with why.
- No module over MAX_LINES lines, except those in OVER_BUDGET at most their listed
  size: the list may only shrink.
- Nothing under prophet_tf/engine/ imports TensorFlow, Keras, tf_keras or the worker's
  TensorFlow modules (prophet_tf._native, prophet_tf._native_library, prophet_tf.strategy,
  prophet_tf.variables):
  the simulator drives the engine's dispatch without TensorFlow.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prophet_tf"

NO_BENCH_OR_TOOLS = ("prophet_tf.bench", "prophet_tf.tools")
ENGINE_FORBIDDEN = ("tensorflow", "keras", "tf_keras", "prophet_tf._native",
                    "prophet_tf._native_library", "prophet_tf.strategy", "prophet_tf.variables")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: pathlib.Path):
    """(line, statement text, module) for every module the file may import.

    `from X import a` yields X and X.a (a may be a submodule); relative imports are
    resolved against the file's package; `importlib.import_module("X")` and
    `__import__("X")` with a literal name count too.
    """
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    lines = source.splitlines()
    for node in ast.walk(tree):
        # The statement's first line (ast.get_source_segment on every node re-splits the
        # whole source each time: seconds per large module).
        text = lines[node.lineno - 1] if hasattr(node, "lineno") else ""
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, text, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            yield node.lineno, text, base
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, text, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                   or isinstance(node.func, ast.Name) and node.func.id == "__import__")):
            yield node.lineno, text, node.args[0].value


def violations(folders, forbidden) -> list[str]:
    """'file:line: statement (imports M)' for each import of a forbidden module (or one of
    its submodules) by a .py file under the given folders (or top-level modules) of
    prophet_tf."""
    found = []
    for folder in folders:
        where = PACKAGE / folder  # a folder, or a top-level module
        for path in sorted(where.rglob("*.py") if where.is_dir() else [where]):
            seen = set()
            for line, text, module in sorted(imported_modules(path)):
                for bad in forbidden:
                    if (module == bad or module.startswith(bad + ".")) and (line, bad) not in seen:
                        seen.add((line, bad))
                        found.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()}  "
                                     f"(imports {bad})")
    return found


def test_the_scanner_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The rules below could fail: imports inside functions, relative and dynamic imports
    and `from package import submodule` are all found."""
    package = tmp_path / "prophet_tf" / "engine" / "sub"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(textwrap.dedent("""\
        import os

        def later():
            import tensorflow.compat.v1 as tf1
            from ... import _native
            from ...bench import shaping
            from prophet_tf import tools
            importlib.import_module("keras")
            return tf1
    """))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "prophet_tf")
    engine = violations(["engine"], ENGINE_FORBIDDEN)
    assert [v.split(": ", 1)[0] for v in engine] == [
        "prophet_tf/engine/sub/mod.py:4", "prophet_tf/engine/sub/mod.py:5",
        "prophet_tf/engine/sub/mod.py:8"], engine
    assert "(imports prophet_tf._native)" in engine[1], engine
    layers = violations(["engine"], NO_BENCH_OR_TOOLS)
    assert [v.split(": ", 1)[0] for v in layers] == [
        "prophet_tf/engine/sub/mod.py:6", "prophet_tf/engine/sub/mod.py:7"], layers


def _outside_bench_and_tools() -> list[str]:
    """The folders and top-level modules of the package but bench/ and tools/."""
    return sorted(p.name for p in PACKAGE.iterdir()
                  if (p.is_dir() and (p / "__init__.py").exists() or p.suffix == ".py")
                  and p.name not in ("bench", "tools"))


@pytest.mark.parametrize("folder", _outside_bench_and_tools())
def test_nothing_outside_bench_and_tools_imports_them(folder):
    found = violations([folder], NO_BENCH_OR_TOOLS)
    assert not found, f"prophet_tf/{folder} must not import bench/ or tools/:\n" + \
        "\n".join(found)


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, a package's own modules importing the
    package (always imported first) left out."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if "v1" not in p.parts}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for _, _, imported in imported_modules(path):
            while imported and imported not in modules:  # `from m import function`
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                edges.add(imported)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# Each with why it is left; a new cycle fails the test.
CYCLES_ALLOWED: set[tuple[str, ...]] = set()


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_modules():
    found = [tuple(c) for c in cycles(import_graph())]
    new = [c for c in found if c not in CYCLES_ALLOWED]
    assert not new, "import cycles (a module that imports another that imports it back):\n" \
        + "\n".join(" <-> ".join(c) for c in new)
    gone = CYCLES_ALLOWED - set(found)
    assert not gone, f"these cycles are gone: remove them from CYCLES_ALLOWED: {sorted(gone)}"


MAX_LINES = 450
# Modules over the budget, each at most its size here until split along its seams.
# The list may only shrink: lower a number when a module shrinks, remove it at 450.
OVER_BUDGET: dict[str, int] = {}


def test_every_module_keeps_to_the_line_budget():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py") if "v1" not in p.parts}
    over = {m: n for m, n in sizes.items() if n > OVER_BUDGET.get(m, MAX_LINES)}
    assert not over, (f"modules over {MAX_LINES} lines (or over their OVER_BUDGET size): "
                      f"{over}; split them along their seams")
    shrunk = {m: (limit, sizes.get(m)) for m, limit in OVER_BUDGET.items()
              if sizes.get(m, 0) < limit}
    assert not shrunk, f"lower (or remove at {MAX_LINES}) these OVER_BUDGET entries: {shrunk}"


def test_engine_does_not_import_tensorflow_keras_or_worker_modules():
    found = violations(["engine"], ENGINE_FORBIDDEN)
    assert not found, ("prophet_tf/engine/ must not import TensorFlow, Keras or the worker's "
                       "TensorFlow modules:\n" + "\n".join(found))


@pytest.mark.timeout(120)
def test_engine_imports_with_tensorflow_unimportable():
    """What the static rule means at run time, `prophet_tf/__init__.py` and every module
    the engine pulls in included."""
    modules = ["prophet_tf.engine", "prophet_tf.engine.schedulers", "prophet_tf.engine.timeline"]
    if (PACKAGE / "engine" / "dispatch.py").exists():
        modules.append("prophet_tf.engine.dispatch")
    modules += sorted(f"prophet_tf.engine.schedulers.{p.stem}"
                      for p in (PACKAGE / "engine" / "schedulers").glob("*.py")
                      if p.stem != "__init__")
    script = textwrap.dedent(f"""\
        import importlib, sys
        for name in ("tensorflow", "keras", "tf_keras"):
            sys.modules[name] = None  # `import tensorflow` now raises ImportError.
        for name in {modules!r}:
            importlib.import_module(name)
        print("imported", len({modules!r}))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=100, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"imported {len(modules)}", result.stdout
