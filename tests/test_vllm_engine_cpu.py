"""The vLLM engine's code that runs without vLLM: the refit stream, its check, the KV cap, the shim, the
start-up switches (kernel warm-up, startup plan) and what reaches vLLM's constructor."""

import json
import sys
import types

import pytest
import torch

from rollout.vllm_engine import (
    FLEX_BLOCK_MAP_BYTES,
    FLEX_MAX_NUM_SEQS,
    KV_BLOCK_TOKENS,
    check_loaded,
    engine_env,
    flex_kv_cap_bytes,
    kernel_warmup,
    kv_bytes_per_token,
    refit_stream,
    vllm_compat,
)
from rollout.weight_names import VLLMSkips, vllm_load_name, vllm_param_for

H200_BYTES = 143_771_090_944


def _llava_config(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "llava", family="llava", size="tiny", seed=0)
    return json.loads((path / "config.json").read_text())


def test_refit_stream_predicts_params_and_counts_skips(tmp_path):
    config = _llava_config(tmp_path)
    skips = VLLMSkips.for_config("llava", config)
    last = config["vision_config"]["num_hidden_layers"] - 1
    names = [
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.language_model.layers.0.self_attn.k_proj.weight",
        f"model.vision_tower.encoder.layers.{last}.mlp.fc1.weight",  # past vision_feature_layer=-2
        "lm_head.weight",
    ]
    tensors = [(n, torch.ones(2, 2, requires_grad=True)) for n in names]
    expected, skipped = set(), {}
    out = list(refit_stream("llava", skips, False, tensors, expected, skipped))
    assert [n for n, _ in out] == [vllm_load_name("llava", n) for n in names]  # skipped ones still go to vLLM
    assert all(not t.requires_grad for _, t in out)
    assert set(skipped) == {names[2]}
    # q and k stack into one vLLM parameter: the prediction is by parameter, not by tensor
    assert expected == {vllm_param_for("llava", names[0])[0], vllm_param_for("llava", "lm_head.weight")[0]}
    # with a tied head, vLLM drops lm_head.*: it is not expected back
    expected_tied = set()
    list(refit_stream("llava", skips, True, tensors, expected_tied, {}))
    assert vllm_param_for("llava", "lm_head.weight")[0] not in expected_tied


def test_refit_stream_rejects_non_tensors_and_foreign_names(tmp_path):
    skips = VLLMSkips.for_config("llava", _llava_config(tmp_path))
    with pytest.raises(TypeError, match="lm_head.weight is a list"):
        list(refit_stream("llava", skips, False, [("lm_head.weight", [1.0])], set(), {}))
    with pytest.raises(ValueError, match="transformer.h.0.mlp.weight"):
        list(refit_stream("llava", skips, False, [("transformer.h.0.mlp.weight", torch.zeros(1))], set(), {}))


def test_check_loaded_names_what_is_missing_and_extra():
    check_loaded({"a", "b"}, {"a", "b"})
    with pytest.raises(RuntimeError, match=r"did not load \['b'\] \(1 in all\) and loaded unexpected \['c'\]"):
        check_loaded({"a", "c"}, {"a", "b"})


def _gemma3(layers=34, kv_heads=4, head_dim=256):
    return {"model_type": "gemma3", "text_config": {"num_hidden_layers": layers, "num_key_value_heads": kv_heads,
                                                    "head_dim": head_dim, "num_attention_heads": 8,
                                                    "hidden_size": 2560}}


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    assert kv_bytes_per_token(_gemma3(), 2) == 2 * 34 * 4 * 256 * 2
    # head_dim from hidden_size / heads when the config leaves it out; kv heads default to heads
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 4) == 2 * 2 * 4 * 16 * 4


def test_flex_cap_binds_for_tiny_models_only():
    tiny = _gemma3(layers=2, kv_heads=2, head_dim=16)
    cap = flex_kv_cap_bytes(tiny, 2, 0.5, H200_BYTES)
    assert cap is not None
    blocks = cap // (KV_BLOCK_TOKENS * kv_bytes_per_token(tiny, 2))
    assert blocks * FLEX_MAX_NUM_SEQS * 8 <= FLEX_BLOCK_MAP_BYTES  # the block map fits its budget
    assert flex_kv_cap_bytes(_gemma3(), 2, 0.5, H200_BYTES) is None  # Gemma3-4B: the cap would not bind
    qwen = {**tiny, "model_type": "qwen2_5_vl"}
    assert flex_kv_cap_bytes(qwen, 2, 0.5, H200_BYTES) is None  # no FlexAttention block map to bound


def test_vllm_compat_touches_nothing_for_other_families():
    assert vllm_compat("qwen2_5_vl") == []
    assert vllm_compat("gemma3") == []


def test_flex_cap_is_per_gpu_under_tensor_parallelism():
    tiny = _gemma3(layers=2, kv_heads=2, head_dim=16)
    one = flex_kv_cap_bytes(tiny, 2, 0.5, H200_BYTES)
    assert flex_kv_cap_bytes(tiny, 2, 0.5, H200_BYTES, tensor_parallel_size=2) == one // 2
    # more GPUs than KV heads: heads are replicated, a GPU still holds one head's share
    assert flex_kv_cap_bytes(tiny, 2, 0.5, H200_BYTES, tensor_parallel_size=4) == one // 2


