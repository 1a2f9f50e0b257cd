"""``examples/transformers_generate.py`` runs as its README row says: a tiny Qwen3-MoE loaded
by asyncslab generates the same tokens as transformers' ``from_pretrained``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a subprocess importing transformers twice


def test_transformers_generate_matches_from_pretrained() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "transformers_generate.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "Qwen3MoeForCausalLM" in run.stdout
    assert "identical parameters and tokens" in run.stdout
