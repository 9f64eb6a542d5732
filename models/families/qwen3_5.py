"""Qwen3.5 (transformers `qwen3_5`): a Qwen3-VL-style tower over a hybrid decoder with linear attention.

Images are Qwen3-VL's (16-pixel patches, 2×2 merge, sides on the 32-pixel grid, one
`<|image_pad|>` per merged patch, learned position embeddings interpolated per image), without
DeepStack: the tower returns one feature stream. Positions are Qwen-VL's 3-D m-rope ids
(`Qwen3_5Model.get_rope_index` gives an image start + (t, h, w) and resumes the text at
start + max(h, w)), rotated over a quarter of each head with interleaved sections.

The decoder mixes two token mixers: three of every four layers are Gated DeltaNet (linear
attention: a depthwise causal convolution of width 4 over q/k/v, then the gated delta rule, a
recurrent state per head), the fourth full attention with an output gate. In a packed row both
the convolution window and the recurrent state must restart at every sequence boundary;
transformers' own torch path carries both across (its `cu_seqlens` argument is honoured only by
the flash-linear-attention kernels, and its torch fallback refuses it). The policy therefore
routes each Gated DeltaNet layer through `packed_gated_deltanet` inside a packed row
(`models.attention.packed_row` gives the boundaries). On CUDA, where the `fla` package imports, the
convolution, the delta rule and the gated norm run through flash-linear-attention's kernels (varlen for
the first two); elsewhere the convolution is masked at boundaries in torch, and the delta rule runs
through transformers' torch chunked rule on the row's sequences as one right-padded batch (exact: the
rule is causal, so padding after a sequence never reaches it).
fla refuses its backward on Hopper with Triton in [3.4.0, 3.7.1); `prepare_delta_rule_backward` decides
per GPU, before the first backward, whether vlrl may run it there (`models.fla_guard`).
Outside a packed row (the built-in engine, with its cache) the layer runs as transformers wrote it.
The built-in engine generates one prompt at a time (`batch_with_padding`): right padding would
run the recurrent state through the pad slots.

vLLM: `Qwen3_5ForConditionalGeneration` (vllm/model_executor/models/qwen3_5.py as read at vLLM commit
00def4f, not checked against the 0.26.0 tag) is Qwen3-VL's multimodal class over a Qwen3-Next-style
decoder. Its mapper is
Qwen3-VL's (`model.language_model.` → `language_model.model.`, `model.visual.` → `visual.`,
`lm_head.` → `language_model.lm_head.`). It stacks the decoder's q/k/v into qkv_proj and gate/up
into gate_up_proj, and the Gated DeltaNet's in_proj_qkv and in_proj_z into in_proj_qkvz (shards
(0, 1, 2) and 3) and in_proj_b and in_proj_a into in_proj_ba (shards 0 and 1); conv1d, A_log,
dt_bias, norm and out_proj keep their names. Its processor is Qwen3-VL's
(`Qwen3VLMultiModalProcessor`): each `<|image_pad|>` becomes the image's run, so prompts collapse
as Qwen-VL's do. vLLM 0.26 ran it on the H200 (tiny model, README's family table).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers.activations import ACT2FN

from models.attention import given_row, host_bounds, prebuilt_masks
from models.families.qwen_vl import (
    _PREFIXES, QWEN2_5_EXTRA_TOKENS, QWEN3_PATCH_SIZE, Qwen3Images, Qwen3VLAdapter, _qwen_adapter,
    _tiny_image_processor,
)
from models.families.tiny import MERGE_SIZE, TEMPORAL_PATCH_SIZE, SizeSpec, TinySpec, text_config, token_ids
from models.family import Family, ToolFormat, VLLMNames, register


# --- packed Gated DeltaNet ----------------------------------------------------------------------
def _position_in_sequence(cu: torch.Tensor, length: int) -> torch.Tensor:
    """(L,) each token's index within its own sequence of the packed row."""
    at = torch.arange(length, device=cu.device)
    seq = torch.searchsorted(cu[1:].to(at.dtype), at, right=True)
    return at - cu.to(at.dtype)[seq]


