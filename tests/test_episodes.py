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
from data.trajectories import render_chat
from grpo.config import load_config
from models.family import FAMILIES
from rollout.base import Generation
from rollout.episode import MODEL, PROMPT, TOOL, episode_batch
from rollout.groups import EngineGroup
from rollout.rollouts import Rollouts, awake, tool_prompt
from rollout.tools import _REGISTRY, tool_schema

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


def _prompt(processor, index=0, color=(200, 30, 30), answer="3", tool_prompt=None) -> EncodedPrompt:
    image = Image.new("RGB", (56, 56), color)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = render_chat(processor, messages, True, tool_prompt)
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
        # as vLLM reports its prefix cache: here, say, half of each prompt
        self.last_stats = {"prompt_tokens": sum(len(p.input_ids) for p in prompts),
                           "cached_prompt_tokens": sum(len(p.input_ids) // 2 for p in prompts)}
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
    # the prompts carry the configured tools' schemas in their system turn, as the trainer encodes them
    tp = tool_prompt(cfg, rollouts.adapter, processor)
    prompts = [_prompt(processor, 0, tool_prompt=tp), _prompt(processor, 1, (20, 200, 30), tool_prompt=tp)]
    text = processor.tokenizer.decode(prompts[0].input_ids)
    schemas = "\n".join(json.dumps(tool_schema(_REGISTRY[n]), ensure_ascii=False) for n in cfg.rollout.tools)
    assert text.startswith("<|im_start|>system\n") and f"<tools>\n{schemas}\n</tools>" in text
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
        whole = processor(render_chat(processor, conversation, True, tp), e.images)
        assert e.token_ids[:s2] == whole["input_ids"].tolist()
        assert torch.equal(e.image_grid_thw(), whole["image_grid_thw"])
        assert torch.equal(e.pixel_values(), whole["pixel_values"])
        assert e.sources == [PROMPT] * s1 + [MODEL] * (e1 - s1) + [TOOL] * (s2 - e1) + [MODEL] * (e2 - s2)
        assert e.logprobs == [-0.25] * ((e1 - s1) + (e2 - s2))
    assert all(r.accuracy == 1.0 for r in infos)  # the final answer is scored
    # the prompt's episodes share its pixel tensor (the tower encodes it once per group)
    assert episodes[0].prompt_pixels is episodes[1].prompt_pixels is prompts[0].pixel_values
    # the turn's tool messages were encoded together: a prompt's two episodes got the same crop, processed once
    assert episodes[0].tool_pixels[0] is episodes[1].tool_pixels[0]
    assert episodes[1].tool_pixels[0] is not episodes[2].tool_pixels[0]


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


FAILURES = {
    "malformed_json": '<tool_call>{"name": "image_zoom_in_tool", </tool_call><|im_end|>',
    "unknown_tool": _call({"name": "no_such_tool", "arguments": {}}),
    "bad_arguments": _call({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500]}}),
    "tool_exception": _call({"name": "episode_crash", "arguments": {}}),
    "timeout": _call({"name": "episode_nap", "arguments": {"seconds": 30}}),
    None: _call({"name": "calculator", "arguments": {"expression": "20 + 3"}}),
}


