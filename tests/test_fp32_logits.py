"""model.fp32_logits: the config key, the fp32-output head (models/logits.py) on the CPU against an fp32
reference, the policy's logprobs with it, the built-in engine's logits, and vLLM's head_dtype override."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

from grpo.config import ConfigError, ModelConfig, load_config, save_config
from models.families.gemma4 import _SoftcappedHead
from models.logits import fp32_head_logits, head_logits
from models.policy import _chunk_logprobs
from tools.loop_summary import read_settings

HIDDEN, VOCAB = 256, 512


def _head(bias: bool = False, seed: int = 0, scale: float = 1.0) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.mul_(scale)
    return head.to(torch.bfloat16)


def _hidden(rows: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).mul(4).to(torch.bfloat16)


def _reference(head: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    bias = None if head.bias is None else head.bias.float()
    return F.linear(h.float(), head.weight.float(), bias)


# --- the config ------------------------------------------------------------------------------------------------------
def test_default_is_true_and_the_key_takes_booleans_only():
    assert load_config(None, []).model.fp32_logits is True
    assert ModelConfig().fp32_logits is True
    assert load_config(None, ["model.fp32_logits=false"]).model.fp32_logits is False
    with pytest.raises(ConfigError, match=r"model.fp32_logits"):
        load_config(None, ["model.fp32_logits=sometimes"])


def test_exact_settles_it_to_false_and_refuses_it_given_true(tmp_path):
    assert load_config(None, ["rollout.exact=true"]).model.fp32_logits is False
    assert load_config(None, ["rollout.exact=true", "model.fp32_logits=false"]).model.fp32_logits is False
    with pytest.raises(ConfigError, match=r"'model.fp32_logits' is true; it needs false .* rollout.exact=true"):
        load_config(None, ["rollout.exact=true", "model.fp32_logits=true"])
    path = tmp_path / "exact.yaml"
    path.write_text("model:\n  fp32_logits: true\nrollout:\n  exact: true\n")
    with pytest.raises(ConfigError, match=r"model.fp32_logits.*rollout.exact"):
        load_config(str(path))


def test_the_settled_value_is_recorded_and_summarized(tmp_path):
    for overrides, meaning in (([], True), (["model.fp32_logits=false"], False), (["rollout.exact=true"], False)):
        cfg = load_config(None, overrides)
        save_config(cfg, tmp_path / "config.yaml")
        assert load_config(str(tmp_path / "config.yaml")) == cfg
        assert read_settings(tmp_path / "config.yaml")["fp32_logits"] is meaning


# --- the head --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_output_equals_the_fp32_reference_and_not_the_bf16_rounded_logits(bias):
    head, h = _head(bias), _hidden()
    reference = _reference(head, h)
    ours = head_logits(head, h, True)
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    assert torch.allclose(ours, reference, rtol=1e-6, atol=1e-5)
    rounded = head_logits(head, h, False)  # the bf16 head, cast after
    assert torch.equal(rounded, head(h).float())
    assert (rounded - reference).abs().max() > 1e-3  # bf16 rounding of logits of this size
    assert (ours - reference).abs().max() < 1e-4 * (rounded - reference).abs().max()


@pytest.mark.parametrize("bias", [False, True])
def test_the_backward_is_the_bf16_heads_and_close_to_the_fp32_reference(bias):
    head, h = _head(bias), _hidden()
    upstream = torch.randn(h.shape[0], VOCAB, generator=torch.Generator().manual_seed(2))

    def grads(fn):
        head.zero_grad()
        x = h.clone().requires_grad_(True)
        (fn(x) * upstream).sum().backward()
        return x.grad, head.weight.grad.clone(), None if head.bias is None else head.bias.grad.clone()

    ours = grads(lambda x: head_logits(head, x, True))
    bf16 = grads(lambda x: head(x).float())  # what the model-dtype head's backward gives
    head32 = nn.Linear(HIDDEN, VOCAB, bias=bias)
    head32.load_state_dict({k: v.float() for k, v in head.state_dict().items()})
    x32 = h.float().requires_grad_(True)
    (head32(x32) * upstream).sum().backward()
    fp32 = (x32.grad, head32.weight.grad, None if not bias else head32.bias.grad)
    for got, same, ref in zip(ours, bf16, fp32):
        if ref is None:
            assert got is None and same is None
            continue
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert torch.allclose(got.float(), same.float(), rtol=1e-2, atol=1e-2 * same.float().abs().max().item())
        assert torch.allclose(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_a_frozen_weight_gets_no_gradient_and_the_hidden_states_still_do():
    head, h = _head(), _hidden()
    head.requires_grad_(False)
    x = h.clone().requires_grad_(True)
    head_logits(head, x, True).logsumexp(-1).sum().backward()
    assert head.weight.grad is None and x.grad is not None and x.grad.dtype == torch.bfloat16
    assert torch.isfinite(x.grad.float()).all()


def test_heads_it_does_not_cover_run_as_they_are():
    h = _hidden()
    head32 = nn.Linear(HIDDEN, VOCAB)
    assert fp32_head_logits(head32, h) is None  # a weight in another dtype than h
    assert torch.equal(head_logits(head32, h.float(), True), head32(h.float()))  # fp32 already: the head itself
    patched = _head()
    patched.forward = lambda x: F.linear(x, patched.weight) * 2  # exact mode patches the instance's forward
    assert fp32_head_logits(patched, h) is None
    assert torch.equal(head_logits(patched, h, True), patched(h).float())

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 3

    sub = Scaled(HIDDEN, VOCAB).to(torch.bfloat16)
    assert fp32_head_logits(sub, h) is None
    assert torch.equal(head_logits(sub, h, True), sub(h).float())
    hooked = _head()
    hooked.register_forward_hook(lambda m, args, out: out * 0)
    assert fp32_head_logits(hooked, h) is None


def test_gemmas_soft_cap_is_taken_on_the_fp32_logits():
    head, h, cap = _head(scale=8.0), _hidden(), 30.0
    capped = _SoftcappedHead(head, cap)
    reference = torch.tanh(_reference(head, h) / cap) * cap
    ours = head_logits(capped, h, True)
    assert ours.dtype == torch.float32 and torch.allclose(ours, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(head_logits(capped, h, False), capped(h).float())  # off: the cap in bf16, as before
    assert (head_logits(capped, h, False) - reference).abs().max() > 1e-3


# --- the policy's logprobs -------------------------------------------------------------------------------------------
def test_chunk_logprobs_are_closer_to_the_fp32_reference_with_it():
    head, h = _head(scale=8.0), _hidden(64)
    targets = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(3))
    reference = torch.log_softmax(_reference(head, h) / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    on, ent_on = _chunk_logprobs(head, h, targets, 0.7, True, None, None, True)
    off, _ = _chunk_logprobs(head, h, targets, 0.7, True, None, None, False)
    err_on, err_off = (on - reference).abs().max(), (off - reference).abs().max()
    assert err_on < 1e-4 and err_off > 1e-3 and err_on < err_off / 10
    assert ent_on is not None and torch.isfinite(ent_on).all()
    # exact mode keeps the head's own output: the same values whatever the switch says
    bias = ((5, 9), -100.0)
    exact_on, _ = _chunk_logprobs(head, h, targets, 0.7, False, bias, None, True)
    exact_off, _ = _chunk_logprobs(head, h, targets, 0.7, False, bias, None, False)
    assert torch.equal(exact_on, exact_off)


def test_chunk_logprobs_backward_runs_under_activation_checkpointing():
    head, h = _head(scale=8.0), _hidden(32)
    targets = torch.randint(0, VOCAB, (32,), generator=torch.Generator().manual_seed(4))
    x = h.clone().requires_grad_(True)
    lp, _ = checkpoint(_chunk_logprobs, head, x, targets, 1.0, False, None, None, True, use_reentrant=False)
    lp.sum().backward()
    assert x.grad is not None and head.weight.grad is not None and torch.isfinite(head.weight.grad.float()).all()


def test_build_policy_takes_the_setting(tiny_model):
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    for value in (True, False):
        policy = build_policy(ModelConfig(path=str(tiny_model), fp32_logits=value), build_parallel_dims(),
                              trainable=False)
        assert policy.fp32_logits is value


# --- the engines -----------------------------------------------------------------------------------------------------
def test_the_torch_engine_computes_its_logits_as_the_policy_does():
    from rollout.torch_engine import TorchEngine

    head, h = _head(scale=8.0), _hidden()
    engine = TorchEngine.__new__(TorchEngine)
    engine.adapter, engine.model = types.SimpleNamespace(lm_head=lambda model: head), None
    engine.fp32_logits = True
    assert torch.equal(engine._logits(h), head_logits(head, h, True))
    engine.fp32_logits = False
    assert torch.equal(engine._logits(h), head(h).float())


def _vllm_kwargs(monkeypatch, family_kwargs: dict, *, fp32: bool, exact=None, dtype: str = "bfloat16") -> dict:
    from rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.__dict__.update(_world=1, _processor_cache_gb=0.0, max_images_per_prompt=1, max_videos_per_prompt=0,
                           _async_scheduling=None, _max_num_seqs=None, _routing=False, _exact=exact,
                           _fp32_logits=fp32)
    engine.adapter = types.SimpleNamespace(vllm_processor_kwargs=lambda a, b: {},
                                           vllm_engine_kwargs=lambda: dict(family_kwargs))
    monkeypatch.setattr(VLLMEngine, "_kv_cache_kwargs", lambda self, *a: {})
    return engine._llm_kwargs("model", 1, 0.3, True, 4096, 0, dtype, 3136, 12544)


def test_vllm_gets_head_dtype_float32_in_its_hf_overrides(monkeypatch):
    assert _vllm_kwargs(monkeypatch, {}, fp32=True)["hf_overrides"] == {"head_dtype": "float32"}
    merged = _vllm_kwargs(monkeypatch, {"hf_overrides": {"max_position_embeddings": 8}}, fp32=True)
    assert merged["hf_overrides"] == {"max_position_embeddings": 8, "head_dtype": "float32"}
    # off, in exact mode, or with a float32 model: the family's overrides as they are, or none
    assert "hf_overrides" not in _vllm_kwargs(monkeypatch, {}, fp32=False)
    exact = types.SimpleNamespace(engine_kwargs=lambda max_model_len: {})
    assert "hf_overrides" not in _vllm_kwargs(monkeypatch, {}, fp32=True, exact=exact)
    assert "hf_overrides" not in _vllm_kwargs(monkeypatch, {}, fp32=True, dtype="float32")
    assert _vllm_kwargs(monkeypatch, {"hf_overrides": {"a": 1}}, fp32=False)["hf_overrides"] == {"a": 1}


def test_a_callable_family_override_runs_first_then_head_dtype_is_set(monkeypatch):
    def family(config):  # as Gemma4's vllm_hf_config: changes the config and returns it
        config.update({"global_head_dim": 64})
        return config

    overrides = _vllm_kwargs(monkeypatch, {"hf_overrides": family}, fp32=True)["hf_overrides"]
    assert callable(overrides)
    config = overrides(PretrainedConfig())
    assert config.global_head_dim == 64 and config.head_dtype == "float32"
    assert _vllm_kwargs(monkeypatch, {"hf_overrides": family}, fp32=False)["hf_overrides"] is family
    import functools

    from rollout.vllm_engine import _then_head_dtype, with_head_dtype

    # a partial of module-level functions, which vLLM's config can copy and send to its workers
    wrapped = with_head_dtype({"hf_overrides": types.SimpleNamespace}, "float32")["hf_overrides"]
    assert isinstance(wrapped, functools.partial) and wrapped.func is _then_head_dtype
    assert wrapped.args == (types.SimpleNamespace, "float32")


def test_the_vllm_engine_refuses_it_in_exact_mode(monkeypatch):
    from rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="fp32_logits with exact mode"):
        VLLMEngine("/nonexistent", max_model_len=64, seed=0, min_pixels=1, max_pixels=1, image_pad_id=0,
                   fp32_logits=True, exact=types.SimpleNamespace())


def test_the_factory_passes_the_setting(monkeypatch, tiny_model):
    from models.family import build_adapter
    from rollout import factory, vllm_engine
    from transformers import AutoConfig

    adapter = build_adapter(AutoConfig.from_pretrained(str(tiny_model)))
    policy = types.SimpleNamespace(model=types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen2_5_vl")),
                                   dtype=torch.bfloat16, adapter=adapter)
    built = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda path, **kw: built.update(kw))
    monkeypatch.setattr(factory, "resolve_engine_name", lambda name, family=None: "vllm")
    for overrides, value in (([], True), (["model.fp32_logits=false"], False)):
        factory.build_engine(load_config(None, [f"model.path={tiny_model}", *overrides]), policy)
        assert built["fp32_logits"] is value
    for overrides, value in (([], True), (["rollout.engine_compile=false"], False)):  # the same path, another key
        factory.build_engine(load_config(None, [f"model.path={tiny_model}", *overrides]), policy)
        assert built["engine_compile"] is value
