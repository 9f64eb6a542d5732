"""Transformers checkpoint names → vLLM parameter names, for refit and read-back.

The same tensors reach the engine under two spellings. A transformers 5 model in memory
names them `model.language_model.*` (the Qwen2 decoder), `model.visual.*` (the vision tower)
and `lm_head.*`; checkpoint files use the hub layout `model.*`, `visual.*`, `lm_head.*`, which
transformers 5's `save_pretrained` still writes (it converts the names back on save). Both
are accepted. vLLM 0.26 builds the model with other module paths and fuses some projections
into one parameter:

    transformers                                        vLLM
    model.language_model.layers.0.self_attn.q_proj.w    language_model.model.layers.0.self_attn.qkv_proj.w  (shard "q")
    model.language_model.layers.0.mlp.up_proj.w         language_model.model.layers.0.mlp.gate_up_proj.w    (shard 1)
    model.visual.blocks.0.attn.qkv.w                    visual.blocks.0.attn.qkv.w  (already fused on both sides)
    model.visual.blocks.0.mlp.gate_proj.w  (2.5 only)   visual.blocks.0.mlp.gate_up_proj.w                  (shard 0)
    lm_head.w                                           language_model.lm_head.w
    model.language_model.layers.0.mlp.experts.gate_up_proj  (MoE: all experts, (E, 2·I, H))
        → language_model.model.layers.0.mlp.experts.routed_experts.w13_weight  (vLLM's FusedMoE)

A shard id says where a checkpoint tensor sits inside the fused vLLM parameter: "q", "k",
"v" for the attention projection (vLLM's QKVParallelLinear), 0 and 1 for gate and up
(vLLM's MergedColumnParallelLinear). These are the ids vLLM's own weight mappers attach
(`Qwen2Model.hf_to_vllm_mapper`, `Qwen2_5_VisionTransformer.hf_to_vllm_mapper`).

Some checkpoint tensors have no vLLM parameter at all: vLLM builds LLaVA's vision tower only
up to `vision_feature_layer` and then without post_layernorm, and never builds a SigLIP pooling
head; a tied lm_head is the embedding. `VLLMSkips` names the first kind, the engine learns the
last from the built model.

The per-family tables (prefixes, stacking scopes, skips, load renames) are declared by each
family's module (`models.family.VLLMNames`). This module is pure Python: the CPU tests pin it, and the vLLM engine uses it to check a
refit touched exactly the parameters it should and to read parameters back by their
transformers names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from models.family import FAMILIES, VLLMNames

# Each family's module (models/families/) declares its vLLM names (`models.family.VLLMNames`);
# this module applies them.


def vllm_names(family: str) -> VLLMNames:
    """The registered vLLM names of a family (config.json's model_type); unknown ones name the supported."""
    if family not in FAMILIES:
        raise ValueError(f"weight_names: unknown family {family!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[family].vllm


# Families the vLLM engine does not run yet, and families whose vLLM path is written but not yet
# measured on a GPU, each with the reason (`VLLMNames.pending` / `.unverified`). `auto` keeps the
# unverified ones on the built-in engine and an explicit `rollout.engine=vllm` runs them with a
# warning; a family leaves the table with its measured token_mult_prob_error.
VLLM_PENDING: dict[str, str] = {t: f.vllm.pending for t, f in FAMILIES.items() if f.vllm.pending}
VLLM_UNVERIFIED: dict[str, str] = {t: f.vllm.unverified for t, f in FAMILIES.items() if f.vllm.unverified}

# vLLM parameters that hold several checkpoint tensors, and the checkpoint module names
# stacked into each, in the order they sit along the output dimension.
STACKED: list[tuple[str, list[str]]] = [
    ("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
    ("gate_up_proj", ["gate_proj", "up_proj"]),
    # Qwen3.5's Gated DeltaNet (vLLM's GatedDeltaNetAttention): q/k/v and z in one, b and a in one.
    ("in_proj_qkvz", ["in_proj_qkv", "in_proj_z"]),
    ("in_proj_ba", ["in_proj_b", "in_proj_a"]),
]

# The shard id vLLM's weight loaders take for each stacked member (in_proj_qkv fills the first
# three of in_proj_qkvz's four output blocks, q, k and v, at once).
SHARD_IDS: dict[str, str | int | tuple[int, ...]] = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1,
    "in_proj_qkv": (0, 1, 2), "in_proj_z": 3, "in_proj_b": 0, "in_proj_a": 1,
}

_MEMBER_TO_STACK = {member: stacked for stacked, members in STACKED for member in members}


@dataclass(frozen=True)
class ExpertShard:
    """One expert's projection inside vLLM's fused expert parameter (FusedMoE's w13_weight / w2_weight).

    Hub checkpoints store routed experts one tensor per expert and projection
    (`...experts.3.up_proj.weight`); vLLM's `RoutedExperts` holds all of a layer's experts in one
    parameter. `expert` is the index along its first dimension, `part` vLLM's shard id: "w1" the
    gate rows and "w3" the up rows of w13_weight, "w2" the down projection w2_weight.
    """

    expert: int
    part: str


# Per-expert checkpoint names and the vLLM shard id of each projection (RoutedExperts' own ids).
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
FUSED_EXPERT_PARAMS = ("w13_weight", "w2_weight")


@dataclass(frozen=True)
class VLLMSkips:
    """What vLLM 0.26 leaves out of a family's vision tower, so refit has no parameter for it.

    `vision_layers`: encoder layers built (None: all); `post_layernorm`, `head`: whether those
    are built. Checkpoint tensors of what is left out are dropped by vLLM's `load_weights`
    (CLIP/SigLIP/Idefics2 `_filter` and `skip_prefixes`) and must not be expected back.
    """

    vision_layers: int | None = None
    post_layernorm: bool = True
    head: bool = False

    @classmethod
    def for_config(cls, family: str, config: dict) -> VLLMSkips:
        """The skips for a checkpoint's config.json (a dict), mirroring how vLLM 0.26 builds the family
        (`VLLMNames.skips`; without one, the whole tower with post_layernorm and no SigLIP head)."""
        skips = vllm_names(family).skips
        return cls(**skips(config)) if skips is not None else cls()

    def reason(self, family: str, hf_name: str) -> str | None:
        """Why vLLM has no parameter for this checkpoint tensor, or None when it has one."""
        prefix = vllm_names(family).vision_transformer
        name = hf_to_vllm_name(family, hf_name)
        if prefix is None or not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        match = re.match(r"encoder\.layers\.(\d+)\.", rest)
        if match and self.vision_layers is not None and int(match.group(1)) >= self.vision_layers:
            return f"vision layer {match.group(1)} is past the {self.vision_layers} layers vLLM builds"
        if rest.startswith("post_layernorm.") and not self.post_layernorm:
            return "vLLM builds the vision tower without post_layernorm"
        if rest.startswith("head.") and not self.head:
            return "vLLM builds the vision tower without the pooling head"
        return None


def vllm_load_name(family: str, hf_name: str) -> str:
    """The name refit hands to vLLM's `load_weights` for a transformers tensor (mostly the name itself)."""
    for pattern, repl in vllm_names(family).load_renames:
        if re.match(pattern, hf_name):
            return re.sub(pattern, repl, hf_name, count=1)
    return hf_name


def _family_rules(family: str) -> tuple[tuple[str, str], ...]:
    return vllm_names(family).prefixes


def hf_to_vllm_name(family: str, hf_name: str) -> str:
    """The vLLM module path of a transformers parameter name, before any stacking.

    Raises ValueError naming the tensor when no rule of the family matches it (for example a
    vLLM name such as `language_model.model.layers.0...`).
    """
    for pattern, vllm_prefix in _family_rules(family):
        if re.match(pattern, hf_name):
            return re.sub(pattern, vllm_prefix, hf_name, count=1)
    prefixes = ", ".join(p.strip("^").replace("\\", "") for p, _ in _family_rules(family))
    raise ValueError(
        f"weight_names: {hf_name!r} is not a transformers {family} parameter name "
        f"(expected one starting with {prefixes})"
    )


def vllm_param_for(family: str, hf_name: str) -> tuple[str, str | int | tuple[int, ...] | ExpertShard | None]:
    """(vLLM parameter name, shard id or None) that holds the transformers tensor `hf_name`.

    A shard id is returned when vLLM fuses the tensor with its siblings into one parameter
    (q/k/v → qkv_proj, gate/up → gate_up_proj, one expert of a hub file → the layer's fused
    experts, an `ExpertShard`); None when the parameter is the tensor itself (transformers 5's
    fused `experts.gate_up_proj` is all of w13_weight).
    """
    name = hf_to_vllm_name(family, hf_name)
    expert = _PER_EXPERT.search(hf_name)
    if expert is not None and name.rpartition(".")[2] in FUSED_EXPERT_PARAMS:
        return name, ExpertShard(int(expert.group(1)), _EXPERT_PARTS[expert.group(2)])
    if not name.startswith(vllm_names(family).stacking_scopes):
        return name, None
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _MEMBER_TO_STACK:
        return name, None
    member = parts[-2]
    parts[-2] = _MEMBER_TO_STACK[member]
    return ".".join(parts), SHARD_IDS[member]


def collapse_image_pads(ids, image_pad_id: int) -> list[int]:
    """Token ids with every run of consecutive `image_pad_id` reduced to one token.

    vLLM 0.26 expands each `<|image_pad|>` it finds in a token prompt into the image's full
    run (one per merged patch). Prompts here arrive already expanded, so each run is cut
    back to a single placeholder first; vLLM then rebuilds exactly one run per image.
    """
    out: list[int] = []
    previous_was_pad = False
    for token in ids:
        token = int(token)
        is_pad = token == image_pad_id
        if not (is_pad and previous_was_pad):
            out.append(token)
        previous_was_pad = is_pad
    return out
