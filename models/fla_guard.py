"""flash-linear-attention's gated delta rule backward on Hopper with Triton in [3.4.0, 3.7.1).

fla-core 0.6.0 refuses its gated `chunk_bwd_dqkwg` (the backward of every Gated DeltaNet layer) on
Hopper with a Triton from 3.4.0 up to, not including, 3.7.1: that Triton miscompiles a `tl.trans` of
a wgmma-layout tensor in `chunk_bwd_kernel_dqkwg` (fla-org/flash-linear-attention#640, guard kept by
PR #983). The issue reports wrong results only where the kernel's key block BK is 64; on Hopper fla
tiles up to 128, so BK = min(max(next_pow2(K), 16), 128), and Qwen3.5's 128-wide key heads give
BK = 128. torch 2.11 ships such a Triton, and neither a newer Triton nor fla's tilelang backend
(which would replace the kernel) can always be installed next to vLLM.

What vlrl does, per device and before the first backward (`prepare_backward`):
- the guard would not fire (another GPU, another Triton), or fla's tilelang backend is usable:
  fla runs as it is;
- the guard would fire and BK is 128: vlrl registers a backend for `chunk_bwd_dqkwg` through fla's
  own backend registry (`fla.backends.register`), which runs fla's function with the guard lifted for
  that call only (a copy of the function that reads TRITON_ABOVE_3_7_1 as true; fla's module is not
  changed), and only on devices that passed a self-check: a small random packed problem with the
  model's head counts and widths, fla's output and gradients against the exact torch rule in fp32, in
  float16 at fla's own test tolerances (the #640 corruption showed as a g-gradient error of 0.04
  against fla's tolerance of 0.02, an error bf16's own rounding could hide) and in the model's dtype.
  A disagreement beyond tolerance refuses the run;
- the guard would fire and BK is anything else (64 is the case #640 reports wrong): refuse.
Refusals raise `DeltaRuleBackwardError`, which says what to do: Triton >= 3.7.1 or tilelang.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F

SAFE_BLOCK = 128  # the key block #640 reports correct on Hopper
ISSUE = "fla-org/flash-linear-attention#640"
REMEDY = ("upgrade Triton to >= 3.7.1 (with a torch built for it) or install tilelang (`pip install tilelang`; "
          "it needs nvcc), which fla then uses for this kernel")
CHECK_LENGTHS = (45, 64, 3, 150)  # a partial chunk, a whole one, a short one, a state carried over three chunks
GRADIENTS = ("q", "k", "v", "g", "beta")


class DeltaRuleBackwardError(RuntimeError):
    """The gated delta rule's backward on this device would be refused by fla or would be wrong."""


@dataclass(frozen=True)
class FlaFlags:
    """What fla's guard in `chunk_bwd_dqkwg` reads (fla.ops.common.chunk_o's module globals)."""

    hopper: bool
    triton_3_4_0: bool  # Triton >= 3.4.0
    triton_3_7_1: bool  # Triton >= 3.7.1
    triton_version: str

    @property
    def guarded(self) -> bool:
        """Whether fla refuses the gated backward here."""
        return self.hopper and self.triton_3_4_0 and not self.triton_3_7_1


@dataclass(frozen=True)
class RuleShape:
    """The delta rule's heads as the model calls it: key/value head counts and widths, input dtype."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class BackwardPlan:
    """How the gated backward runs on a device: `torch` (no fla), `fla` (as it is), `tilelang`
    (fla's own replacement kernel), `lifted` (vlrl's backend, after a passing self-check, whose
    relative errors per input dtype `errors` holds)."""

    route: str
    errors: dict[str, dict[str, float]] | None = None


# --- reading fla ----------------------------------------------------------------------------------
def _chunk_o():
    from fla.ops.common import chunk_o

    return chunk_o


def read_flags() -> FlaFlags:
    """fla's guard flags as its chunk_o module holds them, with the Triton version for messages."""
    chunk_o = _chunk_o()
    triton = sys.modules.get("triton")
    return FlaFlags(hopper=bool(chunk_o.IS_NVIDIA_HOPPER), triton_3_4_0=bool(chunk_o.TRITON_ABOVE_3_4_0),
                    triton_3_7_1=bool(chunk_o.TRITON_ABOVE_3_7_1),
                    triton_version=str(getattr(triton, "__version__", "unknown")))


