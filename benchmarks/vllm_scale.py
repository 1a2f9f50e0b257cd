"""vLLM's first load against the number of tensors: ``auto`` and asyncslab side by side on
Mixtral-like models that differ only in their expert count, so that what grows is tensors,
not bytes per tensor.

    python -m benchmarks.vllm_scale [--experts 8,32,64,128,256,512] [--rounds 3]
                                    [--json OUT] [--plot OUT.png]

Each model has 24 layers of ``E`` experts on skinny dimensions (hidden 128, intermediate 32:
an expert tensor is 8 KiB), ``24 x (3E + 7) + 3`` tensors: 747 at 8 experts, 37,035 at 512.
Per model and round, one fresh process per format (``vllm_bench.py``'s child, warm page
cache, the order reversed every other round) times ``load_weights``; asyncslab's report
splits its time into recording vLLM's loaders (with vLLM's file selection and the headers'
parse), planning (coverage checked, the plan and the placement built) and the reads. Printed:
medians, microseconds per tensor, and the slope of a least-squares line through each stage's
seconds against tensors (its cost per added tensor, fixed costs left out).

Targets (printed, never asserted): recording + planning <= 5 us per tensor; at 256 experts
asyncslab's first load >= 3x faster than ``auto``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.vllm_bench import _child, _warm

#: Skinny so that the bytes stay small beside the tensor count.
SKINNY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 32,
    "num_hidden_layers": 24,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
}
STAGES = ("capture_s", "plan_s", "reads_s")
PER_TENSOR_TARGET_US = 5.0
SPEEDUP_TARGET = 3.0


def model_for(experts: int, workdir: Path) -> Path:
    """The model of ``experts`` experts a layer, written once into ``workdir``."""
    path = workdir / f"scale-{experts}"
    if not (path / "config.json").exists():
        from support.vllm_models import write_model

        print(f"writing the {experts}-expert model into {path} ...", flush=True)
        write_model(path, "mixtral", shards=4, num_local_experts=experts, **SKINNY)
    return path


def measure(experts: list[int], rounds: int, workdir: Path) -> list[dict[str, Any]]:
    """Per expert count: tensors, and per format the median ``load_weights`` seconds (and
    asyncslab's stages), over ``rounds`` fresh processes each."""
    rows = []
    for count in experts:
        model = model_for(count, workdir)
        runs: dict[str, list[dict[str, Any]]] = {"auto": [], "asyncslab": []}
        for r in range(rounds):
            for name in ("auto", "asyncslab") if r % 2 == 0 else ("asyncslab", "auto"):
                _warm(model)
                result = _child(str(model), name, "cpu")
                if "error" in result:
                    raise SystemExit(f"{name} failed on {model}: {result['error']}")
                runs[name].append(result)
        ours = runs["asyncslab"]
        row: dict[str, Any] = {
            "experts": count,
            "tensors": ours[0]["tensors"],
            "recorded": ours[0]["recorded"],
            "checksums_equal": {x["checksum"] for x in runs["auto"]}
            == {x["checksum"] for x in ours},
        }
        for name, got in runs.items():
            row[name] = statistics.median(x["load_weights_s"] for x in got)
        for stage in STAGES:
            row[stage] = statistics.median(x[stage] for x in ours)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    us = 1e6 / row["tensors"]
    return (
        f"  {row['experts']:>4} experts, {row['tensors']:>6} tensors: auto {row['auto']:.3f} s, "
        f"asyncslab {row['asyncslab']:.3f} s ({row['auto'] / row['asyncslab']:.2f}x faster); "
        f"recording {row['capture_s'] * us:.1f} us/tensor ({row['recorded']} through vLLM's "
        f"loaders), planning {row['plan_s'] * us:.1f}, reads {row['reads_s'] * us:.1f}"
    )


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def report(rows: list[dict[str, Any]]) -> str:
    tensors = [float(r["tensors"]) for r in rows]
    lines = [
        "| experts | tensors | auto | asyncslab | speed-up | recording | planning | reads "
        "| through vLLM's loaders |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        us = 1e6 / r["tensors"]
        lines.append(
            f"| {r['experts']} | {r['tensors']:,} | {r['auto']:.3f} s | {r['asyncslab']:.3f} s "
            f"| {r['auto'] / r['asyncslab']:.2f}x | {r['capture_s'] * us:.1f} us "
            f"| {r['plan_s'] * us:.1f} us | {r['reads_s'] * us:.1f} us | {r['recorded']:,} |"
        )
    lines.append("")
    for key in ("auto", "asyncslab", *STAGES):
        per = slope(tensors, [r[key] for r in rows]) * 1e6
        lines.append(f"slope of {key.removesuffix('_s')}: {per:.2f} us per added tensor")
    last = rows[-1]
    per_tensor = (last["capture_s"] + last["plan_s"]) / last["tensors"] * 1e6
    met = "met" if per_tensor <= PER_TENSOR_TARGET_US else "missed"
    lines.append(
        f"recording + planning at {last['tensors']:,} tensors: {per_tensor:.1f} us per tensor; "
        f"target <= {PER_TENSOR_TARGET_US} us: {met}"
    )
    for r in rows:
        if r["experts"] == 256:
            speedup = r["auto"] / r["asyncslab"]
            met = "met" if speedup >= SPEEDUP_TARGET else "missed"
            lines.append(
                f"256 experts: asyncslab {speedup:.2f}x faster than auto; "
                f"target >= {SPEEDUP_TARGET}x: {met}"
            )
    equal = all(r["checksums_equal"] for r in rows)
    lines.append(f"checksums: {'equal' if equal else 'DIFFER'} on every model")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensors = [r["tensors"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(tensors, [r["auto"] for r in rows], "o-", label="auto: load_weights")
    ax.plot(tensors, [r["asyncslab"] for r in rows], "o-", label="asyncslab: load_weights")
    ax.plot(tensors, [r["capture_s"] for r in rows], "s--", label="asyncslab: recording")
    ax.plot(tensors, [r["plan_s"] for r in rows], "s--", label="asyncslab: planning")
    ax.plot(tensors, [r["reads_s"] for r in rows], "s--", label="asyncslab: reads")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint tensors (Mixtral-like, 24 layers, 8-512 experts)")
    ax.set_ylabel("seconds (median)")
    ax.set_title("vLLM first load against tensor count (CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--experts", default="8,32,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "asyncslab-vllm-bench"))
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    experts = [int(e) for e in args.experts.split(",")]
    rows = measure(experts, args.rounds, Path(args.workdir))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print()
    print(report(rows))
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
