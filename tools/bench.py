"""The benchmark suite: training MFU, generation throughput, refit, sleep/wake, GRPO step phases.

    python tools/bench.py --size 3b                         # one GPU, Qwen2.5-VL-3B shapes, vLLM
    python tools/bench.py --size tiny --engine torch        # CPU smoke run at tiny size
    python tools/bench.py --size 3b --append                # also append to docs/benchmarks.*

One run measures, on one model:
- training: packed micro-batches of prompt (with image) + response sequences through the policy's
  forward/backward and an AdamW step; tokens/s and MFU. `mfu_llm` counts the language model's
  FLOPs the way EasyR1/veRL do (6·N·tokens with N the dense parameters including embedding and
  lm_head, plus 12·Σ seqlen²·head_dim·heads·layers for attention); `mfu_total` adds the vision
  tower's FLOPs for the images it actually ran (once per distinct image). Peak: --peak-tflops
  (989 for an H100/H200 SXM in dense bf16).
- padding waste: the token slots computed beyond the real tokens (padded rows, dummy
  micro-batches that keep ranks in step), as a fraction of all slots computed.
- generation: the in-process engine on the same prompts as a standalone vLLM (`LLM(...)` with
  its defaults, in a child process, run first so it has the GPU alone); `gen_vs_standalone`. With
  `--standalone-inproc` a second child runs the same with vLLM's engine core in its own process's
  thread (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the trainer's engine runs: scheduling, the model's
  steps and the outputs' processing on one interpreter), `standalone_inproc_gen_tokens_per_s`.
- refit seconds (full weights from the policy into the engine), sleep and wake seconds.
- a few full GRPO steps with per-phase seconds; `overhead_frac` is the share of a step that is
  neither generation nor training (logprobs, scoring, refit, offload and reload, sleep, wake).

Prints one JSON object; `--append` adds it to docs/benchmarks.jsonl and a row to the table in
docs/benchmarks.md. Where a target of issue 6 is missed, the row says by how much.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from models.flops import llm_flops, row_flops  # noqa: E402,F401  (llm_flops: tests read it here)

TARGETS = {"mfu_llm": (">=", 0.45), "refit_s": ("<=", 0.5), "sleep_wake_s": ("<=", 1.0),
           "gen_vs_standalone": (">=", 0.95), "padding_waste": ("<=", 0.05), "overhead_frac": ("<=", 0.05)}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="3b", help="make_tiny_model size: tiny, demo, 3b (or qwen3_5_4b)")
    p.add_argument("--family", default="qwen2_5_vl", help="make_tiny_model family")
    p.add_argument("--workdir", default="/tmp/vlrl_bench")
    p.add_argument("--engine", default="auto", choices=["auto", "torch", "vllm"])
    p.add_argument("--image-size", type=int, default=448, help="square image side in pixels")
    p.add_argument("--response-len", type=int, default=1024, help="response tokens per training sequence")
    p.add_argument("--train-seqs", type=int, default=64, help="sequences per training step")
    p.add_argument("--group", type=int, default=8, help="responses per prompt (share one image)")
    p.add_argument("--train-steps", type=int, default=3, help="measured training steps (after one warm-up)")
    p.add_argument("--max-tokens", type=int, default=16384, help="optim.max_tokens_per_microbatch")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--attn", default="auto", help="model.attn_implementation")
    p.add_argument("--gen-prompts", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=512, help="new tokens per response in the generation test")
    p.add_argument("--gen-repeats", type=int, default=3,
                   help="timed generation calls, after one warm-up call on the same requests (the median reported)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--grpo-steps", type=int, default=2, help="full GRPO steps timed (after one warm-up)")
    p.add_argument("--grpo-prompts", type=int, default=16)
    p.add_argument("--grpo-new-tokens", type=int, default=256)
    p.add_argument("--no-standalone", action="store_true", help="skip the standalone vLLM comparison")
    p.add_argument("--standalone-inproc", action="store_true",
                   help="also time the standalone vLLM with its engine core in-process "
                        "(VLLM_ENABLE_V1_MULTIPROCESSING=0, as in the trainer): standalone_inproc_*")
    p.add_argument("--peak-tflops", type=float, default=None, help="default: 989 on CUDA, 0 (no MFU) on CPU")
    p.add_argument("--phases", default="train,engine,grpo", help="comma-separated subset of train,engine,grpo")
    p.add_argument("--json-out", default=None, help="also write the JSON object to this file")
    p.add_argument("--phase-clock", action="store_true",
                   help="time one extra training step's phases without a profiler (models.phases.PhaseClock: each "
                        "phase's host seconds and device span), printed and kept as phase_clock")
    p.add_argument("--profile", default=None,
                   help="profile one extra training step with torch.profiler and write its op table to this file")
    p.add_argument("--empty-cache", action="store_true",
                   help="empty torch's CUDA cache before each timed (and the profiled) training step, untimed, as "
                        "the loop's engine wake does: each step then regrows the cache through the driver")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the trainer the benchmark builds (repeatable)")
    p.add_argument("--append", action="store_true", help="append to docs/benchmarks.jsonl and docs/benchmarks.md")
    p.add_argument("--append-from", default=None,
                   help="append a JSON object a run wrote (e.g. on another machine) and exit")
    p.add_argument("--standalone-child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- FLOPs -----------------------------------------------------------------------------------
def vision_flops(vision_model, grids: list[torch.Tensor]) -> float:
    """Training FLOPs of the vision tower for these images: 6·N·patches plus full attention per image
    (an upper bound for Qwen2.5-VL's windowed blocks)."""
    n = sum(p.numel() for p in vision_model.parameters() if p.dim() >= 2)
    cfg = vision_model.config
    width = getattr(cfg, "hidden_size", None) if hasattr(cfg, "out_hidden_size") else getattr(cfg, "embed_dim", None)
    patches = [int(g.prod()) for grid in grids for g in grid.reshape(-1, 3)]
    return 6.0 * n * sum(patches) + 12 * sum(p * p for p in patches) * (width or 0) * cfg.depth


# --- helpers -----------------------------------------------------------------------------------
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def _timed_calls(fn, repeats: int) -> tuple[list[float], object]:
    """One untimed warm-up call, then `repeats` timed calls of `fn` (the same work): each call's seconds and the
    last call's result. The warm-up runs the very requests timed, so every kernel and batch shape the timed calls
    meet (Triton's specializations, CUDA graphs by batch size) is built before the clock starts."""
    fn()
    runs = [_timed(fn) for _ in range(max(repeats, 1))]
    return [seconds for seconds, _ in runs], runs[-1][1]


def _prepare(args) -> tuple[Path, Path]:
    from tools.make_dataset import make_dataset
    from tools.make_tiny_model import make_tiny_model

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = work / (f"model_{args.size}" if args.family == "qwen2_5_vl" else f"model_{args.family}_{args.size}")
    if not (model / "config.json").is_file():
        cuda = torch.cuda.is_available()
        print(f"bench: building the {args.family} {args.size} model in {model}", flush=True)
        make_tiny_model(model, family=args.family, size=args.size, seed=0, overwrite=True, verbose=True,
                        device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32")
    data = work / f"clevr_{args.image_size}.parquet"
    if not data.is_file():
        rows = max(args.train_seqs // args.group, args.gen_prompts, args.grpo_prompts * 4) * 2
        make_dataset("clevr", rows, 0, data, size=(args.image_size, args.image_size))
    return model, data


def _config(args, model: Path, data: Path):
    from grpo.config import load_config

    pixels = args.image_size * args.image_size
    return load_config(None, [
        "trainer.mode=grpo", f"model.path={model}", f"data.train_path={data}", "data.task=clevr",
        f"data.min_pixels={pixels}", f"data.max_pixels={pixels}", f"rollout.engine={args.engine}",
        f"rollout.n={args.group}", f"rollout.max_new_tokens={args.grpo_new_tokens}",
        f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"data.prompts_per_step={args.grpo_prompts}", f"optim.max_tokens_per_microbatch={args.max_tokens}",
        f"model.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        f"model.attn_implementation={args.attn}", "optim.lr=1e-6", "trainer.run_dir=/tmp/vlrl_bench/run",
        "checkpoint.resume=never", "logging.tensorboard=false", "logging.stdout=false", "trainer.progress=false",
        *args.set,
    ])


# --- standalone vLLM (child process) ---------------------------------------------------------------
def standalone(args) -> dict:
    """Plain `vllm.LLM` with its defaults on the bench prompts; runs alone in its own process."""
    from vllm import LLM
    from vllm import SamplingParams as VSP

    from data.datasets import VLDataset
    from data.loader import PromptFeeder
    from data.processing import load_processor
    from rollout.weight_names import collapse_image_pads

    model, data = _prepare(args)
    cfg = _config(args, model, data)
    proc = load_processor(str(model))
    ds = VLDataset(str(data), "clevr", min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    prompts = PromptFeeder(ds, proc, "clevr", seed=0, shuffle=False, max_prompt_tokens=cfg.data.max_prompt_tokens,
                           rank=0, world=1).next(args.gen_prompts)
    pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    requests = [{"prompt_token_ids": collapse_image_pads(p.input_ids.tolist(), pad),
                 "multi_modal_data": {"image": list(p.images)}} for p in prompts]
    pixels = cfg.data.min_pixels
    t_build, llm = _timed(lambda: LLM(
        model=str(model), dtype="bfloat16", load_format="dummy", gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=cfg.data.max_prompt_tokens + args.gen_tokens, seed=0, generation_config="vllm",
        mm_processor_kwargs={"size": {"shortest_edge": pixels, "longest_edge": pixels}, "do_resize": False},
        limit_mm_per_prompt={"image": 1, "video": 0}))
    sp = VSP(n=args.group, temperature=1.0, max_tokens=args.gen_tokens, ignore_eos=True, logprobs=0, detokenize=False)
    seconds, outs = _timed_calls(lambda: llm.generate(requests, sp, use_tqdm=False), args.gen_repeats)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"standalone_build_s": t_build, "standalone_gen_tokens": tokens,
            "standalone_gen_tokens_per_s": tokens / statistics.median(seconds), "standalone_gen_s_all": seconds}


def _run_standalone(args) -> dict:
    """The standalone vLLM's numbers from a child process (standalone_*), and with --standalone-inproc a second
    child's with the engine core in-process (standalone_inproc_*)."""
    result = _standalone_child(args, "standalone", {})
    if args.standalone_inproc:
        inproc = _standalone_child(args, "standalone_inproc", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        result.update({k.replace("standalone_", "standalone_inproc_", 1): v for k, v in inproc.items()})
    return result


def _standalone_child(args, name: str, extra_env: dict) -> dict:
    out = Path(args.workdir) / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--standalone-child", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    print(f"bench: standalone vLLM in a child process{' ' + str(extra_env) if extra_env else ''}", flush=True)
    proc = subprocess.run(cmd, env={**env, **extra_env}, cwd=ROOT)
    if proc.returncode or not out.is_file():
        return {"standalone_error": f"child exited {proc.returncode}"}
    return json.loads(out.read_text())


# --- the in-process measurements -------------------------------------------------------------
def bench_train(trainer, args) -> dict:
    """SFT-shaped steps over packed prompt+response sequences: the cost of a PPO update."""
    from contextlib import nullcontext

    from grpo.trainer import freeze_survivors
    from grpo.update import PackedStep, optimizer_step
    from rollout.telemetry import host_clock, phase

    prompts = trainer.feeder.next(max(args.train_seqs // args.group, 1))
    g = torch.Generator().manual_seed(0)
    vocab = len(trainer.tokenizer) - 64  # ordinary tokens, away from the special ones at the end
    responses = [torch.randint(0, vocab, (args.response_len,), generator=g) for _ in range(len(prompts) * args.group)]
    owner = [i // args.group for i in range(len(responses))]
    batch = trainer._sequence_batch(prompts, responses, owner)
    seqlens = [t.numel() for t in batch["input_ids"].items]
    scored = args.response_len * len(responses)

    def loss_fn(lp, mb, den):
        return -lp.sum() / den["tokens"], {}

    share = trainer.policy.shared_prompts
    max_tokens = trainer.cfg.optim.max_tokens_per_microbatch  # --max-tokens, or a --set of it, which comes later

    def packed():  # packed in every step, as the trainer packs each step's experience
        return PackedStep(batch, max_tokens, trainer.policy.device, share)

    def step():
        return optimizer_step(trainer.policy, trainer.optimizer, packed(), loss_fn, max_tokens=max_tokens,
                              grad_clip=1.0, denominators={"tokens": scored},
                              unsharded_accumulation=trainer.cfg.optim.unsharded_accumulation)

    def empty():  # what --empty-cache asks for before a step, untimed
        if args.empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def emptied():
        empty()
        with phase("perf/train_s"):  # the NVML readings, where the trainer's sampler runs
            return _timed(step)[0]

    step()  # warm-up: optimizer state, allocator, kernels
    if trainer.cfg.trainer.gc_freeze:  # what the loop does after its first step
        freeze_survivors()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    retries, allocs = _alloc_retries(), _device_allocs()
    # the loop's trainer.gpu_telemetry readings for the same pass (GPU busy, clocks; the host's cores), so the update
    # alone and in the loop compare on more than time
    sampler, start = trainer.telemetry, host_clock()
    with sampler or nullcontext():
        times = [emptied() for _ in range(args.train_steps)]
        if sampler:  # its phase readings hold the host's cores over the timed steps too
            readings = sampler.step_metrics(trainer.policy.device)
        else:  # no sampler (no CUDA or NVML): the host's cores over the steps from the same clocks
            end = host_clock()
            wall = end[0] - start[0]
            readings = {"host/process_cores_train": (end[1] - start[1]) / wall,
                        "host/main_thread_cores_train": (end[3] - start[3]) / wall}
    retries = (_alloc_retries() - retries) / max(args.train_steps, 1)
    allocs = (_device_allocs() - allocs) / max(args.train_steps, 1)
    seconds = statistics.median(times)
    clocked = _phase_clock(step, trainer.policy.device) if args.phase_clock else {}
    if args.profile:
        empty()
    prof = _profile(step, Path(args.profile)) if args.profile else None
    rows = [mb for mb in packed().microbatches if mb.sample_indices]
    bins = [mb.sample_indices for mb in rows]
    slots = sum(max(sum(seqlens[i] for i in b), 2) for b in bins)
    model = trainer.policy.model
    text_cfg = getattr(model.config, "text_config", model.config)
    distinct = [p.image_grid_thw for p in prompts if p.image_grid_thw is not None]
    f_llm = row_flops(text_cfg, rows)  # the FLOPs the rows run: with shared prompts each prompt once a row
    f_vis = vision_flops(trainer.adapter.vision_tower(model), distinct)
    return {
        "shared_prompts": share, "vision_once": trainer.policy.vision_once,
        "pad_vision_mlp": trainer.policy.pad_vision_mlp, "torch_rms_norms": trainer.policy.torch_rms_norms,
        "flash_direct": trainer.policy.flash_direct, "liger_mlp": trainer.cfg.model.liger_mlp,
        "row_tokens": sum(mb.num_tokens for mb in rows),
        "train_seqs": len(seqlens), "train_tokens": sum(seqlens), "train_microbatches": len(bins),
        "train_step_s": seconds, "train_step_s_all": times, "train_tokens_per_s": sum(seqlens) / seconds,
        "llm_tflops_per_step": f_llm / 1e12, "vision_tflops_per_step": f_vis / 1e12,
        "achieved_tflops_llm": f_llm / seconds / 1e12, "achieved_tflops_total": (f_llm + f_vis) / seconds / 1e12,
        "padding_waste": 1.0 - sum(seqlens) / slots, "peak_mem_gb_train": _peak_gb(),
        "alloc_retries_per_step": retries, "device_allocs_per_step": allocs, "empty_cache": args.empty_cache,
        # the profiled step: its host waits for the GPU, and on CUDA its kernels' busy and idle seconds under the profiler
        **({"host_syncs": prof["host_syncs"]} if prof and prof["host_syncs"] is not None else {}),
        **({f"profiled_{k}": prof[k] for k in ("block_s", "busy_s", "idle_s") if k in prof} if prof else {}),
        **clocked,  # --phase-clock: phase_clock ({phase: count, host_s, device_s}) and phase_clock_step_s
        # named as tools/loop_summary.py names the loop's: util_pct_mean_train, main_thread_cores_train, ...
        **{k.split("/", 1)[1]: v for k, v in readings.items() if k.startswith(("gpu/", "host/"))},
    }


def _phase_clock(step, device) -> dict:
    """One step with its phase ranges timed, no profiler (models.phases.PhaseClock); the table printed."""
    from models.phases import PhaseClock, clock_table

    with PhaseClock(device) as clock:
        wall = _timed(step)[0]
    totals = clock.totals()
    print(clock_table(totals, wall), flush=True)
    return {"phase_clock": totals, "phase_clock_step_s": wall}


def _profile(step, out: Path) -> dict:
    """One step under torch.profiler (`rollout.telemetry.profiled`: the ops by device time, by CPU time without
    CUDA; on CUDA where the device sat idle). Returns profiled's result: `host_syncs`, the step's
    `cudaStreamSynchronize` calls (each a wait of the host for the GPU's queue; None without CUDA), `block_s`,
    and on CUDA `busy_s` and `idle_s`."""
    from rollout.telemetry import profiled

    with profiled(out, "profiled step") as result:
        step()
    print(f"bench: profile of one training step written to {out}", flush=True)
    return result


def _alloc_retries() -> int:
    """How often torch's allocator has freed its cache to retry an allocation (each retry waits for the device)."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if torch.cuda.is_available() else 0


def _device_allocs() -> int:
    """The caching allocator's driver allocations so far (cudaMalloc, or cuMemMap with expandable segments)."""
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0)) if torch.cuda.is_available() else 0


def _peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def bench_engine(trainer, args) -> dict:
    """Refit, sleep/wake and generation through the trainer's own engine."""
    from rollout.base import PromptInput, SamplingParams

    t_build, engine = _timed(trainer._engine)  # builds (after emptying torch's cache), then refits
    refits = [trainer.refit() for _ in range(3)]
    out = {"engine": type(engine).__name__, "engine_build_s": t_build, "refit_s": statistics.median(refits),
           "refit_s_all": refits}
    if hasattr(engine, "memory_gb"):
        before = engine.memory_gb()["device_used"]
        sleep_s, _ = _timed(engine.sleep)
        asleep = engine.memory_gb()["device_used"]
        wake_s, _ = _timed(engine.wake)
        out.update(sleep_s=sleep_s, wake_s=wake_s, sleep_freed_gb=before - asleep, device_used_awake_gb=before)
    else:
        sleep_s, _ = _timed(engine.sleep)
        wake_s, _ = _timed(engine.wake)
        out.update(sleep_s=sleep_s, wake_s=wake_s)
    out["sleep_wake_s"] = out["sleep_s"] + out["wake_s"]
    prompts = trainer.feeder.next(args.gen_prompts)
    inputs = [PromptInput(p.input_ids.tolist(), p.images, p.pixel_values, p.image_grid_thw) for p in prompts]
    params = SamplingParams(n=args.group, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.gen_tokens,
                            stop_token_ids=[], banned_token_ids=trainer.adapter.banned_token_ids, seed=None)
    seconds, gens = _timed_calls(lambda: engine.generate(inputs, params), args.gen_repeats)
    tokens = sum(len(g.token_ids) for g in gens)
    gen_s = statistics.median(seconds)
    out.update(gen_tokens=tokens, gen_s=gen_s, gen_s_all=seconds, gen_tokens_per_s=tokens / gen_s)
    return out


def bench_grpo(trainer, args) -> dict:
    """Full GRPO steps through the trainer; the first is a warm-up and is not reported."""
    from grpo.update import lr_at

    per_rank = args.grpo_prompts // trainer.dims.dp
    rows = []
    for i in range(args.grpo_steps + 1):
        trainer.step += 1
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr_at(trainer.step, trainer.cfg.optim, 10**6)
        seconds, m = _timed(lambda: trainer.grpo_step(per_rank))
        m["perf/step_s"] = seconds
        if i:
            rows.append(m)
    keys = ["perf/step_s", "perf/gen_s", "perf/logprob_s", "perf/score_s", "perf/train_s", "perf/refit_s"]
    phases = {k.split("/")[1]: statistics.median(r[k] for r in rows) for k in keys}
    overhead = phases["step_s"] - phases["gen_s"] - phases["train_s"]
    return {"grpo_" + k: v for k, v in phases.items()} | {
        "overhead_frac": overhead / phases["step_s"],
        "grpo_token_mult_prob_error": statistics.median(r["fidelity/token_mult_prob_error"] for r in rows),
        "grpo_response_len_mean": statistics.median(r["rollout/response_len_mean"] for r in rows),
    }


def _checkpoint(result: dict, args) -> None:
    """Write what is measured so far, so a phase that fails later does not lose the earlier ones."""
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result) + "\n", encoding="utf-8")


def run(args) -> dict:
    from grpo.trainer import Trainer
    from models.parallel import allocator_settings, init_distributed

    model, data = _prepare(args)
    cuda = torch.cuda.is_available()
    result = {"date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
              "command": "python tools/bench.py " + " ".join(sys.argv[1:]),
              "model": f"{args.family} size {args.size}", "torch": torch.__version__}
    from rollout.factory import resolve_engine_name

    phases = set(args.phases.split(","))
    unknown = phases - {"train", "engine", "grpo"}
    if unknown:
        raise SystemExit(f"bench: unknown phases {sorted(unknown)}; choose from train, engine, grpo")
    engine = resolve_engine_name(args.engine)
    if engine == "vllm" and "engine" in phases and not args.no_standalone:
        result.update(_run_standalone(args))
        _checkpoint(result, args)
    cfg = _config(args, model, data)
    allocator_settings(cfg.parallel.expandable_segments)
    init_distributed()
    trainer = Trainer(cfg)
    result["params_b"] = sum(p.numel() for p in trainer.policy.model.parameters()) / 1e9
    plan = trainer.colocation.make_plan()  # printed with its warnings (on a GPU) before the update can run out
    if plan is not None:
        result["plan_training_peak_gb"] = plan.training_peak / 2**30
        result["plan_warnings"] = plan.warnings
    result["attn_implementation"] = trainer.policy.model.config._attn_implementation
    result["activation_checkpointing"] = cfg.model.activation_checkpointing  # as run: a --set of it comes later
    result["one_device"] = cfg.parallel.one_device
    result["liger_kernel"] = trainer.policy.liger_kernel  # model.liger_kernel as settled (auto: family and device)
    if "train" in phases:
        result.update(bench_train(trainer, args))
        peak = args.peak_tflops if args.peak_tflops is not None else (989.0 if cuda else 0.0)
        if peak:
            result["peak_tflops"] = peak
            result["mfu_llm"] = result["achieved_tflops_llm"] / peak
            result["mfu_total"] = result["achieved_tflops_total"] / peak
    _checkpoint(result, args)
    if "engine" in phases:
        result.update(bench_engine(trainer, args))
        if "standalone_gen_tokens_per_s" in result:
            result["gen_vs_standalone"] = result["gen_tokens_per_s"] / result["standalone_gen_tokens_per_s"]
        if "standalone_inproc_gen_tokens_per_s" in result:
            result["gen_vs_standalone_inproc"] = (result["gen_tokens_per_s"]
                                                  / result["standalone_inproc_gen_tokens_per_s"])
    _checkpoint(result, args)
    if "grpo" in phases:
        result.update(bench_grpo(trainer, args))
    result["peak_mem_gb"] = max(_peak_gb(), result.get("peak_mem_gb_train", 0.0))
    result["missed"] = missed_targets(result)
    return result


def missed_targets(result: dict) -> dict:
    """Each issue-6 target this run missed, with the measured value and the shortfall."""
    out = {}
    for key, (op, goal) in TARGETS.items():
        value = result.get(key)
        if value is None:
            continue
        ok = value >= goal if op == ">=" else value <= goal
        if not ok:
            out[key] = {"value": round(value, 4), "target": f"{op} {goal}",
                        "off_by": round(abs(value - goal) / goal, 3)}
    return out


def _fmt(v, digits=3):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    return str(v)


# The "Current numbers" table at the top of docs/benchmarks.md: per target, the newest row of
# benchmarks.jsonl that carries its key. (label, key, comparison, goal, how to print the value)
CURRENT = [
    ("GRPO step through train.py, 3B recipe, 1 GPU (s, steps 3+)", "loop_step_s", "<=", 6.0, "{:.2f}"),
    ("training MFU, LLM FLOPs / 989 TFLOP/s", "mfu_llm", ">=", 0.45, "{:.1%}"),
    ("in-loop generation / standalone vLLM, same requests", "loop_gen_vs_standalone", ">=", 0.90, "{:.2f}"),
    ("everything but generation, logprobs + update and refit, share of a step", "overhead_frac", "<=", 0.05,
     "{:.1%}"),
    ("sleep + wake, steady state (s)", "sleep_wake_s", "<=", 1.0, "{:.2f}"),
    ("first step beyond a steady step (s)", "first_step_extra_s", "<=", 30.0, "{:.1f}"),
    ("token_mult_prob_error in the loop (3B shape, random weights)", "token_mult_prob_error", "<=", 1.02, "{:.4f}"),
]
# targets set for a machine that has run the recipe before (its compile and kernel caches warm): a row marked
# `"machine_first_run": true` (the machine's first run of that model, which builds them) stays out of these, and
# a variant whose overrides act only from step 2 (`"first_step_as_shipped": true`) counts as the recipe for them
WARM_MACHINE_KEYS = {"first_step_extra_s"}
CURRENT_START, CURRENT_END = "<!-- current numbers: tools/bench.py regenerates this table -->", "<!-- end of current numbers -->"


def current_table(rows: list[dict]) -> str:
    """Markdown: target, value, met, command, date and machine, from the newest `train.py` loop row
    (one with loop_step_s) of the recipe as shipped (no `overrides`) that carries each key: the user's
    path is the number that counts. The first step's target is set for a machine that has run the recipe: it
    reads no row of a machine's first run (`"machine_first_run": true`), and does read a variant whose
    overrides act only from step 2 (`"first_step_as_shipped": true`). A row with `"current": false` (a machine
    that ran well below the others, its note says by how much) stays in the record but out of this table."""
    lines = [CURRENT_START, "## Current numbers", "",
             "| target | goal | value | met | command | date | machine |", "|---|---|---|---|---|---|---|"]
    for label, key, op, goal, fmt in CURRENT:
        row = next((r for r in reversed(rows) if "loop_step_s" in r and r.get("current", True)
                    and (not r.get("overrides") or key in WARM_MACHINE_KEYS and r.get("first_step_as_shipped"))
                    and isinstance(r.get(key), (int, float))
                    and not (key in WARM_MACHINE_KEYS and r.get("machine_first_run"))), None)
        if row is None:
            lines.append(f"| {label} | {op} {goal} | not measured | | | | |")
            continue
        value = row[key]
        met = value >= goal if op == ">=" else value <= goal
        cmd = str(row.get("command", "")).replace("|", "\\|")
        lines.append(f"| {label} | {op} {goal} | {fmt.format(value)} | {'yes' if met else 'no'} | `{cmd}` | "
                     f"{row.get('date', '')} | {row.get('device', '')} |")
    return "\n".join(lines + ["", CURRENT_END])


def write_current(md: Path, rows: list[dict]) -> None:
    """Put the current table right under the page's title (replacing the previous one)."""
    text = md.read_text(encoding="utf-8")
    if CURRENT_START in text:
        head, _, rest = text.partition(CURRENT_START)
        _, _, tail = rest.partition(CURRENT_END)
        text = head + current_table(rows) + tail
    else:
        title, _, body = text.partition("\n")
        text = f"{title}\n\n{current_table(rows)}\n{body}"
    md.write_text(text, encoding="utf-8")


def read_rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def append(result: dict) -> None:
    jsonl = ROOT / "docs" / "benchmarks.jsonl"
    with open(jsonl, "a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")
    md = ROOT / "docs" / "benchmarks.md"
    write_current(md, read_rows(jsonl))
    if "mfu_total" not in result and "train_step_s" not in result:
        return  # a loop row: the current table is its place
    text = md.read_text(encoding="utf-8")
    header = "## Benchmark suite (`tools/bench.py`)"
    cols = ["date", "device", "model", "attn_implementation", "activation_checkpointing", "mfu_llm", "mfu_total", "train_tokens_per_s", "gen_tokens_per_s",
            "gen_vs_standalone", "refit_s", "sleep_s", "wake_s", "padding_waste", "overhead_frac", "peak_mem_gb"]
    if header not in text:
        text += (f"\n{header}\n\nOne row per run of `tools/bench.py --append`; the full JSON (command, every "
                 "phase, missed targets) is the same run's line in `benchmarks.jsonl`.\n\n| "
                 + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
    row = "| " + " | ".join(_fmt(result.get(c)) for c in cols) + " |\n"
    head, _, tail = text.partition(header)
    table_end = tail.find("\n\n", tail.find("|---|"))
    tail = tail + row if table_end < 0 else tail[:table_end + 1] + row + tail[table_end + 1:]
    md.write_text(head + header + tail, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.standalone_child:
        Path(args.standalone_child).write_text(json.dumps(standalone(args)))
        return 0
    if args.append_from:
        for line in Path(args.append_from).read_text(encoding="utf-8").splitlines():
            if line.strip():
                append(json.loads(line))
        return 0
    result = run(args)
    print(json.dumps(result), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result) + "\n", encoding="utf-8")
    if args.append:
        append(result)
    from models.parallel import shutdown_distributed

    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