def _tilelang_usable() -> bool:
    """Whether fla dispatches `chunk_bwd_dqkwg` to its tilelang kernel (installed, nvcc found, enabled)."""
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    except ImportError:
        return False
    return bool(CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled())


def _dispatch_enabled() -> bool:
    """False where FLA_DISABLE_BACKEND_DISPATCH=1 made fla skip every registered backend (vlrl's too)."""
    from fla import backends

    return not getattr(backends, "_DISPATCH_DISABLED", False)


@cache
def _hopper_tiling(index: int) -> bool:
    """Whether fla tiles `chunk_bwd_dqkwg` up to 128 on this device (its Hopper shared-memory test)."""
    return bool(_chunk_o().check_shared_mem("hopper", index))


def key_block(k_dim: int, hopper_tiling: bool) -> int | None:
    """fla's key block BK for `chunk_bwd_dqkwg` on Hopper-sized shared memory; None elsewhere (there
    it also depends on the dtypes of the tensors the kernel loads)."""
    if not hopper_tiling:
        return None
    return min(max(1 << max(k_dim - 1, 0).bit_length(), 16), 128)


# --- the decision -------------------------------------------------------------------------------
def refusal(reason: str, flags: FlaFlags, where: str) -> DeltaRuleBackwardError:
    """The error for a backward vlrl will not run: what, why, what to do."""
    return DeltaRuleBackwardError(
        f"Gated DeltaNet backward on {where}: flash-linear-attention refuses its gated chunk_bwd_dqkwg on Hopper "
        f"with Triton {flags.triton_version} (>= 3.4.0 and < 3.7.1 miscompile it, {ISSUE}), and vlrl runs it "
        f"anyway only where the kernel's key block is {SAFE_BLOCK} and a self-check passes; {reason}. To train "
        f"here, {REMEDY}.")


def plan_route(flags: FlaFlags, k_dim: int, hopper_tiling: bool, tilelang: bool, dispatch: bool,
               where: str = "this device") -> str:
    """`fla`, `tilelang` or `lifted` (see `BackwardPlan`) for a gated backward with key heads `k_dim`
    wide; raises DeltaRuleBackwardError where the backward would be refused or could be wrong."""
    if not flags.guarded:
        return "fla"
    if tilelang and dispatch:
        return "tilelang"
    if not dispatch:
        raise refusal("FLA_DISABLE_BACKEND_DISPATCH=1 turns off the backend vlrl registers for it (unset it)",
                      flags, where)
    block = key_block(k_dim, hopper_tiling)
    if block is None:
        raise refusal(f"fla's Hopper tiling is off on this device, so its key block for {k_dim}-wide key heads "
                      "is not known", flags, where)
    if block != SAFE_BLOCK:
        raise refusal(f"the model's {k_dim}-wide key heads (linear_key_head_dim) give a block of {block}"
                      + (", the case the issue reports wrong" if block == 64 else ", which the issue does not clear"),
                      flags, where)
    return "lifted"


# --- the lifted backend -------------------------------------------------------------------------
_cleared: set[int] = set()  # CUDA device indices on which the lifted kernel may run (self-check passed or running)


def accepts_call(flags: FlaFlags, gated: bool, device_index: int | None, k_dim: int,
                 hopper_tiling: bool) -> tuple[bool, str | None]:
    """Whether vlrl's backend takes a `chunk_bwd_dqkwg` call (fla's verifier contract: ok, reason)."""
    if not (gated and flags.guarded):
        return False, "fla's guard does not fire for this call"
    if device_index not in _cleared:
        return False, f"cuda:{device_index} has not passed vlrl's Gated DeltaNet backward self-check"
    if key_block(k_dim, hopper_tiling) != SAFE_BLOCK:
        return False, f"key block for K={k_dim} is not {SAFE_BLOCK}"
    return True, None