def test_each_tool_failure_is_counted_and_the_episode_goes_on(tiny_model, user_module):
    processor = load_processor(str(tiny_model))
    cfg = _cfg(tiny_model, "rollout.tools=[image_zoom_in_tool,calculator,episode_nap,episode_crash]",
               f"rollout.tools_module={user_module}", "rollout.tool_timeout_s=1", "rollout.tool_workers=6")
    engine = ScriptedEngine(processor.tokenizer, [list(FAILURES.values()), ["<answer>3</answer><|im_end|>"]])
    rollouts = _rollouts(cfg, processor, engine)
    try:
        _, episodes, _ = rollouts.generate_and_score(engine, [_prompt(processor)], rollouts_params(n=len(FAILURES)))
        metrics = rollouts.metrics(episodes, "cpu")
    finally:
        rollouts.close()
    for kind, e in zip(FAILURES, episodes):
        assert e.finish_reason == "answered" and len(e.turns) == 2 and e.tool_calls == 1, kind
        assert e.tool_errors == ({} if kind is None else {kind: 1})
        # the model sees the error (or the result) as the tool's answer, then answers
        shown = processor.tokenizer.decode([t for t, s in zip(e.token_ids, e.sources) if s == TOOL])
        assert "<tool_response>" in shown and ("23" in shown if kind is None else len(shown) > 40), (kind, shown)
    for kind in FAILURES:
        if kind:
            assert metrics[f"agent/tool_errors_{kind}"] == 1, kind
    assert metrics["agent/tool_calls"] == 6 and metrics["agent/tool_errors"] == 5
    assert metrics["agent/finish_answered"] == 1.0 and metrics["agent/turns_mean"] == 2.0
    given = [ids for call_ids, _ in engine.calls for ids in call_ids]
    assert metrics["agent/prefix_cache_hit"] == sum(len(i) // 2 for i in given) / sum(len(i) for i in given)


def _run(tiny_model, script, *extra, n=1):
    processor = load_processor(str(tiny_model))
    engine = ScriptedEngine(processor.tokenizer, script)
    cfg = _cfg(tiny_model, *extra)
    rollouts = _rollouts(cfg, processor, engine)
    params = rollouts_params(n=n, max_new_tokens=cfg.rollout.max_new_tokens)
    try:
        return rollouts.generate_and_score(engine, [_prompt(processor)], params)[1], processor
    finally:
        rollouts.close()


def test_limits_end_episodes_with_their_reason(tiny_model):
    answer = "<answer>3</answer><|im_end|>"
    (e,), _ = _run(tiny_model, [[_call(ZOOM)], [_call(ZOOM)]], "rollout.max_turns=2")
    assert (e.finish_reason, len(e.turns), e.tool_images) == ("max_turns", 2, 1)
    (e,), _ = _run(tiny_model, [[_call(ZOOM)], [_call(ZOOM)], [answer]], "rollout.max_tool_images=1")
    assert (e.finish_reason, len(e.turns), e.tool_images) == ("max_tool_images", 2, 1)
    (e,), _ = _run(tiny_model, [[FAILURES["unknown_tool"]]], "rollout.max_tool_errors=1")
    assert (e.finish_reason, len(e.turns), e.errors) == ("tool_error_limit", 1, 1)
    (e,), processor = _run(tiny_model, [[answer]], "rollout.max_new_tokens=3")
    assert (e.finish_reason, e.model_tokens, e.engine_finish) == ("max_tokens", 3, "length")
    # max_new_tokens is a budget over all turns: the second turn gets what the first left
    first = len(processor.tokenizer.encode(_call(ZOOM), add_special_tokens=False))
    (e,), _ = _run(tiny_model, [[_call(ZOOM)], [answer]], f"rollout.max_new_tokens={first + 2}")
    assert (e.finish_reason, e.model_tokens, len(e.turns)) == ("max_tokens", first + 2, 2)
    # a tool result that would leave no room for another model token ends the episode unappended
    prompt_len = _prompt(processor).input_ids.numel()
    (e,), _ = _run(tiny_model, [[_call(ZOOM)], [answer]], "data.max_prompt_tokens=100",
                   f"rollout.max_context_tokens={prompt_len + first + 20}")
    assert (e.finish_reason, len(e.turns), e.tool_images, len(e.token_ids)) == ("max_tokens", 1, 0, prompt_len + first)


def test_without_tools_an_episode_is_one_turn(tiny_model):
    processor = load_processor(str(tiny_model))
    cfg = load_config(None, [f"model.path={tiny_model}", "data.task=clevr"])
    engine = ScriptedEngine(processor.tokenizer, [[_call(ZOOM), "<answer>3</answer>"]])
    rollouts = _rollouts(cfg, processor, engine)
    _, episodes, infos = rollouts.generate_and_score(engine, [_prompt(processor)], rollouts_params(n=2))
    assert len(engine.calls) == 1 and rollouts.metrics(episodes, "cpu") == {}
    assert [(e.finish_reason, len(e.turns)) for e in episodes] == [("answered", 1), ("max_tokens", 1)]
    assert infos[1].accuracy == 1.0


def _hf_model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logprobs(model, ids: list[int], pixels, grid, start: int) -> torch.Tensor:
    """Logprobs of ids[start:] from transformers' forward on the whole sequence, at the positions of the
    model's own `get_rope_index`."""
    import inspect

    t = torch.tensor([ids])
    kwargs = {}
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        mm = (t == model.config.image_token_id).int()
        kwargs["position_ids"], _ = model.model.get_rope_index(t, mm_token_type_ids=mm, image_grid_thw=grid)
    logits = model(input_ids=t, pixel_values=pixels, image_grid_thw=grid, **kwargs).logits[0].float()
    return torch.log_softmax(logits[start - 1:-1], -1).gather(1, t[0, start:, None])[:, 0]


def _zoom_episode(tiny_model):
    (e,), processor = _run(tiny_model, [[_call(ZOOM)], ["<answer>3</answer><|im_end|>"]])
    assert len(e.images) == 2
    return e, processor


def test_positions_over_several_images_match_the_reference(tiny_model):
    import inspect

    e, _ = _zoom_episode(tiny_model)
    model = _hf_model(tiny_model)
    inner = model.model
    if "mm_token_type_ids" not in inspect.signature(inner.get_rope_index).parameters:
        pytest.skip("this transformers version computes rope indices with another signature")
    adapter = FAMILIES["qwen2_5_vl"].adapter(model.config)
    ids = torch.tensor(e.token_ids)
    grid = e.image_grid_thw()
    ours = episode_batch([e], adapter)["position_ids"].items[0]
    mm = (ids == adapter.image_token_id).int()[None]
    ref, _ = inner.get_rope_index(ids[None], mm_token_type_ids=mm, image_grid_thw=grid)
    assert grid.shape[0] == 2 and torch.equal(ref[:, 0], ours[1:])
    assert torch.equal(ours[0], torch.arange(ids.numel()))


def test_the_built_in_engine_continues_an_episode_with_several_images(tiny_model):
    from rollout.base import SamplingParams
    from rollout.torch_engine import TorchEngine

    e, _ = _zoom_episode(tiny_model)
    start, _ = e.turns[1]
    prompt = e.engine_input()
    prompt.input_ids = e.token_ids[:start]  # the episode as turn 2 got it: two images, a tool message
    engine = TorchEngine(str(tiny_model))
    (g,) = engine.generate([prompt], SamplingParams(n=1, max_new_tokens=5, seed=1))
    ref = _hf_logprobs(engine.model, prompt.input_ids + g.token_ids, prompt.pixel_values, prompt.image_grid_thw,
                       start)
    assert len(g.token_ids) == 5 and torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-5)


