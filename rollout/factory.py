"""Choose and build the rollout engine from `rollout.engine` (torch | vllm | auto)."""

from __future__ import annotations

import importlib.util
import warnings

import torch

from rollout.base import SamplingParams
from rollout.weight_names import VLLM_PENDING, VLLM_UNVERIFIED


def vllm_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def resolve_engine_name(name: str, family: str | None = None) -> str:
    """auto → vllm when CUDA and vllm are present and the vLLM engine handles the model family
    (`family`: config.json's model_type), else the built-in torch engine."""
    pending = VLLM_PENDING.get(family)
    unverified = VLLM_UNVERIFIED.get(family)
    if name == "auto":
        return "vllm" if vllm_available() and pending is None and unverified is None else "torch"
    if name == "vllm" and pending is not None:
        raise RuntimeError(f"rollout.engine=vllm does not run model family '{family}' yet ({pending}); "
                           "set rollout.engine=torch to use the built-in engine")
    if name == "vllm" and not vllm_available():
        raise RuntimeError(
            "rollout.engine=vllm needs CUDA and the vllm package (pip install -e .[vllm]); "
            "set rollout.engine=torch to use the built-in engine"
        )
    if name == "vllm" and unverified is not None:
        warnings.warn(f"rollout.engine=vllm for model family '{family}' is not yet measured against the "
                      f"policy ({unverified}); watch fidelity/token_mult_prob_error in the logs",
                      stacklevel=1)  # one place: start-up checks and the engine build warn once between them
    return name


def build_engine(cfg, policy, *, gpu_memory_utilization: float | None = None, max_num_seqs: int | None = None):
    """The engine for this rank, holding the policy's model folder; weights arrive by refit.

    `gpu_memory_utilization` is the colocation plan's share of the device for vLLM (default:
    rollout.gpu_memory_utilization); `max_num_seqs` the most sequences one generation call runs
    at once (vLLM sizes its scheduler and CUDA graphs by it)."""
    name = resolve_engine_name(cfg.rollout.engine, policy.model.config.model_type)
    replay = cfg.algorithm.routing_replay
    if replay and not policy.adapter.experts_per_token:
        raise ValueError(f"config key 'algorithm.routing_replay' is true, but model family '{policy.adapter.name}' "
                         "has no MoE router; set it to false")
    if name == "torch":
        from rollout.torch_engine import TorchEngine

        return TorchEngine(cfg.model.path, device=policy.device, dtype=policy.dtype, adapter=policy.adapter,
                           record_routing=replay, fp32_logits=cfg.model.fp32_logits)
    from rollout.exact import engine_mode
    from rollout.vllm_engine import VLLMEngine

    from data.processing import videos_per_row
    from rollout.rollouts import context_tokens

    r, d = cfg.rollout, cfg.data
    return VLLMEngine(
        cfg.model.path, tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization or r.gpu_memory_utilization or 0.5,
        enforce_eager=r.enforce_eager, max_num_seqs=max_num_seqs, sleep_level=r.sleep_level,
        processor_cache_gb=r.processor_cache_gb, mm_uuids=r.mm_uuids,
        skip_empty_hf_calls=r.skip_empty_hf_calls, fast_placeholder_search=r.fast_placeholder_search,
        max_model_len=context_tokens(cfg), seed=cfg.trainer.seed,
        # a prompt's image plus what the tools may add to its episode
        max_images_per_prompt=1 + (r.max_tool_images if r.tools else 0),
        max_videos_per_prompt=max((videos_per_row(p) for p in (d.train_path, d.eval_path) if p), default=0)
        if policy.adapter.takes_video else 0,
        dtype="bfloat16" if policy.dtype == torch.bfloat16 else "float32", min_pixels=d.min_pixels,
        max_pixels=d.max_pixels, image_pad_id=policy.adapter.image_token_id, adapter=policy.adapter,
        return_routed_experts=replay, fp32_logits=cfg.model.fp32_logits,
        exact=engine_mode(policy, r.exact_cuda_graphs) if r.exact else None, attention_backend=r.attention_backend,
        engine_warmup=r.engine_warmup, startup_plan=r.engine_startup_plan, gen_breakdown=r.gen_breakdown,
        engine_compile=r.engine_compile,
        # the lean warm-up samples as the rollouts do (Trainer.sampling_params)
        warmup_sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=2,
                                       banned_token_ids=list(policy.adapter.banned_token_ids)),
    )