def unguarded(function: Callable) -> Callable:
    """A copy of fla's `chunk_bwd_dqkwg` (undecorated) that reads TRITON_ABOVE_3_7_1 as true: its guard
    stays quiet, everything else it does is unchanged, and its module keeps its own flags."""
    raw = inspect.unwrap(function)
    if "TRITON_ABOVE_3_7_1" not in raw.__code__.co_names:
        raise DeltaRuleBackwardError(
            f"fla's {raw.__module__}.{raw.__name__} is not the function vlrl lifts the #640 guard of (written "
            f"against fla-core 0.6.0); {REMEDY}")
    scope = dict(raw.__globals__, TRITON_ABOVE_3_7_1=True)
    copy = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    copy.__kwdefaults__ = raw.__kwdefaults__
    return copy


@cache
def install_backend() -> None:
    """Register vlrl's `chunk_bwd_dqkwg` backend with fla (once per process). It sorts after fla's
    tilelang backend and takes only the calls `accepts_call` clears; fla runs the rest as it would."""
    from fla.backends import BaseBackend, register

    chunk_o = _chunk_o()
    lifted = unguarded(chunk_o.chunk_bwd_dqkwg)
    flags = read_flags()  # fla sets them once at import; the verifier runs on every backward call

    class LiftedHopperGuard(BaseBackend):
        backend_type = "vlrl_lifted_hopper_guard"
        priority = 8  # after tilelang (5): where that kernel is usable it is the better fix

        def chunk_bwd_dqkwg_verifier(self, q, k, *args, g=None, **kwargs):
            return accepts_call(flags, g is not None, k.device.index, k.shape[-1],
                                k.is_cuda and _hopper_tiling(k.device.index))

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return lifted(*args, **kwargs)

    register("common")(LiftedHopperGuard)


# --- the self-check -----------------------------------------------------------------------------
def tolerance(name: str, dtype: torch.dtype) -> float:
    """The largest relative RMS error accepted for output or gradient `name` in `dtype`. float16: fla's
    own test tolerances for this rule (0.005 to 0.008, 0.02 for the gates) with a little room; the
    gates' gradients are sums of differences and noisier. bfloat16 keeps three fewer mantissa bits in
    fla's intermediates: only a gross error is caught there."""
    base = {torch.float16: 0.01, torch.float32: 0.01}.get(dtype, 0.05)
    return 2 * base if name in ("g", "beta") else base


def check_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The self-check's input dtypes: float16 (fine enough to see #640's corruption) and the model's."""
    return (torch.float16,) if dtype == torch.float16 else (torch.float16, dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """RMS of the difference over RMS of the reference (fla's own test metric); inf where not finite."""
    got, want = got.detach().float(), want.detach().float()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).square().mean().sqrt() / (want.square().mean().sqrt() + 1e-12)).item()


def _check_problem(shape: RuleShape, device: torch.device, lengths) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                         torch.Tensor]:
    """Inputs of the delta rule over one packed row (1, L, heads, dim), its cu_seqlens and an output
    gradient; seeded on its own generator (the run's random state is left alone)."""
    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)

    def draw(*size):
        return torch.randn(*size, generator=gen, device=device)

    q = draw(1, total, shape.k_heads, shape.k_dim).to(shape.dtype)
    k = draw(1, total, shape.k_heads, shape.k_dim).to(shape.dtype)
    v = draw(1, total, shape.v_heads, shape.v_dim).to(shape.dtype)
    g = F.logsigmoid(draw(1, total, shape.v_heads))  # log decay < 0, fp32 as the layer computes it
    beta = torch.rand(1, total, shape.v_heads, generator=gen, device=device).to(shape.dtype)
    grad_out = draw(1, total, shape.v_heads, shape.v_dim).to(shape.dtype)
    cu = torch.tensor((0, *lengths), device=device).cumsum(0)
    return [q, k, v, g, beta], cu, grad_out


