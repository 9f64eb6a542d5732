"""The vLLM rollout engine: one in-process `vllm.LLM` per rank, riding torchrun's process group.

Written against vLLM 0.26.0. vLLM is imported only when an engine is built, so the rest of
`rollout/` imports on machines without it. Each choice below is a fidelity rule of DESIGN.md:

- In process, tensor parallel inside the node: `distributed_executor_backend="external_launcher"`
  makes every torchrun rank run its own engine over the existing process group (consecutive
  ranks form a tensor-parallel group; the groups beyond it are independent data-parallel copies).
  All ranks of a group must call `generate`, `refit` and `read_weights` together, with the same
  arguments. Without torchrun a process runs as a world of one.
- Weights: the engine starts from `load_format="dummy"` (random weights, no checkpoint read)
  and gets real ones by `refit`. Refit feeds vLLM the transformers names themselves (module names
  of a model in memory, or the checkpoint-file names): its `load_weights` reads both, mapping
  prefixes and stacking q/k/v and gate/up itself (LLaVA's and Gemma3's vision names first get the
  `vision_model.` level transformers 5 dropped, `weight_names.vllm_load_name`). Tensors vLLM builds
  no parameter for (`weight_names.VLLMSkips`: LLaVA's vision layers past vision_feature_layer and
  its post_layernorm) are handed over, counted and not expected back. `rollout.weight_names` predicts the vLLM
  parameter each name lands in, and the refit fails if vLLM loaded anything else, so a silently
  dropped tensor cannot go unnoticed. Tensor-parallel all-reduces go through NCCL: vLLM's
  CUDA-IPC custom all-reduce is disabled.
- Image placeholders: vLLM 0.26 treats a token prompt as unexpanded. Its multimodal processor
  (`BaseMultiModalProcessor._apply_prompt_updates` with the family's `PromptReplacement`)
  replaces, for each image, the first target token it finds (Qwen's `<|image_pad|>`, LLaVA's and
  SmolVLM's `<image>`, Gemma3's `<start_of_image>`) with that image's full replacement. Our
  prompts are already expanded, so the family adapter collapses each image block back to what
  vLLM expects (`FamilyAdapter.vllm_collapse`) and the engine checks that the adapter's model of
  vLLM's expansion (`vllm_expand`) gives our ids back; vLLM then rebuilds the blocks from its own
  processor output, and every response is checked: the prompt ids vLLM ran must equal ours token
  for token, so a different image grid (pixels, resize rule) fails loudly instead of shifting positions.
- Images: the images the trainer's processor saw (already at the family's size) go to vLLM with
  the processor kwargs the trainer used (`FamilyAdapter.vllm_processor_kwargs`: Qwen's min/max
  pixels and `do_resize=False`, SmolVLM's splitting after a size-keeping resize, Gemma3 without
  pan-and-scan), so both sides compute identical pixel values. The multimodal processor cache
  (`rollout.processor_cache_gb`, default 4 GiB of host memory per engine) keeps those pixel values by
  image content, so an episode's earlier images are not processed again each turn; they do not
  depend on the weights; the turns of one step share it. It, the encoder cache and the prefix cache
  are emptied at every wake, so no vision features or KV blocks of old weights are reused.
- Image keys (`rollout.mm_uuids`, off by default until measured on a GPU): each request names its images by a content key
  (`multi_modal_uuids`), computed once per image object (`ImageKeys`), so vLLM does not hash every
  earlier image of an episode again on every turn; vLLM uses the key wherever it would use its own
  hash (processor cache, encoder cache, prefix-cache block keys). Prompts get no joined pixel rows
  (`reads_pixel_values`): vLLM processes the images itself.
- Full processor-cache hits (`rollout.skip_empty_hf_calls`, on by default): where a
  family's vLLM processor overrides `_call_hf_processor` (Qwen2/2.5-VL), vLLM 0.26 calls the HF
  processor on dummy text even when every image of a request is cached, only to drop its output; a
  later turn pays that call for every episode. The engine can skip the call when no image is missing
  (`skip_empty_hf_calls`): vLLM's prompt ids, pixels, hashes and placeholders stay the same.
- Placeholder search (`rollout.fast_placeholder_search`, on by default): after
  expanding a prompt, vLLM 0.26 finds each image's run by comparing a slice of the image's length at
  every position of the prompt (`_iter_placeholders`), a cost that grows with every turn; the engine
  can make it jump to the positions holding a run's first token, where only a match can start.
- Videos: the trainer's canonical frames go as `multi_modal_data["video"]` with the clip's timing
  (`data.processing.video_metadata`) where the family's vLLM processor reads it
  (`FamilyAdapter.vllm_video_items`: Qwen3-VL in the item, Qwen2.5-VL as the request's
  `video_metadata` processor argument); the video expansion is collapsed and checked like the
  images' (`vllm_collapse_videos`). `limit_mm_per_prompt` has `max_videos_per_prompt` videos.
  Qwen2/2.5-VL engines for two or more videos per prompt run without the processor cache: on a
  partial hit vLLM hands transformers the missed clips with the request's whole `video_metadata`
  (`processor_cache`, `QwenVLAdapter.vllm_processor_cache_safe`).
- Logprobs: `logprobs_mode="processed_logprobs"` returns log_softmax of the fp32 logits after
  vLLM's logit processors and temperature (V1 `Sampler`: bias → logits / T → top-k/top-p →
  log_softmax). With top_p=1 and top_k off this is the trainer's log_softmax(logits / T) over
  the full vocabulary, except that banned tokens carry no mass (they are never sampled, so this
  is the distribution actually sampled from; for a trained model their mass is ~0). The default
  "raw_logprobs" is taken before temperature and would be wrong for any T != 1. With top_p < 1
  or top_k on, vLLM returns logprobs of the truncated, renormalized distribution: no vLLM 0.26
  mode gives the untruncated one, so keep top_p=1, top_k=-1 when engine logprobs feed the loss.
- Banned tokens (image/video placeholders, vision start/end): a logit bias of -100, the bound
  vLLM clamps `logit_bias` to. A banned token's probability is at most e^-100 ≈ 4e-44 relative
  to any other, so it is never sampled, and its share of the normalizer is below fp32 resolution.
- Stopping: exactly `stop_token_ids` (`ignore_eos=True` keeps vLLM from adding the tokenizer's
  or generation_config's EOS on its own); the stop token is kept as the response's last token.
- Randomness: constructing vLLM reseeds Python's, numpy's and torch's global generators; their
  states are restored afterwards. Unseeded sampling draws from the CUDA generator (V1 runner) or from
  per-request seeds vLLM draws from numpy's global generator (V2 runner); both are reseeded from
  (engine seed, call count, data-parallel rank) inside a forked RNG scope for each `generate`,
  so ranks of a tensor-parallel group sample identically whatever the trainer did with the
  global generator in between, and the trainer's stream is left as it was. With
  `SamplingParams.seed` set, prompt i uses seed + i*n (vLLM adds the sample index).
- Memory: sleep level 1 by default here (weights copied to host, KV cache dropped); the trainer
  passes `rollout.sleep_level`, 2 by default (weights dropped: it refits before every generation
  that follows; level 2 corrupted VLM rollouts in one public report on an older vLLM, and matched
  level 1's mismatch in the 3B loop here). Families vLLM runs through FlexAttention (Gemma3's bidirectional
  image attention) get their KV cache capped where its per-step block map would grow past
  256 MiB (`flex_kv_cap_bytes`; only models with little KV per token, like the tiny ones). A refit of a sleeping engine wakes only the weights; `wake` then
  brings the KV cache back.
- Start-up: `build_times` holds the seconds of importing vLLM, of `LLM(...)` and of the V2 model
  runner's kernel warm-up inside it, which `rollout.engine_warmup` can shrink to the kernels a rollout
  runs or skip (`kernel_warmup`); `rollout.engine_startup_plan` lets vLLM reuse its memory profile.
- Generation breakdown (`rollout.gen_breakdown`, on by default): a `GenerationProbe`
  (rollout/gen_probe.py) wraps vLLM's request adding, engine steps, scheduler and multimodal processor
  and keeps where each generate call's time went as `last_breakdown`, without synchronizing the GPU; the
  trainer logs a step's sums as perf/gen_*.
- Continuous turns (`rollout.continuous_turns`): `generate_continuing` adds requests through vLLM's own
  `_add_completion_requests` and runs `llm_engine.step()` itself, so requests that follow from the ones that
  finished in a step join the running batch at once, as do those its `poll` hands over once their tool calls
  are done (the loop waits on `poll` only when no request is left running); each finished request is
  checked and converted as in `generate`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import socket
import time
import weakref
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from data.images import image_key
from models.family import FAMILIES, FamilyAdapter, build_adapter
from rollout.base import Engine, Generation, PromptInput, SamplingParams
from rollout.colocation import kv_bytes_per_token
from rollout.weight_names import FUSED_EXPERT_PARAMS, ExpertShard, VLLMSkips, vllm_load_name, vllm_names, vllm_param_for

log = logging.getLogger(__name__)

BAN_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]
_GIB = 1024**3


def read_config(model_path: str | os.PathLike) -> dict:
    """A checkpoint folder's config.json, its `model_type` checked as a supported family."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"VLLMEngine: no config.json in model folder {model_path}")
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("model_type") not in FAMILIES:
        raise ValueError(
            f"VLLMEngine: {path} has model_type {config.get('model_type')!r}; supported: {sorted(FAMILIES)}"
        )
    return config


