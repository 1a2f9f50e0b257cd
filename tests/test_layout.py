"""Units a reader can hold in mind: no module of the package over 800 lines, no class over
400, no function over 80. A unit past them is split along a seam of its own (a module per
concern, a collaborator, a module function per phase), not cut anywhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import asyncslab

MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


def _oversized(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                where = path.relative_to(root.parent)
                found.append(f"{where}:{node.lineno}:{node.name}:{lines} lines (at most {limit})")
    return found


def _oversized_modules(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            where = path.relative_to(root.parent)
            found.append(f"{where}:{lines} lines (at most {MAX_MODULE_LINES})")
    return found


def test_no_module_of_the_package_is_over_its_size() -> None:
    oversized = _oversized_modules(Path(asyncslab.__file__).parent)
    assert oversized == [], "\n".join(oversized)


def test_the_scan_sees_an_oversized_module(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "small.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (package / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _oversized_modules(package) == [
        f"pkg/big.py:{MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"
    ]


def test_no_class_or_function_of_the_package_is_over_its_size() -> None:
    oversized = _oversized(Path(asyncslab.__file__).parent)
    assert oversized == [], "\n".join(oversized)


def test_the_scan_sees_an_oversized_unit(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (package / "mod.py").write_text(f"def small():\n    pass\n\n\ndef big():\n{body}\n")
    assert _oversized(package) == [
        f"pkg/mod.py:5:big:{MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})"
    ]


# --- stage order and internal APIs -------------------------------------------------------

ROOT = Path(asyncslab.__file__).parent
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"

# The faces: above every stage.
FACES = {"__init__", "__main__", "rules", "vllm", "transformers"}
# Imports of a stage's private module from outside it, each for a reason docs/architecture.md
# gives: the engines' glue imports vLLM or transformers, so only its face (and the command
# line's --transformers) imports it; testing's __init__ is a public face with an exact
# __all__, so the command line takes the demo's helpers from its modules.
DIRECT = {
    ("vllm", "engines._vllm"),
    ("transformers", "engines._transformers"),
    ("cli", "engines._transformers"),
    ("cli", "testing._synthetic"),
    ("cli", "testing._verify"),
}


def drawn_stage_order(architecture: str) -> list[str]:
    """The stages in the order docs/architecture.md's tree draws them (``  name/  ...``)."""
    block = architecture.split("```\nasyncslab/\n", 1)[1].split("```", 1)[0]
    return re.findall(r"^  (\w+)/", block, flags=re.MULTILINE)


def drawn_foundation(architecture: str) -> set[str]:
    """The modules (``name.py``) and packages (``name/``) docs/architecture.md's tree draws
    on its line "under every stage": what any stage may import."""
    block = architecture.split("```\nasyncslab/\n", 1)[1].split("```", 1)[0]
    (line,) = [line for line in block.splitlines() if line.endswith("under every stage")]
    return set(re.findall(r"(\w+)(?:\.py|/)", line))


