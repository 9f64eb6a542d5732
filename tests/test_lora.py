"""LoRA (models/lora.py) on the session's tiny Qwen2.5-VL, one CPU rank: the initial policy is the base
model, only adapters train and hold optimizer state, the merge is W + (alpha/rank)·B·A, and refit
hands the built-in engine merged weights whose logprobs equal the policy's."""

import math

import pytest
import torch
from torch import nn

from data.batch import Batch
from grpo.config import ConfigError, LoraConfig, ModelConfig, OptimConfig, load_config
from grpo.update import build_optimizer
from models.lora import (
    DEFAULT_TARGETS, LoraLinear, is_adapter_name, lora_module_names, lora_modules, merge_lora, merged_weight,
)
from models.packing import pack, unpack_per_sequence
from models.parallel import build_parallel_dims, full_value, init_distributed
from models.policy import build_policy
from rollout.base import PromptInput, SamplingParams
from rollout.torch_engine import TorchEngine
from tests.test_full_state_dict import set_full_value

RANK, ALPHA = 4, 8.0


def model_cfg(path, rank=RANK, **lora):
    return ModelConfig(path=str(path), dtype="float32", attn_implementation="sdpa",
                       lora=LoraConfig(rank=rank, alpha=ALPHA, **lora))


@pytest.fixture(scope="module")
def base(tiny_model):
    init_distributed()
    return build_policy(model_cfg(tiny_model, rank=0), build_parallel_dims())


@pytest.fixture()
def lora(tiny_model):
    init_distributed()
    return build_policy(model_cfg(tiny_model), build_parallel_dims())


def randomize_adapters(policy, seed=1, scale=0.05):
    """Give B (zero at start) random values, so the merge has something to fold in."""
    g = torch.Generator().manual_seed(seed)
    for m in lora_modules(policy.model).values():
        set_full_value(m.lora_B, torch.randn(m.lora_B.shape, generator=g) * scale)