def gradient_errors(rule: Callable, reference: Callable, shape: RuleShape, device: torch.device,
                    lengths=CHECK_LENGTHS) -> dict[str, float]:
    """Relative errors of `rule(q, k, v, g, beta, cu)`'s output and input gradients on a random packed
    problem against `reference` run on the same values in fp32."""
    inputs, cu, grad_out = _check_problem(shape, device, lengths)
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):  # the reference stays fp32
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = rule(*leaves, cu)
        got = [out, *torch.autograd.grad(out, leaves, grad_out)]
        exact = [t.float().requires_grad_() for t in inputs]
        ref = reference(*exact, cu)
        want = [ref, *torch.autograd.grad(ref, exact, grad_out.float())]
    return {name: relative_error(a, b) for name, a, b in zip(("out", *GRADIENTS), got, want)}


def check_backward(rule: Callable, reference: Callable, shape: RuleShape,
                   device: torch.device) -> dict[str, dict[str, float]]:
    """`gradient_errors` in each of `check_dtypes(shape.dtype)` (keyed by dtype name), raising
    DeltaRuleBackwardError where one is past its tolerance."""
    errors = {}
    for dtype in check_dtypes(shape.dtype):
        found = gradient_errors(rule, reference, replace(shape, dtype=dtype), device)
        errors[str(dtype).removeprefix("torch.")] = found
        bad = {name: e for name, e in found.items() if not e <= tolerance(name, dtype)}
        if bad:
            listed = ", ".join(f"{name} {e:.3g} (tolerance {tolerance(name, dtype):g})" for name, e in bad.items())
            raise DeltaRuleBackwardError(
                f"Gated DeltaNet backward on {device}: flash-linear-attention's kernels, run past fla's guard for "
                f"{ISSUE}, disagree with the exact torch rule on a self-check ({shape.k_heads}/{shape.v_heads} "
                f"key/value heads of {shape.k_dim}/{shape.v_dim}, {dtype}, packed lengths {list(CHECK_LENGTHS)}): "
                f"relative error {listed}. This Triton miscompiles the kernel here; {REMEDY}.")
    return errors


# --- once per device ----------------------------------------------------------------------------
_plans: dict[tuple[int, int], BackwardPlan] = {}  # by (device index, key head width)


def prepare_backward(device: torch.device, shape: RuleShape, rule: Callable, reference: Callable) -> BackwardPlan:
    """Decide, once per CUDA device (and key head width), how fla's gated backward runs there (see the
    module docstring), running the self-check where vlrl lifts fla's guard; raises DeltaRuleBackwardError
    where it will not."""
    if device.type != "cuda":
        return BackwardPlan("torch")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, shape.k_dim) in _plans:
        return _plans[index, shape.k_dim]
    where = f"cuda:{index}"
    route = plan_route(read_flags(), shape.k_dim, _hopper_tiling(index), _tilelang_usable(), _dispatch_enabled(),
                       where)
    errors = None
    if route == "lifted":
        install_backend()
        _cleared.add(index)
        try:
            errors = check_backward(rule, reference, shape, torch.device("cuda", index))
        except BaseException:
            _cleared.discard(index)
            raise
        shown = "; ".join(f"{dtype} " + ", ".join(f"{name} {e:.2g}" for name, e in found.items())
                          for dtype, found in errors.items())
        print(f"Gated DeltaNet backward on {where}: fla's #640 guard lifted for key block {SAFE_BLOCK} after a "
              f"self-check against the torch rule (relative errors {shown})", flush=True)
    _plans[index, shape.k_dim] = BackwardPlan(route, errors)
    return _plans[index, shape.k_dim]
