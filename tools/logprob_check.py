"""Generate with an engine, recompute with the policy, report how well the logprobs agree.

    python tools/logprob_check.py --model DIR --data FILE --task clevr --engine torch --num-prompts 8 --n 4
    torchrun --nproc-per-node 2 tools/logprob_check.py ... --packing padded
    python tools/logprob_check.py ... --engine vllm --exact --time-train   # rollout.exact=true, with timings

Prints one JSON object: packed_vs_padded_max_abs_dlogp (the policy's logprobs of the same tokens
with and without packing), token_mult_prob_error {mean, median, max} over sequences (each
sequence's mean of exp(|lp_engine − lp_policy|)), gen_kl, tokens, engine, dtype, and the worst
tokens with their context; `--png` draws per-token |Δlogprob| for the worst sequences. Also: max_abs_dlogprob
(the largest |lp_engine − lp_policy| over all scored tokens; 0 in exact mode), exact, model, and the seconds
of generation (gen_s), of the policy's scoring pass (score_s) and, with `--time-train`, of one forward and
backward over the batch (train_s) — the throughput cost of `--exact` is these against a run without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from grpo.config import load_config  # noqa: E402
from grpo.run_folder import scratch_run_dir  # noqa: E402


def add_run_arguments(p: argparse.ArgumentParser, *, num_prompts: int, n: int, max_new_tokens: int) -> None:
    """The model, data, engine and sampling arguments shared by the engine-vs-policy tools."""
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--task", default="clevr")
    p.add_argument("--engine", default="auto", choices=["auto", "torch", "vllm"])
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--n", "--responses-per-prompt", dest="n", type=int, default=n,
                   help="responses per prompt (use the long name under torchrun, which claims --n)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, num_prompts=8, n=4, max_new_tokens=64)
    p.add_argument("--packing", default="packed", choices=["packed", "padded"],
                   help="padded: one sequence per micro-batch (no packing)")
    p.add_argument("--min-pixels", type=int, default=3136)
    p.add_argument("--max-pixels", type=int, default=12544)
    p.add_argument("--worst", type=int, default=5, help="how many worst tokens to show")
    p.add_argument("--sharpen", type=float, default=1.0,
                   help="scale lm_head by this factor in a copy of the model first: a random model's near-uniform "
                        "next-token distributions hide mismatch; sharper ones resemble a trained model's "
                        "(entropy_mean in the output says how sharp)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--exact", action="store_true",
                   help="rollout.exact=true: batch-invariant vLLM and the policy on the engine's kernels")
    p.add_argument("--time-train", action="store_true",
                   help="also time one forward and backward of the policy over the batch (train_s), and the "
                        "generation and scoring once more with everything warm (gen_warm_s, score_warm_s)")
    p.add_argument("--profile-train", default=None, metavar="FILE",
                   help="with --time-train: one more forward and backward over the batch under torch.profiler, its "
                        "op table written to FILE (where exact mode's training time goes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a further config override, e.g. rollout.enforce_eager=true (repeatable)")
    p.add_argument("--png", default=None, help="write a PNG of per-token |dlogprob| for the worst sequences")
    return p.parse_args(argv)


def sharpened_copy(src: str, factor: float, out: Path) -> str:
    """A copy of the model folder with lm_head.weight × factor (rank 0 writes; every rank waits)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if dist.get_rank() == 0:
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in Path(src).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copyfile(f, tmp / f.name)
        for f in Path(src).glob("*.safetensors"):
            tensors = load_file(str(f))
            for name in [n for n in tensors if n.endswith("lm_head.weight")]:
                tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
            save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    dist.barrier()
    return str(out)


