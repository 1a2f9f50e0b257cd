"""A small inference server that loads its checkpoint in the background and answers at once.

    python examples/server.py [--checkpoint PATH] [--size 256MiB] [--host 127.0.0.1]
                              [--port 8000] [--max-mb-per-s R] [--loop uvloop|asyncio]
                              [--layer L] [--device cpu|cuda[:N]] [--keep]
                              [--log-level info]

Starlette under uvicorn (uvloop by default), as inference servers run. Before the server
starts, the checkpoint is opened and planned (headers only); a checkpoint that cannot be, a
``--layer`` that is not an MoE layer, or a ``--device`` that is not there ends the script
with exit code 2 and one line on stderr. At startup the lifespan then allocates the slabs
and starts ``SlabSet(plan).start(...)`` as a background task on the server's own event
loop, and the server accepts requests while the bytes land:

* ``GET /health``  -- 503 with progress ``{state, bytes_done, bytes_total, units_complete,
  units_total, gbps, eta_s, ...}`` while loading, 200 once ready, 500 with ``error`` if the
  load failed (a read error, a file changed since it was planned, slabs that cannot be
  allocated). Never waits for the load.
* ``GET|POST /forward?tokens=8&seed=0`` -- one forward pass of one MoE layer's block
  (``examples/moe_block.py``), whose expert weights are zero-copy views of the slabs; it is
  bound from ``on_unit_ready`` as soon as its layer's unit lands. Returns the output's shape,
  sum and sha256 (``include_output=1`` adds the values). 503 until the load is complete.

Without ``--checkpoint`` it generates a synthetic EXL3-like mixed-tier MoE checkpoint of
``--size`` into a temporary directory (removed at exit unless ``--keep``). Ctrl-C / SIGTERM
during the load cancels it cleanly: the lifespan shutdown awaits ``slabs.aclose()``, which
waits for reads still inside I/O threads, closes every file and frees the slabs; the process
then exits 0. Without ``starlette`` or ``uvicorn`` installed the script says so and exits 0.

``--max-mb-per-s R`` paces the load (``LoadOptions.max_bytes_per_s``) and reads 64 KiB at
a time: it leaves storage bandwidth to neighbours, and makes a small checkpoint load slowly
enough to watch its progress.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from moe_block import TieredMoEBlock, checksum, make_input

from asyncslab import Checkpoint, LoadOptions, Plan, SlabSet, plan
from asyncslab.testing import spec_for_size, write_synthetic

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
except ModuleNotFoundError as err:  # main() says so and exits 0, as the other examples do
    MISSING: str | None = err.name or "starlette"
else:
    MISSING = None

INSTALL = 'pip install "starlette>=0.37" "uvicorn>=0.29"'

MAX_TOKENS = 4096
PACED_READ_SIZE = 64 << 10


def log(message: str) -> None:
    print(f"[server] {message}", flush=True)


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Service:
    """The model's state, shared by the lifespan and the routes (all on the loop thread)."""

    def __init__(
        self,
        path: Path,
        checkpoint: Checkpoint,
        p: Plan,
        *,
        layer: int,
        device: str,
        options: LoadOptions,
    ) -> None:
        self.path = path
        self.checkpoint = checkpoint
        self.plan = p
        self.layer = layer
        self.device = device
        self.options = options
        self.slabs: SlabSet | None = None
        self.block: TieredMoEBlock | None = None
        self.task: asyncio.Task[SlabSet] | None = None
        self.error: str | None = None  # a failure before the load could start (allocation)

    # --- lifespan ----------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        log(f"event loop: {type(loop).__module__}.{type(loop).__qualname__}")
        slabs: SlabSet | None = None
        p, layer = self.plan, self.layer
        try:
            self.block = TieredMoEBlock.from_plan(p, layer)
            # On a GPU the first CUDA call of the process initialises CUDA, and the slabs'
            # one allocation reserves their whole size: off the loop.
            slabs = await asyncio.to_thread(SlabSet, p, self.device)
            task = slabs.start(
                self.checkpoint, options=self.options, on_unit_ready=self._on_unit_ready
            )
        except Exception as err:  # anything: /health reports it (500) instead of a crash
            self.error = f"{type(err).__name__}: {err}"
            log(f"cannot load {self.path}: {self.error}")
            if slabs is not None:
                await slabs.aclose()
            return
        self.slabs, self.task = slabs, task
        task.add_done_callback(self._load_done)
        groups = ", ".join(f"{g}: {n} experts" for g, n in self.block.partition.sizes().items())
        log(
            f"loading {mib(p.nbytes)} into {len(p.slabs)} slabs ({len(p.routes)} tensors, "
            f"{len(p.units)} units) on {self.device}; serving layer {layer} ({groups})"
        )

    async def stop(self) -> None:
        if self.slabs is None:
            return
        before = self.slabs.statistics()
        await self.slabs.aclose()
        if before.state == "loading":
            log(
                f"shutdown during the load: cancelled at {mib(before.bytes_landed)} of "
                f"{mib(before.bytes_needed or before.bytes_total)}; slabs freed"
            )
        else:
            log(f"shutdown: slabs freed (load was {before.state})")
        # aclose() waited for every read; helper threads may take a moment to finish exiting.
        for _ in range(100):  # up to 2 s
            if not (left := _io_threads()):
                break
            await asyncio.sleep(0.02)
        log(f"I/O threads left: {len(left)}" + (f" {left}" if left else ""))

    async def _on_unit_ready(self, unit: str, slabs: SlabSet) -> None:
        # Runs inside the load's task group: an error here fails the load (and /health says so).
        if self.block is not None and unit == self.block.unit:
            self.block.bind(slabs)
            log(f"{unit} landed; MoE block bound to its slabs (zero-copy)")

    def _load_done(self, task: asyncio.Task[SlabSet]) -> None:
        # Retrieves the task's exception, so asyncio never logs it as unretrieved.
        if task.cancelled():
            return
        err = task.exception()
        if err is not None:
            log(f"load failed: {type(err).__name__}: {err}")
            return
        s = task.result().statistics()
        log(
            f"load complete: {mib(s.bytes_landed)} in {s.elapsed_s:.2f} s "
            f"({s.gbps:.2f} GB/s, {s.reads} reads); ready"
        )

    # --- answers -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return (
            self.slabs is not None
            and self.slabs.state == "complete"
            and self.block is not None
            and self.block.bound
        )

    def progress(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /health."""
        if self.slabs is None:
            state = "failed" if self.error else "starting"
            body: dict[str, Any] = {
                "state": state,
                "ready": False,
                "bytes_done": 0,
                "bytes_total": 0,
                "units_complete": 0,
                "units_total": 0,
                "gbps": 0.0,
                "eta_s": None,
                "elapsed_s": 0.0,
                "error": self.error,
                "layer": None,
                "layer_bound": False,
            }
            return (500 if self.error else 503), body
        s = self.slabs.statistics()
        body = {
            "state": s.state,
            "ready": self.ready,
            "bytes_done": s.bytes_landed,
            "bytes_total": s.bytes_needed or s.bytes_total,
            "units_complete": s.units_complete,
            "units_total": s.units,
            "gbps": round(s.gbps, 4),
            "eta_s": None if s.eta_s is None else round(s.eta_s, 3),
            "elapsed_s": round(s.elapsed_s, 3),
            "error": s.error,
            "layer": self.block.layer if self.block is not None else None,
            "layer_bound": bool(self.block is not None and self.block.bound),
        }
        status = 200 if self.ready else 500 if s.state == "failed" else 503
        return status, body


def _io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("asyncslab-io")]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _flag(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def _integer(value: Any) -> int | None:
    """An int, or the text of one (query parameters); not a float (8.9, Infinity), not a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _encode_with_output(body: dict[str, Any], y: torch.Tensor) -> bytes:
    """``body`` with the output rows, encoded as starlette's JSONResponse encodes."""
    rows = [[_finite(v) for v in row] for row in y.tolist()]
    doc = {**body, "output": rows}
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def build_app(service: Service) -> Starlette:
    async def health(request: Request) -> JSONResponse:
        status, body = service.progress()
        return JSONResponse(body, status_code=status)

    async def forward(request: Request) -> Response:
        if not service.ready:
            status, progress = service.progress()
            refusal = {
                "error": progress["error"] or "not ready: the checkpoint is still loading",
                **{k: progress[k] for k in ("state", "bytes_done", "bytes_total")},
            }
            return JSONResponse(refusal, status_code=500 if status == 500 else 503)
        params: dict[str, Any] = dict(request.query_params)
        if request.method == "POST":
            raw = await request.body()
            if raw.strip():
                try:
                    doc = json.loads(raw)
                except (ValueError, RecursionError) as err:  # nested too deep: RecursionError
                    return JSONResponse({"error": f"body is not JSON: {err}"}, status_code=400)
                if not isinstance(doc, dict):
                    return JSONResponse({"error": "body must be a JSON object"}, status_code=400)
                params.update(doc)
        tokens, seed = _integer(params.get("tokens", 8)), _integer(params.get("seed", 0))
        if tokens is None or seed is None:
            return JSONResponse({"error": "tokens and seed must be integers"}, status_code=400)
        if not 1 <= tokens <= MAX_TOKENS:
            return JSONResponse({"error": f"tokens must be in 1..{MAX_TOKENS}"}, status_code=400)
        if not 0 <= seed < 1 << 63:  # what torch.Generator.manual_seed takes
            return JSONResponse({"error": "seed must be in 0..2**63-1"}, status_code=400)
        block = service.block
        assert block is not None
        x = make_input(tokens, block.hidden, seed).to(service.device)
        t0 = time.perf_counter()
        # Compute off the loop thread, so /health keeps answering during a long forward.
        y = (await asyncio.to_thread(block, x)).cpu()
        ms = (time.perf_counter() - t0) * 1e3
        body: dict[str, Any] = {
            "layer": block.layer,
            "tokens": tokens,
            "seed": seed,
            "shape": list(y.shape),
            "dtype": str(y.dtype).removeprefix("torch."),
            "sum": _finite(float(y.double().sum())),
            "abs_sum": _finite(float(y.double().abs().sum())),
            "sha256": checksum(y),
            "ms": round(ms, 3),
        }
        if _flag(params.get("include_output", "0")):
            # 4096 x hidden floats: building and encoding them took ~0.8 s, off the loop too.
            encoded = await asyncio.to_thread(_encode_with_output, body, y)
            return Response(encoded, media_type="application/json")
        return JSONResponse(body)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/forward", forward, methods=["GET", "POST"]),
        ],
        lifespan=lifespan,
    )


