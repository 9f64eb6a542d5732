"""model.vision_once: a pass runs the vision tower once per chunk of micro-batches (models.policy.PassVision)
instead of once per micro-batch; a trained tower runs its backward once, after the last micro-batch, from its
features' summed gradients. The logprobs and every gradient equal the per-micro-batch pass's (fp32, CPU), with
prompt images shared by a group's episodes, tool images in second turns, and the step split over micro-batches
and tower calls."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError, ModelConfig, load_config
from grpo.update import PackedStep, optimizer_step, packed_logprobs
from models.policy import runs_vision_once, vision_plan


@pytest.fixture(scope="module")
def policy(tiny_model):
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    torch.manual_seed(0)
    return build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True, vision_once="on"),
                        build_parallel_dims())


@pytest.fixture(scope="module")
def batch(tiny_model, policy):
    from tests.test_shared_prompts import episode_rows

    return episode_rows(tiny_model, policy.adapter)


class _Recorder:
    """An optimizer that keeps the gradients `optimizer_step` hands it and changes nothing."""

    def __init__(self, model):
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


def _tower_calls(policy) -> list[int]:
    calls: list[int] = []
    policy.adapter.vision_tower(policy.model).register_forward_hook(lambda m, a, o: calls.append(1))
    return calls


def _step(policy, batch, max_tokens: int, once: bool, calls: list[int]):
    policy.vision_once = once
    step = PackedStep(batch, max_tokens, policy.device, True)
    seed = torch.Generator().manual_seed(1)
    step.set_per_token("w", [torch.rand(int(m[1:].sum()), generator=seed) for m in batch["loss_mask"].items])
    recorder = _Recorder(policy.model)

    def loss_fn(lp, mb, denominators):
        return (lp * mb.fields["w"]).sum(), {"w_sum": mb.fields["w"].sum()}

    calls.clear()
    out = optimizer_step(policy, recorder, step, loss_fn, max_tokens=max_tokens, grad_clip=0.0, denominators={})
    update_calls = len(calls)
    packed_logprobs(policy, step, "lp")
    assert all(mb.vision is None for mb in step.microbatches)  # nothing of the pass is left on the micro-batches
    return step, out, recorder.grads, update_calls, len(calls) - update_calls


@pytest.mark.parametrize("max_tokens", [1 << 20, 160, 40])
def test_vision_once_gives_the_per_microbatch_logprobs_and_gradients(policy, batch, max_tokens):
    calls = _tower_calls(policy)
    try:
        step, out, grads, calls_update, calls_lp = _step(policy, batch, max_tokens, False, calls)
        step_once, out_once, grads_once, calls_update_once, calls_lp_once = _step(policy, batch, max_tokens, True,
                                                                                  calls)
    finally:
        policy.vision_once = True
    for a, b in zip(step.per_sample("lp"), step_once.per_sample("lp")):
        assert a.numel() > 0
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    assert out_once["w_sum"] == pytest.approx(out["w_sum"])
    assert out_once["loss/total"] == pytest.approx(out["loss/total"], rel=1e-5)
    tower = {n for n, _ in policy.adapter.vision_tower(policy.model).named_parameters()}
    assert grads.keys() == grads_once.keys() and any(n.endswith(t) for n in grads for t in tower)
    for name in grads:
        torch.testing.assert_close(grads_once[name], grads[name], atol=2e-5, rtol=1e-4, msg=name)
    with_images = sum(mb.pixel_values is not None for mb in step.microbatches)
    plan = vision_plan(policy, step_once.microbatches, max_tokens)
    assert calls_update == calls_lp == with_images  # per micro-batch: one tower call each
    assert calls_lp_once == len(plan) and calls_update_once == 2 * len(plan)  # per chunk: encode, then recompute
    assert sorted(j for members in plan for j in members) == [
        j for j, mb in enumerate(step_once.microbatches) if mb.pixel_values is not None]
    if max_tokens == 160:  # several micro-batches, their images in one tower call
        assert with_images > 1 and len(plan) == 1
    if max_tokens == 40:  # chunks of at most 20 feature rows
        assert len(plan) > 1


def test_a_frozen_tower_runs_no_second_forward(tiny_model, batch):
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    torch.manual_seed(0)
    frozen = build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True, vision_once="on",
                                      freeze_vision_tower=True), build_parallel_dims())
    calls = _tower_calls(frozen)
    try:
        step, _, grads, _, _ = _step(frozen, batch, 160, False, calls)
        _, _, grads_once, calls_update_once, _ = _step(frozen, batch, 160, True, calls)
    finally:
        frozen.vision_once = True
    assert calls_update_once == len(vision_plan(frozen, step.microbatches, 160)) == 1
    assert grads.keys() == grads_once.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads_once[name], grads[name], atol=2e-5, rtol=1e-4, msg=name)


def test_vision_once_settles_by_family_device_and_exact_mode(tiny_model):
    from models.family import FamilyAdapter, build_adapter
    from models.policy import load_model_config

    projected = FamilyAdapter("projected", "ProjectedForConditionalGeneration", 0)  # vision_in_tower false
    assert not runs_vision_once("auto", projected, "cuda")
    with pytest.raises(ValueError, match="model.vision_once' is on, but model family 'projected'"):
        runs_vision_once("on", projected, "cuda")
    qwen = build_adapter(load_model_config(str(tiny_model)))
    assert runs_vision_once("auto", qwen, "cuda") and not runs_vision_once("auto", qwen, "cpu")
    assert runs_vision_once("on", qwen, "cpu") and not runs_vision_once("off", qwen, "cuda")
    cfg = load_config(None, [f"model.path={tiny_model}"])
    assert cfg.model.vision_once == "auto"
    assert load_config(None, [f"model.path={tiny_model}", "rollout.exact=true"]).model.vision_once == "off"
    assert load_config(None, [f"model.path={tiny_model}", "model.vision_once=true"]).model.vision_once == "on"
    with pytest.raises(ConfigError, match="'model.vision_once' is on with rollout.exact=true"):
        load_config(None, [f"model.path={tiny_model}", "model.vision_once=on", "rollout.exact=true"])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_once_with_videos_and_deepstack_streams(family, tiny_model, tmp_path_factory):
    """Rows of videos, images then videos, text only and images only, over several micro-batches: the pass's
    tower calls hold videos and images together, and Qwen3-VL's DeepStack streams (several per call) each get
    their gradient back; logprobs and gradients equal the per-micro-batch pass's."""
    from data.processing import load_processor
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_video_model import _batch, _rows
    from tools.make_tiny_model import make_tiny_model

    path = tiny_model if family == "qwen2_5_vl" else make_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny_qwen3_vl", family="qwen3_vl", size="tiny", seed=0)
    init_distributed()
    torch.manual_seed(0)
    policy = build_policy(ModelConfig(path=str(path), shared_prompts=True, vision_once="on"), build_parallel_dims())
    processor = load_processor(str(path))
    batch = _batch(policy.adapter, _rows(processor, policy.adapter, processor.images.factor), [0, 0, 1, 1, 2, 3])
    from models.policy import VisionChunk

    with torch.no_grad():  # through the root module, as a pass calls it (FSDP gathers from the root first)
        streams = policy.model(VisionChunk(batch["pixel_values"].items[5], batch["image_grid_thw"].items[5], None))
    assert (len(streams) > 1) == (family == "qwen3_vl")  # DeepStack: a stream per level
    calls = _tower_calls(policy)
    max_tokens = 60
    step, _, grads, _, _ = _step(policy, batch, max_tokens, False, calls)
    step_once, _, grads_once, calls_update, _ = _step(policy, batch, max_tokens, True, calls)
    plan = vision_plan(policy, step_once.microbatches, max_tokens)
    with_videos = sum(mb.pixel_values_videos is not None for mb in step.microbatches)
    assert with_videos >= 1 and len(step.microbatches) > 2, len(step.microbatches)
    assert calls_update == 2 * len(plan) and len(plan) < sum(
        mb.pixel_values is not None or mb.pixel_values_videos is not None for mb in step.microbatches)
    for a, b in zip(step.per_sample("lp"), step_once.per_sample("lp")):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    tower = {n for n, _ in policy.adapter.vision_tower(policy.model).named_parameters()}
    assert grads.keys() == grads_once.keys() and any(n.endswith(t) for n in grads for t in tower)
    for name in grads:
        torch.testing.assert_close(grads_once[name], grads[name], atol=2e-5, rtol=1e-4, msg=name)


