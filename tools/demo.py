"""The CPU demo: build a demo-size Qwen2.5-VL and generated CLEVR, SFT warm start, then GRPO.

    python tools/demo.py [--nproc 2] [--workdir artifacts/demo]      (what `make demo` runs)

Prints held-out greedy accuracy after SFT and after GRPO, and writes a PNG of the reward and
accuracy curves next to the GRPO run's TensorBoard logs. Everything is built locally; nothing
is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLEVR = dict(size=(112, 112), min_objects=1, max_objects=3, question_kinds=("all",), object_scale=1.8,
             shapes=("circle",), sizes=("large",), colors=("red",))


def _run(cmd: list[str]) -> str:
    """Run a stage, streaming its output, and return stdout (rank 0 prints the final eval line)."""
    print("$ " + " ".join(cmd), flush=True)
    # Prepend, not replace: packages reachable only through the caller's PYTHONPATH (a vLLM build,
    # for instance) must stay importable in every stage.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        if "Warning" in line or "warnings.warn" in line or line.startswith("W1") or "Loading weights" in line:
            continue
        lines.append(line)
        print(line, end="", flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"stage failed ({proc.returncode}): {' '.join(cmd)}")
    return "".join(lines)


def _final_eval(output: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith("final "):
            return json.loads(line[len("final "):])
    raise SystemExit("the run printed no final evaluation")


def torchrun(nproc: int, config: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "train.py", "--config", config, *overrides]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workdir", default="artifacts/demo")
    p.add_argument("--runs", default="runs")
    p.add_argument("--train-rows", type=int, default=3000)
    p.add_argument("--eval-rows", type=int, default=256)
    args, extra = p.parse_known_args(argv)
    from tools.make_dataset import make_dataset
    from tools.make_tiny_model import make_tiny_model

    t0 = time.monotonic()
    work = ROOT / args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model_init"
    if not (model / "config.json").is_file():
        make_tiny_model(model, family="qwen2_5_vl", size="demo", seed=0, overwrite=True)
    train, held_out = work / "train.parquet", work / "eval.parquet"
    if not train.is_file():
        make_dataset("clevr", args.train_rows, 1, train, **CLEVR)
    if not held_out.is_file():
        make_dataset("clevr", args.eval_rows, 2, held_out, **CLEVR)
    sft_run, grpo_run, merged = ROOT / args.runs / "demo_sft", ROOT / args.runs / "demo_grpo", work / "model_sft"
    data = [f"data.train_path={train}", f"data.eval_path={held_out}"]

    print("\n== stage 1: SFT warm start ==", flush=True)
    # The demo owns its run folders: each run starts them over (checkpoint.resume=overwrite).
    out = _run(torchrun(args.nproc, "configs/demo_sft.yaml", f"model.path={model}", f"trainer.run_dir={sft_run}",
                        "checkpoint.resume=overwrite", *data))
    sft_eval = _final_eval(out)
    last = sorted((sft_run / "checkpoints").glob("step_*"), key=lambda q: int(q.name.split("_")[1]))[-1]
    _run([sys.executable, "tools/checkpoint_merge.py", "--checkpoint", str(last), "--out", str(merged), "--overwrite"])

    print("\n== stage 2: GRPO ==", flush=True)
    out = _run(torchrun(args.nproc, "configs/demo.yaml", f"model.path={merged}", f"trainer.run_dir={grpo_run}",
                        "checkpoint.resume=overwrite", *data, *extra))
    grpo_eval = _final_eval(out)
    _run([sys.executable, "tools/plot_metrics.py", str(grpo_run), "--keys", "reward/mean", "reward/accuracy",
          "eval/accuracy"])

    minutes = (time.monotonic() - t0) / 60
    before, after = sft_eval["eval/accuracy"], grpo_eval["eval/accuracy"]
    print("\n== demo result ==")
    print(f"held-out accuracy after SFT:  {before:.3f}  ({int(sft_eval['eval/samples'])} samples, greedy)")
    print(f"held-out accuracy after GRPO: {after:.3f}  ({after - before:+.3f})")
    print(f"curves: {grpo_run / 'tensorboard' / 'curves.png'}   tensorboard --logdir {args.runs}")
    print(f"total time: {minutes:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
