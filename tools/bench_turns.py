"""vLLM generation throughput of multi-turn episodes against single-turn generation of the same tokens.

    python tools/bench_turns.py --model DIR [--prompts 16 --n 8 --turns 3 --turn-tokens 128] [--json-out F]
        [--crops same|distinct] [--mm-uuids 1|0] [--skip-empty-hf 0|1] [--fast-placeholders 0|1] [--text-tools]
        [--processor-cache-gb 4] [--profile-turns 0|1 [--trace-dir DIR]] [--lengths fixed|varied]
        [--continuous 0|1 [--continuous-add-batch N]] [--same-total 1|0]
    python tools/bench_turns.py --summarize F     # one line of a result: ratio, per turn where the time went
    python tools/bench_turns.py --encode-only --model DIR [--crops same|distinct] [--text-tools] [--repeats 5]
    PYTHONPATH=<vLLM 0.26 source> python tools/bench_turns.py --add-only --model DIR [--crops ...] [--mm-uuids 1|0]
        [--skip-empty-hf 0|1] [--fast-placeholders 0|1] [--repeats 5]

`--lengths varied` gives each episode's turns their own lengths (a quarter to 7/4 of `turn_tokens`, seeded),
as a model's turns end at different steps, and `--continuous 1` runs the episodes through the engine's
`generate_continuing` (rollout.continuous_turns), an episode's next turn added when its own turn ends; either
one runs `varied_turns` (its docstring says what is timed) instead of the turn-by-turn breakdown below.

Single-turn: each prompt, n samples, `turns × turn_tokens` new tokens. Multi-turn: the same prompts
and samples, `turn_tokens` per turn; between turns every episode gets a tool message holding a
zoomed crop of its prompt image (rendered by the family's chat template, as `rollout/rollouts.py`
appends it), and the next turn sends each whole episode to the engine in one call, built as
`Rollouts` builds it for vLLM (`Episode.engine_input(pixels=False)`). Generation is forced to its
full length (no stop tokens) so both sides generate the same number of tokens. Tokens/s count
generated tokens over the engine's generate calls only. Weights are vLLM's dummy ones: throughput
does not depend on their values.

Two baselines (fixed lengths). `ratio` is against single-turn generation of the same generated tokens from the
bare prompts: the multi-turn side also prefills every tool message (~300 tokens an episode a turn at the
default shape) and decodes over longer contexts, GPU work the baseline never does. `ratio_same_total`
(`--same-total 1`, the default) is against single-turn generation at the same total tokens: each finished
episode's prompt and tool messages up front (`same_total_inputs`), its model tokens in one turn, so both
sides process the same tokens and the ratio shows what running them as turns costs.

Tool messages: a turn's are encoded together, as `Rollouts` encodes them (`ToolResultEncoder.encode_many`);
`tool_message_s` is that encoding over all turns, `crop_s` the making of the crops before it.
`--encode-only` runs no engine (no GPU): it times one turn's encoding on the CPU, each episode
alone (`encode_s`) against the turn's episodes together (`encode_many_s`), best of `--repeats`,
and checks both give every episode the same ids, pixels, grid and images bit for bit (`identical`).

`--add-only` runs no engine either: it times, on the CPU, what a generate call does before vLLM's
engine steps for each turn's prompts (the engine's prompt building, then vLLM's renderer with its
multimodal processor and processor cache, the input processor, the engine core's receiver cache and
its `Request` with prefix-cache block hashes), with `_patch_vllm` of tools/vllm_prompt_check.py where
vLLM's compiled extensions are missing. Model turns are stand-in text ids; tool messages and crops are
the engine run's. Each repeat starts from empty caches and runs every turn in order; per turn the best
repeat's seconds and its parts (`add_s`, `parts_s`), and whether vLLM's prompt ids equal the episodes'
(`ids_equal`). `--skip-empty-hf 1`: the engine's `skip_empty_hf_calls` (no HF processor call for a
request whose images all hit the processor cache); `--fast-placeholders 1`: its `fast_placeholder_search`
(vLLM's search for the expanded image runs jumps to candidate positions).

Crops: `same` (the default, the benchmark as first measured) zooms every episode into the same
corner of its prompt's image each turn, so the 8 episodes of a prompt, and its turns, send the same
crop; the benchmark's prompt images are of one colour, so that crop is the prompt's image bit for bit
and vLLM's processor and encoder caches serve it from turn 1: no crop is processed or encoded. `distinct`
marks each episode's crop of each turn with a few pixels of its own, so every crop is new content,
as when a model zooms where it likes: 128 crops processed and encoded per later turn. Same size
either way (the benchmark's definition).

Per turn (`turn_breakdown` in the JSON, one entry per turn; `single_turn_breakdown` for the single-turn call),
from wrappers on the engine's vLLM objects (`GenerationProbe` of rollout/gen_probe.py, which train.py runs
too under rollout.gen_breakdown; here its own, synchronized around the encoder; a part vLLM lacks reads null):
  input_s          building the engine prompts from the episodes (outside the generate call)
  the probe's fields (rollout/gen_probe.py's module docstring lists them: prep_s, add_s, mm_stage_s, steps_s,
  encoder_s, encoder_synced, gc_s, slowest_steps_s and the counts of images, steps and tokens)

`--profile-turns 1` runs the single-turn call, turn 1 and the last turn under torch.profiler (CPU, and CUDA
where there is a GPU), to see why a later turn's decode step takes longer than turn 1's. Per profiled call
(`profiles` in the JSON: `single_turn`, `turn_1`, `turn_<last>`): `cuda_kernels`, the top 15 CUDA kernels
by total time (name cut to 80 characters, `ms`, `count` launches), `cuda_kernel_ms` (all kernels), `wall_s`,
`cpu_ops`, the top 10 CPU ops by self time (`self_ms`, `count`), and per engine step of the call's breakdown
`wall_ms_per_step` and `cuda_kernel_ms_per_step` (the whole call's: prefill and request adding included).
Kernel fields are null without CUDA. The profiled calls' seconds include the profiler's overhead, so their
turns' tokens/s and the ratio are not comparable with an unprofiled run. `--trace-dir DIR` also writes each
profiled call's chrome trace there (`<json-out stem>_<call>.trace.json`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.gen_probe import COUNTS, TIMES, GenerationProbe  # noqa: E402,F401  (COUNTS, TIMES: the result's keys)

PROFILE_KERNELS = 15  # --profile-turns: CUDA kernels listed per profiled call, by total time
PROFILE_CPU_OPS = 10  # and CPU ops, by self time


def _prompts(processor, count: int, side: int):
    from PIL import Image

    from data.processing import EncodedPrompt

    out = []
    for i in range(count):
        image = Image.new("RGB", (side, side), (37 * i % 255, 90, 200 - 11 * i % 200))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many objects?"}]}]
        images = processor.prepare_images([image])
        enc = processor(processor.apply_chat_template(messages), images)
        out.append(EncodedPrompt(i, enc["input_ids"], enc["pixel_values"], enc["image_grid_thw"], images, "0"))
    return out


def zoom_crop(image, side: int, episode: int, turn: int, distinct: bool):
    """The zoomed top-left quarter of `image` at `side` × `side`; `distinct` marks it with pixels that
    encode (episode, turn), so no two episodes or turns send the same crop."""
    crop = image.crop((0, 0, side // 2, side // 2)).resize((side, side))
    if distinct:
        for bit in range(24):  # episode and turn as a row of black/white pixels
            on = ((episode << 8 | turn) >> bit) & 1
            crop.putpixel((bit, 0), (255, 255, 255) if on else (0, 0, 0))
    return crop


def tool_results(images: list, args, turn: int) -> list[list[tuple[str, list]]]:
    """Each episode's tool results for one turn, from its prompt image: one message, "zoomed", with
    the episode's crop (`zoom_crop`), or no image with --text-tools."""
    distinct = args.crops == "distinct"
    return [[("zoomed", [] if args.text_tools else [zoom_crop(image, args.side, k, turn, distinct)])]
            for k, image in enumerate(images)]