def sequences(adapter, count=3, seed=0):
    """Prompt + response token rows (one with an image), scored on their last 6 tokens."""
    g = torch.Generator().manual_seed(seed)
    dim = 3 * adapter.temporal_patch_size * adapter.patch_size**2
    ids, masks, pixels, grids = [], [], [], []
    for k in range(count):
        seq = torch.randint(0, 256, (6 + k,), generator=g).tolist()
        grid = [(1, 4, 4)] if k == 0 else []
        for t, h, w in grid:
            seq += [adapter.vision_start_token_id] + [adapter.image_token_id] * (t * h * w // 4)
            seq += [adapter.vision_end_token_id]
        seq = torch.tensor(seq + torch.randint(0, 256, (6,), generator=g).tolist())
        mask = torch.zeros_like(seq)
        mask[-6:] = 1
        ids.append(seq)
        masks.append(mask)
        pixels.append(torch.randn(16, dim, generator=g) if grid else None)
        grids.append(torch.tensor(grid) if grid else None)
    batch = Batch({"input_ids": ids, "loss_mask": masks, "pixel_values": pixels, "image_grid_thw": grids})
    batch["position_ids"] = [adapter.position_ids(s, gr) for s, gr in zip(ids, grids)]
    return pack(batch, list(range(count)))


def test_config_default_targets_and_checks():
    assert tuple(LoraConfig().targets) == DEFAULT_TARGETS and LoraConfig().rank == 0
    cfg = load_config(None, ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.targets=[q_proj,v_proj]"])
    assert cfg.model.lora.targets == ["q_proj", "v_proj"] and cfg.model.lora.rank == 8
    for bad, key in ((["model.lora.rank=-1"], "model.lora.rank"), (["model.lora.rank=2", "model.lora.alpha=0"], "alpha"),
                     (["model.lora.rank=2", "parallel.tp=2"], "parallel.tp=1"),
                     (["model.lora.rank=2", "model.lora.targets=[]"], "train nothing")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, bad)


def test_targets_select_and_unknown_target_names_the_choices(base, lora):
    names = lora_module_names(base.model, base.adapter, ["q_proj", "down_proj"], ["qkv"])
    assert names and all(n.endswith(("q_proj", "down_proj", "qkv")) for n in names)
    assert any(".visual." in n for n in names) and any("language_model" in n for n in names)
    with pytest.raises(ValueError, match=r"q_prj.*end in.*q_proj"):
        lora_module_names(base.model, base.adapter, ["q_prj"])
    layers = len(lora.adapter.decoder_layers(lora.model))
    assert len(lora_modules(lora.model)) == 7 * layers  # the defaults minus gate_up_proj, absent from Qwen


def test_initial_policy_equals_base_model(base, lora):
    mb = sequences(base.adapter)
    with torch.no_grad():
        lp_base, _ = base.logprobs(mb)
        lp_lora, _ = lora.logprobs(mb)
    assert torch.equal(lp_base, lp_lora)  # B = 0: the adapters add exactly zero
    a, b = dict(base.full_state_dict()), dict(lora.full_state_dict())
    assert a.keys() == b.keys() and not any(is_adapter_name(n) for n in b)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_only_adapters_get_gradients_and_optimizer_state(lora):
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert len(trainable) == 2 * len(lora_modules(lora.model))
    before = {n: p.detach().clone() for n, p in lora.model.named_parameters()}
    opt = build_optimizer(lora, OptimConfig(lr=1e-2))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)
    lp, _ = lora.logprobs(sequences(lora.adapter))
    (-lp.mean()).backward()
    grads = {n: p.grad for n, p in lora.model.named_parameters() if p.grad is not None}
    assert grads.keys() == set(trainable)
    assert all(float(g.abs().sum()) > 0 for n, g in grads.items() if n.endswith("lora_B"))
    opt.step()
    assert len(opt.state) == len(trainable)
    for n, p in lora.model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == n.endswith("lora_B"), n  # A moves from the next step on: its gradient is B-weighted


def test_merge_math_against_hand_computation():
    torch.manual_seed(0)
    base = nn.Linear(5, 3)
    layer = LoraLinear(base, rank=2, alpha=6.0)
    with torch.no_grad():
        layer.lora_A.copy_(torch.tensor([[1.0, 0, 0, 0, 2], [0, 1, 0, 0, 0]]))
        layer.lora_B.copy_(torch.tensor([[1.0, 0], [0, 1], [1, 1]]))
    # (alpha / rank) · B · A by hand: scaling 3; rows of B·A are A0, A1 and A0 + A1.
    delta = 3.0 * torch.tensor([[1.0, 0, 0, 0, 2], [0, 1, 0, 0, 0], [1, 1, 0, 0, 2]])
    expected = base.weight.detach() + delta
    assert torch.allclose(merged_weight(layer), expected, atol=0, rtol=0)
    x = torch.randn(4, 5)
    assert torch.allclose(layer(x), x @ expected.T + base.bias, atol=1e-6)
    holder = nn.Sequential(layer)
    assert merge_lora(holder) == 1 and type(holder[0]) is nn.Linear
    assert torch.allclose(holder[0](x), x @ expected.T + base.bias, atol=1e-6)
    assert set(holder.state_dict()) == {"0.weight", "0.bias"}


def test_refit_gives_the_engine_merged_weights_and_equal_logprobs(tiny_model, lora):
    randomize_adapters(lora)
    engine = TorchEngine(str(tiny_model), adapter=lora.adapter)
    engine.refit(lora.full_state_dict(engine.dtype))
    held = dict(engine.model.named_parameters())
    for name, module in lora_modules(lora.model).items():
        assert torch.equal(held[name + ".weight"], merged_weight(module).to(engine.dtype))
        assert not torch.equal(merged_weight(module), full_value(module.weight).detach())  # the adapters did change it
    a = lora.adapter
    prompt = [1, 2, 3, a.vision_start_token_id] + [a.image_token_id] * 4 + [a.vision_end_token_id, 4, 5]
    dim = 3 * a.temporal_patch_size * a.patch_size**2
    prompts = [PromptInput(prompt, pixel_values=torch.randn(16, dim), image_grid_thw=torch.tensor([(1, 4, 4)])),
               PromptInput([7, 8, 9, 10])]
    gens = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=0))
    ids, masks, pixels, grids = [], [], [], []
    for gen in gens:
        p = prompts[gen.prompt_index]
        seq = torch.tensor(p.input_ids + gen.token_ids)
        ids.append(seq)
        masks.append(torch.cat([torch.zeros(len(p.input_ids), dtype=torch.long), torch.ones(len(gen.token_ids),
                                                                                             dtype=torch.long)]))
        pixels.append(p.pixel_values)
        grids.append(p.image_grid_thw)
    batch = Batch({"input_ids": ids, "loss_mask": masks, "pixel_values": pixels, "image_grid_thw": grids})
    batch["position_ids"] = [a.position_ids(s, g) for s, g in zip(ids, grids)]
    mb = pack(batch, list(range(len(gens))))
    with torch.no_grad():
        lp, _ = lora.logprobs(mb)
    for gen, mine in zip(gens, unpack_per_sequence(lp, mb)):
        assert len(gen.logprobs) == len(mine) > 0
        assert max(abs(x - float(y)) for x, y in zip(gen.logprobs, mine)) < 1e-5
    assert all(math.isfinite(x) for g in gens for x in g.logprobs)


