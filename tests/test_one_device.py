"""parallel.one_device=plain: a policy that trains on one device as a plain module (fp32 masters, a bf16 copy
swapped in for the step's passes, the copies' gradients added into fp32 after each backward) instead of FSDP units
over a mesh of one. In bf16 it computes what the FSDP policy computes, bit for bit: the logprobs, the gradient
norm and the weights after two AdamW steps over several micro-batches, with the vision tower run once per pass
and per micro-batch; and the refit's stream and a checkpoint round trip see the fp32 masters."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from grpo.config import ModelConfig, OptimConfig
from grpo.update import PackedStep, build_optimizer, optimizer_step, packed_logprobs
from models.parallel import ComputeCopy, build_parallel_dims, init_distributed
from models.policy import build_policy
from tests.test_packing import mixed_batch


def _policies(tiny_model, dtype="bfloat16", **model):
    init_distributed()
    cfg = ModelConfig(path=str(tiny_model), dtype=dtype, **model)
    return (build_policy(cfg, build_parallel_dims(one_device="fsdp")),
            build_policy(cfg, build_parallel_dims(one_device="plain")))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(policy, batch, max_tokens: int, steps: int = 2):
    optimizer = build_optimizer(policy, OptimConfig(lr=1e-2, weight_decay=0.1))
    norms, logprobs = [], []
    for _ in range(steps):
        step = PackedStep(batch, max_tokens, policy.device)
        g = torch.Generator().manual_seed(1)
        step.set_per_token("w", [torch.rand(int(m[1:].sum()), generator=g) for m in batch["loss_mask"].items])

        def loss_fn(lp, mb, denominators):
            return (lp * mb.fields["w"]).sum(), {}

        packed_logprobs(policy, step, "lp")
        logprobs.append(torch.cat([f["lp"] for _, f in step]))
        out = optimizer_step(policy, optimizer, step, loss_fn, max_tokens=max_tokens, grad_clip=1.0,
                             denominators={}, unsharded_accumulation=True)
        norms.append(out["loss/grad_norm"])
    return norms, logprobs, optimizer


@pytest.mark.parametrize("vision_once", ["off", "on"])
def test_plain_one_device_trains_as_fsdp_does(tiny_model, vision_once):
    fsdp, plain = _policies(tiny_model, vision_once=vision_once)
    assert plain.fsdp_units == [] and isinstance(plain.compute, ComputeCopy)
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
    assert {p.dtype for p in plain.model.parameters()} == {torch.float32}  # the masters
    batch = mixed_batch(fsdp.adapter)
    max_tokens = 40  # several micro-batches
    assert len(PackedStep(batch, max_tokens, fsdp.device).microbatches) > 2
    norms_f, lps_f, _ = _train(fsdp, batch, max_tokens)
    norms_p, lps_p, optimizer = _train(plain, batch, max_tokens)
    for a, b in zip(lps_f, lps_p):
        assert a.numel() > 0 and torch.equal(a, b), (a - b).abs().max()
    assert norms_f == norms_p and all(n > 0 for n in norms_p)
    assert not torch.equal(lps_p[0], lps_p[1])  # the first step moved the weights
    named_f = dict(fsdp.model.named_parameters())
    compared = 0
    for name, p in plain.model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is None, name
        assert torch.equal(_full(named_f[name]), p), name
        compared += 1
    assert compared > 10 and not plain.compute.active
    # AdamW's moments are fp32 and belong to the masters
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
    assert set(map(id, optimizer.state)) <= {id(p) for p in plain.model.parameters()}


def test_the_copies_come_and_go(tiny_model):
    fsdp, plain = _policies(tiny_model)
    batch = mixed_batch(plain.adapter)
    step = PackedStep(batch, 1 << 20, plain.device)
    with torch.no_grad():
        mb = step.microbatches[0]
        lp = plain.logprobs(mb)[0]
    assert plain.compute.active and {p.dtype for p in plain.model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(lp, fsdp.logprobs(mb)[0])
    stream = dict(plain.full_state_dict(torch.bfloat16))  # the masters' values, the copies released first
    assert not plain.compute.active
    for name, t in fsdp.full_state_dict(torch.bfloat16):
        assert torch.equal(stream[name], t), name
    # a backward outside the update: each group's gradients go into the masters in fp32 as soon as the group has
    # them all (the tower's, each block's, the rest's), so none waits in bf16 when the backward ends
    lp = plain.logprobs(mb)[0]
    lp.sum().backward()
    assert not any(c.grad is not None for c in plain.compute.copies.values())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in plain.compute.masters if p.requires_grad)
    plain.reshard()
    grads = [p.grad for p in plain.model.parameters() if p.grad is not None]
    assert grads and {g.dtype for g in grads} == {torch.float32}
    plain.offload()
    assert {p.device.type for p in plain.model.parameters()} == {"cpu"} and not plain.compute.active


@pytest.mark.parametrize("vision_once", ["off", "on"])
def test_the_copies_gradients_stay_within_the_plan(tiny_model, vision_once):
    """What the memory plan counts for the copies' gradients (`ComputeCopy.gradient_bytes`) holds their peak in a
    backward over images and text, and is not the whole model's."""
    from grpo.update import optimizer_step

    _, plain = _policies(tiny_model, vision_once=vision_once)
    compute, peak = plain.compute, [0]
    inner = compute._hook

    def hook(group):
        arrived = inner(group)

        def measured(copy):  # each copy's gradient just accumulated, before its group's are added in
            peak[0] = max(peak[0], sum(c.grad.numel() * c.grad.element_size()
                                       for c in compute.copies.values() if c.grad is not None))
            arrived(copy)
        return measured

    compute._hook = hook
    step = PackedStep(mixed_batch(plain.adapter), 40, plain.device)
    optimizer_step(plain, build_optimizer(plain, OptimConfig(lr=1e-2)), step, lambda lp, mb, d: (lp.sum(), {}),
                   max_tokens=40, grad_clip=1.0, denominators={}, unsharded_accumulation=True)
    whole = sum(p.numel() for p in compute.masters if p.requires_grad) * 2
    largest = max(sum(p.numel() for p in group) for group in compute.groups) * 2
    assert largest <= peak[0] <= compute.gradient_bytes() < whole, (largest, peak[0], compute.gradient_bytes(), whole)