def _imports(root: Path) -> list[tuple[str, int, str, str, list[str]]]:
    """``(file, line, importing unit, imported module as dotted parts, names)`` for every
    import of the package by the package, relative or absolute, lazy ones included. A unit
    is a stage folder or a top-level module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        package = list(rel[:-1])
        unit = package[0] if package else rel[-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level >= 1:
                    base = package[: len(package) - (node.level - 1)]
                    target = [*base, *(node.module.split(".") if node.module else [])]
                elif node.module and node.module.split(".")[0] == root.name:
                    target = node.module.split(".")[1:]
                else:
                    continue
                names = [alias.name for alias in node.names]
                if not target:  # from . import x: x is a unit
                    found += [(str(rel), node.lineno, unit, [name], []) for name in names]
                else:
                    found.append((str(path.relative_to(root)), node.lineno, unit, target, names))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == root.name and len(parts) > 1:
                        found.append(
                            (str(path.relative_to(root)), node.lineno, unit, parts[1:], [])
                        )
    return found


def _later_stage_imports(root: Path, order: list[str], foundation: set[str]) -> list[str]:
    rank = {name: i + 1 for i, name in enumerate(order)}
    rank.update({name: 0 for name in foundation})
    rank.update({name: len(order) + 1 for name in FACES})
    wrong = []
    for where, line, unit, target, _ in _imports(root):
        imported = target[0]
        if imported == unit:
            continue
        assert unit in rank, (
            f"{where}: {unit!r} is neither a stage drawn in docs/architecture.md nor a known module"
        )
        assert imported in rank, (
            f"{where}:{line}: imports {imported!r}, which docs/architecture.md does not draw"
        )
        if rank[imported] > rank[unit]:
            wrong.append(f"{where}:{line}: {unit} imports {'.'.join(target)}, a later stage")
    return wrong


def _private_module_imports(root: Path) -> list[str]:
    wrong = []
    for where, line, unit, target, _ in _imports(root):
        if target[0] == unit or len(target) < 2 or not target[1].startswith("_"):
            continue
        if not (root / target[0]).is_dir():
            continue  # a top-level module has no stage __init__ to go through
        if (unit, ".".join(target[:2])) in DIRECT:
            continue
        wrong.append(f"{where}:{line}: imports {'.'.join(target)}; import it from {target[0]}")
    return wrong


def test_no_stage_imports_a_later_one() -> None:
    architecture = ARCHITECTURE.read_text()
    order, foundation = drawn_stage_order(architecture), drawn_foundation(architecture)
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(order) == sorted(packages - foundation), (
        "docs/architecture.md draws every stage, once"
    )
    modules = {p.stem for p in ROOT.glob("*.py")} | packages
    assert foundation <= modules, f"drawn under every stage but missing: {foundation - modules}"
    wrong = _later_stage_imports(ROOT, order, foundation)
    assert wrong == [], "\n".join(wrong)


def test_other_stages_import_a_stage_through_its_init() -> None:
    wrong = _private_module_imports(ROOT)
    assert wrong == [], "\n".join(wrong)


def test_the_import_checks_see_a_later_stage_and_a_private_module(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for stage in ("early", "late"):
        (package / stage).mkdir(parents=True)
        (package / stage / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "late" / "_inner.py").write_text("X = 1\n")
    (package / "early" / "_mod.py").write_text(
        "def f():\n    from ..late import X\n"
        "    from pkg.late._inner import X as Y\n    return X, Y\n"
    )
    assert _later_stage_imports(package, ["early", "late"], set()) == [
        "early/_mod.py:2: early imports late, a later stage",
        "early/_mod.py:3: early imports late._inner, a later stage",
    ]
    assert _private_module_imports(package) == [
        "early/_mod.py:3: imports late._inner; import it from late"
    ]
    drawn = "x\n```\nasyncslab/\n  a.py _b/   under every stage\n  early/  x\n  late/   y\n```\n"
    assert drawn_stage_order(drawn) == ["early", "late"]
    assert drawn_foundation(drawn) == {"a", "_b"}


# --- the tests and the benchmarks apart ----------------------------------------------------

REPO = ROOT.parent
#: What the benchmarks and the tests share lives in support/, which both import; the
#: benchmarks never import the tests. None of them edits sys.path: pytest's ``pythonpath``
#: option and ``python -m benchmarks.x`` from the repository root make both importable.
APART = ("benchmarks", "support", "tests")


def _is_test_code(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "tests" or any(part.startswith("test_") for part in parts)


def _test_imports_and_path_edits(repo: Path) -> list[str]:
    """Imports of the tests (``tests...`` or any ``test_*`` module) by the benchmarks or the
    support package, and every use of ``sys.path`` under the three folders."""
    wrong: list[tuple[Path, int, str]] = []
    for folder in APART:
        for path in sorted((repo / folder).rglob("*.py")):
            where = path.relative_to(repo)
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Attribute) and node.attr == "path":
                    if isinstance(node.value, ast.Name) and node.value.id == "sys":
                        wrong.append((where, node.lineno, "uses sys.path"))
                if folder == "tests":
                    continue
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules = [node.module] if _is_test_code(node.module) else []
                    modules += [f"{node.module}.{a.name}" for a in node.names if not modules]
                elif isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                else:
                    continue
                wrong += [
                    (where, node.lineno, f"imports {m}, test code")
                    for m in modules
                    if _is_test_code(m)
                ]
    return [f"{where}:{line}: {what}" for where, line, what in sorted(wrong)]


def test_benchmarks_import_no_test_code_and_nothing_edits_sys_path() -> None:
    wrong = _test_imports_and_path_edits(REPO)
    assert wrong == [], "\n".join(wrong)


def test_the_apart_scan_sees_a_test_import_and_a_path_edit(tmp_path: Path) -> None:
    for folder in APART:
        (tmp_path / folder).mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text(
        "import sys\nsys.path.insert(0, '.')\nfrom tests import helpers\n"
        "from support import test_x\nimport tests.loading.test_faults\nfrom support import ok\n"
    )
    (tmp_path / "tests" / "t.py").write_text("import sys\nfrom tests import helpers\nsys.path\n")
    assert _test_imports_and_path_edits(tmp_path) == [
        "benchmarks/b.py:2: uses sys.path",
        "benchmarks/b.py:3: imports tests, test code",
        "benchmarks/b.py:4: imports support.test_x, test code",
        "benchmarks/b.py:5: imports tests.loading.test_faults, test code",
        "tests/t.py:3: uses sys.path",
    ]