def _pair(tiny_model, key: str) -> tuple:
    """Two fp32 policies of the tiny model, with the tower once per pass, `key` off then on."""
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    policies = []
    for on in (False, True):
        torch.manual_seed(0)
        policies.append(build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True, vision_once="on",
                                                 **{key: on}), build_parallel_dims()))
    return tuple(policies)


def _same_step(plain, other, batch) -> dict:
    """`other`'s update and logprob pass give `plain`'s logprobs and gradients (fp32); returns the gradients."""
    calls: list[int] = []
    step, _, grads, _, _ = _step(plain, batch, 160, True, calls)
    step_other, _, grads_other, _, _ = _step(other, batch, 160, True, calls)
    for a, b in zip(step.per_sample("lp"), step_other.per_sample("lp")):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    assert grads.keys() == grads_other.keys()
    for name in grads:
        assert grads_other[name].shape == grads[name].shape
        torch.testing.assert_close(grads_other[name], grads[name], atol=2e-5, rtol=1e-4, msg=name)
    return grads


def test_padded_vision_mlp_gives_the_unpadded_logprobs_and_gradients(tiny_model, batch):
    """model.pad_vision_mlp: the tower's gated MLPs run at a width that is a multiple of 128 (the tiny model's 64
    → 128), zero-padded in each forward; the parameters keep their shapes and the logprobs and gradients are the
    unpadded model's (fp32)."""
    from models.policy import pad_mlp_widths

    plain, padded = _pair(tiny_model, "pad_vision_mlp")
    tower = padded.adapter.vision_tower(padded.model)
    assert [n for n, m in tower.named_modules() if "forward" in m.__dict__ and n.endswith("mlp")]
    assert pad_mlp_widths(plain.adapter.vision_tower(plain.model), multiple=64) == 0  # already a multiple
    grads = _same_step(plain, padded, batch)
    assert any(".mlp.gate_proj." in n and "visual" in n for n in grads)
    with pytest.raises(ConfigError, match="'model.pad_vision_mlp' is true with rollout.exact=true"):
        load_config(None, [f"model.path={tiny_model}", "model.pad_vision_mlp=true", "rollout.exact=true"])


