"""rollout.exact over multi-turn episodes: vLLM's logprobs of the tokens it sampled in a second turn, after a zoom
tool added an image, equal the exact policy's logprobs of the same tokens in the packed episode, bit for bit.

Turn 1 is scripted (every sample writes the same zoom call, so the tiny random model's episodes have a tool
image); turn 2 is sampled by vLLM in exact mode from the whole episode: the prompt's image, the tool's, and
the tokens between. With prefix caching off (the mode's setting) turn 2 prefills its whole context, the path
the mode covers. The episodes go through `episode_batch` and the policy's packed logprobs, as in training.

Batch-invariant mode is process-wide and set before vLLM is imported, so the check runs in a fresh process
(`python -m tests.gpu.test_exact_episodes OUT`); the test reads its JSON. Skipped without CUDA or vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, work: Path) -> dict:
    """The check itself, in this process: exact settings first, then the engine, the episodes, the policy."""
    from rollout.exact import prepare_process

    prepare_process()  # before the policy's first GEMM and before vLLM is imported

    from data.processing import load_processor
    from grpo.config import load_config
    from grpo.update import PackedStep, packed_logprobs
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from rollout.episode import episode_batch
    from rollout.exact import build_exact
    from rollout.factory import build_engine
    from tests.gpu.test_vllm_episodes import two_turn_episodes
    from tools.make_tiny_model import make_tiny_model

    init_distributed()
    model_dir = make_tiny_model(work / "tiny", family="qwen2_5_vl", size="tiny", seed=0)
    cfg = load_config(None, [f"model.path={model_dir}", "data.task=clevr", "data.min_pixels=3136",
                             "data.max_pixels=3136", "rollout.tools=[image_zoom_in_tool]", "rollout.max_turns=2",
                             "rollout.max_new_tokens=96", "rollout.exact=true", "rollout.engine=vllm",
                             f"trainer.run_dir={work / 'run'}"])
    policy = build_policy(cfg.model, build_parallel_dims())
    build_exact(policy)
    engine = build_engine(cfg, policy, gpu_memory_utilization=0.3, max_num_seqs=16)
    engine.refit(policy.full_state_dict(engine.dtype))
    adapter = policy.adapter
    episodes, _ = two_turn_episodes(engine, load_processor(str(model_dir)), adapter, cfg)
    step = PackedStep(episode_batch(episodes, adapter), cfg.optim.max_tokens_per_microbatch, policy.device)
    packed_logprobs(policy, step, "policy", 1.0)
    diffs, two_images = [], 0
    for e, ours in zip(episodes, step.per_sample("policy")):
        if len(e.turns) < 2:
            continue
        two_images += len(e.images) == 2
        start, end = e.turns[1]
        n = end - start  # turn 2's sampled tokens: the last model tokens of the episode
        engine_lp = torch.tensor(e.logprobs[-n:], dtype=torch.float64)
        diffs.append((engine_lp - ours[-n:].double()).abs())
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    report = {"episodes": len(episodes), "two_turn_episodes": len(diffs), "two_image_episodes": two_images,
              "tokens": int(d.numel()), "max_abs_dlogprob": float(d.max()) if d.numel() else None,
              "token_mult_prob_error_median": float(torch.exp(d).median()) if d.numel() else None,
              "token_mult_prob_error_max": float(torch.exp(d).max()) if d.numel() else None,
              "exact": True, "model": "qwen2_5_vl size tiny (random init)", "multi_turn": True,
              "exact_report": getattr(engine, "_exact").report}
    out.write_text(json.dumps(report, default=str) + "\n")
    return report


def test_exact_mode_is_bitwise_over_a_tool_turn(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("the exact mode needs CUDA")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the exact mode needs vLLM")
    out = tmp_path / "exact_episodes.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "tests.gpu.test_exact_episodes", str(out), str(tmp_path)],
                          cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=int(os.environ.get("EXACT_S", "280")))
    assert done.returncode == 0, f"the exact multi-turn check failed:\n{done.stderr[-4000:]}"
    report = json.loads(out.read_text())
    print(json.dumps(report, default=str), flush=True)
    if os.environ.get("EXACT_OUT"):
        Path(os.environ["EXACT_OUT"]).write_text(json.dumps(report, default=str) + "\n")
    assert report["two_image_episodes"] == report["episodes"] == 16 and report["tokens"] > 0
    assert report["max_abs_dlogprob"] == 0.0, (
        f"exact mode over a tool turn: max |dlogprob| {report['max_abs_dlogprob']:.3e} over {report['tokens']} "
        "second-turn tokens")


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
