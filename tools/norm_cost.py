"""What one call of a decoder's small fused ops costs the host and the device, forward and backward, by
implementation: RMSNorm (the default), SwiGLU's gate and rotary embeddings (`--op`).

    python tools/norm_cost.py [--op rms_norm|swiglu|rope] [--rows 7833] [--width 2048] [--calls 200]
                              [--json-out FILE]

The update of the 3B recipe is host-bound (its Python threads add up to one core over it), so the host's
seconds per call matter as much as the kernel's. bf16 on CUDA:
  rms_norm  eager: transformers' Qwen2 RMSNorm as written (x·rsqrt(mean(x²)+eps) in fp32, rounded, times the
            weight); liger: LigerRMSNormFunction (what model.liger_kernel swaps in); torch:
            torch.nn.functional.rms_norm (one fused CUDA kernel each way; rounds once, after the weight)
  swiglu    eager: silu(gate) * up, at `--width` intermediate columns; liger: LigerSiLUMulFunction
  rope      eager: transformers' apply_rotary_pos_emb on q (16 heads) and k (2 heads) of 128 over `--rows`
            positions; liger: liger_rotary_pos_emb
For each: the host's microseconds per forward and per forward+backward (wall time of `--calls` calls on a
tiny input, so the device never holds the host back), the wall per forward+backward at `--rows` x `--width`
(the longer of the host's and the kernels' time per call; CUDA events), and the largest difference from
`eager` in the output and the first input's gradient (the output's in bf16 ulps of its largest value). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def eager_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def inputs(op: str, rows: int, width: int, device, g: torch.Generator) -> tuple[list[torch.Tensor], list]:
    """(the inputs that take gradients, the constant arguments) of one call of `op`."""
    dt = torch.bfloat16
    if op == "rms_norm":
        x = torch.randn(rows, width, device=device, dtype=dt, generator=g)
        w = (1 + 0.1 * torch.randn(width, device=device, generator=g)).to(dt)
        return [x, w], []
    if op == "swiglu":
        return [torch.randn(rows, width, device=device, dtype=dt, generator=g) for _ in range(2)], []
    q = torch.randn(1, 16, rows, 128, device=device, dtype=dt, generator=g)
    k = torch.randn(1, 2, rows, 128, device=device, dtype=dt, generator=g)
    angles = torch.rand(1, rows, 64, device=device, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    return [q, k], [emb.cos().to(dt), emb.sin().to(dt)]


def implementations(op: str, eps: float) -> dict:
    """name -> fn(*inputs, *constants) returning a tensor or a tuple of them."""
    if op == "rms_norm":
        impls = {"eager": lambda x, w: eager_rms_norm(x, w, eps),
                 "torch": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)}
    elif op == "swiglu":
        impls = {"eager": lambda a, b: torch.nn.functional.silu(a) * b}
    else:
        impls = {"eager": eager_rope}
    try:
        if op == "rms_norm":
            from liger_kernel.ops import LigerRMSNormFunction

            impls["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True, None)
        elif op == "swiglu":
            from liger_kernel.ops import LigerSiLUMulFunction

            impls["liger"] = lambda a, b: LigerSiLUMulFunction.apply(a, b, 1.0, 1.0)
        else:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            impls["liger"] = liger_rotary_pos_emb
    except ImportError:
        pass
    return impls


def _outputs(y) -> tuple[torch.Tensor, ...]:
    return y if isinstance(y, tuple) else (y,)


def _call(fn, grads: list[torch.Tensor], constants: list, weights: tuple[torch.Tensor, ...] | None):
    """A forward on fresh leaves, then (with `weights`) a backward of sum(output · weight)."""
    leaves = [t.detach().requires_grad_() for t in grads]
    out = _outputs(fn(*leaves, *constants))
    if weights is not None:
        torch.autograd.backward(out, weights)
    return out, leaves


def host_us(fn, grads, constants, calls: int, backward: bool) -> float:
    """Host microseconds a call: `calls` calls on a tiny input, synchronized once at the end."""
    weights = tuple(torch.ones_like(o) for o in _outputs(fn(*grads, *constants))) if backward else None
    for _ in range(10):
        _call(fn, grads, constants, weights)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        _call(fn, grads, constants, weights)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def wall_ms(fn, grads, constants, weights, reps: int = 20) -> float:
    for _ in range(3):
        _call(fn, grads, constants, weights)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        _call(fn, grads, constants, weights)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("rms_norm", "swiglu", "rope"), default="rms_norm")
    p.add_argument("--rows", type=int, default=7833)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/norm_cost.py needs a CUDA device")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    big, constants = inputs(args.op, args.rows, args.width, dev, g)
    tiny, tiny_constants = inputs(args.op, 8, args.width, dev, g)
    weights = tuple(torch.randn(o.shape, device=dev, dtype=o.dtype, generator=g)
                    for o in _outputs(implementations(args.op, args.eps)["eager"](*big, *constants)))
    ref, ref_leaves = _call(implementations(args.op, args.eps)["eager"], big, constants, weights)
    scale = ref[0].detach().float().abs().max().item()
    out = {"op": args.op, "rows": args.rows, "width": args.width, "calls": args.calls,
           "device": torch.cuda.get_device_name()}
    for name, fn in implementations(args.op, args.eps).items():
        y, leaves = _call(fn, big, constants, weights)
        d_out = max((a.detach().float() - b.detach().float()).abs().max().item() for a, b in zip(y, ref))
        d_grad = (leaves[0].grad.float() - ref_leaves[0].grad.float()).abs().max().item()
        row = {"host_us_forward": host_us(fn, tiny, tiny_constants, args.calls, False),
               "host_us_forward_backward": host_us(fn, tiny, tiny_constants, args.calls, True),
               "wall_ms_forward_backward": wall_ms(fn, big, constants, weights),
               "max_abs_diff_out": d_out, "max_abs_diff_out_ulps": d_out / (scale * 2 ** -8),
               "max_abs_diff_grad": d_grad}
        out[name] = row
        print(f"{args.op} {name:6s} host {row['host_us_forward']:7.1f} us forward, "
              f"{row['host_us_forward_backward']:7.1f} us forward+backward; wall {row['wall_ms_forward_backward']:.3f} "
              f"ms forward+backward at {args.rows}x{args.width}; max |out - eager| {d_out:.3e} "
              f"({row['max_abs_diff_out_ulps']:.2f} ulp of the largest output), max |grad - eager's| {d_grad:.3e}",
              flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
