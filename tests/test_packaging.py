"""What a fresh install brings: the demo (the README's first command) must run on the
runtime dependencies alone, not on what the test extra (or anything else here) adds; the
wheel built from the tree holds every module and data file of the package, and its commands
run from it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as _name

# Runs the demo with every module of a distribution outside the runtime dependencies made
# unimportable, as on a machine that installed only those (optional imports, like torch's
# of tqdm, then fall back as they would there).
_PROBE = """
import importlib.abc, json, sys
blocked = set(json.loads(sys.argv[2]))

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
from asyncslab.cli._main import main
sys.exit(main(["demo", "--size", "2MiB", "--no-progress", "--dir", sys.argv[1]]))
"""


def _runtime_closure(dist: str) -> set[str]:
    """``dist`` and every distribution its requirements (no extras) pull in, installed."""
    seen: set[str] = set()
    todo = [dist]
    while todo:
        name = _name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


@pytest.mark.timeout(120)
def test_the_demo_runs_on_the_runtime_dependencies_alone(tmp_path: Path) -> None:
    # safetensors 0.8 saves torch tensors through numpy, which only the test extra listed:
    # the README's demo command failed on a fresh machine with "No module named 'numpy'".
    runtime = _runtime_closure("asyncslab")
    blocked = sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not {_name(d) for d in dists} & runtime and module.isidentifier()
    )
    assert "pytest" in blocked  # the probe does block what the test extra brings
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "demo"), json.dumps(blocked)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK: all" in out.stdout


# --------------------------------------------------------------------------- the wheel

REPO = Path(__file__).resolve().parents[1]


def _tree_files() -> set[str]:
    """Every file of the package in the tree (``asyncslab/...``), modules and data alike."""
    package = REPO / "asyncslab"
    return {
        path.relative_to(REPO).as_posix()
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def _build_wheel(root: Path) -> Path:
    """The wheel of a copy of the tree (the top-level files and the package), built with
    the setuptools already installed: no download, and no stale ``build/`` of the tree (whose
    leftovers setuptools would put in the wheel) is read or written."""
    src, out = root / "src", root / "dist"
    src.mkdir(parents=True)
    for path in REPO.iterdir():
        if path.is_file():
            shutil.copy2(path, src / path.name)
    shutil.copytree(
        REPO / "asyncslab", src / "asyncslab", ignore=shutil.ignore_patterns("__pycache__")
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), "-q",
         str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = out.glob("asyncslab-*.whl")
    return wheel


def _fresh_venv(root: Path) -> Path:
    """A virtual environment of its own, without asyncslab; the runtime dependencies come
    from this interpreter's site-packages, named in a ``.pth`` file (a path, not a site
    directory: the editable install's hook there is not run, its own site-packages comes
    first)."""
    venv.create(root, with_pip=False, symlinks=os.name != "nt")
    python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")} | set(site.getsitepackages())
    (Path(purelib) / "zz_test_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_holds_the_whole_package_and_its_commands_run(tmp_path: Path) -> None:
    # `packages = ["asyncslab"]` left asyncslab/_bench/ out of the wheel: installed from it
    # (not editable, as the README's commands install), `asyncslab bench` was unavailable.
    wheel = _build_wheel(tmp_path / "build")
    with zipfile.ZipFile(wheel) as z:
        shipped = {name for name in z.namelist() if name.startswith("asyncslab/")}
    tree = _tree_files()
    assert "asyncslab/py.typed" in tree
    assert {"asyncslab/cli/_bench/runner.py", "asyncslab/cli/_bench/worker.py"} <= tree
    assert sorted(tree - shipped) == []
    assert sorted(shipped - tree) == []

    python = _fresh_venv(tmp_path / "venv")
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python),
         "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    work = tmp_path / "cwd"  # not the repository: nothing of the tree is on the path
    work.mkdir()

    def run(*argv: str) -> str:
        out = subprocess.run(
            argv, cwd=work, env=env, capture_output=True, text=True, check=False, timeout=240
        )
        assert out.returncode == 0, (argv, out.stdout[-2000:], out.stderr[-3000:])
        return out.stdout

    where = run(str(python), "-c", "import asyncslab; print(asyncslab.__file__)")
    site_packages = Path(
        run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    )
    assert Path(where.strip()).parent == site_packages / "asyncslab"  # the wheel's, not the tree's
    command = str(python.parent / "asyncslab")
    assert "OK: all" in run(command, "demo", "--size", "2MiB", "--no-progress")
    assert "--many-small" in run(command, "bench", "--help")
    # The benchmark's workers are processes of their own: each imports the installed package.
    table = run(
        command, "bench", "--size", "2MiB", "--runs", "1", "--mode", "warm-fresh",
        "--contenders", "asyncslab,bound-N", "--verify", "2", "--settle", "0",
        "--dir", str(work / "bench"),
    )  # fmt: skip
    assert re.search(r"^asyncslab\s+\d+\.\d+", table, re.M), table
