"""The DTensor policy: a transformers VLM built on meta, sharded with FSDP2, loaded from safetensors.

`Policy.logprobs(mb)` runs one packed micro-batch and returns the log-probabilities (and
entropies) of its scored tokens only: hidden states are gathered at the scored positions and
pushed through lm_head in chunks, each chunk under activation checkpointing, so full-vocabulary
fp32 logits never exist for the whole pack at once.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import shutil
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from models.attention import image_grid, packed_row, set_direct_flash
from models.family import FamilyAdapter, QwenVLAdapter, build_adapter
from models.logits import entropy, head_logits, head_logprobs
from models.lora import (
    adapters_detached, apply_lora, init_lora_weights, is_adapter_name, lora_module_names, lora_modules, merged_weight,
)
from models.moe import apply_routing_replay, load_balancing_loss, routes_as
from models.packing import PackedMicrobatch
from models.parallel import ComputeCopy, ParallelDims, apply_parallelism, full_value, unit_modules
from models.phases import phase_range

log = logging.getLogger("vlrl")

LOGPROB_CHUNK = 1024  # scored tokens per lm_head chunk

# Files of a model folder that export copies next to the weights.
_SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json", "vocab.json", "merges.txt", "added_tokens.json",
)


def canonical_weight_name(name: str, adapter: FamilyAdapter | None = None) -> str:
    """A checkpoint key in transformers' current naming (model.language_model.*, model.visual.*, lm_head.*).

    The family's adapter knows its legacy layouts; without one, the Qwen-VL rules apply.
    """
    if adapter is None:
        adapter = QwenVLAdapter(name="", hf_architecture="", image_token_id=-1)
    return adapter.canonical_weight_name(name)


def check_config_dtypes(config: dict, where: str) -> None:
    """Raise ValueError naming `where` unless every `dtype` / `torch_dtype` in a model's config.json (its
    sub-configs' too) is null or names a torch floating-point dtype: transformers looks the name up with
    `getattr(torch, name)`, and a bad one fails there as an AttributeError traceback."""
    stack = [("", config)]
    while stack:
        prefix, section = stack.pop()
        for key, value in section.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))
            elif key in ("dtype", "torch_dtype") and value is not None:
                found = getattr(torch, value, None) if isinstance(value, str) else None
                if not (isinstance(found, torch.dtype) and found.is_floating_point):
                    raise ValueError(f"{where}: {prefix}{key} is {value!r}, not a torch floating-point dtype; "
                                     "use bfloat16, float16 or float32 (the source checkpoint's value)")


def load_model_config(path: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={path!r} is not a model folder (no config.json); put a Hugging Face checkpoint "
            "folder on local disk and point model.path at it"
        )
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON ({exc})") from None
    if isinstance(raw, dict):
        check_config_dtypes(raw, str(folder / "config.json"))
    return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=trust_remote_code)


def _open_weights(path: str, adapter: FamilyAdapter | None = None) -> dict[str, tuple[str, str]]:
    """Map canonical weight name → (safetensors file, key in that file) for a model folder."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = json.loads(index.read_text())["weight_map"]
        return {canonical_weight_name(k, adapter): (str(folder / v), k) for k, v in files.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    with safe_open(str(single), framework="pt") as f:
        return {canonical_weight_name(k, adapter): (str(single), k) for k in f.keys()}


def load_safetensors_into(model: nn.Module, path: str, adapter: FamilyAdapter | None = None) -> None:
    """Fill every parameter and persistent buffer of a (possibly sharded) model from a folder's safetensors.

    Each rank reads one full tensor at a time and keeps its own shard. Tied weights (lm_head
    sharing the embedding) may be absent from the files.
    """
    where = _open_weights(path, adapter)
    handles: dict[str, object] = {}
    tied = bool(getattr(getattr(model.config, "text_config", model.config), "tie_word_embeddings", False)) or bool(
        getattr(model.config, "tie_word_embeddings", False)
    )
    missing = []

    def read(name: str) -> torch.Tensor:
        file, key = where[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        return handles[file].get_tensor(key)

    for name, tensor in model.state_dict().items():
        parts = adapter.weight_parts(name) if adapter is not None and name not in where else None
        if parts and all(p in where for row in parts for p in row):
            full = torch.stack([torch.cat([read(p) for p in row]) for row in parts])
        elif name not in where:
            if tied and name.endswith("lm_head.weight"):
                continue
            missing.append(name)
            continue
        else:
            full = read(name)
        if tuple(full.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(tensor.shape)}")
        with torch.no_grad():
            if isinstance(tensor, DTensor):
                shard = distribute_tensor(full.to(tensor.dtype), tensor.device_mesh, tensor.placements)
                tensor.to_local().copy_(shard.to_local())
            else:
                tensor.copy_(full.to(tensor.dtype))
    if missing:
        raise ValueError(f"{len(missing)} weights missing from the checkpoint in {path}, e.g. {missing[:3]}")


def _reinit_nonpersistent_buffers(model: nn.Module, device: torch.device, adapter: FamilyAdapter | None = None) -> None:
    """Recompute buffers that are not in checkpoints (rotary inv_freq) after building on meta.

    A module with a config is rebuilt from it; one without (Gemma3's scaled embedding) is left
    to the family adapter.
    """
    for module in model.modules():
        names = [n for n in module._buffers if n in getattr(module, "_non_persistent_buffers_set", set())]
        if not names:
            continue
        if not hasattr(module, "config") and adapter is not None and adapter.rebuild_buffers(module, device):
            continue
        if not hasattr(module, "config"):
            raise RuntimeError(f"cannot rebuild non-persistent buffers of {type(module).__name__}")
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        for n in names:
            module._buffers[n] = fresh._buffers[n].to(device)


def _store_parameters_in(model: nn.Module, dtype: torch.dtype) -> None:
    """A frozen model (the reference) keeps its parameters in the compute dtype: the values FSDP's mixed
    precision would cast them to before every forward (round to nearest even, once, at load), for half the
    memory of fp32 and no cast per forward. Tied parameters stay tied."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            module._parameters[name] = done[id(p)]


def _has_meta(model: nn.Module) -> list[str]:
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]


# The compute dtypes the flash kernels (torch's varlen, flash-attn 2, vLLM's) take.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def resolve_attn_implementation(name: str, device_type: str, varlen_ok: bool = False,
                                dtype: torch.dtype = torch.bfloat16) -> str:
    """The attention implementation to build with. `auto`: on CUDA, the varlen kernel where the
    family is validated with it (`varlen_ok`) and torch has it, else flash-attn 2 if installed,
    else sdpa; sdpa for an fp32 forward on CUDA (the flash kernels take bf16/fp16 only). Off CUDA, varlen
    where the family takes it (each sequence of a packed row through SDPA on its own, not the whole row under
    a block-diagonal mask), else sdpa. "varlen" is registered with transformers here."""
    from models.attention import kernel_available, register

    if device_type == "cuda" and dtype not in HALF_DTYPES and name in ("varlen", "flash_attention_2", "vllm_paged"):
        raise ValueError(f"config key 'model.attn_implementation' is {name} with model.dtype "
                         f"{str(dtype).removeprefix('torch.')}, but its CUDA kernel takes bfloat16 or float16 only; "
                         "set it to auto or sdpa, or model.dtype to bfloat16")
    if name == "auto":
        if device_type != "cuda":
            name = "varlen" if varlen_ok else "sdpa"
        elif dtype not in HALF_DTYPES:
            name = "sdpa"
        elif varlen_ok and kernel_available():
            name = "varlen"
        else:
            try:
                import flash_attn  # noqa: F401

                name = "flash_attention_2"
            except ImportError:
                name = "sdpa"
    if name == "varlen":
        register()
    elif name == "vllm_paged":  # vLLM's FlashAttention call on the paged layout (SDPA per sequence off CUDA)
        from models.attention import register_engine_flash

        register_engine_flash()
    return name


def compute_dtype(name: str, device_type: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class Policy:
    """A sharded VLM plus its family adapter; runs packed micro-batches and yields full weights."""

    def __init__(self, model: nn.Module, adapter: FamilyAdapter, dims: ParallelDims, path: str, dtype: torch.dtype,
                 shared_prompts: bool = False, liger_kernel: bool = False, fp32_logits: bool = False,
                 vision_once: bool = False, pad_vision_mlp: bool = False, padded_vision_mlps: int = 0,
                 torch_rms_norm: bool = False, torch_rms_norms: int = 0, flash_direct: bool = False):
        self.model = model
        self.adapter = adapter
        self.dims = dims
        self.path = path
        self.dtype = dtype
        self.device = dims.device
        self._dummy_vision = None
        # MoE: weight of the routers' load-balancing loss (model.router_aux_loss_coef); with it set,
        # every forward that builds a graph leaves that loss in `router_aux` for the update to add.
        self.router_aux_coef = 0.0
        self.router_aux: torch.Tensor | None = None
        self._router_logits: list[torch.Tensor] | None = None
        # exact mode (rollout.exact): (banned token ids, their logit bias) applied to the fp32 logits before the
        # temperature and a log_softmax, the order and the op the vLLM sampler uses; None: logsumexp path
        self.exact_logit_bias: tuple[tuple[int, ...], float] | None = None
        # exact mode: (model-dtype logits, targets, temperature) -> the engine's values for them, or None
        self.exact_engine_logprobs = None
        # model.shared_prompts as settled for this family and device (models.policy.shares_prompts)
        self.shared_prompts = shared_prompts
        # model.liger_kernel as settled for this family and device (models.policy.uses_liger)
        self.liger_kernel = liger_kernel
        # model.fp32_logits as settled by the config (off with rollout.exact): the lm_head's logits with fp32
        # output from the model-dtype operands (models.logits.head_logits), as vLLM's head_dtype=float32
        self.fp32_logits = fp32_logits
        # model.vision_once as settled for this family and device (models.policy.runs_vision_once)
        self.vision_once = vision_once
        self._fsdp_units: list[nn.Module] | None = None  # `fsdp_units`, found on first use
        # model.pad_vision_mlp as settled for this device (models.policy.cuda_switch), and how many of the
        # tower's MLPs it widened (build_policy)
        self.pad_vision_mlp = pad_vision_mlp
        self.padded_vision_mlps = padded_vision_mlps
        # model.torch_rms_norm as settled for this device (models.policy.cuda_switch), and how many RMSNorms run
        # torch's fused kernel (build_policy)
        self.torch_rms_norm = torch_rms_norm
        self.torch_rms_norms = torch_rms_norms
        # model.flash_direct as settled for this device: the varlen attention's kernel called directly
        self.flash_direct = flash_direct
        # parallel.one_device=plain with a compute dtype below fp32: the masters' compute copies (build_policy)
        self.compute: ComputeCopy | None = None

    # --- forward ---------------------------------------------------------------------------
    def _vision_keepalive(self) -> torch.Tensor:
        """A zero-weighted vision forward for micro-batches without images.

        Every rank must run the vision tower's FSDP collectives in every micro-batch, or a rank
        holding only text-only samples would hang the others.
        """
        if self._dummy_vision is None:
            pixels, grid = self.adapter.dummy_vision_inputs(self.device)
            self._dummy_vision = (pixels, grid, grid.tolist())  # the grid read back once, not every micro-batch
        pixels, grid, rows = self._dummy_vision
        with image_grid(rows):
            streams = self.adapter.image_features(self.model, pixels, grid)
        return sum(s.float().sum() for s in streams) * 0.0

    def _vision_chunk(self, chunk: "VisionChunk") -> list[torch.Tensor]:
        """The feature streams of a pass's vision tower call; a keep-alive's zero-weighted scalar without pixels."""
        if chunk.pixels is None:
            return [self._vision_keepalive()]
        with phase_range("vision tower"), image_grid(chunk.rows) if chunk.rows is not None else nullcontext():
            return self.adapter.image_features(self.model, chunk.pixels, chunk.grid)

    @contextmanager
    def pass_vision(self, microbatches: list[PackedMicrobatch], plan: list[list[int]] | None
                    ) -> Iterator["PassVision | None"]:
        """A pass over `microbatches` with the vision tower run per chunk of `plan` (`vision_plan`, padded with
        empty chunks to the count every rank runs) instead of per micro-batch; None: per micro-batch."""
        if plan is None:
            yield None
            return
        run = PassVision(self, microbatches, plan)
        try:
            run.encode()
            yield run
        finally:
            run.close()

    def hidden_states(self, mb: PackedMicrobatch) -> torch.Tensor:
        """Last hidden states (L, H) of a packed row.

        The vision tower runs once per distinct image group (the G responses of a prompt share
        one); its features are repeated into every sequence that uses them, so autograd sums
        their gradients. The features replace the image placeholders, as the model's own
        forward does, and the language model runs on the packed embeddings. A family that
        cannot pack (`adapter.packable` false) runs the language model once per sequence of the
        row, on that sequence's slice: the same logprobs as one sequence per micro-batch.

        The row's boundaries, image grids and placeholder counts come from the micro-batch's host layout: the
        forward reads nothing back, however deep the model (a micro-batch made on the device: its placeholder
        counts, once).
        """
        a = self.adapter
        embeds = a.embed_tokens(self.model)(mb.input_ids)
        image_mask = mb.input_ids == a.image_token_id
        extra: list[torch.Tensor] = []
        if mb.pixel_values is None and mb.pixel_values_videos is None:
            # in a pass that ran the tower for all its micro-batches (`pass_vision`) its collectives ran there
            keepalive = None if mb.vision is not None else self._vision_keepalive().to(embeds.dtype)
        else:
            with phase_range("vision tower"):
                embeds, image_mask, extra = self._with_vision_features(mb, embeds, image_mask)
            keepalive = None
        if mb.routed_experts is not None:  # MoE routing replay: the engine's experts per token
            apply_routing_replay(a.routers(self.model))
        host = mb.host_layout()
        if a.packable or mb.cu_seqlens.numel() <= 2:
            bounds = {} if host is None else {"bounds": host.cu_seqlens, "bounds_k": host.cu_seqlens_k}
            with packed_row(mb.cu_seqlens.to(embeds.device), mb.input_ids.shape[1], mb.kv_index,
                            mb.cu_seqlens_k, **bounds), routes_as(mb.routed_experts), phase_range("language model"):
                hidden = a.run_language_model(self.model, embeds, mb.position_ids, image_mask, extra)[0]
        else:
            with phase_range("language model"):
                hidden = torch.cat(self._per_sequence(mb, embeds, image_mask, extra))
        return hidden if keepalive is None else hidden + keepalive

    def _with_vision_features(self, mb: PackedMicrobatch, embeds, image_mask):
        """(embeddings with the vision features in place of the placeholders, the mask of every vision
        token, the further feature streams over those tokens)."""
        a = self.adapter
        images, videos = self._vision_streams(mb)
        video_mask = mb.input_ids == a.video_token_id if videos else torch.zeros_like(image_mask)
        host = mb.host_layout()
        if host is not None and host.input_ids is not None:  # counted on the host's copy of the row: no read back
            ids = host.input_ids
            counts = [int((ids == a.image_token_id).sum()), int((ids == a.video_token_id).sum()) if videos else 0]
        else:
            counts = torch.stack([image_mask.sum(), video_mask.sum()]).tolist()  # one read back for both checks
        for mask, found, kind, count in ((image_mask, images, "image", counts[0]),
                                         (video_mask, videos, "video", counts[1])):
            have = found[0].shape[0] if found else 0
            if count != have:
                raise ValueError(f"{count} {kind} placeholders but {have} {kind} features")
            if found:
                embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), found[0].to(embeds.dtype))
        # Further streams (DeepStack) run over every vision token in row order, images and videos mixed.
        visual = image_mask | video_mask
        extra = []
        in_image = image_mask[visual] if images and videos and max(len(images), len(videos)) > 1 else None
        for k in range(1, max(len(images), len(videos))):
            if in_image is None:
                extra.append((images or videos)[k].to(embeds.dtype))
                continue
            joint = embeds.new_zeros(sum(counts), embeds.shape[-1])
            joint[in_image] = images[k].to(embeds.dtype)
            joint[~in_image] = videos[k].to(embeds.dtype)
            extra.append(joint)
        return embeds, visual, extra

    def _per_sequence(self, mb: PackedMicrobatch, embeds, image_mask, extra) -> list[torch.Tensor]:
        """Hidden states of each sequence of the row, run on its own (families that cannot pack)."""
        out, used = [], 0
        host = mb.host_layout()
        bounds = host.cu_seqlens if host is not None else mb.cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            mask = image_mask[:, start:end]
            n = int(mask.sum())
            seq_extra = [s[used:used + n] for s in extra]
            used += n
            routes = None if mb.routed_experts is None else mb.routed_experts[start:end]
            with routes_as(routes):
                out.append(self.adapter.run_language_model(
                    self.model, embeds[:, start:end], mb.position_ids[:, :, start:end], mask, seq_extra)[0])
        return out

    def _vision_streams(self, mb: PackedMicrobatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(image streams, video streams) in row order, each a list over feature streams of (tokens, H).

        The vision tower runs once over the micro-batch's distinct image groups and video groups
        together (a video's patch rows are an image's with t > 1), or once for the whole pass
        (`pass_vision`, which leaves this micro-batch's share in `mb.vision`); each group's features are
        then repeated into every sequence that uses it.
        """
        a = self.adapter
        if mb.vision is not None:  # the pass ran the tower already
            streams = mb.vision
        else:
            pixels, grid, rows = _tower_inputs(mb)
            with image_grid(rows) if rows is not None else nullcontext():
                streams = a.image_features(self.model, pixels, grid)
        n_images = 0 if mb.image_grid_thw is None else mb.image_grid_thw.shape[0]
        tokens = _feature_rows(a, mb)
        per_item = [list(torch.split(s, tokens)) for s in streams]
        images = self._in_row_order([p[:n_images] for p in per_item], mb.images_per_group, mb.image_group)
        videos = self._in_row_order([p[n_images:] for p in per_item], mb.videos_per_group or [], mb.video_group or [])
        return images, videos

    @staticmethod
    def _in_row_order(per_item: list[list[torch.Tensor]], per_group: list[int], order: list[int]) -> list[torch.Tensor]:
        """Per feature stream: the items' features grouped (`per_group` items each) and concatenated
        in the row's order of groups (`order`, -1 skipped); [] when there is none."""
        if not per_group:
            return []
        out = []
        for items in per_item:
            groups, start = [], 0
            for n in per_group:
                groups.append(torch.cat(items[start:start + n]))
                start += n
            out.append(torch.cat([groups[i] for i in order if i >= 0]))
        return out

    def logprobs(
        self, mb: PackedMicrobatch, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities (K,) of the micro-batch's scored tokens under softmax(logits / temperature).

        Goes through the root module's call (its forward is bound to `_forward`), so FSDP gathers
        the root unit (embeddings, norm, lm_head) for the whole forward.
        """
        mb = mb.to(self.device)
        return self.model(mb, temperature, with_entropy)

    def watch_routers(self, coef: float) -> None:
        """Collect the MoE routers' logits in every forward that builds a graph and leave their
        load-balancing loss in `router_aux` (the update adds `coef` times it to the loss)."""
        routers = self.adapter.routers(self.model)
        if not routers or not self.adapter.experts_per_token:
            raise ValueError(f"config key 'model.router_aux_loss_coef' is {coef}, but model family "
                             f"'{self.adapter.name}' has no MoE router; set it to 0")

        def keep(module, args, output):
            if self._router_logits is not None:  # not in activation checkpointing's recompute
                self._router_logits.append(output[0])

        for router in routers:
            router.register_forward_hook(keep)
        self.router_aux_coef = coef

    def _forward(self, mb: PackedMicrobatch, temperature: float, with_entropy: bool):
        collect = self.router_aux_coef > 0 and torch.is_grad_enabled()
        self._router_logits = [] if collect else None
        try:
            hidden = self.hidden_states(mb)
            if collect:
                self.router_aux = load_balancing_loss(self._router_logits, self.adapter.experts_per_token)
            else:
                self.router_aux = None
        finally:
            self._router_logits = None
        with phase_range("logprobs"):
            return self._head_logprobs(hidden, mb, temperature, with_entropy)

    def _head_logprobs(self, hidden: torch.Tensor, mb: PackedMicrobatch, temperature: float, with_entropy: bool):
        """The scored tokens' logprobs (and entropies) from the row's last hidden states, LOGPROB_CHUNK at a time."""
        picked = hidden.index_select(0, mb.target_positions)
        head = self.adapter.lm_head(self.model)
        if self.exact_logit_bias is None and picked.shape[0]:  # a plain projection: one node for all chunks
            fused = head_logprobs(head, picked, mb.target_ids, temperature, self.fp32_logits, LOGPROB_CHUNK,
                                  with_entropy)
            if fused is not None:
                return fused
        lps, ents = [], []
        for start in range(0, picked.shape[0], LOGPROB_CHUNK):
            h = picked[start : start + LOGPROB_CHUNK]
            t = mb.target_ids[start : start + LOGPROB_CHUNK]
            if torch.is_grad_enabled():
                lp, ent = checkpoint(_chunk_logprobs, head, h, t, temperature, with_entropy, self.exact_logit_bias,
                                     self.exact_engine_logprobs, self.fp32_logits, use_reentrant=False)
            else:
                lp, ent = _chunk_logprobs(head, h, t, temperature, with_entropy, self.exact_logit_bias,
                                          self.exact_engine_logprobs, self.fp32_logits)
            lps.append(lp)
            ents.append(ent)
        if not lps:
            empty = hidden.new_zeros(0, dtype=torch.float32) + hidden.float().sum() * 0.0
            return empty, (empty.detach() if with_entropy else None)
        return torch.cat(lps), (torch.cat(ents) if with_entropy else None)

    # --- memory ----------------------------------------------------------------------------
    def offload(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Move the sharded parameters (and optimizer state) to CPU so a colocated engine can use the GPU."""
        self.reshard()  # the parameters the optimizer holds, no compute copy left behind on the device
        _move_model(self.model, torch.device("cpu"))
        if optimizer is not None:
            move_optimizer_state(optimizer, torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reload(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        _move_model(self.model, self.device)
        if optimizer is not None:
            move_optimizer_state(optimizer, self.device)

    @property
    def fsdp_units(self) -> list[nn.Module]:
        """The model's FSDP units, found once (a walk over every submodule, ~840 in a 3B VLM, takes ~1 ms)."""
        from torch.distributed.fsdp import FSDPModule

        if self._fsdp_units is None:
            self._fsdp_units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        return self._fsdp_units

    def gather_units_once(self) -> None:
        """Gather and free each FSDP unit once (`build_policy`, for a trainable policy on one data-parallel rank).
        FSDP2's post-backward under no-sync (the update's hold) reads every unit's gathered parameters, which a unit
        has only after its first gather: a VLM's vision tower that a text-only step never runs (model.vision_once)
        would raise AttributeError there. One unit at a time, so the peak is one unit's compute copy."""
        for unit in self.fsdp_units:  # the root first (model.modules() order): its lazy init sets up every unit
            unit.unshard()
            unit.reshard()

    def reshard(self) -> None:
        """Free any unsharded compute copy FSDP still holds (one data-parallel rank keeps it from
        forward to backward; a forward without backward would leave it in place), or the `ComputeCopy`'s,
        whose gradients go into the masters first."""
        for unit in self.fsdp_units:
            unit.reshard()
        if self.compute is not None:
            self.compute.release()

    def after_backward(self) -> None:
        """With a `ComputeCopy`: the backward's gradients added into the masters' fp32 ones (FSDP's units do
        this themselves, in their hooks)."""
        if self.compute is not None:
            self.compute.accumulate()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """A forward-only pass over many micro-batches (the old logprobs, or the reference's with LoRA). With one
        data-parallel rank a trained model's FSDP units keep their compute copy after a forward (they do not
        reshard then), so each is made at the first micro-batch and kept to the last; a pass without backward
        would leave them all in place, and they are freed when it ends. A frozen model on one device has no
        units (`apply_parallelism`); with more ranks every unit gathers and frees per micro-batch, as it must."""
        try:
            yield
        finally:
            if self.dims.dp == 1:
                self.reshard()

    def offload_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Move only the optimizer state to CPU (the parameters stay where they are)."""
        move_optimizer_state(optimizer, torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # non-blocking copies must land before the memory is reused
            torch.cuda.empty_cache()

    def reload_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        move_optimizer_state(optimizer, self.device)

    # --- full weights ----------------------------------------------------------------------
    def full_state_dict(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every weight, in transformers' current names; a collective on all ranks.

        With LoRA, each adapted layer's weight is yielded merged, W + (alpha / rank)·B·A computed in
        fp32 and then cast, and the adapters themselves are not yielded: consumers see base names only.
        """
        self.reshard()  # the parameters the optimizer holds (a `ComputeCopy`'s masters), not compute copies
        adapted = lora_modules(self.model)
        for name, tensor in self.model.state_dict().items():
            if is_adapter_name(name):
                continue
            owner = name[: -len(".weight")] if name.endswith(".weight") else None
            if owner in adapted:
                full = merged_weight(adapted[owner]).to(tensor.dtype)
            else:
                full = full_value(tensor)
            yield name, (full.to(dtype) if dtype is not None else full).detach()

    def export_hf(self, out: str | Path, dtype: torch.dtype | None = None) -> Path | None:
        """Write a Hugging Face folder (rank 0): config, model.safetensors, processor and tokenizer files."""
        return export_hf_folder(self.full_state_dict(dtype), self.model.config, self.path, out, self.dims.is_main)


def _chunk_logprobs(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                    exact_bias: tuple[tuple[int, ...], float] | None = None, engine_logprobs=None,
                    fp32_logits: bool = False):
    if exact_bias is not None:  # exact mode: the engine's values come from the head's own (model-dtype) output
        raw = head(h)
        logits = raw.float()
    else:  # model.fp32_logits: fp32-output logits, not rounded to the model dtype first
        logits = head_logits(head, h, fp32_logits)
    if exact_bias is not None and exact_bias[0]:
        logits = logits.index_add(-1, torch.tensor(exact_bias[0], device=logits.device),
                                  logits.new_full((logits.shape[0], len(exact_bias[0])), exact_bias[1]))
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    if exact_bias is not None:
        lp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        value = engine_logprobs(raw, targets, temperature) if engine_logprobs is not None else None
        if value is not None:  # the engine's bits forward, torch's log_softmax gradient backward
            lp = lp + (value.to(lp.dtype) - lp).detach()
    else:
        lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = entropy(logits, lse)
    return lp, ent


def _move_model(model: nn.Module, device: torch.device) -> None:
    """Move the sharded parameters and buffers; FSDP2's `_apply` re-registers the local shards.

    Assigning `p.data` across devices is refused for DTensor parameters, so the move goes
    through `Module.to`, which FSDP2 supports after sharding.
    """
    model.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimizer's state tensors. The step counter moves too where the optimizer keeps it
    beside the parameters (fused or capturable AdamW), and otherwise stays on the CPU, as torch wants."""
    for group in optimizer.param_groups:
        step_follows = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if k == "step" and not step_follows:
                    continue
                if isinstance(v, torch.Tensor) and v.device != device:
                    optimizer.state[p][k] = v.to(device, non_blocking=True)


def export_hf_folder(named_tensors, config, source_path: str, out: str | Path, is_main: bool) -> Path | None:
    """Save full tensors + the source folder's config/processor/tokenizer files as a HF checkpoint folder."""
    out = Path(out)
    tied = bool(getattr(getattr(config, "text_config", config), "tie_word_embeddings", False)) or bool(
        getattr(config, "tie_word_embeddings", False)
    )
    tensors = {}
    for name, t in named_tensors:  # every rank iterates: gathering is collective
        if is_main and not (tied and name == "lm_head.weight"):
            tensors[name] = t.detach().to("cpu").contiguous().clone()
    if not is_main:
        return None
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    for name in _SIDE_FILES:
        src = Path(source_path) / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)
    return out


def build_policy(cfg_model, dims: ParallelDims, trainable: bool = True) -> Policy:
    """Config → sharded, loaded Policy. Builds on meta, shards, materializes, loads, checks nothing is left on meta.

    `trainable=False` builds a frozen copy (the reference model): no parameter keeps a gradient, the
    parameters are stored in the compute dtype (bf16 on a GPU: half an fp32 copy), and no LoRA
    adapters (the reference is the base model). With `model.lora.rank` > 0 the targeted linear
    layers get adapters before sharding and only those train (models/lora.py)."""
    from transformers import AutoModelForImageTextToText

    config = load_model_config(cfg_model.path, cfg_model.trust_remote_code)
    adapter = build_adapter(config)
    coef = getattr(cfg_model, "router_aux_loss_coef", 0.0)
    if trainable and coef > 0 and not adapter.experts_per_token:
        raise ValueError(f"config key 'model.router_aux_loss_coef' is {coef}, but model family '{adapter.name}' "
                         "has no MoE router; set it to 0")
    liger = uses_liger(getattr(cfg_model, "liger_kernel", "false"), config.model_type, dims.device_type,
                       importlib.util.find_spec("liger_kernel") is not None, hint=trainable)
    torch_norm = cuda_switch(getattr(cfg_model, "torch_rms_norm", "false"), dims.device_type)
    flash_direct = cuda_switch(getattr(cfg_model, "flash_direct", "false"), dims.device_type)
    set_direct_flash(flash_direct)
    if liger:  # before the model is built: liger swaps classes that the decoder layers look up when made
        apply_liger_kernels(config.model_type, dims.device_type, hint=trainable, rms_norm=not torch_norm,
                            gated_mlp=bool(getattr(cfg_model, "liger_mlp", True)))
    dtype = compute_dtype(cfg_model.dtype, dims.device_type)
    attn_name = cfg_model.attn_implementation
    shared = shares_prompts(getattr(cfg_model, "shared_prompts", "off"), adapter, attn_name, dims.device_type, dtype)
    if shared:
        attn_name = "varlen"  # the attention that reads the row's segments (SDPA per segment off CUDA)
    attn = resolve_attn_implementation(attn_name, dims.device_type, adapter.varlen_attention, dtype)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            config, attn_implementation=attn, dtype=torch.float32, trust_remote_code=cfg_model.trust_remote_code
        )
    if attn == "varlen" and adapter.varlen_vision:  # the vision tower's windows in one call too
        from models.attention import VISION_NAME

        adapter.vision_tower(model).config._attn_implementation = VISION_NAME
    model.forward = _bind_forward(model)
    conv3d_windows_as_linear(model)  # the patch embedding as the engine computes it
    tower = adapter.vision_tower(model)
    normed = route_rms_norms_to_torch(model) if torch_norm else 0
    lora = getattr(cfg_model, "lora", None)
    if trainable and lora is not None and lora.rank > 0:  # before sharding: adapters live in their layer's unit
        names = lora_module_names(model, adapter, lora.targets, lora.vision_targets)
        apply_lora(model, names, lora.rank, lora.alpha)
    pad = cuda_switch(getattr(cfg_model, "pad_vision_mlp", "false"), dims.device_type)
    padded = pad_mlp_widths(tower) if pad and tower is not None else 0  # after LoRA: a wrapped MLP keeps its own
    if not trainable and dtype != torch.float32:
        _store_parameters_in(model, dtype)
    apply_parallelism(
        model, adapter, dims,
        param_dtype=dtype if dtype != torch.float32 else None,
        activation_checkpointing=cfg_model.activation_checkpointing and trainable, trainable=trainable,
        compile_blocks=getattr(cfg_model, "compile", False),
    )
    model.to_empty(device=dims.device)
    _reinit_nonpersistent_buffers(model, dims.device, adapter)
    with adapters_detached(model):  # the model folder holds base weights only
        load_safetensors_into(model, cfg_model.path, adapter)
    init_lora_weights(model)
    left = _has_meta(model)
    if left:
        raise RuntimeError(f"{len(left)} tensors still on the meta device after loading, e.g. {left[:3]}")
    if not trainable:
        model.requires_grad_(False)
    elif getattr(cfg_model, "freeze_vision_tower", False):
        frozen = freeze_vision_tower(model, adapter)
        if dims.is_main:
            log.info("model.freeze_vision_tower: %d vision tower tensors (%.1fM weights) keep their values", *frozen)
    policy = Policy(model, adapter, dims, cfg_model.path, dtype, shared_prompts=shared, liger_kernel=liger,
                    fp32_logits=bool(getattr(cfg_model, "fp32_logits", False)),
                    vision_once=runs_vision_once(getattr(cfg_model, "vision_once", "off"), adapter, dims.device_type),
                    pad_vision_mlp=pad, padded_vision_mlps=padded, torch_rms_norm=torch_norm, torch_rms_norms=normed,
                    flash_direct=flash_direct)
    model._vlrl_policy = policy
    if trainable and dims.one_device_mesh and dims.one_device == "plain" and dtype != torch.float32:
        policy.compute = ComputeCopy(model, dtype, unit_modules(model, adapter)[:-1])
        model.register_forward_pre_hook(lambda module, args: policy.compute.swap_in())
    if trainable and coef > 0:
        policy.watch_routers(coef)
    if trainable and dims.dp == 1:
        policy.gather_units_once()  # before any step, for the update's hold (a no-op for a plain module)
    return policy


def freeze_vision_tower(model: nn.Module, adapter: FamilyAdapter) -> tuple[int, float]:
    """model.freeze_vision_tower: the vision tower's parameters stop requiring gradients, so the tower runs no
    backward and the optimizer (`build_optimizer` takes what requires grad) keeps no state for them. Returns
    (tensors, millions of weights) frozen; a family whose adapter finds no tower is an error."""
    tower = adapter.vision_tower(model)
    params = list(tower.parameters()) if tower is not None else []
    if not params:
        raise ValueError(f"config key 'model.freeze_vision_tower' is true, but model family '{adapter.name}' has no "
                         "vision tower parameters to freeze")
    for p in params:
        p.requires_grad_(False)
    return len(params), sum(p.numel() for p in params) / 1e6


def shares_prompts(setting: str | bool, adapter: FamilyAdapter, attn_implementation: str, device_type: str,
                   dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether GRPO's training rows hold each prompt once (model.shared_prompts, after the config's checks).

    `on` (or True) needs a family whose attention a shared row reproduces, and on CUDA a bf16/fp16
    forward (the varlen kernel's); `auto` takes it where that holds with attention auto or varlen: on CUDA
    in bf16/fp16 (the varlen kernel) and off CUDA, where a row's attention runs SDPA per segment either way
    and the shared row saves the repeated prompts' tokens (the demo's GRPO step on 2 CPU cores: 3.3 s
    against 5.6 s). `off` (or False) never."""
    setting = {True: "on", False: "off"}.get(setting, setting)
    if setting == "on" and not adapter.shares_prompts:
        raise ValueError(f"config key 'model.shared_prompts' is on, but model family '{adapter.name}' has "
                         "attention a shared prompt's row cannot reproduce (its own masks or recurrent layers); "
                         "set it to auto or off")
    if setting == "on" and device_type == "cuda" and dtype not in HALF_DTYPES:
        raise ValueError(f"config key 'model.shared_prompts' is on with model.dtype {str(dtype).removeprefix('torch.')}, "
                         "but the varlen kernel it runs on CUDA takes bfloat16 or float16 only; set it to auto or off")
    if setting == "auto":
        return (adapter.shares_prompts and (device_type != "cuda" or dtype in HALF_DTYPES)
                and attn_implementation in ("auto", "varlen"))
    return setting == "on"


def runs_vision_once(setting: str | bool, adapter: FamilyAdapter, device_type: str) -> bool:
    """Whether a pass runs the vision tower once over all its micro-batches' images (model.vision_once, after
    the config's checks). `on` needs a family whose image features come from the tower's module alone
    (`FamilyAdapter.vision_in_tower`); `auto` takes it there on CUDA, where a tower call per micro-batch leaves
    the device waiting on the host's launches; `off` never."""
    setting = {True: "on", False: "off"}.get(setting, setting)
    if setting == "on" and not adapter.vision_in_tower:
        raise ValueError(f"config key 'model.vision_once' is on, but model family '{adapter.name}' computes its image "
                         "features outside its vision tower's module (a projector of the language model's); set it "
                         "to auto or off")
    if setting == "auto":
        return adapter.vision_in_tower and device_type == "cuda"
    return setting == "on"


# Model types whose update liger-kernel was measured to speed up on a GPU: model.liger_kernel=auto turns it on for
# these alone. qwen2_5_vl: the 3B recipe (configs/clevr_qwen2_5_vl_3b.yaml) on one H200, 2026-12-02: the update
# alone (tools/bench.py, 128 sequences x 256 tokens) 2.87 -> 2.65 s, MFU 28.2 -> 30.5%, peak 117 -> 106 GiB;
# train.py's update 2.77-3.03 -> 2.50-2.88 s, token_mult_prob_error unchanged
LIGER_MEASURED_FAMILIES = frozenset({"qwen2_5_vl"})


def uses_liger(setting: str | bool, model_type: str, device_type: str, importable: bool, hint: bool = False) -> bool:
    """Whether the policy runs liger-kernel's kernels (model.liger_kernel, after the config settled rollout.exact
    and model.compile to false).

    `true` (or True) insists: `apply_liger_kernels` names what is missing. `auto` takes them on CUDA, with the
    package importable, for a model type in LIGER_MEASURED_FAMILIES; with `hint` it logs how to get them where
    only the package is missing. `false` (or False) never."""
    setting = {True: "true", False: "false"}.get(setting, setting)
    if setting != "auto":
        return setting == "true"
    measured = device_type == "cuda" and model_type in LIGER_MEASURED_FAMILIES
    if measured and not importable and hint:
        log.info("model.liger_kernel=auto: liger-kernel is not installed, so the update runs without its fused "
                 "kernels; pip install -e .[liger] makes it faster (the 3B Qwen2.5-VL update on one H200: "
                 "2.87 -> 2.65 s, 11 GiB less peak memory)")
    return measured and importable


def apply_liger_kernels(model_type: str, device_type: str, hint: bool = False, rms_norm: bool = True,
                        gated_mlp: bool = True) -> None:
    """Swap in liger-kernel's fused RMSNorm (unless `rms_norm` is False: model.torch_rms_norm) and gated MLP
    (SwiGLU, Gemma's GeGLU; unless `gated_mlp` is False: model.liger_mlp), and its rotary embedding where it
    has one for the family (`liger_patch`), for this family's transformers modules. Runs before the model is
    built: liger replaces classes in transformers' modeling module. The lm_head keeps the chunked logprob
    path."""
    if device_type != "cuda":
        raise RuntimeError("model.liger_kernel=true needs CUDA (its kernels are Triton); set it to auto or false "
                           "on CPU")
    apply, kwargs = liger_patch(model_type, hint)
    kwargs["rms_norm"] = rms_norm
    kwargs["geglu" if "geglu" in kwargs else "swiglu"] = gated_mlp
    apply(**kwargs)
    if kwargs.get("rope"):
        route_rotary_to_liger(model_type)


# Rotary functions transformers 5.x's attention calls that liger's apply function (0.8.5) leaves alone, routed to
# liger's kernels here: for Qwen2-VL and Qwen2.5-VL liger replaces `apply_multimodal_rotary_pos_emb`, which the
# attention no longer calls (the rotary embedding merges the m-rope sections into cos/sin and the attention calls
# the plain `apply_rotary_pos_emb`), and it leaves the vision tower's `apply_rotary_pos_emb_vision` (it routes
# Qwen3-VL's). The 3B update's profile on the H200 (2026-12-03) showed both unfused: q * cos multiplies over
# [1, 16, T, 128] in the decoder and over [4096, 16, 80] in the tower.
LIGER_ROTARY = {
    "qwen2_vl": "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
}


def route_rotary_to_liger(model_type: str) -> None:
    """Point the family's modeling module's rotary functions at liger's (see LIGER_ROTARY); the attention looks
    them up in the module at each call."""
    name = LIGER_ROTARY.get(model_type)
    if name is None:
        return
    from liger_kernel.transformers.rope import liger_rotary_pos_emb, liger_rotary_pos_emb_vision

    module = importlib.import_module(name)
    module.apply_rotary_pos_emb = liger_rotary_pos_emb
    module.apply_rotary_pos_emb_vision = liger_rotary_pos_emb_vision


def liger_patch(model_type: str, hint: bool = False) -> tuple[Callable[..., None], dict[str, bool]]:
    """liger-kernel's apply function for this model type and the arguments to call it with: RMSNorm and the gated
    MLP (SwiGLU, Gemma's GeGLU) fused, liger's losses off (the logprobs come from the chunked lm_head), the rotary
    embedding fused where the function fuses it by default. With `hint`, a family whose rotary stays unfused gets one line saying so."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise RuntimeError("model.liger_kernel=true needs the liger-kernel package: pip install -e .[liger], or "
                           "set it to auto or false") from err
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise RuntimeError(f"model.liger_kernel=true: liger-kernel has no kernels for model type '{model_type}'")
    params = inspect.signature(apply).parameters
    # the gated MLP's switch: `geglu` for the Gemma families (GELU-gated), `swiglu` for the rest
    mlp = "geglu" if "geglu" in params and "swiglu" not in params else "swiglu"
    kwargs = {"rms_norm": True, mlp: True, "cross_entropy": False, "fused_linear_cross_entropy": False}
    # Each apply function says in its `rope` default whether liger fuses the family's rotary embedding: True where
    # its kernel fits, False where it has none (liger 0.8.5's Qwen3.5, Qwen3.5-MoE, GLM-4 and GLM-4.1V functions
    # raise NotImplementedError on rope=True). Reading the default follows liger as it gains kernels, where a list
    # of model types here would go stale; a function without the argument (LLaVA's, InternVL's) is not given it.
    rope = params.get("rope")
    if rope is not None:
        kwargs["rope"] = rope.default is True
        if hint and not kwargs["rope"]:
            log.info("model.liger_kernel: liger-kernel fuses RMSNorm and SwiGLU for model type '%s'; the rotary "
                     "embedding stays unfused (liger has no rotary kernel for it)", model_type)
    return apply, kwargs


def conv3d_windows_as_linear(model: nn.Module) -> int:
    """Route every Conv3d whose stride is its kernel (no padding, dilation or groups), the vision patch
    embedding's, to one matmul over each flattened window when its input is exactly one window per item, as
    vLLM's Conv3dLayer computes it (a GEMM over the patches; torch ≥ 2.9 also runs such a Conv3d without cuDNN).
    The same function of the weights, rounded as the engine rounds it. Other inputs keep the convolution.
    Returns how many were routed."""
    routed = 0
    for m in model.modules():
        if (isinstance(m, nn.Conv3d) and tuple(m.stride) == tuple(m.kernel_size) and m.groups == 1
                and m.padding in ((0, 0, 0), "valid") and tuple(m.dilation) == (1, 1, 1)):
            m.forward = _windows_as_linear(m, m.forward)
            routed += 1
    return routed


def _windows_as_linear(conv: nn.Conv3d, convolve: Callable) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or tuple(x.shape[2:]) != tuple(conv.kernel_size):
            return convolve(x)
        w = conv.weight
        out = nn.functional.linear(x.reshape(x.shape[0], -1), w.reshape(w.shape[0], -1), conv.bias)
        return out.view(x.shape[0], w.shape[0], 1, 1, 1)

    return forward


# RMSNorm classes whose forward is weight * (x·rsqrt(mean(x²) + variance_epsilon), computed in fp32 and rounded to
# x's dtype): the ones `route_rms_norms_to_torch` may route (Gemma's and Qwen3.5's scale by 1 + weight)
TORCH_RMS_NORMS = frozenset({"Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3VLTextRMSNorm", "Glm4vRMSNorm"})


def _routable_norm(m: nn.Module) -> bool:
    """Whether `route_rms_norms_to_torch` may route `m`: a TORCH_RMS_NORMS class, or liger's RMSNorm computing the
    same function (no offset, llama casting, a weight). The second are what a process builds after an earlier
    policy of the family took liger's RMSNorm: liger replaces the class in transformers' modeling module for the
    rest of the process."""
    if not isinstance(getattr(m, "weight", None), torch.Tensor):
        return False
    name = type(m).__name__
    if name == "LigerRMSNorm":
        return getattr(m, "offset", None) == 0.0 and getattr(m, "casting_mode", None) == "llama"
    return name in TORCH_RMS_NORMS


def route_rms_norms_to_torch(module: nn.Module) -> int:
    """model.torch_rms_norm: every RMSNorm of `module` in TORCH_RMS_NORMS runs torch's `rms_norm` (one fused
    CUDA kernel each way, dispatched from C++: a fifth of liger's host time a call and a quarter of the
    transformers module's on an H200, `tools/norm_cost.py`), the same function rounded once, after the
    weight, where transformers rounds the normalized input before it (at most ~1.3 bf16 ulps of the output
    apart). A call whose weight is not in the input's dtype keeps the module's own forward. Returns how many
    were routed."""
    routed = 0
    for m in module.modules():
        if _routable_norm(m):
            m.forward = _torch_rms_norm(m, m.forward)
            routed += 1
    return routed


def _torch_rms_norm(norm: nn.Module, own: Callable) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if norm.weight.dtype != x.dtype:
            return own(x)
        return nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    return forward


# MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)), plain nn.Linear projections: the
# ones `pad_mlp_widths` may widen. Qwen2.5-VL's vision blocks: intermediate 3420 (not a multiple of 8 elements),
# whose products cuBLAS runs with sm80 CUTLASS kernels on an H200 (the tower's forward spent 71 ms in them at
# 16 images of 448², 2026-12-04 profile) where aligned widths get the sm90 ones
PADDABLE_MLPS = frozenset({"Qwen2_5_VLMLP"})


def cuda_switch(setting: str | bool, device_type: str) -> bool:
    """An `auto`/`true`/`false` setting whose auto is on CUDA only (model.pad_vision_mlp, model.torch_rms_norm,
    model.flash_direct), as settled: `true` (or True) on, `false` (or False) off, `auto` on CUDA (the config
    settles pad_vision_mlp and torch_rms_norm to false with rollout.exact)."""
    if setting in (True, "true"):
        return True
    return setting == "auto" and device_type == "cuda"


def pad_mlp_widths(module: nn.Module, multiple: int = 128) -> int:
    """Run every gated MLP of `module` (`PADDABLE_MLPS`) whose intermediate width is not a multiple of `multiple`
    at the next multiple: its gate and up rows and its down columns padded with zeros in each forward (the
    parameters keep their shapes, so loading, checkpoints, the engine's refit and the optimizer see nothing).
    The padded lanes are exactly zero through the product (act(0)·0) and add zeros to the down projection, so
    the outputs and gradients are the unpadded MLP's up to rounding order. Returns how many were padded."""
    padded = 0
    for m in module.modules():
        if type(m).__name__ not in PADDABLE_MLPS:
            continue
        if not _plain_projections(m):  # LoRA-wrapped or replaced: left alone
            continue
        gate, up, down = m.gate_proj, m.up_proj, m.down_proj
        width = gate.out_features
        if width % multiple == 0 or up.out_features != width or down.in_features != width:
            continue
        m.forward = _padded_mlp(m, -width % multiple, m.forward)
        padded += 1
    return padded


def _plain_projections(mlp: nn.Module) -> bool:
    """Whether a gated MLP's gate, up and down projections are all plain nn.Linear (none wrapped by LoRA)."""
    return all(type(getattr(mlp, n, None)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj"))


def _padded_mlp(mlp: nn.Module, pad: int, own: Callable) -> Callable:
    """The padded forward; the module's own where a projection is no longer a plain nn.Linear (LoRA wraps them
    after the model is built: its adapters must see the input)."""
    F = nn.functional

    def rows(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if linear.bias is None else F.pad(linear.bias, (0, pad))
        return F.pad(linear.weight, (0, 0, 0, pad)), bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _plain_projections(mlp):
            return own(x)
        gate_w, gate_b = rows(mlp.gate_proj)
        up_w, up_b = rows(mlp.up_proj)
        hidden = mlp.act_fn(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b)
        return F.linear(hidden, F.pad(mlp.down_proj.weight, (0, pad)), mlp.down_proj.bias)

    return forward


def _tower_inputs(mb: PackedMicrobatch) -> tuple[torch.Tensor, torch.Tensor, list | None]:
    """(pixel rows, grid rows, the grid's host copy or None) of a micro-batch's distinct image groups, then its
    video groups, as one vision tower call takes them."""
    present = [(p, g) for p, g in ((mb.pixel_values, mb.image_grid_thw), (mb.pixel_values_videos, mb.video_grid_thw))
               if p is not None]
    pixels = torch.cat([p for p, _ in present]) if len(present) > 1 else present[0][0]
    grid = torch.cat([g for _, g in present]) if len(present) > 1 else present[0][1]
    host = mb.host_layout()
    rows = None if host is None else [*(host.image_grid or ()), *(host.video_grid or ())]
    return pixels, grid, rows


def _feature_rows(adapter: FamilyAdapter, mb: PackedMicrobatch) -> list[int]:
    """The vision feature rows (placeholder tokens) of each of a micro-batch's distinct images, then videos, in
    the order one tower call over them returns them: from the host's copy of the grids, else read back once."""
    host = mb.host_layout()
    if host is not None:
        images, videos = host.image_grid or (), host.video_grid or ()
    else:
        images = () if mb.image_grid_thw is None else mb.image_grid_thw.tolist()
        videos = () if mb.video_grid_thw is None else mb.video_grid_thw.tolist()
    return [adapter.image_token_count(r) for r in images] + [adapter.video_token_count(r) for r in videos]


@dataclass
class VisionChunk:
    """One vision tower call of a pass (`Policy.pass_vision`): several micro-batches' images and videos, in
    micro-batch order. No pixels: a keep-alive call, for a rank with fewer chunks than another."""

    pixels: torch.Tensor | None
    grid: torch.Tensor | None
    rows: list | None  # the grid's rows as ints, the host's copy; None: read from `grid`


class PassVision:
    """The vision tower of one pass over a step's micro-batches, run once per chunk of micro-batches instead of
    once per micro-batch (model.vision_once).

    Before the pass, each chunk's features are computed without a graph and each micro-batch's share is left in
    `mb.vision`; in a pass that trains the tower those shares are leaves, and each micro-batch's backward leaves
    its features' gradient in them. `backward` then runs each chunk's forward again, with a graph, and its
    backward from those gradients: the gradient the tower gets is the sum over micro-batches that running it in
    every micro-batch gives, from one call per chunk.
    """

    def __init__(self, policy: "Policy", microbatches: list[PackedMicrobatch], plan: list[list[int]]):
        self.policy = policy
        self.microbatches = microbatches
        self.plan = plan
        tower = policy.adapter.vision_tower(policy.model)
        self.trains = torch.is_grad_enabled() and any(p.requires_grad for p in tower.parameters())
        self.chunks = [self._chunk([microbatches[j] for j in members]) for members in plan]

    def _chunk(self, members: list[PackedMicrobatch]) -> tuple[VisionChunk, list[int]]:
        """The chunk's tower call and the feature rows each member takes."""
        if not members:
            return VisionChunk(None, None, None), []
        parts = [_tower_inputs(mb) for mb in members]
        rows = None if any(r is None for _, _, r in parts) else [r for _, _, rs in parts for r in rs]
        tokens = [sum(_feature_rows(self.policy.adapter, mb)) for mb in members]
        pixels = torch.cat([p for p, _, _ in parts]) if len(parts) > 1 else parts[0][0]
        grid = torch.cat([g for _, g, _ in parts]) if len(parts) > 1 else parts[0][1]
        return VisionChunk(pixels, grid, rows), tokens

    def encode(self) -> None:
        """Each chunk's features, without a graph, into its micro-batches' `vision` ([] for the others)."""
        for mb in self.microbatches:
            mb.vision = []
        with torch.no_grad():
            for members, (chunk, tokens) in zip(self.plan, self.chunks):
                streams = self.policy.model(chunk)
                if not members:
                    continue
                per_mb = [torch.split(s, tokens) for s in streams]
                for j, index in enumerate(members):
                    shares = [parts[j] for parts in per_mb]
                    self.microbatches[index].vision = [s.requires_grad_() for s in shares] if self.trains else shares

    def backward(self) -> None:
        """The tower's backward from the gradients the pass's micro-batches left in their features (a trained
        tower only; every chunk on every rank, so the tower's collectives line up)."""
        if not self.trains:
            return
        for members, (chunk, _) in zip(self.plan, self.chunks):
            streams = self.policy.model(chunk)
            if not members:
                streams[0].backward()  # a keep-alive: zero-weighted
                continue
            grads = []
            for k, s in enumerate(streams):
                shares = [self.microbatches[j].vision[k] for j in members]
                grads.append(torch.cat([x.grad if x.grad is not None else torch.zeros_like(x) for x in shares]))
            torch.autograd.backward(streams, grads)

    def close(self) -> None:
        for mb in self.microbatches:
            mb.vision = None


def vision_plan(policy: "Policy", microbatches: list[PackedMicrobatch], max_tokens: int) -> list[list[int]]:
    """The micro-batches with images or videos grouped into the pass's vision tower calls, in order: each call
    holds at most max_tokens // 2 feature rows (a micro-batch with more has a call of its own), which keeps the
    tower's activations within what a micro-batch of the language model holds (the 3B recipe's tower keeps
    ~1.6 MB per 14x14 patch, four to a feature row, against ~3.6 MB per token of the decoder)."""
    limit = max(max_tokens // 2, 1)
    plan: list[list[int]] = []
    load = 0
    for j, mb in enumerate(microbatches):
        if mb.pixel_values is None and mb.pixel_values_videos is None:
            continue
        n = sum(_feature_rows(policy.adapter, mb))
        if plan and load + n <= limit:
            plan[-1].append(j)
            load += n
        else:
            plan.append([j])
            load = n
    return plan


def _bind_forward(model: nn.Module):
    """Route the root module's forward to the packed logprob forward.

    FSDP2 hooks the root module's `__call__`; calling the model itself (not `model.model`)
    keeps the root unit gathered for embeddings, norm and the chunked lm_head.
    """

    def forward(mb, temperature=1.0, with_entropy=False):
        if isinstance(mb, VisionChunk):  # a pass's vision tower call (PassVision)
            return model._vlrl_policy._vision_chunk(mb)
        return model._vlrl_policy._forward(mb, temperature, with_entropy)

    return forward
