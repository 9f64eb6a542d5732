"""Qwen3.5-MoE under FSDP2: each decoder block's fused experts are an FSDP unit of their own, and one
update (with the routers' load-balancing loss) over two gloo ranks equals the same update on one rank."""

import pytest
import torch
import torch.distributed as dist

from grpo.config import ModelConfig, OptimConfig
from grpo.update import build_optimizer
from models.parallel import build_parallel_dims, init_distributed
from models.policy import build_policy


@pytest.fixture(scope="module")
def moe_folder(tiny_moe_model):
    return tiny_moe_model


def _policy(path: str):
    policy = build_policy(ModelConfig(path=path, dtype="float32", attn_implementation="sdpa",
                                      router_aux_loss_coef=0.5), build_parallel_dims(one_device="fsdp"))
    return policy


def one_update(path: str) -> tuple[dict, dict]:
    """One AdamW step on a fixed batch (the same on every rank), the loss plus the routers' aux loss;
    the full weights before and after (a collective)."""
    from tests.test_lora import sequences

    policy = _policy(path)
    before = {n: t.clone() for n, t in policy.full_state_dict()}
    opt = build_optimizer(policy, OptimConfig(lr=1e-2))
    lp, _ = policy.logprobs(sequences(policy.adapter))
    (-lp.mean() + policy.router_aux_coef * policy.router_aux).backward()
    opt.step()
    return before, {n: t.clone() for n, t in policy.full_state_dict()}


def test_experts_are_units_of_their_own(moe_folder):
    from torch.distributed.fsdp import FSDPModule

    init_distributed()
    policy = _policy(str(moe_folder))
    layers = policy.adapter.decoder_layers(policy.model)
    assert all(isinstance(m, FSDPModule) for layer in layers for m in (layer, layer.mlp.experts))
    assert not any(isinstance(layer.mlp.gate, FSDPModule) or isinstance(layer.mlp.shared_expert, FSDPModule)
                   for layer in layers)  # router and shared expert stay in the block's unit


@pytest.mark.slow
def test_two_rank_update_matches_one_rank(moe_folder, tmp_path):
    from safetensors.torch import load_file

    from tests.conftest import run_torchrun

    out = tmp_path / "two.safetensors"
    run_torchrun(["-m", "tests.test_moe_fsdp", str(moe_folder), str(out)], nproc=2)
    two = load_file(str(out))
    init_distributed()
    before, one = one_update(str(moe_folder))
    assert one.keys() == two.keys()
    # AdamW's first step moves each weight by about lr * sign(grad) = 1e-2; where a gradient is at the
    # level of summation-order noise (two ranks add in another order), its step is noise-sized too:
    # one patch-embedding weight of 49,152 differed by 2e-6 on a 2-core CPU, one vision merger norm bias
    # of 32 by 2.5e-5 with 128-wide Gated DeltaNet heads. A wrong reduction moves 1e-2.
    for name, tensor in one.items():
        assert torch.allclose(tensor, two[name], atol=1e-4, rtol=1e-5), name
    experts = [n for n in one if n.endswith("mlp.experts.gate_up_proj")]
    assert experts and all(not torch.equal(before[n], one[n]) for n in experts)  # the experts trained
    routers = [n for n in one if n.endswith("mlp.gate.weight")]
    assert routers and all(not torch.equal(before[n], one[n]) for n in routers)


if __name__ == "__main__":  # one rank of the two-rank test, under torchrun
    import sys

    from safetensors.torch import save_file

    init_distributed()
    torch.set_num_threads(1)
    _, after = one_update(sys.argv[1])
    if dist.get_rank() == 0:
        save_file({n: t.contiguous() for n, t in after.items()}, sys.argv[2])
    dist.barrier()
