"""The host's cost of pieces of the training step, the trainer's way against the plain way, in one JSON line.

    python tools/host_cost.py                       # all parts
    python tools/host_cost.py --parts optim --params 400 --numel 4096 --repeats 50

Parts (`--parts`, comma-separated):
  optim   the gradient clip and an AdamW step over `--params` one-device DTensors of `--numel` values: torch's over
          the DTensors against the trainer's on their local tensors (grpo.update.clip_gradients, grpo.update.AdamW).
          The tensors are tiny, so the times are the host's (Python, DTensor's dispatch, the launches).
  refit   `Policy.full_state_dict(bfloat16)` over a policy of the 3B model's depths at a tiny width
          (make_tiny_model --size tiny_hd128_deep, 825 tensors): the refit's stream as the trainer makes it, and the
          same tensors gathered by DTensor (`full_tensor`), as before `models.parallel.full_value`; and on the same
          policy the FSDP hold's setting, `Policy.reshard` and `Policy.gathered` over `Policy.fsdp_units`, against
          a walk over every submodule, as before.
  gc      a full garbage collection in the process of the tiny trainer (configs/demo.yaml, torch engine) after two
          GRPO steps, before and after `grpo.trainer.freeze_survivors` (trainer.gc_freeze), and the objects it walks.
  pack    `models.packing.prompt_groups` over the 3B recipe's step shape (16 prompts x 8 responses x 256 tokens,
          448x448 images) on the tiny model.
  ref     the frozen reference's logprob pass on one device (`--ref-seqs` text sequences of `--ref-len` tokens, two
          to a micro-batch) over the 3B model's depths at a tiny width, in fp32 and in bf16: the plain module the
          trainer builds, against the same model in FSDP units as before (one gather per unit and pass, its hooks
          and input casts in every micro-batch); the two passes' logprobs compared bit for bit.
  train   the trainer's update (`grpo.update.optimizer_step`: the passes, the clip, the reads; an optimizer that
          moves nothing) over the same micro-batches, in fp32 and in bf16: the policy in FSDP units, held as the
          trainer holds them, against `parallel.one_device=plain` (a plain module; in bf16 its compute copies):
          what FSDP costs on one rank. The two updates' loss and gradient norm compared bit for bit. The model is
          the 3B's depths at width 256 (`--train-size`; tiny_deep: at width 64, where a CPU's time is mostly the
          host's work per module and op, as on a GPU that waits for its host).
Medians of `--repeats` calls after one warm-up, in milliseconds. Models and data are made under `--workdir`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.update import AdamW, clip_gradients  # noqa: E402
from models.parallel import init_distributed  # noqa: E402

PARTS = ("optim", "refit", "gc", "pack", "ref", "train")


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 3)


def measure(params: int = 825, numel: int = 64, repeats: int = 20) -> dict:
    """The `optim` part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init_distributed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (1,))
    tensors = [torch.nn.Parameter(distribute_tensor(torch.randn(numel, device=device), mesh, [Shard(0)]))
               for _ in range(params)]
    for p in tensors:
        p.grad = distribute_tensor(torch.randn(numel, device=device), mesh, [Shard(0)])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    out = {"device": device, "params": params, "numel": numel, "repeats": repeats, "optimizer": next(iter(fused))}
    out["clip_torch_ms"] = _median_ms(lambda: (torch.nn.utils.clip_grad_norm_(tensors, 1.0), sync()), repeats)
    out["clip_local_ms"] = _median_ms(lambda: (clip_gradients(tensors, 1.0), sync()), repeats)
    for name, cls in (("adamw_torch_ms", torch.optim.AdamW), ("adamw_local_ms", AdamW)):
        optimizer = cls(tensors, lr=1e-6, **fused)
        out[name] = _median_ms(lambda: (optimizer.step(), sync()), repeats)
    return out


def _model(workdir: Path, size: str) -> Path:
    from tools.make_tiny_model import make_tiny_model

    out = workdir / f"qwen2_5_vl_{size}"
    if not (out / "config.json").is_file():
        make_tiny_model(out, family="qwen2_5_vl", size=size, seed=0, overwrite=True)
    return out


def _dataset(workdir: Path, side: int, rows: int) -> Path:
    from tools.make_dataset import make_dataset

    out = workdir / f"clevr_{side}.parquet"
    if not out.is_file():
        make_dataset("clevr", rows, 0, out, size=(side, side), max_objects=4)
    return out