def same_total_inputs(episodes, pixels: bool) -> list:
    """The same-total baseline's single-turn prompts: each finished episode without its model turns (its
    prompt, then every tool message with its images, in order). Generating the episode's model tokens in
    one turn after such a prompt processes the episode's whole length, as the multi-turn episode did,
    prefill of the tool messages included; the tool tokens come first, so its decode steps attend over
    the longer context from the start (no less work than the episode's)."""
    import dataclasses

    from rollout.episode import MODEL

    out = []
    for e in episodes:
        keep = [i for i, source in enumerate(e.sources) if source != MODEL]
        flat = dataclasses.replace(e, token_ids=[e.token_ids[i] for i in keep], sources=[e.sources[i] for i in keep],
                                   logprobs=[], turns=[], routed_experts=None)
        out.append(flat.engine_input(pixels))
    return out


def bitwise_equal(a, b) -> bool:
    """Whether two encoder outputs (ids, pixel_values, image_grid_thw, images) are the same bit for bit."""
    import torch

    def same(x, y) -> bool:
        if x is None or y is None:
            return x is y
        return (x.dtype == y.dtype and x.shape == y.shape
                and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)))

    return (a[0] == b[0] and same(a[1], b[1]) and same(a[2], b[2]) and len(a[3]) == len(b[3])
            and all(x.size == y.size and x.tobytes() == y.tobytes() for x, y in zip(a[3], b[3])))


def _setup(args):
    """(adapter, processor, the benchmark's prompts, the tool-message encoder) of --model."""
    from data.processing import load_processor
    from models.family import build_adapter
    from models.policy import load_model_config
    from rollout.episode import ToolResultEncoder

    adapter = build_adapter(load_model_config(args.model))
    processor = load_processor(args.model)
    prompts = _prompts(processor, args.prompts, args.side)
    encoder = ToolResultEncoder(processor, adapter.tool_format, adapter.end_of_turn, 784, args.side * args.side)
    return adapter, processor, prompts, encoder