class _FakeSamplingParams:
    """vLLM's SamplingParams as far as the warm-up touches it."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    @staticmethod
    def for_sampler_warmup():
        return "every feature"


def _fake_worker(monkeypatch, calls: list):
    """A vLLM whose V2 worker warms up through `gpu_worker.warmup_kernels`, which records what it got."""

    def warmup_kernels(model_runner, execute_model, sample_tokens):
        calls.append({"runner": model_runner, "params": _FakeSamplingParams.for_sampler_warmup(),
                      "sampled": sample_tokens("grammar bitmask")})

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = _FakeSamplingParams
    worker = types.ModuleType("vllm.v1.worker.gpu_worker")
    worker.warmup_kernels = warmup_kernels
    for name, module in (("vllm", vllm), ("vllm.v1", types.ModuleType("vllm.v1")),
                         ("vllm.v1.worker", types.ModuleType("vllm.v1.worker")), (worker.__name__, worker)):
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["vllm.v1.worker"].gpu_worker = worker
    sys.modules["vllm.v1"].worker = sys.modules["vllm.v1.worker"]
    vllm.v1 = sys.modules["vllm.v1"]
    return vllm, worker, warmup_kernels


@pytest.mark.parametrize("mode", ["full", "lean", "off"])
def test_kernel_warmup_modes_reach_the_v2_worker(monkeypatch, mode):
    calls = []
    _, worker, original = _fake_worker(monkeypatch, calls)
    times = {}
    with kernel_warmup(mode, "rollout params", times):
        assert worker.warmup_kernels is not original
        worker.warmup_kernels("runner", lambda out: None, lambda grammar: f"sampled with {grammar}")
    assert worker.warmup_kernels is original and _FakeSamplingParams.for_sampler_warmup() == "every feature"
    assert times["warmup_s"] >= 0
    expected = {"full": [{"runner": "runner", "params": "every feature", "sampled": "sampled with grammar bitmask"}],
                "lean": [{"runner": "runner", "params": "rollout params", "sampled": "sampled with None"}],
                "off": []}[mode]
    assert calls == expected


def test_kernel_warmup_names_a_bad_mode_and_tolerates_a_vllm_without_the_v2_worker(monkeypatch):
    with pytest.raises(ValueError, match="engine_warmup='fast'"):
        with kernel_warmup("fast", None, {}):
            pass
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # a plain module: no vllm.v1
    times = {}
    with kernel_warmup("off", None, times):
        pass
    assert times == {}


def test_the_build_runs_the_configured_warmup_inside_the_llm_constructor(monkeypatch, tmp_path):
    from rollout.base import SamplingParams
    from rollout.vllm_engine import BAN_BIAS, VLLMEngine

    calls, captured = [], {}
    vllm, worker, _ = _fake_worker(monkeypatch, calls)

    class LLM:  # vLLM's constructor warms up through the worker, inside the engine's build
        def __init__(self, **kwargs):
            captured.update(kwargs)
            worker.warmup_kernels("runner", lambda out: None, lambda grammar: grammar)

    vllm.LLM = LLM
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.__dict__.update(_world=1, _processor_cache_gb=0.0, max_images_per_prompt=1, max_videos_per_prompt=0,
                           _async_scheduling=None, _max_num_seqs=128, _routing=False, _exact=None,
                           _engine_warmup="lean", build_times={},
                           _warmup_sampling=SamplingParams(temperature=0.7, max_new_tokens=2, banned_token_ids=[5, 9]))
    engine.adapter = types.SimpleNamespace(vllm_processor_kwargs=lambda a, b: {}, vllm_engine_kwargs=lambda: {})
    monkeypatch.setattr(VLLMEngine, "_kv_cache_kwargs", lambda self, *a: {})
    engine._build_llm(str(tmp_path), 1, 0.3, False, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["max_num_seqs"] == 128 and captured["load_format"] == "dummy"
    (call,) = calls
    lean = call["params"]  # the rollouts' sampling: their temperature and bans, the sampled token's logprob only
    assert (lean.temperature, lean.top_p, lean.top_k, lean.logprobs) == (0.7, 1.0, 0, 0)
    assert lean.logit_bias == {5: BAN_BIAS, 9: BAN_BIAS} and call["sampled"] is None
    assert "warmup_s" in engine.build_times
    engine._engine_warmup = "full"
    calls.clear()
    engine._build_llm(str(tmp_path), 1, 0.3, False, 4096, 0, "bfloat16", 3136, 12544)
    assert calls == [{"runner": "runner", "params": "every feature", "sampled": "grammar bitmask"}]
    engine._engine_warmup = "off"  # the default: no warm-up runs, its (near-zero) time is still reported
    calls.clear()
    engine.build_times.clear()
    engine._build_llm(str(tmp_path), 1, 0.3, False, 4096, 0, "bfloat16", 3136, 12544)
    assert calls == [] and engine.build_times["warmup_s"] < 1.0


def test_engine_env_adds_the_startup_plan_only_when_asked():
    family = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert engine_env(family, False) == family
    assert engine_env(family, True) == {**family, "VLLM_ENABLE_STARTUP_PLAN": "1"}
    assert engine_env({}, False) == {}


def _factory_kwargs(monkeypatch, tiny_model, *overrides: str) -> tuple[dict, object]:
    """What rollout.factory.build_engine hands VLLMEngine for a config with these overrides, and the adapter."""
    from grpo.config import load_config
    from models.family import build_adapter
    from rollout import factory, vllm_engine
    from transformers import AutoConfig

    built = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda path, **kw: built.update(kw))
    monkeypatch.setattr(factory, "resolve_engine_name", lambda name, family=None: "vllm")
    adapter = build_adapter(AutoConfig.from_pretrained(str(tiny_model)))
    policy = types.SimpleNamespace(model=types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen2_5_vl")),
                                   dtype=torch.bfloat16, adapter=adapter)
    factory.build_engine(load_config(None, [f"model.path={tiny_model}", *overrides]), policy)
    return built, adapter


def test_factory_passes_the_start_up_switches(monkeypatch, tiny_model):
    built, _ = _factory_kwargs(monkeypatch, tiny_model)
    # by default no kernel warm-up (each kernel compiles on first use) and vLLM's own memory profiling
    assert built["engine_warmup"] == "off" and built["startup_plan"] is False
    built, adapter = _factory_kwargs(monkeypatch, tiny_model, "rollout.engine_warmup=lean",
                                     "rollout.engine_startup_plan=true", "rollout.temperature=0.6")
    assert built["engine_warmup"] == "lean" and built["startup_plan"] is True
    warm = built["warmup_sampling"]
    assert warm.temperature == 0.6 and warm.banned_token_ids == list(adapter.banned_token_ids)


def test_factory_passes_gen_breakdown(monkeypatch, tiny_model):
    from grpo.config import ConfigError, load_config

    assert load_config(None).rollout.gen_breakdown is True  # on by default: every vLLM run logs perf/gen_*
    assert _factory_kwargs(monkeypatch, tiny_model)[0]["gen_breakdown"] is True
    assert _factory_kwargs(monkeypatch, tiny_model, "rollout.gen_breakdown=false")[0]["gen_breakdown"] is False
    with pytest.raises(ConfigError, match=r"rollout.gen_breakdown.*expected bool"):
        load_config(None, ["rollout.gen_breakdown=sometimes"])


def test_generate_keeps_each_call_s_breakdown(tiny_model):
    """rollout.gen_breakdown: VLLMEngine.generate brackets each call with its probe and keeps the call's
    breakdown as last_breakdown; without a probe (rollout.gen_breakdown=false) it stays empty."""
    from types import SimpleNamespace as NS

    from rollout.base import PromptInput, SamplingParams

    engine, processor = _request_engine(tiny_model, _asleep=set(), _seed=0, _calls=0, _dp_rank=0, _device=None,
                                        _routing=False, mm_uuids=False)
    ids = processor.tokenizer.encode("hello there")
    scheduler = NS(requests={})
    steps = []

    class LLM:
        def _add_completion_requests(self, requests):
            return None

        def _run_engine(self):
            for _ in range(3):
                scheduler.schedule()

        def generate(self, requests, sampling, use_tqdm=False):
            self._add_completion_requests(requests)
            self._run_engine()
            return [NS(prompt_token_ids=r["prompt_token_ids"], num_cached_tokens=1,
                       outputs=[NS(index=0, token_ids=[5], logprobs=[{5: NS(logprob=-0.5)}], finish_reason="length")])
                    for r in requests]

    scheduler.schedule = lambda: steps.append(1) or NS(num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1,
                                                        scheduled_encoder_inputs={}, scheduled_encoder_input_stats=None)
    engine._llm = LLM()
    engine._llm.llm_engine = NS(engine_core=NS(engine_core=NS(scheduler=scheduler)))
    engine._vllm_sampling = lambda params, count: None
    engine._install_probe()
    try:
        engine.generate([PromptInput(ids), PromptInput(ids)], SamplingParams(n=1, max_new_tokens=1))
        first = engine.last_breakdown
        assert first["steps"] == 3 and first["prompt_tokens"] == 2 * len(ids) and first["cached_prompt_tokens"] == 2
        assert first["add_s"] >= 0 and first["encoder_s"] is None and first["encoder_synced"] is False
        engine.generate([PromptInput(ids)], SamplingParams(n=1, max_new_tokens=1))
        assert engine.last_breakdown["steps"] == 3  # this call's alone
        assert engine.generate([], SamplingParams(n=1, max_new_tokens=1)) == [] and engine.last_breakdown == {}
    finally:
        engine._probe.close()
    engine._probe = None  # rollout.gen_breakdown=false
    engine.generate([PromptInput(ids)], SamplingParams(n=1, max_new_tokens=1))
    assert engine.last_breakdown == {}


def test_image_keys_name_content_and_hash_each_image_object_once():
    import gc

    from PIL import Image

    from rollout.vllm_engine import ImageKeys, image_key

    red, red_again, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    keys = ImageKeys()
    assert keys(red) == keys(red_again) == image_key(red) != keys(blue)  # by content, not by object
    assert keys.computed == 3 and keys(red) == image_key(red) and keys.computed == 3  # the second time a look-up
    # the same bytes in another shape or mode are another image
    assert image_key(Image.new("L", (24, 8), 0)) != image_key(Image.new("L", (8, 24), 0))
    assert image_key(Image.new("L", (8, 8), 0)) != image_key(Image.new("P", (8, 8), 0))
    del red_again
    gc.collect()
    assert len(keys) == 2  # a freed image's entry goes with it


def _request_engine(tiny_model, **attrs):
    from data.processing import load_processor
    from models.family import build_adapter
    from rollout.vllm_engine import VLLMEngine
    from transformers import AutoConfig

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.adapter = build_adapter(AutoConfig.from_pretrained(str(tiny_model)))
    engine.family, engine.max_images_per_prompt, engine.max_videos_per_prompt = "qwen2_5_vl", 3, 0
    processor = load_processor(str(tiny_model))
    engine._vocab = processor.tokenizer.get_vocab()
    engine.__dict__.update(attrs)
    return engine, processor


def test_vllm_requests_name_their_images_by_content_key(tiny_model):
    from PIL import Image

    from rollout.base import PromptInput
    from rollout.vllm_engine import ImageKeys, image_key

    engine, processor = _request_engine(tiny_model, mm_uuids=True, _image_keys=ImageKeys())  # rollout.mm_uuids=true
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    images = processor.prepare_images([Image.new("RGB", (56, 56), "red"), Image.new("RGB", (56, 56), "blue")])
    ids = processor(processor.apply_chat_template(messages), images)["input_ids"].tolist()
    prompt = PromptInput(ids, images)
    request = engine._vllm_prompt(0, prompt)
    assert request["multi_modal_uuids"] == {"image": [image_key(i) for i in images]}
    assert request["multi_modal_data"] == {"image": images}
    engine._vllm_prompt(1, prompt)  # a later turn sends the same image objects: no hashing again
    assert engine._image_keys.computed == 2
    engine.mm_uuids = False  # rollout.mm_uuids=false: vLLM hashes the images itself
    assert "multi_modal_uuids" not in engine._vllm_prompt(0, prompt)
    assert "multi_modal_uuids" not in engine._vllm_prompt(0, PromptInput(processor.tokenizer.encode("hi")))


def test_factory_passes_mm_uuids(monkeypatch, tiny_model):
    assert _factory_kwargs(monkeypatch, tiny_model)[0]["mm_uuids"] is False  # off until measured on a GPU
    assert _factory_kwargs(monkeypatch, tiny_model, "rollout.mm_uuids=true")[0]["mm_uuids"] is True


def test_factory_passes_the_processor_switches(monkeypatch, tiny_model):
    switches = ("skip_empty_hf_calls", "fast_placeholder_search")
    built = _factory_kwargs(monkeypatch, tiny_model)[0]
    assert all(built[name] is True for name in switches)  # on by default (docs/agents.md, the H200 turns run)
    for name in switches:
        built = _factory_kwargs(monkeypatch, tiny_model, f"rollout.{name}=false")[0]
        assert built[name] is False and all(built[other] is True for other in switches if other != name)


def test_generation_probe_reads_the_engine_s_vllm_objects(tiny_model):
    """rollout/gen_probe.py's GenerationProbe (train.py's rollout.gen_breakdown, tools/bench_turns.py's per-turn
    breakdown) on stand-ins shaped like vLLM 0.26's in-process objects."""
    from types import SimpleNamespace as NS

    from PIL import Image

    from rollout.base import PromptInput
    from rollout.gen_probe import GenerationProbe
    from tools.bench_turns import zoom_crop

    engine, processor = _request_engine(tiny_model)
    feature = NS(mm_position=NS(get_num_embeds=lambda: 4))
    scheduler = NS(requests={"r0": NS(mm_features=[feature, feature])})
    steps = [NS(num_scheduled_tokens={"r0": 9, "r1": 1}, total_num_scheduled_tokens=10,
                scheduled_encoder_inputs={"r0": [0, 1]}, scheduled_encoder_input_stats=None, preempted_req_ids={"r2"}),
             NS(num_scheduled_tokens={"r0": 1, "r1": 1}, total_num_scheduled_tokens=2, scheduled_encoder_inputs={},
                scheduled_encoder_input_stats=None, preempted_req_ids=None)]
    scheduler.schedule = lambda: steps.pop(0)

    class LLM:
        def _add_completion_requests(self, prompts):
            return [engine._vllm_prompt(i, p) for i, p in enumerate(prompts)]

        def _run_engine(self):
            scheduler.schedule()
            scheduler.schedule()

    engine._llm = LLM()
    engine._llm.llm_engine = NS(engine_core=NS(engine_core=NS(scheduler=scheduler)))  # no renderer, no runner
    probe = GenerationProbe(engine)
    try:
        probe.begin()
        image = Image.new("RGB", (28, 28), "red")
        ids = processor(processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}]),
                        [image])["input_ids"].tolist()
        engine._llm._add_completion_requests([PromptInput(ids, [image])] * 3)
        engine._llm._run_engine()
        out = probe.report({"prompt_tokens": 30, "cached_prompt_tokens": 12}, input_s=0.25)
    finally:
        probe.close()
    assert out["images_sent"] == 3 and out["images_encoded"] == 2 and out["encoder_embeds"] == 8
    assert (out["steps"], out["prefill_steps"], out["scheduled_tokens"], out["prefill_tokens"]) == (2, 1, 12, 9)
    assert out["preempted"] == 1 and out["input_s"] == 0.25 and out["cached_prompt_tokens"] == 12
    assert len(out["slowest_steps_s"]) == 1  # two scheduler calls: one interval
    assert out["prep_s"] >= 0 and out["add_s"] >= out["prep_s"] and out["steps_s"] >= 0
    # what these stand-ins lack reads null, not zero
    assert out["mm_stage_s"] is None and out["images_processed"] is None and out["encoder_s"] is None
    assert probe.report()["steps"] == 0  # reset after reading
    crops = [zoom_crop(Image.new("RGB", (56, 56), "red"), 56, k, t, True) for k in range(3) for t in range(2)]
    assert len({c.tobytes() for c in crops}) == 6 and all(c.size == (56, 56) for c in crops)
    assert zoom_crop(image, 28, 0, 0, False).tobytes() == zoom_crop(image, 28, 5, 1, False).tobytes()


