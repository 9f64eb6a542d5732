"""SFT on multi-turn trajectories (`messages` rows): the loss mask covers the assistant turns exactly,
m-rope positions over the conversation's several images equal transformers' reference, and an SFT step
of the trainer runs on such rows with the tiny Qwen2.5-VL."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from data.datasets import VLDataset
from data.processing import encode_prompt, load_processor
from tools.make_dataset import make_dataset

PIXELS = dict(min_pixels=3136, max_pixels=12544)


@pytest.fixture(scope="module")
def sft_rows(tmp_path_factory):
    return make_dataset("zoom_sft", 6, 0, tmp_path_factory.mktemp("traj") / "zoom_sft.parquet", **PIXELS)


@pytest.fixture(scope="module")
def encoded(tiny_model, sft_rows):
    processor = load_processor(str(tiny_model))
    ds = VLDataset(sft_rows, "zoom", **PIXELS)
    return processor, [(ds.get(i), encode_prompt(processor, ds.get(i), "zoom", 4096)) for i in range(2)]


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) spans where mask is 1."""
    spans, start = [], None
    for i, v in enumerate(mask.tolist() + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_mask_covers_exactly_the_assistant_turns(encoded):
    processor, pairs = encoded
    tok = processor.tokenizer
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for sample, prompt in pairs:
        conv = prompt.conversation
        ids, mask = conv.input_ids.tolist(), conv.loss_mask
        # reference spans from the token ids alone: after each assistant header, up to its <|im_end|>
        expected = []
        for i in range(len(ids) - len(header) + 1):
            if ids[i:i + len(header)] == header:
                start = i + len(header)
                expected.append((start, ids.index(im_end, start) + 1))
        assert len(expected) == 2 and runs(mask) == expected
        texts = [tok.decode(ids[a:b]) for a, b in expected]
        turns = [m for m in sample.conversation if m["role"] == "assistant"]
        assert texts == [t["content"][0]["text"] + "<|im_end|>" for t in turns]
        unmasked = tok.decode([t for t, m in zip(ids, mask.tolist()) if not m])
        assert "<tool_response>" in unmasked and "What colour" in unmasked and "<|im_start|>system" in unmasked
        # both images sit in the sequence, expanded by the image rule, with their grids
        pad = tok.convert_tokens_to_ids("<|image_pad|>")
        assert conv.image_grid_thw.shape[0] == 2
        assert ids.count(pad) == int(conv.image_grid_thw.prod(-1).sum()) // 4
        assert not any(m and t == pad for t, m in zip(ids, mask.tolist()))
        # the prompt part is the same row encoded for rollouts: the first user turn only
        assert prompt.input_ids.tolist() == ids[:prompt.input_ids.numel() - len(header)] + header


def test_mrope_positions_over_the_conversation_match_the_reference(tiny_model, encoded):
    from transformers import AutoModelForImageTextToText

    from models.family import build_adapter

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_model), local_files_only=True, dtype=torch.float32)
    adapter = build_adapter(model.config)
    inner = model.model
    params = inspect.signature(inner.get_rope_index).parameters
    for _, prompt in encoded[1]:
        conv = prompt.conversation
        ids, grid = conv.input_ids, conv.image_grid_thw
        ours = adapter.position_ids(ids, grid)
        if "mm_token_type_ids" in params:
            mm = (ids == adapter.image_token_id).int()[None]
            ref, _ = inner.get_rope_index(ids[None], mm_token_type_ids=mm, image_grid_thw=grid)
        else:
            ref, _ = inner.get_rope_index(ids[None], image_grid_thw=grid, attention_mask=torch.ones_like(ids)[None])
        assert torch.equal(ref[:, 0], ours[1:])
        # two images: the second image's positions start after the first image's and the text between
        assert int(ours[1:].max()) < ids.numel()


def test_sft_step_on_trajectories(tiny_model, sft_rows, tmp_path):
    import grpo.trainer as trainer_module
    from grpo.config import load_config
    from models.parallel import init_distributed

    init_distributed()
    run = tmp_path / "sft"
    cfg = load_config("configs/sft_clevr_tiny.yaml", [
        f"model.path={tiny_model}", f"data.train_path={sft_rows}", "data.task=zoom", f"trainer.run_dir={run}",
        "trainer.max_steps=2", "data.prompts_per_step=3", "data.shuffle=false", "optim.warmup_steps=0",
        "data.min_pixels=3136", "data.max_pixels=12544", "logging.tensorboard=false", "trainer.progress=false",
        "checkpoint.every_steps=0", "data.max_prompt_tokens=4096"])
    trainer = trainer_module.Trainer(cfg)
    trainer.train()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss/total" in r]
    assert len(rows) == 2 and all(r["loss/grad_norm"] > 0 and r["loss/skipped_nonfinite"] == 0 for r in rows)
    # the step's loss counts the assistant tokens of its 3 conversations and nothing else
    processor = load_processor(str(tiny_model))
    ds = VLDataset(sft_rows, "zoom", **PIXELS)
    convs = [encode_prompt(processor, ds.get(i), "zoom", 4096).conversation for i in range(3)]
    assert rows[0]["perf/scored_tokens"] == sum(int(c.loss_mask.sum()) for c in convs)
    assert rows[0]["perf/tokens"] == sum(c.input_ids.numel() for c in convs)