class TeacherEngine:
    """Writes fixed texts and reports the model's own logprobs of them (transformers' forward on the
    whole sequence): per prompt, sample 0 zooms and then answers, sample 1 calls a tool that does not
    exist and then writes no answer."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.calls = model, tokenizer, 0

    def generate(self, prompts, params):
        turn, self.calls = self.calls, self.calls + 1
        out = []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                later = "<answer>1</answer><|im_end|>" if j == 0 else "no idea<|im_end|>"
                text = (_call(ZOOM) if j == 0 else FAILURES["unknown_tool"]) if turn == 0 else later
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                lps = _hf_logprobs(self.model, list(p.input_ids) + ids, p.pixel_values, p.image_grid_thw,
                                   len(p.input_ids))
                out.append(Generation(i, ids, lps.tolist(), "stop"))
        return out


@pytest.mark.parametrize("shared", [False, True])
def test_grpo_step_with_tools_through_the_trainer(tiny_model, clevr_parquet, tmp_path, shared):
    """Episodes with a zoom and with a failed call train in one step; the policy's packed logprobs of
    the model tokens, with the tool images, equal transformers' on each whole episode (also with each
    prompt once per row: model.shared_prompts); each failed call costs algorithm.tool_error_penalty."""
    from grpo.trainer import Trainer
    from models.parallel import init_distributed

    init_distributed()
    cfg = load_config(None, [
        "trainer.mode=grpo", f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        f"trainer.run_dir={tmp_path / 'run'}", "logging.tensorboard=false", "checkpoint.resume=never",
        f"optim.max_tokens_per_microbatch={1000 if shared else 200}", "rollout.tools=[image_zoom_in_tool]",
        "rollout.max_turns=2", "rollout.max_new_tokens=200", "algorithm.tool_error_penalty=0.5",
        f"model.shared_prompts={shared}",
    ])
    trainer = Trainer(cfg)
    engine = TeacherEngine(_hf_model(tiny_model), trainer.tokenizer)
    wakes = []
    trainer.rollouts.generating = lambda: wakes.append(1) or awake(engine)
    collect, seen = trainer.rollouts.collect, []
    trainer.rollouts.collect = lambda *a: seen.append(collect(*a)) or seen[-1]
    try:
        m = trainer.grpo_step(2)
    finally:
        trainer.rollouts.close()
    assert engine.calls == 2 and len(wakes) == 1  # two turns, each one engine call, the engine awake once
    assert m["agent/turns_mean"] == 2.0 and m["agent/tool_calls"] == 4 and m["agent/images_per_episode"] == 1.5
    assert {k: v for k, v in m.items() if k.startswith("agent/finish_")} == {
        "agent/finish_answered": 1.0, "agent/finish_max_turns": 0.0, "agent/finish_max_tool_images": 0.0,
        "agent/finish_max_tokens": 0.0, "agent/finish_tool_error_limit": 0.0}
    assert m["agent/tool_errors"] == 2 and m["agent/tool_errors_unknown_tool"] == 2
    _, episodes, infos = seen[0]
    penalized = [r.score - 0.5 * e.errors for e, r in zip(episodes, infos)]
    assert [e.errors for e in episodes] == [0, 1, 0, 1]
    assert abs(m["reward/mean"] - sum(penalized) / 4) < 1e-6
    assert 1.0 <= m["fidelity/token_mult_prob_error"] <= 1.0001, m["fidelity/token_mult_prob_error"]
    assert m["reward/std"] > 0 and m["loss/grad_norm"] > 0
    assert (m["perf/row_token_share"] < 0.9) if shared else (m["perf/row_token_share"] == 1.0), m["perf/row_token_share"]
    # the data feed and scoring, every engine: parts of generation's seconds
    assert m["perf/gen_data_s"] > 0 and m["perf/gen_score_s"] > 0
    assert m["perf/gen_data_s"] + m["perf/gen_score_s"] <= m["perf/gen_s"]


def test_vllm_gets_an_episode_with_several_images_and_its_limit(tiny_model, monkeypatch):
    """Without vLLM: the engine's request for a two-image episode, and the image limit the factory sets."""
    from types import SimpleNamespace

    import rollout.factory as factory
    import rollout.vllm_engine as vllm_engine

    e, processor = _zoom_episode(tiny_model)
    engine = object.__new__(vllm_engine.VLLMEngine)
    engine.adapter, engine.family = FAMILIES["qwen2_5_vl"].adapter(_model_config(tiny_model)), "qwen2_5_vl"
    engine._vocab = processor.tokenizer.get_vocab()
    engine.max_images_per_prompt = 5
    request = engine._vllm_prompt(0, e.engine_input())
    pad = engine.adapter.image_token_id
    assert request["multi_modal_data"]["image"] == e.images and request["prompt_token_ids"].count(pad) == 2
    engine.max_images_per_prompt = 1
    with pytest.raises(ValueError, match="2 images.*max_images_per_prompt"):
        engine._vllm_prompt(0, e.engine_input())

    built = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda path, **kw: built.update(kw))
    monkeypatch.setattr(factory, "resolve_engine_name", lambda name, family=None: "vllm")
    policy = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(model_type="qwen2_5_vl")),
                             dtype=torch.bfloat16, adapter=engine.adapter)
    factory.build_engine(_cfg(tiny_model, "rollout.max_tool_images=3", "rollout.max_context_tokens=4000"), policy)
    assert built["max_images_per_prompt"] == 4 and built["max_model_len"] == 4000
    factory.build_engine(load_config(None, [f"model.path={tiny_model}"]), policy)
    assert built["max_images_per_prompt"] == 1 and built["max_model_len"] == 2048 + 64


