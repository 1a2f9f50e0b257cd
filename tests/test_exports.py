"""The public surface is exactly ``__all__``; every error has one base and a builtin."""

from __future__ import annotations

import importlib
import json
import pickle
import re
import traceback
import types
from pathlib import Path

import pytest

import asyncslab
import asyncslab.distributed
import asyncslab.errors
import asyncslab.rules
import asyncslab.testing
import asyncslab.transformers

ROOT = Path(__file__).resolve().parent.parent


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
@pytest.mark.parametrize("module", ["errors", "rules", "testing", "distributed", "transformers"])
def test_each_public_submodule_has_exactly_its_all(module: str) -> None:
    mod = importlib.import_module(f"asyncslab.{module}")
    for name in mod.__all__:
        assert hasattr(mod, name), name
    public = {n for n, v in vars(mod).items() if not n.startswith("_")}
    public -= {"annotations"}
    assert public - {n for n, v in vars(mod).items() if isinstance(v, types.ModuleType)} == set(
        mod.__all__
    )


@pytest.mark.parametrize("name", asyncslab.errors.__all__)
def test_every_error_has_the_base_and_a_builtin(name: str) -> None:
    cls = getattr(asyncslab.errors, name)
    assert issubclass(cls, asyncslab.AsyncSlabError)
    if cls is not asyncslab.AsyncSlabError:
        assert issubclass(cls, (ValueError, RuntimeError))
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


# asyncslab.vllm imports vLLM: test_vllm_names_show_asyncslab_vllm checks it apart.
PUBLIC = [
    asyncslab,
    asyncslab.errors,
    asyncslab.rules,
    asyncslab.testing,
    asyncslab.distributed,
    asyncslab.transformers,
]


def _home(module: types.ModuleType, name: str, obj: object) -> str:
    """Where a public name shows: an error in ``asyncslab.errors`` (which defines it), a name
    the top level exports at the top level, any other in the public module exporting it."""
    if isinstance(obj, type) and issubclass(obj, asyncslab.AsyncSlabError):
        return "asyncslab.errors"
    if getattr(asyncslab, name, None) is obj:
        return "asyncslab"
    return module.__name__