def restarting_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           position: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution over a packed row that starts over at every sequence, in fp32.

    x (C, L); weight (C, K) as `nn.Conv1d(groups=C)` holds it (tap K-1 meets the current token);
    position (L,) each token's index within its sequence. Tap K-1-j reads the token j back, and only
    when that token is in the same sequence (j <= position): what the layer computes on each sequence
    alone, whose convolution sees zeros before the start.

    The rounding is vLLM 0.26's Triton convolution's (mamba/ops/causal_conv1d.py, prefill and decode
    kernels alike): each tap's product in the weight's dtype (Triton keeps bf16 * bf16 in bf16), summed
    in fp32 from the bias and the oldest tap on. The sum is returned unrounded, for the activation to run
    in fp32 too; in fp32 this is the plain convolution.
    """
    width = weight.shape[-1]
    x = x.to(weight.dtype)
    out = None if bias is None else bias.float()[:, None]
    for j in range(width - 1, -1, -1):  # the oldest tap first, as vLLM's kernels add them
        shifted = x if j == 0 else F.pad(x[:, :-j], (j, 0)) * (position >= j).to(x.dtype)
        tap = (shifted * weight[:, width - 1 - j : width - j]).float()
        out = tap if out is None else out + tap
    return out


@cache  # looked up on every Gated DeltaNet call; whether fla is installed does not change in a process
def _fla_rule():
    """flash-linear-attention's varlen chunked gated delta rule, where the package is installed."""
    if importlib.util.find_spec("fla") is None:
        return None
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


log = logging.getLogger("vlrl")
# fla 0.6's chunked forward state kernel: Triton's cache holds it once any Gated DeltaNet pass has run on the machine
FLA_PROBE_KERNEL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
_build_noticed: set[str] = set()


def kernel_build_notice(device: torch.device) -> str | None:
    """Once per process, before the first packed pass on CUDA: where Triton's cache holds none of fla's Gated
    DeltaNet kernels yet, the line that says the first passes build and autotune them (minutes, silent
    otherwise); None where the cache has them, off CUDA, without fla, and after the first call."""
    if device.type != "cuda" or _fla_rule() is None or "cuda" in _build_noticed:
        return None
    _build_noticed.add("cuda")
    cache_dir = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    if cache_dir.is_dir() and any(cache_dir.glob(f"*/{FLA_PROBE_KERNEL}.*")):
        return None
    return (f"Gated DeltaNet: Triton's cache ({cache_dir}) holds none of fla's kernels yet, so the first logprob and "
            "update passes build and autotune them: minutes on a fresh machine (22 kernels, fla's and vLLM's, took "
            "213 s on an H200), read from the cache by later runs")


@cache
def _fla_conv():
    """flash-linear-attention's varlen causal convolution (Triton, activation fused), where installed."""
    if importlib.util.find_spec("fla") is None:
        return None
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d


@cache
def _fla_gated_norm():
    """flash-linear-attention's fused gated RMSNorm (Triton, one kernel each way), where installed."""
    if importlib.util.find_spec("fla") is None:
        return None
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated


# fla wants int64 boundaries and, to skip a device sync in every call, a host copy; it memoizes its chunk
# indices by the tensor's identity, so every layer of a row must pass the same objects
_FLA_BOUNDS = WeakIdKeyDictionary()