def _load_adapter(model_path):
    """The family adapter of a model folder, for an engine built without the policy's adapter."""
    from transformers import AutoConfig

    return build_adapter(AutoConfig.from_pretrained(str(model_path), local_files_only=True))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_launcher_env() -> None:
    """Set what external_launcher reads: torchrun's variables, or a world of one without torchrun."""
    # The engine core must live in this process: external_launcher asserts it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Tensor-parallel all-reduce through NCCL alone: vLLM's symmetric-memory all-reduce allocates its
    # own buffers beside the trainer's and wants NVLink multicast, which shared hosts turn off.
    os.environ.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError(
            "VLLMEngine: torch.distributed is initialized but RANK/LOCAL_RANK are not set; "
            "launch with torchrun so the engine can join the process group"
        )
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def engine_env(family_env: dict[str, str], startup_plan: bool) -> dict[str, str]:
    """The environment an engine is built in: the family's, and with `startup_plan` vLLM's
    VLLM_ENABLE_STARTUP_PLAN (rollout.engine_startup_plan): vLLM then keeps its memory profile's KV-cache
    size under ~/.cache/vllm/startup_plan, keyed by a fingerprint of the config, device and versions, and
    a later build with that fingerprint and at least as much free memory skips the profiling."""
    return {**family_env, **({"VLLM_ENABLE_STARTUP_PLAN": "1"} if startup_plan else {})}


# Names vLLM 0.26's pixtral module (imported by its LLaVA module) takes from transformers, which
# transformers 5.17 removed. They serve Pixtral vision towers only, never LLaVA's CLIP/SigLIP.
_PIXTRAL_NAMES = ("PixtralRotaryEmbedding", "position_ids_in_meshgrid")


def apply_vllm_env(env: dict[str, str]) -> None:
    """Set the environment for the engine about to be built (the family's `FamilyAdapter.vllm_env`, and
    the engine's own switches) and drop vLLM's cache of its variables: an engine built earlier in this
    process froze them."""
    for key, value in env.items():
        if os.environ.get(key) != value:
            log.info("VLLMEngine: %s=%s (was %s)", key, value, os.environ.get(key))
        os.environ[key] = value
    if env:
        try:
            import vllm.envs
        except ImportError:
            return
        vllm.envs.disable_envs_cache()


def vllm_compat(family: str) -> list[str]:
    """Let vLLM 0.26 build `family` with the installed transformers; returns what was patched.

    For LLaVA on transformers >= 5.17 the two removed Pixtral names get placeholders that raise if
    used, in this process only, and vLLM's LLaVA class is registered in-process: vLLM would
    otherwise inspect it in a fresh subprocess, which fails on the same import.
    """
    if family != "llava":
        return []
    import transformers.models.pixtral.modeling_pixtral as pixtral

    patched = []
    for name in _PIXTRAL_NAMES:
        if not hasattr(pixtral, name):
            def removed(*args, _name=name, **kwargs):
                raise RuntimeError(f"transformers {_name} was removed in transformers 5.17; vLLM's Pixtral "
                                   "tower needs transformers <= 5.16")

            setattr(pixtral, name, removed)
            patched.append(f"transformers pixtral.{name}")
    if patched:
        from vllm import ModelRegistry
        from vllm.model_executor.models.llava import LlavaForConditionalGeneration

        ModelRegistry.register_model("LlavaForConditionalGeneration", LlavaForConditionalGeneration)
        patched.append("vLLM's LLaVA class registered in-process")
    return patched


@contextlib.contextmanager
def _preserved_rng(device: int):
    """Restore Python, numpy and torch (CPU and this rank's GPU) RNG states on exit."""
    py_state, np_state, cpu_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        torch.cuda.set_rng_state(cuda_state, device)


@contextlib.contextmanager
def _sampling_rng(seed: int, device: int | None):
    """Seed this GPU's generator and numpy's global one for one generate call, leaving the caller's streams
    untouched. vLLM 0.26's V2 model runner gives every unseeded request a seed drawn from numpy's global
    generator (v1/worker/gpu/sample/states.py `add_request`), the V1 runner samples from the CUDA generator:
    both are seeded here, so each rank of a tensor-parallel group draws the same tokens and a run repeats."""
    state = np.random.get_state()
    np.random.seed(seed % 2**32)
    try:
        with torch.random.fork_rng(devices=[] if device is None else [device]):
            if device is not None:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
            yield
    finally:
        np.random.set_state(state)


# What `rollout.engine_warmup` makes of vLLM 0.26's kernel warm-up for the V2 model runner
# (gpu_worker.compile_or_warm_up_model → v1/worker/gpu/warmup.py `warmup_kernels`: a prefill of
# max_num_seqs dummy requests with `SamplingParams.for_sampler_warmup()`, which turns on every sampler
# feature (penalties, bad words, min-p, top-k/top-p, prompt logprobs, 5 logprobs), plus a grammar
# bitmask, then a decode step). It only compiles and loads kernels: the KV blocks it writes belong to
# no request, and vLLM reseeds its generators after it. On the 3B recipe 13 s passed between the end of
# CUDA-graph capture and the end of warm-up, where this runs (V1-runner engines: under 1 s there).
#   full: vLLM's own warm-up, every kernel any request could use.
#   lean: the same prefill and decode, sampled the way this engine's `generate` samples (temperature,
#         the banned-token bias, the sampled token's logprob, no grammar): the kernels a rollout runs.
#   off:  none; each kernel compiles when a rollout first needs it (vLLM's JIT monitor names them).
WARMUP_MODES = ("full", "lean", "off")


@contextlib.contextmanager
def _sampler_warmup_params(params):
    """vLLM's `SamplingParams.for_sampler_warmup()` returns `params` inside the block."""
    from vllm import SamplingParams as VLLMSamplingParams

    original = VLLMSamplingParams.__dict__["for_sampler_warmup"]
    VLLMSamplingParams.for_sampler_warmup = staticmethod(lambda: params)
    try:
        yield
    finally:
        VLLMSamplingParams.for_sampler_warmup = original


@contextlib.contextmanager
def kernel_warmup(mode: str, lean_params, times: dict):
    """While an engine is built: run the V2 model runner's kernel warm-up as `mode` says (WARMUP_MODES)
    and put its seconds in `times["warmup_s"]`. `lean_params` (a vLLM SamplingParams) is what the lean
    warm-up samples with. The V1 model runner has no such warm-up; then nothing is timed."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"VLLMEngine: engine_warmup={mode!r}; expected one of {WARMUP_MODES}")
    try:
        from vllm.v1.worker import gpu_worker
    except ImportError:  # a vLLM without the V2 worker: nothing to time or change
        yield
        return
    original = gpu_worker.warmup_kernels

    def warmup(model_runner, execute_model, sample_tokens):
        start = time.monotonic()
        try:
            if mode == "full":
                original(model_runner, execute_model, sample_tokens)
            elif mode == "lean":
                with _sampler_warmup_params(lean_params):
                    # no grammar bitmask: rollouts never use structured output
                    original(model_runner, execute_model, lambda grammar_output: sample_tokens(None))
        finally:
            times["warmup_s"] = time.monotonic() - start

    gpu_worker.warmup_kernels = warmup  # gpu_worker looks the name up when it warms up
    try:
        yield
    finally:
        gpu_worker.warmup_kernels = original


def _mix_seed(*values: int) -> int:
    digest = hashlib.blake2b(",".join(str(v) for v in values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _check_sampling(params: SamplingParams) -> None:
    if params.n < 1 or params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams: n={params.n} and max_new_tokens={params.max_new_tokens} must be >= 1")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise ValueError(
            f"SamplingParams: temperature={params.temperature} must be >= 0 and top_p={params.top_p} in (0, 1]"
        )
    if params.temperature == 0 and params.n > 1:
        raise ValueError(f"SamplingParams: greedy decoding (temperature=0) gives one response, not n={params.n}")


def _sampled_logprobs(tokens: list[int], logprobs) -> list[float]:
    """The logprob of each sampled token, from vLLM's per-position logprobs (flat or dict form)."""
    count = 0 if logprobs is None else len(logprobs)
    if count != len(tokens):
        raise RuntimeError(f"vLLM returned logprobs for {count} of {len(tokens)} sampled tokens")
    if not hasattr(logprobs, "start_indices"):
        return [position[token].logprob for position, token in zip(logprobs, tokens)]
    values = []  # FlatLogprobs: parallel lists instead of one dict per token
    for pos, token in enumerate(tokens):
        span = range(logprobs.start_indices[pos], logprobs.end_indices[pos])
        value = next((logprobs.logprobs[j] for j in span if logprobs.token_ids[j] == token), None)
        if value is None:
            raise RuntimeError(f"vLLM returned no logprob for sampled token {token} at position {pos}")
        values.append(value)
    return values