def encode_only(args) -> dict:
    """One turn's tool messages encoded on the CPU, no engine: `encode` of each episode alone against
    `encode_many` of the turn's episodes together (the best of --repeats timings each: other work on
    shared cores only adds time), and whether both give every episode the same outputs bit for bit."""
    adapter, processor, prompts, encoder = _setup(args)
    start = time.perf_counter()
    results = tool_results([p.images[0] for p in prompts for _ in range(args.n)], args, 0)
    crop_s = time.perf_counter() - start
    timings = {"encode_s": [], "encode_many_s": []}
    for _ in range(args.repeats):
        for key, run in (("encode_s", lambda: [encoder.encode(r) for r in results]),
                         ("encode_many_s", lambda: encoder.encode_many(results))):
            start = time.perf_counter()
            run()  # outputs dropped at once: each timing allocates its own, as a turn does
            timings[key].append(time.perf_counter() - start)
    alone, together = [encoder.encode(r) for r in results], encoder.encode_many(results)
    return {"encode_only": True, "model": Path(args.model).name,
            "image_processor": type(processor.image_processor).__name__, "episodes": len(results),
            "image_side": args.side, "tool_images": not args.text_tools, "crops": args.crops,
            "repeats": args.repeats, "crop_s": round(crop_s, 3),
            **{key: round(min(times), 3) for key, times in timings.items()},
            "identical": all(bitwise_equal(a, b) for a, b in zip(alone, together))}


