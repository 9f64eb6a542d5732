"""What `trainer.gpu_telemetry`'s NVML thread costs a host-bound GPU loop, like a decode step's.

    python tools/telemetry_cost.py [--steps 400] [--rounds 3] [--interval-s 0.05] [--json-out FILE]

Each step launches a decode-like step (`--graph`: one CUDA graph replay of `--layers` small layers at
`--batch` rows; else the same kernels eagerly), reads one value back to the host (a sampled token's wait) and
spends `--host-ms` in Python (a scheduler's bookkeeping). Rounds alternate telemetry off and on (the
trainer's sampler, `rollout.telemetry.build_telemetry("true", ...)`, with the generation phase open) and
print each round's mean step time; the JSON holds them and `on_over_off`, the ratio of the medians. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.telemetry import build_telemetry  # noqa: E402


def decode_step(weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = x
    for w in weights:
        h = torch.nn.functional.silu(h @ w) + h
    return h


def timed_steps(run, steps: int, host_s: float) -> float:
    """Mean seconds a step: run(), one value back to the host, host_s of Python work."""
    t0 = time.perf_counter()
    for _ in range(steps):
        out = run()
        float(out[0, 0])
        end = time.perf_counter() + host_s
        n = 0
        while time.perf_counter() < end:
            n += 1
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--host-ms", type=float, default=1.0)
    p.add_argument("--interval-s", type=float, default=0.05)
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/telemetry_cost.py needs a CUDA device")
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(args.width, args.width, device=device, dtype=torch.bfloat16, generator=g) * 0.01
               for _ in range(args.layers)]
    x = torch.randn(args.batch, args.width, device=device, dtype=torch.bfloat16, generator=g)
    run = lambda: decode_step(weights, x)  # noqa: E731
    if args.graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                decode_step(weights, x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = decode_step(weights, x)

        def run():
            graph.replay()
            return static_out
    timed_steps(run, 50, args.host_ms / 1000)  # warm-up
    telemetry = build_telemetry("true", device, args.interval_s, ("perf/gen_s",))
    rounds: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on"):
            if mode == "on":
                with telemetry:
                    telemetry.open = ("perf/gen_s",)
                    s = timed_steps(run, args.steps, args.host_ms / 1000)
                    telemetry.open = ()
            else:
                s = timed_steps(run, args.steps, args.host_ms / 1000)
            rounds[mode].append(s)
            print(f"round {r + 1} telemetry {mode:3s}: {1000 * s:.3f} ms a step", flush=True)
    ratio = statistics.median(rounds["on"]) / statistics.median(rounds["off"])
    print(f"telemetry on / off, median step: {ratio:.4f} ({'graph' if args.graph else 'eager'}, {args.layers} layers, "
          f"batch {args.batch}, host {args.host_ms} ms, NVML every {1000 * args.interval_s:.0f} ms)")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"graph": args.graph, "layers": args.layers, "batch": args.batch,
                                             "host_ms": args.host_ms, "interval_s": args.interval_s,
                                             "step_s_off": rounds["off"], "step_s_on": rounds["on"],
                                             "on_over_off": ratio}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
