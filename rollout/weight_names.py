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

A shard id says where a checkpoint tensor sits inside the fused vLLM parameter: "q", "k",
"v" for the attention projection (vLLM's QKVParallelLinear), 0 and 1 for gate and up
(vLLM's MergedColumnParallelLinear). These are the ids vLLM's own weight mappers attach
(`Qwen2Model.hf_to_vllm_mapper`, `Qwen2_5_VisionTransformer.hf_to_vllm_mapper`).

Some checkpoint tensors have no vLLM parameter at all: vLLM builds LLaVA's vision tower only
up to `vision_feature_layer` and then without post_layernorm, and never builds a SigLIP pooling
head; a tied lm_head is the embedding. `VLLMSkips` names the first kind, the engine learns the
last from the built model.

This module is pure Python: the CPU tests pin it, and the vLLM engine uses it to check a
refit touched exactly the parameters it should and to read parameters back by their
transformers names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Per family: (regex on the transformers name, vLLM prefix that replaces the match); the
# first matching rule wins. Module names of a transformers 5 model come first; the
# checkpoint-file layout (hub checkpoints, and what save_pretrained still writes) after them.
_QWEN_VL_PREFIXES = [
    (r"^model\.language_model\.", "language_model.model."),
    (r"^model\.visual\.", "visual."),
    (r"^model\.", "language_model.model."),
    (r"^visual\.", "visual."),
    (r"^lm_head\.", "language_model.lm_head."),
]
# LLaVA-style models (vLLM's LlavaForConditionalGeneration / Gemma3ForConditionalGeneration
# mappers): current transformers names first, then the pre-4.52 hub layout, which is already
# vLLM's own.
#
# transformers 5 builds the CLIP/SigLIP tower without its `vision_model.` level
# (`model.vision_tower.encoder.layers.0...`, saved as `vision_tower.encoder...`); vLLM 0.26 keeps
# it (`vision_tower.vision_model.encoder...`) and its LLaVA/Gemma3 mappers do not add it, so it is
# added here, and `vllm_load_name` adds it to the names refit hands to vLLM's loader.
_TOWER_WITHOUT_VISION_MODEL = r"vision_tower\.(?!vision_model\.)"
_LLAVA_PREFIXES = [
    (r"^model\.language_model\.", "language_model.model."),
    (rf"^model\.{_TOWER_WITHOUT_VISION_MODEL}", "vision_tower.vision_model."),
    (rf"^{_TOWER_WITHOUT_VISION_MODEL}", "vision_tower.vision_model."),
    (r"^model\.vision_tower\.", "vision_tower."),
    (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^language_model\.model\.", "language_model.model."),
    (r"^language_model\.lm_head\.", "language_model.lm_head."),
    (r"^vision_tower\.", "vision_tower."),
    (r"^multi_modal_projector\.", "multi_modal_projector."),
]
HF_TO_VLLM: dict[str, list[tuple[str, str]]] = {
    "qwen2_vl": list(_QWEN_VL_PREFIXES),
    "qwen2_5_vl": list(_QWEN_VL_PREFIXES),
    # Qwen3-VL: the same module paths (vLLM's Qwen3VLForConditionalGeneration mapper); its vision
    # blocks, merger and deepstack mergers use linear_fc1/linear_fc2 and a fused attn.qkv.
    "qwen3_vl": list(_QWEN_VL_PREFIXES),
    "llava": list(_LLAVA_PREFIXES),
    # SmolVLM (Idefics3): vLLM keeps transformers' module paths (model.vision_model,
    # model.connector, model.text_model, lm_head).
    "idefics3": [(r"^model\.", "model."), (r"^lm_head\.", "lm_head.")],
    "gemma3": list(_LLAVA_PREFIXES),
}

# Families the vLLM engine does not run yet, each with the reason (`resolve_engine_name` refuses
# them). Every family with a name-table row is handled today: its adapter collapses prompts to
# the form vLLM re-expands and names the processor kwargs; `VLLMSkips` says which checkpoint
# tensors vLLM builds no parameter for.
VLLM_PENDING: dict[str, str] = {}

# Families whose vLLM path is written but not yet measured on a GPU, each with where it stands.
# `auto` keeps them on the built-in engine; an explicit `rollout.engine=vllm` runs them with a
# warning. A family leaves this table with its measured token_mult_prob_error.
VLLM_UNVERIFIED: dict[str, str] = {
    "gemma3": "measured on an H200 only with rollout.enforce_eager=true and gpu_memory_utilization=0.01 "
              "(tiny model, token_mult_prob_error 1.0024 mean); the engine's KV cap for FlexAttention "
              "(vllm_engine.flex_kv_cap_bytes) that lets the defaults start has not run on a GPU",
}

# vLLM parameters that hold several checkpoint tensors, and the checkpoint module names
# stacked into each, in the order they sit along the output dimension.
STACKED: list[tuple[str, list[str]]] = [
    ("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
    ("gate_up_proj", ["gate_proj", "up_proj"]),
]

# The shard id vLLM's weight loaders take for each stacked member.
SHARD_IDS: dict[str, str | int] = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1}

# Where stacking applies, as vLLM-side prefixes. Qwen2-VL's vision MLP is fc1/fc2 (nothing
# to stack); Qwen2.5-VL's vision MLP is gated and vLLM fuses its gate/up like the decoder's.
# Both vision towers keep the checkpoint's fused `attn.qkv` as one parameter.
STACKING_SCOPES: dict[str, tuple[str, ...]] = {
    "qwen2_vl": ("language_model.model.layers.",),
    "qwen2_5_vl": ("language_model.model.layers.", "visual.blocks."),
    "qwen3_vl": ("language_model.model.layers.",),
    # vLLM's CLIP/SigLIP attention fuses q/k/v into qkv_proj; their MLP is fc1/fc2. vLLM builds the
    # tower only up to vision_feature_layer and without post_layernorm: those checkpoint tensors
    # (the last CLIP layer under the default -2) have a name here but no parameter in vLLM (`VLLMSkips`).
    "llava": ("language_model.model.layers.", "vision_tower.vision_model.encoder.layers."),
    # vLLM's Idefics3 vision attention fuses q/k/v like the Llama decoder.
    "idefics3": ("model.text_model.layers.", "model.vision_model.encoder.layers."),
    "gemma3": ("language_model.model.layers.", "vision_tower.vision_model.encoder.layers."),
}

# The transformers name of the input embedding, where it is not `model.language_model.embed_tokens`:
# the engine compares its module with lm_head's to learn whether vLLM tied them.
EMBED_TOKENS: dict[str, str] = {"idefics3": "model.text_model.embed_tokens.weight"}

# Per family: the vLLM prefix of the vision tower's transformer (CLIP/SigLIP/Idefics2 layout:
# embeddings, encoder.layers.N, post_layernorm, head), for `VLLMSkips`.
VISION_TRANSFORMER: dict[str, str] = {
    "llava": "vision_tower.vision_model.",
    "idefics3": "model.vision_model.",
    "gemma3": "vision_tower.vision_model.",
}

_MEMBER_TO_STACK = {member: stacked for stacked, members in STACKED for member in members}


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
        """The skips for a checkpoint's config.json (a dict), mirroring how vLLM 0.26 builds the family.

        LLaVA (`init_vision_tower_for_llava`): the tower stops at `vision_feature_layer` (the deepest
        one of a list; a negative index k keeps layers + k + 1 of them) and has post_layernorm only
        when every layer is built. Gemma3 builds the whole SigLIP tower with post_layernorm;
        Idefics3 the whole Idefics2 tower with post_layernorm. None of them builds the SigLIP head.
        """
        if family != "llava":
            return cls()
        total = int(config["vision_config"].get("num_hidden_layers", 0))
        layers = config.get("vision_feature_layer", -2)
        kept = max(_layer_count(k, total) for k in (layers if isinstance(layers, list) else [layers]))
        return cls(vision_layers=kept, post_layernorm=kept == total)

    def reason(self, family: str, hf_name: str) -> str | None:
        """Why vLLM has no parameter for this checkpoint tensor, or None when it has one."""
        prefix = VISION_TRANSFORMER.get(family)
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


def _layer_count(feature_layer: int, total: int) -> int:
    # vllm.model_executor.models.utils.get_layer_index
    return total + feature_layer + 1 if feature_layer < 0 else feature_layer


# Per family: renames of a transformers name into one vLLM's own `load_weights` maps correctly.
_ADD_VISION_MODEL = (rf"^(model\.)?{_TOWER_WITHOUT_VISION_MODEL}", r"\1vision_tower.vision_model.")
_VLLM_LOAD_RENAMES: dict[str, list[tuple[str, str]]] = {"llava": [_ADD_VISION_MODEL], "gemma3": [_ADD_VISION_MODEL]}


def vllm_load_name(family: str, hf_name: str) -> str:
    """The name refit hands to vLLM's `load_weights` for a transformers tensor (mostly the name itself)."""
    for pattern, repl in _VLLM_LOAD_RENAMES.get(family, ()):
        if re.match(pattern, hf_name):
            return re.sub(pattern, repl, hf_name, count=1)
    return hf_name


def _family_rules(family: str) -> list[tuple[str, str]]:
    if family not in HF_TO_VLLM:
        raise ValueError(f"weight_names: unknown family {family!r}; supported: {sorted(HF_TO_VLLM)}")
    return HF_TO_VLLM[family]


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


def vllm_param_for(family: str, hf_name: str) -> tuple[str, str | int | None]:
    """(vLLM parameter name, shard id or None) that holds the transformers tensor `hf_name`.

    A shard id is returned when vLLM fuses the tensor with its siblings into one parameter
    (q/k/v → qkv_proj, gate/up → gate_up_proj); None when the parameter is the tensor itself.
    """
    name = hf_to_vllm_name(family, hf_name)
    if not name.startswith(STACKING_SCOPES[family]):
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
