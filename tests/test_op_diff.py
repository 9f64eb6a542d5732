"""tools/op_diff.py on the tiny Qwen2.5-VL in fp32: the policy and the built-in engine agree at every module it
captures, a weight changed in the engine only is reported first at its own decoder layer's MLP, and one changed in
its vision tower shows at the language model's input on image tokens only."""

import json

import pytest
import torch

from models.parallel import init_distributed
from tools.op_diff import _ForwardTap, _parse, first_over, op_diff

LAYER_PARTS = ("input_layernorm[input]", "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
               "self_attn.o_proj[input]", "self_attn.o_proj", "post_attention_layernorm", "mlp")


def run(tiny_model, clevr_parquet, run_dir, *extra) -> dict:
    init_distributed()
    return op_diff(_parse([
        "--model", str(tiny_model), "--data", str(clevr_parquet), "--engine", "torch", "--dtype", "float32",
        "--num-prompts", "2", "--n", "2", "--max-new-tokens", "8", "--temperature", "0.8",
        "--set", f"trainer.run_dir={run_dir}", *extra,
    ]))


def test_policy_and_torch_engine_agree_at_every_module(tiny_model, clevr_parquet, tmp_path):
    report = run(tiny_model, clevr_parquet, tmp_path / "run")
    config = json.loads((tiny_model / "config.json").read_text())
    layers, depth = config["text_config"]["num_hidden_layers"], config["vision_config"]["depth"]
    names = [r["name"] for r in report["modules"]]
    expected = ["model.visual.patch_embed", *[f"model.visual.blocks.{i}" for i in range(depth)], "model.visual.merger",
                "model.language_model.embed_tokens", "model.language_model.norm", "lm_head", "logprobs"]
    for i in range(layers):
        layer = f"model.language_model.layers.{i}"
        expected += [layer, *[f"{layer}.{part}" for part in LAYER_PARTS]]
    assert sorted(names) == sorted(expected)
    # forward order: each layer's parts before the layer itself, the layers in turn, then the head
    assert names.index("model.visual.merger") < names.index("model.language_model.layers.0.input_layernorm")
    assert names.index("model.language_model.layers.0.mlp") < names.index("model.language_model.layers.0") \
        < names.index("model.language_model.layers.1.input_layernorm")
    assert names[-3:] == ["model.language_model.norm", "lm_head", "logprobs"]
    assert report["sequences"] == 4 and report["scored_tokens"] > 0 and report["engine"] == "TorchEngine"
    for row in report["modules"]:  # every module captured on both sides with the same shape, and close
        assert row["max_abs"] < 1e-4 and row["rel_l2"] < 1e-5, row
    assert report["modules"][0]["bitwise"]  # the embedding lookup is exact
    assert first_over(report["modules"], 1e-4) is None
    assert report["generation_logprobs"]["max_abs"] < 1e-5  # the engine's KV-cache decoding agrees too


@pytest.mark.parametrize("layer", [0, 1])
def test_engine_only_weight_change_is_found_at_that_layers_mlp(tiny_model, clevr_parquet, tmp_path, layer):
    weight = f"model.language_model.layers.{layer}.mlp.down_proj.weight"
    report = run(tiny_model, clevr_parquet, tmp_path / "run", "--random-responses", "--tol", "1e-4",
                 "--perturb-engine", f"{weight}=1e-2")
    target = f"model.language_model.layers.{layer}.mlp"
    assert report["first_over_tol"] == target
    names = [r["name"] for r in report["modules"]]
    at = names.index(target)
    assert all(r["max_abs"] <= 1e-4 for r in report["modules"][:at])
    assert report["modules"][at]["max_abs"] > 1e-3 and not report["modules"][at]["bitwise"]
    assert report["modules"][-1]["name"] == "logprobs" and report["modules"][-1]["max_abs"] > 1e-4
    assert "generation_logprobs" not in report  # random responses: no generation to compare


def test_engine_only_vision_change_shows_on_image_tokens_only(tiny_model, clevr_parquet, tmp_path):
    report = run(tiny_model, clevr_parquet, tmp_path / "run", "--random-responses", "--tol", "1e-4",
                 "--perturb-engine", "model.visual.merger.mlp.2.weight=1e-2")
    assert report["first_over_tol"] == "model.visual.merger"
    row = next(r for r in report["modules"] if r["name"] == "model.language_model.layers.0.input_layernorm[input]")
    assert row["max_abs_image"] > 1e-3 and row["max_abs_text"] == 0.0, row
    patches = next(r for r in report["modules"] if r["name"] == "model.visual.patch_embed")
    assert "max_abs_image" not in patches and patches["bitwise"]  # vision rows are not split by token kind


