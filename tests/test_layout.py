"""Units a reader can hold in mind: no class of the package over 450 lines, no function
over 110. A unit past them is split along a seam of its own (a collaborator, a module
function), not cut anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncslab

MAX_CLASS_LINES = 450
MAX_FUNCTION_LINES = 110


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