# --------------------------------------------------------------------------- command line

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20}
_UNITS |= {"mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9}
_UNITS |= {"t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """``"256MiB"`` -> 268435456: a number and an optional unit, ``KiB/MiB/GiB`` (or
    ``K/M/G``) in powers of 1024, ``KB/MB/GB`` in powers of 1000 (and ``T``); no unit or
    ``B``: bytes. Case-insensitive."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number) :].lower()
    try:
        size = round(float(number) * _UNITS[unit])
    except (ValueError, KeyError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a number and an optional unit, like 256MiB or 1GB"
        ) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be at least one byte")
    return size


class Refused(Exception):
    """What cannot be served, found before the server starts: exit code 2."""


def check_device(device: str) -> None:
    """Without initialising CUDA (the lifespan does, off the loop): is ``device`` there?"""
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise Refused(f"--device {device}: {err}") from None
    if dev.type not in ("cpu", "cuda"):
        raise Refused(f"--device {device}: not supported (cpu or cuda[:N])")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise Refused(f"--device {device}: CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise Refused(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")


def open_and_plan(path: Path, layer: int | None) -> tuple[Checkpoint, Plan, int]:
    """The checkpoint's headers, its plan and the MoE layer to serve; no payload is read."""
    try:
        checkpoint = Checkpoint.open(path)
        tier_map = path / "tier_map.json" if path.is_dir() else None
        if tier_map is not None and not tier_map.is_file():
            tier_map = None
        p = plan(checkpoint, tier_map=tier_map)
    except (ValueError, OSError) as err:  # asyncslab's errors are ValueErrors
        message = f"{type(err).__name__}: {err}"
        raise Refused(message if str(path) in message else f"{path}: {message}") from None
    layers: list[int] = sorted(p.extras.get("partitions", {}))
    if not layers:
        raise Refused(f"{path}: the checkpoint has no MoE layers to serve")
    if layer is None:
        return checkpoint, p, layers[0]
    if layer not in layers:
        raise Refused(f"--layer {layer} is not an MoE layer of {path} ({layers})")
    return checkpoint, p, layer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint",
        type=Path,
        help="safetensors file, index or directory to load "
        "(default: generate a synthetic MoE checkpoint of --size)",
    )
    ap.add_argument(
        "--size",
        type=parse_size,
        default=256 << 20,
        help="size of the generated checkpoint (default 256MiB)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--layer", type=int, help="MoE layer to serve (default: the first)")
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda[:N] (default cpu; the tests load on cpu only)",
    )
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument(
        "--max-mb-per-s",
        type=float,
        default=0.0,
        metavar="R",
        help="pace the load to R MB/s in 64 KiB reads (0: as fast as possible)",
    )
    ap.add_argument("--log-level", default="info", help="uvicorn's log level")
    return ap.parse_args(argv)


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM before the server is up: clean up as for Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if MISSING is not None:
        print(f"skipped: {MISSING} is not installed ({INSTALL})")
        return 0
    try:
        check_device(args.device)  # before generating a checkpoint it could not load
    except Refused as err:
        print(f"server: error: {one_line(err)}", file=sys.stderr)
        return 2
    generated: Path | None = None
    # Until uvicorn takes over the signals: SIGTERM while the checkpoint is generated would
    # otherwise kill the process and leave the generated checkpoint behind.
    on_term = signal.signal(signal.SIGTERM, _terminated)
    try:
        if args.checkpoint is not None:
            path = args.checkpoint
            if not path.exists():
                print(f"server: error: {path}: no such checkpoint", file=sys.stderr)
                return 2
        else:
            generated = path = Path(tempfile.mkdtemp(prefix="asyncslab-server-"))
            t0 = time.perf_counter()
            written = write_synthetic(path, spec_for_size(args.size))
            log(
                f"generated a synthetic MoE checkpoint: {mib(written.total_bytes)}, "
                f"{written.n_tensors} tensors, {len(written.files)} files in "
                f"{time.perf_counter() - t0:.1f} s"
            )
        try:  # headers only: a checkpoint that cannot be served never starts the server
            checkpoint, p, layer = open_and_plan(path, args.layer)
        except Refused as err:
            print(f"server: error: {one_line(err)}", file=sys.stderr)
            return 2
        log(f"checkpoint: {path}")

        options = LoadOptions()
        if args.max_mb_per_s > 0:
            rate = args.max_mb_per_s * 1e6
            options = LoadOptions(read_size=PACED_READ_SIZE, max_bytes_per_s=rate)
            log(f"reads paced to {args.max_mb_per_s:g} MB/s, {PACED_READ_SIZE >> 10} KiB at a time")

        service = Service(path, checkpoint, p, layer=layer, device=args.device, options=options)
        config = uvicorn.Config(
            build_app(service),
            host=args.host,
            port=args.port,
            loop=args.loop,
            lifespan="on",
            log_level=args.log_level,
            access_log=False,
        )
        server = uvicorn.Server(config)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the
        # handler it found; this one records it, so a signalled shutdown exits 0 without a
        # KeyboardInterrupt traceback.
        received: list[int] = []

        def remember(signum: int, frame: object) -> None:
            received.append(signum)

        previous = {s: signal.signal(s, remember) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if not server.started:
            print("server: did not start (see above)", file=sys.stderr)
            return 1
        if received:
            log(f"stopped by {signal.Signals(received[0]).name}")
        return 0
    except KeyboardInterrupt:  # Ctrl-C before the server was up (e.g. while generating)
        print("\n[server] interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, on_term)
        if generated is not None and not args.keep:
            shutil.rmtree(generated, ignore_errors=True)
        elif generated is not None:
            log(f"kept {generated}")


if __name__ == "__main__":
    sys.exit(main())