class ListFeeder:
    def __init__(self, prompts):
        self.prompts, self.taken = prompts, 0

    def next(self, k):
        out = self.prompts[self.taken:self.taken + k]
        self.taken += k
        return out


def test_dynamic_sampling_refills_inside_one_wake(tiny_model):
    """Groups whose episodes all score the same are dropped and refilled; the engine wakes once."""
    processor = load_processor(str(tiny_model))
    cfg = _cfg(tiny_model, "algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=2")
    texts = ["<answer>3</answer><|im_end|>", "<answer>4</answer><|im_end|>"]
    engine = ScriptedEngine(processor.tokenizer, [texts] * 3 + [[_call(ZOOM)]])
    wakes = []
    rollouts = _rollouts(cfg, processor, engine)
    rollouts.generating = lambda: wakes.append(1) or awake(engine)
    feeder = ListFeeder([_prompt(processor, i, answer=a) for i, a in enumerate(["5", "3", "5", "4"])])
    try:
        prompts, episodes, infos = rollouts.collect(feeder, 2, rollouts_params(n=2))
        # without tools in use, the same configuration answers in one turn
        _, single, _ = rollouts.evaluate([_prompt(processor)], rollouts_params(n=1), use_tools=False)
    finally:
        rollouts.close()
    assert [p.answer for p in prompts] == ["3", "4"] and len(wakes) == 2 and len(engine.calls) == 4
    assert [e.prompt_index for e in episodes] == [0, 0, 1, 1]
    assert [r.accuracy for r in infos] == [1.0, 0.0, 0.0, 1.0]
    assert len(single[0].turns) == 1


