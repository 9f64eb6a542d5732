"""vLLM continuing multi-turn episodes: two images (the prompt's and a zoom tool's) in one request.

Turn 1 is scripted (a zoom call, so the tiny random model's episodes have a tool image); turn 2 is
sampled by vLLM from the whole episode. The sampled tokens' engine logprobs are compared with
transformers' fp32 forward on each whole episode at its own `get_rope_index` positions: the
mismatch over model tokens must stay within 1.01. Skipped without CUDA or vllm.
"""

import inspect
import json
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the vLLM engine needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from data.processing import load_processor  # noqa: E402
from grpo.config import load_config  # noqa: E402
from models.family import FAMILIES  # noqa: E402
from models.policy import load_model_config  # noqa: E402
from rollout.base import Generation, SamplingParams  # noqa: E402
from rollout.groups import EngineGroup  # noqa: E402
from rollout.rollouts import Rollouts, awake  # noqa: E402
from rollout.vllm_engine import VLLMEngine  # noqa: E402
from tools.make_tiny_model import SIZES, make_tiny_model  # noqa: E402

ZOOM = json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 28, 28]}})


class ZoomFirst:
    """Turn 1: vLLM reads the prompts (one token, as a real first turn would fill its prefix cache) and
    every sample writes the same zoom call; later turns: the vLLM engine samples."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer, self.turn = engine, tokenizer, 0

    @property
    def last_stats(self):
        return self.engine.last_stats

    def generate(self, prompts, params):
        self.turn += 1
        if self.turn > 1:
            return self.engine.generate(prompts, params)
        self.engine.generate(prompts, replace(params, max_new_tokens=1))
        ids = self.tokenizer.encode(f"<tool_call>{ZOOM}</tool_call><|im_end|>", add_special_tokens=False)
        return [Generation(i, ids, [0.0] * len(ids), "stop") for i in range(len(prompts)) for _ in range(params.n)]


def four_prompts(processor, adapter, max_new_tokens: int, seed: int) -> tuple[list, SamplingParams]:
    """Four one-image prompts (56x56, a colour each) and the sampling of 4 responses each, stopping at
    `<|im_end|>`."""
    from tests.test_episodes import _prompt

    prompts = [_prompt(processor, i, (40 * i, 200 - 30 * i, 90)) for i in range(4)]
    stop = [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return prompts, SamplingParams(n=4, max_new_tokens=max_new_tokens, stop_token_ids=stop,
                                   banned_token_ids=adapter.banned_token_ids, seed=seed)


def two_turn_episodes(engine, processor, adapter, cfg) -> tuple[list, float]:
    """Four prompts x 4 samples through `Rollouts` with a scripted zoom call in turn 1 (`ZoomFirst`) and the
    engine sampling turn 2: (the episodes, the prefix-cache hit rate)."""
    scripted = ZoomFirst(engine, processor.tokenizer)
    rollouts = Rollouts(cfg, adapter, processor, lambda: awake(scripted), EngineGroup(), lambda v: v)
    prompts, params = four_prompts(processor, adapter, 96, seed=0)
    try:
        _, episodes, _ = rollouts.collect(type("F", (), {"next": lambda self, k: prompts[:k]})(), 4, params)
        hit = rollouts.metrics(episodes, "cpu")["agent/prefix_cache_hit"]
    finally:
        rollouts.close()
    return episodes, hit


@torch.no_grad()
def reference_logprobs(model, ids, pixels, grid, start):
    t = torch.tensor([ids], device="cuda")
    kwargs = {}
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        mm = (t == model.config.image_token_id).int()
        kwargs["position_ids"], _ = model.model.get_rope_index(t, mm_token_type_ids=mm, image_grid_thw=grid.cuda())
    logits = model(input_ids=t, pixel_values=pixels.cuda(), image_grid_thw=grid.cuda(), **kwargs).logits[0].float()
    return torch.log_softmax(logits[start - 1:-1], -1).gather(1, t[0, start:, None])[:, 0].cpu()


def test_vllm_samples_the_second_turn_of_two_image_episodes(tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir = make_tiny_model(tmp_path / "tiny", family="qwen2_5_vl", size="tiny", seed=0)
    size = SIZES["tiny"]
    config = load_model_config(str(model_dir))
    processor = load_processor(str(model_dir))
    cfg = load_config(None, [f"model.path={model_dir}", "data.task=clevr", "data.min_pixels=3136",
                             "data.max_pixels=3136", "rollout.tools=[image_zoom_in_tool]", "rollout.max_turns=2",
                             "rollout.max_new_tokens=96"])
    engine = VLLMEngine(str(model_dir), gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=1024, seed=0,
                        dtype="bfloat16", min_pixels=size.min_pixels, max_pixels=size.max_pixels,
                        image_pad_id=config.image_token_id, max_images_per_prompt=1 + cfg.rollout.max_tool_images)
    engine.refit(load_file(str(model_dir / "model.safetensors")).items())
    adapter = FAMILIES["qwen2_5_vl"].adapter(config)
    episodes, hit = two_turn_episodes(engine, processor, adapter, cfg)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    errors, count = 0.0, 0
    for e in episodes:
        assert len(e.turns) == 2 and len(e.images) == 2, e.finish_reason
        start, end = e.turns[1]
        ref = reference_logprobs(model, e.token_ids[:end], e.pixel_values(), e.image_grid_thw(), start)
        engine_lp = torch.tensor(e.logprobs[-(end - start):])
        errors += float(torch.exp((engine_lp - ref).abs()).sum())
        count += end - start
    value = errors / count
    print(f"vLLM two-image episodes: token_mult_prob_error {value:.6f} over {count} second-turn tokens; "
          f"prefix cache hit {hit:.3f}")
    assert count > 0 and value <= 1.01
    assert hit > 0  # turn 2's prompts begin with turn 1's, which the prefix cache holds
