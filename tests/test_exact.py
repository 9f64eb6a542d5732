"""rollout.exact on CPU: the config's refusals, the paged attention call, the shared numerics, the policy's routing
and the engine's arguments (vLLM's constructor replaced). The bitwise check itself is tests/gpu/test_exact.py."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from grpo.config import ConfigError, load_config
from models import attention
from rollout import exact


# --- config ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("rollout.engine=torch", "rollout.engine"),
    ("rollout.tensor_parallel_size=2", "rollout.tensor_parallel_size"),
    ("parallel.tp=2", "parallel.tp"),
    ("model.compile=true", "model.compile"),
    ("model.liger_kernel=true", "model.liger_kernel"),
    ("model.attn_implementation=sdpa", "model.attn_implementation"),
    ("model.lora.rank=8", "model.lora.rank"),
    ("rollout.top_p=0.9", "rollout.top_p"),
    ("rollout.top_k=20", "rollout.top_k"),
    ("rollout.attention_backend=TRITON_ATTN", "rollout.attention_backend"),
    ("model.dtype=float32", "model.dtype"),
])
def test_exact_refuses_what_cannot_be_exact(override, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}' is .* with rollout.exact=true"):
        load_config(None, ["rollout.exact=true", override])
    load_config(None, [override] if key != "rollout.tensor_parallel_size" else [])  # fine without the mode


def test_exact_accepts_vllm_and_auto():
    assert load_config(None, ["rollout.exact=true", "rollout.engine=vllm"]).rollout.exact
    assert load_config(None, ["rollout.exact=true"]).rollout.engine == "auto"
    assert not load_config(None, []).rollout.exact


def test_family_and_device_checks_name_the_key():
    with pytest.raises(ValueError, match="'rollout.exact' is true but model.path is a llava model"):
        exact.check_family("llava")
    exact.check_family("qwen2_5_vl")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'rollout.exact' is true but no CUDA device"):
            exact.check_device()


def test_prepare_process_sets_batch_invariant_env(monkeypatch):
    for k in exact.PROCESS_ENV:
        monkeypatch.delenv(k, raising=False)
    bf16 = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        exact.prepare_process()
        assert all(__import__("os").environ[k] == v for k, v in exact.PROCESS_ENV.items())
        assert __import__("os").environ["VLLM_BATCH_INVARIANT"] == "1"
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = bf16


# --- paged attention ------------------------------------------------------------------------------------------------
def _row(seed=0, lengths=(5, 17, 33), heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=g)
    k, v = (torch.randn(total, kv_heads, dim, generator=g) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def test_paged_kv_places_every_token_in_its_block():
    q, k, v, cu = _row()
    k_cache, v_cache, table, lengths = attention.paged_kv(k, v, cu, block=16)
    assert lengths.tolist() == [5, 17, 33] and table.dtype == torch.int32
    assert k_cache.shape[1:] == (16, 2, 8) and k_cache.shape[0] == 1 + 2 + 3
    for i, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths.tolist())):
        for j in range(n):
            block, offset = table[i, j // 16], j % 16
            assert torch.equal(k_cache[block, offset], k[start + j])
            assert torch.equal(v_cache[block, offset], v[start + j])
    assert int((k_cache != 0).sum()) == int((k != 0).sum())  # padding slots stay zero


def _paged_reference_kernel(calls):
    """A stand-in for vLLM's flash_attn_varlen_func that reads the paged cache the way the kernel does."""

    def kernel(*, q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal, block_table,
               num_splits, **extra):
        calls.append({"num_splits": num_splits, "causal": causal, "max_seqlen_q": max_seqlen_q, **extra})
        block = k.shape[1]
        out = []
        for i, (start, end) in enumerate(zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist())):
            n = int(seqused_k[i])
            rows = block_table[i, : (n + block - 1) // block].long()
            ks, vs = (c[rows].reshape(-1, *c.shape[2:])[:n] for c in (k, v))
            qs = q[start:end]
            rep = qs.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
            scores = scores.masked_fill(torch.ones(end - start, n, dtype=torch.bool).triu(1), float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        return torch.cat(out)

    return kernel


def test_paged_flash_makes_the_engine_call_on_the_packed_row():
    q, k, v, cu = _row()
    calls = []
    out = attention.paged_flash(q, k, v, cu, 33, 8 ** -0.5, kernel=_paged_reference_kernel(calls))
    ref = attention.reference_attention(q, k, v, cu, 8 ** -0.5)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert calls == [{"num_splits": 1, "causal": True, "max_seqlen_q": 33}]


def test_engine_kernel_attention_backward_is_torchs(monkeypatch):
    q, k, v, cu = _row(1)
    monkeypatch.setattr(attention, "_vllm_flash_kernel", lambda: (_paged_reference_kernel([]), None))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention._EngineKernelAttention.apply(*leaves, cu, 33, 0.3).square().sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention.reference_attention(*ref_leaves, cu, 0.3).square().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


def test_engine_kernel_attention_backward_takes_the_varlen_kernel_where_it_runs(monkeypatch):
    """On CUDA the backward recomputes the row in one varlen call (not SDPA per sequence); same gradients."""
    q, k, v, cu = _row(2)
    calls = []

    def varlen(q, k, v, cu_q, cu_k, longest_q, longest_k, scale=None, is_causal=False, enable_gqa=False):
        calls.append((longest_q, is_causal, enable_gqa))
        return attention.reference_attention(q, k, v, cu_q, scale)

    monkeypatch.setattr(attention, "_vllm_flash_kernel", lambda: (_paged_reference_kernel([]), None))
    monkeypatch.setattr(attention, "_kernel", lambda: (varlen, {"is_causal", "enable_gqa"}))
    monkeypatch.setattr(attention, "kernel_runs", lambda device: True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention._EngineKernelAttention.apply(*leaves, cu, 33, 0.3).square().sum().backward()
    assert calls == [(33, True, True)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention.reference_attention(*ref_leaves, cu, 0.3).square().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


# --- the shared numerics --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_swiglu_are_transformers_bitwise(dtype):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = Qwen2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    x, h = (torch.randn(3, 7, 64, generator=g).to(dtype) * 3 for _ in range(2))
    with torch.no_grad():
        assert torch.equal(exact.rms_norm(x, norm.weight, 1e-6), norm(x))
        engine = types.SimpleNamespace(weight=norm.weight, variance_epsilon=1e-6)
        out, residual = exact._engine_rms_norm(engine, h, x)  # vLLM's norm(attn_out, residual)
        assert torch.equal(residual, x + h) and torch.equal(out, norm(x + h))  # transformers: residual + h, then norm
        gate_up = torch.randn(5, 32, generator=g).to(dtype)
        assert torch.equal(exact._engine_silu_and_mul(None, gate_up), F.silu(gate_up[:, :16]) * gate_up[:, 16:])


def test_align_engine_rebuilds_mrope_tables_from_the_policys_inv_freq():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLRotaryEmbedding

    config = Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4, rope_scaling={"type": "mrope",
                                                                                       "mrope_section": [2, 3, 3]})
    rotary = Qwen2_5_VLRotaryEmbedding(config)
    half = rotary.inv_freq.numel()
    engine = torch.nn.Module()
    engine.rope = torch.nn.Module()
    engine.rope.cos_sin_cache = torch.zeros(50, 2 * half)
    engine.visual = torch.nn.Module()
    engine.visual.cos_sin_cache = torch.zeros(50, 2 * half)
    assert exact.align_engine(engine, rotary.inv_freq)["rope_tables"] == 1
    assert not engine.visual.cos_sin_cache.any()  # no vision inv_freq given: the vision table is left alone
    vision_freq = torch.rand(half)
    assert exact.align_engine(engine, rotary.inv_freq, vision_freq)["vision_rope_tables"] == 1
    assert torch.equal(engine.visual.cos_sin_cache[:, :half], (torch.arange(50.0)[:, None] * vision_freq).cos())
    # a bf16 vision table (vLLM builds it in the model dtype) comes back fp32, as transformers' vision cos/sin;
    # the vision attention's ApplyRotaryEmb op is routed to the fp32 rotation, a text one is left alone
    ApplyRotaryEmb = type("ApplyRotaryEmb", (torch.nn.Module,), {"forward": lambda self, x, cos, sin: x})
    engine.visual.cos_sin_cache = torch.zeros(50, 2 * half, dtype=torch.bfloat16)
    engine.visual.apply_rotary_emb = ApplyRotaryEmb()
    engine.rope.apply_rotary_emb = ApplyRotaryEmb()
    done = exact.align_engine(engine, rotary.inv_freq, vision_freq)
    assert done["vision_rotation"] == 1 and engine.visual.cos_sin_cache.dtype == torch.float32
    x = torch.randn(2, 50, 3, 2 * half).to(torch.bfloat16)
    table_cos, table_sin = engine.visual.cos_sin_cache.chunk(2, dim=-1)
    assert torch.equal(engine.visual.apply_rotary_emb(x, table_cos, table_sin), exact.vision_rope(x, table_cos, table_sin))
    assert engine.rope.apply_rotary_emb(x, table_cos, table_sin) is x
    positions = torch.arange(50).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = rotary(torch.zeros(1, 50, 64), positions)
    table = engine.rope.cos_sin_cache
    # every angle of the policy's (its m-rope sections pick among the same per-position values)
    assert set(cos[0].flatten().tolist()) <= set(table[:, :half].flatten().tolist())
    assert torch.equal(table[:, :half], (torch.arange(50.0)[:, None] * rotary.inv_freq).cos())
    assert torch.equal(table[:, half:], (torch.arange(50.0)[:, None] * rotary.inv_freq).sin())
    routed = exact._policy_text_rope(rotary)(torch.zeros(1, 50, 64), positions)
    assert all(torch.equal(a, b) for a, b in zip(routed, (cos, sin)))  # the policy's routing changes no bit


def test_vision_rope_and_patch_embed_are_transformers():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(9, 2, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    freqs = torch.randn(9, 8, generator=g)
    emb = torch.cat((freqs, freqs), dim=-1)
    expect_q, _ = m.apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
    assert torch.equal(exact.vision_rope(q, freqs.cos(), freqs.sin()), expect_q)
    assert torch.equal(exact._engine_vision_rope(q, freqs), expect_q)
    conv = torch.nn.Conv3d(3, 12, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=False)
    x = torch.randn(5, 3 * 2 * 4 * 4, generator=g)
    with torch.no_grad():
        ref = conv(x.view(-1, 3, 2, 4, 4)).view(-1, 12)
        assert torch.allclose(exact.patch_embed(x, conv.weight), ref, atol=1e-6)
        flat = torch.nn.Linear(96, 12, bias=False)  # vLLM keeps the weight flat
        flat.weight.copy_(conv.weight.reshape(12, -1))
        assert torch.equal(exact.patch_embed(x, flat.weight), exact.patch_embed(x, conv.weight))


def test_fused_projections_compute_one_gemm_with_the_same_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    block = torch.nn.Module()
    block.q_proj, block.k_proj, block.v_proj = (torch.nn.Linear(8, n, bias=True) for n in (8, 4, 4))
    reference = [torch.nn.Linear(8, n) for n in (8, 4, 4)]
    for r, m in zip(reference, (block.q_proj, block.k_proj, block.v_proj)):
        r.load_state_dict(m.state_dict())
    assert exact._fuse(block, ("q_proj", "k_proj", "v_proj")) and not exact._fuse(block, ("gate_proj", "up_proj"))
    x = torch.randn(3, 8, generator=g, requires_grad=True)
    calls = []
    original = F.linear
    try:
        F.linear = lambda *a, **k: calls.append(a[1].shape) or original(*a, **k)
        outs = [block.q_proj(x), block.k_proj(x), block.v_proj(x)]
    finally:
        F.linear = original
    assert calls == [torch.Size([16, 8])]  # one GEMM over [q; k; v]
    refs = [r(x) for r in reference]
    assert all(torch.allclose(o, r, atol=1e-6) for o, r in zip(outs, refs))
    sum(o.square().sum() for o in outs).backward()
    grads = [m.weight.grad.clone() for m in (block.q_proj, block.k_proj, block.v_proj)]
    sum(r.square().sum() for r in refs).backward()
    assert all(torch.allclose(a, r.weight.grad, atol=1e-5) for a, r in zip(grads, reference))


def test_chunk_logprobs_in_exact_mode_is_vllms_order():
    from models.policy import _chunk_logprobs

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    h, targets = torch.randn(6, 16, generator=g), torch.randint(0, 40, (6,), generator=g)
    banned = (3, 7)
    with torch.no_grad():
        lp, _ = _chunk_logprobs(head, h, targets, 0.7, False, (banned, -100.0))
        logits = head(h).float()
        logits[:, list(banned)] += -100.0
        expect = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
        plain, _ = _chunk_logprobs(head, h, targets, 0.7, False)
    assert torch.equal(lp, expect)
    assert not torch.equal(lp, plain)  # the banned tokens' mass is gone, as in the engine's distribution


# --- the policy's routing -------------------------------------------------------------------------------------------
def test_policy_routing_keeps_logprobs_and_runs_the_exact_paths(tiny_model, monkeypatch):
    from grpo.config import ModelConfig
    from models.packing import pack, unpack_per_sequence
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_packing import mixed_batch

    init_distributed()
    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims())
    batch = mixed_batch(policy.adapter)
    mb = pack(batch, list(range(len(batch))))
    with torch.no_grad():
        before = unpack_per_sequence(policy.logprobs(mb)[0], mb)
    seen = {"attention": 0, "vision": 0}
    original = attention.reference_attention

    def counted(*a, **kw):
        seen["attention"] += 1
        return original(*a, **kw)

    monkeypatch.setattr(attention, "reference_attention", counted)
    from transformers.integrations import sdpa_attention

    original_sdpa = sdpa_attention.sdpa_attention_forward

    def counted_sdpa(*a, **kw):
        seen["vision"] += 1
        return original_sdpa(*a, **kw)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", counted_sdpa)
    mode = exact.ExactMode(policy.adapter.name)  # no banned tokens: only the routing changes
    mode.apply_to_policy(policy)
    assert mode.report["policy"]["rms_norm"] > 0 and mode.report["policy"]["text_rope"] == 1
    assert mode.report["policy"]["patch_embed"] == 1
    layers = len(policy.adapter.decoder_layers(policy.model))
    assert mode.report["policy"]["fused_qkv"] == layers  # the vision tower's qkv is one layer already
    assert mode.report["policy"]["fused_gate_up"] >= layers
    # every other linear layer runs the engine's GEMM: o_proj and down_proj of each decoder layer, the vision
    # blocks' qkv, proj and down_proj, the merger's two, lm_head
    depth = len(policy.adapter.vision_tower(policy.model).blocks)
    assert mode.report["policy"]["linear"] == 2 * layers + 3 * depth + 2 + 1
    assert "forward" in policy.adapter.lm_head(policy.model).__dict__
    assert policy.adapter.vision_tower(policy.model).config._attn_implementation == exact.VISION_ATTENTION_NAME
    assert policy.model.config.get_text_config()._attn_implementation == exact.ATTENTION_NAME
    with torch.no_grad():
        after = unpack_per_sequence(policy.logprobs(mb)[0], mb)
    assert seen["attention"] == layers and seen["vision"] > 0
    for a, b in zip(before, after):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()


# --- the engine's side ----------------------------------------------------------------------------------------------
def _fake_vllm(monkeypatch, captured):
    class RMSNorm:
        def forward_cuda(self, x, residual=None):
            return "fused kernel"

        forward_native = forward_cuda

    class SiluAndMul(RMSNorm):
        pass

    class MRotaryEmbedding:
        def forward_native(self, positions, query, key=None):
            return "native"

        def forward_cuda(self, positions, query, key=None):
            return "triton"

    class LLM:
        def __init__(self, **kwargs):
            captured.update(kwargs)

    modules = {"vllm": types.ModuleType("vllm"), "vllm.model_executor": types.ModuleType("vllm.model_executor"),
               "vllm.model_executor.layers": types.ModuleType("vllm.model_executor.layers")}
    for name, cls in (("layernorm", RMSNorm), ("activation", SiluAndMul), ("rotary_embedding", MRotaryEmbedding)):
        mod = types.ModuleType(f"vllm.model_executor.layers.{name}")
        setattr(mod, cls.__name__, cls)
        modules[mod.__name__] = mod
    modules["vllm"].LLM = LLM
    models = types.ModuleType("vllm.model_executor.models")
    qwen = types.ModuleType("vllm.model_executor.models.qwen2_5_vl")
    qwen.Qwen2_5_VisionPatchEmbed = type("Qwen2_5_VisionPatchEmbed", (), {"forward": lambda self, x: "linear"})
    qwen.apply_rotary_pos_emb_vision = lambda t, freqs, fn=None: "flash_attn rotary"
    models.qwen2_5_vl = qwen
    modules.update({models.__name__: models, qwen.__name__: qwen})
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return RMSNorm, SiluAndMul, MRotaryEmbedding


def test_patch_vllm_routes_the_custom_ops(monkeypatch):
    rms, silu, rope = _fake_vllm(monkeypatch, {})
    report = {}
    exact.patch_vllm(report)
    assert report.pop("linear").startswith("UnquantizedLinearMethod not readable")  # no linear module in the fake
    assert exact.ENGINE_LINEAR["path"] == "batch_invariant"
    assert report == {"RMSNorm": "routed to torch code", "SiluAndMul": "routed to torch code",
                      "MRotaryEmbedding": "forward_cuda -> forward_native",
                      "ApplyRotaryEmb": "not found in vllm.model_executor.layers.rotary_embedding.common",
                      "Qwen2_5_VisionPatchEmbed": "routed to torch code",
                      "apply_rotary_pos_emb_vision": "routed to torch code"}
    qwen = sys.modules["vllm.model_executor.models.qwen2_5_vl"]
    assert qwen.apply_rotary_pos_emb_vision is exact._engine_vision_rope
    assert qwen.Qwen2_5_VisionPatchEmbed.forward is exact._engine_patch_embed
    norm = rms()
    norm.weight, norm.variance_epsilon = torch.ones(4), 1e-6
    x = torch.randn(2, 4)
    assert torch.equal(norm.forward_cuda(x), exact.rms_norm(x, norm.weight, 1e-6))
    assert rope().forward_cuda(None, None) == "native"
    monkeypatch.delitem(sys.modules, "vllm.model_executor.layers.activation")
    report = {}
    exact.patch_vllm(report)
    assert report["SiluAndMul"].startswith("not found")


class _BatchInvariantLinearMethod:  # vLLM 0.26's UnquantizedLinearMethod.apply, as read by _engine_linear_path
    def apply(self, layer, x, bias=None):
        return "linear_batch_invariant(x, layer.weight, bias)"


class _TorchLinearMethod:
    def apply(self, layer, x, bias=None):
        return "dispatch_unquantized_gemm()(layer, x, layer.weight, bias)"


@pytest.mark.parametrize("method,path", [(_BatchInvariantLinearMethod, "batch_invariant"), (_TorchLinearMethod, "torch")])
def test_policy_linear_follows_the_engines_linear_method(monkeypatch, method, path):
    """exact_linear takes vLLM's batch-invariant GEMM where the engine's linear layers call it, F.linear where not;
    off CUDA it is F.linear either way."""
    monkeypatch.setitem(exact.ENGINE_LINEAR, "path", "batch_invariant")
    linear = types.ModuleType("vllm.model_executor.layers.linear")
    linear.UnquantizedLinearMethod = method
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.linear", linear)
    assert (path == "batch_invariant") == ("linear_batch_invariant on both sides" in exact._engine_linear_path())
    assert exact.ENGINE_LINEAR["path"] == path
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    assert torch.equal(exact.exact_linear(x, w, b), F.linear(x, w, b))


def test_engine_linear_forward_is_vllms_and_backward_is_linears(monkeypatch):
    """_EngineLinear returns vLLM's linear_batch_invariant bits (here a stand-in that adds the bias after the
    product, rounded to bf16 in between as vLLM's does) and the gradients of x·Wᵀ + b."""
    def batch_invariant(x, w, bias=None):
        out = (x @ w.t()).to(torch.bfloat16).to(x.dtype)
        return out if bias is None else out + bias

    monkeypatch.setattr(exact, "_engine_linear_fn", lambda: batch_invariant)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    out = exact._EngineLinear.apply(x, w, b)
    assert torch.equal(out, batch_invariant(x, w, b))
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (x, w, b), upstream)
    expect = torch.autograd.grad(F.linear(x, w, b), (x, w, b), upstream)
    assert all(torch.allclose(a, e) for a, e in zip(grads, expect))


def test_exact_switches_reach_the_llm_constructor(monkeypatch, tiny_model):
    from rollout.vllm_engine import VLLMEngine

    captured = {}
    _fake_vllm(monkeypatch, captured)
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.__dict__.update(_world=1, _processor_cache_gb=0.0, max_images_per_prompt=1, max_videos_per_prompt=0,
                           _async_scheduling=None, _max_num_seqs=64, _routing=False,
                           _exact=exact.ExactMode("qwen2_5_vl"))
    engine.adapter = types.SimpleNamespace(vllm_processor_kwargs=lambda a, b: {}, vllm_engine_kwargs=lambda: {})
    monkeypatch.setattr(VLLMEngine, "_kv_cache_kwargs", lambda self, *a: {})
    engine._build_llm(str(tiny_model), 1, 0.3, True, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["attention_config"] == {"backend": "FLASH_ATTN"}
    assert captured["mm_encoder_attn_backend"] == "TORCH_SDPA"
    assert captured["enable_prefix_caching"] is False and captured["enable_chunked_prefill"] is False
    assert captured["max_num_batched_tokens"] >= 4096 and captured["block_size"] == attention.KV_BLOCK
    assert captured["enforce_eager"] is True and "compilation_config" not in captured
    assert captured["disable_cascade_attn"] is True
    # a vLLM whose EngineArgs lacks a switch: left out and named, the backend through attention_backend
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    import dataclasses

    arg_utils.EngineArgs = dataclasses.make_dataclass("EngineArgs", ["attention_backend", "block_size",
                                                                     "enable_prefix_caching", "max_num_batched_tokens"])
    monkeypatch.setitem(sys.modules, "vllm.engine", types.ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
    config = types.ModuleType("vllm.config")  # a vLLM that names the compilation switch `level`
    config.CompilationConfig = dataclasses.make_dataclass("CompilationConfig", ["level", "cudagraph_mode"])
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    mode = exact.ExactMode("qwen2_5_vl")
    assert mode.engine_kwargs(4096) == {"attention_backend": "FLASH_ATTN", "block_size": attention.KV_BLOCK,
                                        "enable_prefix_caching": False, "max_num_batched_tokens": 16384}
    assert mode.report["engine_kwargs_dropped"] == ["compilation_config", "disable_cascade_attn",
                                                    "enable_chunked_prefill", "mm_encoder_attn_backend"]
    arg_utils.EngineArgs = dataclasses.make_dataclass("EngineArgs", ["attention_config", "compilation_config"])
    assert mode.engine_kwargs(4096) == {"attention_config": {"backend": "FLASH_ATTN"},
                                        "compilation_config": {"level": 0, "cudagraph_mode": "NONE"}}
    captured.clear()
    engine._exact = None
    engine._build_llm(str(tiny_model), 1, 0.3, False, 4096, 0, "bfloat16", 3136, 12544)
    assert "attention_config" not in captured and "enable_prefix_caching" not in captured
    engine._attention_backend = "TRITON_ATTN"  # rollout.attention_backend, the non-exact lever
    engine._build_llm(str(tiny_model), 1, 0.3, False, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["attention_config"] == {"backend": "TRITON_ATTN"}


def _engine_building_with(monkeypatch, captured: dict, mode):
    """A VLLMEngine shell whose `_build_llm` hands its `LLM(...)` arguments to `captured`, under a vLLM whose
    CompilationConfig names `mode` and `cudagraph_mode`, with exact mode `mode` (or None)."""
    import dataclasses

    from rollout.vllm_engine import VLLMEngine

    config = types.ModuleType("vllm.config")
    config.CompilationConfig = dataclasses.make_dataclass("CompilationConfig", ["mode", "cudagraph_mode"])
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    _fake_vllm(monkeypatch, captured)
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.__dict__.update(_world=1, _processor_cache_gb=0.0, max_images_per_prompt=1, max_videos_per_prompt=0,
                           _async_scheduling=None, _max_num_seqs=60, _routing=False, _exact=mode)
    engine.adapter = types.SimpleNamespace(vllm_processor_kwargs=lambda a, b: {}, vllm_engine_kwargs=lambda: {})
    monkeypatch.setattr(VLLMEngine, "_kv_cache_kwargs", lambda self, *a: {})
    return engine


def test_exact_cuda_graphs_capture_decode_steps_without_compiling(monkeypatch, tiny_model):
    """rollout.exact_cuda_graphs: graphs for decode steps only (no compilation), sized to the batch; the config key
    reaches the engine's mode."""
    from grpo.config import load_config

    captured = {}
    engine = _engine_building_with(monkeypatch, captured, exact.ExactMode("qwen2_5_vl", cuda_graphs=True))
    engine._build_llm(str(tiny_model), 1, 0.3, False, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["enforce_eager"] is False and captured["max_num_seqs"] == 64
    assert captured["compilation_config"] == {"max_cudagraph_capture_size": 64, "mode": 0,
                                              "cudagraph_mode": "FULL_DECODE_ONLY"}
    engine._exact = exact.ExactMode("qwen2_5_vl")  # the mode as measured: eager, nothing captured
    captured.clear()
    engine._build_llm(str(tiny_model), 1, 0.3, True, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["compilation_config"] == {"mode": 0, "cudagraph_mode": "NONE"}
    cfg = load_config(None, ["rollout.exact=true", "rollout.exact_cuda_graphs=true"])
    assert cfg.rollout.exact_cuda_graphs is True
    for bad, named in ((["rollout.exact_cuda_graphs=true"], "without rollout.exact"),
                       (["rollout.exact=true", "rollout.exact_cuda_graphs=true", "rollout.enforce_eager=true"],
                        "rollout.enforce_eager")):
        with pytest.raises(ValueError, match=named):
            load_config(None, bad)


def test_engine_compile_false_builds_decode_graphs_without_compiling(monkeypatch, tiny_model):
    """rollout.engine_compile=false: vLLM's compilation off and its decode steps from CUDA graphs sized to the batch;
    none under enforce_eager; the default leaves vLLM's compilation alone; exact mode's own settings win."""
    from grpo.config import load_config

    captured = {}
    engine = _engine_building_with(monkeypatch, captured, None)
    engine._build_llm(str(tiny_model), 1, 0.3, False, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["compilation_config"] == {"max_cudagraph_capture_size": 64}  # the default: vLLM compiles
    engine._compile = False
    engine._build_llm(str(tiny_model), 1, 0.3, False, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["compilation_config"] == {"max_cudagraph_capture_size": 64, "mode": 0,
                                              "cudagraph_mode": "FULL_DECODE_ONLY"}
    captured.clear()
    engine._build_llm(str(tiny_model), 1, 0.3, True, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["enforce_eager"] is True and captured["compilation_config"] == {"mode": 0, "cudagraph_mode": "NONE"}
    engine._exact = exact.ExactMode("qwen2_5_vl")
    captured.clear()
    engine._build_llm(str(tiny_model), 1, 0.3, True, 4096, 0, "bfloat16", 3136, 12544)
    assert captured["compilation_config"] == {"mode": 0, "cudagraph_mode": "NONE"}
    assert load_config(None, []).rollout.engine_compile is True
    assert load_config(None, ["rollout.engine_compile=false"]).rollout.engine_compile is False


def test_vllm_paged_attention_builds_and_keeps_logprobs(tiny_model):
    from grpo.config import ModelConfig
    from models.packing import pack
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_packing import mixed_batch

    init_distributed()
    lps = []
    for attn in ("auto", "vllm_paged"):  # off CUDA vllm_paged is SDPA per sequence; the vision tower keeps SDPA
        policy = build_policy(ModelConfig(path=str(tiny_model), attn_implementation=attn), build_parallel_dims())
        batch = mixed_batch(policy.adapter)
        with torch.no_grad():
            lps.append(policy.logprobs(pack(batch, list(range(len(batch)))))[0])
    assert torch.allclose(lps[0], lps[1], atol=1e-5, rtol=0), (lps[0] - lps[1]).abs().max()


# --- the measuring tool ---------------------------------------------------------------------------------------------
def test_logprob_check_reports_the_exact_rows_keys_and_timings(tiny_model):
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from rollout.base import Generation
    from tests.test_packing import mixed_batch
    from tools import logprob_check

    init_distributed()
    gens = [Generation(0, [5, 6, 7], [-1.0, -2.0, -0.5], "length"), Generation(0, [8, 9], [-3.0, -0.25], "stop")]
    policy_lp = [torch.tensor([-1.0, -2.5, -0.5]), torch.tensor([-3.0, -0.25])]
    trainer = types.SimpleNamespace(tokenizer=types.SimpleNamespace(decode=lambda ids: "x"), engine=object(),
                                    policy=types.SimpleNamespace(dtype=torch.float32))
    args = types.SimpleNamespace(worst=2, png=None, packing="packed")
    report = logprob_check._report(trainer, gens, policy_lp, None, args, 0.5)
    assert report["max_abs_dlogprob"] == 0.5
    assert report["token_mult_prob_error_median"] == report["token_mult_prob_error"]["median"]
    assert report["token_mult_prob_error_max"] == report["token_mult_prob_error"]["max"] > 1.0

    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims())
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    trainer = types.SimpleNamespace(policy=policy, optimizer=optimizer)
    seconds = logprob_check._train_pass_s(trainer, mixed_batch(policy.adapter), 4096, 1.0)
    assert seconds > 0 and all(p.grad is None for p in policy.model.parameters())


def test_policy_logprobs_take_the_engines_values_forward_and_torchs_gradient():
    from models.policy import _chunk_logprobs

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=False)
    h = torch.randn(5, 8, generator=g, requires_grad=True)
    targets = torch.tensor([1, 4, 7, 0, 19])
    bias = ((3, 5), exact.BAN_BIAS)
    plain, _ = _chunk_logprobs(head, h, targets, 0.7, False, bias)
    (grad_plain,) = torch.autograd.grad(plain.sum(), h)
    seen = {}

    def engine(raw, t, temperature):  # stands in for vLLM's kernels: the raw logits in, other bits out
        seen.update(raw=raw, temperature=temperature)
        return (plain.detach() + 1e-3).to(torch.float32)

    routed, _ = _chunk_logprobs(head, h, targets, 0.7, False, bias, engine)
    (grad_routed,) = torch.autograd.grad(routed.sum(), h)
    assert torch.equal(routed.detach(), plain.detach() + 1e-3)  # the engine's values forward
    assert torch.equal(grad_routed, grad_plain)  # torch's log_softmax gradient backward
    assert seen["temperature"] == 0.7 and torch.equal(seen["raw"], head(h))  # logits before bias and temperature


def test_v2_token_logprobs_prepares_logits_as_vllms_sampler(monkeypatch):
    import sys
    import types

    calls = {}

    def apply_temperature(logits, rows, temperature):
        calls["temperature"] = (logits.dtype, rows.tolist(), temperature.tolist())
        logits.copy_((logits.float() / temperature[0]).to(logits.dtype))

    def compute_token_logprobs(logits, ids):
        calls["logprobs"] = (logits.clone(), ids.dtype, tuple(ids.shape))
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids)

    modules = {"vllm.v1.worker.gpu.sample.gumbel": types.SimpleNamespace(apply_temperature=apply_temperature),
               "vllm.v1.worker.gpu.sample.logprob": types.SimpleNamespace(compute_token_logprobs=compute_token_logprobs)}
    for name in ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.sample"):
        modules.setdefault(name, types.ModuleType(name))
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    logits = (torch.randn(3, 10) * 4).to(torch.bfloat16)
    targets = torch.tensor([2, 5, 9])
    out = exact.v2_token_logprobs(logits, targets, 1.0, (5,), exact.BAN_BIAS)
    processed, dtype, shape = calls.pop("logprobs")
    assert "temperature" not in calls  # vLLM skips the kernel at temperature 1
    assert processed.dtype == torch.bfloat16 and dtype == torch.int64 and shape == (3, 1)
    assert torch.equal(processed[:, 5], (logits[:, 5].float() - 100.0).to(torch.bfloat16))  # biased, stored back
    assert torch.equal(processed[:, :5], logits[:, :5]) and out.shape == (3,)
    exact.v2_token_logprobs(logits, targets, 0.5, (), exact.BAN_BIAS)
    assert calls["temperature"] == (torch.bfloat16, [0, 0, 0], [0.5])
    mode = exact.ExactMode("qwen2_5_vl", banned_token_ids=(5,))
    assert mode.engine_logprobs(logits, targets, 1.0) is None  # on CPU the policy's own log_softmax stands


def test_exact_refuses_heads_the_attention_kernel_tiles_differently_per_step():
    """On compute capability 9.x, vLLM's FlashAttention sums a decode step's keys in other blocks than a
    prefill's for heads of 64 or less: the mode refuses them there, names the width and the way out."""
    import transformers

    with pytest.raises(ValueError, match=r"heads are 16 wide.*tiny_hd128"):
        exact.check_head_size(16, (9, 0))
    with pytest.raises(ValueError, match="64 wide"):
        exact.check_head_size(64, (9, 0))
    exact.check_head_size(128, (9, 0))  # the released Qwen2.5-VL width
    exact.check_head_size(256, (9, 0))
    exact.check_head_size(16, (8, 0))  # not the kernel measured
    config = transformers.Qwen2_5_VLConfig(text_config={"hidden_size": 256, "num_attention_heads": 2})
    assert exact.text_head_dim(config) == 128