def _stand_in_turns(args, adapter, processor, prompts, encoder) -> list[list]:
    """Each turn's engine inputs as the engine run builds them, with stand-in model turns (text ids)."""
    import random

    from rollout.base import Generation
    from rollout.episode import Episode

    rng = random.Random(0)
    episodes = [Episode.start(i, p) for i, p in enumerate(prompts) for _ in range(args.n)]
    end_id = processor.tokenizer.convert_tokens_to_ids(adapter.end_of_turn)
    text_ids = range(100, len(processor.tokenizer) // 2)  # ordinary text tokens, below the added special ones
    turns = [[Episode.start(i, p).engine_input(False) for i, p in enumerate(prompts)]]
    for t in range(args.turns - 1):
        for e in episodes:
            e.add_model_turn(Generation(0, [rng.choice(text_ids) for _ in range(args.turn_tokens)],
                                        [-0.1] * args.turn_tokens, "length"))
        results = tool_results([e.images[0] for e in episodes], args, t)
        for e, (ids, pix, grid, images) in zip(episodes, encoder.encode_many(results)):
            e.token_ids[-1] = end_id
            e.add_tool_tokens(ids, pix, grid, images)
        turns.append([e.engine_input(False) for e in episodes])
    return turns


class RequestAdder:
    """vLLM 0.26's request adding without an engine (`--add-only`): the renderer (multimodal processor
    and its processor cache), the input processor, and the engine core's receiver cache and `Request`
    with its prefix-cache block hashes, built from the config `LLM` would build, on the CPU."""

    def __init__(self, args, adapter, processor, context: int):
        from tools.vllm_prompt_check import _patch_vllm

        _patch_vllm(adapter.name)
        from vllm.config import DeviceConfig, ModelConfig, VllmConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.renderers.registry import renderer_from_config
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.engine.input_processor import InputProcessor

        from rollout.vllm_engine import ImageKeys, VLLMEngine, fast_placeholder_search, skip_empty_hf_calls

        pixels = args.side * args.side
        self.model_config = ModelConfig(
            model=args.model, tokenizer=args.model, dtype="bfloat16", seed=0, max_model_len=context,
            mm_processor_kwargs=adapter.vllm_processor_kwargs(784, pixels), generation_config="vllm",
            mm_processor_cache_gb=args.processor_cache_gb, limit_mm_per_prompt={"image": args.turns, "video": 0},
            **adapter.vllm_engine_kwargs())
        config = VllmConfig(model_config=self.model_config, device_config=DeviceConfig(device="cpu"))
        self.renderer = renderer_from_config(config)
        self.inputs = InputProcessor(config, self.renderer)
        self.receiver = MULTIMODAL_REGISTRY.engine_receiver_cache_from_config(config)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(config.cache_config.block_size, hash_fn)
        self.engine = VLLMEngine.__new__(VLLMEngine)  # only its prompt building: no vLLM engine
        self.engine.adapter, self.engine.family = adapter, adapter.name
        self.engine.max_images_per_prompt, self.engine.max_videos_per_prompt = args.turns, 0
        self.engine._vocab = processor.tokenizer.get_vocab()
        self.engine.mm_uuids, self.engine._image_keys = bool(args.mm_uuids), ImageKeys()
        if args.skip_empty_hf:
            skip_empty_hf_calls(self.renderer.get_mm_processor())
        if args.fast_placeholders:
            fast_placeholder_search(self.renderer.get_mm_processor())
        self.parts: dict[str, float] = {}
        self._stage_timing(self.renderer.get_mm_processor())
        self.banned = adapter.banned_token_ids

    def _stage_timing(self, mm_processor) -> None:
        from vllm.multimodal.processing.context import TimingContext

        original = mm_processor.apply

        def apply(inputs, timing_ctx=None):
            ctx = TimingContext(enabled=True)
            try:
                return original(inputs, ctx)
            finally:
                for stage, secs in ctx.stage_secs.items():
                    self._add(stage.removesuffix("_secs"), secs)
        mm_processor.apply = apply

    def _add(self, key: str, secs: float) -> None:
        self.parts[key] = self.parts.get(key, 0.0) + secs

    def reset(self) -> None:
        """Empty the processor and receiver caches and the engine's image keys, as a fresh engine has them."""
        from rollout.vllm_engine import ImageKeys

        self.renderer.clear_mm_cache()
        if self.receiver is not None:
            self.receiver.clear_cache()
        self.engine._image_keys = ImageKeys()

    def add(self, prompts: list, n: int, max_tokens: int, seed: int) -> list:
        """vLLM `Request`s of `prompts`, built as `LLM.generate` builds them before its engine steps."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.v1.request import Request

        start = time.perf_counter()
        requests = [self.engine._vllm_prompt(i, p) for i, p in enumerate(prompts)]
        self._add("prep", time.perf_counter() - start)
        out = []
        for i, request in enumerate(requests):
            params = VLLMSamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, logprobs=0, flat_logprobs=True,
                                        detokenize=False, seed=seed + i * n,
                                        logit_bias={int(t): -100.0 for t in self.banned} or None)
            t0 = time.perf_counter()
            (rendered,) = self.renderer.render_cmpl([parse_model_prompt(self.model_config, request)],
                                                    self.renderer.default_cmpl_tok_params)
            t1 = time.perf_counter()
            core_request = self.inputs.process_inputs(str(i), rendered, params, supported_tasks=("generate",))
            t2 = time.perf_counter()
            if self.receiver is not None and core_request.mm_features:
                core_request.mm_features = self.receiver.get_and_update_features(core_request.mm_features)
            out.append(Request.from_engine_core_request(core_request, self.block_hasher))
            self._add("render", t1 - t0)
            self._add("process_inputs", t2 - t1)
            self._add("core_add", time.perf_counter() - t2)
        return out


def add_only(args) -> dict:
    """Each turn's request adding through vLLM's own code on the CPU (`--add-only`, module docstring)."""
    adapter, processor, prompts, encoder = _setup(args)
    longest = max(p.input_ids.numel() for p in prompts)
    context = longest + args.turns * (args.turn_tokens + 64 + args.side * args.side // 784)
    turns = _stand_in_turns(args, adapter, processor, prompts, encoder)
    adder = RequestAdder(args, adapter, processor, context)
    runs = []  # per repeat, per turn: (seconds, parts)
    ids_equal = True
    for _ in range(args.repeats):
        adder.reset()
        run = []
        for t, batch in enumerate(turns):
            adder.parts = {}
            start = time.perf_counter()
            requests = adder.add(batch, args.n if t == 0 else 1, args.turn_tokens, 1 + t)
            run.append((time.perf_counter() - start, adder.parts))
            ids_equal &= all(list(r.prompt_token_ids) == list(p.input_ids) for p, r in zip(batch, requests))
            del requests
        runs.append(run)
    per_turn = []
    for t in range(len(turns)):
        secs, parts = min((run[t] for run in runs), key=lambda x: x[0])
        per_turn.append({"turn": t + 1, "prompts": len(turns[t]), "add_s": round(secs, 4),
                         "prompt_tokens": sum(len(p.input_ids) for p in turns[t]),
                         "images_sent": sum(len(p.images) for p in turns[t]),
                         "all_s": [round(run[t][0], 3) for run in runs],
                         "parts_s": {k: round(v, 4) for k, v in sorted(parts.items())}})
    return {"add_only": True, "model": Path(args.model).name, "prompts": args.prompts, "n": args.n,
            "turns": args.turns, "turn_tokens": args.turn_tokens, "image_side": args.side, "crops": args.crops,
            "mm_uuids": bool(args.mm_uuids), "skip_empty_hf": bool(args.skip_empty_hf),
            "fast_placeholders": bool(args.fast_placeholders), "processor_cache_gb": args.processor_cache_gb,
            "repeats": args.repeats, "ids_equal": ids_equal,
            "turn_breakdown": per_turn}


def summary_line(result: dict) -> str:
    """One line of a result: the ratio, then per turn its seconds and where they went."""
    def turn(b: dict) -> str:
        stages = b.get("mm_stage_s") or {}
        return (f"t{b['turn']} {b['s']}s=add {b['add_s']}(hash {stages.get('get_mm_hashes')}, hf "
                f"{stages.get('apply_hf_processor')}, updates {stages.get('apply_prompt_updates')})+steps "
                f"{b['steps_s']}(enc {b['encoder_s']}) gc {b['gc_s']} in {b['input_s']} img "
                f"{b['images_sent']}/{b['images_processed']}/{b['images_encoded']} prefill {b['prefill_tokens']} "
                f"in {b['prefill_steps']}/{b['steps']} steps (slowest {b.get('slowest_steps_s')}) cached "
                f"{b['cached_prompt_tokens']}/{b['prompt_tokens']}")
    head = (f"ratio {result['ratio']} single {result['single_turn_tokens_per_s']} multi "
            f"{result['multi_turn_tokens_per_s']} tok/s crops {result.get('crops')} keys {result.get('mm_uuids')} "
            f"skip_empty_hf {result.get('skip_empty_hf')} fast_placeholders {result.get('fast_placeholders')} "
            f"tool_message_s {result['tool_message_s']}"
            + (f" same-total ratio {result['ratio_same_total']} ({result['same_total_tokens_per_s']} tok/s, "
               f"{result['same_total_prompt_tokens']} prompt tokens)" if "ratio_same_total" in result else ""))
    def prof(name: str, p: dict) -> str:
        if "error" in p and "wall_s" not in p:
            return f"prof {name} error {p['error']}"
        top = (p.get("cuda_kernels") or p.get("cpu_ops") or [{}])[0].get("name")
        return (f"prof {name} {p.get('wall_s')}s kernels {p.get('cuda_kernel_ms')} ms "
                f"({p.get('cuda_kernel_ms_per_step')} ms/step of {p.get('wall_ms_per_step')} ms) top {top}")
    profiles = [prof(name, p) for name, p in (result.get("profiles") or {}).items()]
    return " | ".join([head] + [turn(b) for b in result.get("turn_breakdown", [])] + profiles)


def _timed(engine, inputs, params) -> tuple[list, float]:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    gens = engine.generate(inputs, params)
    torch.cuda.synchronize()
    return gens, time.perf_counter() - t


def profile_summary(prof, wall_s: float, cuda: bool) -> dict:
    """One profiled call: the top 15 CUDA kernels by total time (name cut to 80 characters, ms, launches), all
    CUDA kernels' ms, the call's wall seconds, and the top 10 CPU ops by self time. Without CUDA the kernel
    fields are null and the CPU ops are the whole profile."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    out = {"wall_s": round(wall_s, 3), "cuda": cuda, "cuda_kernel_ms": None, "cuda_kernels": None}
    if cuda:
        # device activity only: an op row also carries its kernels' time, a user range overlaps them
        kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False)]
        out["cuda_kernel_ms"] = round(sum(e.self_device_time_total for e in kernels) / 1e3, 3)
        out["cuda_kernels"] = [{"name": e.key[:80], "ms": round(e.self_device_time_total / 1e3, 3), "count": e.count}
                               for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:PROFILE_KERNELS]]
    ops = [e for e in events if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU
           and not getattr(e, "is_user_annotation", False)]
    out["cpu_ops"] = [{"name": e.key[:80], "self_ms": round(e.self_cpu_time_total / 1e3, 3), "count": e.count}
                      for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:PROFILE_CPU_OPS]]
    return out