def test_torch_rms_norm_gives_the_module_s_logprobs_and_gradients(tiny_model, batch):
    """model.torch_rms_norm: every RMSNorm of the language model and the vision tower runs torch's rms_norm; the
    logprobs and gradients are the transformers modules' (fp32); refused with rollout.exact."""
    from models.policy import TORCH_RMS_NORMS

    plain, routed = _pair(tiny_model, "torch_rms_norm")
    norms = [n for n, m in routed.model.named_modules() if type(m).__name__ in TORCH_RMS_NORMS]
    tower = routed.adapter.vision_tower(routed.model)
    assert plain.torch_rms_norms == 0 and routed.torch_rms_norms == len(norms) > 0
    assert any("forward" in m.__dict__ for m in tower.modules() if type(m).__name__ in TORCH_RMS_NORMS)
    grads = _same_step(plain, routed, batch)
    assert any("norm" in n for n in grads)
    with pytest.raises(ConfigError, match="'model.torch_rms_norm' is true with rollout.exact=true"):
        load_config(None, [f"model.path={tiny_model}", "model.torch_rms_norm=true", "rollout.exact=true"])


@pytest.mark.parametrize("key", ["pad_vision_mlp", "torch_rms_norm"])
def test_cuda_switches_settle(tiny_model, key):
    """model.pad_vision_mlp and model.torch_rms_norm: auto is on CUDA, off elsewhere and with rollout.exact;
    true/false (or booleans) as given. model.flash_direct's auto is on CUDA too (exact mode's attention is not
    the varlen kernel, so it stays auto there)."""
    from models.policy import cuda_switch

    assert getattr(load_config(None, [f"model.path={tiny_model}"]).model, key) == "auto"
    assert getattr(load_config(None, [f"model.path={tiny_model}", "rollout.exact=true"]).model, key) == "false"
    assert getattr(load_config(None, [f"model.path={tiny_model}", f"model.{key}=false"]).model, key) == "false"
    assert getattr(load_config(None, [f"model.path={tiny_model}", f"model.{key}=true"]).model, key) == "true"
    assert load_config(None, [f"model.path={tiny_model}", "rollout.exact=true"]).model.flash_direct == "auto"
    assert [cuda_switch(s, d) for s, d in (("auto", "cuda"), ("auto", "cpu"), ("true", "cpu"), (True, "cpu"),
                                               ("false", "cuda"), (False, "cuda"))] == [True, False, True, True,
                                                                                      False, False]


