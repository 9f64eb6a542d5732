"""What one RMSNorm call costs the host and the device, forward and backward, by implementation.

    python tools/norm_cost.py [--rows 7833] [--width 2048] [--calls 200] [--json-out FILE]

The update of the 3B recipe is host-bound (its Python threads add up to one core over it), so the host's
seconds per call matter as much as the kernel's. Three implementations of Qwen2's RMSNorm
(x·rsqrt(mean(x²)+eps) in fp32, rounded to the input's dtype, times the weight), bf16 on CUDA:
  eager   transformers' module as written (cast, pow, mean, rsqrt, mul, cast, mul)
  liger   liger-kernel's LigerRMSNormFunction (Triton; what model.liger_kernel swaps in)
  torch   torch.nn.functional.rms_norm (one fused CUDA kernel each way; rounds once, after the weight)
For each: the host's microseconds per forward and per forward+backward (wall time of `--calls` calls on a
tiny input, so the device never holds the host back), the device's per forward+backward at `--rows` x
`--width` (CUDA events), and the largest difference from `eager` in the output and the input's gradient
(in bf16 ulps of the output's scale). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def eager(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def implementations(eps: float) -> dict:
    impls = {"eager": lambda x, w: eager(x, w, eps),
             "torch": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)}
    try:
        from liger_kernel.ops import LigerRMSNormFunction

        impls["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True, None)
    except ImportError:
        pass
    return impls


def host_us(fn, x: torch.Tensor, w: torch.Tensor, calls: int, backward: bool) -> float:
    """Host microseconds a call: `calls` calls on a tiny input, synchronized once at the end."""
    for _ in range(10):
        (fn(x, w).sum().backward() if backward else fn(x, w))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        y = fn(x, w)
        if backward:
            y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def device_ms(fn, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, reps: int = 20) -> float:
    for _ in range(3):
        fn(x, w).backward(grad)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(x, w).backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=7833)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/norm_cost.py needs a CUDA device")
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    big = torch.randn(args.rows, args.width, device=dev, dtype=dt, generator=g)
    grad = torch.randn(args.rows, args.width, device=dev, dtype=dt, generator=g)
    w = (1 + 0.1 * torch.randn(args.width, device=dev, generator=g)).to(dt).requires_grad_(True)
    tiny = torch.randn(8, args.width, device=dev, dtype=dt, generator=g)
    impls = implementations(args.eps)
    ref_x = big.clone().requires_grad_(True)
    ref = eager(ref_x, w, args.eps)
    ref.backward(grad)
    ref_grad = ref_x.grad.clone()
    scale = ref.detach().float().abs().max().item()
    out = {"rows": args.rows, "width": args.width, "calls": args.calls, "device": torch.cuda.get_device_name()}
    for name, fn in impls.items():
        x = big.clone().requires_grad_(True)
        y = fn(x, w)
        y.backward(grad)
        d_out = (y.detach().float() - ref.detach().float()).abs().max().item()
        d_grad = (x.grad.float() - ref_grad.float()).abs().max().item()
        tx = tiny.clone().requires_grad_(True)
        row = {"host_us_forward": host_us(fn, tiny, w, args.calls, False),
               "host_us_forward_backward": host_us(fn, tx, w, args.calls, True),
               "device_ms_forward_backward": device_ms(fn, big.clone().requires_grad_(True), w, grad),
               "max_abs_diff_out": d_out, "max_abs_diff_out_ulps": d_out / (scale * 2 ** -8),
               "max_abs_diff_grad": d_grad}
        out[name] = row
        print(f"{name:6s} host {row['host_us_forward']:7.1f} us forward, {row['host_us_forward_backward']:7.1f} us "
              f"forward+backward; device {row['device_ms_forward_backward']:.3f} ms forward+backward at "
              f"{args.rows}x{args.width}; max |out - eager| {d_out:.3e} ({row['max_abs_diff_out_ulps']:.2f} ulp of "
              f"the largest output), max |dx - eager's| {d_grad:.3e}", flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
