"""A longer fuzz campaign over header + index mutations, through the whole pipeline.

Every input starts from the valid two-shard checkpoint of ``support/fuzz.py`` (tiered-MoE
experts, dense, zero-size, scalar and bool tensors, an index), applies 1-3 mutations — the
same mutators as the property tests (``tests/test_fuzz.py``), plus ``header_splice``
(bytes of the fuzzer's input spliced into a header at a fuzzer-chosen point) — and runs
``Checkpoint.open`` -> ``plan`` -> ``load``. Each input ends one of three ways:

* ``accepted``: loaded, and bit-identical to what ``safetensors`` reads (when it accepts
  the files too; "accepted, reference refuses" is counted separately);
* an :class:`asyncslab.AsyncSlabError` subclass (by name);
* anything else: a **bug** (``KNOWN:<id>`` for the ones listed in ``support.fuzz.KNOWN_BUGS``).

Engines: ``atheris`` (coverage-guided libFuzzer over asyncslab's bytecode; its input bytes
drive every choice a mutator makes) when importable, else ``random`` (seeded
``random.Random`` per input). The worker runs under an address-space limit and writes its
tallies to JSON every few seconds; the parent prints the table.

    python -m benchmarks.fuzz_campaign --seconds 240            # atheris if installed
    python -m benchmarks.fuzz_campaign --engine random --seconds 60 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


# --- the worker --------------------------------------------------------------------------


class Tally:
    def __init__(self, path: Path, engine: str) -> None:
        self.path = path
        self.engine = engine
        self.started = time.time()
        self.inputs = 0
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.by_status: collections.Counter[str] = collections.Counter()
        self.reference_refuses = 0
        self.bugs: list[dict[str, Any]] = []
        self.bug_signatures: collections.Counter[str] = collections.Counter()
        self.refusals: collections.Counter[str] = collections.Counter()
        self.refusal_examples: dict[str, list[str]] = {}
        self.last_dump = 0.0

    def add(self, steps: list[tuple[str, str]], status: str, reference: str, detail: str) -> None:
        self.inputs += 1
        self.by_status[status] += 1
        if status == "accepted" and reference == "refuses":
            self.reference_refuses += 1
            key = detail[:160]
            self.refusals[key] += 1
            if key not in self.refusal_examples:
                self.refusal_examples[key] = [s for _, s in steps]
        # By mutation kind: the last mutation applied (the one whose outcome this is, for
        # single mutations; stacked ones are also tallied under "stacked").
        kind = steps[-1][0] if len(steps) == 1 else "stacked"
        self.by_kind[kind][status] += 1
        if status == "BUG" or status.startswith("KNOWN"):
            signature = detail.strip().splitlines()[-1][:200] if detail.strip() else status
            self.bug_signatures[f"{status}: {signature}"] += 1
            if status == "BUG" and len(self.bugs) < 50:
                self.bugs.append({"steps": [s for _, s in steps], "detail": detail[-3000:]})
        now = time.time()
        if now - self.last_dump > 2.0:
            self.dump()

    def dump(self) -> None:
        self.last_dump = time.time()
        data = {
            "engine": self.engine,
            "seconds": round(time.time() - self.started, 1),
            "inputs": self.inputs,
            "by_status": dict(self.by_status),
            "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
            "accepted_reference_refuses": self.reference_refuses,
            "reference_refusals": {
                k: {"count": c, "example": self.refusal_examples[k]}
                for k, c in self.refusals.items()
            },
            "bug_signatures": dict(self.bug_signatures),
            "bugs": self.bugs,
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)


def _header_splice(files: dict[str, bytes], rng: random.Random, payload: bytes) -> str:
    import struct

    from support import fuzz as fz

    name = rng.choice(list(fz.SHARDS))
    blob = files[name]
    n = struct.unpack("<Q", blob[:8])[0]
    header, rest = blob[8 : 8 + n], blob[8 + n :]
    at = rng.randrange(len(header) + 1)
    cut = rng.randrange(0, 9)
    header = header[:at] + payload + header[at + cut :]
    files[name] = struct.pack("<Q", len(header)) + header + rest
    return f"{name}: splice {payload[:32]!r} at {at} over {cut} bytes"


def run_one(
    fz: Any,
    tally: Tally,
    choose: random.Random,
    splice: bytes,
    kinds: list[str],
    first: str | None = None,
) -> None:
    files = fz.base_files()
    steps: list[tuple[str, str]] = []
    for i in range(1 + (choose.randrange(3) if choose.random() < 0.3 else 0)):
        kind = first if i == 0 and first is not None else choose.choice(kinds)
        if kind == "header_splice":
            files = dict(files)
            try:
                step = _header_splice(files, choose, splice)
            except Exception as err:  # noqa: BLE001 - an earlier mutation broke the framing
                step = f"header_splice: not applicable ({type(err).__name__})"
        else:
            files, step = fz.mutate(files, kind, choose)
        steps.append((kind, step))
    loop = "uvloop" if choose.random() < 0.5 else "asyncio"
    with tempfile.TemporaryDirectory() as d:
        fz.write_files(Path(d), files)
        outcome = fz.run_pipeline(Path(d), loop)
    tally.add(steps, outcome.status, outcome.reference, outcome.detail)


class FdpRandom(random.Random):
    """A ``random.Random`` whose every draw comes from atheris' input bytes, so coverage
    feedback steers the mutators' choices (kinds, positions, values)."""

    def __init__(self, fdp: Any) -> None:
        self.fdp = fdp
        super().__init__(0)

    def random(self) -> float:
        return float(self.fdp.ConsumeProbability())

    def getrandbits(self, k: int) -> int:
        return int(self.fdp.ConsumeIntInRange(0, (1 << k) - 1)) if k else 0


