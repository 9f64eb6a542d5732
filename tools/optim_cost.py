"""The host's cost of the optimizer phase over one-device DTensors: the gradient clip and an AdamW step, torch's
over the DTensors against the trainer's on their local tensors (grpo.update.clip_gradients, grpo.update.AdamW).

    python tools/optim_cost.py                      # 825 parameters (the 3B Qwen2.5-VL's count), 64 values each
    python tools/optim_cost.py --params 400 --numel 4096 --repeats 50

The tensors are tiny, so the times are the host's (Python, DTensor's dispatch, the ops' launches), the part a GPU
waits through. Medians of `--repeats` calls after one warm-up, in milliseconds, one JSON line.
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

from grpo.update import AdamW, clip_gradients  # noqa: E402
from models.parallel import init_distributed  # noqa: E402


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 3)


def measure(params: int = 825, numel: int = 64, repeats: int = 20) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init_distributed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (1,))
    tensors = [torch.nn.Parameter(distribute_tensor(torch.randn(numel, device=device), mesh, [Shard(0)]))
               for _ in range(params)]
    for p in tensors:
        p.grad = distribute_tensor(torch.randn(numel, device=device), mesh, [Shard(0)])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    out = {"device": device, "params": params, "numel": numel, "repeats": repeats, "optimizer": next(iter(fused))}
    out["clip_torch_ms"] = _median_ms(lambda: (torch.nn.utils.clip_grad_norm_(tensors, 1.0), sync()), repeats)
    out["clip_local_ms"] = _median_ms(lambda: (clip_gradients(tensors, 1.0), sync()), repeats)
    for name, cls in (("adamw_torch_ms", torch.optim.AdamW), ("adamw_local_ms", AdamW)):
        optimizer = cls(tensors, lr=1e-6, **fused)
        out[name] = _median_ms(lambda: (optimizer.step(), sync()), repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=825)
    p.add_argument("--numel", type=int, default=64, help="values per parameter")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.params, args.numel, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
