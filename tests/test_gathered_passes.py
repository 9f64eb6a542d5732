"""Forward-only passes (reference and old logprobs) with one data-parallel rank: each FSDP unit's compute copy is
made once for the whole pass, not once per micro-batch (`Policy.gathered`), with the same logprobs; the copies are
freed when the pass ends, and a frozen model reshards after each forward again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from grpo.config import ModelConfig
from grpo.update import PackedStep, packed_logprobs
from models.family import FAMILIES
from tests.test_nonfinite import text_batch


def test_a_forward_only_pass_gathers_each_unit_once(tiny_model):
    """The old logprobs' pass over a trained model on one rank: each unit's copy made once, freed at the end."""
    from torch.distributed.fsdp import FSDPModule

    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims(one_device="fsdp"))
    units = [m for m in policy.model.modules() if isinstance(m, FSDPModule)]
    gathers = []

    def owned(unit):  # (module, name) of the parameters this unit manages (not those of units inside it)
        inner = [m for m in unit.modules() if isinstance(m, FSDPModule) and m is not unit]
        skip = {id(p) for m in inner for p in m.parameters()}
        return [(m, n) for m in unit.modules() for n, p in m.named_parameters(recurse=False) if id(p) not in skip]

    def sharded(params) -> bool:
        return isinstance(params[0][0]._parameters[params[0][1]], DTensor)

    def counter(params):
        def count_gather(module, args, kwargs):  # runs before FSDP's own pre-forward: sharded means a gather
            if sharded(params):
                gathers.append(module)
        return count_gather

    for unit in units:
        unit.register_forward_pre_hook(counter(owned(unit)), prepend=True, with_kwargs=True)
    batch = text_batch(policy, vocab=int(policy.model.config.get_text_config().vocab_size))
    step = PackedStep(batch, 12, policy.device)  # the two sequences (12 and 9 tokens): two micro-batches
    assert len(step.microbatches) == 2
    packed_logprobs(policy, step, "old")
    assert len(units) > 1 and 0 < len(gathers) <= len(units)  # the text-only rows never run the tower's unit
    assert len(set(map(id, gathers))) == len(gathers)
    assert all(sharded(owned(unit)) for unit in units)  # every copy freed when the pass ended
    with torch.no_grad():
        per_mb = torch.cat([policy.logprobs(mb)[0].float() for mb, _ in step])
    assert torch.equal(torch.cat([f["old"] for _, f in step]), per_mb)


def test_frozen_reference_is_stored_in_the_compute_dtype(tiny_model):
    """A bf16 reference keeps bf16 parameters (half the memory of the fp32 master copy) and gives the same
    logprobs as the trainable policy, whose fp32 weights FSDP casts to bf16 for every forward."""
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_packing import mixed_batch

    init_distributed()
    cfg = ModelConfig(path=str(tiny_model), dtype="bfloat16")
    policy = build_policy(cfg, build_parallel_dims(one_device="fsdp"))
    ref = build_policy(cfg, build_parallel_dims(one_device="fsdp"), trainable=False)
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}
    batch = mixed_batch(policy.adapter)  # images of three sizes, a text-only row, two images in one sample
    step = PackedStep(batch, 1 << 30, policy.device)
    packed_logprobs(policy, step, "policy")
    packed_logprobs(ref, step, "ref")
    for _, f in step:
        assert f["ref"].numel() > 0 and torch.equal(f["ref"], f["policy"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_frozen_reference_on_one_device_runs_without_fsdp(family, tmp_path):
    """On one device the reference is a plain module in the compute dtype: no FSDP unit, no DTensor, so no second
    copy of its weights in a pass and no hooks around its units. Its logprobs equal, bit for bit in bf16, those of
    the trainable policy, whose FSDP casts the fp32 weights and every unit's floating inputs to bf16: the casts
    it makes and the reference does not change nothing, in every family (images of two sizes, a text-only
    prompt; the tower, the decoder and the head)."""
    from torch.distributed.fsdp import FSDPModule

    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_families import _policy_logprobs, _prompts
    from tools.make_tiny_model import make_tiny_model

    init_distributed()
    path = make_tiny_model(tmp_path / family, family=family, size="tiny", seed=0)
    cfg = ModelConfig(path=str(path), dtype="bfloat16", attn_implementation="sdpa")
    policy = build_policy(cfg, build_parallel_dims(one_device="fsdp"))
    ref = build_policy(cfg, build_parallel_dims(one_device="fsdp"), trainable=False)
    assert any(isinstance(m, FSDPModule) for m in policy.model.modules())
    assert ref.fsdp_units == [] and not any(isinstance(p, DTensor) for p in ref.model.parameters())
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}
    prompts = _prompts(path)
    g = torch.Generator().manual_seed(0)
    gens = [SimpleNamespace(token_ids=torch.randint(10, 1000, (6,), generator=g).tolist(), prompt_index=i // 2)
            for i in range(2 * len(prompts))]
    mine, theirs = (_policy_logprobs(p, prompts, gens, max_per_bin=3) for p in (ref, policy))
    assert sum(t.numel() for t in mine) == 6 * len(gens)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b), (a - b).abs().max()