def test_checkpoint_resumes_adapters_and_merge_folds_them_in(tiny_model, lora, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from grpo.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from tools.checkpoint_merge import merge_checkpoint

    randomize_adapters(lora, seed=2)
    opt = build_optimizer(lora, OptimConfig(lr=1e-2))
    lp, _ = lora.logprobs(sequences(lora.adapter))
    (-lp.mean()).backward()
    opt.step()  # A moves too now, and AdamW has state to save
    folder = save_checkpoint(tmp_path / "run", 1, lora.model, opt, {"data": {}}, str(tiny_model))
    merged = {n: t.clone() for n, t in lora.full_state_dict()}

    fresh = build_policy(model_cfg(tiny_model), build_parallel_dims())
    fresh_opt = build_optimizer(fresh, OptimConfig(lr=1e-2))
    load_checkpoint(folder, fresh.model, fresh_opt)
    for (n, a), b in zip(lora.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(full_value(a), full_value(b)), n
    assert len(fresh_opt.state) == 2 * len(lora_modules(fresh.model))
    other = build_policy(model_cfg(tiny_model, rank=2), build_parallel_dims())
    with pytest.raises(CheckpointError, match="rank 4.*rank 2"):
        load_checkpoint(folder, other.model, build_optimizer(other, OptimConfig()))

    out = merge_checkpoint(folder, tmp_path / "hf")
    on_disk = load_file(str(out / "model.safetensors"))
    assert not any("lora" in n for n in on_disk)
    hf = AutoModelForImageTextToText.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    loaded = hf.state_dict()
    for name, tensor in merged.items():
        assert torch.equal(loaded[name], tensor), name


def test_activation_checkpointing_gives_the_same_adapter_gradients(tiny_model, lora):
    """Frozen embeddings feed the first checkpointed block an input without grad; the adapters inside
    must still get the gradients they get without checkpointing."""
    recomputed = build_policy(ModelConfig(path=str(tiny_model), dtype="float32", attn_implementation="sdpa",
                                          activation_checkpointing=True, lora=LoraConfig(rank=RANK, alpha=ALPHA)),
                              build_parallel_dims())
    for p in (lora, recomputed):
        randomize_adapters(p)
        lp, _ = p.logprobs(sequences(p.adapter))
        (-lp.mean()).backward()
    plain = {n: full_value(q.grad) for n, q in lora.model.named_parameters() if q.grad is not None}
    again = {n: full_value(q.grad) for n, q in recomputed.model.named_parameters() if q.grad is not None}
    assert plain.keys() == again.keys() and len(plain) == 2 * len(lora_modules(lora.model))
    for n in plain:
        assert torch.allclose(plain[n], again[n], atol=1e-6), n
    assert any(float(g.abs().sum()) > 0 for n, g in again.items() if n.endswith("lora_A"))


def _vision_adapter_grads(policy, base) -> list:
    """The tower adapters' B gradients after one backward; before it, the untrained adapters give the base's
    logprobs exactly."""
    mb = sequences(policy.adapter)
    with torch.no_grad():
        assert torch.equal(policy.logprobs(mb)[0], base.logprobs(mb)[0])
    lp, _ = policy.logprobs(mb)
    (-lp.mean()).backward()
    return [m.lora_B.grad for n, m in lora_modules(policy.model).items() if ".visual." in n]


def test_vision_tower_adapters_train_through_the_image_features(tiny_model, base):
    policy = build_policy(model_cfg(tiny_model, targets=["q_proj"], vision_targets=["qkv"]), build_parallel_dims())
    names = list(lora_modules(policy.model))
    assert any(".visual." in n for n in names) and all(n.endswith(("q_proj", "qkv")) for n in names)
    vision_b = _vision_adapter_grads(policy, base)
    assert all(g is not None for g in vision_b) and any(float(g.abs().sum()) > 0 for g in vision_b)


def test_vision_mlp_adapters_train_with_the_padded_mlp(tiny_model, base):
    """model.pad_vision_mlp with LoRA on the tower's MLP projections: the wrapped MLPs keep their own forward, so
    the adapters see the input and train; unwrapped ones are still padded."""
    mlp = ["gate_proj", "up_proj", "down_proj"]
    cfg = model_cfg(tiny_model, targets=["q_proj"], vision_targets=mlp)
    cfg.pad_vision_mlp = "true"
    policy = build_policy(cfg, build_parallel_dims())
    assert policy.padded_vision_mlps == 0  # every tower MLP is wrapped: none padded
    names = [n for n in lora_modules(policy.model) if ".visual." in n]
    assert names and all(n.endswith(tuple(mlp)) for n in names)
    vision_b = _vision_adapter_grads(policy, base)
    assert all(g is not None for g in vision_b) and all(float(g.abs().sum()) > 0 for g in vision_b)
    cfg = model_cfg(tiny_model, targets=["q_proj"])
    cfg.pad_vision_mlp = "true"
    assert build_policy(cfg, build_parallel_dims()).padded_vision_mlps > 0  # no tower adapters: padded


def test_a_padded_mlp_whose_projection_is_wrapped_later_runs_its_own_forward():
    from models.lora import LoraLinear
    from models.policy import pad_mlp_widths

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False)
            self.down_proj = nn.Linear(12, 8, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    MLP.__name__ = "Qwen2_5_VLMLP"
    torch.manual_seed(0)
    m = MLP()
    assert pad_mlp_widths(m, multiple=16) == 1
    x = torch.randn(3, 8)
    plain = m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x))
    torch.testing.assert_close(m(x), plain)
    m.gate_proj = LoraLinear(m.gate_proj, 2, 4.0)
    with torch.no_grad():
        m.gate_proj.lora_A.normal_()
        m.gate_proj.lora_B.normal_()
    torch.testing.assert_close(m(x), m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x)))
    assert not torch.allclose(m(x), plain)