def engine_routes(prompt_routes, completion_routes, prompt_len: int, gen_len: int) -> torch.Tensor:
    """vLLM's routing of one completion as (prompt_len + gen_len, MoE layers, k) int16 expert ids, -1 where
    it reports none. vLLM reports the prompt's at the request level (`prompt_routed_experts`) and the
    response's per completion (`routed_experts`), which may lack the last sampled token (never run); a
    completion array that already covers the prompt (no request-level one) is taken as the whole sequence."""
    import numpy as np

    if completion_routes is None:
        raise RuntimeError("vLLM returned no routed_experts for algorithm.routing_replay (it needs "
                           "enable_return_routed_experts, the V2 model runner and prefix caching on)")
    as_ids = lambda a: torch.from_numpy(np.asarray(a).astype(np.int16))  # noqa: E731
    rows = [as_ids(completion_routes)]
    if prompt_routes is not None:
        rows.insert(0, as_ids(prompt_routes))
    elif rows[0].shape[0] < prompt_len:
        raise RuntimeError(f"vLLM reported routing for {rows[0].shape[0]} tokens and none for the prompt of "
                           f"{prompt_len} tokens")
    routes = torch.cat(rows)
    total = prompt_len + gen_len
    if routes.ndim != 3 or routes.shape[0] > total:
        raise RuntimeError(f"vLLM's routing has shape {tuple(routes.shape)} for {prompt_len} prompt and {gen_len} "
                           "response tokens")
    return torch.cat([routes, routes.new_full((total - routes.shape[0], *routes.shape[1:]), -1)])


def _vllm_sampling_params(params: SamplingParams, seed: int | None):
    """vLLM's SamplingParams for `params` with this seed: the sampled token's logprob only, no detokenizing."""
    from vllm import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        max_tokens=params.max_new_tokens,
        stop_token_ids=[int(t) for t in params.stop_token_ids],
        ignore_eos=True,
        logit_bias={int(t): BAN_BIAS for t in params.banned_token_ids} or None,
        logprobs=0,  # the sampled token's logprob only
        flat_logprobs=True,
        detokenize=False,
        seed=seed,
    )


def _check_requests(requests) -> None:
    """`generate_continuing`'s requests: one response each (n=1), sampling params in range."""
    for key, _, params in requests:
        if params.n != 1:
            raise ValueError(f"VLLMEngine.generate_continuing: request {key!r} asks for n={params.n} responses; "
                             "each request is one response (n=1): send an episode's samples as separate requests")
        _check_sampling(params)


class _ContinuingRun:
    """The requests of one `VLLMEngine.generate_continuing` call: what each vLLM request stands for, its tallies
    and timings. vLLM 0.26's `_add_completion_requests` returns its internal request ids (the external id, a
    counter, then '-' and 8 random characters) while its outputs carry the external id: requests are found by
    the external one and aborted by the internal one."""

    def __init__(self, engine):
        self.engine = engine
        # external request id -> (internal id, index, key, prompt) of each request not finished yet
        self.waiting: dict[str, tuple[str, int, object, PromptInput]] = {}
        self.ready: list = []  # requests follow or poll returned, held until `flush` adds them
        self.added = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.times = {"add_s": 0.0, "steps_s": 0.0, "follow_s": 0.0, "poll_s": 0.0, "tool_wait_s": 0.0}

    def add(self, requests) -> None:
        requests = list(requests)
        _check_requests(requests)
        if not requests:
            return
        prompts = [self.engine._vllm_prompt(self.added + i, prompt) for i, (_, prompt, _) in enumerate(requests)]
        sampling = [_vllm_sampling_params(params, params.seed) for _, _, params in requests]
        start = time.perf_counter()
        ids = self.engine._llm._add_completion_requests(prompts, sampling, use_tqdm=False)
        self.times["add_s"] += time.perf_counter() - start
        if len(ids) != len(requests):
            raise RuntimeError(f"vLLM added {len(ids)} requests for {len(requests)} prompts")
        for internal, (key, prompt, _) in zip(ids, requests):
            self.waiting[internal.split("-", 1)[0]] = (internal, self.added, key, prompt)
            self.added += 1
            self.prompt_tokens += len(prompt.input_ids)

    def hold(self, requests) -> None:
        self.ready += list(requests)

    def flush(self, add_batch: int, force: bool = False) -> None:
        """Add the held requests when there are `add_batch` of them, when they are at least as many as the
        requests still running (the batch would otherwise drain while they wait), or with `force`."""
        if self.ready and (force or len(self.ready) >= min(add_batch, max(len(self.waiting), 1))):
            requests, self.ready = self.ready, []
            self.add(requests)

    def step(self) -> list[tuple[object, Generation]]:
        """One engine step; the requests that finished in it as (key, Generation), in vLLM's order."""
        start = time.perf_counter()
        outputs = self.engine._llm.llm_engine.step()
        self.times["steps_s"] += time.perf_counter() - start
        finished = []
        for out in outputs:
            if not out.finished:
                continue
            if out.request_id not in self.waiting:
                raise RuntimeError(f"vLLM finished request {out.request_id!r}, which this call did not add")
            _, index, key, prompt = self.waiting.pop(out.request_id)
            self.cached_tokens += int(getattr(out, "num_cached_tokens", 0) or 0)
            (generation,) = self.engine._generations(index, prompt, out, 1)
            finished.append((key, generation))
        return finished

    def follow(self, follow: Callable, finished: list) -> list:
        start = time.perf_counter()
        try:
            return list(follow(finished) or [])
        finally:
            self.times["follow_s"] += time.perf_counter() - start

    def poll(self, poll: Callable, wait: bool) -> bool:
        """Hold the requests `poll(wait)` returns; whether the caller still has some pending."""
        start = time.perf_counter()
        try:
            requests, pending = poll(wait)
        finally:
            self.times["tool_wait_s" if wait else "poll_s"] += time.perf_counter() - start
        self.hold(requests or [])
        return bool(pending)

    def abort(self) -> None:
        """Abort this call's unfinished requests (after an error), so the next call starts with none."""
        internal = [v[0] for v in self.waiting.values()]
        self.waiting.clear()
        if internal:
            try:
                self.engine._llm.llm_engine.abort_request(internal, internal=True)
            except Exception as e:  # the error that stopped the call is the one to raise
                log.warning("VLLMEngine.generate_continuing: aborting %d requests failed (%s: %s)",
                            len(internal), type(e).__name__, e)

    def breakdown(self, report: dict) -> dict:
        """The probe's report with this call's own add and step seconds where the probe has none (it times
        `_run_engine`, which this call does not run), follow_s, poll_s and tool_wait_s."""
        for key in ("add_s", "steps_s"):
            if not report.get(key):
                report[key] = round(self.times[key], 3)
        for key in ("follow_s", "poll_s", "tool_wait_s"):
            report[key] = round(self.times[key], 3)
        return report


def _finish_reason(reason: str | None) -> str:
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a response with reason {reason!r}; expected 'stop' or 'length'")
    return reason


# --- reading parameters back (runs inside the engine's worker, on the model) -------------------


