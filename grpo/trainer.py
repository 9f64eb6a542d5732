"""The training loop: SFT steps, or GRPO steps that read top to bottom.

GRPO step, colocated and time-sliced on every rank (rollout/colocation.py owns the turns):
    rollout (engine awake; only what the memory plan says does not fit leaves the GPU) → score
    → experience (pack once; reference/old logprobs; advantages) → update (PPO epochs over the
    same packed micro-batches) → refit the engine.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from data.batch import Batch, PackedGenericDataItem
from data.datasets import VLDataset, video_kwargs
from data.loader import PromptFeeder
from data.processing import EncodedPrompt, encode_response, load_processor, sft_target, stop_token_ids
from grpo import algorithm as alg
from grpo.checkpoint import checkpoint_dir, load_checkpoint, resolve_resume, save_checkpoint
from grpo.config import SETTLED_BY_POLICY, Config, config_to_dict
from grpo.metrics import MetricsLogger
from grpo.preemption import PreemptionGuard
from grpo.preflight import preflight
from grpo.run_folder import check_resume_data, claim_run_folder, write_config
from grpo.update import (
    PackedStep, all_reduce_max_int, all_reduce_sum, build_optimizer, lr_at, optimizer_step, packed_logprobs,
)
from models.flops import peak_tflops, row_flops
from models.lora import adapters_off
from models.parallel import build_parallel_dims
from models.policy import Policy, build_policy
from rollout.base import Generation, PromptInput, SamplingParams, timed
from rollout.episode import Episode, episode_batch
from rollout.colocation import (
    KV_HEADROOM, RESERVE_BYTES, Colocation, MemoryNeeds, activation_bytes, fsdp_unit_sizes, kv_bytes_per_token,
    state_bytes_per_sequence, tensor_bytes, tensor_elements,
)
from rollout.exact import build_exact, prepare_process
from rollout.factory import build_engine
from rollout.gen_probe import breakdown_metrics
from rollout.groups import EngineGroup
from rollout.rollouts import Rollouts, context_tokens, tool_prompt
from rollout.telemetry import build_telemetry, profiled

log = logging.getLogger("vlrl")
MISMATCH_ALARM = 1.05
# Reward reasons that mean the scorer could not judge (counted), as opposed to a wrong answer.
REWARD_FAILURES = ("timeout", "answer_too_long", "invalid_gold_answer")
# The policy objective's statistics reported per step (those the chosen objective computes), each a
# token-weighted mean over micro-batches and ranks.
OBJECTIVE_METRICS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction", "approx_kl",
                     "ratio_mean", "seq_clip_fraction", "seq_ratio_mean", "gate_mean")
# The phases a GRPO step's time splits into (perf/other_s is what none of them covers). Generation
# includes waking and putting the engine to sleep (perf/wake_s, perf/sleep_s, perf/offload_s).
STEP_PHASES = ("perf/gen_s", "perf/logprob_s", "perf/score_s", "perf/train_s", "perf/refit_s")


def freeze_survivors() -> int:
    """One collection, then every object still alive moved out of Python's cyclic garbage collector's reach
    (`gc.freeze`), so that later collections walk only the objects made after: the model's modules and tensors,
    the engine's and the libraries' objects are never walked again. Objects frozen here are still freed when
    their last reference goes; only a cycle among them that later becomes garbage stays until `gc.unfreeze`.
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _seconds(times: dict) -> str:
    """'policy_build 12.3 s, ...' for perf/*_s timings."""
    return ", ".join(f"{k.removeprefix('perf/').removesuffix('_s')} {v:.1f} s" for k, v in times.items())


class NonFiniteStop(RuntimeError):
    """Too many non-finite steps in a row: the run stopped with a checkpoint."""


class OutOfMemoryStop(RuntimeError):
    """A step ran out of device memory: the message names the pass and the settings that lower its need."""


