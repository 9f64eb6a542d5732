"""Qwen3.5 on a tiny checkpoint: what is particular to it beyond tests/test_families.py.

Its Gated DeltaNet layers must restart their convolution and recurrent state at every sequence of a
packed row (logprobs and gradients of a packed row equal those of each sequence alone), its
positions must be the model's own (`Qwen3_5Model.get_rope_index`), its weight names vLLM's
(`Qwen3_5ForConditionalGeneration`: in_proj_qkvz and in_proj_ba stacked), and its prompts collapse
to one `<|image_pad|>` per image, which vLLM's Qwen3-VL processor replaces with the run.
"""

import json
import re
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grpo.config import ModelConfig
from models.packing import pack, unpack_per_sequence
from models.parallel import build_parallel_dims, full_value, init_distributed
from models.policy import build_policy
from rollout.base import Generation
from rollout.weight_names import ExpertShard, vllm_param_for
from tests.test_families import _prompts
from tests.test_torch_engine import generation_batch


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "tiny", family="qwen3_5", size="tiny", seed=0)


@pytest.fixture(scope="module")
def moe_folder(tiny_moe_model):
    return tiny_moe_model


def _policy(folder, activation_checkpointing=False):
    init_distributed()
    return build_policy(ModelConfig(path=str(folder), dtype="float32", attn_implementation="sdpa",
                                    activation_checkpointing=activation_checkpointing), build_parallel_dims())


def _generations():
    """Responses of different lengths after two image prompts of different sizes and a text-only one."""
    g = torch.Generator().manual_seed(0)
    lengths = [9, 23, 5, 70, 14, 3]
    return [Generation(i % 3, torch.randint(10, 1400, (n,), generator=g).tolist(), [0.0] * n, "length")
            for i, n in enumerate(lengths)]


def _logprobs_and_grads(policy, batch, bins):
    """Logprobs per sequence and the gradient of a weighted sum of them, one micro-batch per bin."""
    policy.model.zero_grad(set_to_none=True)
    out = {}
    for b in bins:
        mb = pack(batch, b)
        lp, _ = policy.logprobs(mb)
        per_seq = unpack_per_sequence(lp, mb)
        # A weight per token that depends only on its sequence and place, however the bins fall.
        sum((t * torch.linspace(-1.0, 1.0, t.numel()) * (1 + i)).sum() for i, t in zip(b, per_seq)).backward()
        out.update(zip(b, (t.detach() for t in per_seq)))
    grads = {n: full_value(p.grad).detach().clone() for n, p in policy.model.named_parameters()
             if p.grad is not None}
    return [out[i] for i in sorted(out)], grads


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_packed_row_equals_each_sequence_alone(family, request, monkeypatch):
    folder = request.getfixturevalue("folder" if family == "qwen3_5" else "moe_folder")
    policy = _policy(folder)
    prompts, gens = _prompts(folder), _generations()
    batch = generation_batch(policy.adapter, prompts, gens)
    everything = [list(range(len(gens)))]
    alone = [[i] for i in range(len(gens))]
    packed_lp, packed_grad = _logprobs_and_grads(policy, batch, everything)
    single_lp, single_grad = _logprobs_and_grads(policy, batch, alone)
    assert (torch.cat(packed_lp) - torch.cat(single_lp)).abs().max().item() < 1e-5
    linear = [n for n in packed_grad if ".linear_attn." in n]
    assert linear and set(packed_grad) == set(single_grad)
    for name in packed_grad:
        assert torch.allclose(packed_grad[name], single_grad[name], rtol=1e-4, atol=1e-5), name
    # Activation checkpointing recomputes each layer in backward, after the packed row's block closed.
    recomputed = _policy(folder, activation_checkpointing=True)
    _, recomputed_grad = _logprobs_and_grads(recomputed, batch, everything)
    for name in packed_grad:
        assert torch.allclose(recomputed_grad[name], single_grad[name], rtol=1e-4, atol=1e-5), name
    # Without the packed path, transformers' layer carries state across sequences: the row differs.
    from models.families import qwen3_5

    monkeypatch.setattr(qwen3_5, "apply_packed_linear_attention", lambda decoder: None)
    plain = _policy(folder)
    plain_lp, _ = _logprobs_and_grads(plain, batch, everything)
    assert (torch.cat(plain_lp) - torch.cat(single_lp)).abs().max().item() > 1e-4  # 10x the packed path's bound above


def test_the_restarting_convolution_is_each_sequences_own():
    from models.families.qwen3_5 import _position_in_sequence, restarting_causal_conv

    g = torch.Generator().manual_seed(1)
    lengths = [1, 5, 2, 9]
    x = torch.randn(6, sum(lengths), generator=g)
    w = torch.randn(6, 4, generator=g)
    bias = torch.randn(6, generator=g)
    cu = torch.tensor([0, 1, 6, 8, 17], dtype=torch.int32)
    ours = restarting_causal_conv(x, w, bias, _position_in_sequence(cu, x.shape[1]))
    theirs = torch.cat([F.conv1d(s[None], w[:, None], bias, padding=3, groups=6)[0, :, : s.shape[1]]
                        for s in x.split(lengths, dim=1)], dim=1)
    assert torch.allclose(ours, theirs, atol=1e-6)


def _vllm_conv_silu(x, w, lengths):
    """vLLM 0.26's Triton causal convolution and SiLU (mamba/ops/causal_conv1d.py) on each sequence alone: each
    tap's product rounded to bf16, summed in fp32 from the oldest tap, acc / (1 + exp(-acc)), one rounding."""
    outs = []
    for s in x.split(lengths, dim=1):
        windows = F.pad(s.float(), (w.shape[1] - 1, 0)).unfold(1, w.shape[1], 1)  # (C, n, K), oldest tap first
        products = (windows * w.float()[:, None, :]).to(torch.bfloat16).float()
        acc = products[..., 0]
        for i in range(1, w.shape[1]):
            acc = acc + products[..., i]
        outs.append((acc / (1 + torch.exp(-acc))).to(torch.bfloat16))
    return torch.cat(outs, dim=1)


