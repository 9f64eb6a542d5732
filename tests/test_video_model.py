"""Video inputs, the model side: processor fields, timestamps, m-rope positions against transformers,
packing with video rows, the vLLM prompt form, and families without video."""

from __future__ import annotations

import importlib.util
import inspect
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from data.batch import Batch, PackedGenericDataItem
from data.processing import group_timestamps, load_processor, video_metadata
from data.video import Video
from models.packing import pack


def _frames(n: int, width: int, height: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(n)]


def _image(width: int, height: int, seed: int = 1) -> Image.Image:
    return _frames(1, width, height, seed)[0]


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen3_vl", family="qwen3_vl", size="tiny", seed=0)


def _adapter(path):
    from models.family import build_adapter
    from models.policy import load_model_config

    return build_adapter(load_model_config(str(path)))


def _prompt(processor, parts: list[dict], images=(), videos=()) -> dict:
    text = processor.apply_chat_template([{"role": "user", "content": parts}])
    return processor(text, list(images), list(videos))


# --- processor fields -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_patches_equal_the_processors(family, tiny_model, qwen3_vl):
    """pixel_values_videos: each temporal patch holds frame 2g in its first slot and frame 2g+1 in its
    second. Reference on CPU: the family's image processor on each frame alone (it repeats a frame into
    both slots); where torchvision imports, transformers' video processor itself."""
    path = tiny_model if family == "qwen2_5_vl" else qwen3_vl
    processor = load_processor(str(path))
    rule = processor.images
    side = rule.factor
    frames = _frames(4, 4 * side, 2 * side)
    out = rule.encode_videos([Video(frames, fps=4.0)])
    patch, temporal = int(rule.image_processor.patch_size), rule.temporal_patch_size
    assert out["video_grid_thw"].tolist() == [[2, 4, 8]]
    assert out["second_per_grid_ts"].dtype == torch.float32 and out["second_per_grid_ts"].tolist() == [0.5]
    ref = []
    for g in range(0, 4, temporal):
        alone = [rule.encode([f])[0].view(-1, 3, temporal, patch, patch) for f in frames[g:g + temporal]]
        ref.append(torch.stack([alone[k][:, :, k] for k in range(temporal)], dim=2).flatten(1))
    assert torch.allclose(out["pixel_values_videos"], torch.cat(ref), atol=1e-5)
    if importlib.util.find_spec("torchvision") is not None:  # the GPU image
        from transformers import AutoVideoProcessor

        video_processor = AutoVideoProcessor.from_pretrained(str(path), local_files_only=True)
        real = video_processor(videos=[np.stack([np.asarray(f) for f in frames])], do_resize=False,
                               do_sample_frames=False, return_tensors="pt")
        assert real["video_grid_thw"].tolist() == out["video_grid_thw"].tolist()
        assert torch.allclose(real["pixel_values_videos"], out["pixel_values_videos"], atol=1e-6)


def test_frames_off_the_grid_are_refused_not_resized(tiny_model):
    rule = load_processor(str(tiny_model)).images
    with pytest.raises(ValueError, match="multiples of 28"):
        rule.encode_videos([Video(_frames(2, 60, 56), fps=2.0)])


