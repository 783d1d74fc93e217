"""Every PROPHET_TF_* variable is declared once (prophet_tf/environment.py), read by the
module it names, and listed in the user guide's table: no name typed twice, no variable
the docs miss (the guide's table is rendered from the declarations:
test_report.py checks it is up to date)."""
import ast
import fnmatch
import pathlib
import re

from prophet_tf import environment

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prophet_tf"
NAME = re.compile(r"PROPHET_TF_[A-Z_]+\*?")


def _constants() -> dict[str, str]:
    """{variable name: the constant in prophet_tf.environment that holds it}."""
    return {value: key for key, value in vars(environment).items()
            if key.isupper() and isinstance(value, str) and value.startswith("PROPHET_TF_")}


def test_every_name_is_declared_once_and_typed_nowhere_else():
    typed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "v1" in path.parts or path.name == "environment.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"PROPHET_TF_[A-Z_]+", node.value):
                typed.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not typed, "use prophet_tf.environment's names:\n" + "\n".join(typed)
    assert set(_constants()) == set(environment.VARIABLES)


def test_each_variable_is_read_by_the_module_it_names():
    for name, v in environment.VARIABLES.items():
        source = (ROOT / (v.module.replace(".", "/") + ".py")).read_text()
        assert f"environment.{_constants()[name]}" in source, (name, v.module)
        assert v.read_by and v.meaning


def test_the_guides_table_lists_exactly_the_declared_variables():
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert "<!-- table: environment prophet_tf.environment -->" in guide
    section = guide.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = set()
    for row in rows:
        for pattern in NAME.findall(row.split("|")[1]):
            matched = fnmatch.filter(environment.VARIABLES, pattern)
            assert matched, f"the guide lists {pattern}, which is not declared"
            listed.update(matched)
    assert listed == set(environment.VARIABLES), \
        f"missing from the guide: {sorted(set(environment.VARIABLES) - listed)}"