def test_packed_convolution_rounds_as_vllms_kernel():
    """In bf16 the torch path's convolution and SiLU round as vLLM's kernel does, not after every tap."""
    from models.families.qwen3_5 import packed_conv

    g = torch.Generator().manual_seed(2)
    lengths = [1, 40, 3, 200]
    x = torch.randn(64, sum(lengths), generator=g).to(torch.bfloat16)
    w = (torch.randn(64, 4, generator=g) / 2).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ours = packed_conv(x, w, None, "silu", cu)
    theirs = _vllm_conv_silu(x, w, lengths)
    assert ours.dtype == torch.bfloat16
    # exp and the division may differ in fp32's last bit on another CPU, flipping a rounding now and then;
    # rounding after every tap in bf16 (the torch path before) differs in 39% of these outputs
    assert (ours != theirs).float().mean().item() < 0.005


def test_packed_gated_norm_rounds_once_as_vllm():
    """In bf16 the gated RMSNorm outside fla rounds once, as vLLM's RMSNormGated does; transformers' module
    also rounds the normed input and its product with the weight."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    from models.families.qwen3_5 import gated_norm

    g = torch.Generator().manual_seed(3)
    norm = Qwen3_5RMSNormGated(128, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(torch.randn(128, generator=g) / 4)
    norm = norm.to(torch.bfloat16)
    x, gate = (torch.randn(500, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    # vLLM's RMSNormGated.forward_static (norm_before_gate): fp32 from the inputs on, rounded at the end
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    theirs = (normed * norm.weight.float() * F.silu(gate.float())).to(torch.bfloat16)
    assert torch.equal(gated_norm(norm, x, gate), theirs)
    assert not torch.equal(norm(x, gate), theirs)


def test_positions_are_the_models_own(folder):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from models.family import build_adapter

    adapter = build_adapter(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    prompt = _prompts(folder)[1]
    ids = torch.tensor(prompt.input_ids)
    ours = adapter.position_ids(ids, prompt.image_grid_thw)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(folder)))
    types = (ids == adapter.image_token_id).int().unsqueeze(0)
    theirs, _ = model.model.get_rope_index(ids.unsqueeze(0), types, prompt.image_grid_thw)
    assert torch.equal(ours[1:], theirs[:, 0].cpu()) and torch.equal(ours[0], torch.arange(ids.numel()))


def test_the_tiny_checkpoint(folder):
    config = json.loads((folder / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert text["layer_types"] == ["linear_attention", "full_attention"]
    # transformers 5.17 reads num_attention_heads, later versions num_heads.
    assert vision["num_heads"] == vision["num_attention_heads"] == 2
    processor = json.loads((folder / "processor_config.json").read_text())
    assert processor["processor_class"] == "Qwen3VLProcessor" and processor["image_processor"]["patch_size"] == 16


@pytest.mark.parametrize("hf_name, vllm_name, shard", [
    ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
     "language_model.model.layers.0.linear_attn.in_proj_qkvz.weight", (0, 1, 2)),
    ("model.language_model.layers.0.linear_attn.in_proj_z.weight",
     "language_model.model.layers.0.linear_attn.in_proj_qkvz.weight", 3),
    ("model.language_model.layers.0.linear_attn.in_proj_b.weight",
     "language_model.model.layers.0.linear_attn.in_proj_ba.weight", 0),
    ("model.language_model.layers.0.linear_attn.in_proj_a.weight",
     "language_model.model.layers.0.linear_attn.in_proj_ba.weight", 1),
    ("model.language_model.layers.0.linear_attn.conv1d.weight",
     "language_model.model.layers.0.linear_attn.conv1d.weight", None),
    ("model.language_model.layers.0.linear_attn.A_log", "language_model.model.layers.0.linear_attn.A_log", None),
    ("model.language_model.layers.1.self_attn.q_proj.weight",
     "language_model.model.layers.1.self_attn.qkv_proj.weight", "q"),
    ("model.language_model.layers.1.mlp.up_proj.weight", "language_model.model.layers.1.mlp.gate_up_proj.weight", 1),
    ("model.visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight", None),
    ("model.visual.merger.linear_fc1.weight", "visual.merger.linear_fc1.weight", None),
    ("lm_head.weight", "language_model.lm_head.weight", None),
    ("model.layers.0.linear_attn.dt_bias", "language_model.model.layers.0.linear_attn.dt_bias", None),
])
def test_vllm_names(hf_name, vllm_name, shard):
    assert vllm_param_for("qwen3_5", hf_name) == (vllm_name, shard)


def test_prompts_collapse_to_what_vllm_expands(folder):
    from transformers import AutoConfig

    from data.processing import load_processor
    from models.family import FAMILIES, build_adapter
    from rollout.weight_names import VLLM_UNVERIFIED

    adapter = build_adapter(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    vocab = load_processor(str(folder)).tokenizer.get_vocab()
    prompt = _prompts(folder)[1]
    collapsed, runs = adapter.vllm_collapse(prompt.input_ids, vocab)
    assert collapsed.count(adapter.image_token_id) == 1
    assert runs == [[adapter.image_token_id] * (int(prompt.image_grid_thw[0].prod()) // 4)]
    assert adapter.vllm_expand(collapsed, runs, vocab) == prompt.input_ids
    assert adapter.vllm_processor_kwargs(3136, 12544) == {
        "size": {"shortest_edge": 3136, "longest_edge": 12544}, "do_resize": False}
    assert "qwen3_5" not in VLLM_UNVERIFIED and "qwen3_5_moe" not in VLLM_UNVERIFIED  # both measured on an H200
    assert not adapter.batch_with_padding and adapter.tool_format is FAMILIES["qwen3_5"].tool_format is not None
    assert adapter.vllm_engine_kwargs() == {"additional_config": {"gdn_prefill_backend": "triton"}}


def test_moe_hub_files_load_per_expert_into_fused_experts(moe_folder):
    """Hub files hold one tensor per expert; the policy stacks them into transformers' fused experts."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    with safe_open(str(moe_folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        gate = f.get_tensor("model.language_model.layers.1.mlp.experts.2.gate_proj.weight")
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" not in keys
    policy = _policy(moe_folder)
    assert policy.adapter.num_experts == 4
    ours = dict(policy.full_state_dict())
    fused = ours["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    assert fused.shape == (4, 64, 64) and torch.equal(fused[2, :32], gate)
    theirs = AutoModelForImageTextToText.from_pretrained(str(moe_folder), dtype=torch.float32).state_dict()
    for name in ("model.language_model.layers.0.mlp.experts.gate_up_proj",
                 "model.language_model.layers.1.mlp.experts.down_proj",
                 "model.language_model.layers.0.mlp.gate.weight"):
        assert torch.equal(ours[name], theirs[name]), name


def test_moe_engine_runs_the_experts_in_the_layout_refit_writes(moe_folder):
    """vLLM's Triton MoE kernels read w13/w2 as loaded; FlashInfer's read a layout made once at start-up."""
    from transformers import AutoConfig

    from models.family import build_adapter

    kwargs = build_adapter(AutoConfig.from_pretrained(moe_folder)).vllm_engine_kwargs()
    assert kwargs == {"additional_config": {"gdn_prefill_backend": "triton"}, "moe_backend": "triton"}


@pytest.mark.parametrize("hf_name, vllm_name, shard", [
    ("model.language_model.layers.0.mlp.experts.gate_up_proj",
     "language_model.model.layers.0.mlp.experts.routed_experts.w13_weight", None),
    ("model.language_model.layers.1.mlp.experts.down_proj",
     "language_model.model.layers.1.mlp.experts.routed_experts.w2_weight", None),
    ("model.language_model.layers.1.mlp.experts.3.up_proj.weight",
     "language_model.model.layers.1.mlp.experts.routed_experts.w13_weight", ExpertShard(3, "w3")),
    ("model.layers.0.mlp.experts.0.gate_proj.weight",
     "language_model.model.layers.0.mlp.experts.routed_experts.w13_weight", ExpertShard(0, "w1")),
    ("model.language_model.layers.0.mlp.experts.2.down_proj.weight",
     "language_model.model.layers.0.mlp.experts.routed_experts.w2_weight", ExpertShard(2, "w2")),
    ("model.language_model.layers.0.mlp.gate.weight", "language_model.model.layers.0.mlp.gate.weight", None),
    ("model.language_model.layers.0.mlp.shared_expert.gate_proj.weight",
     "language_model.model.layers.0.mlp.shared_expert.gate_up_proj.weight", 0),
    ("model.language_model.layers.0.mlp.shared_expert_gate.weight",
     "language_model.model.layers.0.mlp.shared_expert_gate.weight", None),
    ("model.language_model.layers.0.linear_attn.in_proj_z.weight",
     "language_model.model.layers.0.linear_attn.in_proj_qkvz.weight", 3),
])
def test_moe_vllm_names(hf_name, vllm_name, shard):
    assert vllm_param_for("qwen3_5_moe", hf_name) == (vllm_name, shard)


def test_read_back_of_the_stacked_gated_deltanet_projections(monkeypatch):
    """in_proj_qkv fills three of in_proj_qkvz's four blocks (shard (0, 1, 2)); reading it back takes
    those three, in_proj_z the fourth. vLLM's layer classes are stood in for (no vLLM on CPU)."""
    import sys
    import types

    from rollout.vllm_engine import _full_tensor

    linear = types.ModuleType("vllm.model_executor.layers.linear")
    for name in ("ColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear"):
        setattr(linear, name, type(name, (), {}))
    linear.MergedColumnParallelLinear = type("MergedColumnParallelLinear", (), {"tp_size": 1})
    embedding = types.ModuleType("vllm.model_executor.layers.vocab_parallel_embedding")
    embedding.VocabParallelEmbedding = type("VocabParallelEmbedding", (), {})
    monkeypatch.setitem(sys.modules, linear.__name__, linear)
    monkeypatch.setitem(sys.modules, embedding.__name__, embedding)
    qkvz = linear.MergedColumnParallelLinear()
    qkvz.output_sizes = [4, 4, 6, 6]
    data = torch.arange(20.0).unsqueeze(1)
    assert torch.equal(_full_tensor(qkvz, "weight", data, (0, 1, 2)), data[:14])
    assert torch.equal(_full_tensor(qkvz, "weight", data, 3), data[14:])


# --- vLLM 0.26's FusedMoE as refit meets it (stand-ins: no vLLM in the CPU tests) ---------------
class _RoutedExperts(torch.nn.Module):
    """vLLM 0.26's RoutedExperts (fused_moe/routed_experts.py) as far as refit sees it: a layer's experts
    as w13_weight (E, 2·I, H: gate rows, then up) and w2_weight (E, H, I), this rank's slice of I plus
    `pad` rows or columns; `load_weights` takes transformers' fused tensors and hub files' per-expert
    ones, yields the parameter's name relative to itself, and drops any other name without a word."""

    def __init__(self, experts, inter, hidden, pad=0, tp_size=1, tp_rank=0):
        super().__init__()
        nan = float("nan")
        self.w13_weight = torch.nn.Parameter(torch.full((experts, 2 * (inter + pad), hidden), nan), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.full((experts, hidden, inter + pad), nan), requires_grad=False)
        self.layer_name = "stand-in"
        self.tp_rank = tp_rank
        self.moe_config = SimpleNamespace(
            moe_parallel_config=SimpleNamespace(use_ep=False, dp_size=1, tp_size=tp_size),
            hidden_dim_unpadded=hidden, intermediate_size_per_partition_unpadded=inter)

    def _w13(self, expert, part, weight):
        inter, half = self.moe_config.intermediate_size_per_partition_unpadded, self.w13_weight.shape[1] // 2
        rows = weight.narrow(-2, self.tp_rank * inter, inter)
        self.w13_weight.data[expert, (0 if part == "w1" else half) + torch.arange(inter)] = rows

    def _w2(self, expert, weight):
        inter = self.moe_config.intermediate_size_per_partition_unpadded
        self.w2_weight.data[expert, :, :inter] = weight.narrow(-1, self.tp_rank * inter, inter)

    def load_weights(self, weights):
        for name, weight in weights:
            per_expert = re.fullmatch(r"(\d+)\.(gate|up|down)_proj\.weight", name)
            if name == "gate_up_proj":
                for e, (gate, up) in enumerate(zip(*weight.chunk(2, 1))):
                    self._w13(e, "w1", gate), self._w13(e, "w3", up)
                yield "w13_weight"
            elif name == "down_proj":
                for e, down in enumerate(weight):
                    self._w2(e, down)
                yield "w2_weight"
            elif per_expert:
                e, proj = int(per_expert.group(1)), per_expert.group(2)
                if proj == "down":
                    self._w2(e, weight)
                else:
                    self._w13(e, "w1" if proj == "gate" else "w3", weight)
                yield "w2_weight" if proj == "down" else "w13_weight"


class _MoERunner(torch.nn.Module):
    """vLLM 0.26's MoERunner (`mlp.experts`): hands its weights to its `routed_experts` child."""

    def __init__(self, experts):
        super().__init__()
        self.routed_experts = experts

    def load_weights(self, weights):
        return self.routed_experts.load_weights(weights)


class _MoEModel(torch.nn.Module):
    """The expert path of vLLM's Qwen3.5-MoE: `language_model.model.layers.N.mlp.experts`; its
    `load_weights` maps transformers' prefix as Qwen3-VL's mapper does and, as AutoWeightsLoader, gives
    a child with `load_weights` the rest of each name and prefixes the child's path to what it reports."""

    def __init__(self, layers, experts, inter, hidden):
        super().__init__()
        self.language_model = torch.nn.Module()
        self.language_model.model = torch.nn.Module()
        self.language_model.model.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = _MoERunner(_RoutedExperts(experts, inter, hidden))
            self.language_model.model.layers.append(layer)

    def load_weights(self, weights):
        for name, weight in weights:
            name = re.sub(r"^model\.(language_model\.)?", "language_model.model.", name)
            path, _, rest = name.partition(".mlp.experts.")
            runner = f"{path}.mlp.experts"
            yield from (f"{runner}.{n}" for n in self.get_submodule(runner).load_weights([(rest, weight)]))


def _experts_state(layers=2, experts=4, inter=3, hidden=5):
    """Transformers 5's fused experts of a Qwen3.5-MoE decoder, random."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        out[f"model.language_model.layers.{i}.mlp.experts.gate_up_proj"] = torch.randn(experts, 2 * inter, hidden,
                                                                                         generator=g)
        out[f"model.language_model.layers.{i}.mlp.experts.down_proj"] = torch.randn(experts, hidden, inter, generator=g)
    return out


def _per_expert(fused: dict) -> dict:
    """The same experts under a hub file's names, one tensor per expert and projection."""
    out = {}
    for name, t in fused.items():
        prefix = name.rpartition(".")[0]
        for e, w in enumerate(t):
            if name.endswith("gate_up_proj"):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = w.chunk(2, 0)
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = w
    return out


def _read_back(experts, name):
    """`vllm_engine._full_tensor` of the expert parameter a transformers name maps to."""
    from rollout.vllm_engine import _full_tensor

    param, shard = vllm_param_for("qwen3_5_moe", name)
    attr = param.rpartition(".")[2]
    return _full_tensor(experts, attr, getattr(experts, attr).data, shard)


@pytest.mark.parametrize("names", ["module", "file"])
def test_refit_loads_the_experts_and_reads_them_back(names):
    """vLLM 0.26 reports the experts it loaded as `...mlp.experts.w13_weight`, one module short of the
    parameter `...mlp.experts.routed_experts.w13_weight` (the H200's first refit failed on this): the
    refit must count them loaded, and every expert tensor must read back as sent."""
    from rollout.vllm_engine import _read_params, check_loaded, load_into, refit_stream
    from rollout.weight_names import VLLMSkips

    sent = _experts_state() if names == "module" else _per_expert(_experts_state())
    model = _MoEModel(2, 4, 3, 5)
    expected, skipped = set(), {}
    with torch.no_grad():
        loaded = load_into(model, refit_stream("qwen3_5_moe", VLLMSkips(), False, sent.items(), expected, skipped))
    check_loaded(loaded, expected)
    assert expected == {f"language_model.model.layers.{i}.mlp.experts.routed_experts.{w}"
                        for i in (0, 1) for w in ("w13_weight", "w2_weight")}
    assert not any(p.isnan().any() for p in model.parameters())  # every expert row was written
    back = _read_params(model, [(n, *vllm_param_for("qwen3_5_moe", n)) for n in sent])
    assert all(torch.equal(back[n], t) for n, t in sent.items())


def test_refit_fails_when_vllm_drops_or_misreports_the_experts(monkeypatch):
    """Expert tensors under a name vLLM's loader ignores would leave the engine's experts stale, and
    names reported one module short are not counted without their resolution: both fail the refit."""
    import rollout.vllm_engine as engine
    from rollout.weight_names import VLLMSkips

    def refit():
        expected = set()
        stream = engine.refit_stream("qwen3_5_moe", VLLMSkips(), False, _experts_state().items(), expected, {})
        engine.check_loaded(engine.load_into(_MoEModel(2, 4, 3, 5), stream), expected)

    refit()
    with monkeypatch.context() as patch:  # a name RoutedExperts.load_weights matches nothing with
        patch.setattr(engine, "vllm_load_name", lambda family, name: name.replace("gate_up_proj", "gate_up"))
        with pytest.raises(RuntimeError, match=r"did not load \['language_model.model.layers.0.mlp.experts."
                                               r"routed_experts.w13_weight', 'language_model.model.layers.1"):
            refit()
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_REPORTING_CHILDREN", ())
        with pytest.raises(RuntimeError, match=r"did not load .*\(4 in all\)"):
            refit()


def test_expert_read_back_gathers_each_ranks_slice_of_the_intermediate_dimension(monkeypatch):
    """With tensor parallelism each rank holds [gate_r; up_r] rows of w13 and columns of w2 (padded
    here past the checkpoint's size); read-back cuts the padding and gathers gate and up apart."""
    import threading

    import rollout.vllm_engine as engine

    fused = _experts_state(layers=1, experts=3, inter=4, hidden=5)
    per_expert = _per_expert(fused)
    names = [*fused, "model.language_model.layers.0.mlp.experts.2.up_proj.weight",
             "model.language_model.layers.0.mlp.experts.1.gate_proj.weight",
             "model.language_model.layers.0.mlp.experts.1.down_proj.weight"]
    tp, barrier, pieces, rank = 2, threading.Barrier(2), {}, threading.local()

    def all_gather(t, dim, size):  # torch.distributed's all_gather, with two threads as the ranks
        pieces.setdefault(rank.step, [None] * size)[rank.id] = t
        barrier.wait()
        out = torch.cat(pieces[rank.step], dim)
        rank.step += 1
        return out

    monkeypatch.setattr(engine, "_gather", all_gather)
    results = [None] * tp

    def run(r):
        rank.id, rank.step = r, 0
        experts = _RoutedExperts(3, 4 // tp, 5, pad=1, tp_size=tp, tp_rank=r)
        list(experts.load_weights((n.rpartition(".experts.")[2], t) for n, t in fused.items()))
        results[r] = {n: _read_back(experts, n) for n in names}

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(tp):
        for name in names:
            assert torch.equal(results[r][name], fused.get(name, per_expert.get(name))), (r, name)



def test_vllms_own_moe_model_loads_every_expert_on_cpu(moe_folder):
    """vLLM 0.26's own Qwen3.5-MoE class, built on CPU by tools/vllm_load_check.py: both refits load
    exactly the predicted parameters, write every parameter, and read back bitwise. Runs where vLLM's
    source and its pure-Python dependencies import (PYTHONPATH=<vLLM 0.26 source>:<deps>)."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM's source is not importable (PYTHONPATH=<vLLM 0.26 source>:<its deps>)")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "tools" / "vllm_load_check.py"), "--model", str(moe_folder),
                           "--max-images", "1"], capture_output=True, text=True, timeout=900, cwd=root)
    results = {r["check"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert results.get("setup", {}).get("ok"), proc.stdout + proc.stderr[-4000:]
    for label in ("refit_module_names", "refit_file_names"):
        assert results[label]["ok"] and results[label]["unwritten"] == [], results[label]

def test_load_balancing_loss_is_transformers_own():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    from models.moe import load_balancing_loss

    g = torch.Generator().manual_seed(2)
    logits = [torch.randn(11, 6, generator=g) * 3 for _ in range(3)]
    ours = load_balancing_loss(logits, top_k=2)
    theirs = load_balancing_loss_func(tuple(logits), num_experts=6, top_k=2)
    assert torch.allclose(ours, theirs, atol=1e-6) and ours > 2.0  # 2 (= top_k) only when balanced


def test_router_aux_loss_reaches_the_update(moe_folder, folder):
    """model.router_aux_loss_coef: the policy's aux loss equals the model's own (transformers'
    output_router_logits) on a sequence, and the update adds it (router gradients change)."""
    from transformers import AutoModelForImageTextToText

    from grpo.config import ConfigError, load_config
    from grpo.update import optimizer_step

    with pytest.raises(ConfigError, match="model.router_aux_loss_coef"):
        load_config(None, ["model.router_aux_loss_coef=-0.1"])
    init_distributed()
    with pytest.raises(ValueError, match="'model.router_aux_loss_coef' is 0.5, but model family 'qwen3_5' has no"):
        build_policy(ModelConfig(path=str(folder), dtype="float32", router_aux_loss_coef=0.5), build_parallel_dims())

    policy = build_policy(ModelConfig(path=str(moe_folder), dtype="float32", attn_implementation="sdpa",
                                      router_aux_loss_coef=0.5), build_parallel_dims())
    prompts = _prompts(moe_folder)
    gens = [Generation(2, [5, 6, 7, 8, 9], [0.0] * 5, "length")]  # the text-only prompt
    batch = generation_batch(policy.adapter, prompts, gens)
    policy.logprobs(pack(batch, [0]))
    hf = AutoModelForImageTextToText.from_pretrained(str(moe_folder), dtype=torch.float32)
    ids = batch["input_ids"].items[0].unsqueeze(0)
    theirs = hf(input_ids=ids, output_router_logits=True).aux_loss
    assert torch.allclose(policy.router_aux.detach(), theirs, atol=1e-5)

    def loss_fn(lp, mb, den):
        return -lp.sum() / den["tokens"], {}

    def router_grads(coef):
        policy.router_aux_coef = coef
        policy.model.zero_grad(set_to_none=True)
        optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
        grads, clear = [], optimizer.zero_grad

        def zero_grad(set_to_none=True):  # read the router gradients before the step clears them
            grads.append([full_value(p.grad).clone() for r in policy.adapter.routers(policy.model)
                          for p in r.parameters() if p.grad is not None])
            clear(set_to_none=set_to_none)

        optimizer.zero_grad = zero_grad
        out = optimizer_step(policy, optimizer, batch, loss_fn, max_tokens=4096, grad_clip=0.0,
                             denominators={"tokens": 4})
        assert grads[0] == [] and len(grads[-1]) == 2  # none before the step, both routers' after
        return out, grads[-1]

    with_aux, grads_aux = router_grads(0.5)
    assert with_aux["loss/router_aux_sum"] > 0
    _, grads_plain = router_grads(1e-12)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(grads_aux, grads_plain))


# --- tools: Qwen3.5's XML calls in episodes ----------------------------------------------------------

ZOOM_XML = ("<tool_call>\n<function=image_zoom_in_tool>\n<parameter=bbox_2d>\n[0, 0, 32, 32]\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>")
BAD_XML = "<tool_call>\n<function=image_zoom_in_tool>\n<parameter=bbox_2d>\n[0, 0</function>\n</tool_call><|im_end|>"


def test_tool_episode_appends_the_templates_rendering(folder):
    """Token in, token out with XML calls: turn 2 is given exactly what the chat template renders for the
    conversation with the tool message (its image expanded); a malformed call is a counted error."""
    from data.processing import load_processor
    from data.trajectories import render_chat
    from grpo.algorithm import dynamic_sampling_keep
    from models.family import FAMILIES
    from models.policy import load_model_config
    from rollout.groups import EngineGroup
    from rollout.rollouts import Rollouts, awake, tool_prompt
    from tests.test_episodes import ScriptedEngine, _cfg, _prompt, rollouts_params

    processor = load_processor(str(folder))
    cfg = _cfg(folder)
    engine = ScriptedEngine(processor.tokenizer, [[ZOOM_XML, BAD_XML], ["<answer>3</answer><|im_end|>"]])
    adapter = FAMILIES["qwen3_5"].adapter(load_model_config(str(folder)))
    rollouts = Rollouts(cfg, adapter, processor, lambda: awake(engine), EngineGroup(), lambda v: v,
                        dynamic_sampling_keep)
    tp = tool_prompt(cfg, adapter, processor)
    prompts = [_prompt(processor, 0, tool_prompt=tp)]
    assert processor.tokenizer.decode(prompts[0].input_ids).startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    try:
        _, (zoomed, failed), _ = rollouts.generate_and_score(engine, prompts, rollouts_params(n=2))
    finally:
        rollouts.close()
    (s1, e1), (s2, e2) = zoomed.turns
    assert zoomed.tool_calls == 1 and not zoomed.tool_errors and zoomed.tool_images == 1
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
        {"role": "assistant", "content": processor.tokenizer.decode(zoomed.token_ids[s1:e1 - 1])},
        {"role": "tool", "content": [{"type": "image"}]},
    ]
    whole = processor(render_chat(processor, conversation, True, tp), zoomed.images)
    assert zoomed.token_ids[:s2] == whole["input_ids"].tolist()
    assert torch.equal(zoomed.pixel_values(), whole["pixel_values"])
    assert failed.tool_errors == {"malformed_json": 1} and len(failed.turns) == 2
    shown = processor.tokenizer.decode(failed.token_ids[failed.turns[0][1]:failed.turns[1][0]])
    assert "an unclosed <parameter" in shown


class XmlTeacher:
    """Per prompt, sample 0 zooms and then answers, sample 1 writes malformed XML and then no answer;
    each turn's logprobs are transformers' own on the whole sequence."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.calls = model, tokenizer, 0

    def generate(self, prompts, params):
        from tests.test_episodes import _hf_logprobs

        turn, self.calls = self.calls, self.calls + 1
        out = []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                text = (ZOOM_XML if j == 0 else BAD_XML) if turn == 0 else (
                    "<answer>1</answer><|im_end|>" if j == 0 else "no idea<|im_end|>")
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                lps = _hf_logprobs(self.model, list(p.input_ids) + ids, p.pixel_values, p.image_grid_thw,
                                   len(p.input_ids))
                out.append(Generation(i, ids, lps.tolist(), "stop"))
        return out


def test_grpo_step_with_the_zoom_tool(folder, clevr_parquet, tmp_path):
    """A GRPO step through the trainer with XML zoom calls: the policy's packed logprobs of the model tokens,
    with the zoomed images, equal transformers' on each whole episode; the malformed call is penalized."""
    from grpo.config import load_config
    from grpo.trainer import Trainer
    from rollout.rollouts import awake
    from tests.test_episodes import _hf_model

    init_distributed()
    cfg = load_config(None, [
        "trainer.mode=grpo", f"model.path={folder}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=1", "data.min_pixels=3136", "data.max_pixels=3136",
        f"trainer.run_dir={tmp_path / 'run'}", "logging.tensorboard=false", "checkpoint.resume=never",
        "optim.max_tokens_per_microbatch=4096", "rollout.tools=[image_zoom_in_tool]", "rollout.max_turns=2",
        "rollout.max_new_tokens=100", "algorithm.tool_error_penalty=0.5",
    ])
    trainer = Trainer(cfg)
    engine = XmlTeacher(_hf_model(folder), trainer.tokenizer)
    trainer.rollouts.generating = lambda: awake(engine)
    try:
        m = trainer.grpo_step(1)
    finally:
        trainer.rollouts.close()
    assert engine.calls == 2 and m["agent/tool_calls"] == 2 and m["agent/images_per_episode"] == 1.5
    assert m["agent/tool_errors"] == 1 and m["agent/tool_errors_malformed_json"] == 1
    assert 1.0 <= m["fidelity/token_mult_prob_error"] <= 1.0001, m["fidelity/token_mult_prob_error"]
    assert m["reward/std"] > 0 and m["loss/grad_norm"] > 0


# --- fla's Hopper guard (#640) on the Gated DeltaNet backward: the decision, with fla's flags stubbed --------
GUARDED = dict(hopper=True, triton_3_4_0=True, triton_3_7_1=False, triton_version="3.5.1")


def _flags(**changes):
    from models.fla_guard import FlaFlags

    return FlaFlags(**{**GUARDED, **changes})


@pytest.mark.parametrize("flags, k_dim, tiling, tilelang, dispatch, route", [
    (dict(triton_3_7_1=True, triton_version="3.7.1"), 64, True, False, True, "fla"),  # a Triton with the fix
    (dict(hopper=False), 64, False, False, True, "fla"),  # not Hopper: no guard
    (dict(triton_3_4_0=False, triton_version="3.3.1"), 64, True, False, True, "fla"),  # before the bug
    ({}, 128, True, False, True, "lifted"),  # Qwen3.5's 128-wide key heads: BK = 128
    ({}, 100, True, False, True, "lifted"),  # next power of two: BK = 128 too
    ({}, 64, True, True, True, "tilelang"),  # fla's own replacement kernel takes it
    ({}, 64, True, False, True, "a block of 64, the case the issue reports wrong"),
    ({}, 16, True, False, True, "a block of 16, which the issue does not clear"),
    ({}, 128, False, False, True, "Hopper tiling is off"),
    ({}, 128, True, True, False, "FLA_DISABLE_BACKEND_DISPATCH=1"),
])
def test_fla_guard_route(flags, k_dim, tiling, tilelang, dispatch, route):
    from models.fla_guard import DeltaRuleBackwardError, plan_route

    if route in ("fla", "lifted", "tilelang"):
        assert plan_route(_flags(**flags), k_dim, tiling, tilelang, dispatch) == route
    else:
        with pytest.raises(DeltaRuleBackwardError, match=route):
            plan_route(_flags(**flags), k_dim, tiling, tilelang, dispatch)


def test_fla_guard_refusal_says_what_why_and_what_to_do():
    from models.fla_guard import DeltaRuleBackwardError, plan_route

    with pytest.raises(DeltaRuleBackwardError) as err:
        plan_route(_flags(), 64, True, False, True, where="cuda:3")
    text = str(err.value)
    for part in ("Gated DeltaNet backward on cuda:3", "Triton 3.5.1", "fla-org/flash-linear-attention#640",
                 "64-wide key heads (linear_key_head_dim)", "Triton to >= 3.7.1", "pip install tilelang"):
        assert part in text, (part, text)


def _guarded_chunk_bwd_dqkwg(q, k, g=None, scale=2.0):
    """fla's guard as `_stub_fla`'s module runs it: the flags are that module's globals, not this file's."""
    if g is not None and IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:  # noqa: F821
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs (see #640)")
    return q * k * scale


def _stub_fla(monkeypatch, **flags):
    """A stand-in for fla.ops.common.chunk_o (and triton) in sys.modules with the guard's flags and a
    `chunk_bwd_dqkwg` behind a dispatch-like wrapper that raises as fla's does."""
    import functools
    import sys
    import types

    chunk_o = types.ModuleType("fla.ops.common.chunk_o")
    chunk_o.IS_NVIDIA_HOPPER, chunk_o.TRITON_ABOVE_3_4_0 = flags["hopper"], flags["triton_3_4_0"]
    chunk_o.TRITON_ABOVE_3_7_1 = flags["triton_3_7_1"]
    # fla's function reads the flags as its module's globals: the stand-in's code runs on the stub's dict
    raw = types.FunctionType(_guarded_chunk_bwd_dqkwg.__code__, chunk_o.__dict__, "chunk_bwd_dqkwg",
                             _guarded_chunk_bwd_dqkwg.__defaults__)
    chunk_o.chunk_bwd_dqkwg = functools.wraps(raw)(lambda *a, **kw: raw(*a, **kw))
    common = types.ModuleType("fla.ops.common")
    common.chunk_o = chunk_o
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.common", common), ("fla.ops.common.chunk_o", chunk_o),
                         ("triton", types.SimpleNamespace(__version__=flags["triton_version"]))):
        monkeypatch.setitem(sys.modules, name, module)
    return chunk_o


def test_fla_guard_reads_fla_flags(monkeypatch):
    from models.fla_guard import read_flags

    _stub_fla(monkeypatch, **GUARDED)
    assert read_flags() == _flags() and read_flags().guarded
    _stub_fla(monkeypatch, **{**GUARDED, "triton_3_7_1": True})
    assert not read_flags().guarded


def test_fla_guard_lifts_the_guard_of_its_copy_only(monkeypatch):
    from models.fla_guard import DeltaRuleBackwardError, unguarded

    chunk_o = _stub_fla(monkeypatch, **GUARDED)
    with pytest.raises(RuntimeError, match="#640"):
        chunk_o.chunk_bwd_dqkwg(3.0, 2.0, g=1.0)
    lifted = unguarded(chunk_o.chunk_bwd_dqkwg)
    assert lifted(3.0, 2.0, g=1.0) == 12.0 and lifted(3.0, 2.0, g=1.0, scale=1.0) == 6.0
    assert chunk_o.TRITON_ABOVE_3_7_1 is False  # fla's module keeps its flag: other calls stay guarded
    with pytest.raises(RuntimeError, match="#640"):
        chunk_o.chunk_bwd_dqkwg(3.0, 2.0, g=1.0)
    with pytest.raises(DeltaRuleBackwardError, match="not the function vlrl lifts"):
        unguarded(lambda q, k: q)  # another fla's function: refuse rather than guess


def test_fla_guard_backend_takes_only_cleared_calls(monkeypatch):
    from models import fla_guard

    monkeypatch.setattr(fla_guard, "_cleared", {0})
    assert fla_guard.accepts_call(_flags(), True, 0, 128, True) == (True, None)
    assert not fla_guard.accepts_call(_flags(), True, 1, 128, True)[0]  # device not self-checked
    assert not fla_guard.accepts_call(_flags(), True, 0, 64, True)[0]  # block 64
    assert not fla_guard.accepts_call(_flags(), False, 0, 128, True)[0]  # ungated: fla's guard is quiet
    assert not fla_guard.accepts_call(_flags(triton_3_7_1=True), True, 0, 128, True)[0]


def _stub_decision(monkeypatch, check):
    """fla_guard with a guarded fla on Hopper, no tilelang, and `check` in place of the CUDA self-check."""
    from models import fla_guard

    monkeypatch.setattr(fla_guard, "_plans", {})
    monkeypatch.setattr(fla_guard, "_cleared", set())
    monkeypatch.setattr(fla_guard, "read_flags", lambda: _flags())
    monkeypatch.setattr(fla_guard, "_hopper_tiling", lambda index: True)
    monkeypatch.setattr(fla_guard, "_tilelang_usable", lambda: False)
    monkeypatch.setattr(fla_guard, "_dispatch_enabled", lambda: True)
    monkeypatch.setattr(fla_guard, "install_backend", lambda: None)
    monkeypatch.setattr(fla_guard, "check_backward", check)
    return fla_guard


def test_fla_guard_checks_each_device_once(monkeypatch, capsys):
    calls = []

    def check(rule, reference, shape, device):
        calls.append(device)
        assert device.index in fla_guard._cleared  # the lifted kernel may run during its own check
        return {"float16": {"out": 0.001, "q": 0.002}, "bfloat16": {"out": 0.01}}

    fla_guard = _stub_decision(monkeypatch, check)
    shape = fla_guard.RuleShape(16, 32, 128, 128, torch.bfloat16)
    plan = fla_guard.prepare_backward(torch.device("cuda", 0), shape, None, None)
    assert plan.route == "lifted" and plan.errors["float16"] == {"out": 0.001, "q": 0.002}
    assert fla_guard.prepare_backward(torch.device("cuda", 0), shape, None, None) is plan
    with pytest.raises(fla_guard.DeltaRuleBackwardError, match="a block of 64"):  # another model, same GPU
        fla_guard.prepare_backward(torch.device("cuda", 0), fla_guard.RuleShape(2, 4, 64, 64, torch.bfloat16),
                                   None, None)
    fla_guard.prepare_backward(torch.device("cuda", 1), shape, None, None)
    assert calls == [torch.device("cuda", 0), torch.device("cuda", 1)] and fla_guard._cleared == {0, 1}
    assert "guard lifted for key block 128" in capsys.readouterr().out
    assert fla_guard.check_dtypes(torch.bfloat16) == (torch.float16, torch.bfloat16)
    assert fla_guard.check_dtypes(torch.float16) == (torch.float16,)
    assert fla_guard.prepare_backward(torch.device("cpu"), shape, None, None).route == "torch"


def test_fla_guard_refuses_before_any_check_at_block_64(monkeypatch):
    fla_guard = _stub_decision(monkeypatch, lambda *a: pytest.fail("no self-check where the block is 64"))
    shape = fla_guard.RuleShape(2, 4, 64, 64, torch.bfloat16)
    with pytest.raises(fla_guard.DeltaRuleBackwardError, match="a block of 64"):
        fla_guard.prepare_backward(torch.device("cuda", 0), shape, None, None)
    assert not fla_guard._cleared


def test_fla_guard_failed_check_leaves_the_device_uncleared(monkeypatch):
    from models.fla_guard import DeltaRuleBackwardError

    def check(*args):
        raise DeltaRuleBackwardError("disagree")

    fla_guard = _stub_decision(monkeypatch, check)
    shape = fla_guard.RuleShape(16, 32, 128, 128, torch.bfloat16)
    for _ in range(2):  # not remembered as passed: a second call checks (and refuses) again
        with pytest.raises(DeltaRuleBackwardError, match="disagree"):
            fla_guard.prepare_backward(torch.device("cuda", 0), shape, None, None)
        assert not fla_guard._cleared and not fla_guard._plans


class _WrongBackward(torch.autograd.Function):
    """Identity forward whose backward is off by a factor, as a miscompiled backward kernel would be."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


def test_fla_guard_self_check_numerics():
    """The self-check's comparison, with the exact torch rule standing in for fla (CPU): equal paths pass;
    a path whose forward is right but whose key gradient is off is refused, naming that gradient."""
    from models.families.qwen3_5 import torch_delta_rule_packed
    from models.fla_guard import DeltaRuleBackwardError, RuleShape, check_backward

    shape = RuleShape(2, 4, 16, 16, torch.float32)
    errors = check_backward(torch_delta_rule_packed, torch_delta_rule_packed, shape, torch.device("cpu"))
    assert list(errors) == ["float16", "float32"]  # float16 first: fine enough to see #640's corruption
    assert set(errors["float32"]) == {"out", "q", "k", "v", "g", "beta"} and max(errors["float32"].values()) < 1e-5
    assert max(errors["float16"].values()) < 2e-3  # the torch rule runs in fp32: only the inputs' rounding

    def wrong(q, k, v, g, beta, cu):
        return torch_delta_rule_packed(q, _WrongBackward.apply(k), v, g, beta, cu)

    refused = r"torch.float16.*relative error k 0\.\d+ \(tolerance 0\.01\)"
    with pytest.raises(DeltaRuleBackwardError, match=refused) as err:
        check_backward(wrong, torch_delta_rule_packed, shape, torch.device("cpu"))
    assert "out " not in str(err.value) and "Triton to >= 3.7.1" in str(err.value)


def test_torch_rule_gets_key_heads_repeated_over_value_heads(monkeypatch):
    """Qwen3.5-4B has 16 key heads to 32 value heads. transformers 5.17's torch rule takes q/k already
    repeated to the value heads (later versions repeat inside), so the packed path repeats them itself:
    without it the H200's self-check failed at 16 against 32 heads."""
    import models.families.qwen3_5 as q35

    seen = []

    def strict_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel):
        assert q.shape[2] == k.shape[2] == v.shape[2] == g.shape[2] == beta.shape[2]
        seen.append(q.shape)
        return v.clone(), None

    monkeypatch.setattr(q35, "_torch_rule", lambda: strict_rule)
    length, cu = 10, torch.tensor([0, 4, 10], dtype=torch.int32)
    q, k = torch.randn(1, length, 2, 8), torch.randn(1, length, 2, 8)
    v, g, beta = torch.randn(1, length, 4, 8), -torch.rand(1, length, 4), torch.rand(1, length, 4)
    out = q35.torch_delta_rule_packed(q, k, v, g, beta, cu)
    assert out.shape == (1, length, 4, 8) and seen and seen[0][2] == 4


def test_tiny_configs_keep_the_gated_deltanet_state_in_fp32_as_released_configs_do(folder, moe_folder):
    """vLLM keeps the recurrent state between decode steps in the checkpoint's `mamba_ssm_dtype` (the model's bf16
    without it, rounding the state at every token where the trainer's chunked rule carries fp32)."""
    from transformers import AutoConfig

    for path in (folder, moe_folder):
        assert json.loads((Path(path) / "config.json").read_text())["text_config"]["mamba_ssm_dtype"] == "float32"
        assert AutoConfig.from_pretrained(path).text_config.mamba_ssm_dtype == "float32"


def test_auto_trains_qwen3_5_full_attention_with_the_varlen_kernel_on_cuda(monkeypatch):
    """Qwen3.5's full-attention layers passed the varlen-vs-SDPA check on the H200, so `auto` picks the varlen
    kernel for it on CUDA in bf16 (SDPA in fp32 on CUDA; on CPU varlen's SDPA per sequence)."""
    from models import attention
    from models.families.qwen3_5 import Qwen3_5Adapter
    from models.policy import resolve_attn_implementation

    monkeypatch.setattr(attention, "kernel_available", lambda: True)
    ok = Qwen3_5Adapter.varlen_attention
    assert resolve_attn_implementation("auto", "cuda", ok, torch.bfloat16) == "varlen"
    assert resolve_attn_implementation("auto", "cpu", ok, torch.bfloat16) == "varlen"
    assert resolve_attn_implementation("auto", "cuda", ok, torch.float32) == "sdpa"


def test_kernel_build_notice_once_and_only_where_the_cache_lacks_the_kernels(tmp_path, monkeypatch):
    """Before the first packed pass on CUDA the trainer says that fla's kernels build and autotune (minutes)
    where Triton's cache holds none of them; once per process; never off CUDA or once the cache has them."""
    from models.families import qwen3_5

    monkeypatch.setattr(qwen3_5, "_fla_rule", lambda: object())
    monkeypatch.setattr(qwen3_5, "_build_noticed", set())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert qwen3_5.kernel_build_notice(torch.device("cpu")) is None
    line = qwen3_5.kernel_build_notice(torch.device("cuda", 0))
    assert line.startswith(f"Gated DeltaNet: Triton's cache ({tmp_path / 'triton'}) holds none of fla's kernels")
    assert qwen3_5.kernel_build_notice(torch.device("cuda", 0)) is None  # once
    monkeypatch.setattr(qwen3_5, "_build_noticed", set())
    entry = tmp_path / "triton" / "3f2a9c"
    entry.mkdir(parents=True)
    (entry / f"{qwen3_5.FLA_PROBE_KERNEL}.json").write_text("{}")
    assert qwen3_5.kernel_build_notice(torch.device("cuda", 0)) is None