def test_qwen3_timestamps_follow_transformers_processor(qwen3_vl):
    """The expansion is transformers' `Qwen3VLProcessor.replace_video_token` for the same metadata
    (called on a stand-in processor: the real one needs torchvision for its video processor)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    processor = load_processor(str(qwen3_vl))
    video = Video(_frames(6, 64, 64), fps=3.0, timestamps=[1.0 + i / 3 for i in range(6)])
    out = processor.images.encode_videos([video])
    meta = {k: v for k, v in video_metadata(video).items() if k != "do_sample_frames"}
    stand_in = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                               video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                               vision_end_token="<|vision_end|>")
    stand_in._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(stand_in, *a)
    ref = Qwen3VLProcessor.replace_video_token(
        stand_in, {"video_grid_thw": out["video_grid_thw"], "video_metadata": [VideoMetadata(**meta)]}, 0)
    ours = processor.images.video_expansion(out["video_grid_thw"][0], video)
    assert ours == ref
    assert ours.startswith("<1.2 seconds><|vision_start|>") and "<|vision_end|><2.5 seconds>" in ours
    assert group_timestamps(video_metadata(video), 2) == pytest.approx([7 / 6, 11 / 6, 5 / 2])


# --- positions against transformers' get_rope_index ----------------------------------------------------
def _reference_positions(path, ids, image_grid, video_grid, seconds):
    from transformers import AutoModelForImageTextToText

    from models.policy import load_model_config

    config = load_model_config(str(path))
    with torch.device("meta"):
        inner = AutoModelForImageTextToText.from_config(config).model
    if "mm_token_type_ids" not in inspect.signature(inner.get_rope_index).parameters:
        pytest.skip("this transformers version computes rope indices with another signature")
    kinds = torch.zeros_like(ids)
    kinds[ids == config.image_token_id] = 1
    kinds[ids == config.video_token_id] = 2
    extra = {} if seconds is None else {"second_per_grid_ts": seconds}
    pos, _ = inner.get_rope_index(ids[None], kinds[None], image_grid_thw=image_grid, video_grid_thw=video_grid,
                                  **extra)
    return pos[:, 0]


@pytest.mark.parametrize("fps", [1.0, 4.0])
def test_qwen2_5_positions_follow_fps(fps, tiny_model):
    """Mixed image + video prompt at two fps: temporal groups 2/fps · tokens_per_second positions apart,
    as transformers' get_rope_index puts them; ignoring second_per_grid_ts (verl's bug) would space
    them tokens_per_second apart, the fps-2 answer, at any fps."""
    processor = load_processor(str(tiny_model))
    adapter = _adapter(tiny_model)
    video = Video(_frames(4, 168, 168), fps=fps)  # 6 × 6 merged patches: its spatial extent passes its temporal one
    out = _prompt(processor, [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"},
                              {"type": "text", "text": "what moves?"}], [_image(112, 56)], [video])
    ours = adapter.position_ids(out["input_ids"], out["image_grid_thw"], out["video_grid_thw"],
                                out["second_per_grid_ts"])
    ref = _reference_positions(tiny_model, out["input_ids"], out["image_grid_thw"], out["video_grid_thw"],
                               out["second_per_grid_ts"])
    assert torch.equal(ours[1:], ref)
    temporal = ours[1][out["input_ids"] == adapter.video_token_id].unique()
    step = 2 / fps * adapter.tokens_per_second
    assert (temporal - temporal[0]).tolist() == [int(k * step) for k in range(2)]
    ignored = adapter.position_ids(out["input_ids"], out["image_grid_thw"], out["video_grid_thw"],
                                   torch.ones(1))  # second_per_grid_ts as if it were not given
    assert not torch.equal(ignored, ours)


def test_text_after_a_long_video_resumes_past_its_last_position(tiny_model):
    """After a video whose temporal extent passes its spatial one, text resumes one past the largest
    position (vLLM 0.26 and transformers < 5); transformers 5's get_rope_index resumes at start + max(h, w)."""
    processor = load_processor(str(tiny_model))
    adapter = _adapter(tiny_model)
    out = _prompt(processor, [{"type": "video"}, {"type": "text", "text": "x"}], [], [Video(_frames(8, 56, 56), fps=0.5)])
    ours = adapter.position_ids(out["input_ids"], None, out["video_grid_thw"], out["second_per_grid_ts"])
    ids = out["input_ids"]
    video = (ids == adapter.video_token_id).nonzero().flatten()
    first, last = int(video[0]), int(video[-1])
    start = int(ours[1, first - 1]) + 1
    assert ours[1, video].unique().tolist() == [start + k * 8 for k in range(4)]  # 2 / 0.5 fps · 2 tokens/s
    assert torch.equal(ours[1:, last + 1], torch.full((3,), start + 24 + 1))


def test_qwen3_positions_split_groups_and_match_transformers(qwen3_vl):
    processor = load_processor(str(qwen3_vl))
    adapter = _adapter(qwen3_vl)
    video = Video(_frames(4, 128, 64), fps=2.0)
    out = _prompt(processor, [{"type": "video"}, {"type": "text", "text": "then"}, {"type": "image"}],
                  [_image(64, 64)], [video])
    ours = adapter.position_ids(out["input_ids"], out["image_grid_thw"], out["video_grid_thw"], None)
    ref = _reference_positions(qwen3_vl, out["input_ids"], out["image_grid_thw"], out["video_grid_thw"], None)
    assert torch.equal(ours[1:], ref)
    text = processor.tokenizer.decode(out["input_ids"])
    assert text.count("seconds>") == 2 and "<0.2 seconds>" in text and "<1.2 seconds>" in text


