"""Continuous multi-turn rollouts (rollout.continuous_turns): the episodes of `Rollouts._run_continuous` against
the turn-synchronous loop's on a stand-in engine whose answers depend only on the prompt ids; the seeds and
budgets of each request; `VLLMEngine.generate_continuing`'s plumbing on stand-ins of vLLM 0.26's objects."""

from __future__ import annotations

import hashlib
import sys
import textwrap
import time
import types
from types import SimpleNamespace as NS

import pytest
import torch
from PIL import Image

from data.processing import EncodedPrompt, load_processor
from data.trajectories import render_chat
from grpo.config import ConfigError, load_config
from models.family import FAMILIES
from rollout.base import Generation, PromptInput, SamplingParams
from rollout.groups import EngineGroup
from rollout.rollouts import TURN_SEED_STRIDE, Rollouts, awake
from tests.test_episodes import ZOOM, _call, _model_config

QUESTIONS = ["How many?", "How many cubes?", "Count the spheres.", "What color is it?", "Is it red?",
             "How many objects are there?", "Name the shape.", "How many red things?", "Which is largest?",
             "Is there a cylinder?", "How many metal things?", "What is left of the cube?"]


def _cfg(model, *extra):
    return load_config(None, [f"model.path={model}", "data.task=clevr", "data.min_pixels=3136", "data.max_pixels=3136",
                              "rollout.tools=[image_zoom_in_tool,calculator]", "rollout.max_turns=3",
                              "rollout.max_new_tokens=200", "rollout.tool_timeout_s=5", *extra])


def _prompts(processor) -> list[EncodedPrompt]:
    out = []
    for i, question in enumerate(QUESTIONS):
        image = Image.new("RGB", (56, 56), (30 * i, 200 - 20 * i, 90))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        images = processor.prepare_images([image])
        enc = processor(render_chat(processor, messages, True, None), images)
        out.append(EncodedPrompt(i, enc["input_ids"], enc["pixel_values"], enc["image_grid_thw"], images, "3"))
    return out