def test_forward_tap_sees_a_module_whose_call_skips_hooks():
    import torch

    class Decorated(torch.nn.Linear):  # as vLLM's torch.compile decorator, when not compiling
        do_not_compile = True

        def __call__(self, *args, **kwargs):
            return self.forward(*args, **kwargs)

    m = Decorated(3, 2)
    seen = []
    m.register_forward_hook(lambda mod, args, out: seen.append("hook"))
    tap = _ForwardTap(m, lambda mod, args, kwargs, out: seen.append(out.shape))
    out = m(torch.ones(4, 3))
    assert seen == [torch.Size([4, 2])]  # the plain hook never fired; the tap did
    tap.remove()
    assert torch.equal(m(torch.ones(4, 3)), out) and len(seen) == 1 and "forward" not in m.__dict__
    routed = lambda x: x * 2  # noqa: E731 (a forward set on the instance, as exact mode routes modules)
    m.forward = routed
    _ForwardTap(m, lambda *a: None).remove()
    assert m.forward is routed  # the tap puts the instance's own forward back


def test_vllm_side_reads_a_norms_input_before_its_in_place_kernel():
    """Eager vLLM (no torch.compile) runs a decoder norm with a residual through its fused add + RMSNorm kernel, which
    writes the normalized output into x and the sum into residual in place: the captured input is the sum as it was
    before the call, and the output is the normalized value."""
    import torch

    from tools.op_diff import Probe, _VLLMSide

    class FusedAddNorm(torch.nn.Module):  # vllm_c's fused_add_rms_norm: both arguments overwritten
        def forward(self, x, residual):
            residual.add_(x)
            x.copy_(residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6))
            return x, residual

    model = torch.nn.Module()
    model.norm = FusedAddNorm()
    side = object.__new__(_VLLMSide)
    side.probes = [Probe("layers.1.input_layernorm[input]", None, "token", True),
                   Probe("layers.1.input_layernorm", None, "token")]
    side.paths = {p.name: "norm" for p in side.probes}
    captured = {}
    handles = side._hook(model, captured)
    x, residual = torch.randn(5, 8), torch.randn(5, 8)
    total = x + residual
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
    model.norm(x, residual)
    for h in handles:
        h.remove()
    assert torch.equal(captured["layers.1.input_layernorm[input]"][0], total.reshape(1, 5, 8))
    assert torch.allclose(captured["layers.1.input_layernorm"][0], normed.reshape(1, 5, 8))