class Trainer:
    """Builds the pieces from the config and runs `train()`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        started = time.monotonic()
        # start-up seconds, logged with the first step's metrics (perf/*_build_s), with the engine's once it is built
        self._startup: dict[str, float] = {}
        preflight(cfg, dist.get_world_size())
        self.dims = build_parallel_dims(cfg.parallel.tp, cfg.parallel.replicate, cfg.parallel.one_device)
        self.telemetry = build_telemetry(cfg.trainer.gpu_telemetry, self.dims.device,
                                         cfg.trainer.gpu_telemetry_interval_s, STEP_PHASES)
        # every rank samples or none does: its step metrics are a collective
        if cfg.trainer.gpu_telemetry == "auto" and all_reduce_max_int(int(self.telemetry is None), self.dims.device):
            self.telemetry = None
        self.run_dir = Path(cfg.trainer.run_dir)
        if self.dims.is_main:
            print(f"parallel: {self.dims.describe()}", flush=True)
        # lock the folder, refuse to write over an earlier run unless told (collective)
        self.run_lock = claim_run_folder(cfg, self.run_dir, self.dims.is_main)
        torch.manual_seed(cfg.trainer.seed + self.dims.rank)
        self.engine_group = EngineGroup.build(cfg.rollout.tensor_parallel_size, self.dims.world_size, self.dims.rank,
                                              self.dims.local_world_size)
        if cfg.rollout.exact:  # before the policy's first GEMM: cuBLAS reads the batch-invariant settings once
            prepare_process()
        with timed(self._startup, "perf/policy_build_s"):
            self.policy: Policy = build_policy(cfg.model, self.dims)
            if cfg.rollout.exact:
                build_exact(self.policy)
        # what ran, not `auto`: config.yaml, the trackers and the reference built below see the settled value
        asked = {key: getattr(cfg.model, key) for key in SETTLED_BY_POLICY}
        for key in SETTLED_BY_POLICY:
            setattr(cfg.model, key, "true" if getattr(self.policy, key) else "false")
        self.adapter = self.policy.adapter
        self.optimizer = build_optimizer(self.policy, cfg.optim)
        with timed(self._startup, "perf/data_build_s"):  # processor, tokenizer, datasets
            self.processor = load_processor(cfg.model.path, cfg.model.trust_remote_code)
            self.tokenizer = self.processor.tokenizer
            self.stop_ids = stop_token_ids(cfg.model.path, self.tokenizer, self.adapter.end_of_turn)
            self.tool_prompt = tool_prompt(cfg, self.adapter, self.processor)  # rollout.tools' schemas in every prompt
            self.feeder = self._feeder(cfg.data.train_path)
            self.eval_feeder = self._feeder(cfg.data.eval_path, shuffle=False) if cfg.data.eval_path else None
        # The reference model for the KL term: a frozen copy, or with LoRA the policy itself with its
        # adapters off (its base weights never train, so it is the same model without a second copy).
        self.ref: Policy | None = None
        if cfg.trainer.mode == "grpo" and cfg.algorithm.kl_coef > 0:
            if cfg.model.lora.rank > 0:
                self.ref = self.policy
            else:
                with timed(self._startup, "perf/reference_build_s"):
                    self.ref = build_policy(cfg.model, self.dims, trainable=False)
                    if cfg.rollout.exact:
                        build_exact(self.ref)
        self.colocation = Colocation(
            self.policy, self.optimizer, reference=None if self.ref is self.policy else self.ref,
            needs=self._memory_needs,
            build_engine=self._build_engine,
            offload=cfg.parallel.offload_during_generate, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            agree=lambda v: all_reduce_max_int(v, self.policy.device), is_main=self.dims.is_main,
        )
        # episodes (turns, tools, rewards, dynamic sampling) come from rollout/, the engine awake once per step
        self.rollouts = Rollouts(cfg, self.adapter, self.processor, self.colocation.generating, self.engine_group,
                                 lambda v: all_reduce_max_int(v, self.policy.device), alg.dynamic_sampling_keep)
        self._peak_tflops = peak_tflops(self.policy.device)
        self.step = 0
        self.preempted = False  # set when a SIGTERM/SIGINT stopped train() early
        self.counters = {"skipped_nonfinite": 0, "masked_mismatch_seqs": 0, "reward_failures": 0}
        self._nonfinite_in_row = 0
        self._saved_step: int | None = None  # the step of the newest checkpoint this run wrote or resumed from
        self._resume()
        write_config(cfg, self.run_dir, self.dims.is_main)  # only once resume has succeeded (collective)
        self.logger = MetricsLogger(
            self.run_dir, enabled=self.dims.is_main, total_steps=cfg.trainer.max_steps, start_step=self.step,
            tensorboard=cfg.logging.tensorboard, stdout=cfg.logging.stdout, progress=cfg.trainer.progress,
            backends=cfg.logging.backends, config=config_to_dict(cfg),
        )
        self._startup["perf/init_s"] = time.monotonic() - started
        if self.dims.is_main:
            print("start-up: " + _seconds(self._startup), flush=True)
            print(f"shared prompts: {'on' if self.policy.shared_prompts else 'off'} "
                  f"(model.shared_prompts={cfg.model.shared_prompts})", flush=True)
            print(f"vision tower: {'once per pass' if self.policy.vision_once else 'once per micro-batch'} "
                  f"(model.vision_once={cfg.model.vision_once}); {self.policy.padded_vision_mlps} of its MLPs "
                  f"widened to a multiple of 128 (model.pad_vision_mlp={asked['pad_vision_mlp']})", flush=True)
            kernels = (f"; {self.policy.torch_rms_norms} RMSNorms on torch's fused kernel "
                       f"(model.torch_rms_norm={asked['torch_rms_norm']})" if self.policy.torch_rms_norms else "")
            if self.policy.flash_direct:
                kernels += "; FlashAttention's varlen kernels called directly (model.flash_direct)"
            if self.policy.liger_kernel and not cfg.model.liger_mlp:
                kernels += "; the gated MLPs the family's own (model.liger_mlp=false)"
            print(f"liger kernels: {'on' if self.policy.liger_kernel else 'off'} "
                  f"(model.liger_kernel={asked['liger_kernel']})" + kernels, flush=True)

    # --- construction ------------------------------------------------------------------------
    def _feeder(self, path: str, shuffle: bool | None = None) -> PromptFeeder:
        d = self.cfg.data
        if not path:
            raise ValueError("config key 'data.train_path' is empty: point it at a parquet or JSONL file")
        ds = VLDataset(path, d.task, min_pixels=d.min_pixels, max_pixels=d.max_pixels, **video_kwargs(d),
                       **self.processor.video_options())

        def gather(value: int) -> list[int]:
            # each rank fills its data-parallel slot; tensor-parallel peers fill the same slot alike
            slots = torch.zeros(self.dims.dp, dtype=torch.long, device=self.policy.device)
            slots[self.dims.dp_rank] = value
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(slots, op=dist.ReduceOp.MAX)
            return slots.tolist()

        return PromptFeeder(
            ds, self.processor, d.task, seed=self.cfg.trainer.seed, shuffle=d.shuffle if shuffle is None else shuffle,
            max_prompt_tokens=d.max_prompt_tokens, rank=self.dims.dp_rank, world=self.dims.dp, gather=gather,
            tool_prompt=self.tool_prompt,
        )

    def _build_engine(self, share: float | None):
        """The rollout engine for the colocation plan's share of the device, its build timed: perf/engine_build_s
        and the engine's own parts (perf/engine_import_s, perf/engine_llm_s, perf/engine_warmup_s)."""
        with timed(self._startup, "perf/engine_build_s"):
            engine = build_engine(self.cfg, self.policy, gpu_memory_utilization=share,
                                  max_num_seqs=self._rollout_sequences())
        parts = {f"perf/engine_{k}": v for k, v in getattr(engine, "build_times", {}).items()}
        self._startup.update(parts)
        if self.dims.is_main:
            print("engine built: " + _seconds({"perf/engine_build_s": self._startup["perf/engine_build_s"], **parts}),
                  flush=True)
        return engine

    @property
    def engine(self):
        """The rollout engine (None until the first generation builds it)."""
        return self.colocation.engine

    def _engine(self):
        """The rollout engine, built on first use and refit whenever the policy has moved since."""
        return self.colocation.ensure_engine()

    def _rollout_sequences(self) -> int:
        """The most sequences one engine generates at once: its group's share of a step's prompts × n."""
        per_rank = max(self.cfg.data.prompts_per_step // self.dims.dp, 1)
        return per_rank * self.engine_group.size * self.cfg.rollout.n

    def _memory_needs(self) -> MemoryNeeds:
        """What the colocated step needs on this rank's GPU (the memory plan's inputs).

        The compute copy: with one data-parallel rank every FSDP unit keeps its copy from forward to
        backward (models/parallel.py), so all of it (this rank's tensor-parallel part); with more, a
        unit reshards after forward and backward: the unit at work and the one prefetched. Gradients
        are the fp32 gradient of every trainable parameter, sharded or (optim.unsharded_accumulation)
        not; beside them in backward one unit's gradient in the compute dtype and its fp32 reduce
        buffer (rollout/colocation.py's module docstring says what lives when)."""
        cfg = self.cfg
        model = self.policy.model
        params = tensor_bytes(model.parameters())
        trainable = tensor_bytes(p for p in model.parameters() if p.requires_grad)  # LoRA: adapters
        count = sum(p.numel() for p in model.parameters())  # full (unsharded) sizes
        config = model.config
        engine_dtype = 2 if self.policy.dtype != torch.float32 else 4
        units = fsdp_unit_sizes(model)
        if self.dims.dp == 1:
            compute_copy = tensor_elements(model.parameters())
        else:
            compute_copy = 2 * max(n for n, _ in units)
        if self.policy.compute is not None:  # parallel.one_device=plain: the copies' gradients, until added in
            grad_buffers = self.policy.compute.gradient_bytes()
        else:
            grad_buffers = max(n for _, n in units) * (engine_dtype + 4)
        tp = cfg.rollout.tensor_parallel_size
        seq_tokens = context_tokens(cfg)  # the engine's max_model_len: a whole episode
        free, total = torch.cuda.mem_get_info(self.policy.device)
        outside_torch = max(total - free - torch.cuda.memory_reserved(self.policy.device), 0)  # CUDA context, NCCL
        return MemoryNeeds(
            device=torch.cuda.get_device_properties(self.policy.device).total_memory,
            parameters=params, gradients=trainable, optimizer=2 * trainable,
            reference=0 if self.ref is None or self.ref is self.policy else tensor_bytes(self.ref.model.parameters()),
            compute_copy=compute_copy * engine_dtype,
            grad_buffers=grad_buffers,
            activations=activation_bytes(config, cfg.optim.max_tokens_per_microbatch, cfg.model.activation_checkpointing),
            microbatch_tokens=cfg.optim.max_tokens_per_microbatch,
            engine_weights=count * engine_dtype // tp,
            # the most KV the engine's scheduler can ever hold: max_num_seqs full-length sequences (and a hybrid's
            # linear-attention state for each)
            engine_kv_wanted=int(KV_HEADROOM * -(-self._rollout_sequences() // 8) * 8
                                 * (seq_tokens * kv_bytes_per_token(config.to_dict(), engine_dtype, tp)
                                    + state_bytes_per_sequence(config.to_dict(), engine_dtype, tp))),
            reserve=RESERVE_BYTES + outside_torch,
        )

    def _resume(self) -> None:
        path = resolve_resume(self.cfg.checkpoint.resume, self.run_dir)
        if path is None:
            return
        check_resume_data(path, len(self.feeder.dataset), self.cfg.data.train_path)
        self.policy.reshard()
        state = load_checkpoint(path, self.policy.model, self.optimizer)
        self.step = self._saved_step = int(state["step"])
        self.feeder.stream.load_state_dict(state["data"]["stream"])
        self.counters.update(state.get("counters", {}))
        if self.dims.is_main:
            print(f"resumed from {path} at step {self.step}", flush=True)

    def _skipped_total(self) -> float:
        """Bad samples skipped so far over all ranks (restored count + this run's, all-reduced)."""
        (here,) = all_reduce_sum([self.feeder.stats.total], self.policy.device)
        return self.counters.get("skipped_samples_before", 0) + here

    def save(self) -> Path:
        counters = {**self.counters, "skipped_samples_before": self._skipped_total()}
        state = {"data": self.feeder.state_dict(), "counters": counters}
        self.policy.reshard()  # the parameters the optimizer holds in the model, not compute copies
        path = save_checkpoint(self.run_dir, self.step, self.policy.model, self.optimizer, state,
                               self.cfg.model.path, keep=self.cfg.checkpoint.keep)
        self._saved_step = self.step
        if self.dims.is_main:
            print(f"checkpoint written: {path}", flush=True)
        return path

    def _out_of_memory(self) -> str:
        """What ran out of device memory in this step, and what lowers it (OutOfMemoryStop's message)."""
        cfg = self.cfg
        label = self.colocation.peak.pass_label
        tokens = cfg.optim.max_tokens_per_microbatch
        if label is None:
            where = "outside the logprob and update passes (generation, scoring or the refit)"
            fix = ("lower rollout.gpu_memory_utilization (0: the memory plan decides) or data.prompts_per_step, or "
                   "set parallel.offload_during_generate=on")
        else:
            where = "in " + {"logprob": "the logprob pass", "update": "the update"}.get(label, "a training pass")
            fix = f"lower optim.max_tokens_per_microbatch (now {tokens}; {max(tokens // 2, 1)} halves the activations)"
            if not cfg.model.activation_checkpointing:
                fix += " or set model.activation_checkpointing=true"
        plan = self.colocation.plan
        planned = f", the start-up plan's training peak ~{plan.training_peak / 2**30:.1f} GiB" if plan else ""
        saved = (f"the newest checkpoint is step {self._saved_step}; resume with checkpoint.resume=auto"
                 if self._saved_step else "this run has no checkpoint yet")
        return (f"step {self.step} ran out of device memory {where} (model.dtype={cfg.model.dtype}{planned}): "
                f"{fix}; {saved}")

    def _profiling(self, what: str):
        """torch.profiler around the passes of trainer.profile_step on the first rank (op tables to
        <run_dir>/profile_step_<N>.txt), elsewhere nothing."""
        if self.step != self.cfg.trainer.profile_step or not self.dims.is_main:
            return nullcontext()
        out = Path(self.run_dir) / f"profile_step_{self.step}.txt"
        print(f"profiling step {self.step}'s {what}: {out}", flush=True)
        return profiled(out, f"step {self.step}'s {what}")

    # --- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        """Run steps until trainer.max_steps, or until a SIGTERM/SIGINT (then checkpoint and return)."""
        guard = PreemptionGuard(current_step=lambda: self.step)
        frozen_before = gc.get_freeze_count()
        try:
            with self.telemetry or nullcontext():  # GPU readings on a thread, stopped however the loop ends
                return self._train(guard)
        finally:
            if gc.get_freeze_count() > frozen_before:  # trainer.gc_freeze: the collector walks everything again
                gc.unfreeze()
            guard.close()
            self.feeder.drop_prefetch()  # a stop before trainer.max_steps leaves the next step's prefetch

    def _train(self, guard: PreemptionGuard) -> dict:
        cfg = self.cfg
        per_rank = cfg.data.prompts_per_step // self.dims.dp  # divisibility checked by preflight
        last = {}
        saved_at = -1
        froze = False
        while self.step < cfg.trainer.max_steps:
            self.step += 1
            t0 = time.monotonic()
            self.colocation.peak.begin()
            lr = lr_at(self.step, cfg.optim, cfg.trainer.max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            try:
                if cfg.trainer.mode == "sft":
                    with self.colocation.peak.training("update"), self._profiling("update"):
                        metrics = self.sft_step(per_rank)
                else:
                    metrics = self.grpo_step(per_rank)
            except torch.OutOfMemoryError as exc:
                raise OutOfMemoryStop(self._out_of_memory()) from exc
            metrics["optim/lr"] = lr
            metrics["perf/step_s"] = time.monotonic() - t0
            phases = sum(metrics.get(k, 0.0) for k in STEP_PHASES)
            metrics["perf/other_s"] = metrics["perf/step_s"] - phases if phases else 0.0
            metrics["memory/peak_gb"] = self.colocation.peak.end()
            metrics["memory/alloc_retries"] = self.colocation.peak.alloc_retries()
            metrics.update(self.colocation.peak.phase_metrics())  # per pass, on a GPU: memory/*_logprob, *_update
            if self.telemetry:  # clocks, power, temperature and throttling per phase: gpu/*_gen, *_train, ...
                metrics.update(self.telemetry.step_metrics(self.policy.device))
            metrics["data/skipped_samples"] = self._skipped_total()
            metrics.update(self._startup)  # start-up and engine-build seconds, once (the step that built the engine)
            self._startup = {}
            if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0 and self.eval_feeder:
                metrics.update(self.evaluate())
            self.logger.log(self.step, metrics)
            last = metrics
            if cfg.trainer.gc_freeze and not froze:  # after the first step: its start-up and warm-up objects stay
                froze = True
                frozen = freeze_survivors()
                if self.dims.is_main:
                    print(f"garbage collector: {frozen} objects alive after the first step frozen "
                          "(trainer.gc_freeze)", flush=True)
            if cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0:
                self.save()
                saved_at = self.step
            self._nonfinite_in_row = self._nonfinite_in_row + 1 if metrics.get("loss/skipped_nonfinite") else 0
            if self._nonfinite_in_row >= cfg.trainer.max_nonfinite_in_row > 0:
                path = self.save()
                raise NonFiniteStop(
                    f"{self._nonfinite_in_row} non-finite steps in a row (last: step {self.step}); stopped with a "
                    f"checkpoint at {path}. Lower optim.lr or raise optim.grad_clip, then resume with "
                    "checkpoint.resume=auto (or set trainer.max_nonfinite_in_row=0 to never stop)"
                )
            if guard.stop_requested(self.policy.device):  # collective: every rank stops after this step
                path = self.save() if saved_at != self.step else checkpoint_dir(self.run_dir, self.step)
                self.preempted = True
                if self.dims.is_main:
                    print(f"preempted at step {self.step}; checkpoint written: {path}; "
                          "resume with checkpoint.resume=auto", flush=True)
                break
        if not self.preempted and cfg.checkpoint.at_end and (
                cfg.checkpoint.every_steps == 0 or self.step % cfg.checkpoint.every_steps):
            self.save()
        self.logger.close()
        return last

    # --- SFT ---------------------------------------------------------------------------------
    def sft_step(self, per_rank: int) -> dict:
        prompts = self.feeder.next(per_rank)
        if any(p.conversation is not None for p in prompts):  # trajectory rows: the loss on assistant turns only
            batch = self._conversation_batch(prompts)
        else:
            end = self.adapter.end_of_turn  # the target ends the turn as generation stops it
            responses = [encode_response(self.tokenizer, sft_target(self.cfg.data.task, p.answer), end) for p in prompts]
            batch = self._sequence_batch(prompts, responses)
        tokens = sum(int(m.sum()) - int(m[0]) for m in batch["loss_mask"].items)
        (global_tokens,) = all_reduce_sum([tokens], self.policy.device)

        def loss_fn(lp, mb, den):
            return -lp.sum() / den["tokens"], {"loss/nll_sum": -float(lp.detach().sum())}

        times = {}
        with timed(times, "perf/train_s"):
            out = optimizer_step(self.policy, self.optimizer, batch, loss_fn,
                                 max_tokens=self.cfg.optim.max_tokens_per_microbatch,
                                 grad_clip=self.cfg.optim.grad_clip, denominators={"tokens": global_tokens},
                                 unsharded_accumulation=self.cfg.optim.unsharded_accumulation)
        train_s = times["perf/train_s"]
        self.colocation.policy_updated()
        self.counters["skipped_nonfinite"] += int(out["loss/skipped_nonfinite"])
        total_tokens = sum(t.numel() for t in batch["input_ids"].items)
        (all_tokens,) = all_reduce_sum([total_tokens], self.policy.device)
        return {"loss/total": out["loss/total"], "loss/grad_norm": out["loss/grad_norm"],
                "loss/skipped_nonfinite": out["loss/skipped_nonfinite"],
                "loss/skipped_nonfinite_total": float(self.counters["skipped_nonfinite"]),
                "perf/tokens": all_tokens, "perf/scored_tokens": global_tokens,
                "perf/tokens_per_s": all_tokens / max(train_s, 1e-9), "perf/train_s": train_s}

    def _conversation_batch(self, prompts: list[EncodedPrompt]) -> Batch:
        """Whole conversations (data/trajectories.py), each with its images and its assistant-token mask."""
        convs = [p.conversation for p in prompts]
        if any(c is None for c in convs):
            raise ValueError(f"{self.cfg.data.train_path}: SFT rows mix trajectories (`messages`) with single-turn rows")
        return Batch({"input_ids": [c.input_ids for c in convs], "loss_mask": [c.loss_mask for c in convs],
                      "image_grid_thw": [c.image_grid_thw for c in convs], "pixel_values": [c.pixel_values for c in convs],
                      "position_ids": PackedGenericDataItem(
                          [self.adapter.position_ids(c.input_ids, c.image_grid_thw) for c in convs], dim=1)})

    def _sequence_batch(self, prompts: list[EncodedPrompt], responses: list[torch.Tensor],
                        prompt_of: list[int] | None = None) -> Batch:
        """Prompt + response sequences; samples of one prompt share its pixel tensor (no copy)."""
        prompt_of = prompt_of if prompt_of is not None else list(range(len(prompts)))
        ids, masks, pos, pix, grids = [], [], [], [], []
        for i, resp in zip(prompt_of, responses):
            p = prompts[i]
            seq = torch.cat([p.input_ids, resp.to(p.input_ids.dtype)])
            mask = torch.zeros_like(seq)
            mask[p.input_ids.numel():] = 1
            ids.append(seq)
            masks.append(mask)
            pos.append(self.adapter.position_ids(seq, p.image_grid_thw, p.video_grid_thw, p.second_per_grid_ts))
            pix.append(p.pixel_values)
            grids.append(p.image_grid_thw)
        return Batch({"input_ids": ids, "loss_mask": masks, "image_grid_thw": grids, "pixel_values": pix,
                      "position_ids": PackedGenericDataItem(pos, dim=1),
                      "pixel_values_videos": [prompts[i].pixel_values_videos for i in prompt_of],
                      "video_grid_thw": [prompts[i].video_grid_thw for i in prompt_of]})

    # --- GRPO --------------------------------------------------------------------------------
    def sampling_params(self, greedy: bool = False, max_new_tokens: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=1 if greedy else r.n, temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_new_tokens=max_new_tokens or r.max_new_tokens, stop_token_ids=self.stop_ids,
            banned_token_ids=self.adapter.banned_token_ids,
            seed=None if greedy else self.cfg.trainer.seed * 100_003 + self.step * 1009 + self.engine_group.index,
        )

    def generate(self, prompts: list[EncodedPrompt], params: SamplingParams) -> list[Generation]:
        """Responses from the engine, awake for the call and asleep after it (see Colocation)."""
        inputs = [PromptInput(p.input_ids.tolist(), p.images, p.pixel_values, p.image_grid_thw, p.videos,
                              p.pixel_values_videos, p.video_grid_thw, p.second_per_grid_ts) for p in prompts]
        with self.colocation.generating() as engine:
            return self.rollouts.generate(engine, inputs, params)

    def refit(self) -> float:
        """Stream the policy's weights into the engine; returns seconds."""
        return self.colocation.refit()

    def grpo_step(self, per_rank: int) -> dict:
        """rollout → score → experience (pack once, logprobs, advantages) → update → refit."""
        timings = {}
        with timed(timings, "perf/gen_s"):
            _, episodes, rewards_info = self.rollouts.collect(self.feeder, per_rank, self.sampling_params())
        if self.cfg.data.prefetch and self.step < self.cfg.trainer.max_steps:
            # collective, like the next step's first feeder.next(per_rank), which takes it: the next step's
            # prompts are read, decoded and encoded on a thread while this step's logprobs, update and refit run
            with timed(timings, "perf/prefetch_s"):  # the first round's gather, on this thread
                self.feeder.prefetch(per_rank)
        gen_detail = dict(self.colocation.timings)
        # where the step's engine calls spent their time (rollout.gen_breakdown, vLLM): perf/gen_*
        gen_detail.update(breakdown_metrics(self.rollouts.breakdowns))
        # the parts of perf/gen_s outside the engine, every engine: the data feed and scoring (Rollouts.times)
        gen_detail.update({f"perf/gen_{k}": v for k, v in self.rollouts.times.items()})

        reuse = self._old_logprobs_from_update()
        peak = self.colocation.peak  # two labelled passes; the step's peak is the same as over one
        with self._profiling("logprob and update passes"):
            with peak.training("logprob"):
                with timed(timings, "perf/logprob_s"):
                    step = self._experience(episodes, old_logprobs=not reuse, timings=timings)
                with timed(timings, "perf/score_s"):
                    rewards = self._advantages(step, episodes, rewards_info)
                    if not reuse:  # the mismatch mask needs the old logprobs before the update
                        fidelity = self._fidelity(step)
            with peak.training("update"):
                with timed(timings, "perf/train_s"):
                    train = self._ppo_update(step, old_from_update=reuse)
                if reuse:  # the update's own forward gave the old logprobs; compare them with the engine's now
                    fidelity = self._fidelity(step)

        with timed(timings, "perf/refit_s"):
            self.refit()
        timings.update(self.colocation.refit_timings)  # perf/refit_cache_s, refit_gather_s, refit_engine_s
        self.colocation.peak.sample()  # the engine's weights are back on the device
        return {**self._rollout_metrics(episodes, rewards_info, rewards), **fidelity, **train, **timings,
                **gen_detail, **self._throughput(step, timings)}

    def _experience(self, episodes: list[Episode], old_logprobs: bool, timings: dict) -> PackedStep:
        """The step's episodes packed once onto the device, with engine, reference and (when the
        update cannot supply them: `old_logprobs`) old logprobs as packed per-token fields. Only
        model tokens are scored: prompt and tool tokens are context. `timings` gets `perf/logprob_pack_s`, the
        host's work before the first pass (the sequences, their positions, the packed rows and their copies to
        the device), during which the device has nothing queued."""
        cfg = self.cfg
        with timed(timings, "perf/logprob_pack_s"):
            batch = episode_batch(episodes, self.adapter)
            step = PackedStep(batch, cfg.optim.max_tokens_per_microbatch, self.policy.device,
                              self.policy.shared_prompts)
            step.set_per_token("engine_logprobs", [torch.tensor(e.logprobs, dtype=torch.float32) for e in episodes])
        if old_logprobs:
            packed_logprobs(self.policy, step, "old_logprobs", cfg.rollout.temperature)
        if self.ref is not None:
            with adapters_off(self.policy.model) if self.ref is self.policy else nullcontext():
                packed_logprobs(self.ref, step, "ref_logprobs", cfg.rollout.temperature)
        return step

    def _advantages(self, step: PackedStep, episodes: list[Episode], rewards_info) -> torch.Tensor:
        """Rewards (with tool-error, overlong and in-reward KL penalties) → group advantages (each
        group the n episodes of one prompt), packed per model token."""
        cfg, a = self.cfg, self.cfg.algorithm
        rewards = torch.tensor([r.score for r in rewards_info], dtype=torch.float32)
        if a.tool_error_penalty:
            rewards = rewards - a.tool_error_penalty * torch.tensor([float(e.errors) for e in episodes])
        lengths = torch.tensor([e.model_tokens for e in episodes])
        if a.overlong_buffer > 0:
            rewards = rewards + alg.overlong_penalty(lengths, cfg.rollout.max_new_tokens, a.overlong_buffer,
                                                     a.overlong_penalty)
        if self.ref is not None and a.kl_in_reward:  # old logprobs exist here (see _old_logprobs_from_update)
            for mb, f in step:
                if mb.sample_indices:
                    f["kl"] = alg.kl_penalty(f["old_logprobs"], f["ref_logprobs"], a.kl_estimator)
            rewards = rewards - a.kl_coef * step.sequence_sums("kl").cpu()
        adv = alg.compute_advantages(rewards, cfg.rollout.n, a.adv_estimator) if len(rewards) else rewards
        step.set_per_sequence("advantages", adv)
        return rewards

    def _fidelity(self, step: PackedStep) -> dict:
        """token_mult_prob_error between the engine's and the trainer's logprobs of the sampled tokens,
        from the packed fields; sequences past algorithm.mismatch_mask_threshold get token weight 0; what
        algorithm.rollout_correction masks and clips of the remaining tokens."""
        dev = self.policy.device
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        seq_max = torch.ones(1, dtype=torch.float64, device=dev)
        masked = torch.zeros(1, dtype=torch.float64, device=dev)
        correction = self.cfg.algorithm.correction()
        corrected = torch.zeros(len(alg.CORRECTION_COUNTS), dtype=torch.float64, device=dev)
        for mb, f in step:
            if not mb.sample_indices:
                continue
            seg = mb.target_seq
            m = alg.mismatch_metrics(f["engine_logprobs"], f["old_logprobs"], torch.ones_like(seg, dtype=torch.bool),
                                     segments=seg, num_segments=len(mb.sample_indices))
            sums += torch.stack([m["token_mult_prob_error_sum"], m["token_count"], m["gen_kl_sum"]]).double()
            seq_max = torch.maximum(seq_max, m["seq_max_mult_prob_error"].double().max().reshape(1))
            keep = alg.mismatch_sequence_mask(m["seq_max_mult_prob_error"], self.cfg.algorithm.mismatch_mask_threshold)
            f["token_weight"] = keep.float()[seg]
            masked += (~keep).sum()
            if correction["mode"] != "none":
                _, c = alg.rollout_correction(f["old_logprobs"], f["engine_logprobs"], keep[seg], **correction,
                                              segments=seg, num_segments=len(mb.sample_indices))
                corrected += torch.stack([c[k] for k in alg.CORRECTION_COUNTS]).double()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(masked)
            dist.all_reduce(corrected)
            dist.all_reduce(seq_max, op=dist.ReduceOp.MAX)
        total, count, kl = sums.tolist()
        masked_all = float(masked.item())
        self.counters["masked_mismatch_seqs"] += int(masked_all)
        value = total / max(count, 1)
        if value > MISMATCH_ALARM and self.dims.is_main:
            log.warning("fidelity alarm: token_mult_prob_error=%.4f > %.2f at step %d", value, MISMATCH_ALARM, self.step)
        out = {"fidelity/token_mult_prob_error": value, "fidelity/token_mult_prob_error_seq_max": float(seq_max.item()),
               "fidelity/gen_kl": kl / max(count, 1), "fidelity/masked_seqs": masked_all}
        if correction["mode"] != "none":
            c = dict(zip(alg.CORRECTION_COUNTS, corrected.tolist()))
            tokens, seqs = max(c["tokens"], 1), max(c["seqs"], 1)
            out.update({"fidelity/correction_masked_token_frac": c["masked_tokens"] / tokens,
                        "fidelity/correction_masked_seq_frac": c["masked_seqs"] / seqs,
                        "fidelity/correction_clipped_token_frac": c["clipped_tokens"] / tokens,
                        "fidelity/correction_clipped_seq_frac": c["clipped_seqs"] / seqs,
                        "fidelity/correction_weight_mean": c["weight_sum"] / tokens})
        return out

    def _old_logprobs_from_update(self) -> bool:
        """Whether the single PPO epoch's own forward can supply the old logprobs.

        With one epoch the policy has not moved between the old-logprob pass and the update's
        forward, so that pass computes the same numbers a second time; its detached values serve
        as the old logprobs (ratio 1, the on-policy gradient). Not when anything needs them before
        the update: masking by mismatch, or a KL penalty folded into the reward.
        """
        a = self.cfg.algorithm
        return (a.ppo_epochs == 1 and a.mismatch_mask_threshold <= 0
                and not (self.ref is not None and a.kl_in_reward))

    def _ppo_update(self, step: PackedStep, old_from_update: bool = False) -> dict:
        """PPO epochs over the step's packed micro-batches; every per-token value stays on the device."""
        cfg, a = self.cfg, self.cfg.algorithm
        dev = self.policy.device
        rows = [(mb, f) for mb, f in step if mb.sample_indices]
        masked = any("token_weight" in f for _, f in rows)  # weights the mismatch mask set (_fidelity)
        for _, f in rows:
            f.setdefault("token_weight", torch.ones_like(f["engine_logprobs"]))
        if masked:  # the weighted tokens counted on the device
            counts = torch.zeros(2, dtype=torch.float64, device=dev)  # scored tokens, sequences with any
            for mb, f in rows:
                counts += torch.stack(alg.valid_counts(f["token_weight"] > 0, mb.target_seq,
                                                       len(mb.sample_indices))).double()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(counts)
            g_tokens, g_seqs = counts.tolist()
        else:  # every scored token weighs 1: counted from the host's loss masks, so the update waits on nothing
            g_tokens, g_seqs = all_reduce_sum(list(step.scored_counts()), dev)

        correction = a.correction()
        clip = {"gspo": (a.gspo_clip_low, a.gspo_clip_high),
                "cispo": (a.cispo_clip_low, a.cispo_clip_high)}.get(a.policy_loss, (a.clip_low, a.clip_high))

        def loss_fn(lp, mb, den):
            f = mb.fields
            logp = lp.float()
            if old_from_update:
                f["old_logprobs"] = logp.detach()
            old = f["old_logprobs"]
            mask = f["token_weight"] > 0
            seg, nseg = mb.target_seq, len(mb.sample_indices)
            weights = None  # the rollout correction's per-token weights (old vs engine logprobs, fixed per step)
            if correction["mode"] != "none":
                weights, _ = alg.rollout_correction(old, f["engine_logprobs"], mask, **correction, segments=seg,
                                                    num_segments=nseg)
            loss, m = alg.objective_loss(a.policy_loss, logp, old, f["advantages"], mask, clip_low=clip[0],
                                         clip_high=clip[1], dual_clip=a.dual_clip, tau_pos=a.sapo_tau_pos,
                                         tau_neg=a.sapo_tau_neg, loss_agg=a.loss_agg, weights=weights,
                                         global_tokens=den["tokens"], global_seqs=den["seqs"], segments=seg,
                                         num_segments=nseg)
            n = mask.sum()
            sums = {"loss/tokens": n}
            for k in OBJECTIVE_METRICS:  # token-weighted over micro-batches and ranks
                if k in m:
                    sums[f"loss/{k}_sum"] = m[k] * n
            if self.ref is not None and not a.kl_in_reward:
                kl = alg.kl_penalty(logp, f["ref_logprobs"], a.kl_estimator)
                kl_loss = alg.aggregate_loss(kl, mask, a.loss_agg, global_tokens=den["tokens"], global_seqs=den["seqs"],
                                             segments=seg, num_segments=nseg)
                loss = loss + a.kl_coef * kl_loss
                sums["loss/kl_sum"] = torch.where(mask, kl.detach(), 0.0).sum()  # no boolean index: no read back
            return loss, sums

        out = {}
        for _ in range(a.ppo_epochs):
            out = optimizer_step(self.policy, self.optimizer, step, loss_fn, max_tokens=cfg.optim.max_tokens_per_microbatch,
                                 grad_clip=cfg.optim.grad_clip, temperature=cfg.rollout.temperature,
                                 denominators={"tokens": g_tokens, "seqs": g_seqs},
                                 unsharded_accumulation=cfg.optim.unsharded_accumulation)
            self.counters["skipped_nonfinite"] += int(out["loss/skipped_nonfinite"])
            self.colocation.policy_updated()
        present = [k for k in OBJECTIVE_METRICS if f"loss/{k}_sum" in out]
        keys = ["loss/tokens", "loss/kl_sum", "loss/entropy_sum"] + [f"loss/{k}_sum" for k in present]
        n, kl, ent, *objective = all_reduce_sum([out.get(k, 0.0) for k in keys], dev)
        metrics = {"loss/total": out["loss/total"], "loss/grad_norm": out["loss/grad_norm"],
                   "loss/skipped_nonfinite": out["loss/skipped_nonfinite"], "loss/entropy": ent / max(n, 1),
                   "loss/skipped_nonfinite_total": float(self.counters["skipped_nonfinite"]),
                   **{f"loss/{k}": v / max(n, 1) for k, v in zip(present, objective)}}
        if self.ref is not None:
            metrics["loss/kl"] = kl / max(n, 1)
        return metrics

    def _rollout_metrics(self, episodes: list[Episode], infos, rewards) -> dict:
        """reward/* and rollout/* over all ranks (lengths count model tokens), and rollout/'s agent/* metrics."""
        lengths = [e.model_tokens for e in episodes]
        sums = [float(rewards.sum()), float((rewards**2).sum()), sum(r.accuracy for r in infos),
                sum(r.format for r in infos), float(sum(lengths)), float(len(episodes)),
                float(sum(e.finish_reason == "max_tokens" for e in episodes))]
        failures = float(sum(r.reason.split(":")[0] in REWARD_FAILURES for r in infos))
        s, s2, acc, fmt, ln, n, trunc, fail = all_reduce_sum(sums + [failures], self.policy.device)
        self.counters["reward_failures"] += int(fail)
        (max_len,) = [all_reduce_max_int(max(lengths, default=0), self.policy.device)]
        n = max(n, 1)
        mean = s / n
        return {"reward/mean": mean, "reward/std": max(s2 / n - mean**2, 0.0) ** 0.5, "reward/accuracy": acc / n,
                "reward/format": fmt / n, "rollout/response_len_mean": ln / n, "rollout/response_len_max": float(max_len),
                "rollout/truncated_frac": trunc / n, "reward/failures_total": float(self.counters["reward_failures"]),
                **self.rollouts.metrics(episodes, self.policy.device)}

    def _throughput(self, step: PackedStep, timings: dict) -> dict:
        """Tokens per second of training and generation, and the update's MFU (language-model FLOPs
        of forward and backward over every micro-batch, the way EasyR1 and veRL count them)."""
        seqlens = [t.numel() for t in step.batch["input_ids"].items]
        gen_tokens = sum(int(f["engine_logprobs"].numel()) for mb, f in step if mb.sample_indices)
        rows = [mb for mb, _ in step if mb.sample_indices]
        row_tokens = sum(mb.num_tokens for mb in rows)
        # the FLOPs the rows run (with shared prompts, each prompt once per row)
        flops = row_flops(self.policy.model.config, rows) * self.cfg.algorithm.ppo_epochs
        total, gen, flops, computed = all_reduce_sum([sum(seqlens), gen_tokens, flops, row_tokens], self.policy.device)
        out = {"perf/tokens_per_s": total / max(timings["perf/train_s"], 1e-9),
               "perf/gen_tokens_per_s": gen / max(timings["perf/gen_s"], 1e-9),
               "perf/row_token_share": computed / max(total, 1)}  # < 1: shared prompts ran once per group
        if self._peak_tflops:
            out["perf/mfu_llm"] = flops / max(timings["perf/train_s"], 1e-9) / (self._peak_tflops * 1e12 * self.dims.world_size)
        return out

    # --- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_samples: int | None = None, use_tools: bool = True) -> dict:
        """Greedy accuracy on the held-out split (this rank's shard of the first N rows); with
        `use_tools=False` the model answers in one turn even when rollout.tools is set."""
        if self.eval_feeder is None:
            return {}
        self.feeder.wait_prefetch()  # the processor is not safe to share across threads (data.prefetch)
        n = min(max_samples or self.cfg.trainer.eval_samples, len(self.eval_feeder.dataset))
        self.eval_feeder.stream.position, self.eval_feeder.stream.epoch = 0, 0
        per_rank = max(n // self.dims.dp, 1)
        greedy = self.sampling_params(greedy=True, max_new_tokens=self.cfg.trainer.eval_max_new_tokens)
        _, _, infos = self.rollouts.evaluate(self.eval_feeder.next(per_rank), greedy, use_tools)
        acc, fmt, cnt = all_reduce_sum([sum(r.accuracy for r in infos), sum(r.format for r in infos), len(infos)],
                                       self.policy.device)
        return {"eval/accuracy": acc / max(cnt, 1), "eval/format": fmt / max(cnt, 1), "eval/samples": cnt}