def test_collect_times_the_data_feed_and_scoring_of_every_round(tiny_model, monkeypatch):
    """Rollouts.times: the seconds in feeder.next and in scoring over all of collect's rounds (refills
    included), within collect's own; evaluate starts its own."""
    import time

    import rollout.rollouts as rollouts_module

    processor = load_processor(str(tiny_model))
    cfg = _cfg(tiny_model, "algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=2")
    texts = ["<answer>3</answer><|im_end|>", "<answer>4</answer><|im_end|>"]
    engine = ScriptedEngine(processor.tokenizer, [texts] * 4)
    rollouts = _rollouts(cfg, processor, engine)
    scored = []
    real_score = rollouts_module.score

    def slow_score(task, text, answer):
        time.sleep(0.01)
        scored.append(text)
        return real_score(task, text, answer)

    class SlowFeeder(ListFeeder):
        def next(self, k):
            time.sleep(0.05)
            return super().next(k)

    monkeypatch.setattr(rollouts_module, "score", slow_score)
    feeder = SlowFeeder([_prompt(processor, i, answer=a) for i, a in enumerate(["5", "3", "5", "4"])])
    try:
        start = time.perf_counter()
        rollouts.collect(feeder, 2, rollouts_params(n=2))
        elapsed = time.perf_counter() - start
        times = dict(rollouts.times)
        rollouts.evaluate([_prompt(processor)], rollouts_params(n=1), use_tools=False)
    finally:
        rollouts.close()
    assert feeder.taken == 4 and len(scored) == 9  # three rounds: 2 + 1 + 1 prompts, 8 episodes; evaluate's 1
    assert times["data_s"] >= 3 * 0.05 and times["score_s"] >= 8 * 0.01
    assert times["data_s"] + times["score_s"] <= elapsed
    assert rollouts.times["data_s"] == 0.0 and 0.01 <= rollouts.times["score_s"] < times["score_s"]


def test_qwen3_vl_tool_results_use_its_tool_role(tmp_path):
    """Qwen3-VL's tool result is a message of the template's tool role, its image on Qwen3's 32-pixel grid."""
    from data.processing import VLProcessor
    from rollout.episode import ToolResultEncoder
    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "qwen3", family="qwen3_vl", size="tiny", seed=0)
    processor = VLProcessor(str(path))
    encoder = ToolResultEncoder(processor, FAMILIES["qwen3_vl"].tool_format, "<|im_end|>", 3136, 3136)
    ids, pixels, grid, images = encoder.encode([("zoomed", [Image.new("RGB", (40, 90), "red")]), ("error: x", [])])
    text = processor.tokenizer.decode(ids)
    assert text.startswith("\n<|im_start|>tool\n<|vision_start|><|image_pad|>")
    assert text.endswith("zoomed<|im_end|>\n<|im_start|>tool\nerror: x<|im_end|>\n<|im_start|>assistant\n")
    assert images[0].width % 32 == 0 and images[0].height % 32 == 0 and grid.shape == (1, 3)
    assert ids.count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == int(grid.prod()) // 4


