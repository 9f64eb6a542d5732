"""The agent demo on CPU: a demo-size Qwen2.5-VL learns to zoom in before it answers.

    python tools/demo_agent.py [--nproc 2] [--workdir artifacts/demo_agent]      (what `make demo-agent` runs)

The task (data/generators/zoom.py): four checkerboards on a 448x448 canvas, one framed; the
question asks the framed one's colour, which averages to grey at the model's 112x112 view and is
readable only through `image_zoom_in_tool`. Stages, each a torchrun of train.py:
  1. without tools: SFT on the same rows with the answer alone (configs/demo_agent_sft.yaml with
     rollout.tools=[]), the best a model that cannot zoom does here;
  2. SFT warm start on tool-using trajectories (configs/demo_agent_sft.yaml): 25 steps at lr 1e-3, which
     teach the call and the four colours but leave a quarter of the held-out episodes without a
     well-formed answer;
  3. GRPO with the tool from the merged SFT model (configs/demo_agent.yaml), sampling at temperature 0.5.
Every accuracy is greedy, on the same held-out rows. It ends with the line
`held-out accuracy: without tools X, with tools Y`, Y being the GRPO model's.

`--places 1` (the default) always frames the same square, so the box to zoom is fixed and the CPU
minutes go to reading the zoomed colours; with `--places 2` or `4` the model must also choose the
box from where the black quadrant is, which 40 SFT steps at lr 3e-3 did not teach the demo-size
model (measured: it wrote one box for every image).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.demo import _final_eval, _run, torchrun  # noqa: E402

PIXELS = dict(min_pixels=3136, max_pixels=12544)  # the configs' data.min_pixels / data.max_pixels
# SFT steps and lr of the without-tools baseline: its answers sit at chance (the colours are grey at the model's
# view); at 3e-3 it writes the answer format by step 40
BASELINE_STEPS = 40
BASELINE_LR = 3e-3


def _merge(run: Path, out: Path) -> None:
    last = sorted((run / "checkpoints").glob("step_*"), key=lambda q: int(q.name.split("_")[1]))[-1]
    _run([sys.executable, "tools/checkpoint_merge.py", "--checkpoint", str(last), "--out", str(out), "--overwrite"])


def build_inputs(work: Path, sft_rows: int, train_rows: int, eval_rows: int, places: int) -> dict[str, Path]:
    """The demo-size model and the three data files, built once; later runs reuse them while
    `inputs.json` (the generator's version and the row counts) says they were made the same way."""
    from data.generators.zoom import VERSION
    from tools.make_dataset import make_dataset
    from tools.make_tiny_model import make_tiny_model

    work.mkdir(parents=True, exist_ok=True)
    paths = {"model": work / "model_init", "sft": work / "sft.parquet", "train": work / "train.parquet",
             "eval": work / "eval.parquet"}
    if not (paths["model"] / "config.json").is_file():
        make_tiny_model(paths["model"], family="qwen2_5_vl", size="demo", seed=0, overwrite=True)
    stamp = {"zoom_version": VERSION, "places": places, "rows": [sft_rows, train_rows, eval_rows], **PIXELS}
    made = work / "inputs.json"
    fresh = made.is_file() and json.loads(made.read_text()) == stamp
    for key, kind, n, seed in (("sft", "zoom_sft", sft_rows, 1), ("train", "zoom", train_rows, 2),
                               ("eval", "zoom", eval_rows, 3)):
        if not (fresh and paths[key].is_file()):
            make_dataset(kind, n, seed, paths[key], places=places, **PIXELS)
    made.write_text(json.dumps(stamp))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workdir", default="artifacts/demo_agent")
    p.add_argument("--runs", default="runs")
    p.add_argument("--sft-rows", type=int, default=1200)
    p.add_argument("--train-rows", type=int, default=1200)
    p.add_argument("--eval-rows", type=int, default=128)
    p.add_argument("--places", type=int, default=1, help="squares that can be the framed one: 1, 2 or 4")
    args, extra = p.parse_known_args(argv)
    t0 = time.monotonic()
    paths = build_inputs(ROOT / args.workdir, args.sft_rows, args.train_rows, args.eval_rows, args.places)
    runs = ROOT / args.runs
    held_out = f"data.eval_path={paths['eval']}"
    # The demo owns its run folders: each run starts them over.
    common = ["checkpoint.resume=overwrite", held_out]

    print("\n== stage 1: without tools (SFT on the answers alone) ==", flush=True)
    out = _run(torchrun(args.nproc, "configs/demo_agent_sft.yaml", f"model.path={paths['model']}",
                        f"data.train_path={paths['train']}", f"trainer.run_dir={runs / 'demo_agent_notools'}",
                        "rollout.tools=[]", "rollout.max_turns=1", "trainer.eval_max_new_tokens=16",
                        f"trainer.max_steps={BASELINE_STEPS}", f"optim.lr={BASELINE_LR}", *common))
    without = _final_eval(out)

    print("\n== stage 2: SFT warm start on tool-using trajectories ==", flush=True)
    sft_run, sft_model = runs / "demo_agent_sft", ROOT / args.workdir / "model_sft"
    out = _run(torchrun(args.nproc, "configs/demo_agent_sft.yaml", f"model.path={paths['model']}",
                        f"data.train_path={paths['sft']}", f"trainer.run_dir={sft_run}", *common))
    sft = _final_eval(out)
    _merge(sft_run, sft_model)

    print("\n== stage 3: GRPO with the tool ==", flush=True)
    out = _run(torchrun(args.nproc, "configs/demo_agent.yaml", f"model.path={sft_model}",
                        f"data.train_path={paths['train']}", f"trainer.run_dir={runs / 'demo_agent_grpo'}",
                        *common, *extra))
    grpo = _final_eval(out)

    minutes = (time.monotonic() - t0) / 60
    print("\n== agent demo result ==")
    print(f"with tools after SFT:  {sft['eval/accuracy']:.3f}   after GRPO: {grpo['eval/accuracy']:.3f} "
          f"({grpo['eval/accuracy'] - sft['eval/accuracy']:+.3f})   ({int(grpo['eval/samples'])} held-out rows, greedy)")
    print(f"total time: {minutes:.1f} min")
    print(f"held-out accuracy: without tools {without['eval/accuracy']:.3f}, with tools {grpo['eval/accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
