"""The vLLM engine on a GPU with a tiny Qwen2.5-VL: refit exactness, generation, bans, logprobs, sleep/wake.

Skipped (at collection, never failing) without CUDA or without vllm. One engine serves the
whole module: vLLM's sleep-mode allocator allows one engine per process. Tests run in file
order and each leaves the engine awake holding the checkpoint's weights. With two GPUs, the
last test also runs this file under torchrun as a tensor-parallel pair (`tensor_parallel_main`).
"""

import faulthandler
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the vLLM engine needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoProcessor  # noqa: E402

from rollout.base import PromptInput, SamplingParams  # noqa: E402
from rollout.vllm_engine import VLLMEngine  # noqa: E402
from tools.make_tiny_model import SIZES, make_tiny_model  # noqa: E402

GIB = 1024**3
TP_TIMEOUT_S = 240  # the pair needs about a minute; a hang prints every rank's stack


def device_used_gb() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def bf16_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality after rounding both to bfloat16."""
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "tiny-qwen2_5_vl"
    return make_tiny_model(out, family="qwen2_5_vl", size="tiny", seed=0)


@pytest.fixture(scope="module")
def config(model_dir):
    return AutoConfig.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def checkpoint(model_dir):
    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def vision_ids(config):
    return [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]


@pytest.fixture(scope="module")
def stop_ids(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    return [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def build_prompts(model_dir) -> list[PromptInput]:
    """Two image prompts of different grids and one text-only prompt, built by the trainer's processor."""
    processor = AutoProcessor.from_pretrained(model_dir)
    rng = np.random.default_rng(0)

    def build(text, size=None):
        content = [{"type": "text", "text": text}]
        images = []
        if size is not None:
            images = [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))]
            content.insert(0, {"type": "image"})
        chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        if not images:
            out = processor(text=[chat], return_tensors="pt")
            return PromptInput(out["input_ids"][0].tolist())
        out = processor(text=[chat], images=images, do_resize=False, return_tensors="pt")
        return PromptInput(out["input_ids"][0].tolist(), images, out["pixel_values"], out["image_grid_thw"])

    return [build("How many cubes are there?", (84, 56)), build("Name the colors.", (56, 112)),
            build("What is two plus three?")]


@pytest.fixture(scope="module")
def prompts(model_dir):
    return build_prompts(model_dir)


@pytest.fixture(scope="module")
def setup(model_dir, config, checkpoint):
    """(engine holding the checkpoint's weights, device memory in GiB before the engine existed)."""
    baseline = device_used_gb()
    size = SIZES["tiny"]
    engine = VLLMEngine(
        str(model_dir), gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=512, seed=0,
        dtype="bfloat16", min_pixels=size.min_pixels, max_pixels=size.max_pixels,
        image_pad_id=config.image_token_id, max_images_per_prompt=1,
    )
    engine.refit(checkpoint.items())
    return engine, baseline


@pytest.fixture(scope="module")
def engine(setup):
    return setup[0]


def greedy(vision_ids, stop_ids, max_new_tokens=16):
    return SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
                          banned_token_ids=vision_ids)


def test_refit_is_bitwise_in_bf16(engine, checkpoint):
    back = engine.read_weights(checkpoint.keys())
    assert set(back) == set(checkpoint)
    wrong = [name for name, tensor in checkpoint.items() if not bf16_equal(back[name], tensor)]
    assert not wrong, f"engine weights differ from the refit tensors: {wrong[:5]}"
    assert all(t.dtype == torch.bfloat16 for t in back.values())


def test_refit_rejects_unknown_names(engine):
    with pytest.raises(ValueError, match="transformer.h.0.mlp.weight"):
        engine.refit([("transformer.h.0.mlp.weight", torch.zeros(2, 2))])


def test_generate_shapes_order_and_finish(engine, prompts, vision_ids, stop_ids):
    n, limit = 4, 24
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=limit, stop_token_ids=stop_ids,
                            banned_token_ids=vision_ids)
    gens = engine.generate(prompts, params)
    assert [g.prompt_index for g in gens] == [i for i in range(len(prompts)) for _ in range(n)]
    for g in gens:
        assert 1 <= len(g.token_ids) <= limit and len(g.logprobs) == len(g.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in g.logprobs)
        assert not set(g.token_ids[:-1]) & set(stop_ids)
        if g.finish_reason == "stop":
            assert g.token_ids[-1] in stop_ids
        else:
            assert g.finish_reason == "length" and len(g.token_ids) == limit


