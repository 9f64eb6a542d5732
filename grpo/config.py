"""The typed config: one root dataclass, one section per component, read through OmegaConf.

The dataclasses below are the schema. `load_config` merges, in order: their defaults, a YAML file
(after the files it names under `base:`), then `a.b=value` arguments from the command line. On top
of OmegaConf's structured configs it keeps the rules this project promises:

- an unknown key names the closest valid one; a wrong type names the key and the type it wants;
- `on`, `off`, `yes` and `no` are strings (the values string-enum keys document); bool keys still
  accept them, and `true`/`false`;
- a key given twice in one YAML file is an error naming the file and line, and so is bad YAML;
- a command-line value with a ` #` in it is kept verbatim (YAML would cut it at the `#`);
- `${section.key}` interpolates another config key; any other `${...}` (an environment variable,
  a resolver such as `oc.env`, also nested or after an escaped backslash) is an error naming the key:
  no value is ever read from outside the config; `\\${...}` is literal text;
- a YAML file is at most `MAX_YAML_BYTES`, and a file or command-line value may nest at most
  `MAX_YAML_DEPTH` levels and expand (aliases counted each time they are used) to at most
  `MAX_YAML_NODES` values: checked on YAML's event stream, before any object is built;
- `???` marks a value that must be given before the run starts;
- ranges are checked at load (counts >= 1, probabilities in (0, 1], temperature > 0 for GRPO).

`save_config` writes the resolved config into the run folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser
from omegaconf.grammar_parser import parse as parse_interpolation


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


@dataclass
class TrainerConfig:
    mode: Literal["grpo", "sft"] = "grpo"
    max_steps: int = 10
    run_dir: str = "runs/default"
    seed: int = 0
    eval_every: int = 0  # 0: evaluate only at the end
    eval_samples: int = 64
    eval_max_new_tokens: int = 32
    progress: bool = True  # progress bar with ETA on stderr (rank 0)
    max_nonfinite_in_row: int = 3  # stop with a checkpoint after this many skipped steps in a row; 0: never
    # the GPU's SM clock, power, temperature and clock-event (power/thermal throttle) reasons per step phase, read
    # through NVML (package nvidia-ml-py, which vLLM installs) on a thread and logged as gpu/* (rollout/telemetry.py).
    # auto: on CUDA where NVML answers (else off, with one log line); true: required (an error says what is
    # missing); false: never. Booleans read as true/false
    gpu_telemetry: Literal["auto", "true", "false"] = "auto"
    gpu_telemetry_interval_s: float = 0.05  # seconds between readings
    # the step (1-based) whose logprob and update passes run under torch.profiler (the update alone in SFT), its op
    # tables written to <run_dir>/profile_step_<N>.txt by the first rank (rollout.telemetry.profiled); 0: none
    profile_step: int = 0
    # after this process's first step, one collection and then every object still alive is moved out of Python's
    # cyclic garbage collector's reach (gc.freeze; undone when the loop ends): each later collection walks only
    # the objects made since, where a full one (the in-process vLLM's sleep runs one a step) walked every module,
    # tensor and engine object of the process (~400k in the tiny CPU trainer: ~0.2 s a full collection, ~0 after)
    gc_freeze: bool = True


@dataclass
class LoraConfig:
    """LoRA adapters on the policy's linear layers (models/lora.py); rank 0 trains every weight."""

    rank: int = 0  # 0: off (full fine-tuning)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    # suffixes of linear-layer names in the decoder blocks; the default covers the supported families
    targets: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"])
    vision_targets: list[str] = field(default_factory=list)  # the same in the vision tower (e.g. qkv, proj)


@dataclass
class ModelConfig:
    path: str = ""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 compute on CUDA, fp32 on CPU
    # varlen: FlashAttention's variable-length kernel over packed rows (CUDA; elsewhere SDPA over each sequence of
    # a row on its own, not the whole row under a block-diagonal mask); vllm_paged: the call vLLM's FlashAttention
    # backend makes (paged K/V, one KV split; needs vLLM on CUDA, sdpa elsewhere). auto: varlen for the families
    # that take it (the Qwen-VL families, Qwen3.5) on CUDA in bf16/fp16 and on CPU, else flash_attention_2 where
    # installed on CUDA, else sdpa
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "varlen", "vllm_paged"] = "auto"
    activation_checkpointing: bool = False
    # fused RMSNorm, rotary and SwiGLU kernels from the liger-kernel package (Triton, CUDA). auto: on where they were
    # measured to speed up the update (models.policy.LIGER_MEASURED_FAMILIES: Qwen2.5-VL; the 3B update on one
    # H200 2.87 -> 2.65 s, 11 GiB less peak memory) on CUDA with the package installed, off with rollout.exact or
    # model.compile; true: required (an error says what is missing); false: never. Booleans read as true/false;
    # the run's config.yaml records what ran (true or false)
    liger_kernel: Literal["auto", "true", "false"] = "auto"
    # the lm_head's logits with fp32 output from the model-dtype (bf16) operands on both sides: the trainer's
    # fp32-output GEMM (models/logits.py) and vLLM's hf_overrides head_dtype=float32, instead of logits rounded
    # to bf16 before the softmax (a cause of the trainer/engine logprob mismatch, docs/fidelity.md). No effect
    # on a float32 model. rollout.exact settles it to false (exact mode has its own bitwise lm_head); true given
    # with rollout.exact is an error
    fp32_logits: bool = True
    # torch.compile each decoder block's forward (fuses norms, rotary, SwiGLU and residual adds; the
    # attention call stays eager); the first micro-batches pay the compile time
    compile: bool = False
    # GRPO's training passes hold each prompt once per micro-batch, its responses attending to it
    # (models.packing.pack_shared): the prompt's tokens, its image's among them, run once for the group
    # instead of once per response. The same logprobs and gradients (tests/test_shared_prompts.py); needs
    # the varlen attention and a family with `shares_prompts` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL). auto: on
    # where all of that holds (on CUDA in bf16/fp16; on CPU) and nothing else rules it out (exact mode,
    # routing replay, TP); on: required (an error names what stands in the way); off. true/false read as
    # on/off. The 3B recipe's step on one H200: 8.56 -> 5.80 s; the demo's on 2 CPU cores: 5.6 -> 3.3 s
    # (docs/benchmarks.md)
    shared_prompts: Literal["auto", "on", "off"] = "auto"
    # Each pass over a step's micro-batches (reference, old logprobs, the update) runs the vision tower once over
    # all their images, in calls of up to max_tokens_per_microbatch / 2 feature rows, instead of once per
    # micro-batch; a trained tower then runs its backward once, after the last micro-batch, from the summed
    # gradients of its features (one more forward of the tower, at the full batch's size). The same gradients
    # up to rounding (tests/test_vision_once.py); fewer, larger tower calls. Needs a family whose image
    # features come from the tower's module alone (the Qwen-VL families and GLM-4.1V). auto: on there on CUDA,
    # off with rollout.exact (whose tower must batch its images as the engine does); on: required; off
    vision_once: Literal["auto", "on", "off"] = "auto"
    # run the vision tower's gated MLPs whose width is not a multiple of 128 (Qwen2.5-VL's 3420) at the next
    # multiple, zero-padded in each forward (models.policy.pad_mlp_widths): the same function, on the GPU
    # matrix-product kernels aligned widths get (the 3B update on one H200: 2.09-2.18 s against 2.29-2.33 s at
    # 16384-token micro-batches, docs/benchmarks.md). auto: on CUDA, off with rollout.exact (whose tower
    # computes as the engine's); true: on (an error with rollout.exact); false: off
    pad_vision_mlp: Literal["auto", "true", "false"] = "auto"
    # run the Qwen-VL and GLM-4.1V RMSNorms (language model and vision tower) through torch's fused rms_norm
    # instead of liger-kernel's or transformers' own (models.policy.route_rms_norms_to_torch): one C++-dispatched
    # CUDA kernel each way, for an update whose host is the bottleneck; rounded once where transformers rounds
    # twice (~1 bf16 ulp apart). auto: on CUDA, off with rollout.exact; true: on (an error with rollout.exact);
    # false: off. With model.flash_direct the 3B recipe's update on one H200 took 2.04-2.08 s in the loop
    # against 2.13-2.16 s (docs/benchmarks.md, 2026-12-05)
    torch_rms_norm: Literal["auto", "true", "false"] = "auto"
    # with liger-kernel on: take its fused gated MLP (SwiGLU; GeGLU for the Gemma families). false leaves the
    # family's own MLP (transformers' act_fn(gate_proj(x)) * up_proj(x)): one more element-wise kernel each way
    # on the device, but its Triton launches cost the host 3.6x the eager ops' (478 against 132 us a forward and
    # backward on an H200, tools/norm_cost.py --op swiglu), and the 3B update is host-bound. Not yet measured in
    # a step, so on (as before)
    liger_mlp: bool = True
    # call torch's FlashAttention varlen kernels directly (models.attention.FlashVarlen) instead of through
    # torch.nn.attention.varlen.varlen_attn: grouped K/V heads read by the kernel itself (torch 2.11's varlen_attn
    # cannot, so K/V are repeated to every query head first) and no custom-operator layer per call. The same
    # kernel, bitwise the same outputs and gradients on an H200, 3.8 GiB less peak in the 3B update. auto: on
    # CUDA (the only place the varlen kernel runs); true/false: on/off
    flash_direct: Literal["auto", "true", "false"] = "auto"
    trust_remote_code: bool = False
    # train the language model only: the family's vision tower (FamilyAdapter.vision_tower; for the Qwen-VL and
    # GLM families its merger too, a separate projector such as LLaVA's still trains) keeps its weights, gets no
    # optimizer state and runs no backward (EasyR1's and veRL's freeze_vision_tower)
    freeze_vision_tower: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    # MoE families: weight of the routers' load-balancing loss (Switch Transformer's, as the family's
    # transformers model defines it), added to the update's loss; 0: off
    router_aux_loss_coef: float = 0.0