# --- the kernel probes (--kernels), with stand-in kernels on the CPU ------------------------------------------
def _row_linear(x, w, b=None, bump_below: int = 0):
    """F.linear one row at a time (so every row count gives the same bits); rows of a call with fewer than
    `bump_below` rows are moved by 1, as a kernel that changes with the row count would."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.stack([w @ r + (b if b is not None else 0) for r in rows])
    if rows.shape[0] < bump_below:
        out = out + 1
    return out.reshape(*x.shape[:-1], w.shape[0])


def test_gemm_row_probe_names_the_row_counts_that_change_the_bits():
    from tools.op_diff import gemm_row_probe

    kw = {"rows": (1, 2, 3, 7, 33), "total": 64, "device": "cpu", "dtype": torch.float32}
    assert gemm_row_probe(16, 8, True, linear=_row_linear, **kw)["bitwise"]
    report = gemm_row_probe(16, 8, False, linear=lambda x, w, b: _row_linear(x, w, b, bump_below=4), **kw)
    assert not report["bitwise"]
    assert sorted({d["rows"] for d in report["differs"]}) == [1, 2, 3]
    assert {(d["start"], d["three_d"]) for d in report["differs"]} == {(0, False), (1, False), (0, True)}


def _paged_kernel(q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal, block_table,
                  num_splits, decode_bump: int = 0, **extra):
    """vLLM's paged varlen call in torch, one query row at a time (its bits do not depend on the batch): query rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] attend to the first seqused_k[i] keys of block_table[i], causally with the
    last query on the last key. With `decode_bump`, a pure decode call (max_seqlen_q 1) moves the rows whose
    context is longer than decode_bump keys, as FlashAttention tiling decode otherwise than prefill would."""
    assert causal and num_splits == 1
    block, rep = k.shape[1], q.shape[1] // k.shape[2]
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        a, b, used = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        slots = (block_table[i].long()[:, None] * block + torch.arange(block)).reshape(-1)[:used]
        keys, values = (t.reshape(-1, *t.shape[2:])[slots].repeat_interleave(rep, dim=1) for t in (k, v))
        for r in range(a, b):
            seen = used - (b - 1 - r)
            weights = torch.softmax(torch.einsum("hd,khd->hk", q[r], keys[:seen]) * softmax_scale, dim=-1)
            out[r] = torch.einsum("hk,khd->hd", weights, values[:seen])
            if decode_bump and max_seqlen_q == 1 and seen > decode_bump:
                out[r] += 1e-2
    return out


def test_decode_layout_gives_each_tokens_sequence_and_position():
    from tools.op_diff import decode_layout

    seq, pos = decode_layout(torch.tensor([0, 2, 5, 6]))
    assert seq.tolist() == [0, 0, 1, 1, 1, 2] and pos.tolist() == [0, 1, 0, 1, 2, 0]


def test_attention_probe_compares_prefill_with_decode_and_mixed_steps():
    from tools.op_diff import attention_probe

    kw = {"lengths": (5, 20, 40), "device": "cpu", "dtype": torch.float32}
    report = attention_probe(4, 2, 8, kernel=_paged_kernel, **kw)
    for way in ("pure_decode", "mixed_step", "prompt_prefill"):
        assert report[way]["bitwise"] and report[way]["first_differing_position"] == [None, None, None]
    # decode summing differently past 16 keys of context: pure decode steps differ from position 16 on, and
    # only in the sequences that long; a mixed step (the prefill's call) does not
    bumped = attention_probe(4, 2, 8, kernel=lambda *a, **k: _paged_kernel(*a, decode_bump=16, **k), **kw)
    assert not bumped["pure_decode"]["bitwise"]
    assert bumped["pure_decode"]["first_differing_position"] == [None, 16, 16]
    assert bumped["pure_decode"]["tokens_differing"] == (20 - 16) + (40 - 16)
    assert bumped["mixed_step"]["bitwise"] and bumped["prompt_prefill"]["bitwise"]
    # a prefill whose bits depend on how long its keys run: the prompts' rows differ, from their first position
    cut = attention_probe(4, 2, 8, kernel=lambda *a, **k: _paged_kernel(*a, **k) + (k["max_seqlen_q"] < 40) * 1e-3,
                          **kw)
    assert cut["prompt_prefill"]["first_differing_position"] == [0, 0, 0]
    assert cut["prompt_prefill"]["tokens_differing"] == 3 + 15 + 30


def test_format_probes_names_what_is_not_bitwise():
    from tools.op_diff import attention_probe, format_probes, gemm_pair_probe, gemm_row_probe

    cpu = {"device": "cpu", "dtype": torch.float32}
    good = gemm_row_probe(16, 8, True, rows=(1, 3), total=16, linear=_row_linear, **cpu)
    bad = gemm_row_probe(16, 8, True, rows=(1, 3), total=16, linear=lambda x, w, b: _row_linear(x, w, b, 2), **cpu)
    pair = gemm_pair_probe(16, 8, _row_linear, lambda x, w, b: _row_linear(x, w, None) + b, rows=4, **cpu)
    assert pair["zero_bias"]["bitwise"]
    report = {"device": "cpu", "torch": torch.__version__, "all_bitwise": False,
              "gemm": {"a": good}, "gemm_engine": {"a": bad}, "engine_vs_cublas": {"a": pair},
              "attention": {"x": attention_probe(2, 1, 8, lengths=(3, 5), kernel=_paged_kernel, **cpu)}}
    text = format_probes(report)
    assert "gemm cuBLAS a" in text and "bitwise for every row count" in text
    assert "gemm vLLM   a" in text and "NOT bitwise at rows 1, 1@1, 1 3-D" in text
    assert "attention x" in text and "pure_decode bitwise" in text