def test_banned_tokens_are_never_sampled(engine, prompts, config, vision_ids):
    vocab = config.text_config.vocab_size
    banned = sorted(set(vision_ids) | set(range(0, vocab, 2)))  # half the vocabulary, plus the vision tokens
    params = SamplingParams(n=8, temperature=1.5, max_new_tokens=48, banned_token_ids=banned)
    tokens = [t for g in engine.generate(prompts, params) for t in g.token_ids]
    assert len(tokens) == len(prompts) * 8 * 48  # no stop tokens: every response runs to the limit
    assert not set(tokens) & set(banned)
    assert len(set(tokens)) > 50  # sampling really spread over the allowed half


def test_seeded_sampling_is_reproducible(engine, prompts, vision_ids):
    def run(seed):
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, banned_token_ids=vision_ids, seed=seed)
        return [(g.token_ids, g.logprobs) for g in engine.generate(prompts, params)]

    first, again, other = run(123), run(123), run(124)
    assert first == again
    assert first != other
    # vLLM derives the n samples of a prompt from seed + index: they must not repeat each other.
    assert len({tuple(tokens) for tokens, _ in first[:3]}) == 3


def test_unseeded_calls_draw_fresh_samples(engine, prompts, vision_ids):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, banned_token_ids=vision_ids)
    a = [g.token_ids for g in engine.generate(prompts, params)]
    b = [g.token_ids for g in engine.generate(prompts, params)]
    assert a != b


def test_prompt_with_a_wrong_placeholder_run_is_rejected(engine, prompts, config, vision_ids, stop_ids):
    good = prompts[0]
    pad = config.image_token_id
    first = good.input_ids.index(pad)
    short = PromptInput(good.input_ids[:first] + good.input_ids[first + 1:], good.images)  # one placeholder short
    with pytest.raises(RuntimeError, match="first difference"):
        engine.generate([short], greedy(vision_ids, stop_ids))
    two_images = PromptInput(good.input_ids, good.images * 2)
    with pytest.raises(ValueError, match="at most 1"):
        engine.generate([two_images], greedy(vision_ids, stop_ids))