def _encode_alone(encoder, results):
    """One episode's tool results encoded the plain way: the whole conversation rendered, cut after the
    model's turn, and the processor over the rest with the results' images."""
    from data.images import canonicalize_image

    processor = encoder.processor
    messages = [encoder.format.result_message(text, len(images)) for text, images in results]
    full = processor.apply_chat_template(encoder.base + messages, add_generation_prompt=True)
    images = processor.prepare_images([canonicalize_image(img, min_pixels=encoder.min_pixels,
                                                          max_pixels=encoder.max_pixels)
                                       for _, imgs in results for img in imgs])
    out = processor(full[len(encoder.prefix):], images)
    return out["input_ids"].tolist(), out["pixel_values"], out["image_grid_thw"], images


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_a_turns_tool_results_encoded_together_match_each_alone_bit_for_bit(family, request, tmp_path):
    """encode_many gives every episode what encoding it alone gives (ids, pixels, grid, images), for
    text only, one image, two, the same image twice and errors as text; episodes sent the same image
    content share one processor call and its tensors."""
    from data.processing import VLProcessor
    from rollout.episode import ToolResultEncoder
    from tools.bench_turns import bitwise_equal
    from tools.make_tiny_model import make_tiny_model

    path = (request.getfixturevalue("tiny_model") if family == "qwen2_5_vl"
            else make_tiny_model(tmp_path / family, family=family, size="tiny", seed=0))
    processor = VLProcessor(str(path))
    encoder = ToolResultEncoder(processor, FAMILIES[family].tool_format, "<|im_end|>", 3136, 3136)
    red = Image.new("RGB", (56, 56), (200, 30, 30))
    tall = Image.new("RGB", (40, 90), (20, 60, 200))  # resized by the image rule
    tall.putpixel((3, 5), (255, 255, 0))
    batch = [[("zoomed", [red])], [("zoomed", [red.copy()])], [("error: bbox out of range", [])],
             [("both", [red, tall])], [("twice", [tall, tall])], [("zoomed", [red]), ("error: timeout", [])],
             [("zoomed", [tall])], [("error: bbox out of range", [])], [("zoomed", [red.copy()])]]
    calls = []
    encode_images = processor.images.encode
    processor.images.encode = lambda images: calls.append(len(images)) or encode_images(images)
    together = encoder.encode_many(batch)
    alone = [encoder.encode(results) for results in batch]
    processor.images.encode = encode_images
    want = [_encode_alone(encoder, results) for results in batch]
    for i, (t, a, w) in enumerate(zip(together, alone, want)):
        assert bitwise_equal(t, w) and bitwise_equal(a, w), i
    # distinct image contents in the batch: [red], [red, tall], [tall, tall], [tall]
    assert calls[:4] == [1, 2, 2, 1] and len(calls) == 4 + sum(1 for results in batch if results[0][1])
    assert together[0][1] is together[1][1] is together[5][1] is together[8][1]
    assert together[6][1] is not together[0][1] and together[2][1] is None
    assert together[0][3][0] is not together[1][3][0]  # each episode keeps its own image objects
    together[0][0].append(-1)
    assert together[1][0] == want[1][0]  # and its own ids


class PixelBlindEngine(ScriptedEngine):
    """A ScriptedEngine that processes images itself, as vLLM does: it records the pixel rows and
    images each call got."""

    reads_pixel_values = False

    def __init__(self, tokenizer, script: list[list[str]]):
        super().__init__(tokenizer, script)
        self.seen = []

    def generate(self, prompts, params):
        self.seen.append([(p.pixel_values, p.image_grid_thw, len(p.images)) for p in prompts])
        return super().generate(prompts, params)


def test_engines_that_process_images_themselves_get_no_joined_pixel_rows(tiny_model):
    e, processor = _zoom_episode(tiny_model)
    full, lean = e.engine_input(), e.engine_input(pixels=False)
    assert full.image_grid_thw.shape[0] == 2 and full.pixel_values.shape[0] == int(full.image_grid_thw.prod(1).sum())
    assert lean.input_ids == full.input_ids and lean.images == full.images and lean.videos == full.videos
    assert lean.pixel_values is None and lean.image_grid_thw is None
    answer = "<answer>3</answer><|im_end|>"
    engine = PixelBlindEngine(processor.tokenizer, [[_call(ZOOM)], [answer]])
    rollouts = _rollouts(_cfg(tiny_model), processor, engine)
    try:
        rollouts.generate_and_score(engine, [_prompt(processor)], rollouts_params(n=2))
    finally:
        rollouts.close()
    first, second = engine.seen
    assert [n for _, _, n in first] == [1] and [n for _, _, n in second] == [2, 2]  # every image, every turn
    assert all(pix is None and grid is None for call in engine.seen for pix, grid, _ in call)