def worker(args: argparse.Namespace) -> None:
    limit = args.memory_gb << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    engine = args.engine
    tally = Tally(Path(args.tally), engine)
    if engine == "atheris":
        import atheris

        with atheris.instrument_imports(include=["asyncslab"]):
            import asyncslab  # noqa: F401
        from support import fuzz as fz

        kinds = [*sorted(fz.MUTATORS), "header_splice"]
        fz.base_files()

        def one_input(data: bytes) -> None:
            # The first byte picks the (first) mutation kind, so short inputs spread over
            # all kinds instead of all meaning "kind 0"; the rest drives its choices.
            first = kinds[data[0] % len(kinds)] if data else kinds[0]
            fdp = atheris.FuzzedDataProvider(data[1:])
            splice = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
            run_one(fz, tally, FdpRandom(fdp), splice, kinds, first)

        import atexit

        atexit.register(tally.dump)
        corpus = Path(tempfile.mkdtemp(prefix="asyncslab-fuzz-corpus-"))
        seeds = random.Random(args.seed)
        for i in range(len(kinds)):
            (corpus / f"seed-{i}").write_bytes(bytes([i]) + seeds.randbytes(64))
        atheris.Setup(
            [
                sys.argv[0],
                str(corpus),
                f"-max_total_time={args.seconds}",
                "-timeout=30",
                f"-rss_limit_mb={args.memory_gb * 1024}",
                "-max_len=4096",
                "-print_final_stats=1",
                f"-seed={args.seed}",
            ],
            one_input,
        )
        try:
            atheris.Fuzz()
        finally:
            tally.dump()
    else:
        from support import fuzz as fz

        kinds = [*sorted(fz.MUTATORS), "header_splice"]
        fz.base_files()
        deadline = time.time() + args.seconds
        seed = args.seed
        while time.time() < deadline:
            rng = random.Random(seed)
            seed += 1
            run_one(fz, tally, rng, rng.randbytes(rng.randrange(65)), kinds)
        tally.dump()


# --- the parent --------------------------------------------------------------------------


def report(data: dict[str, Any]) -> str:
    statuses = sorted(
        {s for counts in data["by_kind"].values() for s in counts},
        key=lambda s: (s != "accepted", s.startswith(("BUG", "KNOWN")), s),
    )
    lines = [
        f"engine {data['engine']}, {data['inputs']} inputs in {data['seconds']} s "
        f"({data['inputs'] / max(data['seconds'], 1e-9):.0f}/s)",
        "",
        "| mutation | inputs | " + " | ".join(statuses) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in statuses) + " |",
    ]
    for kind, counts in data["by_kind"].items():
        cells = " | ".join(str(counts.get(s, 0)) for s in statuses)
        lines.append(f"| {kind} | {sum(counts.values())} | {cells} |")
    total = collections.Counter(data["by_status"])
    cells = " | ".join(str(total.get(s, 0)) for s in statuses)
    lines.append(f"| **all** | {data['inputs']} | {cells} |")
    lines.append("")
    lines.append(
        f"accepted while the safetensors reference refuses: {data['accepted_reference_refuses']}"
    )
    for reason, info in sorted(data["reference_refusals"].items()):
        lines.append(f"  {info['count']} x {reason}; e.g. {' / '.join(info['example'])[:200]}")
    bugs = data["by_status"].get("BUG", 0)
    lines.append(f"other exceptions (bugs): {bugs}")
    for signature, count in sorted(data["bug_signatures"].items()):
        lines.append(f"  {count} x {signature}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=240)
    parser.add_argument("--engine", choices=["auto", "atheris", "random"], default="auto")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--memory-gb", type=int, default=4, help="address-space limit")
    parser.add_argument("--json", type=Path, help="write the tallies here too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tally", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.engine == "auto":
        try:
            import atheris  # noqa: F401

            args.engine = "atheris"
        except ImportError:
            args.engine = "random"
    with tempfile.TemporaryDirectory() as d:
        tally = Path(d) / "tally.json"
        command = [
            sys.executable, "-m", "benchmarks.fuzz_campaign", "--worker", "--tally", str(tally),
            "--engine", args.engine, "--seconds", str(args.seconds), "--seed", str(args.seed),
            "--memory-gb", str(args.memory_gb),
        ]  # fmt: skip
        started = time.time()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        elapsed = time.time() - started
        if not tally.exists():
            sys.exit(f"worker wrote no tallies (rc {done.returncode}):\n{done.stderr[-3000:]}")
        data = json.loads(tally.read_text())
    data["worker_returncode"] = done.returncode
    data["wall_seconds"] = round(elapsed, 1)
    tail = [ln for ln in done.stderr.splitlines() if ln.startswith(("stat::", "Done", "=="))]
    data["libfuzzer_stats"] = tail[-12:]
    print(report(data))
    if tail:
        print("\nlibFuzzer:", *tail[-12:], sep="\n  ")
    if done.returncode not in (0,):
        print(f"\nworker exited with {done.returncode}; stderr tail:\n{done.stderr[-2000:]}")
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    if data["by_status"].get("BUG", 0):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
