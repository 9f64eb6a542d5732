"""Exact on-policy mode (`rollout.exact=true`): the engine's and the policy's forwards computed by the same
kernels in the same order, so the sampled tokens' logprobs agree bit for bit (docs/fidelity.md, "Exact mode").

The vLLM engine runs in the trainer's own process, which is what makes this possible with little code:

- **Matmuls, softmax, log-softmax, mean.** vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT=1`, read when
  vLLM is imported) registers its own kernels for aten ops through `torch.library` on the CUDA dispatch key
  (log_softmax, softmax, mean.dim and bmm everywhere; mm/addmm/matmul/linear on SM80) and limits cuBLAS's
  workspace so Hopper GEMMs never split K. A dispatcher override is process-wide: the policy's
  `torch.log_softmax`, `mean` and `bmm` reach the same kernels as the engine's. The cuBLAS settings are
  environment variables torch reads once, at the first GEMM, so `prepare_process` sets them before the
  policy is built.
- **RMSNorm, SwiGLU, rotary.** vLLM's custom ops (a fused add + RMSNorm kernel, a fused SiLU-and-mul kernel,
  a Triton m-rope kernel) round differently from transformers' modules. `patch_vllm` routes them, before the
  engine builds its model, to the torch code transformers runs: the residual added in the model dtype, then
  `rms_norm` below; `silu(gate) * up` in two ops; `q * cos ± rotate(q) * sin` in the model dtype, with the
  cos/sin table rebuilt from the policy's own `inv_freq` on the GPU (`align_engine`).
- **Attention.** The engine runs vLLM's FlashAttention backend with one KV split (what batch-invariant mode
  sets), which is invariant between prefill and decode. The policy's language model calls the same
  function, `flash_attn_varlen_func`, on the same paged layout (K/V in 16-token blocks with a block table),
  so a training row is one prefill of all its sequences (`models.attention.engine_flash_attention`, also
  `model.attn_implementation=vllm_paged` on its own, without the rest of the mode); its backward recomputes the
  attention with torch's own kernel (the backward may differ). The vision tower runs torch's SDPA per window
  on both sides (vLLM's `mm_encoder_attn_backend="TORCH_SDPA"`).
- **Logprobs.** vLLM 0.26's V2 model runner computes the sampled tokens' logprobs with its own Triton kernels
  on model-dtype logits (logit bias, temperature, then a blockwise log-softmax); the policy's forward value
  comes from the same kernels (`v2_token_logprobs`), its gradient from torch's log_softmax over fp32 logits
  after the banned tokens' bias and the temperature, in that order (`Policy.exact_logit_bias`). Under the V1
  runner both sides take that log_softmax.
- **Projections.** vLLM multiplies by [q; k; v] and [gate; up] in one GEMM each; the policy's separate
  layers are computed the same way (`_FusedLinears`), so every output column comes from the same GEMM shape.
- **The engine's schedule.** Eager (no CUDA graphs, and no torch.compile, `compilation_config` mode 0:
  Inductor would fuse the ops above into other kernels), no prefix caching, no chunked prefill, no cascade
  attention over the shared prompt.

What vLLM's batch-invariant mode replaces is as read in vLLM's source (docs/fidelity.md gives the commits);
the engine records what the installed version did (`ExactMode.report`), and every patch below reports
"routed" or "not found", so a module vLLM 0.26 names differently shows in the report, and op_diff --exact
names the first module that still differs.

Covered: Qwen2.5-VL (`EXACT_FAMILIES`). Everything that needs vLLM or CUDA is imported inside functions;
the CPU tests exercise the paged layout, the routing and the validation.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from models.attention import ENGINE_FLASH_NAME, KV_BLOCK, register_engine_flash

log = logging.getLogger(__name__)

EXACT_FAMILIES = ("qwen2_5_vl",)
ATTENTION_NAME = ENGINE_FLASH_NAME  # the language model's attention: vLLM's FlashAttention call (models/attention.py)
VISION_ATTENTION_NAME = "vlrl_exact_vision"
BAN_BIAS = -100.0  # the logit bias the vLLM engine puts on banned tokens (rollout/vllm_engine.py)
# How the engine in this process computes the sampled tokens' logprobs: "v2" (vLLM's V2 model runner: its own
# Triton kernels) or "v1" (torch's log_softmax over fp32 logits). The engine sets it once built; the policy and
# the reference (each with its own ExactMode) read it.
ENGINE_SAMPLER = {"path": "v2"}

# What vLLM 0.26's batch-invariant mode reads or sets for itself; set here before anything touches cuBLAS.
PROCESS_ENV = {
    "VLLM_BATCH_INVARIANT": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":16:8",  # no split-K GEMMs on Hopper (vLLM's enable_batch_invariant_mode)
    "CUBLASLT_WORKSPACE_SIZE": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}


def prepare_process() -> dict:
    """Set the environment and torch flags of batch-invariant mode. Call before the policy runs any GEMM
    (torch reads the cuBLAS workspace settings once) and before vLLM is imported. Returns what it set."""
    os.environ.update(PROCESS_ENV)
    cuda = torch.backends.cuda.matmul
    cuda.allow_tf32 = False
    cuda.allow_bf16_reduced_precision_reduction = False
    cuda.allow_fp16_reduced_precision_reduction = False
    torch.backends.cudnn.allow_tf32 = False
    if torch.cuda.is_available():
        torch.backends.cuda.preferred_blas_library("cublaslt")
    return dict(PROCESS_ENV)


def check_family(family: str) -> None:
    if family not in EXACT_FAMILIES:
        raise ValueError(f"config key 'rollout.exact' is true but model.path is a {family} model; the exact mode "
                         f"covers {', '.join(EXACT_FAMILIES)}")


def check_device() -> None:
    """The mode needs CUDA and vLLM (the engine's kernels are the ones both sides run)."""
    if not torch.cuda.is_available():
        raise RuntimeError("config key 'rollout.exact' is true but no CUDA device is visible; the exact mode runs "
                           "vLLM's kernels on both sides, so it needs a GPU and rollout.engine vllm")
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise RuntimeError("config key 'rollout.exact' is true but vLLM is not installed") from err


# --- the shared numerics -------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2RMSNorm: fp32 statistics, the normalized value rounded to x's dtype, times weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _policy_rms_norm(module):
    def forward(hidden_states):
        return rms_norm(hidden_states, module.weight, module.variance_epsilon)

    return forward


def _engine_rms_norm(self, x, residual=None):
    """vLLM's RMSNorm(x[, residual]) with transformers' rounding: the residual add in the model dtype."""
    if residual is not None:
        x = residual + x
        residual = x
    out = rms_norm(x, self.weight, self.variance_epsilon)
    return out if residual is None else (out, residual)


def _engine_silu_and_mul(self, x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_vision for one tensor: in fp32, rounded back to x's dtype once.
    cos/sin (..., D/2) are repeated to the head dim as vLLM's `apply_rotary_emb_torch` does."""
    cos, sin = (torch.cat((c, c), dim=-1).unsqueeze(-2).float() for c in (cos, sin))
    xf = x.float()
    return ((xf * cos) + (rotate_half(xf) * sin)).to(x.dtype)


@functools.cache
def _engine_linear_fn():
    """vLLM's `linear_batch_invariant`, or None without vLLM. Under VLLM_BATCH_INVARIANT its unquantized linear
    layers and its lm_head call it on CUDA (`UnquantizedLinearMethod.apply`, `UnquantizedEmbeddingMethod.apply`):
    on Hopper too, where the aten::mm override is not registered, it runs vLLM's persistent Triton matmul (fixed
    tiles, so a row's bits do not depend on how many rows share the call) and adds the bias after, in the model
    dtype. cuBLAS's F.linear is neither the same kernel nor the same bias rounding (one rounding, in its epilogue)."""
    try:
        from vllm.model_executor.layers.batch_invariant import linear_batch_invariant
    except ImportError:
        return None
    return linear_batch_invariant


class _EngineLinear(torch.autograd.Function):
    """Forward: vLLM's batch-invariant linear (the engine's bits). Backward: the gradients of x·Wᵀ + b by torch's
    GEMMs (the backward may differ from F.linear's in the last bits; the engine has none)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        w = weight.to(x.dtype)  # FSDP's unsharded parameters are already in the compute dtype
        return _engine_linear_fn()(x, w, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = (g @ weight.to(g.dtype)).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = g.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


# How the engine's linear layers multiply in this process: "batch_invariant" (vLLM 0.26 under VLLM_BATCH_INVARIANT:
# `linear_batch_invariant`) or "torch" (F.linear, a vLLM whose UnquantizedLinearMethod does not call it);
# `patch_vllm` reads the installed vLLM's.
ENGINE_LINEAR = {"path": "batch_invariant"}


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·Wᵀ + b as the engine's layers compute it in exact mode: vLLM's `linear_batch_invariant` on CUDA (the
    policy's gradient from torch's GEMMs), F.linear without CUDA or vLLM or where the engine uses F.linear."""
    if x.is_cuda and ENGINE_LINEAR["path"] == "batch_invariant" and _engine_linear_fn() is not None:
        return _EngineLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def _policy_linear(module):
    def forward(x):
        return exact_linear(x, module.weight, module.bias)

    return forward


def patch_embed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The vision patch embedding as one matmul over flattened patches (a Conv3d whose stride is its kernel):
    (patches, C·T·P·P) → (patches, E), whatever shape the weight is stored in; through `exact_linear` on both
    sides (the engine encodes other images per call than the policy: a row-invariant kernel)."""
    w = weight.reshape(weight.shape[0], -1)
    return exact_linear(x.reshape(-1, w.shape[1]).to(w.dtype), w)


def _policy_patch_embed(module):
    def forward(hidden_states):
        return patch_embed(hidden_states, module.proj.weight)

    return forward


def _engine_patch_embed(self, x):
    return patch_embed(x, self.proj.weight)


class _FusedLinears:
    """Linear layers that read the same input computed as one GEMM over their concatenated weights, as vLLM's
    QKVParallelLinear and MergedColumnParallelLinear do ([q; k; v], [gate; up]), then split. Each member's
    forward returns its slice; the GEMM runs when the first member sees a new input."""

    def __init__(self, members: list):
        self.members = members
        self.sizes = [m.weight.shape[0] for m in members]
        self.key, self.parts, self.served = None, None, 0

    def forward_of(self, index: int):
        def forward(x):
            if self.key is not x:
                weight = torch.cat([m.weight for m in self.members])
                biases = [m.bias for m in self.members]
                bias = torch.cat(biases) if all(b is not None for b in biases) else None
                self.key, self.parts, self.served = x, exact_linear(x, weight, bias).split(self.sizes, dim=-1), 0
            out = self.parts[index]
            self.served += 1
            if self.served == len(self.members):  # all read: hold no activation past the layer
                self.key, self.parts = None, None
            return out

        return forward


def _fuse(module, names: tuple[str, ...]) -> bool:
    members = [getattr(module, n, None) for n in names]
    if not all(isinstance(m, torch.nn.Linear) for m in members):
        return False
    fused = _FusedLinears(members)
    for i, m in enumerate(members):
        m.forward = fused.forward_of(i)
    return True


def _policy_text_rope(module):
    """The language model's m-rope cos/sin with the angle as an elementwise fp32 product (as vLLM's table is
    built): a K=1 matmul would go through batch-invariant mode's Triton bmm, which rounds its inputs to TF32."""

    def forward(x, position_ids):
        if position_ids.ndim == 2:
            position_ids = position_ids.expand(3, -1, -1)
        freqs = position_ids[..., None].float() * module.inv_freq.to(device=x.device, dtype=torch.float)
        scale = getattr(module, "attention_scaling", 1.0)
        if hasattr(module, "recomposition_frequencies"):
            cos, sin = (module.recomposition_frequencies(f * scale) for f in (freqs.cos(), freqs.sin()))
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * scale, emb.sin() * scale
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    return forward


def exact_vision_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    """One window of the vision tower through torch SDPA, as vLLM's TORCH_SDPA encoder backend runs each window
    (transformers splits the windows itself for an implementation without "flash" in its name)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=False)


def no_mask(*args, **kwargs):
    """The vision windows are split by transformers; no mask is read."""
    return None


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register_engine_flash()
    AttentionInterface.register(VISION_ATTENTION_NAME, exact_vision_attention)
    AttentionMaskInterface.register(VISION_ATTENTION_NAME, no_mask)


# --- the mode ----------------------------------------------------------------------------------------------------
@dataclass
class ExactMode:
    """What both sides need to agree: the family, the policy's rotary inverse frequencies, the banned tokens."""

    family: str
    inv_freq: torch.Tensor | None = None  # the policy's language-model rotary buffer (CPU copy)
    vision_inv_freq: torch.Tensor | None = None  # the policy's vision rotary buffer (CPU copy)
    banned_token_ids: tuple[int, ...] = ()
    report: dict = field(default_factory=dict)  # what was patched and found, for logs and the GPU stage
    # rollout.exact_cuda_graphs: decode steps replayed from CUDA graphs (no compilation) instead of eager
    cuda_graphs: bool = False

    def engine_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor | None:
        """The values the engine reports for these logits (model dtype) and targets, or None where the policy's
        own log_softmax already computes them (the V1 sampler, or no CUDA)."""
        if ENGINE_SAMPLER["path"] != "v2" or not logits.is_cuda:
            return None
        return v2_token_logprobs(logits, targets, temperature, self.banned_token_ids, BAN_BIAS)

    def engine_kwargs(self, max_model_len: int) -> dict:
        """`LLM(...)` arguments of the mode (enforce_eager is forced by the engine itself). Where the installed
        vLLM's EngineArgs lacks one, it is left out and named in `report["engine_kwargs_dropped"]` (the decoder
        backend then goes through `attention_backend` or the VLLM_ATTENTION_BACKEND variable)."""
        kwargs = {
            "attention_config": {"backend": "FLASH_ATTN"},
            "mm_encoder_attn_backend": "TORCH_SDPA",
            "block_size": KV_BLOCK,
            "enable_prefix_caching": False,
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(max_model_len, 16384),
            # the G responses of a prompt share its prefix: cascade attention would attend to it in a separate
            # kernel call and merge the two softmaxes, another reduction than the policy's one pass
            "disable_cascade_attn": True,
        }
        from rollout.vllm_engine import uncompiled_config

        compilation = uncompiled_config(self.cuda_graphs)
        if compilation is not None:
            kwargs["compilation_config"] = compilation
        fields = _engine_arg_names()
        if fields is None:
            return kwargs
        if "attention_config" not in fields:
            del kwargs["attention_config"]
            if "attention_backend" in fields:
                kwargs["attention_backend"] = "FLASH_ATTN"
            else:
                os.environ["VLLM_ATTENTION_BACKEND"] = "FLASH_ATTN"
        dropped = sorted(k for k in kwargs if k not in fields)
        if dropped:
            self.report["engine_kwargs_dropped"] = dropped
        return {k: v for k, v in kwargs.items() if k in fields}

    def apply_to_policy(self, policy) -> None:
        """Route the policy's attention, RMSNorm and logprobs to the exact implementations (in place)."""
        check_family(policy.adapter.name)
        policy.exact_logit_bias = (tuple(self.banned_token_ids), BAN_BIAS)
        policy.exact_engine_logprobs = self.engine_logprobs
        self.report["policy"] = apply_exact_modules(policy.model, policy.adapter)


def v2_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, banned: tuple[int, ...],
                      bias: float) -> torch.Tensor:
    """The sampled tokens' logprobs as vLLM 0.26's V2 sampler computes them ("processed_logprobs"), without grad:
    its logits stay in the model dtype, the banned tokens' bias is added in fp32 and stored back (its logit-bias
    kernel), the temperature is applied by its own kernel (an fp32 divide, stored back), and its top-k
    log-softmax kernel takes the row's max, then a sum of exp over 1024-wide blocks, at the targets. Calling
    vLLM's kernels is what makes the values the same bits; the policy's gradient still comes from torch's
    log_softmax."""
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    with torch.no_grad():
        processed = logits.detach().clone()
        if banned:
            index = torch.tensor(banned, device=processed.device)
            processed[:, index] = (processed[:, index].float() + bias).to(processed.dtype)
        if temperature not in (0.0, 1.0):
            rows = torch.zeros(processed.shape[0], dtype=torch.int32, device=processed.device)
            apply_temperature(processed, rows, torch.tensor([temperature], dtype=torch.float32, device=processed.device))
        return compute_token_logprobs(processed, targets.reshape(-1, 1).to(torch.int64)).reshape(-1)