def fla_bounds(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's boundaries as fla takes them: (int64 on the device, int64 on the host), one pair per `cu`."""
    known = _FLA_BOUNDS.get(cu)
    if known is None:
        known = _FLA_BOUNDS[cu] = (cu.long(), torch.tensor(host_bounds(cu), dtype=torch.long))
    return known


def _torch_rule():
    """transformers' own torch chunked gated delta rule (unwrapped from its kernel dispatch)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
    return getattr(rule, "__wrapped__", rule)


def delta_rule_packed(q, k, v, g, beta, cu: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over a packed row (1, L, heads, dim), the state starting at zero at each
    sequence of `cu`; returns (1, L, v_heads, v_dim)."""
    if q.is_cuda and _fla_rule() is not None:
        return fla_delta_rule_packed(q, k, v, g, beta, cu)
    return torch_delta_rule_packed(q, k, v, g, beta, cu)


def _heads_as_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k with each key head repeated over its group of value heads, as the layer does before
    either rule (Qwen3.5-4B has 16 key heads to 32 value heads)."""
    if k.shape[2] == v.shape[2]:
        return q, k
    rep = v.shape[2] // k.shape[2]
    return q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)


def fla_delta_rule_packed(q, k, v, g, beta, cu: torch.Tensor) -> torch.Tensor:
    """`delta_rule_packed` through flash-linear-attention's varlen kernel (CUDA)."""
    q, k = _heads_as_values(q, k, v)
    device_cu, host_cu = fla_bounds(cu)
    out, _ = _fla_rule()(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                         cu_seqlens=device_cu, cu_seqlens_cpu=host_cu, use_qk_l2norm_in_kernel=True)
    return out


def torch_delta_rule_packed(q, k, v, g, beta, cu: torch.Tensor) -> torch.Tensor:
    """`delta_rule_packed` through transformers' torch rule on the row's sequences as one right-padded
    batch (exact: the rule is causal, so padding after a sequence never reaches it)."""
    q, k = _heads_as_values(q, k, v)
    bounds = host_bounds(cu)  # the packer's, on the host: not read back from the device in every layer
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if len(lengths) == 1:
        out, _ = _torch_rule()(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        return out
    pad = lambda t: nn.utils.rnn.pad_sequence(list(t[0].split(lengths)), batch_first=True)  # noqa: E731
    out, _ = _torch_rule()(pad(q), pad(k), pad(v), g=pad(g), beta=pad(beta), use_qk_l2norm_in_kernel=True)
    return torch.cat([out[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)


def prepare_delta_rule_backward(decoder: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Before the first backward on a CUDA device: how fla's gated backward runs there, with a self-check
    against the torch rule at this decoder's head shapes where fla's Hopper guard (#640) is lifted, or a
    DeltaRuleBackwardError where it cannot run (`models.fla_guard`). A no-op off CUDA or without fla."""
    if device.type != "cuda" or _fla_rule() is None:
        return
    layer = next((m.linear_attn for m in decoder.layers if getattr(m, "linear_attn", None) is not None), None)
    if layer is None:
        return
    from models.fla_guard import RuleShape, prepare_backward

    shape = RuleShape(layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, dtype)
    prepare_backward(device, shape, fla_delta_rule_packed, torch_delta_rule_packed)


def packed_gated_deltanet(layer: nn.Module, hidden: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """`Qwen3_5GatedDeltaNet.forward` on a packed row (1, L, H), restarting at every sequence of `cu`.

    The projections, gates and norm are the layer's own, token by token; only the convolution and
    the recurrence see sequence boundaries.
    """
    length = hidden.shape[1]
    mixed = layer.in_proj_qkv(hidden)[0].transpose(0, 1)  # (C, L), a view
    z = layer.in_proj_z(hidden).reshape(1, length, -1, layer.head_v_dim)
    b, a = layer.in_proj_b(hidden), layer.in_proj_a(hidden)
    mixed = packed_conv(mixed, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.activation, cu)
    mixed = mixed.to(hidden.dtype).transpose(0, 1).unsqueeze(0)
    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(1, length, -1, layer.head_k_dim)
    k = k.reshape(1, length, -1, layer.head_k_dim)
    v = v.reshape(1, length, -1, layer.head_v_dim)
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)  # fp32, as the layer has it
    core = delta_rule_packed(q, k, v, g, beta, cu)
    core = gated_norm(layer.norm, core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(1, length, -1))


def packed_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
                cu: torch.Tensor) -> torch.Tensor:
    """The layer's convolution and activation over a packed row, x (C, L) -> (C, L) in the weight's dtype,
    restarting at each sequence of `cu`: on CUDA through fla's varlen kernel (one pass, the activation fused)
    where fla is installed and the activation is SiLU, else `restarting_causal_conv` and the activation in
    torch, in fp32 and rounded once, as vLLM's kernels do. (fla multiplies the taps in fp32, where vLLM
    rounds each product to bf16 first.)"""
    if x.is_cuda and activation in ("silu", "swish") and _fla_conv() is not None:
        device_cu, host_cu = fla_bounds(cu)
        out, _ = _fla_conv()(x.t().unsqueeze(0).to(weight.dtype), weight, bias, activation="silu",
                             cu_seqlens=device_cu, cu_seqlens_cpu=host_cu)
        return out[0].t()
    length = x.shape[1]
    conv = restarting_causal_conv(x, weight, bias, _position_in_sequence(cu, length))
    return ACT2FN[activation](conv).to(weight.dtype)


def gated_norm(norm: nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The layer's gated RMSNorm (`Qwen3_5RMSNormGated`: RMSNorm, weight, then SiLU of the gate) rounded the way
    vLLM 0.26 rounds it: in fp32 throughout and once at the end (layers/layernorm.py `RMSNormGated`, native and
    Triton alike), where transformers' module also rounds the normed input and its product with the weight.
    On CUDA as one fla kernel each way where fla is installed (it rounds once too), else in torch."""
    eps = getattr(norm, "variance_epsilon", None)  # transformers' module; anything else (fla's own) runs as it is
    if eps is None or getattr(norm, "activation", "silu") not in ("silu", "swish"):
        return norm(x, gate)
    if x.is_cuda and _fla_gated_norm() is not None:
        return _fla_gated_norm()(x, gate, norm.weight, None, activation="swish", eps=eps)
    return rms_norm_gated(x, gate, norm.weight, eps)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension, times weight, times SiLU(gate), in fp32 and rounded once to x's
    dtype (vLLM's `RMSNormGated.forward_static` order with norm_before_gate)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float() * F.silu(gate.float())).to(x.dtype)


def _routed_forward(layer: nn.Module, original):
    """The layer's forward: the packed path inside a packed row of its length, else its own."""

    def forward(hidden_states, *args, **kwargs):
        row = given_row(hidden_states.shape[1])
        uncached = kwargs.get("cache") is None and kwargs.get("cache_params") is None and not args
        if row is not None and hidden_states.shape[0] == 1 and uncached:
            return packed_gated_deltanet(layer, hidden_states, row[0].to(hidden_states.device))
        return original(hidden_states, *args, **kwargs)

    return forward


def apply_packed_linear_attention(language_model: nn.Module) -> None:
    """Route every Gated DeltaNet layer of the decoder through `packed_gated_deltanet` in packed rows
    (in place, once; names, parameters and FSDP units unchanged)."""
    for layer in language_model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None and not getattr(mixer, "_vlrl_packed", False):
            mixer.forward = _routed_forward(mixer, mixer.forward)
            mixer._vlrl_packed = True


# --- tool calls ---------------------------------------------------------------------------------
# Qwen3.5's chat template (tools=): the schemas come first in the system turn, then its system text;
# no default system text. A call is XML inside <tool_call>, one <function=NAME> block whose
# parameters are <parameter=KEY> blocks, each value between a newline after the tag and one before
# the closing tag; a tool message becomes a user turn wrapping its content in <tool_response>.
QWEN3_5_TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN3_5_TOOLS_OUTRO = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>")
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def _schema_value(text: str, spec: dict):
    """A parameter's text as the JSON type its schema declares (the first type it converts to); the
    text itself when none does, so the runner's schema check names the parameter."""
    kinds = spec.get("type", "string")
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        stripped = text.strip()
        if kind == "string":
            return text
        if kind == "integer" and re.fullmatch(r"[+-]?\d+", stripped):
            return int(stripped)
        if kind == "number" and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", stripped):
            number = float(stripped)
            return int(number) if re.fullmatch(r"[+-]?\d+", stripped) else number
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind == "null" and stripped.lower() in ("null", "none"):
            return None
        if kind in ("array", "object"):
            try:
                value = json.loads(stripped)
            except (json.JSONDecodeError, RecursionError):
                continue
            if isinstance(value, list if kind == "array" else dict):
                return value
    return text


def xml_call(body: str, tools: Mapping[str, dict] | None) -> dict:
    """One call's text (between <tool_call> and </tool_call>) as `{"name", "arguments"}`, values
    converted by `tools[name]`'s schema; `{"malformed": why}` when it is not the template's XML."""
    match = _FUNCTION.fullmatch(body)
    if match is None:
        return {"malformed": "tool call is not <function=NAME>...</function> inside <tool_call></tool_call>"}
    name, inner = match.group(1).strip(), match.group(2)
    if not name or "<function=" in inner:
        return {"malformed": "a <tool_call> holds exactly one <function=NAME> block with a name"}
    params = (tools or {}).get(name, {}).get("properties", {})
    arguments: dict = {}
    end = 0
    for p in _PARAMETER.finditer(inner):
        key = p.group(1).strip()
        if inner[end:p.start()].strip():
            return {"malformed": f"{name}: text outside <parameter=...></parameter> before parameter {key!r}"}
        if key in arguments:
            return {"malformed": f"{name}: parameter {key!r} is given twice"}
        value = p.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = _schema_value(value, params[key]) if key in params else value
        end = p.end()
    if inner[end:].strip():
        return {"malformed": f"{name}: an unclosed <parameter=...> or text after the parameters"}
    return {"name": name, "arguments": arguments}


@dataclass(frozen=True)
class XmlToolFormat(ToolFormat):
    """Qwen3.5's tool calls (XML parameters, see above) turned into the JSON the tool runner takes."""

    def system_with_tools(self, system: str, schemas: list[dict]) -> str:
        listed = "".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas)  # jinja's tojson
        system = system.strip()
        return self.tools_intro + listed + self.tools_outro + ("\n\n" + system if system else "")

    def calls(self, text: str, tools: Mapping[str, dict] | None = None) -> list[str]:
        return [json.dumps(xml_call(body, tools), ensure_ascii=False) for body in super().calls(text)]


QWEN3_5_TOOLS = XmlToolFormat(call_start="<tool_call>", call_end="</tool_call>", result_role="tool",
                              tools_intro=QWEN3_5_TOOLS_INTRO, tools_outro=QWEN3_5_TOOLS_OUTRO)


# --- adapter ------------------------------------------------------------------------------------
@dataclass
class Qwen3_5Adapter(Qwen3VLAdapter):
    """Qwen-VL positions and inputs; one vision stream; Gated DeltaNet layers that restart per sequence."""

    batch_with_padding: bool = False  # the recurrent state would run through right padding
    # tests/gpu/test_varlen_attention.py on the H200 (2026-12-03: logprobs equal to per-sequence sdpa, gradients
    # within 2.5e-3); Qwen3.5-4B's update 6.53-6.98 s against sdpa's 7.23-7.41 s (docs/benchmarks.md)
    varlen_attention: bool = True
    shares_prompts: bool = False  # Gated DeltaNet layers carry a state through the row
    tool_format: ToolFormat | None = QWEN3_5_TOOLS  # XML calls; results as the template's tool role

    def vllm_engine_kwargs(self) -> dict:
        # vLLM picks FlashInfer's Gated DeltaNet prefill on SM90 by default; its Triton kernels need no
        # extra package (engine start-up JIT-compiles them: about two minutes on an H200)
        # the recurrent state's dtype between decode steps is the checkpoint's `mamba_ssm_dtype` (vLLM's
        # models/config.py `Qwen3_5ForConditionalGenerationConfig`; the tiny specs say float32, as released configs do)
        return {"additional_config": {"gdn_prefill_backend": "triton"}}

    def run_language_model(self, model, embeds, position_ids, image_mask, extra_streams):
        decoder = self.language_model(model)
        apply_packed_linear_attention(decoder)
        notice = kernel_build_notice(embeds.device)
        if notice:
            log.info(notice)
        if torch.is_grad_enabled():  # a backward may follow: can fla's run on this GPU? (a no-op off CUDA)
            prepare_delta_rule_backward(decoder, embeds.device, embeds.dtype)
        # masks prebuilt where the varlen kernel runs (none: it reads the row's boundaries), so the decoder does not
        # read the positions back to look for packed sequences
        masks = prebuilt_masks(decoder.config, embeds.device)
        out = decoder(inputs_embeds=embeds, position_ids=position_ids, attention_mask=masks, use_cache=False)
        return out.last_hidden_state

    def tp_plan(self) -> dict[str, str]:
        # Full-attention layers and MLPs; the Gated DeltaNet layers stay replicated (their conv and
        # recurrence need every head's q/k/v split the way the layer splits them).
        return {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                "mlp.down_proj": "rowwise"}


def _repeat_states(layer, repeats: int) -> None:
    """Repeat a linear-attention cache layer's rows `repeats` times each (its own reorder)."""
    rows = next((t.shape[0] for t in layer.conv_states.values() if t is not None), None)
    if rows is not None:
        layer.reorder_cache(torch.arange(rows).repeat_interleave(repeats))
    if isinstance(layer, _dynamic_layer()):
        _dynamic_layer().batch_repeat_interleave(layer, repeats)


def _select_states(layer, indices: torch.Tensor) -> None:
    """Keep the rows `indices` of a linear-attention cache layer (its own reorder)."""
    layer.reorder_cache(torch.as_tensor(indices))
    if isinstance(layer, _dynamic_layer()):
        _dynamic_layer().batch_select_indices(layer, indices)


def _dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def add_cache_batch_ops() -> None:
    """Give transformers' linear-attention cache layers the batch operations DynamicCache calls on
    every layer (the built-in engine repeats each prompt's cache n times, then drops finished rows);
    transformers 5.24 defines them for attention layers only. A no-op where they exist."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if mixin is None or hasattr(mixin, "batch_repeat_interleave"):
        return
    mixin.batch_repeat_interleave = _repeat_states
    mixin.batch_select_indices = _select_states


def _qwen3_5_adapter(config) -> Qwen3_5Adapter:
    add_cache_batch_ops()
    return _qwen_adapter(config, config.model_type, config.architectures[0] if config.architectures else
                         "Qwen3_5ForConditionalGeneration", Qwen3_5Adapter)


# --- tiny checkpoint ----------------------------------------------------------------------------
def layer_types(layers: int) -> list[str]:
    """Qwen3.5's 3:1 pattern (every fourth layer full attention), with the last layer always full so
    a two-layer model has one of each."""
    return ["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention" for i in range(layers)]


def tiny_text_config(size: SizeSpec, tokenizer, **overrides) -> dict:
    """The decoder: the size's shapes, 32-dim heads rotated over a quarter (interleaved m-rope
    sections [2, 1, 1] of 4 frequencies), Gated DeltaNet with 1 key and 2 value heads of the released
    128 dims (fla's Gated DeltaNet backward on Hopper is cleared for 128-wide key heads only: models/fla_guard.py).
    A size with a released model's `head_dim` (qwen3_5_4b) gets the released Gated DeltaNet shapes:
    16 key and 32 value heads of 128, and its own m-rope sections."""
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    linear = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2)
    head_dim = 32
    if size.head_dim:
        head_dim, rope["mrope_section"] = size.head_dim, list(size.mrope_section)
        linear = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                      linear_num_value_heads=32)
    # mamba_ssm_dtype as released configs say it: vLLM keeps the Gated DeltaNet's recurrent state between decode
    # steps in this dtype (the model's, bf16, without it: every decoded token would round the state that the
    # trainer's chunked rule carries in fp32)
    return text_config(size, tokenizer, head_dim=head_dim, rope_parameters=rope,
                       layer_types=layer_types(size.text_layers), linear_conv_kernel_dim=4, mamba_ssm_dtype="float32",
                       **linear, **overrides)


def tiny_vision_config(size: SizeSpec) -> dict:
    return dict(depth=size.vision_depth, hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
                num_heads=size.vision_heads, in_channels=3,
                patch_size=QWEN3_PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
                out_hidden_size=size.text_hidden, num_position_embeddings=2304 if size.head_dim else 64)


def _tiny_config(size: SizeSpec, tokenizer):
    image, video, start, end = token_ids(tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                         "<|vision_end|>")
    config = transformers.Qwen3_5Config(
        text_config=tiny_text_config(size, tokenizer), vision_config=tiny_vision_config(size), image_token_id=image,
        video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=bool(size.head_dim),  # Qwen3.5-4B ties its embedding; the tiny sizes do not
        architectures=["Qwen3_5ForConditionalGeneration"],
    )
    write_both_head_counts(config.vision_config, size.vision_heads)
    return config


def write_both_head_counts(vision_config, heads: int) -> None:
    """Save `num_attention_heads` next to `num_heads` in config.json: transformers 5.17 reads the first,
    later ones the second (an alias there, so setting it as an attribute would not reach the file)."""
    vision_config.__dict__["num_attention_heads"] = heads


def _tiny_moe_config(size: SizeSpec, tokenizer):
    """Qwen3.5-MoE: every decoder layer's MLP is 4 routed experts (2 per token, 32 wide) plus a
    gated shared expert."""
    image, video, start, end = token_ids(tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                         "<|vision_end|>")
    text = tiny_text_config(size, tokenizer, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32)
    config = transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=tiny_vision_config(size), image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False,
        architectures=["Qwen3_5MoeForConditionalGeneration"],
    )
    write_both_head_counts(config.vision_config, size.vision_heads)
    return config


@dataclass
class Qwen3_5MoeAdapter(Qwen3_5Adapter):
    """Qwen3.5's adapter; the MLPs are expert blocks (router, fused experts, shared expert).

    transformers 5 holds each layer's experts fused (`experts.gate_up_proj` (E, 2·I, H),
    `experts.down_proj` (E, H, I)); hub checkpoints store one tensor per expert and projection,
    which loading stacks (`weight_parts`).
    """

    num_experts: int = 0
    top_k: int = 0

    def routers(self, model: nn.Module) -> list[nn.Module]:
        return [layer.mlp.gate for layer in self.decoder_layers(model)]

    def block_units(self, layer: nn.Module) -> list[nn.Module]:
        # The fused experts are most of a block (Qwen3.5-35B-A3B's shapes: 256 × 3 × 512 × 2048, 0.8B of
        # about 0.84B). FSDP2 holds the running unit and the next one's prefetch gathered: as their own
        # unit that is about one experts block plus an attention block, not two whole blocks.
        return [layer.mlp.experts]

    @property
    def experts_per_token(self) -> int:
        return self.top_k

    def weight_parts(self, name: str) -> list[list[str]] | None:
        match = re.match(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$", name)
        if match is None:
            return None
        prefix, fused = match.groups()
        members = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
        return [[f"{prefix}{e}.{m}.weight" for m in members] for e in range(self.num_experts)]

    def tp_plan(self) -> dict[str, str]:
        return {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.o_proj": "rowwise"}

    def vllm_engine_kwargs(self) -> dict:
        # Refit writes the experts in the checkpoint's layout, which is what vLLM's Triton MoE kernels
        # read (its pick on Hopper). FlashInfer's kernels, its pick on other GPUs, run on a layout made
        # once after start-up loading (fused_moe/oracle/unquantized.py `convert_to_unquantized_kernel_format`:
        # w3 before w1, or a shuffled block layout) that a refit would not remake.
        return {**super().vllm_engine_kwargs(), "moe_backend": "triton"}


def _qwen3_5_moe_adapter(config) -> Qwen3_5MoeAdapter:
    add_cache_batch_ops()
    adapter = _qwen_adapter(config, "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", Qwen3_5MoeAdapter)
    adapter.num_experts = config.text_config.num_experts
    adapter.top_k = config.text_config.num_experts_per_tok
    return adapter


QWEN3_5_EXTRA_TOKENS = QWEN2_5_EXTRA_TOKENS + (("<think>", False), ("</think>", False))
# Gated DeltaNet projections vLLM 0.26 fuses (its `packed_modules_mapping`), inside the decoder.
DECODER = ("language_model.model.layers.",)
# vLLM 0.26 builds each layer's experts as a MoERunner (`mlp.experts`, fused_moe/runner/moe_runner.py)
# whose `routed_experts` child (RoutedExperts) holds them as w13_weight (E, 2·I, H: gate rows, then up)
# and w2_weight (E, H, I), the layout of transformers 5's fused gate_up_proj and down_proj. Its loader
# takes the fused tensors by their transformers names and per-expert hub tensors alike
# (`RoutedExperts.load_weights`); each lands in the routed_experts parameter, which is the name here
# (vLLM reports it without `routed_experts.`; `vllm_engine.load_into` resolves that). The router
# (`mlp.gate`), the shared expert (gate/up stacked into gate_up_proj) and its gate keep transformers' paths.
_ROUTED = r"language_model.model.\1routed_experts."
_EXPERTS = (
    (r"^model\.language_model\.(layers\.\d+\.mlp\.experts\.)gate_up_proj$", _ROUTED + "w13_weight"),
    (r"^model\.language_model\.(layers\.\d+\.mlp\.experts\.)down_proj$", _ROUTED + "w2_weight"),
    (r"^model\.(layers\.\d+\.mlp\.experts\.)gate_up_proj$", _ROUTED + "w13_weight"),
    (r"^model\.(layers\.\d+\.mlp\.experts\.)down_proj$", _ROUTED + "w2_weight"),
    # Hub files' per-expert tensors: each is one expert's slice of the same vLLM parameter
    # (`weight_names.ExpertShard` says which).
    (r"^model\.(?:language_model\.)?(layers\.\d+\.mlp\.experts\.)\d+\.(gate|up)_proj\.weight$",
     _ROUTED + "w13_weight"),
    (r"^model\.(?:language_model\.)?(layers\.\d+\.mlp\.experts\.)\d+\.down_proj\.weight$", _ROUTED + "w2_weight"),
)

register(Family(
    model_type="qwen3_5",
    adapter=_qwen3_5_adapter,
    image_rules={"Qwen3VLProcessor": Qwen3Images},
    tool_format=QWEN3_5_TOOLS,
    # measured on an H200 (vLLM 0.26, bf16, tiny model): token_mult_prob_error 1.0026 mean, 1.0029 max
    vllm=VLLMNames(prefixes=_PREFIXES, stacking_scopes=DECODER),
    tiny=TinySpec(model_class="Qwen3_5ForConditionalGeneration", processor_class="Qwen3VLProcessor",
                  config=_tiny_config, image_processor=_tiny_image_processor("qwen3_vl"),
                  extra_tokens=QWEN3_5_EXTRA_TOKENS),
))
register(Family(
    model_type="qwen3_5_moe",
    adapter=_qwen3_5_moe_adapter,
    image_rules={"Qwen3VLProcessor": Qwen3Images},
    tool_format=QWEN3_5_TOOLS,
    # measured on an H200 (tiny model, vLLM 0.26): token_mult_prob_error 1.0026 mean, 1.0030 max
    vllm=VLLMNames(prefixes=_EXPERTS + _PREFIXES, stacking_scopes=DECODER),
    tiny=TinySpec(model_class="Qwen3_5MoeForConditionalGeneration", processor_class="Qwen3VLProcessor",
                  config=_tiny_moe_config, image_processor=_tiny_image_processor("qwen3_vl"),
                  extra_tokens=QWEN3_5_EXTRA_TOKENS),
))
