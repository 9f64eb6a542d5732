"""What a model family is, and the registry of families.

A family is one module in `models/families/` that holds everything the trainer, the data path,
the engines and the tiny-model builder need to know about it, and registers it once, by its
config.json `model_type`, with `register(Family(...))`:

- the image rule (`data.processing.IMAGE_RULES`, by processor class): the size the model sees,
  the processor call, and what each image placeholder expands to;
- the adapter (a `FamilyAdapter` subclass, built from the transformers config): special tokens,
  position ids, how many placeholders an image takes, the vision tower and how its features enter
  the decoder, the FSDP units, banned tokens, the end-of-turn token, the prompt form vLLM
  re-expands and its processor kwargs, and the tool format (`ToolFormat`: how the model writes
  a tool call and how a tool result enters the conversation; None when it cannot run tools);
- the vLLM names (`VLLMNames`): transformers names to vLLM's, which projections vLLM stacks,
  what it builds no parameter for, and whether the vLLM path was measured;
- the tiny-model spec (`models.families.tiny.TinySpec`) that tools/make_tiny_model.py builds.

Everything else asks the registry (`build_adapter`, `family`). Adding a family is a new module
plus one import line in `models/families/__init__.py`; docs/families.md walks through one.

Two per-prompt image tensors travel through the data pipeline, the batch and the engines
for every family (their names are historical, from the first family):

- `pixel_values`: what the vision tower takes, concatenated over images along dim 0 (Qwen-VL:
  patch rows; LLaVA: one (3, H, W) image per row);
- `image_grid_thw`: one int row per image saying how many placeholder tokens the image takes and
  how they are laid out (Qwen-VL: the (t, h, w) patch grid, t·h·w / merge² tokens; LLaVA:
  (1, h, w) with h·w the fixed token count).

Position ids are kept per sequence as an (R, L) tensor. Row 0 is always the plain 1-D position,
restarting at 0 for each sequence: packed attention finds sequence boundaries from it. Qwen-VL
families add three m-rope rows (R = 4); 1-D families have R = 1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from data.processing import register_image_rule


@dataclass(frozen=True)
class ToolFormat:
    """How a family's model writes a tool call and how a tool's answer enters its conversation.

    A call is the text between `call_start` and `call_end` (JSON `{"name": ..., "arguments": ...}`
    for the Qwen families). A tool's answer is one chat message of role `result_role` whose content
    is `result_prefix`, the returned images, the returned text, then `result_suffix`; the chat
    template renders it, so the tokens appended to an episode are exactly the template's.
    """

    call_start: str
    call_end: str
    result_role: str
    result_prefix: str = ""
    result_suffix: str = ""
    # The tools' schemas in the system turn, for a chat template that does not take `tools=`: the
    # system text (`default_system` when the conversation has none), "\n\n", `tools_intro`, each schema
    # as JSON on its own line, then `tools_outro`: what the family's own template writes when it does.
    tools_intro: str = ""
    tools_outro: str = ""
    default_system: str = ""

    def system_with_tools(self, system: str, schemas: list[dict]) -> str:
        """The system turn's text with `schemas` (OpenAI function schemas) rendered into it."""
        if not self.tools_intro:
            raise ValueError("this tool format does not say how tool schemas enter the system turn")
        system = system or self.default_system
        listed = "".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas)  # jinja's tojson
        return (system + "\n\n" if system else "") + self.tools_intro + listed + self.tools_outro

    def calls(self, text: str, tools: Mapping[str, dict] | None = None) -> list[str]:
        """The raw text of each call in `text`, in order; an unclosed call is its text up to the end.

        What the tool runner parses (`rollout.tools.parse_call`): JSON `{"name": ..., "arguments": ...}`.
        `tools` (name → the tool's JSON-schema `parameters`) is for formats whose values arrive as
        text and are converted by the schema's types (Qwen3.5's XML); this JSON format ignores it.
        """
        out: list[str] = []
        at = text.find(self.call_start)
        while at >= 0:
            start = at + len(self.call_start)
            end = text.find(self.call_end, start)
            if end < 0:
                out.append(text[start:])
                break
            out.append(text[start:end])
            at = text.find(self.call_start, end + len(self.call_end))
        return out

    def result_message(self, text: str, num_images: int) -> dict:
        """The chat message that carries one tool result (`num_images` image parts, then the text)."""
        parts = [{"type": "text", "text": self.result_prefix}] if self.result_prefix else []
        parts += [{"type": "image"} for _ in range(num_images)]
        if text or self.result_suffix:
            parts.append({"type": "text", "text": text + self.result_suffix})
        return {"role": self.result_role, "content": parts}