def _gather(t: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    if tp == 1:
        return t
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(t.contiguous(), dim)


def _qkv_part(module, data: torch.Tensor, shard: str, tp: int) -> torch.Tensor:
    """The full q, k or v tensor of a QKVParallelLinear parameter, from this rank's [q_r; k_r; v_r]."""
    q = module.num_heads * module.head_size
    k = module.num_kv_heads * module.head_size
    v = module.num_kv_heads * module.v_head_size
    start, size = {"q": (0, q), "k": (q, k), "v": (q + k, v)}[shard]
    full = _gather(data.narrow(0, start, size), 0, tp)
    replicas = getattr(module, "num_kv_head_replicas", 1)
    if shard != "q" and replicas > 1:
        # More ranks than kv heads: consecutive ranks hold copies of the same head.
        full = torch.cat(full.chunk(tp, 0)[::replicas], 0)
    return full


def _expert_tensor(module, attr: str, data: torch.Tensor, shard: ExpertShard | None) -> torch.Tensor:
    """The checkpoint-shaped experts behind a vLLM FusedMoE parameter (RoutedExperts' w13_weight or
    w2_weight): all of a layer's experts as transformers 5 holds them (gate_up_proj (E, 2·I, H),
    down_proj (E, H, I)), or one expert's gate, up or down projection of a hub file.

    Each rank holds its slice of the intermediate dimension: [gate_r; up_r] rows of w13, columns
    of w2, possibly padded past the checkpoint's sizes, which are cut off before gathering.
    """
    parallel = module.moe_config.moe_parallel_config
    if parallel.use_ep or parallel.dp_size > 1:
        raise NotImplementedError(
            f"read_weights: {attr} of {module.layer_name} is split across expert-parallel or data-parallel "
            f"ranks (use_ep={parallel.use_ep}, dp_size={parallel.dp_size}); only tensor parallelism is read back")
    tp = parallel.tp_size
    hidden = module.moe_config.hidden_dim_unpadded
    inter = module.moe_config.intermediate_size_per_partition_unpadded
    # one expert's projection is sliced before gathering: a hub file's per-expert names would otherwise
    # gather the whole layer once per expert
    if attr == "w2_weight":
        down = data[:, :hidden, :inter]
        return _gather(down, 2, tp) if shard is None else _gather(down[shard.expert], 1, tp)
    half = data.shape[1] // 2  # w1 rows, then w3 rows (FusedMoE's gated layout)
    gate, up = data[:, :inter, :hidden], data[:, half : half + inter, :hidden]
    if shard is None:
        return torch.cat([_gather(gate, 1, tp), _gather(up, 1, tp)], 1)
    return _gather((gate if shard.part == "w1" else up)[shard.expert], 0, tp)


def _full_tensor(module, attr: str, data: torch.Tensor, shard) -> torch.Tensor:
    """The checkpoint-shaped tensor behind one vLLM parameter (or one shard of a stacked one)."""
    if attr in FUSED_EXPERT_PARAMS and hasattr(module, "moe_config"):
        return _expert_tensor(module, attr, data, shard)
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tp = getattr(module, "tp_size", 1)
    if isinstance(module, VocabParallelEmbedding):
        # Rows are padded to a multiple of 64 per rank; the checkpoint's rows come first.
        indices = module.shard_indices
        return _gather(data[: indices.org_vocab_end_index - indices.org_vocab_start_index], 0, tp)
    if isinstance(module, QKVParallelLinear):
        if shard is None:  # fused on both sides (Qwen2.5-VL vision attn.qkv)
            return torch.cat([_qkv_part(module, data, s, tp) for s in ("q", "k", "v")], 0)
        return _qkv_part(module, data, shard, tp)
    if isinstance(module, MergedColumnParallelLinear) and shard is not None:
        sizes = [s // tp for s in module.output_sizes]
        parts = shard if isinstance(shard, tuple) else (shard,)  # Qwen3.5's in_proj_qkv fills (0, 1, 2)
        return torch.cat([_gather(data.narrow(0, sum(sizes[:p]), sizes[p]), 0, tp) for p in parts])
    if isinstance(module, RowParallelLinear):
        return _gather(data, 1, tp) if attr == "weight" else data
    if isinstance(module, ColumnParallelLinear):
        return _gather(data, 0, tp)
    return data


def _read_params(model, targets: list[tuple[str, str, object]]) -> dict[str, torch.Tensor]:
    """{transformers name: CPU copy of the engine's tensor} for (hf name, vLLM name, shard) targets."""
    out = {}
    for hf_name, vllm_name, shard in targets:
        module_path, _, attr = vllm_name.rpartition(".")
        try:
            module = model.get_submodule(module_path)
        except AttributeError as err:
            raise KeyError(f"read_weights: {hf_name} maps to {vllm_name}, which the engine's model lacks") from err
        param = getattr(module, attr, None)
        if not isinstance(param, torch.Tensor):
            raise KeyError(f"read_weights: {hf_name} maps to {vllm_name}, which the engine's model lacks")
        out[hf_name] = _full_tensor(module, attr, param.data, shard).to("cpu", copy=True)
    return out


# Families vLLM 0.26 runs with bidirectional attention over image tokens (its `is_mm_prefix_lm`;
# `VLLMNames.mm_prefix` in the family's module),
# through FlexAttention, whose metadata builder allocates a (max_num_seqs, KV blocks) int64 map on
# every step: 1024 rows on an H200. Models with little KV per token get millions of blocks from
# gpu_memory_utilization alone (the tiny Gemma3 asked for 279 GiB at 0.5), so the engine caps
# their KV cache where that map would pass FLEX_BLOCK_MAP_BYTES.
FLEX_BLOCK_MAP_BYTES = 256 * 1024**2
FLEX_MAX_NUM_SEQS = 1024  # vLLM 0.26's LLM default on GPUs with >= 70 GiB (256 below)
KV_BLOCK_TOKENS = 16  # vLLM's default block size; larger blocks only shrink the map


def flex_kv_cap_bytes(config: dict, dtype_bytes: int, gpu_memory_utilization: float,
                      device_bytes: int, tensor_parallel_size: int = 1) -> int | None:
    """The KV-cache bytes per GPU to give vLLM for a FlexAttention family, or None when no cap is needed.

    The cap holds the block map at FLEX_BLOCK_MAP_BYTES; it is returned only when it is below what
    gpu_memory_utilization could give the KV cache at most, which for released models it is not
    (Gemma3-4B: 139 KB per token, so the cap is 73 GB of KV, above 0.5 of an H200).
    """
    spec = FAMILIES.get(config.get("model_type"))
    if spec is None or not spec.vllm.mm_prefix:
        return None
    blocks = FLEX_BLOCK_MAP_BYTES // (FLEX_MAX_NUM_SEQS * 8)
    cap = blocks * KV_BLOCK_TOKENS * kv_bytes_per_token(config, dtype_bytes, tensor_parallel_size)
    return cap if cap < gpu_memory_utilization * device_bytes else None


def head_is_embedding(model, family: str) -> bool:
    """Whether vLLM's `model` ties lm_head to embed_tokens (then its load_weights skips lm_head.*)."""
    head = vllm_param_for(family, "lm_head.weight")[0].rpartition(".")[0]
    embed_name = vllm_names(family).embed_tokens
    embed = vllm_param_for(family, embed_name)[0].rpartition(".")[0]
    return model.get_submodule(head) is model.get_submodule(embed)


def refit_stream(family: str, skips: VLLMSkips, tied: bool, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 expected: set[str], skipped: dict[str, str]):
    """(name vLLM's load_weights reads, tensor) for each transformers-named tensor, filling as it goes
    `expected` (the vLLM parameters the name table says get loaded) and `skipped` ({name: reason} for
    tensors vLLM builds no parameter for). Runs inside the engine, and in the CPU load check."""
    lm_head = vllm_param_for(family, "lm_head.weight")[0]
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"refit: {name} is a {type(tensor).__name__}, not a torch.Tensor")
        param = vllm_param_for(family, name)[0]
        reason = skips.reason(family, name)
        if reason is not None:
            # Still handed over: vLLM drops it, and if a vLLM version did load it the refit's check
            # reports the table as wrong instead of leaving that tensor stale.
            skipped[name] = reason
        elif not (tied and param == lm_head):
            expected.add(param)
        # detach(): vLLM tags the tensor it is given with a shard id; keep the caller's clean.
        yield vllm_load_name(family, name), tensor.detach()


# Children that load the weights their parent module is handed and report names relative to
# themselves: vLLM 0.26's MoERunner (`mlp.experts`) passes its weights to RoutedExperts
# (`mlp.experts.routed_experts`), whose `load_weights` yields `w13_weight`; AutoWeightsLoader then
# prefixes the runner's path, so the loaded expert parameters come back as `...mlp.experts.w13_weight`.
_REPORTING_CHILDREN = ("routed_experts",)


def _reported_tensor(name: str, tensors: set[str]) -> str | None:
    """The model's tensor a name reported by `load_weights` stands for: itself, the same name under a
    child in `_REPORTING_CHILDREN`, or None when it names nothing in the model."""
    if name in tensors:
        return name
    path, _, attr = name.rpartition(".")
    for child in _REPORTING_CHILDREN:
        inner = f"{path}.{child}.{attr}" if path else f"{child}.{attr}"
        if inner in tensors:
            return inner
    return None


def load_into(model, stream) -> set[str]:
    """vLLM's `model.load_weights(stream)`: the parameters and buffers of the model it reports loaded.

    vLLM 0.26's Gemma4 text model (gemma4.py `Gemma4Model.load_weights`) reports a stacked tensor
    under the fused parameter's name and under its own (q_proj, gate_proj, ...), which names nothing
    in the model and is dropped. vLLM's FusedMoE layers (Qwen3.5-MoE's experts) report what they loaded
    one module short (`_REPORTING_CHILDREN`), which is resolved to the parameter. An unexpected name
    that is a real parameter still fails `check_loaded`.
    """
    loaded = set(model.load_weights(stream))
    tensors = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tensors |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return {t for t in (_reported_tensor(n, tensors) for n in loaded) if t is not None}


def check_loaded(loaded: set[str], expected: set[str]) -> None:
    """Raise unless vLLM's load_weights loaded exactly the parameters the name table predicts."""
    if loaded != expected:
        missing, extra = sorted(expected - loaded), sorted(loaded - expected)
        raise RuntimeError(
            f"refit: vLLM did not load {missing[:5]} ({len(missing)} in all) and loaded unexpected "
            f"{extra[:5]} ({len(extra)} in all); rollout/weight_names.py disagrees with this vLLM version"
        )


def processor_cache(adapter: FamilyAdapter, cache_gb: float, max_videos_per_prompt: int) -> float:
    """The multimodal processor cache (GiB) to give vLLM: `cache_gb`, or 0 where the family's prompts of
    that many videos would get wrong or failing results from it (`vllm_processor_cache_safe`)."""
    if cache_gb and not adapter.vllm_processor_cache_safe(max_videos_per_prompt):
        log.warning("VLLMEngine: processor cache off (rollout.processor_cache_gb=%s ignored): %s prompts of up "
                    "to %d videos cannot use it in vLLM 0.26", cache_gb, adapter.name, max_videos_per_prompt)
        return 0.0
    return cache_gb


def skip_empty_hf_calls(mm_processor) -> bool:
    """Make vLLM's multimodal processor skip the HF processor call for a request whose items are all
    served by the processor cache; False where the processor lacks the method (another vLLM).

    On a cache hit vLLM 0.26 runs `_apply_hf_processor_mm_only` over the missing items only; with none
    missing, a processor that overrides `_call_hf_processor` still calls the HF processor on dummy text
    (`_apply_hf_processor_text_mm`) and keeps only the fields of `_get_mm_fields_config`, which are empty
    for zero items. An empty `BatchFeature` gives the same empty fields without the call."""
    original = getattr(mm_processor, "_apply_hf_processor_mm_only", None)
    if original is None:
        return False
    if getattr(original, "_vlrl_skips_empty", False):
        return True

    def mm_only(mm_items, hf_processor_mm_kwargs, tokenization_kwargs):
        if not any(mm_items.get_all_counts().values()):
            from transformers import BatchFeature

            return BatchFeature({})
        return original(mm_items, hf_processor_mm_kwargs, tokenization_kwargs)

    mm_only._vlrl_skips_empty = True
    mm_processor._apply_hf_processor_mm_only = mm_only
    return True


def fast_placeholder_search(mm_processor) -> bool:
    """Make vLLM's multimodal processor find placeholder runs by jumping between candidate positions;
    False where the processor lacks `_find_mm_placeholders` (another vLLM).

    vLLM 0.26's `_iter_placeholders` walks the prompt one position at a time and, at each, compares the
    slice of each candidate run's length (an image's full run) with the run. Until a run is found the
    candidates stay the same, and a position whose token starts none of them cannot match, so the walk
    may jump to the next position holding a candidate's first token (`list.index`); every position it
    compares, it compares as vLLM does, in vLLM's order: the same runs, offsets and embed masks."""
    if not hasattr(mm_processor, "_find_mm_placeholders"):
        return False
    if getattr(mm_processor._find_mm_placeholders, "_vlrl_jumps", False):
        return True
    from vllm.multimodal.processing import processor as processing

    def find(new_token_ids, mm_prompt_updates):
        tokenizer = mm_processor.info.get_tokenizer()
        found = _placeholders_by_jumps(processing, new_token_ids, mm_prompt_updates, tokenizer)
        return dict(processing.full_groupby_modality(found))

    find._vlrl_jumps = True
    mm_processor._find_mm_placeholders = find
    return True


def _placeholders_by_jumps(processing, prompt: list[int], mm_prompt_updates, tokenizer):
    """vLLM 0.26's `_iter_placeholders` (vllm/multimodal/processing/processor.py) with the jumps of
    `fast_placeholder_search`."""
    counts = {m: len(items) for m, items in mm_prompt_updates.items()}
    next_item = dict.fromkeys(mm_prompt_updates, 0)
    size, start = len(prompt), 0
    while start < size and any(next_item[m] < counts[m] for m in counts):
        candidates = [(m, update, processing._seq2tokens(tokenizer, update.content.full))
                      for m, updates in mm_prompt_updates.items() if next_item[m] < counts[m]
                      for update in updates[next_item[m]]]
        firsts = {tokens[0] for _, _, tokens in candidates if tokens}
        start = min((_index(prompt, t, start) for t in firsts), default=size)
        while start < size:
            match = next(((m, u, tokens) for m, u, tokens in candidates if tokens and start + len(tokens) <= size
                          and prompt[start:start + len(tokens)] == tokens), None)
            if match is None:
                start += 1
                start = min((_index(prompt, t, start) for t in firsts), default=size)
                continue
            modality, update, tokens = match
            is_embed = update.content.is_embed
            yield processing.PlaceholderFeaturesInfo(
                modality=modality, item_idx=next_item[modality], start_idx=start, tokens=tokens,
                is_embed=None if is_embed is None else is_embed(tokenizer, update.content.full))
            start += len(tokens)
            next_item[modality] += 1
            break


def _index(ids: list[int], token: int, start: int) -> int:
    """The first position >= start holding `token`, or len(ids)."""
    try:
        return ids.index(token, start)
    except ValueError:
        return len(ids)


class ImageKeys:
    """`image_key` of each image object, computed once: an episode sends the same image objects every
    turn (its prompt's, shared by the prompt's n episodes, and its tools'), so each later turn costs a
    dictionary look-up per image instead of hashing megabytes. Images handed to an engine are never
    modified in place (episodes keep them as the model saw them). Entries go when their image is freed."""

    def __init__(self):
        self._keys: dict[int, tuple[weakref.ref, str]] = {}
        self.computed = 0  # keys hashed so far (the rest were look-ups)

    def __len__(self) -> int:
        return len(self._keys)

    def __call__(self, image) -> str:
        entry = self._keys.get(id(image))
        if entry is not None and entry[0]() is image:
            return entry[1]
        key = image_key(image)
        self.computed += 1
        ident = id(image)

        def forget(ref, ident=ident):
            if self._keys.get(ident, (None,))[0] is ref:
                del self._keys[ident]

        self._keys[ident] = (weakref.ref(image, forget), key)
        return key


def uncompiled_config(cuda_graphs: bool = False) -> dict | None:
    """vLLM's compilation config with torch.compile off, in the installed version's field names (`mode` or the
    older `level`, 0: no compilation), and CUDA graphs off, or with `cuda_graphs` whole-model graphs for decode
    steps only (FULL_DECODE_ONLY: no compilation needed, prefills stay eager); None without vLLM. enforce_eager
    alone turns off only the CUDA graphs in some versions. Used by `rollout.engine_compile=false` and exact mode."""
    try:
        import dataclasses

        from vllm.config import CompilationConfig
    except ImportError:
        return None
    names = {f.name for f in dataclasses.fields(CompilationConfig)}
    config = {key: 0 for key in ("mode", "level") if key in names}
    if "cudagraph_mode" in names:
        config["cudagraph_mode"] = "FULL_DECODE_ONLY" if cuda_graphs else "NONE"
    elif cuda_graphs:
        raise RuntimeError("decode-step CUDA graphs without compilation (rollout.engine_compile=false, "
                           "rollout.exact_cuda_graphs=true) need a vLLM whose CompilationConfig has cudagraph_mode "
                           "(0.10 and later); set rollout.enforce_eager=true, or leave those keys at their defaults")
    return config or None


def _merged_compilation(*parts: dict) -> dict:
    """Keyword arguments of `vllm.LLM` from several sources, later ones winning, with their `compilation_config`
    dicts merged key by key (the graph sizes matched to the batch and exact mode's compilation switches)."""
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            if key == "compilation_config" and isinstance(merged.get(key), dict) and isinstance(value, dict):
                value = {**merged[key], **value}
            merged[key] = value
    return merged


def _then_head_dtype(family_override, dtype: str, config):
    """A family's callable `hf_overrides`, then `head_dtype` set on the config it returns."""
    config = family_override(config)
    config.update({"head_dtype": dtype})  # what vLLM does with a dict override's plain keys
    return config


def with_head_dtype(engine_kwargs: dict, dtype: str) -> dict:
    """The family's extra `vllm.LLM` arguments with `head_dtype` added to its `hf_overrides` (model.fp32_logits):
    a dict override gains the key, a callable one (Gemma4's) is followed by setting it, none becomes the key alone."""
    family = engine_kwargs.get("hf_overrides")
    if family is None:
        overrides = {"head_dtype": dtype}
    elif callable(family):
        overrides = functools.partial(_then_head_dtype, family, dtype)
    else:
        overrides = {**family, "head_dtype": dtype}
    return {**engine_kwargs, "hf_overrides": overrides}


# VLLMEngine's switches on vLLM's multimodal processor: (attribute and constructor argument, the change)
MM_PROCESSOR_CHANGES = (("skip_empty_hf_calls", skip_empty_hf_calls),
                        ("fast_placeholder_search", fast_placeholder_search))


class VLLMEngine(Engine):
    """Rollouts with vLLM in this process; sleeps to give the GPU to training; takes weights by refit."""

    max_videos_per_prompt: int = 0  # vLLM's video limit per prompt (the datasets' most videos in a row)
    reads_pixel_values = False  # vLLM processes the images itself: prompts need no processor outputs
    mm_uuids = False  # name images by content key (`image_key`); False: vLLM hashes each image per request
    skip_empty_hf_calls = False  # no HF processor call for a request whose images all hit the processor cache
    fast_placeholder_search = False  # vLLM's placeholder search jumps to candidate positions
    _engine_warmup = "off"  # rollout.engine_warmup (WARMUP_MODES)
    _fp32_logits = False  # model.fp32_logits: the lm_head's logits with fp32 output (head_dtype=float32)
    _compile = True  # rollout.engine_compile: vLLM's torch.compile of the model (false: decode graphs, no compile)
    _probe = None  # rollout.gen_breakdown: the GenerationProbe on this engine's vLLM objects
    last_breakdown: dict = {}  # where the last generate call's time went (rollout/gen_probe.py); {} without a probe

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        max_model_len: int,
        seed: int,
        dtype: str = "bfloat16",
        min_pixels: int,
        max_pixels: int,
        image_pad_id: int,
        adapter: FamilyAdapter | None = None,
        max_images_per_prompt: int = 1,
        max_videos_per_prompt: int = 0,
        async_scheduling: bool | None = None,
        max_num_seqs: int | None = None,
        sleep_level: int = 1,
        processor_cache_gb: float = 4.0,
        mm_uuids: bool = False,
        skip_empty_hf_calls: bool = False,
        fast_placeholder_search: bool = False,
        return_routed_experts: bool = False,
        fp32_logits: bool = False,
        exact=None,
        attention_backend: str = "auto",
        engine_warmup: str = "off",
        warmup_sampling: SamplingParams | None = None,
        startup_plan: bool = False,
        gen_breakdown: bool = True,
        engine_compile: bool = True,
    ):
        if not 0 < min_pixels <= max_pixels:
            raise ValueError(f"VLLMEngine: need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
        if tensor_parallel_size < 1 or max_images_per_prompt < 0 or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"VLLMEngine: bad tensor_parallel_size={tensor_parallel_size}, max_images_per_prompt="
                f"{max_images_per_prompt} or gpu_memory_utilization={gpu_memory_utilization}"
            )
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"VLLMEngine: dtype {dtype!r} must be 'bfloat16', 'float16' or 'float32'")
        if exact is not None and fp32_logits:
            raise ValueError("VLLMEngine: fp32_logits with exact mode; the exact lm_head (rollout/exact.py) is the "
                             "model dtype's, which vLLM's head_dtype=float32 path bypasses")
        config = read_config(model_path)
        self.family = config["model_type"]
        self.adapter = adapter if adapter is not None else _load_adapter(model_path)
        if image_pad_id != self.adapter.image_token_id:
            raise ValueError(f"VLLMEngine: image_pad_id={image_pad_id} is not the {self.family} image token "
                             f"{self.adapter.image_token_id} of {model_path}")
        self._skips = VLLMSkips.for_config(self.family, config)
        self._config = config
        self.skipped_in_refit = 0  # tensors of the last refit that vLLM builds no parameter for
        self.gpu_memory_utilization = gpu_memory_utilization
        self.dtype = getattr(torch, dtype)  # what refit tensors are rounded to; callers may send them so
        self.image_pad_id = image_pad_id
        self.max_images_per_prompt = max_images_per_prompt
        if max_videos_per_prompt < 0:
            raise ValueError(f"VLLMEngine: max_videos_per_prompt must be >= 0, got {max_videos_per_prompt}")
        self.max_videos_per_prompt = max_videos_per_prompt
        # None: vLLM's choice (on). external_launcher relies on every rank of a TP group scheduling
        # identically; the TP=2 pair's hang is not yet explained, and turning this off is a test of it.
        self._async_scheduling = async_scheduling
        self._max_num_seqs = max_num_seqs
        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMEngine: sleep_level must be 1 or 2, got {sleep_level}")
        self.sleep_level = sleep_level
        if processor_cache_gb < 0:
            raise ValueError(f"VLLMEngine: processor_cache_gb must be >= 0, got {processor_cache_gb}")
        self._processor_cache_gb = processor_cache(self.adapter, processor_cache_gb, max_videos_per_prompt)
        self.mm_uuids = mm_uuids  # rollout.mm_uuids
        self.skip_empty_hf_calls = skip_empty_hf_calls
        self.fast_placeholder_search = fast_placeholder_search
        self._image_keys = ImageKeys()
        self._routing = return_routed_experts  # MoE routing replay: vLLM reports each token's experts
        self._seed = seed
        self._calls = 0
        self.last_stats: dict[str, int] = {}
        self.last_breakdown = {}
        self._asleep: set[str] = set()  # vLLM memory tags currently released: "weights", "kv_cache"
        if engine_warmup not in WARMUP_MODES:
            raise ValueError(f"VLLMEngine: engine_warmup={engine_warmup!r}; expected one of {WARMUP_MODES}")
        self._engine_warmup = engine_warmup
        # what the lean warm-up samples with: the rollouts' settings, or generate's defaults
        self._warmup_sampling = warmup_sampling or SamplingParams(max_new_tokens=2, banned_token_ids=[image_pad_id])
        self.build_times: dict[str, float] = {}  # seconds of the build's parts: import_s, llm_s, warmup_s
        _ensure_launcher_env()
        start = time.monotonic()  # import_s: importing (and patching) vLLM, seconds before it logs anything
        # rollout.exact (rollout/exact.py): batch-invariant vLLM, eager, its custom ops routed to torch code
        self._exact = exact
        # model.fp32_logits: vLLM's LogitsProcessor computes the head as torch.mm(..., out_dtype=float32)
        self._fp32_logits = fp32_logits
        self._compile = engine_compile
        self._attention_backend = attention_backend  # "auto": vLLM's choice
        if exact is not None:
            from rollout import exact as exact_mode

            exact_mode.prepare_process()
            exact_mode.patch_vllm(exact.report)
            # eager, or decode steps from CUDA graphs without compilation (ExactMode.engine_kwargs)
            enforce_eager = not exact.cuda_graphs
        for patch in vllm_compat(self.family):
            log.info("VLLMEngine: %s (vLLM 0.26 with transformers >= 5.17)", patch)
        self._device = int(os.environ["LOCAL_RANK"])
        self._tp = tensor_parallel_size
        self._world = int(os.environ.get("WORLD_SIZE", "1"))
        if self._world % tensor_parallel_size:
            raise ValueError(f"VLLMEngine: tensor_parallel_size={tensor_parallel_size} does not divide the "
                             f"{self._world} ranks")
        apply_vllm_env(engine_env(self.adapter.vllm_env(), startup_plan))
        from vllm import LLM  # noqa: F401  (here, after the environment: the rest of the import is timed too)

        self.build_times["import_s"] = time.monotonic() - start
        start = time.monotonic()
        with _preserved_rng(self._device):
            self._llm = self._build_llm(
                str(model_path), tensor_parallel_size, gpu_memory_utilization, enforce_eager,
                max_model_len, seed, dtype, min_pixels, max_pixels,
            )
        self.build_times["llm_s"] = time.monotonic() - start
        if (self.adapter.vllm_env().get("VLLM_USE_V2_MODEL_RUNNER") == "0"
                and getattr(self._llm.llm_engine.vllm_config, "use_v2_model_runner", False)):
            raise RuntimeError(f"VLLMEngine: {self.family} needs vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0), "
                               "but the engine was built with the V2 runner")
        self._dp_rank = torch.distributed.get_rank() // tensor_parallel_size
        if exact is not None:
            exact_mode.enable_batch_invariance(exact.report)
            exact.report["aligned"] = self._llm.apply_model(
                lambda model: exact_mode.align_engine(model, exact.inv_freq, exact.vision_inv_freq))[0]
            # which sampler computes the reported logprobs (the policy computes its values the same way)
            v2 = getattr(self._llm.llm_engine.vllm_config, "use_v2_model_runner", False)
            exact_mode.ENGINE_SAMPLER["path"] = exact.report["sampler"] = "v2" if v2 else "v1"
            log.info("VLLMEngine: exact mode %s", exact.report)
        self._tied = self._lm_head_is_embedding()
        # The vocabulary vLLM's processor looks tokens up in (Gemma3's newline merging does).
        self._vocab = dict(self._llm.get_tokenizer().get_vocab())
        self._change_mm_processors()
        if gen_breakdown:
            self._install_probe()

    def _install_probe(self) -> None:
        """rollout.gen_breakdown: a GenerationProbe on this engine's vLLM objects (no GPU synchronization), its
        breakdown of each generate call kept as `last_breakdown`; a probe that cannot be built leaves none."""
        from rollout.gen_probe import GenerationProbe

        try:
            self._probe = GenerationProbe(self)
        except Exception as e:  # the breakdown is diagnostics: generation goes on without it
            log.warning("VLLMEngine: no generation breakdown (%s: %s)", type(e).__name__, e)
            return
        if self._probe.missing:
            log.info("VLLMEngine: the generation breakdown reads null for %s (not found in this vLLM)",
                     ", ".join(sorted(self._probe.missing)))

    def _change_mm_processors(self) -> None:
        """The request-adding switches that are on (`skip_empty_hf_calls`, `fast_placeholder_search`: the
        module's functions, which the constructor's arguments of the same names shadow there) applied to each
        multimodal processor vLLM's renderer holds."""
        renderer = getattr(self._llm.llm_engine, "renderer", None)
        processors = [getattr(renderer, attr, None) for attr in ("mm_processor", "_readonly_mm_processor")]
        for name, change in MM_PROCESSOR_CHANGES:
            if getattr(self, name) and not any([change(p) for p in processors if p is not None]):
                log.warning("VLLMEngine: rollout.%s does nothing here: no multimodal processor of this vLLM has "
                            "the method it changes (written against vLLM 0.26)", name)

    def _build_llm(self, path, tp, gpu_memory_utilization, enforce_eager, max_model_len, seed, dtype,
                   min_pixels, max_pixels):
        from vllm import LLM

        lean = self._vllm_sampling(self._warmup_sampling, 1) if self._engine_warmup == "lean" else None
        with kernel_warmup(self._engine_warmup, lean, getattr(self, "build_times", {})):
            return LLM(**self._llm_kwargs(path, tp, gpu_memory_utilization, enforce_eager, max_model_len, seed,
                                          dtype, min_pixels, max_pixels))

    def _llm_kwargs(self, path, tp, gpu_memory_utilization, enforce_eager, max_model_len, seed, dtype,
                    min_pixels, max_pixels) -> dict:
        """The arguments of `vllm.LLM` for this engine."""
        return dict(
            model=path,
            tokenizer=path,
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=tp,
            # external_launcher wants the whole torchrun world = tp × dp: the other engine groups are
            # vLLM's data-parallel ranks, each fed its own prompts (rollout/groups.py)
            **({"data_parallel_size": self._world // tp} if self._world > tp else {}),
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            dtype=dtype,
            load_format="dummy",
            enable_sleep_mode=True,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # no sampling defaults from the checkpoint's generation_config.json
            mm_processor_kwargs=self.adapter.vllm_processor_kwargs(min_pixels, max_pixels),
            # the HF processor's outputs by image content: a multi-turn episode re-sends its earlier
            # images every turn, and pixel values do not depend on the weights, so a refit leaves them valid
            mm_processor_cache_gb=self._processor_cache_gb,
            limit_mm_per_prompt={"image": self.max_images_per_prompt, "video": self.max_videos_per_prompt},
            # Tensor-parallel all-reduce through NCCL, not vLLM's CUDA-IPC kernel: with it, a TP=2
            # engine hung in warm-up on the lent 2xH200 VM (colocated RL trainers disable it too).
            disable_custom_all_reduce=True,
            **self._kv_cache_kwargs(gpu_memory_utilization, dtype),
            **({} if self._async_scheduling is None else {"async_scheduling": self._async_scheduling}),
            **self._family_kwargs(dtype),
            **({"enable_return_routed_experts": True} if self._routing else {}),
            **({"attention_config": {"backend": self._attention_backend}}
               if self._exact is None and getattr(self, "_attention_backend", "auto") != "auto" else {}),
            **_merged_compilation(self._batch_kwargs(enforce_eager), self._compile_kwargs(enforce_eager),
                                  {} if self._exact is None else self._exact.engine_kwargs(max_model_len)),
        )

    def _family_kwargs(self, dtype: str) -> dict:
        """The family's extra `vllm.LLM` arguments, with head_dtype=float32 in its hf_overrides under
        model.fp32_logits (never in exact mode: vLLM's fp32 head bypasses the lm_head exact mode patches)."""
        kwargs = self.adapter.vllm_engine_kwargs()
        if self._fp32_logits and self._exact is None and dtype != "float32":
            return with_head_dtype(kwargs, "float32")
        return kwargs

    def _kv_cache_kwargs(self, gpu_memory_utilization: float, dtype: str) -> dict:
        """`kv_cache_memory_bytes` for a FlexAttention family whose block map would not fit, else nothing."""
        device_bytes = torch.cuda.get_device_properties(self._device).total_memory
        cap = flex_kv_cap_bytes(self._config, getattr(torch, dtype).itemsize, gpu_memory_utilization, device_bytes,
                                self._tp)
        if cap is None:
            return {}
        log.info("VLLMEngine: %s KV cache capped at %.2f GiB (FlexAttention's per-step block map stays under "
                 "%d MiB)", self.family, cap / _GIB, FLEX_BLOCK_MAP_BYTES // 1024**2)
        return {"kv_cache_memory_bytes": cap}

    def _compile_kwargs(self, enforce_eager: bool) -> dict:
        """rollout.engine_compile=false: no torch.compile of the model, its decode steps replayed from whole-model
        CUDA graphs (none under enforce_eager) and prefills eager, so a machine's first engine build skips vLLM's
        compilation. Exact mode sets its own (later in the merge)."""
        if getattr(self, "_compile", True) or self._exact is not None:
            return {}
        config = uncompiled_config(cuda_graphs=not enforce_eager)
        return {} if config is None else {"compilation_config": config}

    def _batch_kwargs(self, enforce_eager: bool) -> dict:
        """Scheduler width and CUDA graph sizes matched to the rollout batch, when the caller knows it.

        vLLM's defaults (1024 sequences, graphs captured up to 512) capture graphs a rollout of
        fewer sequences never replays, at start-up time; decode batches never exceed max_num_seqs.
        """
        if not self._max_num_seqs:
            return {}
        seqs = -(-self._max_num_seqs // 8) * 8  # vLLM's capture sizes step by 8
        kwargs = {"max_num_seqs": seqs}
        if not enforce_eager:
            kwargs["compilation_config"] = {"max_cudagraph_capture_size": seqs}
        return kwargs

    def _lm_head_is_embedding(self) -> bool:
        """Whether the engine ties lm_head to embed_tokens (then vLLM skips lm_head.* in refit)."""
        return self._llm.apply_model(lambda model: head_is_embedding(model, self.family))[0]

    # --- generation ---------------------------------------------------------------------------

    def generate(self, prompts: list[PromptInput], params: SamplingParams) -> list[Generation]:
        """n responses per prompt, prompt-major, with the logprob of every sampled token."""
        if self._asleep:
            raise RuntimeError("VLLMEngine.generate: the engine is asleep; call wake() first")
        _check_sampling(params)
        self.last_breakdown = {}
        if not prompts:
            return []
        probe = self._probe
        if probe is not None:
            probe.begin()
        requests = [self._vllm_prompt(i, p) for i, p in enumerate(prompts)]
        sampling = self._vllm_sampling(params, len(prompts))
        call_seed = _mix_seed(self._seed, self._calls, self._dp_rank)
        self._calls += 1
        with _sampling_rng(call_seed, self._device):
            outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        # prompt tokens served from the prefix cache (a multi-turn episode's earlier turns)
        self.last_stats = {"prompt_tokens": sum(len(p.input_ids) for p in prompts),
                           "cached_prompt_tokens": sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs)}
        if probe is not None:
            self.last_breakdown = probe.report(self.last_stats)
        generations = []
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            generations += self._generations(i, prompt, out, params.n)
        return generations

    def _generations(self, index: int, prompt: PromptInput, out, n: int) -> list[Generation]:
        """One vLLM RequestOutput as its n Generations, in completion order, after checking the prompt ids."""
        self._check_prompt_ids(index, prompt, out.prompt_token_ids)
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} responses for prompt {index}, expected n={n}")
        generations = []
        for c in completions:
            tokens = list(c.token_ids)
            logprobs = _sampled_logprobs(tokens, c.logprobs)
            routes = engine_routes(getattr(out, "prompt_routed_experts", None), c.routed_experts,
                                   len(prompt.input_ids), len(tokens)) if self._routing else None
            generations.append(Generation(index, tokens, logprobs, _finish_reason(c.finish_reason), routes))
        return generations

    def generate_continuing(self, first, follow: Callable, poll: Callable | None = None, add_batch: int = 1) -> None:
        """Requests that continue while others decode. `first` is [(key, PromptInput, SamplingParams with n=1)];
        after each engine step `follow([(key, Generation), ...])` gets the requests that finished in it and
        returns the requests to add next in the same form (possibly none): they join the running batch at once,
        or with `add_batch` > 1 once that many are waiting to join (or at least as many as still run, or none
        runs), so that fewer engine steps mix a prefill into the decode batch (`rollout.continuous_add_batch`).
        Each request samples with its own params and seed, as one prompt of `generate` does.

        `poll(wait) -> (requests, pending)` serves requests that become ready outside the loop (an episode whose
        tool calls, started by `follow`, have finished): the requests ready since the last call, and whether
        more are still pending. It is called without waiting after every step; when no request is left running
        but some are pending it is called with `wait=True`, and then blocks until something became ready or
        nothing is pending (its requests may still be none: an episode that ended there). The loop runs while
        a request is running or, with `poll`, while the last poll said some are pending; without `poll` it
        runs until no request is left.

        The whole loop is one call for last_stats and last_breakdown, whose add_s and steps_s are timed here
        where the probe (which wraps `_run_engine`, not called here) has none; follow_s is the seconds spent
        in `follow`, poll_s in polls that do not wait and tool_wait_s in those that wait (no request left to
        decode). After an error in the loop, `follow` and `poll` included, this call's requests are aborted."""
        if self._asleep:
            raise RuntimeError("VLLMEngine.generate_continuing: the engine is asleep; call wake() first")
        first = list(first)
        _check_requests(first)
        self.last_breakdown = {}
        self.last_stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0}
        if not first:
            return
        if add_batch < 1:
            raise ValueError(f"VLLMEngine.generate_continuing: add_batch must be >= 1, got {add_batch}")
        probe = self._probe
        if probe is not None:
            probe.begin()
        run = _ContinuingRun(self)
        call_seed = _mix_seed(self._seed, self._calls, self._dp_rank)
        self._calls += 1
        with _sampling_rng(call_seed, self._device):
            try:
                run.add(first)
                pending = False
                while (running := self._llm.llm_engine.has_unfinished_requests()) or pending or run.ready:
                    if running:
                        finished = run.step()
                        if finished:
                            run.hold(run.follow(follow, finished))
                        if poll is not None:
                            pending = run.poll(poll, wait=False)
                        run.flush(add_batch)
                    elif run.ready:  # nothing decodes: whatever waits to join starts now
                        run.flush(add_batch, force=True)
                    else:
                        pending = run.poll(poll, wait=True)
                        run.flush(add_batch, force=True)
            except BaseException:
                run.abort()  # leave the engine without requests of this call
                raise
        if run.waiting:
            raise RuntimeError(f"vLLM finished with {len(run.waiting)} requests of this call unreported")
        self.last_stats = {"prompt_tokens": run.prompt_tokens, "cached_prompt_tokens": run.cached_tokens}
        if probe is not None:
            self.last_breakdown = run.breakdown(probe.report(self.last_stats))

    def _vllm_prompt(self, index: int, prompt: PromptInput) -> dict:
        """A vLLM token prompt: each image's expanded block collapsed to what vLLM expands, plus the images."""
        images = list(prompt.images)
        if len(images) > self.max_images_per_prompt:
            raise ValueError(
                f"prompt {index} has {len(images)} images; the engine was built for at most "
                f"{self.max_images_per_prompt} (max_images_per_prompt)"
            )
        videos = list(prompt.videos)
        if videos and len(videos) > self.max_videos_per_prompt:
            raise ValueError(f"prompt {index} has {len(videos)} videos; the engine was built for at most "
                             f"{self.max_videos_per_prompt} (max_videos_per_prompt)")
        ours = [int(t) for t in prompt.input_ids]
        try:
            ids, video_blocks = self.adapter.vllm_collapse_videos(ours)
            if len(video_blocks) != len(videos):
                raise ValueError(f"{len(video_blocks)} video blocks but {len(videos)} videos")
            ids, blocks = self.adapter.vllm_collapse(ids, self._vocab)
            if len(blocks) != len(images):
                raise ValueError(f"{len(blocks)} image blocks but {len(images)} images")
            expanded = self.adapter.vllm_expand_videos(self.adapter.vllm_expand(ids, blocks, self._vocab), video_blocks)
            if expanded != ours:
                raise ValueError("vLLM's re-expansion of the collapsed prompt would not give these ids back")
        except ValueError as err:
            raise ValueError(f"prompt {index} ({self.family}): {err}") from err
        request = {"prompt_token_ids": ids}
        if images:
            request["multi_modal_data"] = {"image": images}
            if self.mm_uuids:
                request["multi_modal_uuids"] = {"image": [self._image_keys(image) for image in images]}
        if videos:
            items, kwargs = self.adapter.vllm_video_items(videos)
            request.setdefault("multi_modal_data", {})["video"] = items
            if kwargs:
                request["mm_processor_kwargs"] = kwargs
        return request

    def _vllm_sampling(self, params: SamplingParams, num_prompts: int):
        """One vLLM SamplingParams for all prompts, or one per prompt when a seed is given."""
        if params.seed is None:
            return _vllm_sampling_params(params, None)
        return [_vllm_sampling_params(params, params.seed + i * params.n) for i in range(num_prompts)]

    @staticmethod
    def _check_prompt_ids(index: int, prompt: PromptInput, engine_ids) -> None:
        """The ids vLLM ran (after re-expanding images) must be the trainer's ids exactly."""
        ours = [int(t) for t in prompt.input_ids]
        theirs = list(engine_ids or [])
        if ours == theirs:
            return
        first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise RuntimeError(
            f"prompt {index}: vLLM ran {len(theirs)} prompt tokens, the trainer has {len(ours)} (first difference "
            f"at position {first}). vLLM's image processor produced a different image grid: check that the "
            "images are the trainer's and that the family's vllm_processor_kwargs match its processor call"
        )

    # --- weights ------------------------------------------------------------------------------

    def refit(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors named with transformers names; wakes the weights of a sleeping engine.

        The KV cache stays asleep if it was; prefix, encoder and processor caches are cleared.
        Raises if vLLM loaded a set of parameters other than the one the name table predicts.
        """
        if "weights" in self._asleep:
            self._llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        expected: set[str] = set()
        skipped: dict[str, str] = {}
        stream = refit_stream(self.family, self._skips, self._tied, named_tensors, expected, skipped)
        loaded = self._llm.apply_model(lambda model: load_into(model, stream))[0]
        check_loaded(loaded, expected)
        if skipped and self.skipped_in_refit != len(skipped):
            first = next(iter(skipped.items()))
            log.info("refit: %d checkpoint tensors have no vLLM parameter and were not expected back (e.g. %s: %s)",
                     len(skipped), *first)
        self.skipped_in_refit = len(skipped)
        self._drop_caches()

    def read_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The engine's current tensors for these transformers names, un-stacked and gathered, on CPU.

        Names vLLM builds no parameter for (`VLLMSkips`, e.g. LLaVA's vision layers past
        vision_feature_layer) are left out of the result; any other name it lacks is an error.
        """
        if "weights" in self._asleep:
            raise RuntimeError("VLLMEngine.read_weights: the weights are asleep; call wake() or refit() first")
        targets = [(name, *vllm_param_for(self.family, name)) for name in names
                   if self._skips.reason(self.family, name) is None]
        return self._llm.apply_model(lambda model: _read_params(model, targets))[0]

    # --- memory -------------------------------------------------------------------------------

    @property
    def sleep_discards_weights(self) -> bool:
        """Level 2 drops the weights (vLLM keeps the model's buffers): a refit must come before generating."""
        return self.sleep_level == 2

    def sleep(self) -> None:
        """KV cache released; weights copied to host memory (level 1) or dropped (level 2)."""
        if self._asleep:
            return
        self._llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        torch.cuda.empty_cache()

    def wake(self) -> None:
        """Bring back whatever is asleep, then drop every cache that could hold stale results."""
        if self._asleep:
            # Name the tags: waking all tags re-maps memory that refit already woke.
            self._llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()
        self._drop_caches()

    def _drop_caches(self) -> None:
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("VLLMEngine: vLLM could not reset its prefix cache (requests still running)")
        self._llm.llm_engine.reset_encoder_cache()
        self._llm.reset_mm_cache()

    def memory_gb(self) -> dict[str, float]:
        """GPU memory of this rank's device in GiB: in use on the device, and held by torch's allocator."""
        free, total = torch.cuda.mem_get_info(self._device)
        return {
            "device_used": (total - free) / _GIB,
            "device_total": total / _GIB,
            "torch_allocated": torch.cuda.memory_allocated(self._device) / _GIB,
            "torch_reserved": torch.cuda.memory_reserved(self._device) / _GIB,
        }
