"""``benchmarks/tree_ab.py``: two trees' workers each import their own tree's asyncslab, and
both answer every step of every pair."""

from __future__ import annotations

import shutil
from pathlib import Path

from asyncslab.testing import SyntheticSpec, write_synthetic
from benchmarks import tree_ab

ROOT = Path(__file__).resolve().parent.parent


def test_each_side_imports_its_own_tree_and_times_every_step(tmp_path: Path) -> None:
    base = tmp_path / "base"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "asyncslab", base / "asyncslab", ignore=skip)
    checkpoint = write_synthetic(tmp_path / "ckpt", SyntheticSpec()).root

    imported, times = tree_ab.compare(base, ROOT, checkpoint, pairs=3)

    assert imported == {
        "base": str(base / "asyncslab" / "__init__.py"),
        "new": str(ROOT / "asyncslab" / "__init__.py"),
    }
    for side in times.values():
        for step in tree_ab.STEPS:
            assert len(side[step]) == 3
            assert all(wall > 0 and cpu >= 0 for wall, cpu in side[step])
    lines = tree_ab.report(times)
    assert [line.split(":")[0] for line in lines] == [
        "open wall",
        "open cpu",
        "plan wall",
        "plan cpu",
    ]
