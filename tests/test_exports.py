"""The public surface is exactly ``__all__``; every error has one base and a builtin."""

from __future__ import annotations

import importlib
import json
import pickle
import types

import pytest

import asyncslab
from asyncslab import _errors


def test_all_names_exist_and_nothing_public_is_missing() -> None:
    for name in asyncslab.__all__:
        assert hasattr(asyncslab, name), name
    public = {
        name
        for name, value in vars(asyncslab).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(asyncslab.__all__)
    assert len(asyncslab.__all__) == len(set(asyncslab.__all__))
    assert len(asyncslab.__all__) <= 30  # a small face; the rest is in the submodules


# asyncslab.vllm imports vLLM, which sets up process-wide state: its tests run it apart.
@pytest.mark.parametrize("module", ["errors", "rules", "testing", "distributed"])
def test_each_public_submodule_has_exactly_its_all(module: str) -> None:
    mod = importlib.import_module(f"asyncslab.{module}")
    for name in mod.__all__:
        assert hasattr(mod, name), name
    public = {n for n, v in vars(mod).items() if not n.startswith("_")}
    public -= {"annotations"}
    assert public - {n for n, v in vars(mod).items() if isinstance(v, types.ModuleType)} == set(
        mod.__all__
    )


@pytest.mark.parametrize("name", _errors.__all__)
def test_every_error_has_the_base_and_a_builtin(name: str) -> None:
    cls = getattr(_errors, name)
    assert issubclass(cls, asyncslab.AsyncSlabError)
    if cls is not asyncslab.AsyncSlabError:
        assert issubclass(cls, (ValueError, RuntimeError))
    assert getattr(asyncslab.errors, name) is cls
    # The base and the categories right under it are at the top level too.
    direct = cls.__mro__[1] is asyncslab.AsyncSlabError or cls is asyncslab.AsyncSlabError
    assert (getattr(asyncslab, name, None) is cls) == direct


def test_import_asyncslab_loads_the_loader_not_the_writers() -> None:
    """The synthetic writer (and safetensors' torch saver it brings), the command line and
    the benchmark stay out of a server's ``import asyncslab``."""
    import subprocess
    import sys

    code = (
        "import json, sys, asyncslab; "
        "print(json.dumps([m for m in sys.modules if m.startswith(('asyncslab', 'safetensors'))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    for module in (
        "asyncslab.testing._synthetic",
        "asyncslab.cli._main",
        "asyncslab.cli._bench",
        "safetensors.torch",
    ):
        assert module not in loaded, loaded


def test_errors_keep_their_pieces_and_pickle() -> None:
    err = asyncslab.errors.DtypeMismatchError(
        "dtype I32, plan expects I16",
        file="model-00003.safetensors",
        tensor="model.layers.4.mlp.experts.17.up_proj.trellis",
        expected="I16",
        got="I32",
        expert=17,
    )
    assert str(err) == (
        "model-00003.safetensors: tensor 'model.layers.4.mlp.experts.17.up_proj.trellis': "
        "dtype I32, plan expects I16"
    )
    assert err.details == {"expected": "I16", "got": "I32", "expert": 17}
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is type(err)
    assert str(clone) == str(err)
    assert clone.details == err.details
    assert isinstance(err, ValueError)


def test_the_modules_import_each_other_without_a_cycle() -> None:
    """Every ``from .module import`` of the package, lazy ones (inside functions) included:
    the stages form a graph without a cycle, so each reads without the ones after it."""
    import ast
    from pathlib import Path

    root = Path(asyncslab.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[:-1]  # a module's package, relative to asyncslab's
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts) or "__init__"
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 1 and node.module:
                base = package[: len(package) - (node.level - 1)]
                imported.add(".".join([*base, node.module]))
        graph[name] = imported
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == 2:
            return
        assert state.get(module) != 1, " -> ".join([*path, module])
        state[module] = 1
        for other in sorted(graph.get(module, ())):
            visit(other, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        visit(module, [])
    # The plan vocabulary is the leaf every stage shares.
    assert "planning._vocabulary" in graph
    assert graph["planning._vocabulary"] <= {"_errors", "checkpoint._format"}


def test_no_module_reaches_into_another_modules_privates() -> None:
    """``obj._name`` only for a ``_name`` its own module defines (a class's private used by
    a function beside it): the stages talk through what each module exports. Outside the
    package, only the interpreter's and torch's documented underscore names."""
    import ast
    from pathlib import Path

    # Other libraries' underscore names asyncslab has to use, each for a reason: torch's
    # module registries (binding parameters without a copy), ATen op names (_to_copy and
    # _local_scalar_dense are what .to() and .item() dispatch as), argparse's subparser
    # type, vLLM's list of the files a model loads (so that its format reads those), torch's
    # count of a storage's users (whether a consumer still holds a window's memory).
    allowed_foreign = {
        "_exit", "_getframe", "_replace", "_asdict", "_fields", "_make",
        "_parameters", "_buffers", "_to_copy", "_local_scalar_dense", "_SubParsersAction",
        "_prepare_weights", "_storage_Use_Count", "_cdata",
    }  # fmt: skip
    root = Path(asyncslab.__file__).parent
    reaching: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 1 and node.module:
                # A private module of another stage's package is imported as a module; a
                # private name inside a module is that module's own.
                package = path.parent.joinpath(*[".."] * (node.level - 1), *node.module.split("."))
                reaching += [
                    f"{path.name}:{node.lineno}: import {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                    and not alias.name.startswith("__")
                    and not (package / f"{alias.name}.py").resolve().is_file()
                ]
        own: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, (ast.Name,)) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.ClassDef):
                own.add(node.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        own.add(item.target.id)
                    if isinstance(item, ast.Assign):
                        own.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in own:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("torch", "sys", "os", "self", "cls"):
                continue
            if name in allowed_foreign:
                continue
            reaching.append(f"{path.name}:{node.lineno}: .{name}")
    assert reaching == [], "\n".join(reaching)