def measure_refit(workdir: Path, repeats: int) -> dict:
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    init_distributed()
    policy = build_policy(ModelConfig(path=str(_model(workdir, "tiny_hd128_deep"))),
                          build_parallel_dims(one_device="fsdp"))  # FSDP units: the hold and the gather

    def gathered():
        for t in policy.model.state_dict().values():
            t.full_tensor().to(torch.bfloat16)

    from torch.distributed.fsdp import FSDPModule

    from grpo.update import _Hold

    model, hold = policy.model, _Hold(policy)

    def walked_hold():  # a hold setting as a walk over every submodule sets it
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)

    def walked_reshard():
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def gathered_pass():
        with policy.gathered():
            pass

    return {"refit_tensors": len(policy.model.state_dict()),
            "refit_stream_ms": _median_ms(lambda: list(policy.full_state_dict(torch.bfloat16)), repeats),
            "refit_gathered_ms": _median_ms(gathered, repeats),
            "fsdp_units": len(policy.fsdp_units), "submodules": sum(1 for _ in model.modules()),
            "hold_walk_ms": _median_ms(walked_hold, repeats),
            "hold_units_ms": _median_ms(lambda: (hold(True), hold(False)), repeats) / 2,
            "reshard_walk_ms": _median_ms(walked_reshard, repeats),
            "reshard_units_ms": _median_ms(policy.reshard, repeats),
            "gathered_units_ms": _median_ms(gathered_pass, repeats)}


def _trainer(workdir: Path, config: str, overrides: list[str]):
    from grpo.config import load_config
    from grpo.trainer import Trainer

    init_distributed()
    return Trainer(load_config(config, [
        f"model.path={_model(workdir, 'tiny')}", "data.eval_path=", "rollout.engine=torch", "logging.tensorboard=false",
        "checkpoint.resume=overwrite", "checkpoint.every_steps=0", "checkpoint.at_end=false", "trainer.eval_every=0",
        *overrides]))


def measure_gc(workdir: Path, repeats: int) -> dict:
    trainer = _trainer(workdir, "configs/demo.yaml", [
        f"data.train_path={_dataset(workdir, 56, 48)}", "rollout.n=4", "data.prompts_per_step=4",
        "data.min_pixels=3136", "data.max_pixels=3136", "rollout.max_new_tokens=8", "trainer.max_steps=2",
        f"trainer.run_dir={workdir / 'gc_run'}", "trainer.gc_freeze=false", "trainer.progress=false"])
    trainer.train()
    from grpo.trainer import freeze_survivors

    out = {"gc_objects": len(gc.get_objects()), "gc_full_ms": _median_ms(gc.collect, repeats)}
    try:
        freeze_survivors()
        out.update(gc_objects_frozen=len(gc.get_objects()), gc_full_frozen_ms=_median_ms(gc.collect, repeats))
    finally:
        gc.unfreeze()
    return out