def _engine_arg_names() -> set[str] | None:
    """The fields of the installed vLLM's EngineArgs (what `LLM(...)` takes), or None without vLLM."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(EngineArgs)}


def apply_exact_modules(model, adapter) -> int:
    """Set the exact attention implementations on the language model and the vision tower; every RMSNorm to
    `rms_norm`, the text rotary to `_policy_text_rope`, the patch embedding to `patch_embed`, q/k/v and gate/up
    to one GEMM each (the engine's fused projections), every linear layer to `exact_linear` (the engine's
    batch-invariant GEMM and bias add). Returns the counts."""
    register_attention()
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION_NAME
    adapter.vision_tower(model).config._attn_implementation = VISION_ATTENTION_NAME
    routed = {"rms_norm": 0, "text_rope": 0, "patch_embed": 0, "fused_qkv": 0, "fused_gate_up": 0, "linear": 0}
    for m in model.modules():
        routed["fused_qkv"] += _fuse(m, ("q_proj", "k_proj", "v_proj"))
        routed["fused_gate_up"] += _fuse(m, ("gate_proj", "up_proj"))
    for m in model.modules():  # after the fusing: the fused members have their forward already
        kind = type(m).__name__
        if isinstance(m, torch.nn.Linear) and "forward" not in m.__dict__:  # o_proj, down_proj, vision, lm_head
            m.forward = _policy_linear(m)
            routed["linear"] += 1
        elif kind.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            m.forward = _policy_rms_norm(m)
            routed["rms_norm"] += 1
        elif kind.endswith("RotaryEmbedding") and "Vision" not in kind and hasattr(m, "inv_freq"):
            m.forward = _policy_text_rope(m)
            routed["text_rope"] += 1
        elif kind.endswith("PatchEmbed") and hasattr(m, "proj"):
            m.forward = _policy_patch_embed(m)
            routed["patch_embed"] += 1
    return routed


def engine_mode(policy, cuda_graphs: bool = False) -> ExactMode:
    """The mode's facts for the engine, read from the policy: its family, rotary buffers and banned tokens;
    `cuda_graphs`: rollout.exact_cuda_graphs."""
    check_family(policy.adapter.name)

    def buffer(vision: bool):
        return next((b.detach().to("cpu", copy=True) for n, b in policy.model.named_buffers()
                     if n.endswith("inv_freq") and "original" not in n and ("visual" in n) == vision), None)

    return ExactMode(policy.adapter.name, buffer(False), buffer(True), tuple(policy.adapter.banned_token_ids),
                     cuda_graphs=cuda_graphs)


def check_head_size(head_dim: int, capability: tuple[int, int]) -> None:
    """Refuse heads FlashAttention tiles differently in decode and in prefill.

    vLLM's FlashAttention 3 (compute capability 9.x) drops the causal flag of a step whose queries are all
    one token long (pure decode) for heads of 64 or less, and the non-causal kernel over paged K/V sums the
    keys in blocks of 160 where the causal prefill (the policy's forward, a prefill of whole sequences) sums
    them in blocks of 128: past 128 tokens of context the softmax adds in another order. Measured on an H200
    (tests/gpu/test_exact_episodes.py): 16-wide heads differ from index 129 on, 128-wide heads nowhere."""
    if capability[0] == 9 and head_dim <= 64:
        raise ValueError(
            f"config key 'rollout.exact' is true but the language model's attention heads are {head_dim} wide: on "
            "this GPU vLLM's FlashAttention sums a decode step's keys in blocks of 160 and a prefill's in blocks of "
            "128 for heads of 64 or less, so logprobs past 128 tokens of context cannot match bit for bit; exact mode "
            "needs heads wider than 64 (the released Qwen2.5-VL models have 128; for a test model, "
            "tools/make_tiny_model.py --size tiny_hd128)")


def text_head_dim(config) -> int:
    """The language model's attention head width from a transformers config."""
    from models.flops import text_config

    text = text_config(config)
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def build_exact(policy) -> ExactMode:
    """The mode for a trainer's policy (or its reference), the policy routed; raises in one line where the mode
    cannot run (no CUDA, no vLLM, another family, heads the attention kernel tiles differently per step)."""
    check_device()
    check_head_size(text_head_dim(policy.model.config), torch.cuda.get_device_capability())
    mode = engine_mode(policy)
    mode.apply_to_policy(policy)
    return mode


# --- the engine side -----------------------------------------------------------------------------------------------
def patch_vllm(report: dict) -> None:
    """Route vLLM's RMSNorm, SiLU-and-mul and m-rope custom ops to torch code with transformers' rounding
    (class-level, before the engine builds its model); records in `report` what was patched or missing."""
    targets = (  # (module, class, its import: a fixed module name each, implementation or None)
        ("vllm.model_executor.layers.layernorm", "RMSNorm",
         lambda: __import__("vllm.model_executor.layers.layernorm", fromlist=["RMSNorm"]), _engine_rms_norm),
        ("vllm.model_executor.layers.activation", "SiluAndMul",
         lambda: __import__("vllm.model_executor.layers.activation", fromlist=["SiluAndMul"]), _engine_silu_and_mul),
        ("vllm.model_executor.layers.rotary_embedding", "MRotaryEmbedding",
         lambda: __import__("vllm.model_executor.layers.rotary_embedding", fromlist=["MRotaryEmbedding"]), None),
        ("vllm.model_executor.layers.rotary_embedding.common", "ApplyRotaryEmb",
         lambda: __import__("vllm.model_executor.layers.rotary_embedding.common", fromlist=["ApplyRotaryEmb"]), None),
    )
    for where, name, module, impl in targets:
        try:
            cls = getattr(module(), name)
        except (ImportError, AttributeError):
            report[name] = f"not found in {where}"
            continue
        native = impl if impl is not None else cls.forward_native
        for method in ("forward_cuda", "forward_native"):
            setattr(cls, method, native)
        report[name] = "routed to torch code" if impl is not None else "forward_cuda -> forward_native"
    report["linear"] = _engine_linear_path()
    try:
        from vllm.model_executor.models import qwen2_5_vl
    except ImportError:
        report["Qwen2_5_VisionPatchEmbed"] = "not found"
        return
    for name, attr, impl in (("Qwen2_5_VisionPatchEmbed", "forward", _engine_patch_embed),
                             ("apply_rotary_pos_emb_vision", None, _engine_vision_rope)):
        if not hasattr(qwen2_5_vl, name):  # vLLM 0.26: the vision rotation is an ApplyRotaryEmb op
            report[name] = ("absent (the vision rotation is ApplyRotaryEmb, routed by align_engine)" if attr is None
                            else "not found in vllm.model_executor.models.qwen2_5_vl")
            continue
        if attr is None:
            setattr(qwen2_5_vl, name, impl)
        else:
            setattr(getattr(qwen2_5_vl, name), attr, impl)
        report[name] = "routed to torch code"


def _engine_linear_path() -> str:
    """Which GEMM the installed vLLM's unquantized linear layers run under VLLM_BATCH_INVARIANT (read from the
    source of `UnquantizedLinearMethod.apply`), set in ENGINE_LINEAR for `exact_linear`; returns the report line."""
    import inspect

    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        source = inspect.getsource(UnquantizedLinearMethod.apply)
    except (ImportError, AttributeError, OSError, TypeError):
        return f"UnquantizedLinearMethod not readable: exact_linear assumes {ENGINE_LINEAR['path']}"
    ENGINE_LINEAR["path"] = "batch_invariant" if "linear_batch_invariant" in source else "torch"
    return ("vLLM's linear_batch_invariant on both sides (exact_linear)" if ENGINE_LINEAR["path"] == "batch_invariant"
            else "F.linear on both sides (this vLLM's linear layers do not call linear_batch_invariant)")


def _engine_vision_rope(t, freqs, *args, **kwargs):
    """vLLM's apply_rotary_pos_emb_vision(t, freqs[, fn]) with transformers' fp32 formula."""
    return vision_rope(t, freqs.cos(), freqs.sin())


def align_engine(model, inv_freq: torch.Tensor | None, vision_inv_freq: torch.Tensor | None = None) -> dict:
    """Inside the engine: rebuild every language-model m-rope cos/sin table from the policy's inv_freq on the
    GPU, as an elementwise fp32 product (the policy's angle); give the vision rotary the policy's inv_freq and
    route its rotation to `vision_rope`. Returns what was rebuilt or routed."""
    done = {"rope_tables": 0, "vision_rope_tables": 0, "vision_rotary": 0, "vision_rotation": 0}
    for name, m in model.named_modules():
        cache = getattr(m, "cos_sin_cache", None)
        freq = vision_inv_freq if "visual" in name else inv_freq  # a vision rope built as a table too
        if freq is not None and isinstance(cache, torch.Tensor) and cache.shape[-1] == 2 * freq.numel():
            freq = freq.to(cache.device, torch.float32)
            t = torch.arange(cache.shape[0], device=cache.device, dtype=torch.float32)
            freqs = t[:, None] * freq[None, :]
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
            # the vision tower's cos/sin stay fp32, as transformers computes them; the language model's
            # m-rope rounds them to the model dtype, as transformers' text rotary does
            m.cos_sin_cache = table if "visual" in name else table.to(cache.dtype)
            done["vision_rope_tables" if "visual" in name else "rope_tables"] += 1
        if vision_inv_freq is not None and type(m).__name__.endswith("VisionRotaryEmbedding"):
            _align_vision_rotary(m, vision_inv_freq)
            done["vision_rotary"] += 1
        if hasattr(m, "rotary_embedding_function"):
            m.rotary_embedding_function = _rotary_torch
            done["vision_rotation"] += 1
        elif "visual" in name and type(m).__name__ == "ApplyRotaryEmb":
            # vLLM 0.26's vision attention rotates q/k through an ApplyRotaryEmb op whose torch path computes
            # in the model dtype (enable_fp32_compute off); transformers rotates in fp32 and rounds once
            m.forward = _rotary_torch
            done["vision_rotation"] += 1
    return done


def _rotary_torch(x, cos, sin, *args, **kwargs):
    """vLLM's vision rotary function slot (x fp32, cos/sin (..., D/2)) with transformers' formula."""
    return vision_rope(x, cos, sin)


def _align_vision_rotary(module, inv_freq: torch.Tensor) -> None:
    """vLLM's vision rotary: the policy's inv_freq, and angles as an elementwise fp32 product of it."""
    device = next((b.device for b in module.buffers()), torch.device("cuda"))
    module.inv_freq = inv_freq.to(device, torch.float32)

    def forward(seqlen: int) -> torch.Tensor:
        seq = torch.arange(seqlen, device=module.inv_freq.device, dtype=torch.float32)
        return seq[:, None] * module.inv_freq[None, :]

    module.forward = forward


def batch_invariant_state() -> dict:
    """What vLLM's batch-invariant mode did in this process: its flag, the env it set, the torch flags."""
    state = {"env": {k: os.environ.get(k) for k in PROCESS_ENV}}
    try:
        import vllm.model_executor.layers.batch_invariant as bi
    except ImportError:
        return {**state, "vllm": "not importable"}
    state["mode_on"] = bool(getattr(bi, "_batch_invariant_MODE", False))
    lib = getattr(bi, "_batch_invariant_LIB", None)
    state["overrides_registered"] = lib is not None
    state["functions"] = sorted(n for n in dir(bi) if n.endswith("_batch_invariant"))
    state["bf16_reduced_precision"] = str(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    return state


def enable_batch_invariance(report: dict) -> None:
    """After the engine is built: make sure vLLM's overrides are registered in this process (vLLM 0.26 does it
    while building the worker; call its own function where it has not) and record the state."""
    try:
        import vllm.model_executor.layers.batch_invariant as bi
    except ImportError:
        report["batch_invariant"] = {"vllm": "not importable"}
        return
    if not getattr(bi, "_batch_invariant_MODE", False) and hasattr(bi, "enable_batch_invariant_mode"):
        bi.enable_batch_invariant_mode()
        report["enabled_here"] = True
    report["batch_invariant"] = batch_invariant_state()
