"""vLLM generating from video prompts: the same frames, timing and positions as the trainer.

For the tiny Qwen2.5-VL and Qwen3-VL, prompts with a video at 1 and at 4 frames per second (Qwen2.5-VL's
temporal positions depend on it; Qwen3-VL writes the times as text), a prompt with an image and a
video, two two-video prompts [a, b] then [a, c] whose clips share their metadata (a partial hit of
vLLM's processor cache where the engine keeps it on: Qwen3-VL; Qwen2.5-VL's engine turns it off for
two videos, `processor_cache`), and a 20-frame clip at 0.9 fps (10 temporal groups: in a bf16 engine
float32 seconds would put group 9 one position off, `grid_seconds`) go through the vLLM engine (bf16);
the sampled tokens' engine logprobs are compared with
transformers' fp32 forward on the same frames at the trainer's positions (`position_ids`, which follow
vLLM's rule; transformers 5.17's own get_rope_index truncates second_per_grid_ts to an integer). The
engine checks token for token that vLLM's expansion of each video equals the trainer's.
token_mult_prob_error over the response tokens must stay within 1.01. Skipped without CUDA or vllm.
Run one family per process (`-k qwen3_vl`), as `gpu_session.sh video` does: one vLLM engine per process.
"""

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the vLLM engine needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from data.datasets import Sample  # noqa: E402
from data.processing import encode_prompt, load_processor  # noqa: E402
from data.video import Video  # noqa: E402
from models.family import build_adapter  # noqa: E402
from models.policy import load_model_config  # noqa: E402
from rollout.base import PromptInput, SamplingParams  # noqa: E402
from rollout.vllm_engine import VLLMEngine  # noqa: E402
from tools.make_tiny_model import SIZES, make_tiny_model  # noqa: E402


def _frames(n, width, height, seed):
    """A square moving across a noisy background: frames that differ, as a clip's do."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 120, (height, width, 3), dtype=np.uint8)
    out = []
    for i in range(n):
        f = base.copy()
        x = (i * width // n) % (width - 8)
        f[4:12, x:x + 8] = (230, 40, 40)
        out.append(Image.fromarray(f))
    return out


def _prompts(processor, side):
    a, b, c = (Video(_frames(4, side, side, seed), fps=2.0) for seed in (4, 5, 6))
    specs = [("<video>How many frames show the square?", [], [Video(_frames(8, 2 * side, side, 0), fps=1.0)]),
             ("<video>Which way does it move?", [], [Video(_frames(4, side, side, 1), fps=4.0)]),
             ("<image>and<video>: same colour?", [_frames(1, 2 * side, 2 * side, 2)[0]],
              [Video(_frames(6, side, 2 * side, 3), fps=2.0)]),
             ("<video> and <video>: the same clip?", [], [a, b]),
             ("<video> and <video>: the same clip?", [], [a, c]),
             ("<video>When does the square stop?", [], [Video(_frames(20, side, side, 7), fps=0.9)])]
    out = []
    for i, (problem, images, videos) in enumerate(specs):
        sample = Sample(i, images, problem, "1", videos=videos)
        out.append(encode_prompt(processor, sample, "generic", 2048))
    return out


@torch.no_grad()
def _reference(model, adapter, prompt, response):
    seq = torch.cat([prompt.input_ids, torch.tensor(response)])
    pos = adapter.position_ids(seq, prompt.image_grid_thw, prompt.video_grid_thw, prompt.second_per_grid_ts)
    kwargs = {k: getattr(prompt, k).cuda() for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                                     "video_grid_thw") if getattr(prompt, k) is not None}
    logits = model(input_ids=seq[None].cuda(), position_ids=pos[1:, None].cuda(), **kwargs).logits[0].float()
    n = prompt.input_ids.numel()
    return torch.log_softmax(logits[n - 1:-1], -1).gather(1, seq[n:, None].cuda())[:, 0].cpu()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vllm_video_logprobs_match_the_trainer(family, tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir = make_tiny_model(tmp_path / family, family=family, size="tiny", seed=0)
    size = SIZES["tiny"]
    config = load_model_config(str(model_dir))
    adapter = build_adapter(config)
    processor = load_processor(str(model_dir))
    prompts = _prompts(processor, processor.images.factor)
    engine = VLLMEngine(str(model_dir), gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=2048, seed=0,
                        dtype="bfloat16", min_pixels=size.min_pixels, max_pixels=size.max_pixels,
                        image_pad_id=config.image_token_id, adapter=adapter, max_images_per_prompt=1,
                        max_videos_per_prompt=2, processor_cache_gb=1.0)
    assert engine._processor_cache_gb == (0.0 if family == "qwen2_5_vl" else 1.0)
    engine.refit(load_file(str(model_dir / "model.safetensors")).items())
    stop = [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    params = SamplingParams(n=4, max_new_tokens=48, stop_token_ids=stop, banned_token_ids=adapter.banned_token_ids,
                            seed=0)
    inputs = [PromptInput(p.input_ids.tolist(), p.images, p.pixel_values, p.image_grid_thw, p.videos,
                          p.pixel_values_videos, p.video_grid_thw, p.second_per_grid_ts) for p in prompts]
    gens = engine.generate(inputs, params)  # raises if vLLM's prompt ids differ from the trainer's
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    errors, count, per_prompt = 0.0, 0, {}
    for g in gens:
        ref = _reference(model, adapter, prompts[g.prompt_index], g.token_ids)
        e = torch.exp((torch.tensor(g.logprobs) - ref).abs())
        errors += float(e.sum())
        count += e.numel()
        per_prompt.setdefault(g.prompt_index, []).append(float(e.mean()))
    value = errors / count
    print(f"{family} video prompts: token_mult_prob_error {value:.6f} over {count} tokens; per prompt "
          + ", ".join(f"{i}: {max(v):.4f}" for i, v in sorted(per_prompt.items())))
    assert count > 0 and value <= 1.01