def _tower_gathers(policy) -> list[int]:
    """Each time the tower's FSDP unit makes its compute copy (sharded → unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    tower = policy.adapter.vision_tower(policy.model)
    assert isinstance(tower, FSDPModule)
    group = tower._get_fsdp_state()._fsdp_param_group
    made: list[int] = []
    inner = group._to_unsharded

    def to_unsharded():
        made.append(int(not group.is_unsharded))
        return inner()

    group._to_unsharded = to_unsharded
    return made


@pytest.mark.parametrize("hold", [True, False])
def test_a_trained_tower_is_gathered_once_a_step(tiny_model, batch, monkeypatch, hold):
    """One rank: the tower's compute copy is made for its features' forward and kept through the micro-batches to
    its own backward, then freed; two optimizer steps give the weights that making it again for the backward
    gives (a stale copy would not: the second step's forward must see the first step's update)."""
    import grpo.update as update
    from grpo.config import OptimConfig
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    def run(keep: bool):
        torch.manual_seed(0)
        policy = build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True, vision_once="on"),
                              build_parallel_dims(one_device="fsdp"))
        optimizer = update.build_optimizer(policy, OptimConfig(lr=1e-2))
        made = _tower_gathers(policy)
        if not keep:
            monkeypatch.setattr(update, "_kept_tower", lambda policy, vision: None)
        counts = []
        for _ in range(2):
            step = PackedStep(batch, 160, policy.device, True)
            assert sum(mb.pixel_values is not None for mb in step.microbatches) > 1  # several micro-batches
            made.clear()
            out = optimizer_step(policy, optimizer, step, lambda lp, mb, den: (lp.sum() / 100, {}), max_tokens=160,
                                 grad_clip=0.0, denominators={}, unsharded_accumulation=hold)
            assert out["loss/grad_norm"] > 0
            counts.append(sum(made))
            group = policy.adapter.vision_tower(policy.model)._get_fsdp_state()._fsdp_param_group
            assert group.is_sharded  # freed when the step ends, as before
        monkeypatch.undo()
        weights = {n: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                   for n, p in policy.model.named_parameters()}
        return counts, weights

    kept, weights_kept = run(True)
    again, weights_again = run(False)
    assert kept == [1, 1] and again == [2, 2]
    tower = [n for n in weights_kept if ".visual." in f".{n}"]
    assert tower and weights_kept.keys() == weights_again.keys()
    for name, w in weights_again.items():
        torch.testing.assert_close(weights_kept[name], w, rtol=0, atol=0, msg=name)