def measure_pack(workdir: Path, repeats: int) -> dict:
    from models.packing import prompt_groups

    trainer = _trainer(workdir, "configs/clevr_qwen2_5_vl_3b.yaml", [
        f"data.train_path={_dataset(workdir, 448, 64)}", "data.prompts_per_step=16",
        f"trainer.run_dir={workdir / 'pack_run'}"])
    prompts = trainer.feeder.next(16)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 1000, (256,), generator=g) for _ in range(128)]
    batch = trainer._sequence_batch(prompts, responses, [i // 8 for i in range(128)])
    return {"pack_sequences": len(batch), "prompt_groups_ms": _median_ms(lambda: prompt_groups(batch), repeats)}


def _text_batch(adapter, seqs: int, length: int):
    from data.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, 1000, (length,), generator=g) for _ in range(seqs)]
    masks = [torch.cat([torch.zeros(length // 2, dtype=torch.long), torch.ones(length - length // 2, dtype=torch.long)])
             for _ in range(seqs)]
    batch = Batch({"input_ids": ids, "loss_mask": masks, "pixel_values": [None] * seqs,
                   "image_grid_thw": [None] * seqs})
    batch["position_ids"] = [adapter.position_ids(seq, None) for seq in ids]
    return batch


def _in_fsdp_units(policy) -> None:
    """The frozen model in FSDP units as `apply_parallelism` made them on one device before: each unit reshards
    after its forward, and a pass keeps every unit's copy from its first micro-batch to its last."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from models.parallel import unit_modules

    mp = MixedPrecisionPolicy(param_dtype=policy.dtype, reduce_dtype=torch.float32) \
        if policy.dtype != torch.float32 else None
    for unit in unit_modules(policy.model, policy.adapter):
        for hook in list(unit._forward_pre_hooks):  # the plain model's input casts: FSDP's own do it now
            unit._forward_pre_hooks.pop(hook)
        fully_shard(unit, mesh=policy.dims.dp_mesh, reshard_after_forward=True,
                    **({"mp_policy": mp} if mp is not None else {}))


def measure_ref(workdir: Path, repeats: int, seqs: int, length: int) -> dict:
    from grpo.config import ModelConfig
    from grpo.update import PackedStep, packed_logprobs
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    init_distributed()
    out = {"ref_seqs": seqs, "ref_len": length}
    for dtype in ("float32", "bfloat16"):
        cfg = ModelConfig(path=str(_model(workdir, "tiny_hd128_deep")), dtype=dtype)
        plain = build_policy(cfg, build_parallel_dims(), trainable=False)
        units = build_policy(cfg, build_parallel_dims(), trainable=False)
        _in_fsdp_units(units)
        step = PackedStep(_text_batch(plain.adapter, seqs, length), 2 * length, plain.device)

        def held_pass(policy=units):
            for unit in policy.fsdp_units:
                unit.set_reshard_after_forward(False, recurse=False)
            packed_logprobs(policy, step, "units")  # resharded at its end
            for unit in policy.fsdp_units:
                unit.set_reshard_after_forward(True, recurse=False)

        tag = "fp32" if dtype == "float32" else "bf16"
        out[f"ref_units_{tag}_ms"] = _median_ms(held_pass, repeats)
        out[f"ref_plain_{tag}_ms"] = _median_ms(lambda: packed_logprobs(plain, step, "plain"), repeats)
        out[f"ref_{tag}_equal"] = all(torch.equal(f["plain"], f["units"]) for _, f in step)
    out["ref_microbatches"] = len(step.microbatches)
    out["ref_units"] = len(units.fsdp_units)
    return out


class _NoStep:
    """An optimizer that clears the gradients and moves nothing: `optimizer_step`'s passes, clip and reads alone."""

    def __init__(self, model):
        self.model = model

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        pass


def measure_train(workdir: Path, repeats: int, seqs: int, length: int, size: str = "tiny_hd128_deep") -> dict:
    from grpo.config import ModelConfig
    from grpo.update import PackedStep, optimizer_step
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    init_distributed()
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = ModelConfig(path=str(_model(workdir, size)), dtype=dtype)
        units = build_policy(cfg, build_parallel_dims(one_device="fsdp"))
        plain = build_policy(cfg, build_parallel_dims(one_device="plain"))
        step = PackedStep(_text_batch(units.adapter, seqs, length), 2 * length, units.device)
        results = {}

        def update(policy, name):
            def run():  # the trainer's update (grpo.update.optimizer_step) with an optimizer that moves nothing
                results[name] = optimizer_step(policy, _NoStep(policy.model), step, lambda lp, mb, d: (lp.sum(), {}),
                                               max_tokens=2 * length, grad_clip=1.0, denominators={},
                                               unsharded_accumulation=True)
            return run

        tag = "fp32" if dtype == "float32" else "bf16"
        out[f"train_units_{tag}_ms"] = _median_ms(update(units, "units"), repeats)
        out[f"train_plain_{tag}_ms"] = _median_ms(update(plain, "plain"), repeats)
        out[f"train_{tag}_equal"] = results["units"] == results["plain"]  # the loss and the gradient norm
    out["train_microbatches"] = len(step.microbatches)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--params", type=int, default=825, help="optim: parameters")
    p.add_argument("--numel", type=int, default=64, help="optim: values per parameter")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ref-seqs", type=int, default=8, help="ref, train: text sequences in the pass")
    p.add_argument("--ref-len", type=int, default=64, help="ref, train: tokens a sequence")
    p.add_argument("--train-size", default="tiny_hd128_deep", help="train: make_tiny_model size (tiny_deep: narrower)")
    p.add_argument("--workdir", default="/tmp/vlrl_host_cost")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown {unknown}; expected a subset of {','.join(PARTS)}")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out = {}
    if "optim" in parts:
        out.update(measure(args.params, args.numel, args.repeats))
    if "refit" in parts:
        out.update(measure_refit(workdir, args.repeats))
    if "gc" in parts:
        out.update(measure_gc(workdir, max(args.repeats // 4, 3)))
    if "pack" in parts:
        out.update(measure_pack(workdir, args.repeats))
    if "ref" in parts:
        out.update(measure_ref(workdir, max(args.repeats // 4, 3), args.ref_seqs, args.ref_len))
    if "train" in parts:
        out.update(measure_train(workdir, max(args.repeats // 4, 3), args.ref_seqs, args.ref_len, args.train_size))
        out["train_size"] = args.train_size
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