def test_fp32_needs_no_copy(tiny_model):
    _, plain = _policies(tiny_model, dtype="float32")
    assert plain.compute is None and plain.fsdp_units == []


def test_the_config_key(tmp_path):
    from grpo.config import ConfigError, load_config

    assert load_config(None, ["parallel.one_device=plain"]).parallel.one_device == "plain"
    with pytest.raises(ConfigError, match="one_device"):
        load_config(None, ["parallel.one_device=sharded"])
    init_distributed()  # the start-up line says which it is
    assert "plain module" in build_parallel_dims(one_device="plain").describe()
    assert "(FSDP)" in build_parallel_dims(one_device="fsdp").describe()


def _run(tiny_model, clevr_parquet, run_dir, one_device: str, mode: str, steps: int, resume: str = "never"):
    from grpo.config import load_config
    from grpo.trainer import Trainer

    init_distributed()
    cfg = load_config(None, [
        f"trainer.mode={mode}", f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        "rollout.max_new_tokens=6", f"trainer.run_dir={run_dir}", "logging.tensorboard=false", "optim.lr=1e-2",
        "optim.weight_decay=0.1", "optim.max_tokens_per_microbatch=96", "model.dtype=bfloat16",
        *(["algorithm.kl_coef=0.01"] if mode == "grpo" else []), f"parallel.one_device={one_device}",
        f"trainer.max_steps={steps}", f"checkpoint.resume={resume}", "checkpoint.every_steps=1", "trainer.eval_every=0",
        "trainer.progress=false"])
    trainer = Trainer(cfg)
    trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grpo", "sft"])
def test_the_trainer_takes_the_same_steps_and_resumes(tiny_model, clevr_parquet, tmp_path, mode):
    """Two steps through the trainer in bf16 (GRPO: generation, the reference's KL, the refit from the masters; SFT:
    the answers' gradients), a checkpoint each step, then a third step resumed from the checkpoint: the weights
    equal the FSDP policy's after each run, bit for bit, and the losses and gradient norms are the same."""
    if mode == "grpo" and torch.cuda.is_available():
        pytest.skip("on CUDA this GRPO run's second gradient norm varies from run to run on either side (FSDP's: "
                    "3.501520e-05, then 3.501571e-05 on an H100, 2026-12-05): nothing bitwise to compare there")
    runs = {}
    for one_device in ("fsdp", "plain"):
        run_dir = tmp_path / one_device
        first = _run(tiny_model, clevr_parquet, run_dir, one_device, mode, steps=2)
        resumed = _run(tiny_model, clevr_parquet, run_dir, one_device, mode, steps=3, resume="auto")
        assert resumed.step == 3
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[one_device] = (first, resumed, [(r["step"], r["loss/total"], r["loss/grad_norm"]) for r in rows])
    assert isinstance(runs["plain"][1].policy.compute, ComputeCopy)
    assert runs["plain"][2] == runs["fsdp"][2] and len(runs["plain"][2]) >= 3
    if mode == "sft":
        assert all(norm > 0 for _, _, norm in runs["plain"][2])
    two, three = (dict(runs["plain"][k].policy.model.named_parameters()) for k in (0, 1))
    assert sum(not torch.equal(two[n], three[n]) for n in two) > 10  # the third step moved the weights
    for k in (0, 1):
        fsdp = dict(runs["fsdp"][k].policy.model.named_parameters())
        plain = dict(runs["plain"][k].policy.model.named_parameters())
        assert fsdp.keys() == plain.keys()
        for name, p in plain.items():
            assert p.dtype == torch.float32 and torch.equal(_full(fsdp[name]), p), (k, name)


@pytest.mark.slow
def test_a_checkpoint_resumes_across_the_setting(tiny_model, clevr_parquet, tmp_path):
    """A checkpoint FSDP's policy wrote (DTensor shards) resumes into the plain module, and its third step is the
    one FSDP takes."""
    _run(tiny_model, clevr_parquet, tmp_path / "a", "fsdp", "sft", steps=2)
    fsdp = _run(tiny_model, clevr_parquet, tmp_path / "a", "fsdp", "sft", steps=3, resume="auto")
    _run(tiny_model, clevr_parquet, tmp_path / "b", "fsdp", "sft", steps=2)
    plain = _run(tiny_model, clevr_parquet, tmp_path / "b", "plain", "sft", steps=3, resume="auto")
    assert plain.step == 3 and isinstance(plain.policy.compute, ComputeCopy)
    named = dict(fsdp.policy.model.named_parameters())
    for name, p in plain.policy.model.named_parameters():
        assert torch.equal(_full(named[name]), p), name
