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


# Qwen2.5's chat template as far as tools go (its system turn with `tools=`, verbatim), then ChatML turns
# with the tiny template's image part: a template that takes `tools=`, unlike the tiny one.
QWEN25_TOOLS_TEMPLATE = r"""
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0]['role'] == 'system' -%}
        {{- messages[0]['content'] -}}
    {%- else -%}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -}}
    {%- endif -%}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
    {%- for tool in tools -%}
        {{- "\n" -}}
        {{- tool | tojson -}}
    {%- endfor -%}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- elif messages[0]['role'] == 'system' -%}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}
{%- else -%}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if not (loop.first and message['role'] == 'system') -%}
        {{- '<|im_start|>' + message['role'] + '\n' -}}
        {%- if message['content'] is string -%}
            {{- message['content'] -}}
        {%- else -%}
            {%- for part in message['content'] -%}
                {%- if part['type'] == 'image' -%}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
                {%- elif 'text' in part -%}
                    {{- part['text'] -}}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def _tool_prompt(processor):
    from data.trajectories import build_tool_prompt
    from models.family import FAMILIES
    from rollout.tools import _REGISTRY, tool_schema

    schemas = [tool_schema(_REGISTRY[n]) for n in ("image_zoom_in_tool", "calculator")]
    return schemas, build_tool_prompt(processor, schemas, FAMILIES["qwen2_5_vl"].tool_format.system_with_tools)


def test_tool_schemas_render_into_prompts_and_trajectories_alike(tiny_model, sft_rows):
    from data.generators.zoom import SYSTEM

    ds = VLDataset(sft_rows, "zoom", **PIXELS)
    texts = {}
    for name, template in (("family", None), ("template", QWEN25_TOOLS_TEMPLATE)):
        processor = load_processor(str(tiny_model))
        if template:
            processor.tokenizer.chat_template = template
        schemas, tp = _tool_prompt(processor)
        assert tp.template_takes_tools == (name == "template")
        for i in range(2):
            sample = ds.get(i)
            assert sample.system == SYSTEM
            prompt = encode_prompt(processor, sample, "zoom", 4096, tp)
            text = processor.tokenizer.decode(prompt.input_ids)
            # each schema on its own line, as the template's `tool | tojson` writes it, in rollout.tools order
            lines = [json.dumps(s, ensure_ascii=False) for s in schemas]
            assert "<tools>\n" + "\n".join(lines) + "\n</tools>" in text
            assert text.startswith(f"<|im_start|>system\n{SYSTEM}\n\n# Tools\n")  # the row's system text first
            # the SFT conversation starts with exactly the rollout prompt's tokens
            conv = prompt.conversation.input_ids.tolist()
            n = prompt.input_ids.numel()
            assert conv[:n] == prompt.input_ids.tolist() and prompt.conversation.loss_mask[:n].sum() == 0
            texts.setdefault(i, []).append(text)
    # the family's rule writes exactly what a template that takes tools= writes
    assert all(a == b for a, b in texts.values())


def test_a_system_prompt_that_holds_the_schemas_wins(tiny_model):
    from data.trajectories import render_chat

    processor = load_processor(str(tiny_model))
    schemas, tp = _tool_prompt(processor)
    user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    own = "Tools: " + " ".join(json.dumps(s) for s in schemas)
    assert render_chat(processor, [{"role": "system", "content": own}, user], True, tp) == \
        render_chat(processor, [{"role": "system", "content": own}, user], True, None)
    # a system prompt naming only one of them gets the schemas added after it; none: the family's default
    partial = render_chat(processor, [{"role": "system", "content": json.dumps(schemas[0])}, user], True, tp)
    assert partial.count(json.dumps(schemas[1])) == 1 and partial.count(json.dumps(schemas[0])) == 2
    bare = render_chat(processor, [user], True, tp)
    assert bare.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