def test_video_placeholder_count_errors(tiny_model):
    adapter = _adapter(tiny_model)
    v = adapter.video_token_id
    ids = torch.tensor([1, v, v, 2])
    with pytest.raises(ValueError, match="video 0 needs 8 placeholder"):
        adapter.position_ids(ids, None, torch.tensor([[2, 4, 4]]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="videos"):
        adapter.position_ids(ids, None)
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        adapter.position_ids(torch.tensor([1, v, 2]), None, torch.tensor([[1, 2, 2]]), None)


# --- packing and logprobs --------------------------------------------------------------------------
def _policy(path):
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    return build_policy(ModelConfig(path=str(path)), build_parallel_dims())


def _rows(processor, adapter, side: int):
    """Prompts: video only (fps 1), image then video (fps 4), text only, image only; each + a response."""
    g = torch.Generator().manual_seed(0)
    specs = [([], [Video(_frames(4, 2 * side, side, 3), fps=1.0)], [{"type": "video"}]),
             ([_image(side, side, 4)], [Video(_frames(2, side, 2 * side, 5), fps=4.0)],
              [{"type": "image"}, {"type": "video"}]),
             ([], [], []),
             ([_image(2 * side, side, 6)], [], [{"type": "image"}])]
    prompts = []
    for images, videos, parts in specs:
        out = _prompt(processor, parts + [{"type": "text", "text": "what is it?"}], images, videos)
        out["response"] = torch.randint(10, 200, (5,), generator=g)
        prompts.append(out)
    return prompts


def _batch(adapter, prompts, owners):
    ids, masks, pos = [], [], []
    for i in owners:
        p = prompts[i]
        seq = torch.cat([p["input_ids"], p["response"]])
        mask = torch.zeros_like(seq)
        mask[p["input_ids"].numel():] = 1
        ids.append(seq)
        masks.append(mask)
        pos.append(adapter.position_ids(seq, p["image_grid_thw"], p["video_grid_thw"], p["second_per_grid_ts"]))
    field = lambda k: [prompts[i][k] for i in owners]  # noqa: E731 - one tensor per prompt, shared
    return Batch({"input_ids": ids, "loss_mask": masks, "position_ids": PackedGenericDataItem(pos, dim=1),
                  "pixel_values": field("pixel_values"), "image_grid_thw": field("image_grid_thw"),
                  "pixel_values_videos": field("pixel_values_videos"), "video_grid_thw": field("video_grid_thw")})


def _reference_logprobs(model, adapter, prompts, i):
    """One sequence through transformers' own forward with our positions."""
    p = prompts[i]
    seq = torch.cat([p["input_ids"], p["response"]])
    pos = adapter.position_ids(seq, p["image_grid_thw"], p["video_grid_thw"], p["second_per_grid_ts"])
    kwargs = {k: p[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
              if p[k] is not None}
    with torch.no_grad():
        logits = model(input_ids=seq[None], position_ids=pos[1:, None], **kwargs).logits[0].float()
    n = p["input_ids"].numel()
    return torch.log_softmax(logits, -1)[n - 1:-1].gather(-1, seq[n:, None]).squeeze(-1)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_packed_video_rows_equal_one_by_one_and_transformers(family, tiny_model, qwen3_vl):
    """G responses per prompt sharing one video tensor, mixed image + video rows in one pack: the vision
    tower runs once per distinct prompt; logprobs equal each sequence alone and transformers' forward
    (Qwen3-VL: DeepStack over images and videos in row order), fp32 within 1e-5."""
    from transformers import AutoModelForImageTextToText

    path = tiny_model if family == "qwen2_5_vl" else qwen3_vl
    policy = _policy(path)
    adapter = policy.adapter
    processor = load_processor(str(path))
    prompts = _rows(processor, adapter, processor.images.factor)
    owners = [0, 0, 1, 1, 2, 3]
    batch = _batch(adapter, prompts, owners)
    calls = []
    hook = adapter.vision_tower(policy.model).register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    try:
        with torch.no_grad():
            packed, _ = policy.logprobs(pack(batch, list(range(len(owners)))))
    finally:
        hook.remove()
    distinct = sum(int(prompts[i][k].shape[0]) for i in (0, 1, 3) for k in ("pixel_values", "pixel_values_videos")
                   if prompts[i][k] is not None)
    assert calls == [distinct]  # one tower call, each prompt's patches once
    with torch.no_grad():
        alone = [policy.logprobs(pack(batch, [s]))[0] for s in range(len(owners))]
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)
    model = AutoModelForImageTextToText.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
    for s, i in enumerate(owners):
        if i in (0, 1):
            assert torch.allclose(alone[s], _reference_logprobs(model, adapter, prompts, i), atol=1e-5), (family, i)


# --- vLLM prompt form --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vllm_collapse_round_trips_with_images_and_videos(family, tiny_model, qwen3_vl):
    path = tiny_model if family == "qwen2_5_vl" else qwen3_vl
    processor = load_processor(str(path))
    adapter = _adapter(path)
    side = processor.images.factor
    videos = [Video(_frames(4, side, side, 7), fps=2.0), Video(_frames(2, 2 * side, side, 8), fps=1.0)]
    out = _prompt(processor, [{"type": "video"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "?"}],
                  [_image(side, side)], videos)
    ours = out["input_ids"].tolist()
    ids, video_blocks = adapter.vllm_collapse_videos(ours)
    vocab = processor.tokenizer.get_vocab()
    ids, image_blocks = adapter.vllm_collapse(ids, vocab)
    assert len(video_blocks) == 2 and len(image_blocks) == 1
    assert ids.count(adapter.video_token_id) == 2 and ids.count(adapter.image_token_id) == 1
    assert adapter.vllm_expand_videos(adapter.vllm_expand(ids, image_blocks, vocab), video_blocks) == ours
    items, kwargs = adapter.vllm_video_items(videos)
    if family == "qwen3_vl":  # (frames, metadata) items; vLLM computes the timestamps from them
        assert kwargs == {} and items[0][0].shape == (4, side, side, 3) and items[0][0].dtype == np.uint8
        assert items[0][1]["frames_indices"] == [0, 1, 2, 3] and items[0][1]["fps"] == 2.0
        assert items[0][1]["do_sample_frames"] is False
        times = group_timestamps(items[1][1], 2)
        assert processor.tokenizer.encode(f"<{times[0]:.1f} seconds>", add_special_tokens=False) == video_blocks[1][:len(
            processor.tokenizer.encode(f"<{times[0]:.1f} seconds>", add_special_tokens=False))]
    else:  # frames alone, the timing as the request's processor argument (transformers' sampled fps)
        assert items[1].shape == (2, side, 2 * side, 3)
        metas = kwargs["video_metadata"]
        assert [len(m["frames_indices"]) / m["total_num_frames"] * m["fps"] for m in metas] == [2.0, 1.0]


# --- families without video ------------------------------------------------------------------------
def test_family_without_video_fails_naming_family_and_videos(tmp_path, video_parquet):
    """At start (preflight) in one line naming the family and `videos`; and at every later check."""
    from tools.make_tiny_model import make_tiny_model

    from data.processing import encode_prompt
    from grpo.config import ConfigError, load_config
    from grpo.preflight import preflight

    path = make_tiny_model(tmp_path / "llava", family="llava", size="tiny", seed=0)
    adapter = _adapter(path)
    assert not adapter.takes_video and _adapter_takes_video("qwen2_5_vl")
    cfg = load_config("configs/demo.yaml", [f"model.path={path}", f"data.train_path={video_parquet}", "data.eval_path=",
                                            "data.task=video", "data.min_pixels=3136", "data.max_pixels=3136"])
    with pytest.raises(ConfigError, match=r"rows have `videos`, but model family 'llava' takes no video") as err:
        preflight(cfg)
    assert "\n" not in str(err.value) and "qwen2_5_vl" in str(err.value)
    with pytest.raises(ValueError, match="'llava' takes no video.*`videos`"):
        adapter.position_ids(torch.tensor([1, 2]), None, torch.tensor([[1, 2, 2]]))
    sample = SimpleNamespace(index=0, problem="<video>what?", images=[], answer="1",
                             videos=[Video(_frames(2, 56, 56), fps=2.0)])
    with pytest.raises(ValueError, match="takes no video"):
        encode_prompt(load_processor(str(path)), sample, "clevr", 512)


def _adapter_takes_video(family: str) -> bool:
    from models.family import FAMILIES

    return any(rule.video_placeholder for rule in FAMILIES[family].image_rules.values())


# --- a GRPO step and an SFT step on a video dataset, through the trainer ---------------------------------
@pytest.fixture(scope="module")
def video_parquet(tmp_path_factory):
    from tools.make_dataset import make_dataset

    return make_dataset("video", 4, 0, tmp_path_factory.mktemp("data") / "video.parquet", fps=2.0, frames=4,
                        size=(56, 56))


def _train_one_step(config, overrides, monkeypatch):
    """Trainer(cfg).train() for one step in this process (train.py's path past the launcher); returns the
    step's metrics and the patch grids the vision tower saw."""
    import grpo.trainer as trainer_module
    from grpo.config import load_config
    from models.parallel import init_distributed

    init_distributed()
    trainer = trainer_module.Trainer(load_config(config, overrides))
    grids = []
    tower = trainer.policy.adapter.vision_tower(trainer.policy.model)
    tower.register_forward_hook(lambda m, a, kw, o: grids.extend(kw["grid_thw"].tolist()), with_kwargs=True)
    trainer.train()
    return json.loads((trainer.run_dir / "metrics.jsonl").read_text().splitlines()[-1]), grids


COMMON = ["logging.tensorboard=false", "trainer.progress=false", "trainer.eval_every=0", "checkpoint.every_steps=0",
          "trainer.max_steps=1", "optim.warmup_steps=0", "data.task=video", "data.min_pixels=3136",
          "data.max_pixels=3136", "data.eval_path="]


def test_grpo_step_on_a_video_dataset(tiny_model, video_parquet, tmp_path, monkeypatch):
    """Generated clips (tools/make_dataset.py --kind video) through the built-in engine and the policy:
    the engine's logprobs equal the policy's (video positions and features agree), and the step learns."""
    import rollout.rollouts as rollouts_module
    from data.rewards import RewardResult

    def varied(task, response, answer, **_):
        value = float(len(response) % 3) / 2
        return RewardResult(value, value, 0.0)

    monkeypatch.setattr(rollouts_module, "score", varied)
    row, grids = _train_one_step("configs/demo.yaml", [
        f"model.path={tiny_model}", f"data.train_path={video_parquet}", f"trainer.run_dir={tmp_path / 'grpo'}",
        "data.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6", *COMMON], monkeypatch)
    assert grids and all(t == 2 for t, _, _ in grids)  # 4 frames = 2 temporal groups per clip
    assert 1.0 <= row["fidelity/token_mult_prob_error"] <= 1.0001, row["fidelity/token_mult_prob_error"]
    assert row["reward/std"] > 0 and row["loss/grad_norm"] > 0 and row["loss/skipped_nonfinite"] == 0


def test_sft_step_on_a_video_dataset(tiny_model, video_parquet, tmp_path, monkeypatch):
    row, grids = _train_one_step("configs/sft_clevr_tiny.yaml", [
        f"model.path={tiny_model}", f"data.train_path={video_parquet}", f"trainer.run_dir={tmp_path / 'sft'}",
        "data.prompts_per_step=4", "data.shuffle=false", *COMMON], monkeypatch)
    assert grids and all(t == 2 for t, _, _ in grids)
    assert row["loss/grad_norm"] > 0 and row["loss/total"] > 0 and row["loss/skipped_nonfinite"] == 0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_shared_prompt_rows_with_videos_equal_unshared_rows(family, tiny_model, qwen3_vl):
    """model.shared_prompts (on by default on CUDA for these families) with video prompts: a prompt's video
    (and its image) once per row, its responses after it; the same logprobs as unshared rows, fp32."""
    from grpo.config import ModelConfig
    from models.packing import prompt_groups
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    path = tiny_model if family == "qwen2_5_vl" else qwen3_vl
    init_distributed()
    policy = build_policy(ModelConfig(path=str(path), shared_prompts="on"), build_parallel_dims())
    processor = load_processor(str(path))
    prompts = _rows(processor, policy.adapter, processor.images.factor)
    owners = [0, 0, 0, 1, 1, 2, 2, 3, 3]
    batch = _batch(policy.adapter, prompts, owners)
    indices = list(range(len(owners)))
    groups = prompt_groups(batch)
    assert sorted(len(members) for members, prefix in groups if prefix > 0) == [2, 2, 2, 3]
    with torch.no_grad():
        shared, _ = policy.logprobs(pack(batch, indices, share_prompts=True))
        plain, _ = policy.logprobs(pack(batch, indices))
    assert pack(batch, indices, share_prompts=True).num_tokens < pack(batch, indices).num_tokens
    assert torch.allclose(shared, plain, atol=1e-5), (shared - plain).abs().max()