def test_logprobs_are_the_trainers_after_temperature(engine, model_dir, checkpoint, prompts, vision_ids, config):
    """Engine logprobs equal log_softmax(logits / T) of a transformers forward with the same weights."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    hidden = config.text_config.hidden_size
    gen = torch.Generator().manual_seed(1)
    # Wide logits (std ~2) so that a logprob taken before temperature is far from one taken after.
    head = torch.randn(checkpoint["lm_head.weight"].shape, generator=gen) * (2.0 / math.sqrt(hidden))
    temperature = 0.6
    engine.refit([("lm_head.weight", head)])
    try:
        params = SamplingParams(n=2, temperature=temperature, max_new_tokens=16, banned_token_ids=vision_ids, seed=7)
        gens = engine.generate(prompts, params)
    finally:
        engine.refit([("lm_head.weight", checkpoint["lm_head.weight"])])

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    model.lm_head.weight.data.copy_(head)
    after_t, raw = [], []
    for g in gens:
        prompt = prompts[g.prompt_index]
        ids = torch.tensor([prompt.input_ids + g.token_ids], device="cuda")
        extra = {}
        if prompt.images:
            extra = dict(pixel_values=prompt.pixel_values.cuda(), image_grid_thw=prompt.image_grid_thw.cuda())
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0].float()
        start = len(prompt.input_ids) - 1
        z = logits[start : start + len(g.token_ids)]
        target = torch.tensor(g.token_ids, device="cuda").unsqueeze(1)
        masked = z.clone()
        masked[:, vision_ids] = float("-inf")
        ours = torch.tensor(g.logprobs, device="cuda")
        after_t.append((torch.log_softmax(masked / temperature, -1).gather(1, target).squeeze(1) - ours).abs())
        raw.append((torch.log_softmax(z, -1).gather(1, target).squeeze(1) - ours).abs())
    err, err_raw = torch.cat(after_t).mean().item(), torch.cat(raw).mean().item()
    assert err < 0.05, f"mean |engine - trainer| logprob error {err:.4f}"
    assert err < err_raw / 5, f"engine logprobs look pre-temperature: {err:.4f} vs {err_raw:.4f}"


def test_sleep_frees_memory_and_wake_restores(setup, checkpoint, prompts, vision_ids, stop_ids):
    engine, baseline = setup
    params = greedy(vision_ids, stop_ids)
    before = [g.token_ids for g in engine.generate(prompts, params)]
    awake = device_used_gb()
    engine.sleep()
    asleep = device_used_gb()
    engine_gb = awake - baseline
    assert engine_gb > 1.0, f"engine holds only {engine_gb:.2f} GiB"
    assert awake - asleep >= 0.9 * engine_gb, f"sleep freed {awake - asleep:.2f} of {engine_gb:.2f} GiB"
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, params)
    engine.wake()
    assert abs(device_used_gb() - awake) < 0.05 * engine_gb
    assert [g.token_ids for g in engine.generate(prompts, params)] == before
    back = engine.read_weights(checkpoint.keys())
    assert all(bf16_equal(back[name], tensor) for name, tensor in checkpoint.items())


def test_refit_while_asleep_then_wake(setup, checkpoint, prompts, vision_ids, stop_ids):
    engine, _ = setup
    params = greedy(vision_ids, stop_ids)
    before = [g.token_ids for g in engine.generate(prompts, params)]
    awake = device_used_gb()
    gen = torch.Generator().manual_seed(2)
    changed = {name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in checkpoint.items()}
    engine.sleep()
    asleep = device_used_gb()
    try:
        engine.refit(changed.items())
        # Only the weights came back: the KV cache, most of the engine's memory, is still released.
        assert device_used_gb() < asleep + 0.5 * (awake - asleep)
        engine.wake()
        back = engine.read_weights(changed.keys())
        assert all(bf16_equal(back[name], tensor) for name, tensor in changed.items())
        assert [g.token_ids for g in engine.generate(prompts, params)] != before
    finally:
        engine.wake()
        engine.refit(checkpoint.items())
    assert [g.token_ids for g in engine.generate(prompts, params)] == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs")
def test_tensor_parallel_pair_under_torchrun(model_dir):
    repo = Path(__file__).resolve().parents[2]
    # This process is a world of one already (the module's engine): the pair gets its own rendezvous.
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, str(model_dir)]
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TP_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the tensor-parallel pair hung:\n{err.stdout}\n{err.stderr}")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("tensor-parallel rank ok") == 2


def _all_ranks_equal(values: list[int]) -> bool:
    """Whether every rank holds the same list of ints (compared as tensors, no pickling)."""
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.long, device="cuda")
    lengths = [torch.zeros(1, dtype=torch.long, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, torch.tensor([len(values)], device="cuda"))
    if len({int(n) for n in lengths}) != 1:
        return False
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, mine) for g in gathered)


def tensor_parallel_main(model_dir: str, hang_s: float = TP_TIMEOUT_S) -> None:
    """One rank of a TP=2 engine: refit, bitwise read-back through the gather, identical sampling on both ranks."""
    # A collective that never completes would hang silently: print every thread's stack instead, on
    # every rank (exiting at once would let torchrun kill the other rank before it prints).
    faulthandler.dump_traceback_later(hang_s, exit=False)
    killer = threading.Timer(hang_s + 20, lambda: os._exit(3))
    killer.daemon = True
    killer.start()
    config = AutoConfig.from_pretrained(model_dir)
    checkpoint = load_file(str(Path(model_dir) / "model.safetensors"))
    size = SIZES["tiny"]
    engine = VLLMEngine(
        model_dir, tensor_parallel_size=2, gpu_memory_utilization=0.2, enforce_eager=True, max_model_len=512,
        seed=0, min_pixels=size.min_pixels, max_pixels=size.max_pixels, image_pad_id=config.image_token_id,
        async_scheduling={"0": False, "1": True}.get(os.environ.get("TP_ASYNC_SCHEDULING", "")),
    )
    engine.refit(checkpoint.items())
    back = engine.read_weights(checkpoint.keys())
    wrong = [name for name, tensor in checkpoint.items() if not bf16_equal(back[name], tensor)]
    assert not wrong, f"TP read-back differs: {wrong[:5]}"
    rank = torch.distributed.get_rank()
    print(f"rank {rank}: refit and read-back ok", flush=True)
    vision = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, banned_token_ids=vision)
    for phase in ("before sleep", "after sleep and wake"):
        if phase != "before sleep":
            engine.sleep()
            engine.wake()
        gens = engine.generate(build_prompts(model_dir), params)
        tokens = [t for g in gens for t in [len(g.token_ids), *g.token_ids]]
        assert len(gens) == 9 and _all_ranks_equal(tokens), f"the TP ranks sampled differently {phase}"
        print(f"rank {rank}: generation {phase} ok", flush=True)
    print("tensor-parallel rank ok", flush=True)
    torch.distributed.barrier()  # leave together, so neither rank tears NCCL down under the other
    faulthandler.cancel_dump_traceback_later()
    killer.cancel()


if __name__ == "__main__":
    tensor_parallel_main(sys.argv[1], *(float(a) for a in sys.argv[2:3]))
