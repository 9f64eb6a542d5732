"""A step's rollouts: episodes generated turn by turn, tools run between turns, rewards, dynamic sampling.

`Rollouts.collect` is what the trainer calls once per GRPO step. The engine is awake for the
whole of it (one wake and one sleep per step, `generating`), refill rounds of dynamic sampling
included. In each turn every live episode of the step generates in one engine call: the first
turn sends each prompt once with n samples (the engine prefills it once), later turns send each
live episode's whole sequence with its images (without their joined pixel rows to an engine whose
`reads_pixel_values` is False: vLLM processes the images itself). Finished episodes drop out. Tool calls are found
in the text the model wrote between the family's call markers, run in `ToolRunner`'s bounded
pool, and each result is appended as the chat template's tokens for its message
(`ToolResultEncoder`).

Limits, each a finish reason: `rollout.max_turns` model turns; `rollout.max_tool_images` images
added by tools (a result that would pass it ends the episode unappended); `rollout.max_new_tokens`
model tokens per episode, over all its turns (a turn is sampled with the most any live episode
has left, and an episode's turn is cut at its own budget); `rollout.max_context_tokens` tokens in
all (a tool result that would leave no room for another model token ends the episode);
`rollout.max_tool_errors` failed calls. Without tools an episode has one turn and ends answered
(a stop token) or max_tokens: exactly the single-turn rollout.

`rollout.continuous_turns` (vLLM, one engine rank): the episodes run in one engine call instead of
one per turn; an episode whose turn finished has its tool calls run in the pool while the others keep
decoding, and its next request joins once they are done (`_run_continuous`). The same turn logic and
limits, each episode's turn cut at its own budget by the engine; an episode's turns are seeded by its
own index.

`Rollouts.times` holds the seconds of the step's `collect` spent outside the engine, over all its rounds:
`data_s` in `feeder.next` (reading rows, decoding images, the processor) and `score_s` in `score`
(decoding each episode's last turn, the rewards); the trainer logs them as perf/gen_data_s and
perf/gen_score_s, parts of perf/gen_s.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from data.rewards import score
from data.trajectories import ToolPrompt, build_tool_prompt
from models.family import FamilyAdapter, require_tool_format
from rollout.base import Generation, SamplingParams, timed
from rollout.episode import FINISH_REASONS, Episode, ToolResultEncoder
from rollout.tools import ERROR_KINDS, ToolContext, ToolRunner, build_tools, tool_schema

log = logging.getLogger(__name__)

TURN_SEED_STRIDE = 7919  # later turns sample with seed + turn · stride
TIMES = ("data_s", "score_s")  # Rollouts.times: a step's seconds outside the engine (module docstring)


def tool_prompt(cfg, adapter: FamilyAdapter, processor) -> ToolPrompt | None:
    """The schemas of `rollout.tools`, in that order, for the system turn of every prompt and SFT
    conversation: rendered by the chat template when it takes `tools=`, else by the family's
    `ToolFormat`. None without tools, or with `rollout.tool_schemas_in_prompt` off."""
    if not cfg.rollout.tools or not cfg.rollout.tool_schemas_in_prompt:
        return None
    tools = build_tools(list(cfg.rollout.tools), cfg.rollout.tools_module or None)
    fmt = require_tool_format(adapter)
    schemas = [tool_schema(tools[name]) for name in cfg.rollout.tools]
    return build_tool_prompt(processor, schemas, fmt.system_with_tools if fmt.tools_intro else None, adapter.name)


def context_tokens(cfg) -> int:
    """The most tokens one episode holds (the engine's context length)."""
    return cfg.rollout.max_context_tokens or cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens


class Rollouts:
    """Generates and scores a step's episodes (see the module docstring).

    `generating()` is the colocation context that wakes the engine and puts it back to sleep;
    `engine_group` serves tensor-parallel groups; `agree_max(v)` is the max of v over all ranks;
    `informative(scores, n)` says which groups dynamic sampling keeps.
    """

    def __init__(self, cfg, adapter: FamilyAdapter, processor, generating: Callable, engine_group,
                 agree_max: Callable[[int], int], informative: Callable | None = None):
        self.cfg = cfg
        self.adapter = adapter
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.generating = generating
        self.engine_group = engine_group
        self.agree_max = agree_max
        self.informative = informative
        r = cfg.rollout
        self.tools = build_tools(list(r.tools), r.tools_module or None) if r.tools else {}
        self.format = self.encoder = self.runner = None
        self.end_id = None
        if self.tools:
            self.format = require_tool_format(adapter)
            self.encoder = ToolResultEncoder(processor, self.format, adapter.end_of_turn, cfg.data.min_pixels,
                                             cfg.data.max_pixels)
            self.end_id = self.tokenizer.convert_tokens_to_ids(adapter.end_of_turn)
            self.runner = ToolRunner(self.tools, max_workers=r.tool_workers, timeout_s=r.tool_timeout_s)
            atexit.register(self.runner.close)
        self.context = context_tokens(cfg)
        self.prefix = [0, 0]  # prompt tokens the engine got this step, and those its prefix cache served
        self.breakdowns: list[dict] = []  # the engine's last_breakdown of each of this step's calls (vLLM)
        self.times = dict.fromkeys(TIMES, 0.0)  # this step's seconds in feeder.next and score

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    # --- the step ----------------------------------------------------------------------------
    def collect(self, feeder, per_rank: int, params: SamplingParams):
        """(prompts, episodes, reward infos) for this rank; with dynamic sampling only informative
        groups, refilled from the feeder for up to algorithm.max_refill_rounds more rounds."""
        cfg = self.cfg
        G = params.n
        self.prefix = [0, 0]
        self.breakdowns = []
        self.times = dict.fromkeys(TIMES, 0.0)
        with self.generating() as engine:
            prompts, episodes, infos = self.generate_and_score(engine, self._next(feeder, per_rank), params)
            if not cfg.algorithm.dynamic_sampling:
                return prompts, episodes, infos
            keep_p, keep_e, keep_i = [], [], []
            rounds = 0
            while True:
                scores = torch.tensor([r.score for r in infos])
                keep = self.informative(scores, G) if len(scores) else torch.zeros(0, dtype=torch.bool)
                for pi in torch.nonzero(keep).flatten().tolist():
                    if len(keep_p) >= per_rank:
                        break
                    for e in episodes[pi * G:(pi + 1) * G]:
                        e.prompt_index = len(keep_p)
                        keep_e.append(e)
                    keep_i += infos[pi * G:(pi + 1) * G]
                    keep_p.append(prompts[pi])
                need = per_rank - len(keep_p)
                rounds += 1
                if self.agree_max(need) == 0 or rounds > cfg.algorithm.max_refill_rounds:
                    return keep_p, keep_e, keep_i
                prompts, episodes, infos = self.generate_and_score(engine, self._next(feeder, need), params)

    def evaluate(self, prompts, params: SamplingParams, use_tools: bool = True):
        """(prompts, episodes, reward infos) of one round, the engine awake for it; `use_tools=False`
        answers in one turn even when tools are configured (for comparing with and without them)."""
        self.breakdowns = []
        self.times = dict.fromkeys(TIMES, 0.0)
        with self.generating() as engine:
            return self.generate_and_score(engine, prompts, params, use_tools)

    def generate_and_score(self, engine, prompts, params: SamplingParams, use_tools: bool = True):
        episodes = self.run_episodes(engine, prompts, params, use_tools)
        with timed(self.times, "score_s"):
            infos = self.score(prompts, episodes)
        return prompts, episodes, infos

    def _next(self, feeder, k: int):
        """The feeder's next k prompts, its seconds added to times["data_s"]."""
        with timed(self.times, "data_s"):
            return feeder.next(k)

    def score(self, prompts, episodes: list[Episode]) -> list:
        """The reward of each episode's final answer: the text of its last model turn."""
        out = []
        for e in episodes:
            text = self.tokenizer.decode(e.last_turn_ids(), skip_special_tokens=True)
            out.append(score(self.cfg.data.task, text, prompts[e.prompt_index].answer))
        return out

    # --- turns -------------------------------------------------------------------------------
    def run_episodes(self, engine, prompts, params: SamplingParams, use_tools: bool = True) -> list[Episode]:
        """n episodes per prompt, prompt-major, each run to its finish reason (one turn without tools)."""
        budget = params.max_new_tokens
        tools = bool(self.tools) and use_tools
        episodes = [Episode.start(i, p) for i, p in enumerate(prompts) for _ in range(params.n)]
        if tools and self._continuous(engine):
            self._run_continuous(engine, prompts, episodes, params)
            return episodes
        live = list(episodes)
        turn = 0
        # members of a tensor-parallel engine group generate together, even with nothing of their own
        together = self.engine_group.size > 1
        # an engine that processes the images itself (vLLM) gets no joined pixel rows (Episode.engine_input)
        pixels = getattr(engine, "reads_pixel_values", True)
        while (self.agree_max(len(live)) if together else len(live)) > 0:
            allowed = [min(budget - e.model_tokens, self.context - len(e.token_ids)) for e in live]
            for e, a in zip(live, allowed):
                if a < 1:
                    e.finish_reason = "max_tokens"
            live = [e for e, a in zip(live, allowed) if a >= 1]
            allowed = [a for a in allowed if a >= 1]
            top = max(allowed, default=1)
            turn_params = replace(params, max_new_tokens=self.agree_max(top) if together else top)
            if params.seed is not None:
                turn_params.seed = params.seed + turn * TURN_SEED_STRIDE
            if turn == 0:  # one n-sample request per prompt still live (a prompt's n episodes live or end together)
                inputs = [e.engine_input(pixels) for e in live[::params.n]]
                gens = self.generate(engine, inputs, turn_params)
            else:
                gens = self.generate(engine, [e.engine_input(pixels) for e in live], replace(turn_params, n=1))
            turn += 1
            calls = self._end_turn(live, gens, allowed, [turn] * len(live), budget, tools)
            if calls:
                self._run_tools(prompts, calls)
            live = [e for e in live if not e.done]
        return episodes

    def generate(self, engine, inputs, params: SamplingParams) -> list[Generation]:
        """One engine call; a tensor-parallel group's members serve their prompts together."""
        if not inputs and self.engine_group.size == 1:
            return []
        count = len(inputs)
        inputs, params, start = self.engine_group.gather(inputs, params)
        gens = engine.generate(inputs, params)
        self._note_call(engine)
        return self.engine_group.own(gens, start, count)

    def _note_call(self, engine) -> None:
        """Add the engine's last call to the step's prefix-cache counts and generation breakdowns."""
        stats = getattr(engine, "last_stats", None) or {}
        if "cached_prompt_tokens" in stats:  # vLLM: its prefix cache's share of the prompt tokens
            self.prefix[0] += stats["prompt_tokens"]
            self.prefix[1] += stats["cached_prompt_tokens"]
        breakdown = getattr(engine, "last_breakdown", None)
        if breakdown and isinstance(breakdown, dict):  # vLLM under rollout.gen_breakdown: where the call's time went
            self.breakdowns.append(breakdown)

    # --- continuous turns (rollout.continuous_turns) -----------------------------------------
    def _continuous(self, engine) -> bool:
        """Whether this call's episodes run continuously: asked for, and an engine that continues requests
        (vLLM) serving this rank alone (a tensor-parallel group's members generate together, turn by turn)."""
        if not self.cfg.rollout.continuous_turns:
            return False
        why = ("the engine continues no requests (vLLM does)" if not hasattr(engine, "generate_continuing")
               else "a tensor-parallel engine group generates together" if self.engine_group.size > 1 else None)
        if why is not None and not getattr(self, "_told_turn_by_turn", False):
            log.info("rollout.continuous_turns=true: episodes run turn by turn here: %s", why)
            self._told_turn_by_turn = True
        return why is None

    def _run_continuous(self, engine, prompts, episodes: list[Episode], params: SamplingParams) -> None:
        """Run `episodes` (prompt-major, n per prompt) in one `engine.generate_continuing` call. The turn logic,
        limits and finish reasons are the turn-synchronous loop's: `follow` ends the turns of each batch of
        episodes that finished together and submits their tool calls to the pool, returning no request for
        them; `poll` collects the episodes whose calls are all done (in index order), appends their results
        (encoded together) and returns their next requests. So decoding goes on while tools run, and the
        engine waits on them only when no request is left running. An episode's tokens depend only on its
        own turns and tools' results, never on which episodes finished or were collected with it.
        Seeds (with params.seed): episode k's turn t (from 0) samples with seed + t · TURN_SEED_STRIDE + k, so
        turn 0 samples as an n-sample request of the prompt does."""
        budget = params.max_new_tokens
        pixels = getattr(engine, "reads_pixel_values", True)
        turns = [0] * len(episodes)  # model turns each episode has had
        allowed = [0] * len(episodes)  # the model tokens episode k's current turn may take
        index = {id(e): k for k, e in enumerate(episodes)}
        calls_out = _CallsInFlight()

        def request(k: int):
            e = episodes[k]
            allowed[k] = min(budget - e.model_tokens, self.context - len(e.token_ids))
            if allowed[k] < 1:
                e.finish_reason = "max_tokens"
                return None
            seed = None if params.seed is None else params.seed + turns[k] * TURN_SEED_STRIDE + k
            return k, e.engine_input(pixels), replace(params, n=1, max_new_tokens=allowed[k], seed=seed)

        def requests(ks) -> list:
            return [r for r in (request(k) for k in ks if not episodes[k].done) if r is not None]

        def follow(finished: list[tuple[int, Generation]]) -> list:
            ks = [k for k, _ in finished]
            for k in ks:
                turns[k] += 1
            batch = [episodes[k] for k in ks]
            calls = self._end_turn(batch, [g for _, g in finished], [allowed[k] for k in ks],
                                   [turns[k] for k in ks], budget, True)
            if calls:
                calls_out.add([index[id(e)] for e, _ in calls], calls, self._submit_tools(prompts, calls))
            return requests(k for k in ks if k not in calls_out)

        def poll(wait: bool) -> tuple[list, bool]:
            ready, calls, outcomes = calls_out.take_done(wait)
            if ready:
                self._append_outcomes(calls, outcomes)
            return requests(ready), bool(calls_out)

        first = requests(range(len(episodes)))
        if not first:
            return
        try:
            engine.generate_continuing(first, follow, poll, add_batch=self.cfg.rollout.continuous_add_batch)
        finally:  # after an error: calls no worker has taken yet never start
            calls_out.cancel()
        self._note_call(engine)

    def _end_turn(self, live: list[Episode], gens: list[Generation], allowed: list[int], turns: list[int],
                  budget: int, tools: bool) -> list[tuple[Episode, str]]:
        """Append each live episode's turn; finish the ones that end here; the tool calls of the rest.
        `turns[i]` is live[i]'s count of model turns, this one included."""
        calls: list[tuple[Episode, str]] = []
        for e, g, cap, turn in zip(live, gens, allowed, turns):
            cut = len(g.token_ids) > cap
            if cut:
                g = Generation(g.prompt_index, g.token_ids[:cap], g.logprobs[:cap], "length", g.routed_experts)
            e.add_model_turn(g)
            if g.finish_reason == "length":
                e.finish_reason = "max_tokens"
                continue
            found = []
            if tools and g.token_ids and g.token_ids[-1] == self.end_id:
                found = self.format.calls(self.tokenizer.decode(g.token_ids, skip_special_tokens=False),
                                          {name: tool.parameters for name, tool in self.tools.items()})
            if not found:
                e.finish_reason = "answered"
            elif turn >= self.cfg.rollout.max_turns:
                e.finish_reason = "max_turns"
            elif e.model_tokens >= budget:
                e.finish_reason = "max_tokens"
            else:
                calls += [(e, raw) for raw in found]
        return calls

    def _run_tools(self, prompts, calls: list[tuple[Episode, str]]) -> None:
        """Run every call of the turn in the pool and append their results (`_append_outcomes`)."""
        self._append_outcomes(calls, [f.result() for f in self._submit_tools(prompts, calls)])

    def _submit_tools(self, prompts, calls: list[tuple[Episode, str]]) -> list:
        """Start every call in the pool, each with its episode's images so far; their futures, in order."""
        d = self.cfg.data
        contexts = {}
        for e, _ in calls:
            if id(e) not in contexts:
                originals = list(getattr(prompts[e.prompt_index], "originals", None) or [])
                contexts[id(e)] = ToolContext(images=list(e.images), min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                                              originals=originals)
        return self.runner.submit([(raw, contexts[id(e)]) for e, raw in calls])

    def _append_outcomes(self, calls: list[tuple[Episode, str]], outcomes: list) -> None:
        """Count the calls and their errors; append each episode's results as one delta, the episodes encoded
        together."""
        results: dict[int, list] = {}
        order: list[Episode] = []
        for (e, _), out in zip(calls, outcomes):
            e.tool_calls += 1
            if id(e) not in results:
                results[id(e)] = []
                order.append(e)
            if out.result is None:
                e.count_error(out.error_kind or "tool_exception")
                results[id(e)].append((out.error, []))
            else:
                results[id(e)].append((out.result.text, list(out.result.images)))
        self._append_results(order, [results[id(e)] for e in order])

    def _append_results(self, episodes: list[Episode], results: list[list]) -> None:
        """Append each episode's results as one tool delta, or finish it at the limit they would pass.
        The turn's messages are encoded together (`ToolResultEncoder.encode_many`)."""
        r = self.cfg.rollout
        appending = []
        for e, res in zip(episodes, results):
            if r.max_tool_errors and e.errors >= r.max_tool_errors:
                e.finish_reason = "tool_error_limit"
            elif e.tool_images + sum(len(images) for _, images in res) > r.max_tool_images:
                e.finish_reason = "max_tool_images"
            else:
                appending.append((e, res))
        encoded = self.encoder.encode_many([res for _, res in appending])
        for (e, _), (ids, pixels, grid, images) in zip(appending, encoded):
            if len(e.token_ids) + len(ids) + 1 > self.context:
                e.finish_reason = "max_tokens"
            else:
                e.add_tool_tokens(ids, pixels, grid, images)

    # --- metrics -----------------------------------------------------------------------------
    def metrics(self, episodes: list[Episode], device) -> dict:
        """agent/* over all ranks: turns, tool calls and errors by kind, images, finish fractions, and
        (vLLM) the share of prompt tokens the prefix cache served in the step's engine calls."""
        if not self.tools:
            return {}
        local = [float(len(episodes)), float(sum(len(e.turns) for e in episodes)),
                 float(sum(e.tool_calls for e in episodes)), float(sum(len(e.images) for e in episodes)),
                 float(sum(e.model_tokens for e in episodes)), float(sum(len(e.token_ids) for e in episodes)),
                 float(self.prefix[0]), float(self.prefix[1])]
        local += [float(sum(e.tool_errors.get(k, 0) for e in episodes)) for k in ERROR_KINDS]
        local += [float(sum(e.finish_reason == f for e in episodes)) for f in FINISH_REASONS]
        t = torch.tensor(local, dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        v = t.tolist()
        n = max(v[0], 1.0)
        out = {"agent/turns_mean": v[1] / n, "agent/tool_calls": v[2], "agent/images_per_episode": v[3] / n,
               "agent/model_tokens_mean": v[4] / n, "agent/episode_tokens_mean": v[5] / n}
        if v[6] > 0:
            out["agent/prefix_cache_hit"] = v[7] / v[6]
        errors = v[8:8 + len(ERROR_KINDS)]
        out["agent/tool_errors"] = sum(errors)
        out.update({f"agent/tool_errors_{k}": x for k, x in zip(ERROR_KINDS, errors)})
        out.update({f"agent/finish_{f}": x / n for f, x in zip(FINISH_REASONS, v[8 + len(ERROR_KINDS):])})
        return out


class _CallsInFlight:
    """The tool calls that episodes wait on in continuous turns, by episode index: an episode is done when
    every call of its turn is."""

    def __init__(self):
        self.calls: dict[int, list] = {}  # k -> [(call, future)], in the order the turn made them

    def add(self, ks: list[int], calls: list, futures: list) -> None:
        for k, call, future in zip(ks, calls, futures):
            self.calls.setdefault(k, []).append((call, future))

    def __contains__(self, k: int) -> bool:
        return k in self.calls

    def __bool__(self) -> bool:
        return bool(self.calls)

    def take_done(self, wait: bool) -> tuple[list[int], list, list]:
        """(indices, calls, outcomes) of the episodes whose calls are all done, in index order; with `wait`,
        blocks until there is one or nothing is in flight."""
        while True:
            # one look at the futures decides both what is ready and what to wait on, so a call that ends in
            # between wakes the wait at once
            undone = {k: [f for _, f in calls if not f.done()] for k, calls in self.calls.items()}
            ready = sorted(k for k, fs in undone.items() if not fs)
            if ready or not wait or not undone:
                break
            concurrent.futures.wait([f for fs in undone.values() for f in fs],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        taken = [pair for k in ready for pair in self.calls.pop(k)]
        return ready, [call for call, _ in taken], [f.result() for _, f in taken]

    def cancel(self) -> None:
        """Cancel the calls no worker has taken yet (after an error, so they never start)."""
        for calls in self.calls.values():
            for _, f in calls:
                f.cancel()


@contextlib.contextmanager
def awake(engine):
    """A `generating` context for an engine that is always awake (tests, tools)."""
    yield engine
