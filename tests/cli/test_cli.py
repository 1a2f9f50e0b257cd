"""The ``asyncslab`` command line: demo, inspect, load, bench, errors, progress output.

Commands run in-process through ``main([...])`` (fast, capturable); one smoke test runs
``python -m asyncslab demo`` as a real subprocess.
"""

from __future__ import annotations

import asyncio
import asyncio.runners
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncslab
from asyncslab._units import format_bytes, format_duration, parse_size
from asyncslab.cli import _common as _cli_common
from asyncslab.cli import _load as _cli_load
from asyncslab.cli import _main as _cli
from asyncslab.cli._main import main
from asyncslab.cli._progress import ProgressBar
from asyncslab.cli._tables import format_table
from asyncslab.rules import Route
from asyncslab.testing import SyntheticCheckpoint, SyntheticSpec, _verify, write_synthetic

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    """A small three-shard tiered MoE checkpoint; tests must not modify it."""
    return write_synthetic(tmp_path_factory.mktemp("cli-ckpt"), SyntheticSpec(n_layers=5))


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Temporary directories of the command (the demo's) go under this test's tmp_path."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def expected_tiers(ckpt: SyntheticCheckpoint) -> dict[int, dict[str, int]]:
    return {
        layer: dict(Counter(f"K{bits}" for bits in experts.values()))
        for layer, experts in ckpt.tier_map.items()
    }


def parse_tier_table(text: str) -> dict[int, dict[str, int]]:
    """Rows of the ``layer K3 K4 ... experts expert bytes`` table printed by the CLI."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["layer"])
    header = lines[start].split()
    groups = header[1 : header.index("experts")]
    assert lines[start + 1].strip().startswith("---")
    tiers: dict[int, dict[str, int]] = {}
    for line in lines[start + 2 :]:
        cells = line.split()
        if not cells or cells[0] == "all":
            break
        counts = [int(c) for c in cells[1 : 1 + len(groups)]]
        tiers[int(cells[0])] = {g: c for g, c in zip(groups, counts, strict=True) if c}
        assert int(cells[1 + len(groups)]) == sum(counts)
    return tiers


def copy_checkpoint(checkpoint: SyntheticCheckpoint, target: Path) -> Path:
    """A copy of ``checkpoint``'s shards and index in ``target``, for a test to damage."""
    target.mkdir()
    for path in [*checkpoint.files, checkpoint.index]:
        assert path is not None
        (target / path.name).write_bytes(path.read_bytes())
    return target


def assert_one_error_line(err: str, *fragments: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("asyncslab: error:"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], err
    return lines[0]


# --------------------------------------------------------------------------- demo


def test_demo_small_prints_tiers_result_and_verifies(
    capsys: pytest.CaptureFixture[str], private_tmp: Path
) -> None:
    assert main(["demo", "--size", "2MiB"]) == 0
    out, err = capsys.readouterr()
    tiers = parse_tier_table(out)
    assert tiers
    assert all(set(counts) <= {"K3", "K4"} for counts in tiers.values())
    assert "expert bytes" in out
    assert "result:" in out
    for row in ("files", "tensors", "bytes", "seconds", "GB/s", "peak RSS", "read/needed"):
        assert f"\n  {row} " in out, row
    # The verdict once, as the last line (it was a row of the table too).
    verdicts = [line for line in out.splitlines() if "OK: all" in line]
    assert verdicts == [out.rstrip().splitlines()[-1]]
    assert re.fullmatch(
        r"OK: all \d+ routed tensors match safetensors byte for byte \(verified in [\d.]+s\)",
        verdicts[0],
    )
    # Not a terminal: the progress bar prints its final line only (the load is fast).
    assert err.count("\n") == 1
    assert err.startswith("complete")
    assert "100.0%" in err
    # The temporary checkpoint is gone.
    assert list(private_tmp.iterdir()) == []


def test_demo_dir_keeps_checkpoint_and_can_rerun(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "demo"
    for _ in range(2):
        assert main(["demo", "--size", "2MiB", "--dir", str(target), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert f"kept {target}" in out
    assert (target / "tier_map.json").is_file()
    assert asyncslab.Checkpoint.open(target).total_bytes > 0


@pytest.mark.parametrize(
    ("size", "note"),
    [("1KiB", " (--size 1.0 KiB is below the smallest the demo writes)"), ("3MiB", "")],
)
def test_demo_announces_the_size_it_writes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, size: str, note: str
) -> None:
    # `--size 1KiB` announced "~1.0 KiB" and wrote 2.2 MiB (the smallest model there is).
    target = tmp_path / "demo"
    assert main(["demo", "--size", size, "--dir", str(target), "--no-progress"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    written = format_bytes(asyncslab.Checkpoint.open(target).total_bytes)
    assert first == (
        f"asyncslab demo: a synthetic EXL3-like mixed-tier MoE checkpoint of {written}{note}"
    )


def test_demo_kept_suggests_a_load_that_checks_the_tier_map_too(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The suggestion was `asyncslab load DIR --verify`: the demo's tier map check was lost.
    target = tmp_path / "a demo"  # a space: the suggestion must survive a copy and paste
    assert main(["demo", "--size", "2MiB", "--dir", str(target), "--no-progress"]) == 0
    out = capsys.readouterr().out
    quoted = shlex.quote(str(target))
    tier_map = shlex.quote(str(target / "tier_map.json"))
    suggested = f"asyncslab load {quoted} --verify --tier-map {tier_map}"
    assert f"kept {target}; load it again with: {suggested}" in out.splitlines()
    argv = shlex.split(suggested)
    assert argv[0] == "asyncslab"
    assert main([*argv[1:], "--no-progress"]) == 0
    assert "OK: all" in capsys.readouterr().out


def test_demo_refuses_directory_with_another_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write_synthetic(tmp_path, SyntheticSpec(n_shards=1))
    (tmp_path / "model.safetensors").rename(tmp_path / "other.safetensors")
    assert main(["demo", "--size", "2MiB", "--dir", str(tmp_path)]) == 2
    assert_one_error_line(capsys.readouterr().err, "other.safetensors", "empty directory")


def test_python_m_asyncslab_demo_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "asyncslab", "demo", "--size", "2MiB"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "layer" in proc.stdout
    assert "expert bytes" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("OK: all")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- inspect


def test_inspect_prints_tiers_per_layer(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint
) -> None:
    assert main(["inspect", str(checkpoint.root)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert parse_tier_table(out) == expected_tiers(checkpoint)
    for name in checkpoint.files:
        assert name.name in out
    plan = asyncslab.plan(asyncslab.Checkpoint.open(checkpoint.root))
    assert f"{len(plan.slabs):,}" in out
    assert f"{plan.nbytes:,} B" in out
    assert f"{checkpoint.n_tensors:,}: {len(plan.routes):,} routed" in out


def test_inspect_json_matches_tier_map_and_plan(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint
) -> None:
    assert main(["inspect", str(checkpoint.root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tiers = {int(layer): counts for layer, counts in doc["tiers"].items()}
    assert tiers == expected_tiers(checkpoint)
    plan = asyncslab.plan(asyncslab.Checkpoint.open(checkpoint.root))
    assert doc["bytes"] == plan.nbytes
    assert doc["tensors_routed"] == len(plan.routes)
    assert doc["fingerprint"] == plan.fingerprint
    info = doc["checkpoint"]
    assert info["tensors"] == checkpoint.n_tensors
    assert info["payload_bytes"] == checkpoint.total_bytes
    assert sorted(f["name"] for f in info["files"]) == sorted(p.name for p in checkpoint.files)


def test_inspect_checks_declared_tier_map(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint, tmp_path: Path
) -> None:
    args = ["inspect", str(checkpoint.root), "--tier-map", str(checkpoint.tier_map_path)]
    assert main(args) == 0
    capsys.readouterr()
    wrong = json.loads(checkpoint.tier_map_path.read_text())
    layer = next(iter(wrong))
    wrong[layer]["0"] = 7 if wrong[layer]["0"] != 7 else 5
    bad_map = tmp_path / "wrong.json"
    bad_map.write_text(json.dumps(wrong))
    assert main(["inspect", str(checkpoint.root), "--tier-map", str(bad_map)]) == 2
    assert_one_error_line(capsys.readouterr().err, "tier map", "expert 0")


# --------------------------------------------------------------------------- load


def test_load_verify_json(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint, tmp_path: Path
) -> None:
    report = tmp_path / "stats.json"
    args = ["load", str(checkpoint.root), "--verify", "--json", str(report), "--read-mb", "0.5"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    plan = asyncslab.plan(asyncslab.Checkpoint.open(checkpoint.root))
    doc = json.loads(report.read_text())
    assert doc["state"] == "complete"
    assert doc["bytes_landed"] == plan.nbytes == doc["plan"]["bytes"]
    assert doc["tensors_landed"] == len(plan.routes)
    assert doc["verify"]["ok"] is True
    assert doc["verify"]["tensors"] == len(plan.routes)
    assert doc["verify"]["mismatches"] == []
    assert doc["gbps"] > 0
    assert doc["peak_rss_bytes"] is None or doc["peak_rss_bytes"] > 0
    assert doc["options"]["read_size"] == 1 << 19
    assert "OK: all" in out
    assert "peak RSS" in out
    assert "peak staging" in out
    assert err.startswith("complete")
    assert "Traceback" not in err


def test_load_mapped_verifies(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint, tmp_path: Path
) -> None:
    report = tmp_path / "stats.json"
    args = ["load", str(checkpoint.root), "--transfer", "mapped", "--verify", "--no-progress"]
    assert main([*args, "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["options"]["transfer"] == "mapped"
    assert doc["verify"]["ok"] is True
    assert doc["staging_budget"] == 0
    assert doc["transfer"] == "mapped"
    out = capsys.readouterr().out
    assert "OK: all" in out
    assert "none (copied straight out of the page cache)" in out


def test_load_verify_mismatch_exits_1_naming_the_tensor(
    capsys: pytest.CaptureFixture[str],
    checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    plan = asyncslab.plan(asyncslab.Checkpoint.open(checkpoint.root))
    victim = next(r.tensor for r in plan.routes if r.nbytes > 16)
    real = _verify._read_reference

    def tampered(file: Path, routes: Sequence[Route]) -> Iterator[tuple[Route, torch.Tensor]]:
        for route, tensor in real(file, routes):
            if route.tensor == victim:
                tensor = tensor.clone()
                tensor.reshape(-1).view(torch.uint8)[3] ^= 0xFF
            yield route, tensor

    monkeypatch.setattr(_verify, "_read_reference", tampered)
    report = tmp_path / "stats.json"
    args = ["load", str(checkpoint.root), "--verify", "--no-progress", "--json", str(report)]
    assert main(args) == 1
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1
    assert "verify failed" in lines[0]
    assert repr(victim) in lines[0]
    assert "first at byte 3" in lines[0]
    assert "FAILED" in out
    doc = json.loads(report.read_text())
    assert doc["verify"]["ok"] is False
    assert doc["verify"]["mismatches"] == [victim]


@pytest.mark.parametrize("command", ["inspect", "load"])
@pytest.mark.parametrize("where", ["single file", "shard of a directory"])
def test_malformed_header_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str],
    checkpoint: SyntheticCheckpoint,
    tmp_path: Path,
    command: str,
    where: str,
) -> None:
    if where == "single file":
        broken = tmp_path / "broken.safetensors"
        broken.write_bytes(b"\x01\x02\x03\x04")
        target = broken
    else:
        target = copy_checkpoint(checkpoint, tmp_path / "ckpt")
        broken = target / checkpoint.files[1].name
        broken.write_bytes(b"\x01\x02\x03\x04")
    assert main([command, str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_one_error_line(err, broken.name, "8-byte header")


@pytest.mark.parametrize("command", ["inspect", "load", "load --verify"])
def test_nonexistent_path_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    missing = tmp_path / "no-such-checkpoint"
    assert main([*command.split(), str(missing)]) == 2
    assert_one_error_line(capsys.readouterr().err, str(missing))


def test_missing_tier_map_file_is_one_line(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.json"
    assert main(["load", str(checkpoint.root), "--tier-map", str(missing)]) == 2
    assert_one_error_line(capsys.readouterr().err, "nope.json")


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("size", ["12XB", "abc", "0", "-5MiB", "5iB", "", "1.5.2G", "0.1"])
def test_bad_demo_size_exits_2(capsys: pytest.CaptureFixture[str], size: str) -> None:
    assert main(["demo", "--size", size]) == 2
    assert_one_error_line(capsys.readouterr().err, "--size")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64MiB", 64 << 20),
        ("1GiB", 1 << 30),
        ("3GB", 3_000_000_000),
        ("500M", 500 << 20),
        ("500mb", 500_000_000),
        ("2k", 2048),
        ("1.5KiB", 1536),
        ("4096", 4096),
        ("10B", 10),
        (" 2 Gi ", 2 << 30),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "missing command"),
        (["frobnicate"], "invalid choice"),
        (["load"], "required"),
        (["load", "x", "--io-workers", "0"], "--io-workers"),
        (["load", "x", "--staging-mb", "-1"], "--staging-mb"),
        (["load", "x", "--device", "tpu"], "--device"),
        (["load", "x", "--transfer", "zero-copy"], "--transfer"),
        (["load", "x", "--rank", "-1"], "--rank"),
        (["inspect", "x", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_one_error_line(err, fragment)


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "inspect", "load", "bench"):
        assert command in out


def test_debug_reraises(tmp_path: Path) -> None:
    with pytest.raises(asyncslab.errors.MissingFileError):
        main(["--debug", "inspect", str(tmp_path)])
    with pytest.raises(FileNotFoundError):
        main(["inspect", str(tmp_path / "missing"), "--debug"])


def test_keyboard_interrupt_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(_cli, "cmd_inspect", interrupted)
    assert main(["inspect", "anything"]) == 130
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["asyncslab: interrupted"]


def test_bench_unavailable_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "asyncslab.cli._bench", None)
    assert main(["bench", "--size", "1GiB"]) == 2
    assert capsys.readouterr().err.splitlines() == ["asyncslab: error: bench is not available"]


def test_run_async_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer() -> int:
        return 42

    assert _cli_common.run_async(answer()) == 42
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert _cli_common.run_async(answer()) == 42


# --------------------------------------------------------------------------- progress, tables


@dataclass
class FakeStats:
    state: str = "loading"
    bytes_landed: int = 0
    bytes_needed: int = 1 << 30
    bytes_total: int = 1 << 30
    units: int = 10
    units_complete: int = 0
    elapsed_s: float = 0.0
    gbps: float = 0.0
    eta_s: float | None = None


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_log_mode_prints_at_most_one_line_per_second() -> None:
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(stream, tty=False, clock=clock)
    for i in range(1, 31):  # 3 s of snapshots every 0.1 s
        clock.now += 0.1
        bar(FakeStats(bytes_landed=i << 25, units_complete=i // 3, elapsed_s=i / 10, gbps=3.4))
    bar(FakeStats(state="complete", bytes_landed=1 << 30, units_complete=10, elapsed_s=3.0))
    bar.finish()
    lines = stream.getvalue().splitlines()
    assert 3 <= len(lines) <= 4
    assert "\r" not in stream.getvalue()
    assert lines[0].startswith("loading")
    assert "GiB" in lines[0]
    assert "GB/s" in lines[0]
    assert lines[-1].startswith("complete")
    assert "100.0%" in lines[-1]
    assert "units 10/10" in lines[-1]


def test_progress_log_mode_finish_prints_pending_snapshot() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, tty=False, clock=FakeClock())
    bar(FakeStats(bytes_landed=1 << 29, units_complete=5, eta_s=1.5))
    assert stream.getvalue() == ""
    bar.finish()
    bar.finish()
    assert stream.getvalue().splitlines() == [stream.getvalue().rstrip("\n")]
    assert "50.0%" in stream.getvalue()
    assert "ETA 1.50s" in stream.getvalue()


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_progress_tty_mode_is_rich_s_bar_redrawn_in_one_line() -> None:
    # With rich installed (the cli extra; the test extra brings it): rich's bar.
    stream = io.StringIO()
    bar = ProgressBar(stream, tty=True, width=120, clock=FakeClock())
    bar(FakeStats(bytes_landed=1 << 28, units_complete=2, eta_s=90.0, gbps=1.0))
    bar(FakeStats(bytes_landed=1 << 29, units_complete=5, eta_s=1.0, gbps=1.0))
    bar(FakeStats(state="complete", bytes_landed=1 << 30, units_complete=10, elapsed_s=2.0))
    bar.finish()
    text = ANSI.sub("", stream.getvalue())
    assert text.count("\n") == 1
    assert text.endswith("\n")
    frames = text.rstrip("\n").split("\r")
    assert len(frames) >= 3  # one per snapshot, each redrawn over the last (rich's last twice)
    assert frames[0].startswith("loading")
    assert "25.0%" in frames[0]
    assert "ETA 1m30s" in frames[0]
    assert "━" in frames[0]  # rich's bar
    assert "ETA 1.00s" in frames[1]
    assert frames[-1].startswith("complete")
    assert "100.0%" in frames[-1]
    assert "units 10/10" in frames[-1]
    assert "in 2.00s" in frames[-1]


def test_progress_tty_mode_plain_draws_the_bar_in_each_line() -> None:
    # Without rich (or asked for plain lines) a terminal gets the log's lines, each with a
    # bar of '#': at most one line per interval, never redrawn.
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(stream, tty=True, plain=True, clock=clock)
    assert bar.tty
    clock.now += 1.0
    bar(FakeStats(bytes_landed=1 << 28, units_complete=2, eta_s=90.0, gbps=1.0))
    clock.now += 0.5
    bar(FakeStats(bytes_landed=1 << 29, units_complete=5, eta_s=1.0, gbps=1.0))  # held back
    bar(FakeStats(state="complete", bytes_landed=1 << 30, units_complete=10, elapsed_s=2.0))
    bar.finish()
    text = stream.getvalue()
    assert "\r" not in text
    assert "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 2
    assert "[######------------------]" in lines[0]
    assert "ETA 1m30s" in lines[0]
    assert "[" + "#" * 24 + "]" in lines[1]
    assert "units 10/10" in lines[1]
    assert "in 2.00s" in lines[1]


def test_progress_log_mode_draws_no_bar() -> None:
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(stream, tty=False, clock=clock)
    bar(FakeStats(state="complete", bytes_landed=1 << 30, units_complete=10, elapsed_s=2.0))
    bar.finish()
    (line,) = stream.getvalue().splitlines()
    assert "#" not in line
    assert "━" not in line
    assert line.startswith("complete")


def test_progress_survives_a_closed_stream() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, tty=True, clock=FakeClock())
    stream.close()
    bar(FakeStats(bytes_landed=1))
    bar.finish()


class Tty(io.StringIO):
    """What a terminal receives."""

    def isatty(self) -> bool:
        return True


def test_tables_on_a_terminal_are_rich_s_and_plain_elsewhere() -> None:
    rows = [["a", 1, 2.5], ["bbb [x]", 100, 0.25]]
    plain = format_table(rows, ["name", "n", "x"], indent="  ")
    assert format_table(rows, ["name", "n", "x"], indent="  ", terminal=io.StringIO()) == plain
    fancy = format_table(rows, ["name", "n", "x"], indent="  ", terminal=Tty())
    assert fancy != plain
    lines = [line.rstrip() for line in ANSI.sub("", fancy).splitlines()]
    assert lines[0].split() == ["name", "n", "x"]
    assert set(lines[1].strip()) == {"─"}  # rich's rule under the headers
    assert lines[2].split() == ["a", "1", "2.5"]
    assert lines[3].split() == ["bbb", "[x]", "100", "0.25"]  # a "[" is text, not markup
    assert all(line.startswith("  ") for line in lines)
    names = format_table([["device", "cpu"], ["GB/s", "1.50"]], align="ll", terminal=Tty())
    assert [line.split() for line in ANSI.sub("", names).splitlines()] == [
        ["device", "cpu"],
        ["GB/s", "1.50"],
    ]


def test_format_helpers() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(67_488_768) == "64.4 MiB"
    assert format_bytes(1 << 20, unit_of=1 << 30) == "0.0 GiB"
    assert format_duration(None) == "--"
    assert format_duration(3725) == "1h02m"
    table = format_table([["a", 1, 2.5], ["bbb", 100, 0.25]], ["name", "n", "x"])
    assert table.splitlines() == [
        "name    n     x",
        "----  ---  ----",
        "a       1   2.5",
        "bbb   100  0.25",
    ]
    with pytest.raises(ValueError, match="align"):
        format_table([["a"]], align="lr")


# --------------------------------------------------------------------------- found by probing


def _cli_env() -> dict[str, str]:
    root = str(Path(asyncslab.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("closed", ["<&-", ">&-"])
def test_load_with_a_closed_stdin_or_stdout_finishes(
    checkpoint: SyntheticCheckpoint, closed: str
) -> None:
    # uvloop's own fds took number 0 or 1, and libuv aborted the process (SIGABRT) on
    # closing one: `python: src/unix/core.c: uv__close: Assertion 'fd > STDERR_FILENO'`.
    command = f'exec "{sys.executable}" -m asyncslab load "{checkpoint.root}" --no-progress'
    proc = subprocess.run(
        ["sh", "-c", f"{command} {closed}"],
        capture_output=True,
        text=True,
        env=_cli_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Assertion" not in proc.stderr


def test_verify_that_the_reference_cannot_read_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A name the JSON allows but UTF-8 cannot hold (a lone surrogate, escaped): asyncslab
    # loads it, the safetensors library refuses the header, and --verify ended in its
    # traceback, exit 1.
    header = b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    path = tmp_path / "lone.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\x80\x3f")
    assert main(["load", str(path), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["load", str(path), "--no-progress", "--verify"]) == 2
    assert_one_error_line(
        capsys.readouterr().err, "--verify", "safetensors library cannot read", "lone.safetensors"
    )


def test_verify_runs_off_the_event_loop_and_stops_when_asked(
    checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Run on the loop's thread, verify kept Ctrl-C waiting until it had compared everything.
    ckpt = asyncslab.Checkpoint.open(checkpoint.root)
    plan = asyncslab.plan(ckpt)
    threads: list[str] = []
    real = _cli_load.verify_slabs

    def recording(*args: object) -> object:
        threads.append(threading.current_thread().name)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_cli_load, "verify_slabs", recording)
    result = _cli_load.run_load(
        ckpt, plan, device="cpu", options=asyncslab.LoadOptions(), show_progress=False, verify=True
    ).verify
    assert result is not None
    assert result.ok
    assert threads
    assert threads[0] != threading.main_thread().name

    async def stopped() -> None:
        slabs = await asyncslab.load(ckpt, plan)
        stop = threading.Event()
        stop.set()
        with pytest.raises(_verify.Stopped):
            real(plan, slabs, stop)
        await slabs.aclose()

    _cli_common.run_async(stopped())


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--io-workers", "99999999999999999999", "at most 1024"),
        ("--streams", "5000", "at most 1024"),
        ("--staging-mb", "1e300", "at most"),
        ("--read-mb", "1e300", "at most"),
    ],
)
def test_option_values_past_any_sense_are_one_line(
    capsys: pytest.CaptureFixture[str],
    checkpoint: SyntheticCheckpoint,
    option: str,
    value: str,
    fragment: str,
) -> None:
    # A mistyped --io-workers made threads until the process ran out of memory; a huge
    # --staging-mb ended in a torch error with its C++ stack on one line.
    assert main(["load", str(checkpoint.root), option, value]) == 2
    assert_one_error_line(capsys.readouterr().err, option, fragment)


def test_staging_budget_below_one_byte_per_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one byte"):
        asyncslab.LoadOptions(staging_bytes=4, staging_buffers=8)


def test_demo_refuses_to_write_over_a_checkpoint_it_did_not_write(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint, tmp_path: Path
) -> None:
    # Shards named as the demo names its own (as transformers names them) were overwritten.
    target = copy_checkpoint(checkpoint, tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    assert main(["demo", "--size", "2MiB", "--dir", str(target), "--no-progress"]) == 2
    assert_one_error_line(capsys.readouterr().err, "not written by the demo", "empty directory")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


@pytest.mark.parametrize("where", ["a directory", "a shard", "under a file", "the index"])
def test_json_that_cannot_be_written_fails_before_the_load(
    capsys: pytest.CaptureFixture[str],
    checkpoint: SyntheticCheckpoint,
    tmp_path: Path,
    where: str,
) -> None:
    # It failed after the load (a directory: "Is a directory"), or overwrote a shard of the
    # checkpoint with JSON, so that the next load failed on its header.
    target = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    (tmp_path / "afile").write_text("x")
    assert checkpoint.index is not None
    json_path = {
        "a directory": tmp_path,
        "a shard": target / checkpoint.files[0].name,
        "under a file": tmp_path / "afile" / "stats.json",
        # The index is the checkpoint's too (and now a path to load: passed twice, say).
        "the index": target / checkpoint.index.name,
    }[where]
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    assert main(["load", str(target), "--no-progress", "--json", str(json_path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the load
    assert_one_error_line(err, "--json")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_load_writes_json_and_its_verdict_before_the_table(
    capsys: pytest.CaptureFixture[str],
    checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # With stdout gone (`| true`), the JSON and the verify verdict were lost (exit 141).
    def gone(*args: object, **kwargs: object) -> None:
        raise BrokenPipeError

    monkeypatch.setattr(_cli_load, "out", gone)
    report = tmp_path / "stats.json"
    args = ["load", str(checkpoint.root), "--no-progress", "--verify", "--json", str(report)]
    assert main(args) == 141
    assert json.loads(report.read_text())["verify"]["ok"] is True


@pytest.mark.parametrize("command", ["inspect", "load"])
def test_a_json_file_that_is_no_index_is_not_called_one(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint, command: str
) -> None:
    # `asyncslab load ck/tier_map.json` said "is an index: pass the checkpoint directory".
    path = checkpoint.tier_map_path
    assert main([command, str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"asyncslab: error: {path} is a JSON file, not a safetensors checkpoint or index\n"
    )


def test_a_rank_sliced_checkpoint_without_rank_says_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # It said "pass rank= (0..1)", the library's keyword, not the command line's option.
    sliced = write_synthetic(tmp_path / "tp2", SyntheticSpec(n_layers=2, tp_ranks=2))
    assert main(["load", str(sliced.root), "--no-progress"]) == 2
    line = assert_one_error_line(capsys.readouterr().err, "rank-sliced into 2 ranks")
    assert line.endswith("pass --rank (0..1)")
    argv = ["load", str(sliced.root), "--no-progress", "--rank", "1"]
    argv += ["--tier-map", str(sliced.tier_map_path)]
    assert main(argv) == 0


def test_a_tier_map_directory_gets_a_message_that_says_what_it_is(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint, tmp_path: Path
) -> None:
    argv = ["load", str(checkpoint.root), "--tier-map", str(tmp_path)]
    assert main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, "is a directory, not a tier map file")


def test_an_index_as_the_path_loads_the_checkpoint_it_lists(
    capsys: pytest.CaptureFixture[str], checkpoint: SyntheticCheckpoint
) -> None:
    # It was refused: "is an index: pass the checkpoint directory that holds it".
    assert checkpoint.index is not None
    argv = ["load", str(checkpoint.index), "--verify", "--no-progress"]
    argv += ["--tier-map", str(checkpoint.tier_map_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"loaded {checkpoint.index}:" in out
    assert "OK: all" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_on_cuda_without_cuda_fails_before_writing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "demo"
    target.mkdir()
    assert main(["demo", "--device", "cuda", "--dir", str(target)]) == 2
    assert_one_error_line(capsys.readouterr().err, "CUDA is not available")
    assert list(target.iterdir()) == []


def test_load_json_dash_is_stdout_and_replaces_the_table(
    capsys: pytest.CaptureFixture[str],
    checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # `--json -` wrote a file named "-" and printed the table on stdout.
    monkeypatch.chdir(tmp_path)
    assert main(["load", str(checkpoint.root), "--no-progress", "--verify", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    doc = json.loads(out)  # all of stdout: one document, no table
    assert doc["state"] == "complete"
    assert doc["verify"]["ok"] is True
    assert doc["checkpoint"] == str(checkpoint.root)
    assert list(tmp_path.iterdir()) == []
    # A failure still leaves one document there, and its one line on stderr.
    missing = tmp_path / "missing"
    assert main(["load", str(missing), "--json", "-"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["state"] == "failed"
    assert err == f"asyncslab: error: {missing}: no such file or directory\n"
    # A file named "-" is still one path away.
    assert main(["load", str(checkpoint.root), "--no-progress", "--json", "./-"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"loaded {checkpoint.root}:\n")
    assert json.loads((tmp_path / "-").read_text())["state"] == "complete"


def test_staging_mb_applies_to_a_staged_load_on_cpu_and_its_help_says_so(
    capsys: pytest.CaptureFixture[str],
    checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The help said "CUDA only".
    argv = ["load", str(checkpoint.root), "--no-progress", "--transfer", "staged"]
    assert main([*argv, "--staging-mb", "8"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any(re.fullmatch(r"  peak staging +\S+ \S+ of 8\.0 MiB", row) for row in rows), rows
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    assert main(["load", "--help"]) == 0
    (line,) = [row for row in capsys.readouterr().out.splitlines() if "--staging-mb MB " in row]
    assert "CUDA only" not in line
    assert "staging budget in MiB of the staged transfer, on cpu as on cuda" in line


@pytest.mark.parametrize("fails", ["in a read", "by Ctrl-C"])
def test_a_load_that_fails_replaces_an_earlier_json_and_the_bar_says_so(
    capsys: pytest.CaptureFixture[str],
    checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    fails: str,
) -> None:
    # The JSON was written only after a load that succeeded: after a failure (exit 2) the
    # file of an earlier run stayed, saying "complete"; the bar's last line said "loading".
    from asyncslab.loading import _copy
    from asyncslab.loading._read import pread_scatter

    report = tmp_path / "stats.json"
    args = ["load", str(checkpoint.root), "--json", str(report), "--read-mb", "0.0625"]
    assert main([*args, "--no-progress"]) == 0
    assert json.loads(report.read_text())["state"] == "complete"
    capsys.readouterr()
    calls = iter(range(1_000_000))
    # The read that sends Ctrl-C returns only once asyncio's SIGINT handler has cancelled
    # the main task (the cancel reaches the load's task at once; nothing lands after it): a
    # fixed 50 ms let a loaded machine finish the load before the handler ran (exit 0).
    interrupted = threading.Event()
    on_sigint = asyncio.runners.Runner._on_sigint

    def noted_sigint(self: asyncio.Runner, *args: Any, **kwargs: Any) -> None:
        try:
            on_sigint(self, *args, **kwargs)
        finally:
            interrupted.set()

    monkeypatch.setattr(asyncio.runners.Runner, "_on_sigint", noted_sigint)

    def read(*a: object, **kw: object) -> int:
        if next(calls) == 3:
            if fails == "by Ctrl-C":
                os.kill(os.getpid(), signal.SIGINT)  # the loop cancels the load
                assert interrupted.wait(60), "asyncio's SIGINT handler never ran"
            else:
                raise asyncslab.errors.ReadError("injected EIO", file=str(kw["path"]))
        return pread_scatter(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_copy, "pread_scatter", read)
    # Ctrl-C as a terminal delivers it: a process started in the background by a shell
    # without job control (as CI runners may start it) inherits SIGINT ignored, and then
    # the kill above did nothing and the load completed (exit 0).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(args) == (2 if fails == "in a read" else 130)
    finally:
        signal.signal(signal.SIGINT, previous)
    doc = json.loads(report.read_text())
    plan = asyncslab.plan(asyncslab.Checkpoint.open(checkpoint.root))
    if fails == "in a read":
        assert doc["state"] == "failed"
        assert "injected EIO" in doc["error"]
    else:
        assert doc["state"] == "cancelled"
        assert doc["error"] == "KeyboardInterrupt"
    # This load's figures (a failing read may stop the landing of reads it overtook: >= 0).
    assert 0 <= doc["bytes_landed"] < plan.nbytes == doc["plan"]["bytes"]
    assert doc["tensors"] == len(plan.routes)
    assert doc["verify"] is None
    err = capsys.readouterr().err
    bar_lines = [line for line in err.splitlines() if "%" in line]
    assert bar_lines[-1].split()[0] == doc["state"]


def test_a_plan_that_fails_replaces_an_earlier_json_but_never_another_file(
    checkpoint: SyntheticCheckpoint, tmp_path: Path
) -> None:
    target = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    report = tmp_path / "stats.json"
    assert main(["load", str(target), "--no-progress", "--json", str(report)]) == 0
    shard = target / checkpoint.files[0].name
    shard.write_bytes(b"\x05" + shard.read_bytes()[1:])  # a header length past the file
    assert main(["load", str(target), "--no-progress", "--json", str(report)]) == 2
    doc = json.loads(report.read_text())
    assert doc["state"] == "failed"
    assert checkpoint.files[0].name in doc["error"]
    assert doc["plan"] is None
    assert "bytes_landed" not in doc  # nothing was loaded: no load figures at all
    # Before a plan the checkpoint's files are unknown: a file that is not a report stays.
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    assert main(["load", str(target), "--no-progress", "--json", str(other)]) == 2
    assert other.read_text() == "mine"