class _BenchStandIn:
    """tools/bench_turns.py's engine, answering without vLLM."""
    reads_pixel_values = False

    def __init__(self, path, **kwargs):
        self.kwargs, self.calls, self.last_stats = kwargs, [], {}
        self._llm = None  # nothing for the probe to wrap: every breakdown field reads null

    def generate(self, prompts, params):
        from rollout.base import Generation

        self.calls.append((prompts, params))
        self.last_stats = {"prompt_tokens": sum(len(p.input_ids) for p in prompts), "cached_prompt_tokens": 0}
        torch.ones(8).mul(2).sum()  # an op for the profiler to see
        self.last_breakdown = {"call": len(self.calls)}  # as the engine's probe leaves it
        return [Generation(i, [11] * params.max_new_tokens, [-0.1] * params.max_new_tokens, "length")
                for i, _ in enumerate(prompts) for _ in range(params.n)]

    def generate_continuing(self, first, follow, add_batch=1):
        """Steps of one token for every running request; a request ends after its max_new_tokens, the step's
        ended ones go to `follow` together and what it returns joins the next step. `events` records each
        request's (step added, step ended, tokens, seed, images)."""
        from rollout.base import Generation

        running, step = [], 0
        self.events = getattr(self, "events", [])
        self.continuing_calls = getattr(self, "continuing_calls", 0) + 1

        def add(requests):
            for key, prompt, params in requests:
                assert params.n == 1
                running.append([key, params.max_new_tokens, {"added": step, "tokens": params.max_new_tokens,
                                                              "seed": params.seed, "images": len(prompt.images)}])
        add(first)
        while running:
            step += 1
            for r in running:
                r[1] -= 1
            done = [r for r in running if r[1] == 0]
            running = [r for r in running if r[1] > 0]
            for r in done:
                self.events.append({**r[2], "ended": step, "call": self.continuing_calls})
            add(follow([(r[0], Generation(0, [11] * r[2]["tokens"], [-0.1] * r[2]["tokens"], "length"))
                        for r in done]))
        self.add_batch = add_batch
        self.last_breakdown = {"steps": step, "continuing_call": self.continuing_calls}