def check(args) -> dict:
    from grpo.trainer import Trainer

    if args.sharpen != 1.0:
        args.model = sharpened_copy(args.model, args.sharpen,
                                    scratch_run_dir("logprob_check") / f"sharpened_{args.sharpen:g}")
    max_tokens = 1 if args.packing == "padded" else 16384
    cfg = load_config(None, [
        f"model.path={args.model}", f"model.dtype={args.dtype}", f"data.train_path={args.data}",
        f"data.task={args.task}", f"rollout.engine={args.engine}", f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
        f"data.min_pixels={args.min_pixels}", f"data.max_pixels={args.max_pixels}",
        f"trainer.run_dir={scratch_run_dir('logprob_check')}", "checkpoint.resume=never", "logging.tensorboard=false",
        f"optim.max_tokens_per_microbatch={max_tokens}", f"data.prompts_per_step={args.num_prompts}",
        *(["rollout.exact=true"] if args.exact else []), *args.overrides,
    ])
    trainer = Trainer(cfg)
    per_rank = max(args.num_prompts // trainer.dims.dp, 1)
    prompts = trainer.feeder.next(per_rank)
    t0 = time.monotonic()
    gens = trainer.generate(prompts, trainer.sampling_params())
    gen_s = time.monotonic() - t0
    responses = [torch.tensor(g.token_ids, dtype=torch.long) for g in gens]
    batch = trainer._sequence_batch(prompts, responses, [g.prompt_index for g in gens])
    from grpo.update import sequence_logprobs

    t0 = time.monotonic()
    policy_lp, entropies = sequence_logprobs(trainer.policy, batch, max_tokens, args.temperature, with_entropy=True)
    score_s = _synced(t0, trainer.policy.device)
    other, _ = sequence_logprobs(trainer.policy, batch, 16384 if max_tokens == 1 else 1, args.temperature)
    diffs = [float((a - b).abs().max()) for a, b in zip(policy_lp, other) if a.numel()]
    report = _report(trainer, gens, policy_lp, batch, args, gen_s)
    ent = torch.tensor([float(torch.cat(entropies).sum()) if entropies else 0.0,
                        float(sum(e.numel() for e in entropies))], dtype=torch.float64, device=trainer.policy.device)
    dist.all_reduce(ent)
    report["entropy_mean"] = float(ent[0] / max(float(ent[1]), 1.0))
    report["sharpen"] = args.sharpen
    t = torch.tensor([max(diffs, default=0.0)], device=trainer.policy.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    report["packed_vs_padded_max_abs_dlogp"] = float(t.item())
    report.update(exact=trainer.cfg.rollout.exact, model=Path(args.model).name, score_s=score_s)
    mode = getattr(trainer.engine, "_exact", None)
    if mode is not None:
        report["exact_report"] = mode.report
    if args.time_train:
        # the same generation and scoring again, the engine built and every kernel warm: gen_s and score_s
        # include the engine's construction and first-call compilation
        t0 = time.monotonic()
        trainer.generate(prompts, trainer.sampling_params())
        report["gen_warm_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        sequence_logprobs(trainer.policy, batch, max_tokens, args.temperature, with_entropy=True)
        report["score_warm_s"] = _synced(t0, trainer.policy.device)
        try:
            report["train_s"] = _train_pass_s(trainer, batch, max_tokens, args.temperature)
            if args.profile_train:
                from tools.bench import _profile

                _profile(lambda: _train_pass_s(trainer, batch, max_tokens, args.temperature), Path(args.profile_train))
        except torch.OutOfMemoryError as err:  # the timing is extra: keep the fidelity report
            trainer.optimizer.zero_grad(set_to_none=True)
            report["train_s"], report["train_error"] = None, f"out of memory: {str(err).splitlines()[0]}"
    return report


def _synced(t0: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic() - t0


def _train_pass_s(trainer, batch, max_tokens: int, temperature: float) -> float:
    """Seconds of one forward and backward of every micro-batch (gradients dropped after), after one untimed
    micro-batch that warms the kernels up."""
    from grpo.update import as_packed

    policy = trainer.policy
    step = as_packed(batch, max_tokens, policy.device)
    micro = list(step)
    for i, (mb, _) in enumerate([micro[0]] + micro):
        if i == 1:
            t0 = time.monotonic()
        lp, _ = policy.logprobs(mb, temperature=temperature)
        lp.sum().backward()
    seconds = _synced(t0, policy.device)
    trainer.optimizer.zero_grad(set_to_none=True)
    return seconds


def _report(trainer, gens, policy_lp, batch, args, gen_s) -> dict:
    per_seq, worst, total_kl, tokens, max_abs = [], [], 0.0, 0, 0.0
    for i, (g, lp) in enumerate(zip(gens, policy_lp)):
        eng = torch.tensor(g.logprobs, dtype=torch.float64)
        d = (eng - lp.double()).abs()
        if d.numel() == 0:
            continue
        per_seq.append(float(torch.exp(d).mean()))
        max_abs = max(max_abs, float(d.max()))
        delta = lp.double() - eng
        total_kl += float((torch.exp(delta) - delta - 1).sum())
        tokens += d.numel()
        for t in torch.topk(d, min(args.worst, d.numel())).indices.tolist():
            ctx = trainer.tokenizer.decode(g.token_ids[max(0, t - 5): t + 1])
            worst.append({"seq": i, "pos": t, "abs_dlogp": float(d[t]), "engine": float(eng[t]),
                          "policy": float(lp[t]), "context": ctx})
    curves = sorted(((float((torch.tensor(g.logprobs, dtype=torch.float64) - lp.double()).abs().max()), i)
                     for i, (g, lp) in enumerate(zip(gens, policy_lp)) if lp.numel()), reverse=True)[:3]
    series = {f"rank{dist.get_rank()} seq {i}": [
        (t, float(abs(gens[i].logprobs[t] - float(policy_lp[i][t])))) for t in range(policy_lp[i].numel())]
        for _, i in curves}
    local = [json.dumps({"per_seq": per_seq, "worst": worst, "kl": total_kl, "tokens": tokens, "series": series,
                         "max_abs": max_abs})]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local[0])
    parts = [json.loads(x) for x in gathered]
    seqs = torch.tensor([v for p in parts for v in p["per_seq"]] or [1.0], dtype=torch.float64)
    all_tokens = sum(p["tokens"] for p in parts)
    worst_all = sorted((w for p in parts for w in p["worst"]), key=lambda w: -w["abs_dlogp"])[: args.worst]
    if args.png and dist.get_rank() == 0:
        from tools.plot_metrics import plot

        series = {k: v for p in parts for k, v in p["series"].items()}
        top = dict(sorted(series.items(), key=lambda kv: -max((y for _, y in kv[1]), default=0))[:3])
        plot(top, Path(args.png), title="per-token |logprob engine - logprob policy| (worst sequences)",
             xlabel="response token", unit_range=False)
    return {
        "token_mult_prob_error": {"mean": float(seqs.mean()), "median": float(seqs.median()), "max": float(seqs.max())},
        "token_mult_prob_error_median": float(seqs.median()), "token_mult_prob_error_max": float(seqs.max()),
        "max_abs_dlogprob": max(p["max_abs"] for p in parts),
        "gen_kl": sum(p["kl"] for p in parts) / max(all_tokens, 1),
        "tokens": all_tokens, "sequences": int(seqs.numel()),
        "engine": type(trainer.engine).__name__, "dtype": str(trainer.policy.dtype).replace("torch.", ""),
        "packing": args.packing, "ranks": dist.get_world_size(), "gen_s": gen_s,
        "worst_tokens": worst_all,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.profile_train and not args.time_train:
        raise SystemExit("logprob_check: --profile-train profiles the pass --time-train times; give both")
    from models.parallel import init_distributed, shutdown_distributed

    init_distributed()
    clean = False
    try:
        result = check(args)
        if dist.get_rank() == 0:
            text = json.dumps(result)
            print(text, flush=True)
            if args.out:
                Path(args.out).write_text(text + "\n")
        clean = True
    finally:
        shutdown_distributed(clean)
    return 0


if __name__ == "__main__":
    sys.exit(main())