def require_tool_format(adapter: "FamilyAdapter") -> "ToolFormat":
    """The family's tool format; a family without one cannot run `rollout.tools`."""
    if adapter.tool_format is None:
        have = sorted(name for name, spec in FAMILIES.items() if spec.tool_format)
        raise ValueError(f"model family '{adapter.name}' has no tool-call format, so config key 'rollout.tools' "
                         f"cannot be used with it (families with one: {', '.join(have)}); set rollout.tools=[]")
    return adapter.tool_format


@dataclass
class FamilyAdapter:
    """What every family shares; subclasses fill in the family-specific parts."""

    name: str
    hf_architecture: str
    image_token_id: int
    extra_banned_ids: tuple[int, ...] = field(default=())
    # False: the language model cannot run several sequences in one packed row (the policy then
    # runs each sequence of a micro-batch on its own; see Policy.hidden_states).
    packable: bool = True
    # False: prompts of different lengths must not share a right-padded batch in the built-in
    # engine (a sliding-window cache counts padding slots as context); it then generates one
    # prompt (with its n samples, all the same length) at a time.
    batch_with_padding: bool = True
    # True: on CUDA, `model.attn_implementation: auto` runs packed rows through the varlen kernel
    # (models/attention.py); set only for families whose varlen path was checked on a GPU.
    varlen_attention: bool = False
    # True: the vision tower takes its images' (and windows') boundaries as `cu_seqlens`; where the decoder's
    # attention is varlen, the tower's runs them in one call too (models.attention.VISION_NAME)
    varlen_vision: bool = False
    # True: `image_features` runs the vision tower's module alone (its merger inside it, no projector of the
    # root's), so a pass can run it over all of its micro-batches' images at once (model.vision_once)
    vision_in_tower: bool = False
    # model.shared_prompts: causal attention with no mask of the family's own, so a row of a shared
    # prompt's segments (models.packing.pack_shared) computes what one sequence at a time does
    shares_prompts: bool = False
    # The token the family's chat template writes right after an assistant message: generation
    # stops on it and SFT targets end with it. "" for none (stop ids then come from the folder's
    # generation_config.json and tokenizer alone).
    end_of_turn: str = ""
    # How the model writes tool calls and reads tool results (multi-turn episodes, `rollout.tools`);
    # None: the family cannot run tools.
    tool_format: ToolFormat | None = None

    @property
    def banned_token_ids(self) -> list[int]:
        """Tokens a response must never contain: sampling one breaks the next forward."""
        return [self.image_token_id, *self.extra_banned_ids]

    # Checkpoint-file names → transformers' current module names: (pattern, replacement), first
    # match wins. Hub checkpoints saved before transformers 4.52 (and transformers 5's
    # save_pretrained, which converts back on save) use the old layout.
    legacy_weight_names: tuple[tuple[str, str], ...] = ()

    def canonical_weight_name(self, name: str) -> str:
        """A checkpoint key in transformers' current naming."""
        for pattern, repl in self.legacy_weight_names:
            if re.match(pattern, name):
                return re.sub(pattern, repl, name, count=1)
        return name

    def weight_parts(self, name: str) -> list[list[str]] | None:
        """The checkpoint names (canonical) that make up the model tensor `name` when checkpoint files
        store it in parts (hub MoE checkpoints: one tensor per expert): per row of the result, the
        names concatenated along dim 0, the rows then stacked. None: the files hold it whole."""
        return None

    # --- images -----------------------------------------------------------------------------
    def image_token_count(self, grid_row: torch.Tensor) -> int:
        """Placeholder tokens one image (one `image_grid_thw` row) takes in the prompt."""
        return int(torch.as_tensor(grid_row).prod())

    def pixel_rows(self, grid: torch.Tensor) -> int:
        """Rows of `pixel_values` the images of `grid` take."""
        return int(grid.shape[0])

    def check_pixels(self, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        """Raise ValueError when `pixels` does not hold exactly the images `grid` describes."""
        need = self.pixel_rows(grid)
        if pixels.shape[0] != need:
            raise ValueError(f"pixel_values has {pixels.shape[0]} rows, image_grid_thw {grid.tolist()} needs {need}")

    def dummy_vision_inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid (pixel_values, image_grid_thw), for zero-weighted keep-alive forwards."""
        raise NotImplementedError

    def image_features(self, model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """Vision features of the images, in image order: a list of streams, each (tokens, hidden).

        Stream 0 replaces the image placeholders in the input embeddings; further streams (Qwen3-VL's
        deepstack levels) are handed to `run_language_model` aligned with the placeholders.
        """
        raise NotImplementedError

    # --- videos -----------------------------------------------------------------------------
    # A family that takes video gives its positions (`position_ids`' video arguments), the token
    # its placeholder runs are made of, and its vLLM prompt form (`vllm_video_items`).
    takes_video: bool = False
    video_token_id: int = 0

    def video_token_count(self, grid_row: torch.Tensor) -> int:
        """Placeholder tokens one video (one `video_grid_thw` row) takes in the prompt."""
        return self.image_token_count(grid_row)

    def check_videos(self, video_grid_thw: torch.Tensor | None) -> None:
        """Raise the one-line error of a family without video given videos."""
        if video_grid_thw is not None and not self.takes_video:
            raise ValueError(f"model family '{self.name}' takes no video, but a prompt has `videos` "
                             f"({video_grid_thw.shape[0]}); use a family that does (docs/families.md)")

    # --- positions --------------------------------------------------------------------------
    def position_ids(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     video_grid_thw: torch.Tensor | None = None,
                     second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
        """(1, L) plain positions of one sequence; m-rope families return (4, L)."""
        self.check_videos(video_grid_thw)
        self._check_placeholders(input_ids, image_grid_thw)
        return torch.arange(input_ids.numel()).unsqueeze(0)

    def _check_placeholders(self, input_ids: torch.Tensor, grid: torch.Tensor | None) -> None:
        have = int((input_ids == self.image_token_id).sum())
        need = 0 if grid is None else sum(self.image_token_count(g) for g in grid)
        if have != need:
            raise ValueError(f"sequence has {have} image placeholder tokens, its images need {need}")

    def next_rope_position(self, position_ids: torch.Tensor) -> int:
        """The position a token appended after this (R, L) sequence takes."""
        return int(position_ids[-1].max()) + 1 if position_ids.shape[1] else 0

    def rope_rows(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The rows of (R, ...) position ids the family's own forward takes."""
        return position_ids[:1]

    @property
    def rope_row_count(self) -> int:
        """How many rows `rope_rows` keeps."""
        return 1

    # --- forward ----------------------------------------------------------------------------
    def run_language_model(self, model: nn.Module, embeds: torch.Tensor, position_ids: torch.Tensor,
                           image_mask: torch.Tensor, extra_streams: list[torch.Tensor]) -> torch.Tensor:
        """Last hidden states (B, L, H) of the decoder on input embeddings.

        `position_ids` is (R, B, L) as packed; row 0 restarting at 0 marks packed sequences.
        """
        out = self.language_model(model)(inputs_embeds=embeds, position_ids=position_ids[0], use_cache=False)
        return out.last_hidden_state

    def engine_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                      pixels: torch.Tensor | None, grid: torch.Tensor | None) -> dict:
        """Keyword arguments of the family's `model.model(...)` for the built-in engine.

        `positions` holds `rope_rows` of each row's position ids, shape (r, B, L).
        """
        kwargs = dict(input_ids=input_ids, position_ids=positions[0], attention_mask=attention_mask)
        if pixels is not None:
            kwargs["pixel_values"] = pixels
        return kwargs

    def video_engine_inputs(self, pixels: torch.Tensor, grid: torch.Tensor, seconds: torch.Tensor | None) -> dict:
        """Keyword arguments that add videos to the built-in engine's `model.model(...)` call."""
        raise ValueError(f"model family '{self.name}' takes no video")

    def rebuild_buffers(self, module: nn.Module, device) -> bool:
        """Refill the non-persistent buffers of a config-less module built on meta; False if unknown."""
        return False

    # --- module structure -------------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.visual

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.model.language_model

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(self.language_model(model).layers)

    def block_units(self, layer: nn.Module) -> list[nn.Module]:
        """Submodules of a decoder block that are FSDP units of their own (sharded before the block,
        which keeps the rest); none for a dense family."""
        return []

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.language_model(model).norm

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        return self.language_model(model).embed_tokens

    def routers(self, model: nn.Module) -> list[nn.Module]:
        """The MoE router of each decoder layer that has one (its forward returns the router logits
        (tokens, experts) first); empty for a dense family."""
        return []

    @property
    def experts_per_token(self) -> int:
        """How many experts the routers pick per token (0 for a dense family)."""
        return 0

    def tp_plan(self) -> dict[str, str]:
        """Per-decoder-block tensor-parallel plan (submodule → 'colwise' | 'rowwise')."""
        return {
            "self_attn.q_proj": "colwise",
            "self_attn.k_proj": "colwise",
            "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_proj": "colwise",
            "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        }

    # --- vLLM prompts and processor -----------------------------------------------------------
    # vLLM 0.26 takes a token prompt as un-expanded: its multimodal processor replaces, for each
    # image in order, the first target token after the previous image with that image's
    # replacement ids (`BaseMultiModalProcessor._apply_prompt_updates` → `apply_token_matches`).
    # The trainer's ids are already expanded, so `vllm_collapse` undoes the family's expansion and
    # `vllm_expand` redoes it the way vLLM does; the engine checks that the two round-trip.
    def vllm_collapse(self, ids: list[int], vocab: Mapping[str, int]) -> tuple[list[int], list[list[int]]]:
        """(the prompt vLLM expands itself, each image's replacement ids as vLLM inserts them).

        Default (Qwen-VL, LLaVA): vLLM's `PromptReplacement` targets one image token and inserts
        the image's whole run of it, so each run becomes one token.
        """
        out: list[int] = []
        runs: list[list[int]] = []
        for token in ids:
            if token == self.image_token_id and out and out[-1] == token:
                runs[-1].append(token)
                continue
            out.append(token)
            if token == self.image_token_id:
                runs.append([token])
        return out, runs

    def vllm_target(self, vocab: Mapping[str, int]) -> int:
        """The token vLLM replaces with an image's replacement ids."""
        return self.image_token_id

    def vllm_expand(self, ids: list[int], replacements: list[list[int]], vocab: Mapping[str, int]) -> list[int]:
        """The prompt vLLM 0.26 runs for a collapsed prompt: image i's target becomes replacements[i]."""
        return replace_targets(ids, self.vllm_target(vocab), replacements)

    def vllm_collapse_videos(self, ids: list[int]) -> tuple[list[int], list[list[int]]]:
        """(the prompt with each video's expansion collapsed to the one `video_token_id` vLLM replaces,
        each video's replacement ids); `vllm_expand_videos` undoes it. No video: the ids as they are."""
        return list(ids), []

    def vllm_expand_videos(self, ids: list[int], replacements: list[list[int]]) -> list[int]:
        """The prompt vLLM 0.26 runs for a video-collapsed prompt: video i's target becomes replacements[i]."""
        return replace_targets(ids, self.video_token_id, replacements) if replacements else list(ids)

    def vllm_video_items(self, videos: list) -> tuple[list, dict]:
        """(the `multi_modal_data["video"]` items, the per-request `mm_processor_kwargs`) for canonical clips."""
        raise ValueError(f"model family '{self.name}' takes no video")

    def vllm_processor_cache_safe(self, max_videos_per_prompt: int) -> bool:
        """Whether vLLM's multimodal processor cache gives right results for this family's prompts of up
        to `max_videos_per_prompt` videos (see `QwenVLAdapter`'s for one where it does not)."""
        return True

    def vllm_engine_kwargs(self) -> dict:
        """Extra `vllm.LLM(...)` arguments the family's vLLM module needs (default: none)."""
        return {}

    def vllm_env(self) -> dict[str, str]:
        """Environment variables vLLM must read when the engine is built, for choices vLLM 0.26 takes
        only from the environment, such as its model runner (default: none)."""
        return {}

    def vllm_processor_kwargs(self, min_pixels: int, max_pixels: int) -> dict:
        """`mm_processor_kwargs` that make vLLM's HF processor see the images as the trainer's does.

        Default (LLaVA): the trainer calls the processor with its defaults on images already at the
        tower's square size, so vLLM needs none either.
        """
        return {}


def replace_targets(ids: list[int], target: int, replacements: list[list[int]]) -> list[int]:
    """Each replacement, in order, in place of the first `target` after the previous replacement.

    vLLM finds every image's first match from the end of the last replacement and applies the
    earliest one at a time, which for one target token is this left-to-right walk. A missing
    target is an error here (vLLM would fall back to matching on decoded text).
    """
    out: list[int] = []
    start = 0
    for i, repl in enumerate(replacements):
        try:
            at = ids.index(target, start)
        except ValueError:
            raise ValueError(f"vLLM prompt: no image target token {target} left for image {i}") from None
        out += ids[start:at] + list(repl)
        start = at + 1
    return out + ids[start:]


@dataclass(frozen=True)
class VLLMNames:
    """How vLLM 0.26 names, stacks and leaves out a family's weights (rollout/weight_names.py reads it).

    `prefixes`: (regex on the transformers name, vLLM prefix replacing the match), first match
    wins; module names of a transformers 5 model first, the checkpoint-file layout after them.
    `stacking_scopes`: vLLM-side prefixes under which q/k/v and gate/up are stacked into one
    parameter. `embed_tokens`: the transformers name of the input embedding (the engine compares
    it with lm_head to learn whether vLLM tied them). `vision_transformer`: the vLLM prefix of a
    CLIP/SigLIP-style tower (embeddings, encoder.layers.N, post_layernorm, head) whose parts vLLM
    may leave out; `skips(config_dict)` says which (`rollout.weight_names.VLLMSkips` fields).
    `load_renames`: renames that make a transformers name one vLLM's own `load_weights` maps.
    `mm_prefix`: vLLM runs the family with bidirectional attention over images (FlexAttention).
    `unverified`: where the vLLM path stands while it is not measured on a GPU (auto then keeps
    the built-in engine); `pending`: why vLLM cannot run the family at all.
    """

    prefixes: tuple[tuple[str, str], ...]
    stacking_scopes: tuple[str, ...]
    embed_tokens: str = "model.language_model.embed_tokens.weight"
    vision_transformer: str | None = None
    skips: Callable[[dict], dict] | None = None
    load_renames: tuple[tuple[str, str], ...] = ()
    mm_prefix: bool = False
    unverified: str = ""
    pending: str = ""


@dataclass(frozen=True)
class Family:
    """One registered family: what `register` records under `model_type`."""

    model_type: str
    adapter: Callable[[object], FamilyAdapter]  # transformers config -> adapter
    image_rules: Mapping[str, type]  # processor class -> data-side image rule
    vllm: VLLMNames
    tiny: object  # models.families.tiny.TinySpec
    tool_format: ToolFormat | None = None  # the adapter's, for listing which families can run tools


FAMILIES: dict[str, Family] = {}
# model_type -> adapter builder, for callers that only need to know what is supported.
ADAPTERS: dict[str, Callable[[object], FamilyAdapter]] = {}


def register(spec: Family) -> Family:
    """Record a family under its model_type and its image rules under their processor classes."""
    if spec.model_type in FAMILIES:
        raise ValueError(f"model family {spec.model_type!r} is registered twice")
    FAMILIES[spec.model_type] = spec
    ADAPTERS[spec.model_type] = spec.adapter
    for processor_class, rule in spec.image_rules.items():
        register_image_rule(processor_class, rule)
    return spec


def family(model_type: str) -> Family:
    """The registered family of a config.json `model_type`; an unknown one names the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"model family '{model_type}' is not supported; supported families: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def build_adapter(config) -> FamilyAdapter:
    """The adapter for a transformers config; an unsupported family names the supported ones."""
    return family(getattr(config, "model_type", None)).adapter(config)


# The family modules register themselves on import; they import this module's names above.
import models.families  # noqa: E402,F401


def __getattr__(name: str):
    # models/policy.py takes QwenVLAdapter from here for its default weight-name rules.
    if name == "QwenVLAdapter":
        from models.families.qwen_vl import QwenVLAdapter

        return QwenVLAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