def _bench_stand_in(monkeypatch) -> list:
    """The engines tools/bench_turns.py builds, as _BenchStandIn."""
    import rollout.vllm_engine as vllm_engine

    built = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda path, **kw: built.append(_BenchStandIn(path, **kw))
                        or built[-1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return built


def test_bench_turns_runs_end_to_end_on_a_stand_in_engine(monkeypatch, tiny_model, tmp_path):
    """tools/bench_turns.py's turns, tool messages and JSON, with an engine that answers without vLLM."""
    import json

    from tools import bench_turns

    built = _bench_stand_in(monkeypatch)
    out = tmp_path / "turns.json"
    result = bench_turns.main(["--model", str(tiny_model), "--prompts", "2", "--n", "2", "--turns", "3",
                               "--turn-tokens", "4", "--side", "56", "--crops", "distinct", "--mm-uuids", "0",
                               "--skip-empty-hf", "1", "--fast-placeholders", "1", "--json-out", str(out)])
    assert json.loads(out.read_text()) == result
    (engine,) = built
    assert engine.kwargs["mm_uuids"] is False and engine.kwargs["max_images_per_prompt"] == 3
    assert engine.kwargs["skip_empty_hf_calls"] is True and result["skip_empty_hf"] is True
    assert engine.kwargs["fast_placeholder_search"] is True and result["fast_placeholders"] is True
    assert engine.kwargs["gen_breakdown"] is False  # the benchmark's own probe, synchronized around the encoder
    turns = engine.calls[2:5]  # after the warm-up and the single-turn call
    assert [len(c[0]) for c in turns] == [2, 4, 4] and [len(c[0][0].images) for c in turns] == [1, 2, 3]
    # the same-total baseline: each episode's prompt and tool messages (its 3 images), its 12 model tokens in one turn
    (flat_prompts, flat_params), last = engine.calls[5][:2], turns[2][0]
    assert len(engine.calls) == 6 and len(flat_prompts) == 4 and flat_params.max_new_tokens == 12
    assert all(len(f.images) == 3 and f.pixel_values is None for f in flat_prompts)
    assert all(len(f.input_ids) == len(p.input_ids) - 8 for f, p in zip(flat_prompts, last))  # less turns 1-2's model tokens
    assert result["same_total_tokens"] == result["multi_turn_tokens"] == 4 * 12
    assert result["same_total_prompt_tokens"] == sum(len(f.input_ids) for f in flat_prompts)
    assert result["ratio_same_total"] > 0 and "same-total ratio" in bench_turns.summary_line(result)
    assert all(p.pixel_values is None for c in turns for p in c[0])  # built as Rollouts builds them for vLLM
    assert len({p.images[2].tobytes() for p in turns[2][0]}) == 4  # distinct crops: one per episode
    assert result["crops"] == "distinct" and result["mm_uuids"] is False and len(result["turn_s"]) == 3
    assert [t["turn"] for t in result["turn_breakdown"]] == [1, 2, 3]
    assert result["turn_breakdown"][1]["input_s"] >= 0 and result["turn_breakdown"][1]["steps"] is None
    assert result["turn_breakdown"][1]["encoder_synced"] is True
    assert result["single_turn_breakdown"]["prompt_tokens"] == sum(len(p.input_ids) for p in engine.calls[1][0])
    assert result["profile_turns"] is False and "profiles" not in result


def test_bench_turns_varied_lengths_turn_by_turn_and_continuous(monkeypatch, tiny_model):
    """--lengths varied: each episode's turns their own lengths, the same tokens on the single-turn side (one request
    per episode, its whole length); turn by turn, each turn's call at its longest length, cut per episode;
    --continuous 1: an episode's next turn (one more image, its next length) joins while others still run."""
    from tools import bench_turns

    args = ["--model", str(tiny_model), "--prompts", "2", "--n", "2", "--turns", "3", "--turn-tokens", "8",
            "--side", "56", "--crops", "distinct", "--lengths", "varied"]
    lengths = bench_turns.turn_lengths(4, 3, 8, True)
    assert all(2 <= x <= 14 for row in lengths for x in row) and len({x for row in lengths for x in row}) > 1
    assert bench_turns.turn_lengths(4, 3, 8, False) == [[8] * 3] * 4
    built = _bench_stand_in(monkeypatch)
    synced = bench_turns.main(args)
    (engine,) = built
    single = [e for e in engine.events if e["call"] == 1]
    assert sorted(e["tokens"] for e in single) == sorted(sum(row) for row in lengths)
    assert synced["single_turn_tokens"] == synced["multi_turn_tokens"] == sum(map(sum, lengths))
    turns = engine.calls[1:]  # after the warm-up: one call per turn at its longest length
    assert [c[1].max_new_tokens for c in turns] == [max(row[t] for row in lengths) for t in range(3)]
    # the engine's own breakdown (rollout.gen_breakdown) of every call: the single-turn call and each turn's
    assert engine.kwargs["gen_breakdown"] is True
    assert synced["breakdowns"]["single_turn"] == {"steps": max(map(sum, lengths)), "continuing_call": 1}
    assert [synced["breakdowns"][f"turn_{t}"] for t in (1, 2, 3)] == [{"call": 2}, {"call": 3}, {"call": 4}]
    built.clear()
    continuous = bench_turns.main(args + ["--continuous", "1", "--continuous-add-batch", "4"])
    (engine,) = built
    assert engine.add_batch == 4 and continuous["continuous_add_batch"] == 4
    multi = [e for e in engine.events if e["call"] == 2]
    assert continuous["multi_turn_tokens"] == sum(map(sum, lengths)) and continuous["continuous"] is True
    assert sorted(e["tokens"] for e in multi) == sorted(x for row in lengths for x in row)
    assert sorted(e["images"] for e in multi) == [1] * 4 + [2] * 4 + [3] * 4
    # a later turn was added while a request of an earlier one was still running
    assert any(a["added"] < b["ended"] and a["images"] > b["images"] for a in multi for b in multi)
    assert len({e["seed"] for e in multi}) == 12
    assert continuous["breakdowns"]["continuous"]["continuing_call"] == 2  # the continuous call's, not the single's


def test_bench_turns_profiles_the_single_call_turn_1_and_the_last(monkeypatch, tiny_model, tmp_path):
    """--profile-turns 1: the single-turn call, turn 1 and the last turn under torch.profiler (CPU only here),
    each with its kernel and CPU-op tables in the JSON, and a chrome trace with --trace-dir."""
    import json

    from tools import bench_turns

    _bench_stand_in(monkeypatch)
    out, traces = tmp_path / "turns.json", tmp_path / "traces"
    result = bench_turns.main(["--model", str(tiny_model), "--prompts", "2", "--n", "2", "--turns", "3",
                               "--turn-tokens", "4", "--side", "56", "--profile-turns", "1", "--trace-dir",
                               str(traces), "--json-out", str(out)])
    profiles = result["profiles"]
    assert result["profile_turns"] is True and set(profiles) == {"single_turn", "turn_1", "turn_3"}
    for name, prof in profiles.items():
        assert set(prof) >= {"wall_s", "cuda", "cuda_kernel_ms", "cuda_kernels", "cpu_ops", "trace"}, name
        assert prof["cuda"] is False and prof["cuda_kernel_ms"] is None and prof["cuda_kernels"] is None
        assert 0 < len(prof["cpu_ops"]) <= 10 and prof["wall_s"] >= 0
        assert all(set(op) == {"name", "self_ms", "count"} and len(op["name"]) <= 80 for op in prof["cpu_ops"])
        assert "wall_ms_per_step" not in prof  # the stand-in counts no engine steps
        assert json.loads((traces / f"turns_{name}.trace.json").read_text())  # a chrome trace per call
    assert any(op["name"].startswith("aten::") for op in profiles["turn_3"]["cpu_ops"])
    line = bench_turns.summary_line(result)
    assert "prof turn_1" in line and "prof turn_3" in line
    no_trace = bench_turns.main(["--model", str(tiny_model), "--prompts", "2", "--n", "2", "--turns", "1",
                                 "--turn-tokens", "4", "--side", "56", "--profile-turns", "1"])
    assert set(no_trace["profiles"]) == {"single_turn", "turn_1"} and "trace" not in no_trace["profiles"]["turn_1"]


def test_bench_turns_profile_summary_reads_cuda_kernels():
    """profile_summary on stand-ins of torch.profiler's averaged events: kernels by device time, ops by self CPU."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from tools.bench_turns import per_step, profile_summary

    def kernel(name, us, count):
        return NS(key=name, device_type=DeviceType.CUDA, self_device_time_total=us, count=count,
                  self_cpu_time_total=0.0, is_user_annotation=False)

    events = [kernel("k" * 100, 3000.0, 10), kernel("gemm", 5000.0, 128),
              *[kernel(f"small{i}", 1.0, 1) for i in range(20)],
              NS(key="aten::mm", device_type=DeviceType.CPU, self_cpu_time_total=700.0, count=3,
                 self_device_time_total=0.0, is_user_annotation=False),
              NS(key="range", device_type=DeviceType.CUDA, self_device_time_total=9e9, count=1,
                 self_cpu_time_total=0.0, is_user_annotation=True)]
    out = profile_summary(NS(key_averages=lambda: events), 1.23456, cuda=True)
    assert out["cuda_kernel_ms"] == 8.02 and out["wall_s"] == 1.235 and len(out["cuda_kernels"]) == 15
    assert out["cuda_kernels"][0] == {"name": "gemm", "ms": 5.0, "count": 128}
    assert out["cuda_kernels"][1]["name"] == "k" * 80
    assert out["cpu_ops"] == [{"name": "aten::mm", "self_ms": 0.7, "count": 3}]
    per_step({"turn_1": out}, {"turn_1": {"steps": 4}})
    assert out["cuda_kernel_ms_per_step"] == 2.005 and out["wall_ms_per_step"] == pytest.approx(308.75)


def test_bench_turns_summary_line_reads_a_result(tmp_path):
    import json

    from tools.bench_turns import COUNTS, TIMES, main

    turn = {"turn": 2, "s": 1.8, "input_s": 0.1, "mm_stage_s": {"get_mm_hashes": 0.2}, "prompt_tokens": 9,
            "cached_prompt_tokens": 4, **{k: 1 for k in COUNTS}, **dict.fromkeys(TIMES, 0.5)}
    result = {"ratio": 0.7, "single_turn_tokens_per_s": 10.0, "multi_turn_tokens_per_s": 7.0, "crops": "same",
              "mm_uuids": True, "tool_message_s": 2.0, "turn_breakdown": [turn]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert main(["--summarize", str(path)]) == result


def test_bench_turns_encode_only_times_a_turn_alone_and_together(tiny_model):
    """tools/bench_turns.py --encode-only: one turn's tool messages encoded without an engine, each episode
    alone and the turn together, with the check that both give the same outputs."""
    from tools.bench_turns import main

    result = main(["--encode-only", "--model", str(tiny_model), "--prompts", "2", "--n", "2", "--side", "56",
                   "--crops", "distinct", "--repeats", "1"])
    assert result["episodes"] == 4 and result["tool_images"] and result["identical"] is True
    assert result["encode_s"] > 0 and result["encode_many_s"] > 0


def test_skip_empty_hf_calls_skips_only_requests_with_nothing_missing():
    """The wrapper answers an empty BatchFeature for a request whose items all hit the cache, and calls
    vLLM's own method whenever anything is missing; applying it twice wraps once."""
    from types import SimpleNamespace as NS

    from rollout.vllm_engine import skip_empty_hf_calls

    calls = []
    processor = NS(_apply_hf_processor_mm_only=lambda items, mm_kwargs, tok_kwargs: calls.append(items) or {"x": 1})
    assert skip_empty_hf_calls(processor) and skip_empty_hf_calls(processor)
    none_missing = NS(get_all_counts=lambda: {"image": 0})
    one_missing = NS(get_all_counts=lambda: {"image": 1})
    assert dict(processor._apply_hf_processor_mm_only(none_missing, {}, {})) == {} and calls == []
    assert processor._apply_hf_processor_mm_only(one_missing, {}, {}) == {"x": 1} and calls == [one_missing]
    assert skip_empty_hf_calls(NS()) is False  # a vLLM without the method: nothing to change


def test_placeholder_jumps_find_vllm_s_runs_in_vllm_s_order():
    """`fast_placeholder_search`'s walk on stand-ins of vLLM's types: runs are found left to right, item by
    item, a position where a run's first token starts no full match is passed over as vLLM passes it, a
    run too long for the rest of the prompt is not found, and the embed mask is vLLM's callable's."""
    from types import SimpleNamespace as NS

    from rollout.vllm_engine import _placeholders_by_jumps

    processing = NS(_seq2tokens=lambda tokenizer, seq: seq, PlaceholderFeaturesInfo=lambda **kw: kw)

    def update(run, embed=None):
        return NS(content=NS(full=run, is_embed=embed))

    updates = {"image": [[update([9, 9])], [update([9, 9, 9], lambda tok, full: [True] * len(full))]],
               "video": [[update([], None)], [update([4, 4])]]}
    prompt = [9, 1, 9, 9, 2, 9, 9, 9, 4, 4, 4, 3]
    found = list(_placeholders_by_jumps(processing, prompt, updates, None))
    # vLLM's walk: the lone 9 at 0 starts no [9, 9]; item 0 at 2, item 1 at 5; the video's empty run is
    # never a match, so its item 0 blocks its item 1
    assert [(f["modality"], f["item_idx"], f["start_idx"]) for f in found] == [("image", 0, 2), ("image", 1, 5)]
    assert found[0]["is_embed"] is None and found[1]["is_embed"] == [True] * 3
    assert list(_placeholders_by_jumps(processing, [1, 9, 9], {"image": [[update([9, 9, 9])]]}, None)) == []


def _vllm_processing_or_skip() -> None:
    """Skip unless vLLM's multimodal processing code imports here (tools/vllm_prompt_check.py's environment)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (PYTHONPATH=<vLLM 0.26 source> runs this)")
    from tools.vllm_prompt_check import _patch_vllm

    try:
        _patch_vllm("qwen2_5_vl")
        import vllm.multimodal.processing  # noqa: F401
    except ImportError as err:
        pytest.skip(f"vLLM's processing code does not import here: {err}")


def _cached_vllm_processor(model, adapter):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.cache import MultiModalProcessorOnlyCache

    from tools.vllm_prompt_check import MAX_PIXELS, MIN_PIXELS

    config = ModelConfig(model=str(model), tokenizer=str(model), dtype="float32", seed=0, max_model_len=4096,
                         mm_processor_kwargs=adapter.vllm_processor_kwargs(MIN_PIXELS, MAX_PIXELS),
                         mm_processor_cache_gb=1, limit_mm_per_prompt={"image": 2, "video": 0})
    # the cache that hands cached items back (the engine's in-process one keeps them on the engine core's side)
    return MULTIMODAL_REGISTRY.create_processor(config, cache=MultiModalProcessorOnlyCache(config))


def test_processor_changes_give_vllm_the_same_inputs(tiny_model):
    """vLLM's own processor with and without `skip_empty_hf_calls` and `fast_placeholder_search`, over a
    miss, a full cache hit and a partial hit: the same prompt ids (the trainer's), hashes, placeholder
    ranges and embed masks, and pixels bit for bit; only the full hit's HF processor call is gone."""
    _vllm_processing_or_skip()
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    from data.datasets import Sample
    from data.processing import encode_prompt, load_processor
    from models.family import build_adapter
    from rollout.vllm_engine import fast_placeholder_search, skip_empty_hf_calls
    from tools.vllm_prompt_check import _images
    from transformers import AutoConfig

    processor = load_processor(str(tiny_model))
    adapter = build_adapter(AutoConfig.from_pretrained(str(tiny_model)))
    vocab = processor.tokenizer.get_vocab()
    a, b, c = _images(3)
    plain, skipping = _cached_vllm_processor(tiny_model, adapter), _cached_vllm_processor(tiny_model, adapter)
    assert skip_empty_hf_calls(skipping) and fast_placeholder_search(skipping)
    hf_calls = {}
    for name, proc in (("plain", plain), ("skipping", skipping)):
        original = proc._apply_hf_processor_text_mm
        proc._apply_hf_processor_text_mm = lambda *args, _o=original, _n=name, **kw: (
            hf_calls.__setitem__(_n, hf_calls.get(_n, 0) + 1), _o(*args, **kw))[1]
    for images, expect_calls in (([a, b], (1, 1)), ([a, b], (1, 0)), ([a, c], (1, 1))):
        encoded = encode_prompt(processor, Sample(0, images, "<image> and <image> How many objects?", "3"), "clevr",
                                4096)
        ids = encoded.input_ids.tolist()
        collapsed, _ = adapter.vllm_collapse(ids, vocab)
        hf_calls.clear()
        outs = [proc.apply(ProcessorInputs(prompt=list(collapsed), mm_data_items=proc.info.parse_mm_data(
            {"image": list(encoded.images)})), timing_ctx=TimingContext(enabled=False)) for proc in (plain, skipping)]
        assert (hf_calls.get("plain", 0), hf_calls.get("skipping", 0)) == expect_calls
        ours, theirs = outs
        assert list(ours["prompt_token_ids"]) == list(theirs["prompt_token_ids"]) == ids
        assert ours["mm_hashes"] == theirs["mm_hashes"]
        assert [(r.offset, r.length) for r in ours["mm_placeholders"]["image"]] == \
            [(r.offset, r.length) for r in theirs["mm_placeholders"]["image"]]
        assert all((x.is_embed is None) == (y.is_embed is None) and (x.is_embed is None or torch.equal(x.is_embed,
                   y.is_embed)) for x, y in zip(ours["mm_placeholders"]["image"], theirs["mm_placeholders"]["image"]))
        for x, y in zip(ours["mm_kwargs"]["image"], theirs["mm_kwargs"]["image"]):
            assert set(x) == set(y) and all(torch.equal(x[k].data, y[k].data) for k in x)
        pixels = torch.cat([item["pixel_values"].data for item in theirs["mm_kwargs"]["image"]])
        assert torch.equal(pixels, encoded.pixel_values)  # the trainer's pixels


def test_bench_turns_add_only_runs_vllm_s_request_adding(tiny_model):
    """tools/bench_turns.py --add-only: each turn's requests through vLLM's own renderer, input processor and
    Request on the CPU; vLLM's prompt ids equal the episodes' with the lever on."""
    _vllm_processing_or_skip()
    from tools.bench_turns import main

    result = main(["--add-only", "--model", str(tiny_model), "--prompts", "2", "--n", "2", "--turns", "3",
                   "--turn-tokens", "4", "--side", "56", "--crops", "distinct", "--skip-empty-hf", "1",
                   "--fast-placeholders", "1", "--repeats", "1"])
    assert result["ids_equal"] is True and [t["prompts"] for t in result["turn_breakdown"]] == [2, 4, 4]
    assert [t["images_sent"] for t in result["turn_breakdown"]] == [2, 8, 12]
    assert all(t["add_s"] > 0 and t["parts_s"]["render"] > 0 for t in result["turn_breakdown"])


def test_each_generate_seeds_numpys_generator_and_restores_it():
    """vLLM 0.26's V2 runner draws an unseeded request's seed from numpy's global generator: inside a
    generate call it is seeded from the call's seed (the ranks of a tensor-parallel group draw alike, a run
    repeats), and the trainer's own numpy stream continues afterwards as if nothing had drawn from it."""
    import numpy as np

    from rollout.vllm_engine import _sampling_rng

    np.random.seed(123)
    expected_after = np.random.get_state()[1].copy()
    draws = []
    for _ in range(2):
        with _sampling_rng(7, None):
            draws.append(np.random.randint(-2**63, 2**63 - 1, size=4))
    with _sampling_rng(8, None):
        other = np.random.randint(-2**63, 2**63 - 1, size=4)
    assert (draws[0] == draws[1]).all() and not (draws[0] == other).all()
    assert (np.random.get_state()[1] == expected_after).all()


def test_engine_applies_its_processor_switches_to_vllm_s_processors():
    """The constructor's `skip_empty_hf_calls` / `fast_placeholder_search` booleans turn the module's functions
    of the same names on for the renderer's processors (the booleans once shadowed those functions)."""
    from types import SimpleNamespace as NS

    from rollout.vllm_engine import VLLMEngine

    def original(items, mm_kwargs, tok_kwargs):
        return {"x": 1}

    processor = NS(_apply_hf_processor_mm_only=original)
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._llm = NS(llm_engine=NS(renderer=NS(mm_processor=processor, _readonly_mm_processor=None)))
    engine.skip_empty_hf_calls, engine.fast_placeholder_search = False, False
    engine._change_mm_processors()
    assert processor._apply_hf_processor_mm_only is original
    engine.skip_empty_hf_calls = True
    engine._change_mm_processors()
    assert processor._apply_hf_processor_mm_only is not original
    assert dict(processor._apply_hf_processor_mm_only(NS(get_all_counts=lambda: {"image": 0}), {}, {})) == {}


def test_engine_logs_a_processor_switch_that_changes_nothing(caplog):
    """A switch that is on where vLLM's processors lack the method it changes (another vLLM) warns once,
    naming the config key; a switch that is off says nothing."""
    from types import SimpleNamespace as NS

    from rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine._llm = NS(llm_engine=NS(renderer=NS(mm_processor=NS(), _readonly_mm_processor=NS())))
    engine.skip_empty_hf_calls, engine.fast_placeholder_search = True, False
    with caplog.at_level("WARNING", logger="rollout.vllm_engine"):
        engine._change_mm_processors()
    warned = [r.getMessage() for r in caplog.records if "does nothing" in r.getMessage()]
    assert len(warned) == 1 and "rollout.skip_empty_hf_calls" in warned[0]