class TurnEngine:
    """Answers from a prompt's ids alone (a hash of them picks what the model writes and how long it thinks
    first): a zoom, a zoom out of range, a calculator call, an answer, or text without an end of turn that
    runs to the request's max_new_tokens. `generate` is the Engine contract (n per prompt, prompt-major)."""

    reads_pixel_values = False
    calculator = "calculator"  # the tool a calculator call names

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls = []  # generate: (number of prompts, params)
        self.requests = []  # generate_continuing: (key, ids, params) in the order they were added
        self.events = []  # generate_continuing: ("add" | "finish", key, step)

    def _tokens(self, ids: list[int], cap: int) -> Generation:
        h = int.from_bytes(hashlib.sha256(repr(list(ids)).encode()).digest()[:8], "little")
        kind, think = h % 7, "ok " * ((h // 7) % 9)
        zoom = _call(ZOOM)
        out_of_range = _call({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500]}})
        calc = _call({"name": self.calculator, "arguments": {"expression": "2+1"}})
        text = think + [zoom, zoom, zoom, out_of_range, calc, "<answer>3</answer><|im_end|>",
                        "the answer may be three or four, "][kind]
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        finish = "stop"
        if tokens[-1] != self.end:  # no end of turn: rambles on to the cap
            tokens = (tokens * (cap // len(tokens) + 1))
        if len(tokens) > cap:
            tokens, finish = tokens[:cap], "length"
        logprobs = [-((h >> (j % 40)) % 97) / 100 for j in range(len(tokens))]
        return Generation(0, tokens, logprobs, finish)

    def _stats(self, prompts) -> None:
        self.last_stats = {"prompt_tokens": sum(len(p.input_ids) for p in prompts),
                           "cached_prompt_tokens": sum(len(p.input_ids) // 2 for p in prompts)}
        self.last_breakdown = {"steps_s": 0.5, "add_s": 0.25}

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params))
        self._stats(prompts)
        return [self._generation(i, p, params) for i, p in enumerate(prompts) for _ in range(params.n)]

    def _generation(self, index, prompt, params) -> Generation:
        g = self._tokens(prompt.input_ids, params.max_new_tokens)
        return Generation(index, g.token_ids, g.logprobs, g.finish_reason)



class HashEngine(TurnEngine):
    """TurnEngine with `generate_continuing`, which simulates engine steps (a request finishes after as many
    steps as it has tokens; a step takes `step_s` seconds) and follows VLLMEngine's loop: `follow` after a step
    in which requests finished, `poll(False)` after every step, `poll(True)` when no request is running but
    some are pending. It records when each request was added and finished, and each step's time."""

    step_s = 0.0

    def generate_continuing(self, first, follow, poll=None, add_batch=1):
        self.add_batch = add_batch  # rollout.continuous_add_batch, as Rollouts passes it
        running, step, added = [], 0, []  # running: [steps left, order added, key, Generation]
        self.steps = []  # (step, time.monotonic() at its end)

        def add(requests):
            for key, prompt, params in requests:
                assert params.n == 1
                self.requests.append((key, list(prompt.input_ids), params))
                added.append(prompt)
                g = self._tokens(prompt.input_ids, params.max_new_tokens)
                running.append([len(g.token_ids), len(self.requests), key, g])
                self.events.append(("add", key, step))

        add(first)
        pending = False
        while running or pending:
            if not running:
                self.events.append(("wait", None, step))
                requests, pending = poll(True)
                add(requests)
                continue
            step += 1
            time.sleep(self.step_s)
            for r in running:
                r[0] -= 1
            done = sorted((r for r in running if r[0] <= 0), key=lambda r: r[1])
            running[:] = [r for r in running if r[0] > 0]
            self.steps.append((step, time.monotonic()))
            for _, _, key, _ in done:
                self.events.append(("finish", key, step))
            if done:
                add(follow([(key, g) for _, _, key, g in done]))
            if poll is not None:
                requests, pending = poll(False)
                add(requests)
        self._stats(added)


def _rollouts(cfg, processor, group=None):
    from grpo.algorithm import dynamic_sampling_keep

    adapter = FAMILIES["qwen2_5_vl"].adapter(_model_config(cfg.model.path))
    return Rollouts(cfg, adapter, processor, lambda: awake(None), group or EngineGroup(), lambda v: v,
                    dynamic_sampling_keep)


def _run(cfg, processor, engine, prompts, params, group=None):
    rollouts = _rollouts(cfg, processor, group)
    try:
        episodes = rollouts.run_episodes(engine, prompts, params)
    finally:
        rollouts.close()
    return episodes, rollouts


def _same_episode(a, b) -> None:
    assert (a.prompt_index, a.token_ids, a.sources, a.logprobs, a.turns) == \
        (b.prompt_index, b.token_ids, b.sources, b.logprobs, b.turns)
    assert (a.finish_reason, a.engine_finish, a.tool_calls, a.tool_errors) == \
        (b.finish_reason, b.engine_finish, b.tool_calls, b.tool_errors)
    assert [(i.size, i.mode, i.tobytes()) for i in a.images] == [(i.size, i.mode, i.tobytes()) for i in b.images]
    assert len(a.tool_pixels) == len(b.tool_pixels)
    assert all(torch.equal(x, y) for x, y in zip(a.tool_pixels, b.tool_pixels))
    assert all(torch.equal(x, y) for x, y in zip(a.tool_grids, b.tool_grids))
    assert a.loss_mask().tolist() == b.loss_mask().tolist()


def test_continuous_turns_give_the_turn_synchronous_episodes(tiny_model):
    processor = load_processor(str(tiny_model))
    prompts = _prompts(processor)
    params = SamplingParams(n=2, max_new_tokens=200, seed=100, stop_token_ids=[])
    sync_engine = HashEngine(processor.tokenizer)
    expected, _ = _run(_cfg(tiny_model), processor, sync_engine, prompts, params)
    assert len(sync_engine.calls) == 3 and sync_engine.requests == []  # off by default: a call per turn
    engine = HashEngine(processor.tokenizer)
    episodes, rollouts = _run(_cfg(tiny_model, "rollout.continuous_turns=true"), processor, engine, prompts, params)
    assert engine.calls == [] and len(episodes) == len(expected) == 2 * len(prompts)
    for a, b in zip(episodes, expected):
        _same_episode(a, b)
    # the episodes cover every way a turn can end, and tools that failed
    reasons = {e.finish_reason for e in episodes}
    assert {"answered", "max_turns", "max_tokens"} <= reasons, reasons
    assert {len(e.turns) for e in episodes} >= {1, 2, 3}
    assert any(e.tool_errors for e in episodes) and any(e.tool_images for e in episodes)
    # one engine call: its prefix-cache counts and its breakdown
    prompt_tokens = sum(len(ids) for _, ids, _ in engine.requests)
    assert rollouts.prefix == [prompt_tokens, sum(len(ids) // 2 for _, ids, _ in engine.requests)]
    assert rollouts.breakdowns == [{"steps_s": 0.5, "add_s": 0.25}]
    assert engine.add_batch == 1  # rollout.continuous_add_batch's default: requests join at once
    held = HashEngine(processor.tokenizer)
    _run(_cfg(tiny_model, "rollout.continuous_turns=true", "rollout.continuous_add_batch=3"), processor, held,
         prompts, params)
    assert held.add_batch == 3
    with pytest.raises(ConfigError, match="rollout.continuous_add_batch"):
        _cfg(tiny_model, "rollout.continuous_add_batch=0")


def test_a_prompt_without_room_leaves_the_others_their_own_answers(tiny_model):
    """A prompt that leaves no room in the context ends at once (max_tokens) and the engine does not see it; the
    prompt after it gets its own generations, turn by turn and continuous alike."""
    processor = load_processor(str(tiny_model))
    image = Image.new("RGB", (56, 56), (10, 20, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count them. " * 30}]}]
    images = processor.prepare_images([image])
    enc = processor(render_chat(processor, messages, True, None), images)
    long_ = EncodedPrompt(0, enc["input_ids"], enc["pixel_values"], enc["image_grid_thw"], images, "3")
    room = long_.input_ids.numel()
    probe = HashEngine(processor.tokenizer)
    # a prompt whose answer differs from the long prompt's within the room it has
    short = next(p for p in _prompts(processor) if probe._tokens(p.input_ids.tolist(), room).token_ids[:8]
                 != probe._tokens(long_.input_ids.tolist(), room).token_ids[:8])
    params = SamplingParams(n=2, max_new_tokens=200, stop_token_ids=[])
    for extra in ([], ["rollout.continuous_turns=true"]):
        engine = HashEngine(processor.tokenizer)
        cfg = _cfg(tiny_model, f"data.max_prompt_tokens={short.input_ids.numel()}",
                   f"rollout.max_context_tokens={room}", *extra)
        episodes, _ = _run(cfg, processor, engine, [long_, short], params)
        assert [e.finish_reason for e in episodes[:2]] == ["max_tokens"] * 2 and not episodes[0].turns
        own = engine._tokens(short.input_ids.tolist(), room - short.input_ids.numel()).token_ids
        for e in episodes[2:]:
            assert e.token_ids[short.input_ids.numel():][:8] == own[:8]


def test_later_turns_join_while_other_episodes_still_decode(tiny_model):
    processor = load_processor(str(tiny_model))
    prompts = _prompts(processor)
    params = SamplingParams(n=2, max_new_tokens=200, seed=100, stop_token_ids=[])
    engine = HashEngine(processor.tokenizer)
    engine.step_s = 0.002  # steps slower than a zoom, so most tool results come back while others decode
    episodes, _ = _run(_cfg(tiny_model, "rollout.continuous_turns=true"), processor, engine, prompts, params)
    finished_at = {}
    overlaps = 0
    for kind, key, step in engine.events:
        if kind == "finish":
            finished_at.setdefault(key, []).append(step)
    # a request added after the engine waited on tools (none left running) joins no one
    waits = {step for kind, _, step in engine.events if kind == "wait"}
    adds = [(key, step) for kind, key, step in engine.events if kind == "add" and step > 0 and step not in waits]
    assert adds, "no episode had a second turn while others decoded"
    for key, step in adds:
        # a request of another episode that was added before this one and finished after it was added
        overlaps += any(s > step for k, steps in finished_at.items() if k != key for s in steps)
    # later turns start while other episodes decode (an add right after the last running request ended, its
    # tool result in the same poll, has no one to overlap: timing decides how many, so at least one, not all)
    assert overlaps >= 1
    # turn 1: one request per episode, prompt-major, seeded as vLLM seeds the children of an n-sample request
    first = [(key, params_.seed) for key, _, params_ in engine.requests[:len(episodes)]]
    assert first == [(k, 100 + k) for k in range(len(episodes))]
    assert [ids for _, ids, _ in engine.requests[:len(episodes)]] == [p.input_ids.tolist() for p in prompts
                                                                       for _ in range(2)]
    # later turns: seed + turn · stride + the episode's index; each request capped at its episode's allowance
    turn, used = {}, {}
    context = _cfg(tiny_model).data.max_prompt_tokens + 200
    for key, ids, p in engine.requests:
        t = turn.get(key, 0)
        assert p.n == 1 and p.seed == 100 + t * TURN_SEED_STRIDE + key
        assert p.max_new_tokens == min(200 - used.get(key, 0), context - len(ids))
        e = episodes[key]
        s, end = e.turns[t]
        assert ids == e.token_ids[:s]  # the episode so far
        turn[key], used[key] = t + 1, used.get(key, 0) + (end - s)
    assert turn == {k: len(e.turns) for k, e in enumerate(episodes)}
    # without a seed, none
    engine = HashEngine(processor.tokenizer)
    _run(_cfg(tiny_model, "rollout.continuous_turns=true"), processor, engine, prompts[:2],
         SamplingParams(n=2, max_new_tokens=200, stop_token_ids=[]))
    assert {p.seed for _, _, p in engine.requests} == {None}


SLOW_TOOLS = '''
import os, time
from rollout.tools import Calculator, register_tool

class SlowCalculator(Calculator):
    """The calculator, after a sleep; each call's (start, end) in time.monotonic() goes to $VLRL_SLOW_LOG."""
    name = "slow_calculator"
    def __call__(self, arguments, ctx):
        start = time.monotonic()
        time.sleep(0.3)
        result = super().__call__(arguments, ctx)
        with open(os.environ["VLRL_SLOW_LOG"], "a") as f:
            f.write(f"{start} {time.monotonic()}\\n")
        return result

register_tool(SlowCalculator())
'''


@pytest.fixture(scope="module")
def slow_tools(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slow_tools")
    (folder / "vlrl_slow_tools.py").write_text(textwrap.dedent(SLOW_TOOLS))
    sys.path.insert(0, str(folder))
    yield "vlrl_slow_tools"
    sys.path.remove(str(folder))


class SlowHashEngine(HashEngine):
    """HashEngine whose calculator calls name the slow calculator, and whose steps take 2 ms."""

    calculator = "slow_calculator"
    step_s = 0.002


def test_decoding_goes_on_while_a_slow_tool_runs(tiny_model, slow_tools, tmp_path, monkeypatch):
    """A tool call that takes 0.3 s runs in the pool while the engine keeps stepping: other episodes' requests
    finish and later turns join during it, and the episodes are still the turn-synchronous path's."""
    log = tmp_path / "slow.log"
    monkeypatch.setenv("VLRL_SLOW_LOG", str(log))  # the tool workers start after this and inherit it
    processor = load_processor(str(tiny_model))
    prompts = _prompts(processor)
    params = SamplingParams(n=2, max_new_tokens=200, seed=100, stop_token_ids=[])
    extra = ["rollout.tools=[image_zoom_in_tool,calculator,slow_calculator]", f"rollout.tools_module={slow_tools}"]
    expected, _ = _run(_cfg(tiny_model, *extra), processor, SlowHashEngine(processor.tokenizer), prompts, params)
    log.unlink()
    engine = SlowHashEngine(processor.tokenizer)
    episodes, _ = _run(_cfg(tiny_model, *extra, "rollout.continuous_turns=true"), processor, engine, prompts, params)
    for a, b in zip(episodes, expected, strict=True):
        _same_episode(a, b)
    calls = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
    assert calls and sum(e.tool_calls for e in episodes) > len(calls)  # some calls were slow, not all
    # the engine's steps while a slow call slept (a blocking call would leave none): requests finished and later
    # turns were added in them
    during = [[step for step, at in engine.steps if start < at < end] for start, end in calls]
    assert max(map(len, during)) >= 20, [len(steps) for steps in during]
    busy = {step for steps in during for step in steps}
    assert any(kind == "finish" and step in busy for kind, _, step in engine.events)
    assert any(kind == "add" and step in busy for kind, _, step in engine.events)


def test_continuous_turns_apply_only_where_they_can(tiny_model, caplog):
    caplog.set_level("INFO", logger="rollout.rollouts")
    processor = load_processor(str(tiny_model))
    prompts = _prompts(processor)[:2]
    params = SamplingParams(n=2, max_new_tokens=200, seed=0, stop_token_ids=[])
    cfg = _cfg(tiny_model, "rollout.continuous_turns=true")
    assert _cfg(tiny_model).rollout.continuous_turns is False
    assert cfg.rollout.continuous_turns is True
    assert load_config(None, ["rollout.continuous_turns=true", "rollout.exact=true"]).rollout.continuous_turns
    # an engine without generate_continuing (the torch engine): turn by turn
    engine = TurnEngine(processor.tokenizer)
    _run(cfg, processor, engine, prompts, params)
    assert engine.calls and not hasattr(engine, "generate_continuing")
    assert "episodes run turn by turn here: the engine continues no requests" in caplog.text
    # a tensor-parallel engine group: its members generate together, turn by turn
    group = EngineGroup(size=2)
    group.gather = lambda inputs, p: (inputs, p, 0)
    group.own = lambda gens, start, count: gens
    engine = HashEngine(processor.tokenizer)
    rollouts = _rollouts(cfg, processor, group)
    try:
        rollouts.run_episodes(engine, prompts, params)
        assert engine.calls and engine.requests == []
        assert "a tensor-parallel engine group generates together" in caplog.text
        # without tools for this call (evaluate's use_tools=False): one turn through generate
        rollouts.engine_group = EngineGroup()
        engine = HashEngine(processor.tokenizer)
        episodes = rollouts.run_episodes(engine, prompts, params, use_tools=False)
        assert len(engine.calls) == 1 and engine.requests == [] and all(len(e.turns) == 1 for e in episodes)
    finally:
        rollouts.close()


# --- VLLMEngine.generate_continuing on stand-ins of vLLM's objects ------------------------------------------------
class _FakeVLLMSampling:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _FlatLogprobs(NS):
    """vLLM's FlatLogprobs: parallel lists, one span per sampled position."""

    def __init__(self, start_indices, end_indices, token_ids, logprobs):
        super().__init__(start_indices=start_indices, end_indices=end_indices, token_ids=token_ids, logprobs=logprobs)

    def __len__(self):
        return len(self.start_indices)


class _FakeLLM:
    """vLLM 0.26's LLM as generate_continuing uses it: `_add_completion_requests` returns internal request ids
    (the external counter, '-', 8 characters); each `llm_engine.step()` decodes one token of every running
    request and reports the finished ones under their external id, with flat logprobs."""

    def __init__(self, follow_log):
        self.counter, self.running, self.aborted, self.sampling, self.log = 0, [], [], [], follow_log
        self.llm_engine = NS(has_unfinished_requests=lambda: bool(self.running), step=self.step,
                             abort_request=lambda ids, internal=False: self.aborted.append((ids, internal)))

    def _add_completion_requests(self, prompts, params, use_tqdm=True):
        assert use_tqdm is False and len(prompts) == len(params)
        ids = []
        for prompt, sp in zip(prompts, params):
            self.sampling.append(sp)
            self.running.append([sp.max_tokens, str(self.counter), prompt["prompt_token_ids"]])
            ids.append(f"{self.counter}-abcd{self.counter:04d}")
            self.counter += 1
        self.log.append(("add", len(prompts)))
        return ids

    def step(self):
        outs = []
        for r in self.running:
            r[0] -= 1
            tokens = [7 + j for j in range(self.sampling[int(r[1])].max_tokens - r[0])]
            flat = _FlatLogprobs(list(range(len(tokens))), list(range(1, len(tokens) + 1)), list(tokens),
                                 [-0.5 - j for j in range(len(tokens))])
            completion = NS(index=0, token_ids=tokens, logprobs=flat, routed_experts=None,
                            finish_reason="length" if r[0] <= 0 else None)
            outs.append(NS(request_id=r[1], finished=r[0] <= 0, prompt_token_ids=list(r[2]), num_cached_tokens=3,
                           outputs=[completion]))
        self.running = [r for r in self.running if r[0] > 0]
        return outs


def _vllm_engine(monkeypatch, tiny_model, log):
    from rollout.vllm_engine import VLLMEngine

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = _FakeVLLMSampling
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    from tests.test_vllm_engine_cpu import _request_engine

    engine, processor = _request_engine(tiny_model, _asleep=set(), _seed=0, _calls=0, _dp_rank=0, _device=None,
                                        _routing=False, mm_uuids=False)
    engine._llm = _FakeLLM(log)
    assert isinstance(engine, VLLMEngine)
    return engine, processor


def test_vllm_generate_continuing_adds_requests_as_others_finish(monkeypatch, tiny_model):
    log = []
    engine, processor = _vllm_engine(monkeypatch, tiny_model, log)
    a, b = processor.tokenizer.encode("hello there"), processor.tokenizer.encode("a longer prompt than that")
    got = []

    def follow(finished):
        got.append([(key, g.token_ids, g.logprobs, g.finish_reason) for key, g in finished])
        log.append(("follow", [key for key, _ in finished]))
        time.sleep(0.01)
        return [(f"{key}+", PromptInput(a + g.token_ids), SamplingParams(max_new_tokens=2, seed=5))
                for key, g in finished if not key.endswith("+")]

    engine._install_probe()
    try:
        engine.generate_continuing([("x", PromptInput(a), SamplingParams(max_new_tokens=1, seed=9)),
                                    ("y", PromptInput(b), SamplingParams(max_new_tokens=4))], follow)
    finally:
        engine._probe.close()
    # x finished first: its follow-up was added while y was still decoding
    assert log == [("add", 2), ("follow", ["x"]), ("add", 1), ("follow", ["x+"]), ("follow", ["y"]), ("add", 1),
                   ("follow", ["y+"])]
    assert got[0] == [("x", [7], [-0.5], "length")] and got[2] == [("y", [7, 8, 9, 10], [-0.5, -1.5, -2.5, -3.5],
                                                                    "length")]
    # each request its own vLLM SamplingParams: n=1, its max_new_tokens and seed
    assert [(s.n, s.max_tokens, s.seed) for s in engine._llm.sampling] == [(1, 1, 9), (1, 4, None), (1, 2, 5),
                                                                            (1, 2, 5)]
    assert engine._calls == 1  # one call for the sampling RNG
    prompts = [a, b, a + [7], a + [7, 8, 9, 10]]
    assert engine.last_stats == {"prompt_tokens": sum(map(len, prompts)), "cached_prompt_tokens": 12}
    out = engine.last_breakdown
    assert out["prompt_tokens"] == engine.last_stats["prompt_tokens"] and out["cached_prompt_tokens"] == 12
    # the probe times the adds; the steps (no _run_engine to wrap) and follow are timed by the call itself
    assert out["add_s"] is not None and out["steps_s"] is not None and out["follow_s"] >= 0.04
    assert out["prep_s"] >= 0 and engine._llm.aborted == []


def test_vllm_generate_continuing_holds_requests_until_add_batch_wait(monkeypatch, tiny_model):
    """add_batch=2: a finished request's follow-up waits until a second one is ready (or as many wait as still
    run, or none runs), then both join in one add; the requests and their samples are the same as at once."""
    results = {}
    for add_batch in (1, 2):
        log = []
        engine, processor = _vllm_engine(monkeypatch, tiny_model, log)
        a = processor.tokenizer.encode("hello there")

        def follow(finished):
            log.append(("follow", [key for key, _ in finished]))
            return [(f"{key}+", PromptInput(a + g.token_ids), SamplingParams(max_new_tokens=3, seed=5))
                    for key, g in finished if not key.endswith("+")]

        engine.generate_continuing([("x", PromptInput(a), SamplingParams(max_new_tokens=1, seed=1)),
                                    ("z", PromptInput(a), SamplingParams(max_new_tokens=2, seed=2)),
                                    ("y", PromptInput(a), SamplingParams(max_new_tokens=6, seed=3))], follow,
                                   add_batch=add_batch)
        results[add_batch] = (log, sorted((s.max_tokens, s.seed) for s in engine._llm.sampling))
    at_once, held = results[1][0], results[2][0]
    assert at_once[:4] == [("add", 3), ("follow", ["x"]), ("add", 1), ("follow", ["z"])]
    # x's follow-up waits for z's: one add of two
    assert held[:4] == [("add", 3), ("follow", ["x"]), ("follow", ["z"]), ("add", 2)]
    assert results[1][1] == results[2][1]  # the same requests either way
    # every follow-up joins (x+ and z+ together, then y+ alone once nothing else runs): none is left out
    assert sum(n for kind, n in held if kind == "add") == 6 and ("follow", ["y"]) in held
    with pytest.raises(ValueError, match="add_batch must be >= 1"):
        engine.generate_continuing([("q", PromptInput(a), SamplingParams(max_new_tokens=1))], follow, add_batch=0)


def test_vllm_generate_continuing_polls_for_requests_that_were_waiting(monkeypatch, tiny_model):
    """With `poll`: it is asked after every step without waiting; once no request runs but some are pending, it
    is asked to wait; the loop ends when nothing runs and the last poll said nothing is pending."""
    log = []
    engine, processor = _vllm_engine(monkeypatch, tiny_model, log)
    ids = processor.tokenizer.encode("hello there")
    pending = []  # follow-ups of finished requests, handed over by poll

    def follow(finished):
        log.append(("follow", [key for key, _ in finished]))
        pending.extend(f"{key}+" for key, _ in finished if not key.endswith("+"))
        return []

    def poll(wait):
        log.append(("poll", wait))
        if not wait:
            return [], bool(pending)
        time.sleep(0.05)
        ready, pending[:] = list(pending), []
        return [(key, PromptInput(ids), SamplingParams(max_new_tokens=1)) for key in ready], False

    engine._install_probe()
    try:
        engine.generate_continuing([("x", PromptInput(ids), SamplingParams(max_new_tokens=1)),
                                    ("y", PromptInput(ids), SamplingParams(max_new_tokens=2))], follow, poll)
    finally:
        engine._probe.close()
    assert log == [("add", 2), ("follow", ["x"]), ("poll", False), ("follow", ["y"]), ("poll", False),
                   ("poll", True), ("add", 2), ("follow", ["x+", "y+"]), ("poll", False)]
    out = engine.last_breakdown
    # the 0.05 s slept in the waiting poll counts as tool_wait_s, not as poll_s or follow_s
    assert out["tool_wait_s"] >= 0.05 and out["poll_s"] < out["tool_wait_s"] and out["follow_s"] < out["tool_wait_s"]
    assert engine.last_stats["prompt_tokens"] == 4 * len(ids) and engine._llm.aborted == []

    def broken(wait):
        raise KeyError("a tool's bug")

    engine._llm = _FakeLLM([])
    with pytest.raises(KeyError):  # an error in poll aborts what is still running, as one in follow does
        engine.generate_continuing([("x", PromptInput(ids), SamplingParams(max_new_tokens=1)),
                                    ("y", PromptInput(ids), SamplingParams(max_new_tokens=5))], lambda f: [], broken)
    assert engine._llm.aborted == [(["1-abcd0001"], True)]


def test_vllm_generate_continuing_refuses_n_and_cleans_up_after_an_error(monkeypatch, tiny_model):
    engine, processor = _vllm_engine(monkeypatch, tiny_model, [])
    ids = processor.tokenizer.encode("hello there")
    with pytest.raises(ValueError, match="n=2"):
        engine.generate_continuing([("x", PromptInput(ids), SamplingParams(n=2, max_new_tokens=3))], lambda f: [])
    assert engine._llm.counter == 0  # nothing was added
    with pytest.raises(ValueError, match="n=3"):  # nor from follow
        engine.generate_continuing([("x", PromptInput(ids), SamplingParams(max_new_tokens=1))],
                                   lambda f: [("z", PromptInput(ids), SamplingParams(n=3, max_new_tokens=1))])

    def broken(finished):
        raise KeyError("a tool's bug")

    engine._llm = _FakeLLM([])
    with pytest.raises(KeyError):
        engine.generate_continuing([("x", PromptInput(ids), SamplingParams(max_new_tokens=1)),
                                    ("y", PromptInput(ids), SamplingParams(max_new_tokens=5))], broken)
    assert engine._llm.aborted == [(["1-abcd0001"], True)]  # y, by its internal id
    engine._asleep = {"weights"}
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate_continuing([], lambda f: [])
