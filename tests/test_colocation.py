"""The colocation memory plan's arithmetic and the Colocation object's engine life cycle."""

import os

import pytest
import torch

from rollout.colocation import (
    ENGINE_ASLEEP_BYTES, ENGINE_OVERHEAD_BYTES, MAX_ENGINE_SHARE, Colocation, MemoryNeeds, activation_bytes, kv_bytes_per_token, plan_memory,
)

GIB = 2**30


def needs_3b_h200(**overrides):
    """Qwen2.5-VL-3B on one H200: fp32 master weights (3.78B parameters), AdamW, a reference model."""
    params = int(15.1 * GIB)
    base = dict(device=int(139.8 * GIB), parameters=params, gradients=params, optimizer=2 * params, reference=params,
                compute_copy=params // 2, activations=20 * GIB, engine_weights=params // 2, engine_kv_wanted=3 * GIB)
    base.update(overrides)
    return MemoryNeeds(**base)


def test_3b_on_one_h200_keeps_the_policy_resident():
    n = needs_3b_h200()
    plan = plan_memory(n)
    assert plan.offload == "none" and not plan.warnings
    resident = n.parameters + n.optimizer + n.reference  # gradients are freed after each update
    assert plan.resident_during_generation == resident
    # the engine gets what it can use (weights, overhead, the widest batch's KV), not all that is left
    expected = (n.engine_weights + ENGINE_OVERHEAD_BYTES + n.engine_kv_wanted) / n.device
    assert plan.gpu_memory_utilization == pytest.approx(expected)
    assert plan.engine_bytes < n.device - resident - n.reserve
    wide = plan_memory(needs_3b_h200(engine_kv_wanted=200 * GIB))  # more KV than is left: all that is left
    assert wide.offload == "none"
    assert wide.gpu_memory_utilization == pytest.approx((n.device - resident - n.reserve) / n.device)
    assert plan.training_peak == resident + n.gradients + n.compute_copy + n.activations


def test_optimizer_state_leaves_before_parameters():
    params = 30 * GIB  # a 7.5B fp32 policy (90 GiB with AdamW) on a 100 GiB device
    n = MemoryNeeds(device=100 * GIB, parameters=params, gradients=params, optimizer=2 * params,
                    engine_weights=15 * GIB // 2, engine_kv_wanted=2 * GIB)
    plan = plan_memory(n)
    assert plan.offload == "optimizer"
    assert plan.resident_during_generation == params
    assert plan.engine_bytes >= n.engine_weights + n.engine_kv_wanted

    tight = MemoryNeeds(device=48 * GIB, parameters=params, gradients=params, optimizer=params,
                        engine_weights=15 * GIB, engine_kv_wanted=2 * GIB)
    assert plan_memory(tight).offload == "optimizer+parameters"


def test_share_is_capped_and_small_models_leave_room():
    n = MemoryNeeds(device=100 * GIB, parameters=GIB, gradients=GIB, optimizer=2 * GIB, engine_weights=GIB // 2,
                    engine_kv_wanted=200 * GIB)
    plan = plan_memory(n)
    assert plan.offload == "none" and plan.gpu_memory_utilization == MAX_ENGINE_SHARE


def test_explicit_share_and_forced_modes():
    n = needs_3b_h200()
    plan = plan_memory(n, gpu_memory_utilization=0.35)
    assert plan.explicit and plan.gpu_memory_utilization == 0.35 and plan.offload == "none"
    plan = plan_memory(n, gpu_memory_utilization=0.7)  # 98 GiB beside 60 GiB of state: optimizer goes first
    assert plan.offload == "optimizer"
    assert plan_memory(n, offload="on").offload == "optimizer+parameters"
    off = plan_memory(n, offload="off", gpu_memory_utilization=0.9)
    assert off.offload == "none" and any("do not fit" in w for w in off.warnings)


def test_training_that_cannot_fit_warns():
    plan = plan_memory(needs_3b_h200(activations=80 * GIB))
    assert any("max_tokens_per_microbatch" in w for w in plan.warnings)
    room = plan.needs.device - ENGINE_ASLEEP_BYTES - plan.needs.reserve
    assert plan.training_peak > room


def test_plan_lines_name_every_item():
    plan = plan_memory(needs_3b_h200())
    text = "\n".join(plan.lines())
    for item in ("policy parameters", "gradients", "optimizer state", "reference model", "activations", "engine",
                 "gpu_memory_utilization=0.1", "training peak"):
        assert item in text, item
    assert len(plan.lines()) >= 9


class _Cfg:
    hidden_size, intermediate_size, num_hidden_layers = 2048, 11008, 36
    num_attention_heads, num_key_value_heads, head_dim = 16, 2, 128


_CFG = {k: getattr(_Cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "head_dim")}


def test_shape_estimates():
    full = activation_bytes(_Cfg, 8192, checkpointing=False)
    ckpt = activation_bytes(_Cfg, 8192, checkpointing=True)
    assert ckpt < full / 10
    assert 20 * GIB < full < 40 * GIB  # ~112 KB per token and layer in bf16
    assert kv_bytes_per_token(_CFG, 2) == 2 * 36 * 2 * 128 * 2
    assert kv_bytes_per_token(_CFG, 2, tensor_parallel_size=2) == kv_bytes_per_token(_CFG, 2) // 2
    assert kv_bytes_per_token(_CFG, 2, tensor_parallel_size=8) == kv_bytes_per_token(_CFG, 2) // 2  # 2 KV heads


class _FakeEngine:
    dtype = None

    def __init__(self):
        self.calls = []

    def refit(self, named):
        self.calls.append(("refit", len(list(named))))

    def sleep(self):
        self.calls.append("sleep")

    def wake(self):
        self.calls.append("wake")


class _FakePolicy:
    device = torch.device("cpu")

    def full_state_dict(self, dtype=None):
        yield "w", torch.zeros(2)


def test_engine_is_built_once_and_refit_only_when_stale():
    built = []

    def build(share):
        built.append(share)
        return _FakeEngine()

    colo = Colocation(_FakePolicy(), None, build_engine=build, needs=None, gpu_memory_utilization=0.25)
    with colo.generating() as engine:
        assert engine.calls == [("refit", 1)]  # dummy weights replaced before the first generation
    with colo.generating():
        pass
    assert built == [0.25] and engine.calls == [("refit", 1)]  # current: no second refit
    colo.policy_updated()
    assert colo.engine_version != colo.policy_version
    colo.refit()
    assert engine.calls == [("refit", 1), ("refit", 1)] and colo.engine_version == colo.policy_version
    assert "sleep" not in engine.calls  # on CPU the engine never time-slices


class _RecordingPolicy(_FakePolicy):
    def __init__(self):
        self.moves = []

    def offload(self, optimizer):
        self.moves.append("params->cpu")

    def reload(self, optimizer):
        self.moves.append("params->gpu")

    def offload_optimizer(self, optimizer):
        self.moves.append("optimizer->cpu")

    def reload_optimizer(self, optimizer):
        self.moves.append("optimizer->gpu")


@pytest.mark.parametrize("offload,moves", [
    ("none", []),
    ("optimizer", ["optimizer->cpu", "optimizer->gpu"]),
    ("optimizer+parameters", ["params->cpu", "optimizer->cpu", "params->gpu", "optimizer->gpu"]),
])
def test_generation_moves_only_what_the_plan_offloads(offload, moves):
    policy = _RecordingPolicy()
    colo = Colocation(policy, object(), build_engine=lambda share: _FakeEngine(), needs=None)
    colo.plan = plan_memory(needs_3b_h200())
    colo.plan.offload = offload
    with colo.generating():
        assert policy.moves == moves[:len(moves) // 2]  # out while the engine generates
    assert policy.moves == moves  # and back after


class _DroppingEngine(_FakeEngine):
    sleep_discards_weights = True


class _FakeGpuPolicy(_FakePolicy):
    def reshard(self):
        pass


def test_an_engine_that_drops_its_weights_in_sleep_is_refit_before_generating(monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    colo = Colocation(_FakeGpuPolicy(), None, build_engine=lambda share: _DroppingEngine(), needs=None,
                      gpu_memory_utilization=0.3)
    colo._gpu = True  # time-slice as on a GPU (the fake engine needs no device)
    with colo.generating() as engine:
        pass
    with colo.generating():
        pass  # the policy has not moved, but the weights were dropped: refit again
    assert engine.calls == [("refit", 1), "wake", "sleep", ("refit", 1), "wake", "sleep"]


def test_sleep_level_is_checked_at_load():
    from grpo.config import ConfigError, load_config

    assert load_config(None, ["rollout.sleep_level=2"]).rollout.sleep_level == 2
    with pytest.raises(ConfigError, match="rollout.sleep_level"):
        load_config(None, ["rollout.sleep_level=3"])


def test_kv_bytes_read_zero_padded_per_layer_keys():
    """transformers writes `per_layer_config` keys zero-padded to the widest index ("04" among 12 layers, so they
    sort in JSON); loading reads them as integers, and so must the KV count (else layers 0-9 lose their overrides)."""
    text = {"num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 256,
            "head_dim": 32, "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 3,
            "per_layer_config": {f"{i:02d}": {"head_dim": 64, "num_key_value_heads": 2} for i in (3, 7, 11)}}
    assert kv_bytes_per_token({"text_config": text}, 2) == 2 * (9 * 32 + 3 * 2 * 64) * 2


def test_a_hybrids_linear_attention_layers_keep_state_per_sequence_not_kv_per_token():
    """Qwen3.5-4B's shape: 8 full-attention layers of 4 KV heads of 256 keep K and V per token; its 24 Gated
    DeltaNet layers keep a convolution window and a recurrent state per sequence instead."""
    from rollout.colocation import state_bytes_per_sequence

    text = {"num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_size": 2560,
            "head_dim": 256, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    text["layer_types"] = text["layer_types"] * 8
    config = {"text_config": text}
    assert kv_bytes_per_token(config, 2) == 8 * 2 * 4 * 256 * 2
    per_layer = (2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128
    assert state_bytes_per_sequence(config, 2) == 24 * per_layer * 2
    assert state_bytes_per_sequence(config, 2, tensor_parallel_size=2) == 24 * per_layer * 2 // 2
    assert state_bytes_per_sequence(_CFG, 2) == 0
    # the recurrent state in the config's mamba_ssm_dtype (released configs: float32), the window in the model's
    text["mamba_ssm_dtype"] = "float32"
    assert state_bytes_per_sequence(config, 2) == 24 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)


def test_expandable_segments_join_the_allocator_settings_unless_named(monkeypatch):
    from grpo.config import load_config
    from models.parallel import ALLOC_CONF, allocator_settings

    assert load_config(None, []).parallel.expandable_segments is False
    assert load_config(None, ["parallel.expandable_segments=true"]).parallel.expandable_segments is True
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    allocator_settings(False)
    assert ALLOC_CONF not in os.environ
    allocator_settings(True)
    assert os.environ[ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(ALLOC_CONF, "max_split_size_mb:512")
    allocator_settings(True)
    assert os.environ[ALLOC_CONF] == "max_split_size_mb:512,expandable_segments:True"
    monkeypatch.setenv(ALLOC_CONF, "expandable_segments:False")  # the user's own setting wins
    allocator_settings(True)
    assert os.environ[ALLOC_CONF] == "expandable_segments:False"


class _FakeAllocator:
    """torch.cuda's allocator statistics as DevicePeak reads them, driven by hand."""

    def __init__(self, engine_asleep: int):
        self.reserved = self.allocated = engine_asleep  # a sleeping engine's tensors stay in torch's books
        self.peaks = {"reserved": self.reserved, "allocated": self.allocated, "inactive": 0}
        self.inactive = self.retries = self.device_allocs = self.device_frees = 0
        self.outside = 2 * GIB  # CUDA context: on the device, not in torch's books

    def grow(self, allocated: int, reserved: int = 0, inactive: int = 0, retries: int = 0):
        self.allocated += allocated
        self.reserved += reserved
        self.device_allocs += max(reserved, 0) // GIB  # one driver allocation per GiB the cache grows
        self.device_frees += retries  # a full device: cached blocks freed before each retry
        self.inactive, self.retries = inactive, self.retries + retries
        for key, value in (("reserved", self.reserved), ("allocated", self.allocated), ("inactive", inactive)):
            self.peaks[key] = max(self.peaks[key], value)

    def memory_stats(self, device=None):
        return {"reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.peaks["reserved"],
                "allocated_bytes.all.current": self.allocated, "allocated_bytes.all.peak": self.peaks["allocated"],
                "inactive_split_bytes.all.current": self.inactive,
                "inactive_split_bytes.all.peak": self.peaks["inactive"], "num_alloc_retries": self.retries,
                "num_device_alloc": self.device_allocs, "num_device_free": self.device_frees}

    def reset_peak_memory_stats(self, device=None):
        self.peaks = {"reserved": self.reserved, "allocated": self.allocated, "inactive": self.inactive}

    def mem_get_info(self, device=None):
        return 140 * GIB - self.reserved - self.outside, 140 * GIB


def _fake_cuda(monkeypatch, engine_asleep=80 * GIB) -> _FakeAllocator:
    fake = _FakeAllocator(engine_asleep)
    for name in ("memory_stats", "reset_peak_memory_stats", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return fake


def test_labelled_passes_report_the_allocator_per_pass(monkeypatch):
    from rollout.colocation import DevicePeak

    fake = _fake_cuda(monkeypatch)
    fake.grow(allocated=50 * GIB, reserved=60 * GIB)  # the policy's state and a cache; the engine's 80 GiB asleep
    peak = DevicePeak(torch.device("cuda", 0))
    peak.begin()
    fake.grow(0, inactive=3 * GIB)
    peak.before_wake()
    with peak.training("logprob"):
        fake.grow(allocated=8 * GIB, reserved=4 * GIB, inactive=1 * GIB)
        fake.grow(allocated=-8 * GIB)
    with peak.training("update"):
        fake.grow(allocated=40 * GIB, reserved=30 * GIB, inactive=6 * GIB, retries=2)
        fake.grow(allocated=-40 * GIB, inactive=2 * GIB)
    with peak.training("update"):  # a second update pass (another PPO epoch, say) in the same step
        fake.grow(allocated=10 * GIB, reserved=2 * GIB, retries=1)
        fake.grow(allocated=-10 * GIB)
    m = peak.phase_metrics()
    assert m["memory/inactive_split_gb_generation"] == pytest.approx(3.0)
    assert m["memory/alloc_retries_logprob"] == 0.0 and m["memory/alloc_retries_update"] == 3.0
    assert m["memory/reserved_growth_gb_logprob"] == pytest.approx(4.0)
    assert m["memory/allocated_growth_gb_logprob"] == pytest.approx(8.0)  # not the engine's 80 GiB
    assert m["memory/reserved_growth_gb_update"] == pytest.approx(30.0)  # the larger of the two passes
    assert m["memory/allocated_growth_gb_update"] == pytest.approx(40.0)
    assert m["memory/inactive_split_gb_update"] == pytest.approx(6.0)
    # driver allocations: the pass's own, summed over the two update passes (30 + 2), none from before `begin`
    assert m["memory/device_allocs_logprob"] == 4.0 and m["memory/device_allocs_update"] == 32.0
    assert m["memory/device_frees_logprob"] == 0.0 and m["memory/device_frees_update"] == 3.0
    # the step's peak: the device's used memory at the fullest pass start plus its reserved growth
    assert peak.end() * GIB == pytest.approx(fake.outside + 80 * GIB + 60 * GIB + 4 * GIB + 32 * GIB)
    peak.begin()
    assert peak.phase_metrics() == {}


def test_device_peak_on_cpu_reports_no_allocator_metrics():
    from rollout.colocation import DevicePeak

    peak = DevicePeak(torch.device("cpu"))
    peak.begin()
    peak.before_wake()
    with peak.training("update"):
        pass
    assert peak.phase_metrics() == {} and peak.alloc_retries() == 0.0 and peak.end() > 0


def test_gradient_reduce_buffers_count_in_the_training_peak():
    plain = plan_memory(needs_3b_h200())
    held = plan_memory(needs_3b_h200(grad_buffers=4 * GIB))
    assert held.training_peak == plain.training_peak + 4 * GIB
    assert "gradient reduce buffers" in "\n".join(held.lines())
    assert "gradient reduce buffers" not in "\n".join(plain.lines())
    assert held.resident_during_generation == plain.resident_during_generation  # training only


def test_a_training_peak_over_the_device_names_tokens_that_fit():
    n = needs_3b_h200(activations=80 * GIB, microbatch_tokens=8192)
    plan = plan_memory(n)
    (warning,) = [w for w in plan.warnings if "max_tokens_per_microbatch" in w]
    tokens = int(warning.split("about ")[1].split(" fits")[0])
    assert tokens % 256 == 0 and 0 < tokens < 8192
    smaller = plan_memory(needs_3b_h200(activations=80 * GIB * tokens // 8192, microbatch_tokens=tokens))
    assert not any("training needs" in w for w in smaller.warnings)
    assert "activation_checkpointing" in warning
    state_only = plan_memory(needs_3b_h200(parameters=60 * GIB, gradients=60 * GIB, optimizer=120 * GIB))
    assert any("policy's state alone does not fit" in w for w in state_only.warnings)


def _qwen3_5_4b_text(**overrides):
    """Qwen3.5-4B's decoder as transformers configures it: 3 Gated DeltaNet layers to 1 full-attention one."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    shape = dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320)
    return Qwen3_5TextConfig(**{**shape, **overrides})


def test_linear_attention_layers_count_their_own_widths():
    from rollout.colocation import layer_activation_values

    cfg = _qwen3_5_4b_text()
    assert cfg.layer_types.count("linear_attention") == 24 and cfg.layer_types.count("full_attention") == 8
    est = activation_bytes(cfg, 8192, checkpointing=False)
    plain = 8192 * 32 * (8 * 2560 + 4 * 9216) * 2  # the plain-decoder formula for the same shape
    assert est > 1.8 * plain  # the Gated DeltaNet layers keep several times 8·hidden
    assert 50 * GIB < est < 90 * GIB
    linear, full = layer_activation_values(cfg, "linear_attention"), layer_activation_values(cfg, "full_attention")
    assert linear > full > 8 * 2560 + 4 * 9216
    # wider linear heads, a wider convolution, more query heads: each grows the estimate
    for wider in (dict(linear_num_value_heads=64), dict(linear_value_head_dim=256), dict(linear_key_head_dim=256),
                  dict(linear_conv_kernel_dim=8), dict(num_attention_heads=32)):
        assert activation_bytes(_qwen3_5_4b_text(**wider), 8192, checkpointing=False) > est, wider
    half = activation_bytes(cfg, 4096, checkpointing=False)
    assert 2 * half - est == 1024 * 248320 * 16  # linear in tokens, beside one lm_head chunk's fp32 logits
    ckpt = activation_bytes(cfg, 8192, checkpointing=True)
    assert ckpt < est / 5 and ckpt > 8192 * linear * 2  # every layer's input and the widest layer recomputed


def test_the_tiny_qwen3_5_spec_counts_linear_attention():
    """tools/make_tiny_model.py's qwen3_5 decoder: its Gated DeltaNet layers count by their widths."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from models.families.qwen3_5 import tiny_text_config
    from tools.make_tiny_model import SIZES

    class _Tokenizer:  # what the spec reads of a tokenizer: its length and two ids
        def __len__(self):
            return 1500

        def convert_tokens_to_ids(self, token):
            return 1

    text = tiny_text_config(SIZES["tiny"], _Tokenizer())
    cfg = Qwen3_5TextConfig(**text)
    assert "linear_attention" in cfg.layer_types
    est = activation_bytes(cfg, 1024, checkpointing=False)
    for wider in (dict(linear_num_value_heads=4), dict(linear_num_key_heads=2), dict(linear_value_head_dim=256)):
        assert activation_bytes(Qwen3_5TextConfig(**{**text, **wider}), 1024, checkpointing=False) > est, wider


def test_fsdp_unit_sizes_of_a_plain_module():
    from rollout.colocation import fsdp_unit_sizes

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].requires_grad_(False)
    assert fsdp_unit_sizes(model) == [(15 + 8, 15)]


def test_generation_reports_the_engine_s_allocator_counts(monkeypatch):
    """The awake engine's calls: the allocator's retries, driver allocations and frees, summed over a step's
    calls (a multi-turn step generates more than once), none from the training passes around them."""
    from rollout.colocation import DevicePeak

    fake = _fake_cuda(monkeypatch)
    peak = DevicePeak(torch.device("cuda", 0))
    peak.begin()
    with peak.training("update"):
        fake.grow(allocated=4 * GIB, reserved=4 * GIB, retries=1)
    for _ in range(2):
        with peak.generating():
            fake.grow(allocated=1 * GIB, reserved=2 * GIB, retries=1)
            fake.grow(allocated=-1 * GIB)
    m = peak.phase_metrics()
    assert m["memory/alloc_retries_generation"] == 2.0 and m["memory/device_allocs_generation"] == 4.0
    assert m["memory/device_frees_generation"] == 2.0 and m["memory/alloc_retries_update"] == 1.0
    peak.begin()
    assert "memory/device_allocs_generation" not in peak.phase_metrics()  # the next step starts afresh


def test_a_refit_says_where_its_time_went(monkeypatch):
    """The policy's side of the stream (making each tensor) and the engine's (taking it) are told apart."""
    import rollout.colocation as colocation

    clock = [0.0]
    monkeypatch.setattr(colocation.time, "monotonic", lambda: clock[0])

    class Slow(_FakePolicy):
        def full_state_dict(self, dtype=None):
            for name in ("a", "b", "c"):
                clock[0] += 0.5  # gathering and casting one tensor
                yield name, torch.zeros(2)

    class Loading(_FakeEngine):
        def refit(self, named):
            for _ in named:
                clock[0] += 0.25  # loading one tensor
            clock[0] += 1.0  # waking, checking

    colo = Colocation(Slow(), None, build_engine=lambda share: Loading(), needs=None)
    colo.ensure_engine()
    assert colo.refit() == 3.25
    assert colo.refit_timings == {"perf/refit_cache_s": 0.0, "perf/refit_gather_s": 1.5, "perf/refit_engine_s": 1.75}
