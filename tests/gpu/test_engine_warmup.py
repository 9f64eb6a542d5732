"""`rollout.engine_warmup` on a GPU: each mode builds the tiny Qwen2.5-VL engine in a process of its own
(vLLM's sleep-mode allocator allows one engine per process), and seeded generation gives the same tokens
and logprobs whatever the warm-up did. Prints each build's seconds (`VLLMEngine.build_times`).

    python -m pytest -q -s tests/gpu/test_engine_warmup.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the vLLM engine needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
MODES = ("full", "lean", "off")
BUILD_TIMEOUT_S = 300


def _prompts(model_dir: str) -> list:
    """An image prompt and a text-only one, built by the trainer's processor."""
    import numpy as np
    from PIL import Image

    import models.family  # noqa: F401  (registers the families' image rules with the processor)
    from data.processing import load_processor
    from rollout.base import PromptInput

    processor = load_processor(model_dir)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    out = []
    for text, images in (("How many cubes are there?", processor.prepare_images([image])),
                         ("What is two plus three?", [])):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        enc = processor(processor.apply_chat_template([{"role": "user", "content": content}]), images)
        out.append(PromptInput(enc["input_ids"].reshape(-1).tolist(), images, enc.get("pixel_values"),
                               enc.get("image_grid_thw")))
    return out


def build_and_generate(model_dir: str, mode: str, out: str) -> None:
    """One engine with `engine_warmup=mode`: refit from the checkpoint, seeded sampling, results to `out`."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rollout.base import SamplingParams
    from rollout.vllm_engine import VLLMEngine
    from tools.make_tiny_model import SIZES

    config = AutoConfig.from_pretrained(model_dir)
    vision = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    size = SIZES["tiny"]
    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.3, max_model_len=512, seed=0, dtype="bfloat16",
                        min_pixels=size.min_pixels, max_pixels=size.max_pixels, image_pad_id=config.image_token_id,
                        max_num_seqs=8, engine_warmup=mode,
                        warmup_sampling=SamplingParams(max_new_tokens=2, banned_token_ids=vision))
    engine.refit(load_file(str(Path(model_dir) / "model.safetensors")).items())
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, banned_token_ids=vision, seed=7)
    gens = engine.generate(_prompts(model_dir), params)
    v2 = bool(getattr(engine._llm.llm_engine.vllm_config, "use_v2_model_runner", False))
    Path(out).write_text(json.dumps({"tokens": [g.token_ids for g in gens], "logprobs": [g.logprobs for g in gens],
                                     "build_times": engine.build_times, "v2": v2}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("warmup") / "tiny-qwen2_5_vl", family="qwen2_5_vl",
                               size="tiny", seed=0))


def _run(model_dir: str, mode: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # a world of one per process
        env.pop(key, None)
    proc = subprocess.run([sys.executable, __file__, model_dir, mode, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, f"engine_warmup={mode}: rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_warmup_modes_generate_alike(model_dir, tmp_path):
    runs = {mode: _run(model_dir, mode, tmp_path / f"{mode}.json") for mode in MODES}
    for mode, run in runs.items():
        print(f"engine_warmup={mode}: build {run['build_times']} (V2 runner: {run['v2']})")
    full = runs["full"]
    for mode in ("lean", "off"):
        assert runs[mode]["tokens"] == full["tokens"], f"engine_warmup={mode} sampled other tokens than full"
        worst = max(abs(a - b) for x, y in zip(runs[mode]["logprobs"], full["logprobs"]) for a, b in zip(x, y))
        assert worst <= 1e-6, f"engine_warmup={mode}: logprobs differ from full by up to {worst}"
    if full["v2"]:  # the V1 runner has no such warm-up: nothing timed
        assert all("warmup_s" in run["build_times"] for run in runs.values())
        assert runs["off"]["build_times"]["warmup_s"] < 0.5


if __name__ == "__main__":
    build_and_generate(*sys.argv[1:4])
