"""Episodes (rollout/episode.py, rollout/rollouts.py): token in, token out; loss masks; positions over
several images; every tool failure counted; the built-in engine with several images; a GRPO step with tools."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from PIL import Image

from data.batch import Batch
from data.processing import EncodedPrompt, load_processor
from grpo.config import load_config
from models.family import FAMILIES
from rollout.base import Generation
from rollout.episode import MODEL, PROMPT, TOOL, episode_batch
from rollout.groups import EngineGroup
from rollout.rollouts import Rollouts, awake

USER_TOOLS = '''
import time
from rollout.tools import Tool, ToolResult, register_tool

class Nap(Tool):
    name = "episode_nap"
    description = "sleeps"
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
    def __call__(self, arguments, ctx):
        time.sleep(arguments["seconds"])
        return ToolResult(text="awake")

class Crash(Tool):
    name = "episode_crash"
    description = "raises"
    parameters = {"type": "object", "properties": {}}
    def __call__(self, arguments, ctx):
        raise RuntimeError("crashed")

register_tool(Nap())
register_tool(Crash())
'''
ZOOM = {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 28, 28]}}


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    import sys

    folder = tmp_path_factory.mktemp("episode_tools")
    (folder / "vlrl_episode_tools.py").write_text(textwrap.dedent(USER_TOOLS))
    sys.path.insert(0, str(folder))
    yield "vlrl_episode_tools"
    sys.path.remove(str(folder))


def _cfg(model, *extra):
    return load_config(None, [f"model.path={model}", "data.task=clevr", "data.min_pixels=3136", "data.max_pixels=3136",
                              "rollout.tools=[image_zoom_in_tool,calculator]", "rollout.max_turns=3",
                              "rollout.max_new_tokens=200", "rollout.tool_timeout_s=2", *extra])


def _prompt(processor, index=0, color=(200, 30, 30), answer="3") -> EncodedPrompt:
    image = Image.new("RGB", (56, 56), color)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = processor.apply_chat_template(messages)
    images = processor.prepare_images([image])
    out = processor(text, images)
    return EncodedPrompt(index, out["input_ids"], out["pixel_values"], out["image_grid_thw"], images, answer)


class ScriptedEngine:
    """Answers each call with fixed texts (tokenized; a list per call, cycled over its prompts × n)
    and records what it was given."""

    def __init__(self, tokenizer, script: list[list[str]]):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts, params):
        texts = self.script[len(self.calls)]
        self.calls.append(([list(p.input_ids) for p in prompts], params))
        out = []
        for i, _ in enumerate(prompts):
            for j in range(params.n):
                ids = self.tokenizer.encode(texts[(i * params.n + j) % len(texts)], add_special_tokens=False)
                ids = ids[: params.max_new_tokens]
                stop = ids[-1] == self.tokenizer.convert_tokens_to_ids("<|im_end|>")
                out.append(Generation(i, ids, [-0.25] * len(ids), "stop" if stop else "length"))
        return out


def _rollouts(cfg, processor, engine):
    from grpo.algorithm import dynamic_sampling_keep

    adapter = FAMILIES["qwen2_5_vl"].adapter(_model_config(cfg.model.path))
    return Rollouts(cfg, adapter, processor, lambda: awake(engine), EngineGroup(), lambda v: v, dynamic_sampling_keep)


def _model_config(path):
    from models.policy import load_model_config

    return load_model_config(path)


def _call(obj) -> str:
    return f"<tool_call>{json.dumps(obj)}</tool_call><|im_end|>"


def test_token_in_token_out_turn_by_turn(tiny_model):
    processor = load_processor(str(tiny_model))
    cfg = _cfg(tiny_model)
    engine = ScriptedEngine(processor.tokenizer, [[_call(ZOOM)], ["<answer>3</answer><|im_end|>"]])
    rollouts = _rollouts(cfg, processor, engine)
    prompts = [_prompt(processor, 0), _prompt(processor, 1, (20, 200, 30))]
    try:
        _, episodes, infos = rollouts.generate_and_score(engine, prompts, rollouts_params(n=2))
    finally:
        rollouts.close()
    assert len(engine.calls) == 2  # one engine call per turn for all live episodes
    first_ids, first = engine.calls[0]
    assert first.n == 2 and first_ids == [p.input_ids.tolist() for p in prompts]  # the prompts once, n samples
    second_ids, second = engine.calls[1]
    assert second.n == 1 and len(second_ids) == 4
    for e, given in zip(episodes, second_ids):
        (s1, e1), (s2, e2) = e.turns
        assert e.finish_reason == "answered" and e.tool_calls == 1 and not e.tool_errors
        # turn 2 was given exactly the episode so far; each turn's ids are exactly what was sampled
        assert given == e.token_ids[:s2]
        assert e.token_ids[s1:e1] == processor.tokenizer.encode(_call(ZOOM), add_special_tokens=False)
        assert e.token_ids[s2:e2] == processor.tokenizer.encode("<answer>3</answer><|im_end|>", add_special_tokens=False)
        assert e.token_ids[:s1] == prompts[e.prompt_index].input_ids.tolist()
        # the tool tokens are the chat template's rendering of the tool message, its image expanded
        assert len(e.images) == 2 and e.tool_images == 1
        conversation = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
            {"role": "assistant", "content": processor.tokenizer.decode(e.token_ids[s1:e1 - 1])},
            {"role": "user", "content": [{"type": "text", "text": "<tool_response>"}, {"type": "image"},
                                         {"type": "text", "text": "</tool_response>"}]},
        ]
        whole = processor(processor.apply_chat_template(conversation), e.images)
        assert e.token_ids[:s2] == whole["input_ids"].tolist()
        assert torch.equal(e.image_grid_thw(), whole["image_grid_thw"])
        assert torch.equal(e.pixel_values(), whole["pixel_values"])
        assert e.sources == [PROMPT] * s1 + [MODEL] * (e1 - s1) + [TOOL] * (s2 - e1) + [MODEL] * (e2 - s2)
        assert e.logprobs == [-0.25] * ((e1 - s1) + (e2 - s2))
    assert all(r.accuracy == 1.0 for r in infos)  # the final answer is scored
    # the prompt's episodes share its pixel tensor (the tower encodes it once per group)
    assert episodes[0].prompt_pixels is episodes[1].prompt_pixels is prompts[0].pixel_values


def rollouts_params(n=2, max_new_tokens=200, seed=0):
    from rollout.base import SamplingParams

    return SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=[])


def test_loss_mask_and_packing_keep_model_tokens_and_images(tiny_model):
    from grpo.update import PackedStep

    processor = load_processor(str(tiny_model))
    engine = ScriptedEngine(processor.tokenizer, [[_call(ZOOM), "<answer>2</answer><|im_end|>"],
                                                  ["<answer>3</answer><|im_end|>"]])
    rollouts = _rollouts(_cfg(tiny_model), processor, engine)
    prompts = [_prompt(processor, 0), _prompt(processor, 1, (20, 200, 30))]
    try:
        _, episodes, _ = rollouts.generate_and_score(engine, prompts, rollouts_params(n=2))
    finally:
        rollouts.close()
    assert [len(e.turns) for e in episodes] == [2, 1, 2, 1]
    adapter = rollouts.adapter
    batch = episode_batch(episodes, adapter)
    for e, mask in zip(episodes, batch["loss_mask"].items):
        assert mask.tolist() == [int(s == MODEL) for s in e.sources]
    assert batch["tool_pixel_values"].items[1] is None and batch["tool_pixel_values"].items[0] is not None
    step = PackedStep(batch, 4096, torch.device("cpu"))
    step.set_per_token("engine_logprobs", [torch.tensor(e.logprobs) for e in episodes])
    (mb, f), = list(step)
    # scored tokens are exactly the model tokens, in order, one engine logprob each
    want = [t for e in episodes for t, s in zip(e.token_ids[1:], e.sources[1:]) if s == MODEL]
    assert mb.target_ids.tolist() == want and f["engine_logprobs"].numel() == len(want)
    # the distinct image groups: each prompt's once, each two-turn episode's zoom once
    assert mb.pixel_values.shape[0] == sum(p.pixel_values.shape[0] for p in prompts) + sum(
        e.tool_pixel_values().shape[0] for e in episodes if e.tool_pixels)
    assert mb.image_group == [0, 1, 0, 2, 3, 2]
    assert int((mb.input_ids == adapter.image_token_id).sum()) == sum(
        adapter.image_token_count(g) for e in episodes for g in e.image_grid_thw())
