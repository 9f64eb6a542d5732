"""GLM-4.1V (transformers `glm4v`): a Qwen2-VL-style dynamic-resolution tower over a GLM-4 decoder.

Images keep their size on the 28-pixel grid (14-pixel patches, 2×2 merge), as in Qwen2-VL, and
each becomes a run of `<|image|>` tokens framed by `<|begin_of_image|>` / `<|end_of_image|>`.
Positions are 3-D rope ids computed as Qwen2-VL's for images (`get_rope_index`: an image of
merged grid (1, h, w) takes start + (0, i, j), the text after it resumes at start + max(h, w)), so
the adapter is Qwen-VL's; what differs is inside the model: the decoder rotates only half of each
head (partial_rotary_factor 0.5) with the m-rope sections interleaved pairwise. The tower has
learned position embeddings interpolated to the image grid, a 2×2 conv downsample and a gated
merger. The decoder's MLP is one fused gate_up_proj, split by `chunk` in the forward.

vLLM 0.26: `Glm4vForConditionalGeneration` (vllm/model_executor/models/glm4_1v.py) with a
`Glm4ForCausalLM` decoder; its mapper moves `model.language_model.` → `language_model.model.`,
`model.visual.` → `visual.`, `lm_head.` → `language_model.lm_head.`; it stacks the decoder's
q/k/v into qkv_proj (gate_up_proj is fused on both sides) and the tower's gate/up (blocks and
merger) into gate_up_proj; the tower's attn.qkv is fused on both sides. Its processor replaces
each `<|image|>` with the image's run (`Glm4vMultiModalProcessor._get_prompt_updates`).
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers

from models.families.qwen_vl import _PREFIXES, QwenImages, QwenVLAdapter
from models.families.tiny import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, SizeSpec, TinySpec, text_config, token_ids
from models.family import Family, VLLMNames, register


class Glm4vImages(QwenImages):
    """Qwen-VL's image rule with GLM's placeholder: one `<|image|>` per merged patch."""

    placeholder = "<|image|>"


@dataclass
class Glm4vAdapter(QwenVLAdapter):
    """Qwen-VL positions, inputs and vision call; GLM's tokens, end of turn and tensor-parallel plan.

    `vision_start_token_id` / `vision_end_token_id` hold `<|begin_of_image|>` / `<|end_of_image|>`;
    the video frame tokens are banned too (`extra_banned_ids`).
    """

    end_of_turn: str = "<|user|>"  # GLM's template opens the next turn; generation stops on it
    varlen_attention: bool = False  # not yet checked on a GPU
    shares_prompts: bool = False  # not checked for this family
    takes_prebuilt_masks: bool = False  # transformers' GLM-4.1V decoder builds its masks whatever it is given

    @property
    def banned_token_ids(self) -> list[int]:
        return [*super().banned_token_ids, *self.extra_banned_ids]

    def tp_plan(self) -> dict[str, str]:
        # The fused gate_up_proj is split in half by `chunk` after the matmul: sharding its output
        # would hand each rank halves of both gate and up. The MLP stays replicated.
        return {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.o_proj": "rowwise"}


def _glm4v_adapter(config) -> Glm4vAdapter:
    vc = config.vision_config
    return Glm4vAdapter(
        name="glm4v",
        hf_architecture="Glm4vForConditionalGeneration",
        image_token_id=config.image_token_id,
        extra_banned_ids=(config.video_start_token_id, config.video_end_token_id),
        video_token_id=config.video_token_id,
        vision_start_token_id=config.image_start_token_id,
        vision_end_token_id=config.image_end_token_id,
        spatial_merge_size=vc.spatial_merge_size,
        patch_size=vc.patch_size,
        temporal_patch_size=vc.temporal_patch_size,
    )


# --- tiny checkpoint ----------------------------------------------------------------------------
GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>",
              "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>")


def _tiny_config(size: SizeSpec, tokenizer):
    head_dim = size.text_hidden // size.text_heads
    # Half of each head rotates (GLM-4.1V: 64 of 128 dims, sections [8, 12, 12] of 32 frequencies).
    n = head_dim // 4
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [n - 2 * (3 * n // 8), 3 * n // 8, 3 * n // 8]}
    # attention_bias: GLM-4.1V's q/k/v have biases (transformers always builds them); its
    # config.json says so, and vLLM's Glm4 decoder reads it to build them too.
    text = text_config(size, tokenizer, model_type="glm4v_text", rope_parameters=rope, attention_bias=True,
                       pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    vision = dict(depth=size.vision_depth, hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
                  num_heads=size.vision_heads, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                  temporal_patch_size=TEMPORAL_PATCH_SIZE, out_hidden_size=size.text_hidden,
                  image_size=PATCH_SIZE * 8)  # an 8x8 learned position table, interpolated per image
    ids = token_ids(tokenizer, "<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>",
                    "<|begin_of_video|>", "<|end_of_video|>")
    return transformers.Glm4vConfig(
        text_config=text, vision_config=vision, image_token_id=ids[0], video_token_id=ids[1],
        image_start_token_id=ids[2], image_end_token_id=ids[3], video_start_token_id=ids[4],
        video_end_token_id=ids[5], tie_word_embeddings=False, architectures=["Glm4vForConditionalGeneration"],
    )


def _tiny_image_processor(size: SizeSpec):
    cls = getattr(transformers, "Glm4vImageProcessorPil", None) or transformers.Glm4vImageProcessor
    return cls(size={"shortest_edge": size.min_pixels, "longest_edge": size.max_pixels}, patch_size=PATCH_SIZE,
               temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
               image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])


register(Family(
    model_type="glm4v",
    adapter=_glm4v_adapter,
    image_rules={"Glm4vProcessor": Glm4vImages},
    vllm=VLLMNames(
        # measured on an H200 (tiny model, vLLM 0.26, bf16): token_mult_prob_error 1.0037 mean, 1.0042 max
        prefixes=_PREFIXES, stacking_scopes=("language_model.model.layers.", "visual."),
    ),
    tiny=TinySpec(
        model_class="Glm4vForConditionalGeneration", processor_class="Glm4vProcessor", config=_tiny_config,
        image_processor=_tiny_image_processor, extra_tokens=tuple((t, True) for t in GLM_TOKENS),
        image_part="<|begin_of_image|><|image|><|end_of_image|>", end_of_turn="<|user|>",
        named_tokens=(("image_token", "<|image|>"),),
    ),
))
