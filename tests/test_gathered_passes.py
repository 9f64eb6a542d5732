"""Forward-only passes (reference and old logprobs) with one data-parallel rank: each FSDP unit's compute copy is
made once for the whole pass, not once per micro-batch (`Policy.gathered`), with the same logprobs; the copies are
freed when the pass ends, and a frozen model reshards after each forward again."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from grpo.config import ModelConfig
from grpo.update import PackedStep, packed_logprobs
from tests.test_nonfinite import text_batch


def test_reference_pass_gathers_each_unit_once(tiny_model, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    ref = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims(), trainable=False)
    units = [m for m in ref.model.modules() if isinstance(m, FSDPModule)]
    gathers = []

    def owned(unit):  # (module, name) of the parameters this unit manages (not those of units inside it)
        inner = [m for m in unit.modules() if isinstance(m, FSDPModule) and m is not unit]
        skip = {id(p) for m in inner for p in m.parameters()}
        return [(m, n) for m in unit.modules() for n, p in m.named_parameters(recurse=False) if id(p) not in skip]

    def counter(params):
        def count_gather(module, args, kwargs):  # runs before FSDP's own pre-forward: sharded means a gather
            if isinstance(params[0][0]._parameters[params[0][1]], DTensor):
                gathers.append(module)
        return count_gather

    for unit in units:
        unit.register_forward_pre_hook(counter(owned(unit)), prepend=True, with_kwargs=True)
    batch = text_batch(ref, vocab=int(ref.model.config.get_text_config().vocab_size))

    def reference_pass(held: bool) -> tuple[torch.Tensor, int]:
        step = PackedStep(batch, 12, ref.device)  # the two sequences (12 and 9 tokens): two micro-batches
        assert len(step.microbatches) == 2
        gathers.clear()
        if held:
            packed_logprobs(ref, step, "ref")
        else:
            for mb, f in step:  # the pass as it was: every micro-batch gathers every unit it runs
                f["ref"] = ref.logprobs(mb)[0].float()
        return torch.cat([f["ref"] for _, f in step]), len(gathers)

    plain, plain_gathers = reference_pass(held=False)
    held, held_gathers = reference_pass(held=True)
    assert len(units) > 1 and plain_gathers > held_gathers > 0, (len(units), plain_gathers, held_gathers)
    assert held_gathers <= len(units)  # once per unit (the text-only rows never run the vision tower's unit)
    assert torch.equal(held, plain)
    again, again_gathers = reference_pass(held=False)  # resharded at the end, reshard-after-forward restored
    assert again_gathers == plain_gathers and torch.equal(again, plain)


def test_frozen_reference_is_stored_in_the_compute_dtype(tiny_model):
    """A bf16 reference keeps bf16 parameters (half the memory of the fp32 master copy) and gives the same
    logprobs as the trainable policy, whose fp32 weights FSDP casts to bf16 for every forward."""
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_packing import mixed_batch

    init_distributed()
    cfg = ModelConfig(path=str(tiny_model), dtype="bfloat16")
    policy = build_policy(cfg, build_parallel_dims())
    ref = build_policy(cfg, build_parallel_dims(), trainable=False)
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}
    batch = mixed_batch(policy.adapter)  # images of three sizes, a text-only row, two images in one sample
    step = PackedStep(batch, 1 << 30, policy.device)
    packed_logprobs(policy, step, "policy")
    packed_logprobs(ref, step, "ref")
    for _, f in step:
        assert f["ref"].numel() > 0 and torch.equal(f["ref"], f["policy"])
