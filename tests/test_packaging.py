"""What a fresh install brings: the demo (the README's first command) must run on the
runtime dependencies alone, not on what the test extra (or anything else here) adds."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
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