def per_step(profiles: dict, breakdowns: dict) -> None:
    """Each profile's CUDA kernel ms and wall ms per engine step, from its call's breakdown (when it counted steps)."""
    for name, prof in profiles.items():
        steps = (breakdowns.get(name) or {}).get("steps")
        if steps and prof.get("wall_s") is not None:
            prof["wall_ms_per_step"] = round(prof["wall_s"] * 1e3 / steps, 3)
            if prof.get("cuda_kernel_ms") is not None:
                prof["cuda_kernel_ms_per_step"] = round(prof["cuda_kernel_ms"] / steps, 3)


def _call(engine, inputs, params, args, name: str, profiles: dict) -> tuple[list, float]:
    """`_timed`, under torch.profiler when --profile-turns 1 names this call (`profiles[name]` then holds
    `profile_summary`, and --trace-dir its chrome trace). A profiler that cannot start or be read is
    reported in `profiles[name]["error"]`; the call itself runs either way."""
    if not args.profile_turns:
        return _timed(engine, inputs, params)
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    try:
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        prof.__enter__()
    except Exception as e:
        profiles[name] = {"error": f"{type(e).__name__}: {e}"}
        return _timed(engine, inputs, params)
    try:
        gens, s = _timed(engine, inputs, params)
    finally:
        prof.__exit__(None, None, None)
    try:
        profiles[name] = profile_summary(prof, s, cuda)
        if args.trace_dir:
            stem = Path(args.json_out).stem if args.json_out else "turns"
            trace = Path(args.trace_dir) / f"{stem}_{name}.trace.json"
            trace.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace))
            profiles[name]["trace"] = str(trace)
    except Exception as e:
        profiles[name] = {**profiles.get(name, {}), "error": f"{type(e).__name__}: {e}"}
    return gens, s


