"""The public surface is exactly ``__all__``; every error has one base and a builtin."""

from __future__ import annotations

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


@pytest.mark.parametrize("name", _errors.__all__)
def test_every_error_has_the_base_and_a_builtin(name: str) -> None:
    cls = getattr(_errors, name)
    assert issubclass(cls, asyncslab.AsyncSlabError)
    if cls is not asyncslab.AsyncSlabError:
        assert issubclass(cls, (ValueError, RuntimeError))
    assert getattr(asyncslab, name) is cls


def test_errors_keep_their_pieces_and_pickle() -> None:
    err = asyncslab.DtypeMismatchError(
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
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        }
    graph.pop("__init__")  # the face imports everything; nothing imports it
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
    assert "_vocab" in graph and graph["_vocab"] <= {"_errors", "_format"}  # a leaf
