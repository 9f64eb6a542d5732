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


def run(out: Path, work: Path, size: str = "tiny_hd128") -> dict:
    """The check itself, in this process: exact settings first, then the engine, the episodes, the policy."""
    from rollout.exact import prepare_process

    prepare_process()  # before the policy's first GEMM and before vLLM is imported

    from data.processing import load_processor
    from grpo.config import load_config
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from rollout.exact import build_exact
    from rollout.factory import build_engine
    from tests.gpu.test_vllm_episodes import two_turn_episodes
    from tools.make_tiny_model import make_tiny_model

    init_distributed()
    model_dir = make_tiny_model(work / size, family="qwen2_5_vl", size=size, seed=0)
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
    turn2 = _last_turn_diffs(policy, episodes, adapter, cfg, min_turns=2)
    # the control: one sampled turn long enough to pass the same positions, no tool image
    single = _single_turn_episodes(engine, load_processor(str(model_dir)), adapter, cfg)
    report = {"episodes": len(episodes), "two_turn_episodes": turn2["count"],
              "two_image_episodes": sum(len(e.images) == 2 for e in episodes if len(e.turns) >= 2),
              **turn2["summary"], "exact": True, "model": f"qwen2_5_vl size {size} (random init)", "multi_turn": True,
              "by_position": turn2["by_position"],
              "single_turn_control": {**(s1 := _last_turn_diffs(policy, single, adapter, cfg, min_turns=1))["summary"],
                                      "episodes": s1["count"], "by_position": s1["by_position"]},
              "exact_report": getattr(engine, "_exact").report}
    out.write_text(json.dumps(report, default=str) + "\n")
    return report


def _last_turn_diffs(policy, episodes, adapter, cfg, min_turns: int) -> dict:
    """|engine - policy| logprob of each episode's last sampled turn (episodes with at least `min_turns` turns),
    scored as training scores them: the episodes packed, the policy's exact forward. With where in the sequence
    each token sits, so a mismatch that starts at some length (an attention block) shows apart from one that
    follows an input (an image, a position)."""
    from grpo.update import PackedStep, packed_logprobs
    from rollout.episode import episode_batch

    step = PackedStep(episode_batch(episodes, adapter), cfg.optim.max_tokens_per_microbatch, policy.device)
    packed_logprobs(policy, step, "policy", 1.0)
    diffs, where, count = [], [], 0
    for e, ours in zip(episodes, step.per_sample("policy")):
        if len(e.turns) < min_turns:
            continue
        count += 1
        start, end = e.turns[-1]
        n = end - start
        engine_lp = torch.tensor(e.logprobs[-n:], dtype=torch.float64)
        diffs.append((engine_lp - ours[-n:].double()).abs())
        where.append(torch.arange(start, end))  # the sampled token's own index; its logit comes from index - 1
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    at = torch.cat(where) if where else torch.zeros(0, dtype=torch.long)
    off = d > 0
    summary = {"tokens": int(d.numel()), "max_abs_dlogprob": float(d.max()) if d.numel() else None,
               "token_mult_prob_error_median": float(torch.exp(d).median()) if d.numel() else None,
               "token_mult_prob_error_max": float(torch.exp(d).max()) if d.numel() else None}
    by_position = {"mismatched": int(off.sum()),
                   "first_mismatched_index": int(at[off].min()) if off.any() else None,
                   "last_equal_index": int(at[~off].max()) if (~off).any() else None,
                   "index_range": [int(at.min()), int(at.max())] if at.numel() else None}
    for lo, hi in ((0, 128), (128, 256), (256, 1 << 30)):
        band = (at >= lo) & (at < hi)
        by_position[f"{lo}-{hi if hi < 1 << 30 else ''}"] = [int(band.sum()), int((band & off).sum())]
    return {"count": count, "summary": summary, "by_position": by_position}


def _single_turn_episodes(engine, processor, adapter, cfg) -> list:
    """Four prompts x 4 samples of one sampled turn without tools, up to 192 tokens (past the lengths the
    two-turn episodes reach)."""
    from dataclasses import replace

    from rollout.groups import EngineGroup
    from rollout.rollouts import Rollouts, awake
    from tests.gpu.test_vllm_episodes import four_prompts

    one = replace(cfg, rollout=replace(cfg.rollout, tools=[], max_turns=1, max_new_tokens=192))
    rollouts = Rollouts(one, adapter, processor, lambda: awake(engine), EngineGroup(), lambda v: v)
    prompts, params = four_prompts(processor, adapter, 192, seed=1)
    try:
        return rollouts.run_episodes(engine, prompts, params, use_tools=False)
    finally:
        rollouts.close()


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
    run(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:4])