def turn_lengths(episodes: int, turns: int, turn_tokens: int, varied: bool) -> list[list[int]]:
    """Each episode's tokens per turn: `turn_tokens` each, or with `varied` drawn per episode and turn (seeded by
    both) from a quarter to 7/4 of it, so a turn's episodes end at different steps as a model's would."""
    if not varied:
        return [[turn_tokens] * turns for _ in range(episodes)]
    lo, hi = max(1, turn_tokens // 4), turn_tokens * 7 // 4
    return [[random.Random(1000 * k + t).randint(lo, hi) for t in range(turns)] for k in range(episodes)]


def varied_turns(args, engine, prompts, encoder, end_id: int, banned) -> dict:
    """--lengths varied and/or --continuous 1: every episode generates its own lengths (`turn_lengths`).

    Single-turn: each episode its whole length in one request (the engine's `generate_continuing` with nothing to
    follow, which takes a length per request). Multi-turn, turn by turn (--continuous 0): one call per turn at the
    turn's longest length, each episode's generation then cut to its own, as Rollouts cuts at an episode's
    allowance; --continuous 1: one `generate_continuing` call in which an episode's next turn (its tool message,
    then its next length) is added when its own turn ends. Tokens: the episodes' lengths, the same on both sides.
    Seconds: the engine calls' wall time; with --continuous 1 less the tool messages' encoding inside the call (the
    turn-by-turn side encodes between its calls)."""
    import torch

    from rollout.base import SamplingParams
    from rollout.episode import Episode
    from rollout.rollouts import TURN_SEED_STRIDE

    pixels_in = engine.reads_pixel_values
    episodes = [Episode.start(i, p) for i, p in enumerate(prompts) for _ in range(args.n)]
    lengths = turn_lengths(len(episodes), args.turns, args.turn_tokens, args.lengths == "varied")
    total = [sum(row) for row in lengths]

    def params(tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(n=1, max_new_tokens=tokens, banned_token_ids=banned, seed=seed)

    def add_tools(batch: list[Episode], turn: int) -> float:
        start = time.perf_counter()
        for e in batch:
            # generation was forced to full length: its last token stands in for the end-of-turn token
            e.token_ids[-1] = end_id
        results = tool_results([e.images[0] for e in batch], args, turn)
        for e, (ids, pix, grid, images) in zip(batch, encoder.encode_many(results)):
            e.add_tool_tokens(ids, pix, grid, images)
        return time.perf_counter() - start

    torch.cuda.synchronize()
    start = time.perf_counter()
    single = [(k, Episode.start(e.prompt_index, prompts[e.prompt_index]).engine_input(pixels_in), params(total[k], 1 + k))
              for k, e in enumerate(episodes)]
    engine.generate_continuing(single, lambda finished: [])
    torch.cuda.synchronize()
    single_s = time.perf_counter() - start
    breakdowns = {"single_turn": dict(getattr(engine, "last_breakdown", None) or {})}
    single_tokens = sum(total)

    tool_s, turn_s = 0.0, []
    if args.continuous:
        turn_of = [0] * len(episodes)

        def follow(finished):
            nonlocal tool_s
            ended = []
            for k, gen in finished:
                episodes[k].add_model_turn(gen)
                if turn_of[k] + 1 < args.turns:
                    ended.append(k)
            if not ended:
                return []
            tool_s += add_tools([episodes[k] for k in ended], min(turn_of[k] for k in ended))
            nxt = []
            for k in ended:
                turn_of[k] += 1
                seed = 1 + k + TURN_SEED_STRIDE * turn_of[k]
                nxt.append((k, episodes[k].engine_input(pixels_in), params(lengths[k][turn_of[k]], seed)))
            return nxt

        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate_continuing([(k, e.engine_input(pixels_in), params(lengths[k][0], 1 + k))
                                    for k, e in enumerate(episodes)], follow, add_batch=args.continuous_add_batch)
        torch.cuda.synchronize()
        multi_s = time.perf_counter() - start - tool_s
        # engine steps against prefill (mixed) steps, adds, follow: where continuous turns spend their time
        breakdowns["continuous"] = dict(getattr(engine, "last_breakdown", None) or {})
    else:
        multi_s = 0.0
        for t in range(args.turns):
            longest = max(row[t] for row in lengths)
            batch = [e.engine_input(pixels_in) for e in episodes]
            gens, s = _timed(engine, batch, SamplingParams(n=1, max_new_tokens=longest, banned_token_ids=banned,
                                                          seed=1 + TURN_SEED_STRIDE * t))
            multi_s += s
            turn_s.append(round(s, 3))
            breakdowns[f"turn_{t + 1}"] = dict(getattr(engine, "last_breakdown", None) or {})
            for k, (e, g) in enumerate(zip(episodes, gens)):
                cap = lengths[k][t]
                e.add_model_turn(type(g)(g.prompt_index, g.token_ids[:cap], g.logprobs[:cap], "length",
                                         g.routed_experts))
            if t < args.turns - 1:
                tool_s += add_tools(episodes, t)
    multi_tokens = sum(e.model_tokens for e in episodes)
    return {
        "multi_turn": True, "model": Path(args.model).name, "prompts": args.prompts, "n": args.n, "turns": args.turns,
        "turn_tokens": args.turn_tokens, "image_side": args.side, "lengths": args.lengths,
        "continuous": bool(args.continuous), "continuous_add_batch": args.continuous_add_batch,
        "crops": args.crops, "mm_uuids": bool(args.mm_uuids),
        "single_turn_tokens": single_tokens, "single_turn_s": round(single_s, 3),
        "single_turn_tokens_per_s": round(single_tokens / single_s, 1),
        "multi_turn_tokens": multi_tokens, "multi_turn_s": round(multi_s, 3),
        "multi_turn_tokens_per_s": round(multi_tokens / multi_s, 1),
        "ratio": round((multi_tokens / multi_s) / (single_tokens / single_s), 3),
        "turn_s": turn_s, "tool_message_s": round(tool_s, 3), "tool_images": not args.text_tools,
        "episode_tokens_max": max(len(e.token_ids) for e in episodes),
        "breakdowns": breakdowns,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--side", type=int, default=448)
    p.add_argument("--text-tools", action="store_true", help="tool messages hold text only (no crop)")
    p.add_argument("--crops", choices=("same", "distinct"), default="same",
                   help="same: one crop per prompt (vLLM dedupes it); distinct: every episode and turn its own")
    p.add_argument("--processor-cache-gb", type=float, default=4.0, help="vLLM's processed-image cache; 0: off")
    p.add_argument("--mm-uuids", type=int, choices=(0, 1), default=1,
                   help="1: images named by content keys computed once (rollout.mm_uuids); 0: vLLM hashes them")
    p.add_argument("--skip-empty-hf", type=int, choices=(0, 1), default=0,
                   help="1: the engine's skip_empty_hf_calls (no HF processor call when every image hits the cache)")
    p.add_argument("--fast-placeholders", type=int, choices=(0, 1), default=0,
                   help="1: the engine's fast_placeholder_search (vLLM's placeholder search jumps to candidates)")
    p.add_argument("--add-only", action="store_true",
                   help="time only vLLM's request adding of each turn, on the CPU, without an engine (vLLM's source "
                        "on PYTHONPATH)")
    p.add_argument("--encode-only", action="store_true",
                   help="time only the encoding of one turn's tool messages, on the CPU, without an engine")
    p.add_argument("--repeats", type=int, default=5,
                   help="--encode-only, --add-only: timings of each path or turn (the best is reported)")
    p.add_argument("--profile-turns", type=int, choices=(0, 1), default=0,
                   help="1: the single-turn call, turn 1 and the last turn under torch.profiler (kernels and CPU "
                        "ops in the JSON's profiles)")
    p.add_argument("--trace-dir", default="", help="--profile-turns 1: a chrome trace of each profiled call here")
    p.add_argument("--lengths", choices=("fixed", "varied"), default="fixed",
                   help="varied: each episode's turn its own length, from a quarter to 7/4 of --turn-tokens")
    p.add_argument("--continuous", type=int, choices=(0, 1), default=0,
                   help="1: episodes run through the engine's generate_continuing (rollout.continuous_turns): an "
                        "episode's next turn is added when its own turn ends")
    p.add_argument("--continuous-add-batch", type=int, default=1,
                   help="with --continuous 1: next-turn requests join once this many wait (rollout.continuous_add_batch)")
    p.add_argument("--same-total", type=int, choices=(0, 1), default=1,
                   help="1 (fixed lengths): also single-turn at the same total tokens: each episode's prompt and tool "
                        "messages up front, its model tokens in one turn (ratio_same_total)")
    p.add_argument("--json-out", default="")
    p.add_argument("--summarize", default="", help="print the summary line of this result file and exit")
    args = p.parse_args(argv)
    if args.summarize:
        result = json.loads(Path(args.summarize).read_text())
        print(summary_line(result))
        return result

    if not args.model:
        p.error("--model is required")
    if args.encode_only or args.add_only:
        result = encode_only(args) if args.encode_only else add_only(args)
        print(json.dumps(result))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result) + "\n")
        return result
    from rollout.base import SamplingParams
    from rollout.episode import Episode
    from rollout.vllm_engine import VLLMEngine

    adapter, processor, prompts, encoder = _setup(args)
    pixels = args.side * args.side
    longest = max(p.input_ids.numel() for p in prompts)
    context = longest + args.turns * (args.turn_tokens + 64 + pixels // 784)
    engine = VLLMEngine(args.model, gpu_memory_utilization=0.5, max_model_len=context, seed=0, dtype="bfloat16",
                        min_pixels=784, max_pixels=pixels, image_pad_id=adapter.image_token_id,
                        adapter=adapter, max_images_per_prompt=args.turns, max_num_seqs=args.prompts * args.n,
                        processor_cache_gb=args.processor_cache_gb, mm_uuids=bool(args.mm_uuids),
                        skip_empty_hf_calls=bool(args.skip_empty_hf),
                        fast_placeholder_search=bool(args.fast_placeholders),
                        # the fixed-length runs: the benchmark's own probe below, synchronized around the encoder;
                        # varied lengths and continuous turns: the engine's own (train.py's rollout.gen_breakdown)
                        gen_breakdown=args.lengths == "varied" or bool(args.continuous))
    banned = adapter.banned_token_ids
    whole = SamplingParams(n=args.n, max_new_tokens=args.turns * args.turn_tokens, banned_token_ids=banned, seed=1)
    turn = SamplingParams(n=args.n, max_new_tokens=args.turn_tokens, banned_token_ids=banned, seed=1)
    pixels_in = engine.reads_pixel_values  # False for vLLM: as Rollouts builds its inputs
    inputs = [Episode.start(i, p).engine_input(pixels_in) for i, p in enumerate(prompts)]
    engine.generate(inputs[:2], SamplingParams(n=2, max_new_tokens=8, banned_token_ids=banned))  # warm-up
    if args.lengths == "varied" or args.continuous:
        result = varied_turns(args, engine, prompts, encoder, processor.tokenizer.convert_tokens_to_ids(
            adapter.end_of_turn), banned)
        print(json.dumps(result))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result) + "\n")
        return result
    probe = GenerationProbe(engine, synced=True)

    profiles: dict[str, dict] = {}
    probe.begin()
    gens, single_s = _call(engine, inputs, whole, args, "single_turn", profiles)
    single_tokens = sum(len(g.token_ids) for g in gens)
    single_breakdown = probe.report(engine.last_stats)

    episodes = [Episode.start(i, p) for i, p in enumerate(prompts) for _ in range(args.n)]
    multi_s, multi_tokens, tool_s, crop_s, turn_s, turns = 0.0, 0, 0.0, 0.0, [], []
    end_id = processor.tokenizer.convert_tokens_to_ids(adapter.end_of_turn)
    for t in range(args.turns):
        start = time.perf_counter()
        batch = inputs if t == 0 else [e.engine_input(pixels_in) for e in episodes]
        input_s = time.perf_counter() - start
        params = turn if t == 0 else SamplingParams(n=1, max_new_tokens=args.turn_tokens, banned_token_ids=banned,
                                                    seed=1 + t)
        probe.begin()
        if t in (0, args.turns - 1):  # turn 1 and the last turn: profiled under --profile-turns 1
            gens, s = _call(engine, batch, params, args, f"turn_{t + 1}", profiles)
        else:
            gens, s = _timed(engine, batch, params)
        del batch
        multi_s += s
        turn_s.append(round(s, 3))
        turns.append({"turn": t + 1, "s": round(s, 3), **probe.report(engine.last_stats, input_s)})
        multi_tokens += sum(len(g.token_ids) for g in gens)
        for e, g in zip(episodes, gens):
            e.add_model_turn(g)
        if t < args.turns - 1:
            start = time.perf_counter()
            results = tool_results([e.images[0] for e in episodes], args, t)
            crop_s += time.perf_counter() - start
            start = time.perf_counter()
            for e, (ids, pix, grid, images) in zip(episodes, encoder.encode_many(results)):
                # generation was forced to full length: the turn's last token stands in for the
                # end-of-turn token a stopping model writes before a tool message
                e.token_ids[-1] = end_id
                e.add_tool_tokens(ids, pix, grid, images)
            tool_s += time.perf_counter() - start
    hit = engine.last_stats.get("cached_prompt_tokens", 0) / max(engine.last_stats.get("prompt_tokens", 1), 1)
    same_total = {}
    if args.same_total:
        # single-turn at the same total tokens: the episodes' prompts and tool messages up front, their model
        # tokens in one turn (as a model that got every image at once would generate)
        flat = same_total_inputs(episodes, pixels_in)
        probe.begin()
        gens, s = _timed(engine, flat, SamplingParams(n=1, max_new_tokens=args.turns * args.turn_tokens,
                                                      banned_token_ids=banned, seed=1))
        tokens = sum(len(g.token_ids) for g in gens)
        same_total = {"same_total_tokens": tokens, "same_total_s": round(s, 3),
                      "same_total_tokens_per_s": round(tokens / s, 1),
                      "same_total_prompt_tokens": sum(len(f.input_ids) for f in flat),
                      "ratio_same_total": round((multi_tokens / multi_s) / (tokens / s), 3),
                      "same_total_breakdown": probe.report(engine.last_stats)}
    probe.close()
    result = {
        "multi_turn": True, "model": Path(args.model).name, "prompts": args.prompts, "n": args.n,
        "turns": args.turns, "turn_tokens": args.turn_tokens, "image_side": args.side,
        "processor_cache_gb": args.processor_cache_gb,
        "single_turn_tokens": single_tokens, "single_turn_s": round(single_s, 3),
        "single_turn_tokens_per_s": round(single_tokens / single_s, 1),
        "multi_turn_tokens": multi_tokens, "multi_turn_s": round(multi_s, 3),
        "multi_turn_tokens_per_s": round(multi_tokens / multi_s, 1),
        "ratio": round((multi_tokens / multi_s) / (single_tokens / single_s), 3),
        "turn_s": turn_s, "tool_images": not args.text_tools, "tool_message_s": round(tool_s, 3),
        "crop_s": round(crop_s, 3), "last_turn_prefix_cache_hit": round(hit, 3),
        "episode_tokens_max": max(len(e.token_ids) for e in episodes),
        "crops": args.crops, "mm_uuids": bool(args.mm_uuids), "skip_empty_hf": bool(args.skip_empty_hf),
        "fast_placeholders": bool(args.fast_placeholders),
        "single_turn_breakdown": single_breakdown, "turn_breakdown": turns,
        "profile_turns": bool(args.profile_turns), **same_total,
    }
    if args.profile_turns:
        per_step(profiles, {"single_turn": single_breakdown, **{f"turn_{b['turn']}": b for b in turns}})
        result["profiles"] = profiles
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