@dataclass
class DataConfig:
    task: str = "clevr"
    train_path: str = ""
    eval_path: str = ""
    prompts_per_step: int = 8  # global prompts per step (GRPO) or samples per step (SFT)
    max_prompt_tokens: int = 2048  # prompts longer than this are skipped and counted, never truncated
    min_pixels: int = 28 * 28
    max_pixels: int = 512 * 28 * 28
    shuffle: bool = True
    # videos (data/video.py): frames sampled per second of source time, at most max_frames of them (evenly
    # spread over a longer clip), all resized to one size with the whole clip within video_max_pixels
    video_fps: float = 2.0
    max_frames: int = 32
    video_max_pixels: int = 2048 * 28 * 28
    max_video_bytes: int = 256 << 20  # a larger video file is skipped (video_too_large) before it is read
    max_source_frames: int = 36_000  # frames a video's header may list; more is skipped (video_too_long)
    # GRPO: encode the next step's prompts on a thread while this step trains. Off: on an H200 it took the data
    # feed out of generation but made no step faster (the update ran longer beside the thread; docs/benchmarks.md)
    prefetch: bool = False


@dataclass
class RolloutConfig:
    engine: Literal["auto", "torch", "vllm"] = "auto"
    n: int = 4  # responses per prompt (group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    # share of the device the engine may take while awake; 0: the colocation memory plan decides
    gpu_memory_utilization: float = 0.0
    tensor_parallel_size: int = 1  # ranks per engine (node-local groups of consecutive ranks; rollout/groups.py)
    enforce_eager: bool = False
    # vLLM sleep level between generations: 2 drops the weights (the refit before every generation
    # rewrites them all): no host copy, and the first sleep takes 0.2 s where level 1's took 5-8 s on the
    # 3B shape (it allocates the pinned host copy); 1 copies the weights to host memory and back
    sleep_level: int = 2
    # host memory (GiB) for vLLM's cache of processed images, keyed by content; 0 turns it off
    processor_cache_gb: float = 4.0
    # vLLM: name each image by a content key computed once per image (rollout/vllm_engine.py `ImageKeys`)
    # instead of vLLM hashing every image of every request, so a later turn does not re-hash an episode's
    # earlier images; false: vLLM's own per-request hashing. Off until measured on a GPU (tools/bench_turns.py
    # --mm-uuids 1 against 0)
    mm_uuids: bool = False
    # vLLM 0.26: no HF processor call for a request whose images all hit the processor cache (the engine's
    # `skip_empty_hf_calls`); where this vLLM's processor lacks the method it changes, a logged no-op
    skip_empty_hf_calls: bool = True
    # vLLM 0.26: its placeholder search jumps to the positions where an image's run can start (the engine's
    # `fast_placeholder_search`); where this vLLM's processor lacks the method it changes, a logged no-op
    fast_placeholder_search: bool = True
    # Multi-turn episodes with tools (docs/agents.md). No tools: single-turn, one model turn per episode.
    tools: list[str] = field(default_factory=list)  # names from the tool registry (rollout/tools.py)
    tools_module: str = ""  # a module that registers user tools; importing it runs the user's code
    # render the tools' schemas into every prompt's and SFT conversation's system turn (docs/agents.md)
    tool_schemas_in_prompt: bool = True
    max_turns: int = 1  # model turns per episode
    max_tool_images: int = 4  # images the tools may add to one episode
    tool_timeout_s: float = 10.0  # a tool call running longer is stopped and counted as a timeout
    tool_workers: int = 4  # tool calls run at once
    max_tool_errors: int = 0  # failed tool calls that end an episode (tool_error_limit); 0: no limit
    # tokens one episode may hold in all (prompt, model and tool tokens; the engine's context);
    # 0: data.max_prompt_tokens + rollout.max_new_tokens, the single-turn size
    max_context_tokens: int = 0
    # vLLM with one engine rank (tensor_parallel_size 1): an episode whose turn finished gets its tool results
    # and its next turn's request while the other episodes keep decoding, instead of every turn waiting for
    # its longest generation (rollout/rollouts.py `_run_continuous`; docs/agents.md, "Continuous turns").
    # Tool calls run in the pool while decoding goes on. Off: on one H200 it took 5.45 s against 4.78 s turn by
    # turn (docs/agents.md)
    continuous_turns: bool = False
    # with continuous_turns: next-turn requests join the running batch once this many wait (or at least as many
    # as still run, or none runs), so fewer engine steps mix a prefill into the decode batch; 1: at once
    continuous_add_batch: int = 1
    # exact on-policy mode (docs/fidelity.md, "Exact mode"): vLLM batch-invariant, and the policy's scoring
    # forward through the engine's kernels, so engine and trainer logprobs are bitwise equal (GPU, vLLM)
    exact: bool = False
    # with rollout.exact: vLLM replays its decode steps from CUDA graphs (cudagraph_mode FULL_DECODE_ONLY, still
    # no torch.compile): the same kernels launched from a graph, so the logprobs stay the policy's if vLLM's
    # captured batches keep one KV split (batch-invariant mode sets it); off: eager, as the mode was measured
    exact_cuda_graphs: bool = False
    # vLLM's attention backend for the language model (auto: vLLM's choice, FlashAttention on an H200)
    attention_backend: Literal["auto", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION"] = "auto"
    # vLLM's kernel warm-up at engine start (V2 model runner; rollout/vllm_engine.py `kernel_warmup`): full
    # (vLLM's: every sampler feature), lean (the kernels a rollout's sampling runs), off (each compiles on first
    # use). The same sampled tokens and logprobs each way (tests/gpu/test_engine_warmup.py). The 3B recipe's
    # first step on one H200 beyond a steady one: 33.8 s lean, 24.6 s off, ~36 s full (docs/benchmarks.md)
    engine_warmup: Literal["full", "lean", "off"] = "off"
    # let vLLM keep its memory profile's KV-cache size (VLLM_ENABLE_STARTUP_PLAN) and skip profiling next time
    engine_startup_plan: bool = False
    # vLLM compiles the model with torch.compile (its default; tens of seconds in a machine's first engine
    # build, cached for later runs). false: no compilation, decode steps replayed from whole-model CUDA graphs
    # (cudagraph_mode FULL_DECODE_ONLY) and prefills eager. The same model either way; generation speed
    # against the compiled engine not yet measured (docs/benchmarks.md)
    engine_compile: bool = True
    # vLLM: where each generate call's time goes (rollout/gen_probe.py: prompt building, request adding, engine
    # steps, garbage collection, the slowest steps, the multimodal processor), logged per step as perf/gen_*;
    # wrappers on vLLM's objects that add no GPU synchronization; false: none installed
    gen_breakdown: bool = True


DEFAULT_TIS_CAP = 2.0  # veRL's default; TRL uses 3


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal["grpo", "grpo_no_std", "rloo"] = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0  # 0 disables; otherwise c > 1 (e.g. 3.0)
    kl_coef: float = 0.0  # 0: no reference model is loaded
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    # policy objective (README "Algorithm"): ppo-clip, or gspo / cispo / sapo with their own keys below
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo"] = "ppo"
    gspo_clip_low: float = 3e-4  # clip range of GSPO's length-normalised sequence ratio (the paper's values)
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 1.0  # CISPO weight bounds [1 - low, 1 + high]; low = 1: no lower bound (MiniMax-M1)
    cispo_clip_high: float = 4.0
    sapo_tau_pos: float = 1.0  # SAPO gate temperatures for A > 0 and A <= 0 (the paper's values)
    sapo_tau_neg: float = 1.05
    # engine/trainer mismatch correction of the loss (README "Algorithm"); none: measured mismatch ~1.0001
    rollout_correction: Literal["none", "tis", "icepop", "mis", "seq_mask_tis"] = "none"
    # the tis cap (0: 2.0); with rollout_correction=none, tis_cap > 0 alone selects tis (an alias kept from
    # before rollout_correction existed)
    tis_cap: float = 0.0
    icepop_low: float = 0.5  # icepop keeps tokens with w = pi_train / pi_engine in [low, high]
    icepop_high: float = 5.0
    mis_cap: float = 2.0  # mis masks sequences whose product of w exceeds this
    seq_mask_low: float = 0.999  # seq_mask_tis keeps sequences whose geometric-mean w is in [low, high]
    seq_mask_high: float = 1.002
    dynamic_sampling: bool = False
    max_refill_rounds: int = 2
    overlong_buffer: int = 0  # tokens before max_new_tokens where the overlong penalty ramps; 0 disables
    overlong_penalty: float = 1.0
    ppo_epochs: int = 1
    # veto, with any rollout_correction: drop sequences whose per-token max exp|dlogp| exceeds this; 0 disables
    mismatch_mask_threshold: float = 0.0
    tool_error_penalty: float = 0.0  # subtracted from an episode's reward per failed tool call
    # MoE families: the training forwards route each token to the experts the engine chose for it
    # (vLLM's enable_return_routed_experts; the built-in engine records its own); models/moe.py
    routing_replay: bool = False

    def correction(self) -> dict:
        """The rollout correction in force, as `grpo.algorithm.rollout_correction`'s mode and thresholds:
        `rollout_correction`, or tis when only `tis_cap` > 0 is set; tis caps at 2.0 unless `tis_cap` says."""
        mode = "tis" if self.rollout_correction == "none" and self.tis_cap > 0 else self.rollout_correction
        return {"mode": mode, "tis_cap": self.tis_cap if self.tis_cap > 0 else DEFAULT_TIS_CAP,
                "icepop_low": self.icepop_low, "icepop_high": self.icepop_high, "mis_cap": self.mis_cap,
                "seq_mask_low": self.seq_mask_low, "seq_mask_high": self.seq_mask_high}


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    max_tokens_per_microbatch: int = 4096
    # One data-parallel rank: FSDP keeps each unit's compute copy and fp32 gradients unsharded from
    # one micro-batch to the next (its parameter copy and cast, and its gradient copy, once per step
    # rather than per micro-batch). The 3B update on one H200: 5.74 -> 5.15 s, peak 110.3 -> 110.4 GiB
    # (docs/benchmarks.md). Ignored with more than one data-parallel rank.
    unsharded_accumulation: bool = True
    # AdamW's moments made at start, before any activation, instead of by the first step: made lazily they are
    # cut from the first update's cached activation blocks, which then cannot go back to the device (the
    # 3B recipe's 21 GiB stranded during generation on one H200). The same numbers either way. Off: measured,
    # it left 0.9 GiB stranded but the update still retried once a step and ran no faster (2026-12-03)
    allocate_state_at_start: bool = False


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: none before the end (`at_end` decides that one)
    at_end: bool = True  # a checkpoint when the run ends (a preempted run writes one regardless)
    resume: str = "auto"  # auto | never | overwrite (start over in a used run folder) | PATH
    keep: int = 2


@dataclass
class LoggingConfig:
    # experiment trackers (grpo/trackers.py): tensorboard, jsonl, wandb, mlflow; rank 0 writes them
    backends: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    tensorboard: bool = True  # false drops "tensorboard" from backends
    stdout: bool = True


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel degree of the policy's language model
    # HSDP: data-parallel replicas, each sharding the policy over its ranks; 1 = plain FSDP over all
    # data-parallel ranks, 0 = one replica per node (all-gathers stay inside a node)
    replicate: int = 1
    # auto: on GPU, only when the policy with its AdamW state and the engine would not fit together
    offload_during_generate: Literal["auto", "on", "off"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # torch's CUDA allocator grows segments in place (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set at
    # start unless the variable already names the setting) instead of caching fixed blocks: on the 3B recipe the
    # blocks of the update's differently sized micro-batches fill the device, and the allocator frees its whole
    # cache and retries once a step (memory/alloc_retries; each retry waits for the device). vLLM 0.26's sleep
    # mode turns it off around its own pool. Off until measured on a GPU
    expandable_segments: bool = False
    # how the policy trains on one device (one rank, parallel.tp=1): fsdp (FSDP units over a mesh of one, which
    # hold each unit's bf16 copy and the fp32 gradients between micro-batches) or plain (a plain module: fp32
    # master weights, a bf16 copy made once a step and swapped in, the gradients added into fp32 after each
    # backward by the trainer: no FSDP hooks around each unit in each micro-batch; the same numbers,
    # tests/test_one_device.py). Ignored with more ranks. plain: the 3B update alone 18% faster on an H100
    # (docs/benchmarks.md, 2026-12-05)
    one_device: Literal["fsdp", "plain"] = "plain"


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# --- reading YAML --------------------------------------------------------------------------------

_BOOL_TAG = "tag:yaml.org,2002:bool"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"


class _ConfigSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with three changes for config files and command-line values.

    Only `true`/`false` are booleans: YAML 1.1 also reads `on/off/yes/no` as booleans, which turned
    the documented `parallel.offload_during_generate=off` into False. Dates stay strings. A key
    given twice in one mapping is an error instead of the later one silently winning.
    """

    def construct_mapping(self, node, deep=False):
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line {first_line[key] + 1}); "
                    "keep one: a later copy would silently replace the earlier one", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_ConfigSafeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _TIMESTAMP_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigSafeLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _short(value: Any, limit: int = 160) -> str:
    """repr(value), cut to `limit` characters: an error message stays one readable line whatever the value."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _yaml_error(exc: yaml.YAMLError, where: str) -> ConfigError:
    """A YAML error as `where, line L, column C: problem` (lines and columns count from 1)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    detail = f"{problem} ({context})" if context else problem
    if mark is None:
        return ConfigError(f"{where}: not valid YAML: {detail}")
    return ConfigError(f"{where}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {detail}")


MAX_YAML_BYTES = 1 << 20  # a config file; the repository's largest is under 4 KB
MAX_YAML_DEPTH = 32  # nested mappings and lists; the schema needs 4
MAX_YAML_NODES = 10_000  # values after expanding aliases; a full config has about 150


def _check_yaml_shape(text: str, where: str) -> None:
    """Refuse YAML that nests deeper than MAX_YAML_DEPTH or expands past MAX_YAML_NODES values.

    Runs on PyYAML's event stream, which is parsed without recursion and builds no objects: nested
    anchors and aliases ("billion laughs") would otherwise grow exponentially once copied into the
    config, and deep nesting would overflow the recursive composer. Each alias counts the full size
    of the node it names; each open collection is a [anchor, expanded size] entry on a stack.
    """
    sizes: dict[str, int] = {}
    stack: list[list] = []

    def add(n: int, event) -> None:
        if stack:
            stack[-1][1] += n
            if stack[-1][1] > MAX_YAML_NODES:
                raise ConfigError(f"{where}, line {event.start_mark.line + 1}: expands to more than {MAX_YAML_NODES} "
                                  "values (nested anchors and aliases?); a config needs far fewer")

    for event in yaml.parse(text, Loader=_ConfigSafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            stack.append([event.anchor, 1])
            if len(stack) > MAX_YAML_DEPTH:
                raise ConfigError(f"{where}, line {event.start_mark.line + 1}: nested more than {MAX_YAML_DEPTH} "
                                  "levels deep; a config needs 4")
        elif isinstance(event, yaml.CollectionEndEvent) and stack:
            anchor, n = stack.pop()
            if anchor is not None:
                sizes[anchor] = n
            add(n, event)
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                sizes[event.anchor] = 1
            add(1, event)
        elif isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for anchor, _ in stack):
                raise ConfigError(f"{where}, line {event.start_mark.line + 1}: alias *{event.anchor} is inside "
                                  f"the node &{event.anchor} it names; a config value cannot contain itself")
            add(sizes.get(event.anchor, 1), event)


def _read_text(p: Path) -> str:
    """The file's text, reading at most MAX_YAML_BYTES + 1 bytes whatever its size claims."""
    if p.stat().st_size > MAX_YAML_BYTES:
        raise ConfigError(f"config file {p} is {p.stat().st_size} bytes; a config file is at most {MAX_YAML_BYTES}")
    with p.open("rb") as f:
        raw = f.read(MAX_YAML_BYTES + 1)
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"config file {p} is over {MAX_YAML_BYTES} bytes; a config file is at most that")
    return raw.decode("utf-8")


def read_yaml(path: str | Path) -> dict:
    """One config file as a mapping; bad YAML and duplicate keys fail naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = _read_text(p)
        _check_yaml_shape(text, f"config file {path}")
        data = yaml.load(text, Loader=_ConfigSafeLoader)
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, f"config file {path}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections at the top level, "
                          f"got {type(data).__name__}")
    return data


def _base_names(value: Any, path: Path) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"config file {path}: 'base' must name a YAML file (or a list of them), got {_short(value)}")


def _file_layers(path: Path, chain: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    """(source, mapping) for `path` and, first, every file it extends through `base:`, depth first."""
    data = read_yaml(path)
    layers = []
    for name in _base_names(data.pop("base"), path) if "base" in data else []:
        base = (path.parent / name).resolve()
        if base in chain or base == path.resolve():
            raise ConfigError(f"config file {path}: base {name!r} extends itself through "
                              + " -> ".join(str(p) for p in (*chain, path.resolve(), base)))
        if not base.is_file():
            raise ConfigError(f"config file {path}: base {name!r} not found (looked for {base}; "
                              "a base is named relative to the file that names it)")
        layers += _file_layers(base, (*chain, path.resolve()))
    layers.append((f"config file {path}", data))
    return layers


# --- command-line overrides ----------------------------------------------------------------------

def _override_value(text: str, raw: str) -> Any:
    """Parse the right side of `key=value` as one YAML value; a value YAML would cut at ` #` stays verbatim."""
    stripped = raw.strip()
    if not stripped:
        return ""
    try:
        _check_yaml_shape(stripped, f"command-line override {_short(text)}")
        node = yaml.compose(stripped, Loader=_ConfigSafeLoader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, f"command-line override {_short(text)}") from None
    if node is None or stripped[node.end_mark.index:].strip():
        # YAML reads `#` after a space as a comment: take the whole value as written instead.
        return stripped
    try:
        return yaml.load(stripped, Loader=_ConfigSafeLoader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, f"command-line override {_short(text)}") from None


def _split_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {_short(text)} is not of the form key.sub=value")
    dotted, raw = text.split("=", 1)
    dotted = dotted.strip()
    if not dotted or any(not part for part in dotted.split(".")):
        raise ConfigError(f"override {_short(text)}: {_short(dotted)} is not a dotted key like trainer.max_steps")
    return dotted, _override_value(text, raw)


def parse_override(text: str) -> dict:
    """`a.b=v` → {'a': {'b': v}}, v read as a YAML value (3 is int, 1e-6 float, true bool, off str)."""
    dotted, value = _split_override(text)
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


# --- the schema ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> dict[str, Any]:
    """Field name → resolved type annotation of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"a list of {_type_name(item)}"
    return getattr(tp, "__name__", str(tp))


def _closest(name: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _annotation(dotted: str) -> Any:
    """The annotation at a dotted path ('rollout' → RolloutConfig, 'rollout.n' → int), or None."""
    tp: Any = Config
    for part in dotted.split("."):
        fields = _fields(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in fields:
            return None
        tp = fields[part]
    return tp


def _leaf_type(dotted: str) -> Any:
    """The annotation of a leaf key such as 'rollout.temperature', or None when there is no such leaf."""
    tp = _annotation(dotted)
    return None if dataclasses.is_dataclass(tp) else tp


_KEY_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
MAX_INTERPOLATED_CHARS = 4096  # a value holding ${...}: the length of a path (PATH_MAX) is plenty
MAX_INTERPOLATIONS = 32  # ${...} in one value
_ONLY_KEYS = ("only ${section.key} references to other config keys are expanded, never an environment "
              "variable or a resolver; write \\${...} to keep the text as written")


def _check_reference(target: str, key: str, source: str) -> None:
    """`target` (the inside of one `${...}`) must name a leaf config key such as `trainer.seed`."""
    shown = target if len(target) <= 160 else f"{target[:160]}..."
    if not (_KEY_PATH.fullmatch(target) and target.split(".")[0] in _fields(Config)):
        raise ConfigError(f"config key '{key}' ({source}): ${{{shown}}} is not a config key; {_ONLY_KEYS}")
    if _leaf_type(target) is None:
        section, _, name = target.rpartition(".")
        parent = _annotation(section)
        hint = _closest(name, list(_fields(parent))) if dataclasses.is_dataclass(parent) else ""
        raise ConfigError(f"config key '{key}' ({source}): ${{{shown}}} names no config key{hint}")


def _check_interpolations(value: str, key: str, source: str) -> None:
    """Allow in `value` only what OmegaConf resolves as `${section.key}`; refuse every resolver.

    The value is read with OmegaConf's own grammar, the parser that resolves it later, so escapes
    (`\\${` literal, `\\\\${` a backslash then an interpolation) and nesting (a resolver inside
    another's default) are seen exactly as OmegaConf will see them.
    """
    if "${" not in value:  # OmegaConf parses a string for interpolations only when it holds "${"
        return
    if len(value) > MAX_INTERPOLATED_CHARS or value.count("${") > MAX_INTERPOLATIONS:
        raise ConfigError(f"config key '{key}' ({source}): a value with ${{...}} in it may be at most "
                          f"{MAX_INTERPOLATED_CHARS} characters with {MAX_INTERPOLATIONS} of them (OmegaConf's "
                          f"parser is slow on more), got {len(value)} with {value.count('${')}")
    try:
        tree = parse_interpolation(value)
    except Exception as exc:  # noqa: BLE001 - GrammarParseError, or RecursionError from deep nesting
        raise ConfigError(f"config key '{key}' ({source}): {_short(value)} is not a valid ${{...}} reference "
                          f"({type(exc).__name__}); {_ONLY_KEYS}") from None
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
            raise ConfigError(f"config key '{key}' ({source}): ${{{node.resolverName().getText()}:...}} is a "
                              f"resolver; {_ONLY_KEYS}")
        if isinstance(node, OmegaConfGrammarParser.InterpolationNodeContext):
            _check_reference(node.getText()[2:-1], key, source)  # a nested ${...} in the key fails here
            continue
        stack.extend(getattr(node, "children", None) or [])


def _strings(value: Any) -> Iterator[str]:
    """Every string in a YAML value, inside lists and mappings too (keys included; `!!omap`, `!!pairs` and
    `!!set` build tuples and sets)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)


# model.* switches whose `auto` the policy settles for its family and device (attributes of models.policy.Policy
# of the same names); the trainer writes what ran into config.yaml as true/false (tools/loop_summary.py reads
# them back as booleans)
SETTLED_BY_POLICY = ("liger_kernel", "pad_vision_mlp", "torch_rms_norm", "flash_direct")

# keys with an `auto` that read a boolean as one of their words: key -> (the word for true, the word for false)
BOOLEAN_SWITCHES = {"model.shared_prompts": ("on", "off"), "model.vision_once": ("on", "off"),
                    "model.liger_kernel": ("true", "false"), "trainer.gpu_telemetry": ("true", "false"),
                    "model.pad_vision_mlp": ("true", "false"), "model.torch_rms_norm": ("true", "false"),
                    "model.flash_direct": ("true", "false")}


def _prepare(key: str, value: Any, tp: Any, source: str) -> Any:
    """Checks OmegaConf does not make for one leaf value, and the interpolation check on its strings."""
    if isinstance(value, dict):
        raise ConfigError(f"config key '{key}' ({source}) is a value, not a section; expected "
                          f"{_type_name(tp)}, got a mapping {_short(value)}")
    if tp is str and isinstance(value, bool):
        raise ConfigError(f"config key '{key}' ({source}): expected a string, got the boolean {value!r}; "
                          "quote it if you mean the text")
    if isinstance(value, bool) and key in BOOLEAN_SWITCHES:
        value = BOOLEAN_SWITCHES[key][0 if value else 1]  # once a boolean: true/false keep working
    for text in _strings(value):
        _check_interpolations(text, key, source)
    return value


def _leaves(data: dict, cls: type, prefix: str, source: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf of `data`, checking each key against the schema on the way."""
    fields = _fields(cls)
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}' ({source}){_closest(str(name), list(fields))}")
        tp = fields[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{key}' ({source}) is a section; expected a mapping of its "
                                  f"keys ({', '.join(_fields(tp))}), got {_short(value)}")
            yield from _leaves(value, tp, f"{key}.", source)
        else:
            yield key, _prepare(key, value, tp, source)


def _set(conf: Any, key: str, value: Any, source: str) -> None:
    """Assign one leaf; OmegaConf converts it to the key's type or we name the key and the type."""
    try:
        OmegaConf.update(conf, key, value, merge=False)
    except OmegaConfBaseException as exc:
        note = " (a command-line value with ' #' is kept whole, not cut at the '#')" if " #" in str(value) else ""
        raise ConfigError(f"config key '{key}' ({source}): expected {_type_name(_leaf_type(key))}, "
                          f"got {type(value).__name__} {_short(value)}{note}") from None


def _first_line(exc: Exception) -> str:
    return str(getattr(exc, "msg", None) or exc).strip().splitlines()[0]


def _resolve(conf: Any) -> Config:
    """The merged OmegaConf tree as a `Config`, with `???` values and interpolations settled."""
    try:
        missing = sorted(OmegaConf.missing_keys(conf))
        if missing:
            raise ConfigError(f"config keys marked ??? (required) were not given: {', '.join(missing)}; "
                              f"set them on the command line, e.g. {missing[0]}=VALUE")
        return OmegaConf.to_object(conf)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"config key '{key}': {_first_line(exc)}") from None


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Build the root config from an optional YAML file and `a.b=v` overrides, validating every key."""
    layers = _file_layers(Path(path)) if path else []
    for text in overrides or []:
        layers.append((f"command line {_short(text)}", parse_override(text)))
    conf = OmegaConf.structured(Config)
    given = set()  # the keys a file or an override names
    for source, data in layers:
        for key, value in _leaves(data, Config, "", source):
            _set(conf, key, value, source)
            given.add(key)
    cfg = _resolve(conf)
    validate(cfg, given)
    return cfg


# --- ranges and cross-field checks -----------------------------------------------------------------

AT_LEAST_ONE = (
    "rollout.continuous_add_batch",
    "trainer.max_steps", "trainer.eval_samples", "trainer.eval_max_new_tokens",
    "data.prompts_per_step", "data.max_prompt_tokens", "data.min_pixels", "data.max_pixels",
    "data.max_video_bytes", "data.max_source_frames",
    "rollout.n", "rollout.max_new_tokens", "rollout.tensor_parallel_size",
    "rollout.max_turns", "rollout.tool_workers",
    "algorithm.ppo_epochs", "optim.max_tokens_per_microbatch", "parallel.tp",
)
AT_LEAST_ZERO = (
    "trainer.seed", "trainer.eval_every", "model.lora.rank", "trainer.max_nonfinite_in_row", "trainer.profile_step",
    "model.router_aux_loss_coef",
    "rollout.temperature", "rollout.processor_cache_gb", "rollout.max_tool_images", "rollout.max_tool_errors", "rollout.max_context_tokens",
    "algorithm.tool_error_penalty",
    "algorithm.clip_low", "algorithm.clip_high", "algorithm.kl_coef", "algorithm.tis_cap",
    "algorithm.max_refill_rounds", "algorithm.overlong_buffer", "algorithm.overlong_penalty",
    "algorithm.mismatch_mask_threshold", "algorithm.gspo_clip_low", "algorithm.gspo_clip_high",
    "algorithm.cispo_clip_low", "algorithm.cispo_clip_high", "algorithm.icepop_low", "algorithm.seq_mask_low",
    "optim.weight_decay", "optim.warmup_steps", "optim.grad_clip",
    "checkpoint.every_steps", "checkpoint.keep",
)
PROBABILITIES = ("rollout.top_p",)  # in (0, 1]


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _float_keys(cls: type = Config, prefix: str = "") -> Iterator[str]:
    for name, tp in _fields(cls).items():
        if dataclasses.is_dataclass(tp):
            yield from _float_keys(tp, f"{prefix}{name}.")
        elif tp is float:
            yield f"{prefix}{name}"


def _range_errors(cfg: Config) -> Iterator[str]:
    """One message per value outside its range, each naming the key."""
    for key in _float_keys():
        if not math.isfinite(_get(cfg, key)):
            yield f"config key '{key}' must be a finite number, got {_get(cfg, key)}"
    for key in AT_LEAST_ONE:
        if _get(cfg, key) < 1:
            yield f"config key '{key}' must be >= 1, got {_get(cfg, key)}"
    for key in AT_LEAST_ZERO:
        if _get(cfg, key) < 0:
            yield f"config key '{key}' must be >= 0, got {_get(cfg, key)}"
    for key in PROBABILITIES:
        if not 0 < _get(cfg, key) <= 1:
            yield f"config key '{key}' must be in (0, 1], got {_get(cfg, key)}"


def _cross_errors(cfg: Config) -> Iterator[str]:
    """Checks that tie keys together or have a range of their own."""
    if cfg.trainer.mode == "grpo" and not cfg.rollout.temperature > 0:
        yield (f"config key 'rollout.temperature' must be > 0 for GRPO (trainer.mode=grpo), got "
               f"{cfg.rollout.temperature}: responses are sampled at it and logprobs are divided by it; "
               "use 1.0 for the usual on-policy sampling")
    if not cfg.trainer.gpu_telemetry_interval_s > 0:
        yield (f"config key 'trainer.gpu_telemetry_interval_s' must be > 0 (seconds between GPU readings), got "
               f"{cfg.trainer.gpu_telemetry_interval_s}")
    if cfg.rollout.sleep_level not in (1, 2):
        yield f"config key 'rollout.sleep_level' must be 1 or 2, got {cfg.rollout.sleep_level}"
    if not 0 <= cfg.rollout.gpu_memory_utilization <= 1:
        yield (f"config key 'rollout.gpu_memory_utilization' must be in (0, 1], or 0 to let the memory plan "
               f"decide, got {cfg.rollout.gpu_memory_utilization}")
    if cfg.rollout.top_k == 0 or cfg.rollout.top_k < -1:
        yield f"config key 'rollout.top_k' must be -1 (off) or >= 1, got {cfg.rollout.top_k}"
    yield from _tool_errors(cfg)
    yield from _exact_errors(cfg)
    if cfg.data.min_pixels > cfg.data.max_pixels:
        yield (f"config key 'data.min_pixels' ({cfg.data.min_pixels}) must be <= data.max_pixels "
               f"({cfg.data.max_pixels})")
    yield from _video_errors(cfg.data)
    if cfg.algorithm.dual_clip and not cfg.algorithm.dual_clip > 1.0:
        yield f"config key 'algorithm.dual_clip' must be 0 (off) or > 1, got {cfg.algorithm.dual_clip}"
    yield from _algorithm_errors(cfg.algorithm)
    yield from _lora_errors(cfg)
    yield from _shared_prompt_errors(cfg)
    yield from _exact_rounding_errors(cfg)
    yield from _liger_errors(cfg.model)
    if not cfg.optim.lr > 0:
        yield f"config key 'optim.lr' must be a finite positive number, got {cfg.optim.lr}"
    for key in ("optim.beta1", "optim.beta2"):
        if not 0 <= _get(cfg, key) < 1:
            yield f"config key '{key}' must be in [0, 1), got {_get(cfg, key)}"
    if not cfg.optim.eps > 0:
        yield f"config key 'optim.eps' must be > 0, got {cfg.optim.eps}"
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        yield f"config key 'optim.min_lr_ratio' must be in [0, 1], got {cfg.optim.min_lr_ratio}"
    if cfg.parallel.replicate < 0:
        yield (f"config key 'parallel.replicate' must be 0 (one replica per node) or positive, "
               f"got {cfg.parallel.replicate}")
    if cfg.checkpoint.resume not in ("auto", "never") and not cfg.checkpoint.resume:
        yield "config key 'checkpoint.resume' must be auto, never, overwrite or a checkpoint path"


def _video_errors(d: DataConfig) -> Iterator[str]:
    """data keys of video sampling: a positive rate, room for two frames (the temporal patch), and a clip budget
    that gives each of max_frames frames at least one 28 x 28 patch (the smallest family grid)."""
    if not d.video_fps > 0:
        yield f"config key 'data.video_fps' must be > 0, got {d.video_fps}"
    if d.max_frames < 2:
        yield f"config key 'data.max_frames' must be >= 2 (the temporal patch of two frames), got {d.max_frames}"
    if d.video_max_pixels < d.max_frames * 28 * 28:
        yield (f"config key 'data.video_max_pixels' ({d.video_max_pixels}) must be >= data.max_frames × 28 × 28 "
               f"({d.max_frames * 28 * 28}): every frame needs at least one 28 x 28 patch")


def _tool_errors(cfg: Config) -> Iterator[str]:
    """rollout keys of multi-turn episodes."""
    r = cfg.rollout
    if not r.tool_timeout_s > 0:
        yield f"config key 'rollout.tool_timeout_s' must be > 0, got {r.tool_timeout_s}"
    if r.max_turns > 1 and not r.tools:
        yield (f"config key 'rollout.max_turns' is {r.max_turns} but rollout.tools is empty: a second turn follows "
               "only a tool call; name the tools or set rollout.max_turns=1")
    bad = [t for t in r.tools if not isinstance(t, str) or not t or t != t.strip()]
    if bad:
        yield f"config key 'rollout.tools' holds {bad!r}: each entry is a tool name from the registry"
    floor = cfg.data.max_prompt_tokens + 1
    if r.max_context_tokens and r.max_context_tokens < floor:
        yield (f"config key 'rollout.max_context_tokens' ({r.max_context_tokens}) must be 0 or more than "
               f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}): the longest prompt needs room for an answer")


def _exact_errors(cfg: Config) -> Iterator[str]:
    """rollout.exact: the combinations whose engine and policy forwards cannot be made bitwise equal."""
    if cfg.rollout.exact_cuda_graphs and not cfg.rollout.exact:
        yield "config key 'rollout.exact_cuda_graphs' is true without rollout.exact=true; it applies to exact mode only"
    if cfg.rollout.exact_cuda_graphs and cfg.rollout.enforce_eager:
        yield ("config keys 'rollout.exact_cuda_graphs' and 'rollout.enforce_eager' are both true; graphs need the "
               "engine not eager")
    if not cfg.rollout.exact:
        return
    r, m = cfg.rollout, cfg.model
    refusals = (
        ("rollout.engine", r.engine == "torch", f"{r.engine}; it needs vllm (or auto on a GPU)"),
        ("rollout.tensor_parallel_size", r.tensor_parallel_size != 1,
         f"{r.tensor_parallel_size}; it needs 1 (an all-reduce sums the shards in another order than one GPU's matmul)"),
        ("parallel.tp", cfg.parallel.tp != 1, f"{cfg.parallel.tp}; it needs 1 (sharded projections reduce in another order)"),
        ("model.compile", m.compile, "true; it needs false (compiled blocks fuse norms and rotary into other kernels)"),
        ("model.liger_kernel", m.liger_kernel == "true",
         "true; it needs auto or false (liger's fused kernels are not the engine's)"),
        ("model.attn_implementation", m.attn_implementation not in ("auto", "vllm_paged"),
         f"{m.attn_implementation}; it needs auto or vllm_paged (the mode runs the engine's kernel)"),
        ("model.lora.rank", m.lora.rank > 0,
         f"{m.lora.rank}; it needs 0 (the engine runs the merged weight, the policy W and B·A apart)"),
        ("rollout.top_p", r.top_p != 1.0, f"{r.top_p}; it needs 1.0 (vLLM returns the truncated distribution's logprobs)"),
        ("rollout.top_k", r.top_k != -1, f"{r.top_k}; it needs -1 (vLLM returns the truncated distribution's logprobs)"),
        ("algorithm.routing_replay", cfg.algorithm.routing_replay,
         "true; it needs false (vLLM reports the experts only with prefix caching, which exact mode turns off)"),
        ("model.dtype", m.dtype == "float32", "float32; it needs auto or bfloat16 (vLLM's FlashAttention has no fp32 kernel)"),
        ("rollout.attention_backend", r.attention_backend not in ("auto", "FLASH_ATTN"),
         f"{r.attention_backend}; it needs auto or FLASH_ATTN (the kernel the policy calls too)"),
    )
    for key, bad, why in refusals:
        if bad:
            yield f"config key '{key}' is {why} with rollout.exact=true"


def _algorithm_errors(a: AlgorithmConfig) -> Iterator[str]:
    """Objective and rollout-correction keys that need more than a sign check."""
    for key in ("sapo_tau_pos", "sapo_tau_neg", "mis_cap"):
        if not getattr(a, key) > 0:
            yield f"config key 'algorithm.{key}' must be > 0, got {getattr(a, key)}"
    for low, high in (("icepop_low", "icepop_high"), ("seq_mask_low", "seq_mask_high")):
        if not getattr(a, low) <= 1.0 <= getattr(a, high):
            yield (f"config keys 'algorithm.{low}' ({getattr(a, low)}) and 'algorithm.{high}' "
                   f"({getattr(a, high)}) must bracket 1: a token with no mismatch (weight 1) must be kept")


def _shared_prompt_blockers(cfg: Config) -> Iterator[str]:
    """What in the config rules out model.shared_prompts: a row of segments that only the varlen attention
    reads, and not what exact mode or routing replay line up token by token with the engine."""
    m = cfg.model
    if m.attn_implementation not in ("auto", "varlen"):
        yield (f"config key 'model.attn_implementation' is {m.attn_implementation} with model.shared_prompts=on; "
               "it needs auto or varlen (the attention that reads a shared prompt's segments)")
    if cfg.rollout.exact:
        yield "config key 'model.shared_prompts' is on with rollout.exact=true; set it to auto or off"
    if cfg.algorithm.routing_replay:
        yield "config key 'model.shared_prompts' is on with algorithm.routing_replay=true; set it to auto or off"
    if cfg.parallel.tp > 1:
        yield f"config key 'model.shared_prompts' is on with parallel.tp={cfg.parallel.tp}; it needs 1"


def _exact_rounding_errors(cfg: Config) -> Iterator[str]:
    """Settings that round otherwise than the engine, with rollout.exact: model.vision_once=on or
    model.pad_vision_mlp=true (exact mode's tower computes as the engine's, its images batched and its products
    shaped as there) and model.torch_rms_norm=true."""
    if cfg.model.vision_once == "on" and cfg.rollout.exact:
        yield "config key 'model.vision_once' is on with rollout.exact=true; set it to auto or off"
    if cfg.model.pad_vision_mlp == "true" and cfg.rollout.exact:
        yield "config key 'model.pad_vision_mlp' is true with rollout.exact=true; set it to false"
    if cfg.model.torch_rms_norm == "true" and cfg.rollout.exact:
        yield ("config key 'model.torch_rms_norm' is true with rollout.exact=true (torch's kernel rounds as the "
               "engine's does not); set it to false")


def _shared_prompt_errors(cfg: Config) -> Iterator[str]:
    """model.shared_prompts=on with something that rules it out is an error (`auto` settles instead)."""
    if cfg.model.shared_prompts == "on":
        yield from _shared_prompt_blockers(cfg)


def _liger_errors(m: ModelConfig) -> Iterator[str]:
    """model.liger_kernel=true with model.compile=true: torch 2.11's dynamo fails tracing liger's autograd
    functions (an AssertionError in overwrite_tensor_vt_proxy on LigerRMSNormFunction.apply, H200 2026-12-02)."""
    if m.liger_kernel == "true" and m.compile:
        yield ("config keys 'model.liger_kernel' and 'model.compile' are both true: torch.compile (dynamo, torch "
               "2.11) fails tracing liger-kernel's autograd functions (LigerRMSNormFunction); set one of them to "
               "false (model.liger_kernel=auto leaves liger off when compiling)")


def _given_errors(cfg: Config, given: set[str] | frozenset[str]) -> Iterator[str]:
    """Keys whose default the config settles but whose given value it refuses: model.fp32_logits=true with
    rollout.exact=true (vLLM's fp32 head bypasses the lm_head exact mode makes bitwise equal to the policy's)."""
    if cfg.rollout.exact and cfg.model.fp32_logits and "model.fp32_logits" in given:
        yield ("config key 'model.fp32_logits' is true; it needs false (exact mode computes the lm_head in the "
               "model dtype, bitwise as the engine's) with rollout.exact=true")


def _settle_auto_keys(cfg: Config) -> None:
    """`auto` keys the config alone decides: model.shared_prompts is off where the config rules it out,
    model.vision_once, model.pad_vision_mlp and model.torch_rms_norm with rollout.exact, and model.liger_kernel
    with rollout.exact or model.compile (the family, the device and the installed packages decide the rest when
    the policy is built: models.policy.shares_prompts, runs_vision_once, cuda_switch and uses_liger)."""
    if cfg.model.shared_prompts == "auto" and any(_shared_prompt_blockers(cfg)):
        cfg.model.shared_prompts = "off"
    if cfg.model.vision_once == "auto" and cfg.rollout.exact:
        cfg.model.vision_once = "off"
    if cfg.model.pad_vision_mlp == "auto" and cfg.rollout.exact:
        cfg.model.pad_vision_mlp = "false"
    if cfg.model.torch_rms_norm == "auto" and cfg.rollout.exact:
        cfg.model.torch_rms_norm = "false"
    if cfg.model.liger_kernel == "auto" and (cfg.rollout.exact or cfg.model.compile):
        cfg.model.liger_kernel = "false"
    if cfg.rollout.exact:  # model.fp32_logits: its default gives way to exact mode's own lm_head
        cfg.model.fp32_logits = False


def _lora_errors(cfg: Config) -> Iterator[str]:
    """model.lora keys: a positive alpha, some targets, and no tensor parallelism (its plan shards nn.Linear
    layers, which LoRA replaces)."""
    lora = cfg.model.lora
    if not lora.rank:
        return
    if not lora.alpha > 0:
        yield f"config key 'model.lora.alpha' must be > 0, got {lora.alpha}"
    if not lora.targets and not lora.vision_targets:
        yield "config keys 'model.lora.targets' and 'model.lora.vision_targets' are both empty: LoRA would train nothing"
    if lora.vision_targets and cfg.model.freeze_vision_tower:
        yield ("config keys 'model.lora.vision_targets' and 'model.freeze_vision_tower' disagree: adapters in a frozen "
               "vision tower would not train; empty one of them")
    for key in ("targets", "vision_targets"):
        bad = [t for t in getattr(lora, key) if not t or t != t.strip() or t.startswith(".") or t.endswith(".")]
        if bad:
            yield (f"config key 'model.lora.{key}' holds {bad!r}: each entry is the end of a linear layer's "
                   "name, such as q_proj or mlp.down_proj")
    if cfg.parallel.tp > 1:
        yield (f"config key 'model.lora.rank' ({lora.rank}) needs parallel.tp=1, got {cfg.parallel.tp}: LoRA "
               "layers are sharded by FSDP only")


def validate(cfg: Config, given: set[str] | frozenset[str] = frozenset()) -> None:
    """Range and cross-field checks that a type annotation cannot express (the first failure raises), then
    the `auto` keys the config alone decides are settled. `given`: the keys the config's files and overrides
    named (a default that the config rules out settles; the same value given is an error)."""
    for message in (*_range_errors(cfg), *_cross_errors(cfg), *_given_errors(cfg, given)):
        raise ConfigError(message)
    _settle_auto_keys(cfg)


# --- saving --------------------------------------------------------------------------------------

def config_to_dict(cfg: Config) -> dict:
    """The config as plain nested dicts (for trackers and logs)."""
    return dataclasses.asdict(cfg)


_BACKSLASHES_BEFORE_INTERPOLATION = re.compile(r"(\\*)\$\{")


def _escape(value: Any) -> Any:
    """Escape a literal `${` so a saved value reads back as the same text, never as an interpolation.

    OmegaConf reads 2n backslashes before `${` as n backslashes and an interpolation, and 2n + 1 as
    n backslashes and a literal `${`: so n literal backslashes before a literal `${` are saved as 2n + 1."""
    if isinstance(value, str):
        return _BACKSLASHES_BEFORE_INTERPOLATION.sub(lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", value)
    if isinstance(value, list):
        return [_escape(v) for v in value]
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    return value


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML that `load_config` reads back to an equal `Config`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(_escape(config_to_dict(cfg)))))
    os.replace(tmp, path)