@pytest.mark.parametrize("module", PUBLIC, ids=lambda m: m.__name__)
def test_public_names_show_their_public_module_and_pickle_from_it(
    module: types.ModuleType,
) -> None:
    """As httpx's are: reprs and tracebacks read ``asyncslab.Plan``, not the private module
    that defines it, and pickle (by ``__module__`` and ``__qualname__``) finds them there."""
    checked = 0
    for name in module.__all__:
        obj = getattr(module, name)
        if not isinstance(obj, (type, types.FunctionType)):
            continue  # constants and type aliases carry no module
        assert obj.__module__ == _home(module, name, obj), name
        assert pickle.loads(pickle.dumps(obj)) is obj, name
        checked += 1
    assert checked


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_names_show_asyncslab_vllm() -> None:
    """In a process of its own: importing vLLM sets up process-wide state."""
    import subprocess
    import sys

    code = (
        "import pickle, types, asyncslab.vllm as m\n"
        "for n in m.__all__:\n"
        "    o = getattr(m, n)\n"
        "    if isinstance(o, (type, types.FunctionType)):\n"
        "        assert o.__module__ == 'asyncslab.vllm', (n, o.__module__)\n"
        "        assert pickle.loads(pickle.dumps(o)) is o, n\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=540)


def test_public_instances_pickle_across_processes() -> None:
    """What the ranks of a distributed load send each other (headers) and what a caller
    may hand another process (plans, options) still unpickles, whatever module it shows."""
    import torch

    from asyncslab.testing import SyntheticSpec

    for obj in (
        asyncslab.TensorInfo("w", Path("a.safetensors"), torch.float16, "F16", (2, 3), 88, 12),
        asyncslab.LoadOptions(),
        SyntheticSpec(),
    ):
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_errors_read_as_asyncslab_errors_in_reprs_and_tracebacks() -> None:
    err = asyncslab.errors.CudaError(
        "cudaHostRegister(read-only) failed: operation not supported (CUDA error 801)",
        call="cudaHostRegister(read-only)",
        code=801,
    )
    assert repr(type(err)) == "<class 'asyncslab.errors.CudaError'>"
    assert traceback.format_exception_only(err)[-1].startswith(
        "asyncslab.errors.CudaError: cudaHostRegister(read-only) failed"
    )
    try:
        raise asyncslab.PlanError("no rule claims it", tensor="lm_head.weight")
    except asyncslab.PlanError:
        text = traceback.format_exc()
    assert text.rstrip().endswith(
        "asyncslab.errors.PlanError: tensor 'lm_head.weight': no rule claims it"
    )
    assert isinstance(err, asyncslab.LoadError)
    assert isinstance(err, RuntimeError)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is asyncslab.errors.CudaError
    assert clone.details == {"call": "cudaHostRegister(read-only)", "code": 801}


def _all_errors() -> set[type[asyncslab.AsyncSlabError]]:
    found: set[type[asyncslab.AsyncSlabError]] = set()
    todo: list[type[asyncslab.AsyncSlabError]] = [asyncslab.AsyncSlabError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("asyncslab"):
            found.add(cls)
            todo += cls.__subclasses__()
    return found


def test_every_error_is_defined_in_asyncslab_errors() -> None:
    """One module defines the whole tree; the others (``asyncslab``, ``asyncslab.distributed``)
    re-export from it."""
    assert {cls.__name__ for cls in _all_errors()} == set(asyncslab.errors.__all__)
    for cls in _all_errors():
        assert cls.__module__ == "asyncslab.errors", cls


def _drawn_tree() -> str:
    """The tree drawn in ``asyncslab.errors``' docstring, unindented."""
    doc = asyncslab.errors.__doc__ or ""
    lines = doc.splitlines()
    start = lines.index("    AsyncSlabError")
    end = start + 1
    while end < len(lines) and lines[end].startswith("    ") and lines[end].strip():
        end += 1
    return "\n".join(line[4:] for line in lines[start:end]) + "\n"


def _parse_tree(tree: str) -> dict[str, tuple[str | None, str | None]]:
    """``{name: (parent, builtin)}``: a name's parent is the last single name drawn one
    level up; ``(ValueError)`` after a name is a builtin it also derives from."""
    drawn: dict[str, tuple[str | None, str | None]] = {}
    last_at: dict[int, str] = {}
    for line in tree.splitlines():
        column = re.search(r"[A-Za-z]", line)
        assert column is not None, line
        depth = column.start() // 4
        text = line[column.start() :].split(":")[0]
        names = [n.strip() for n in text.split(",") if n.strip()]
        for entry in names:
            m = re.fullmatch(r"(\w+)(?: \((\w+)\))?", entry)
            assert m is not None, line
            parent = last_at.get(depth - 1) if depth else None
            drawn[m[1]] = (parent, m[2])
        if len(names) == 1:
            last_at[depth] = names[0].split(" ")[0]
    return drawn


def test_the_drawn_error_tree_is_the_classes() -> None:
    drawn = _parse_tree(_drawn_tree())
    assert set(drawn) == set(asyncslab.errors.__all__)
    for name, (parent, builtin) in drawn.items():
        cls = getattr(asyncslab.errors, name)
        base = cls.__mro__[1]
        assert parent == (None if cls is asyncslab.AsyncSlabError else base.__name__), name
        if builtin is not None:
            assert builtin in {b.__name__ for b in cls.__bases__}, name
        elif cls is not asyncslab.AsyncSlabError and base is asyncslab.AsyncSlabError:
            pytest.fail(f"{name}: the tree names no builtin for a direct subclass of the base")


def test_docs_errors_md_shows_the_tree_asyncslab_errors_draws() -> None:
    """The tree is written once, in ``asyncslab/errors.py``; ``docs/errors.md`` carries a
    copy for readers of the docs. When this fails, paste the tree printed below."""
    text = (ROOT / "docs" / "errors.md").read_text()
    m = re.search(r"```text\n(AsyncSlabError\n.*?)```", text, re.S)
    assert m is not None, "docs/errors.md has no ```text block drawing the tree"
    assert m[1] == _drawn_tree(), "docs/errors.md is stale; its tree should read:\n" + _drawn_tree()


def test_docs_name_each_errors_base_as_the_classes_do() -> None:
    """Tables that say an error's base (``ReadTimeoutError`` (``ReadError``)) say it rightly."""
    pairs = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"`(\w+Error)` \(`(\w+Error)`\)", path.read_text()):
            pairs.append((path.name, m[1], m[2]))
    wrong = [
        (doc, name, base)
        for doc, name, base in pairs
        if getattr(asyncslab.errors, name).__mro__[1] is not getattr(asyncslab.errors, base)
    ]
    assert wrong == []


def test_no_bare_runtime_error_or_exception_is_raised() -> None:
    """What breaks is an asyncslab error (a failed CUDA call a ``CudaError`` naming the call);
    argument errors stay ``TypeError``/``ValueError``, and an ``OSError`` is wrapped where it
    leaves a load."""
    import ast

    # A bench worker runs in a process of its own; its parent reports the error in the table.
    allowed = {"cli/_bench/worker.py"}
    root = Path(asyncslab.__file__).parent
    raised = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in ("RuntimeError", "Exception"):
                    if where not in allowed:
                        raised.append(f"{where}:{node.lineno}: raise {exc.id}")
    assert raised == []


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
    assert graph["planning._vocabulary"] <= {"errors", "checkpoint"}


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
    # count of a storage's users (whether a consumer still holds a window's memory),
    # transformers' own from_pretrained steps (the keep-in-float32 plan, the finishing).
    allowed_foreign = {
        "_exit", "_getframe", "_replace", "_asdict", "_fields", "_make",
        "_parameters", "_buffers", "_to_copy", "_local_scalar_dense", "_SubParsersAction",
        "_prepare_weights", "_storage_Use_Count", "_cdata",
        "_get_dtype_plan", "_finalize_model_loading",
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
