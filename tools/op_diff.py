"""Run the engine's and the policy's forwards module by module on the same sequences; report the first that differs.

    python tools/op_diff.py --model DIR --data FILE --task clevr --num-prompts 2 --dtype float32
    python tools/op_diff.py ... --random-responses --tol 1e-5 --out op_diff.json
    python tools/op_diff.py ... --perturb-engine model.language_model.layers.1.mlp.down_proj.weight=1e-2
    python tools/op_diff.py ... --engine vllm --exact   # rollout.exact=true: the first module still not bitwise
    python tools/op_diff.py --kernels --out kernels.json   # no model: the exact mode's kernel premises at the 3b
                                                           # shapes (GEMM row invariance, attention decode = prefill)

It builds the trainer (grpo.trainer.Trainer), so the policy is the real sharded policy, takes a few
prompts, and gets responses from the configured engine (or random tokens, `--random-responses`).
Then the same sequences run twice, with forward hooks on each side:

  policy  all sequences as one packed micro-batch through `Policy.logprobs`, the path the old and
          reference logprobs take (grpo/update.py's PackedStep);
  engine  each sequence on its own through the engine's model, one full forward without a KV cache
          (what prefill does). The built-in torch engine: its transformers model (`_TorchSide`).
          vLLM: its own modules, hooked through `LLM.apply_model`, each sequence run as a one-token
          generation with the prefix and encoder caches cleared (`_VLLMSide`). The vLLM side is
          written against vLLM 0.26's Qwen2.5-VL modules and has NOT been run: no GPU was at hand.

Captured, in forward order: the vision tower (patch embed, each block, merger), the token
embeddings, each decoder layer (input norm, q/k/v projections, the attention's output as it
enters o_proj, o_proj, post-attention norm, MLP, the layer's output), the final norm, the logits at
the scored positions (`lm_head`) and their logprobs. The packed row is cut back into sequences by
the packer's cu_seqlens, and the vision tower's rows into images, so every module is compared on
the same tokens: max |engine − policy|, relative L2 ‖engine − policy‖ / ‖policy‖, and whether the
two are bitwise equal. The first module whose max |diff| passes `--tol` (default 0: any bit) is
flagged. With generated responses, the engine's own sampled-token logprobs (KV-cache decoding) are
compared with the policy's as well (`generation_logprobs`).

With `--exact` (rollout.exact=true, docs/fidelity.md "Exact mode") both sides run the exact mode's kernels
and the report carries the engine's account of what the mode patched (`exact`); the tolerance stays 0, so
`first_over_tol` names the first module that is still not bitwise equal, and `logprobs_bitwise` says whether
the scored tokens' logprobs are.

Hooks on a compiled block see nothing inside it: the tool builds the policy with
`model.compile=false` (a `--set` override wins). Tensor-parallel policies (`parallel.tp` > 1) are
refused: their projections' outputs are shards. Several data-parallel ranks (torchrun) each compare
their own sequences; rank 0 prints its own.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from grpo.config import load_config  # noqa: E402
from grpo.run_folder import scratch_run_dir  # noqa: E402
from tools.logprob_check import add_run_arguments  # noqa: E402

# Inside each decoder layer, in the order they finish: (path under the layer, capture its input).
# o_proj's input is the attention kernel's output.
_LAYER_PARTS = (
    ("input_layernorm", True), ("input_layernorm", False), ("self_attn.q_proj", False), ("self_attn.k_proj", False),
    ("self_attn.v_proj", False), ("self_attn.o_proj", True), ("self_attn.o_proj", False),
    ("post_attention_layernorm", False), ("mlp", False),
)
# Wrappers that activation checkpointing and torch.compile put into module paths.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
INPUT_SUFFIX = "[input]"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, num_prompts=2, n=2, max_new_tokens=16)
    p.add_argument("--min-pixels", type=int, default=3136)
    p.add_argument("--max-pixels", type=int, default=12544)
    p.add_argument("--random-responses", action="store_true",
                   help="random response tokens (never a vision token) instead of the engine's generations")
    p.add_argument("--tol", type=float, default=0.0,
                   help="flag the first module whose max |engine - policy| exceeds this (0: any difference)")
    p.add_argument("--perturb-engine", default=None, metavar="WEIGHT=EPS",
                   help="add EPS to one engine weight (transformers name) before comparing: checks the tool "
                        "points at the op that was changed")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--exact", action="store_true",
                   help="rollout.exact=true: batch-invariant vLLM and the policy on the engine's kernels")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a further config override, e.g. rollout.enforce_eager=true (repeatable)")
    return p.parse_args(argv)


# --- probes and hooks --------------------------------------------------------------------------
@dataclass
class Probe:
    """One captured module output: `name` is its transformers path (plus `[input]` for an input)."""

    name: str
    module: nn.Module
    # vision: rows are patches or image tokens, per image; head: rows are scored tokens; layer: a decoder
    # layer's output; else (batch, tokens, ...) activations of the decoder
    role: str
    take_input: bool = False

    @property
    def vision(self) -> bool:
        return self.role == "vision"


def _clean(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def build_probes(model: nn.Module, adapter) -> list[Probe]:
    """The modules to capture, found through the family adapter's accessors; parts a family lacks are skipped."""
    names = {id(m): _clean(n) for n, m in model.named_modules()}
    probes: list[Probe] = []
    tower = adapter.vision_tower(model)
    for attr in ("patch_embed", "blocks", "merger"):
        part = getattr(tower, attr, None)
        for m in (list(part) if isinstance(part, nn.ModuleList) else [part] if part is not None else []):
            probes.append(Probe(names[id(m)], m, "vision"))
    embed = adapter.embed_tokens(model)
    probes.append(Probe(names[id(embed)], embed, "token"))
    for layer in adapter.decoder_layers(model):
        for path, take_input in _LAYER_PARTS:
            try:
                m = layer.get_submodule(path)
            except AttributeError:
                continue
            probes.append(Probe(names[id(m)] + (INPUT_SUFFIX if take_input else ""), m, "token", take_input))
        probes.append(Probe(names[id(layer)], layer, "layer"))
    norm, head = adapter.final_norm(model), adapter.lm_head(model)
    probes += [Probe(names[id(norm)], norm, "token"), Probe(names[id(head)], head, "head")]
    return probes


def _first_tensor(output) -> torch.Tensor:
    """A module's output tensor (transformers' attention returns (output, weights))."""
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output


class Recorder:
    """Forward hooks on the probes while inside the block; `values[name]` lists each call's output on the CPU,
    `order` the names in the order they first finished (a captured input: when its module starts)."""

    def __init__(self, probes: list[Probe]):
        self.probes = probes
        self.values: dict[str, list[torch.Tensor]] = {}
        self.order: list[str] = []
        self._handles = []

    def store(self, name: str, value: torch.Tensor) -> None:
        if name not in self.values:
            self.order.append(name)
        self.values.setdefault(name, []).append(value.detach().to("cpu", copy=True))

    def __enter__(self) -> "Recorder":
        for p in self.probes:
            if p.take_input:
                hook = (lambda p: lambda m, args: self.store(p.name, _first_tensor(args)))(p)
                self._handles.append(p.module.register_forward_pre_hook(hook))
            else:
                hook = (lambda p: lambda m, args, out: self.store(p.name, _first_tensor(out)))(p)
                self._handles.append(p.module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# --- the two forwards --------------------------------------------------------------------------
@dataclass
class Sequence:
    """One sequence of the packed micro-batch, as the engine gets it."""

    ids: torch.Tensor  # (L,)
    positions: torch.Tensor  # (R, L)
    pixels: torch.Tensor | None
    grid: torch.Tensor | None
    targets: torch.Tensor  # positions within the sequence whose logits are scored
    target_ids: torch.Tensor
    images: list  # the canonical images (vLLM runs its own processor on them)


def split_microbatch(batch, mb, images: list[list]) -> list[Sequence]:
    """The micro-batch's sequences in packed order, with their scored positions relative to each start.
    `images[i]` are sample i's canonical images."""
    bounds = mb.cu_seqlens.tolist()
    target_seq, target_pos, target_ids = mb.target_seq.cpu(), mb.target_positions.cpu(), mb.target_ids.cpu()
    out = []
    for s, i in enumerate(mb.sample_indices):
        where = target_seq == s
        out.append(Sequence(batch["input_ids"].items[i], batch["position_ids"].items[i],
                            batch["pixel_values"].items[i], batch["image_grid_thw"].items[i],
                            target_pos[where] - bounds[s], target_ids[where], images[i]))
    return out


def _roles(probes: list[Probe]) -> dict[str, str]:
    return {**{p.name: p.role for p in probes}, "logprobs": "head"}


def _join(parts: list[torch.Tensor], role: str) -> torch.Tensor:
    """Calls of one module joined: rows (vision, scored tokens) on dim 0, decoder activations on the token dim."""
    return torch.cat(parts, dim=0 if role in ("vision", "head") else 1)


def policy_forward(policy, mb, temperature: float) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
    """Captures of one packed micro-batch through `Policy.logprobs`: name → tensor, forward order, name → role."""
    probes = build_probes(policy.model, policy.adapter)
    roles = _roles(probes)
    with torch.no_grad(), Recorder(probes) as rec:
        lp, _ = policy.logprobs(mb, temperature=temperature)
    values = {n: _join(v, roles[n]) for n, v in rec.values.items()}
    values["logprobs"] = lp.detach().float().cpu()
    return values, rec.order + ["logprobs"], roles


class _TorchSide:
    """The built-in engine's transformers model, one sequence at a time, no cache."""

    def __init__(self, engine):
        self.engine = engine
        self.probes = build_probes(engine.model, engine.adapter)

    def forward(self, seq: Sequence, temperature: float) -> dict[str, list[torch.Tensor]]:
        e, a = self.engine, self.engine.adapter
        dev = e.device
        ids = seq.ids.view(1, -1).to(dev)
        positions = a.rope_rows(seq.positions).unsqueeze(1).to(dev)
        pixels = None if seq.pixels is None else seq.pixels.to(dev, e.dtype)  # as the engine's prefill casts them
        grid = None if seq.grid is None else seq.grid.reshape(-1, 3).long().to(dev)
        kwargs = a.engine_inputs(ids, positions, torch.ones_like(ids), pixels, grid)
        with torch.no_grad(), Recorder(self.probes) as rec:
            hidden = e.model.model(use_cache=False, **kwargs).last_hidden_state[0]
            logits = a.lm_head(e.model)(hidden[seq.targets.to(dev)]).float()  # as the engine's `_logits`
        rec.values["logprobs"] = [_logprobs(logits, seq.target_ids.to(dev), temperature).cpu()]
        return rec.values


def _logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The engine's reported logprob (rollout/torch_engine.py `sample_tokens`): log_softmax(logits / T)."""
    scaled = logits if temperature in (0.0, 1.0) else logits / temperature
    return torch.log_softmax(scaled.float(), dim=-1).gather(-1, targets.view(-1, 1)).view(-1)


class _VLLMSide:
    """vLLM's own model modules, hooked through `LLM.apply_model` (run on an H200 with vLLM 0.26).

    Each sequence is one request generating one token, after the prefix and encoder caches are
    cleared, so its whole prompt is prefilled and every hooked module sees it (a prefill split in
    chunks is joined back). It needs `rollout.enforce_eager=true` (the tool sets it, so the
    generations it compares are eager ones too): module hooks do not fire inside CUDA graphs or
    compiled regions, and a module that never fired shows as "not captured in the engine". Modules
    under vLLM's torch.compile decorator (the vision tower's) skip module hooks even in eager mode,
    so their forward is wrapped instead (`_ForwardTap`). Module paths are the policy's mapped by the
    family's vLLM name table (rollout/weight_names.py). vLLM's layers return (hidden, residual)
    pairs: a decoder layer's output is their sum, a norm's its first element, a norm's input the
    sum of its two arguments, read before it runs (eager vLLM's fused add + RMSNorm kernel overwrites
    both in place); q/k/v are cut from
    the fused qkv_proj by size. The logits are vLLM's `compute_logits` on its own final-norm output
    at the scored positions. One rank and vLLM tensor parallel 1 only (a shard of qkv_proj is not
    the policy's q).
    """

    def __init__(self, engine, policy):
        from rollout.weight_names import hf_to_vllm_name

        if dist.get_world_size() > 1 or getattr(engine, "_tp", 1) > 1:
            raise RuntimeError("op_diff with vLLM: run on one rank with rollout.tensor_parallel_size=1")
        self.engine = engine
        self.probes = build_probes(policy.model, policy.adapter)
        self.roles = _roles(self.probes)

        def vllm_path(name: str) -> str:
            path = hf_to_vllm_name(engine.family, name.removesuffix(INPUT_SUFFIX) + ".weight")[: -len(".weight")]
            for member in ("q_proj", "k_proj", "v_proj"):
                path = path.replace(f"self_attn.{member}", "self_attn.qkv_proj")
            return path

        self.paths = {p.name: vllm_path(p.name) for p in self.probes if p.role != "head"}
        self.banned = tuple(policy.adapter.banned_token_ids)  # the engine puts exact.BAN_BIAS on them
        text = engine._llm.llm_engine.model_config.hf_text_config
        self.heads, self.kv_heads = text.num_attention_heads, text.num_key_value_heads

    def forward(self, seq: Sequence, temperature: float) -> dict[str, list[torch.Tensor]]:
        from vllm import SamplingParams as VLLMSampling

        from rollout.base import PromptInput

        e = self.engine
        captured: dict[str, list[torch.Tensor]] = {}
        handles = e._llm.apply_model(lambda model: self._hook(model, captured))[0]
        try:
            e._drop_caches()
            request = e._vllm_prompt(0, PromptInput(seq.ids.tolist(), seq.images, seq.pixels, seq.grid))
            e._llm.generate([request], VLLMSampling(max_tokens=1), use_tqdm=False)
        finally:
            e._llm.apply_model(lambda model: [h.remove() for h in handles])
        values = {n: [_join(v, self.roles[n])] for n, v in captured.items()}
        norm, head = self.probes[-2].name, self.probes[-1].name
        picked = values[norm][0][0, seq.targets].to(f"cuda:{e._device}")
        logits = e._llm.apply_model(lambda model: model.compute_logits(picked))[0]
        values[head] = [logits.cpu()]
        values["logprobs"] = [self._engine_logprobs(logits, seq.target_ids.to(logits.device), temperature).cpu()]
        return values

    def _engine_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """The sampled tokens' logprobs as the engine reports them: with the banned tokens' bias, through vLLM's
        own sampler kernels under its V2 model runner (rollout.exact.v2_token_logprobs)."""
        from rollout import exact

        if exact.ENGINE_SAMPLER["path"] == "v2" and logits.is_cuda:
            return exact.v2_token_logprobs(logits, targets, temperature, self.banned, exact.BAN_BIAS)
        biased = logits.float()
        if self.banned:
            biased[:, list(self.banned)] += exact.BAN_BIAS
        return _logprobs(biased, targets, temperature)

    def _hook(self, model: nn.Module, captured: dict) -> list:
        def hook(p):
            return lambda m, args, kwargs, out: captured.setdefault(p.name, []).append(
                self._value(p, args, kwargs, out).detach().to("cpu", copy=True))

        def before(p):  # an input is read before the module runs: vLLM's fused add + RMSNorm kernel (eager, not
            # exact) writes the normalized output into x and the sum into residual, in place
            return lambda m, args, kwargs: hook(p)(m, args, kwargs, None)

        handles = []
        for p in self.probes:
            if p.role == "head":
                continue
            module = model.get_submodule(self.paths[p.name])
            if hasattr(module, "do_not_compile"):  # vLLM's support_torch_compile: its __call__ skips module hooks
                handles.append(_ForwardTap(module, hook(p), before=p.take_input))
            elif p.take_input:
                handles.append(module.register_forward_pre_hook(before(p), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(hook(p), with_kwargs=True))
        return handles

    def _value(self, p: Probe, args, kwargs, out) -> torch.Tensor:
        """A vLLM module's output in the policy's layout: rows for vision, (1, tokens, ...) for the decoder."""
        if p.take_input:
            value = args[0]
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            if isinstance(residual, torch.Tensor):  # a norm with the residual add fused: its input is the sum
                value = value + residual
        elif p.role == "layer" and isinstance(out, tuple) and out[1] is not None:
            value = out[0] + out[1]  # (hidden, residual): the residual add is fused into the next norm
        else:
            value = out[0] if isinstance(out, tuple) else out
        member = p.name.rsplit(".", 1)[-1]
        if member in ("q_proj", "k_proj", "v_proj"):
            dim = value.shape[-1] // (self.heads + 2 * self.kv_heads)
            q, k, v = value.split([self.heads * dim, self.kv_heads * dim, self.kv_heads * dim], dim=-1)
            value = {"q_proj": q, "k_proj": k, "v_proj": v}[member]
        return value.reshape(-1, value.shape[-1]) if p.vision else value.reshape(1, -1, value.shape[-1])


class _ForwardTap:
    """A forward hook for a module whose `__call__` bypasses nn.Module's hooks (vLLM's torch.compile decorator
    calls `self.forward` directly when it does not compile, as for the vision tower's blocks): the instance's
    forward is wrapped until `remove()`. `before`: the hook runs before the forward (with `out` None), for an input
    the forward may overwrite."""

    def __init__(self, module: nn.Module, hook, before: bool = False):
        self.module = module
        self._own = module.__dict__.get("forward")  # a forward set on the instance before the tap, if any
        inner = module.forward

        def forward(*args, **kwargs):
            if before:
                hook(module, args, kwargs, None)
            out = inner(*args, **kwargs)
            if not before:
                hook(module, args, kwargs, out)
            return out

        module.forward = forward

    def remove(self) -> None:
        if self._own is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self._own


def engine_forward(side, seqs: list[Sequence], image_group: list[int] | None, order: list[str],
                   roles: dict[str, str], temperature: float) -> dict[str, torch.Tensor]:
    """Each sequence through the engine's model, reassembled in the packed row's layout: decoder activations
    and scored rows concatenated over sequences, vision rows once per distinct image group, in group
    order (as the policy runs the tower)."""
    per_seq = [side.forward(s, temperature) for s in seqs]
    groups = image_group or [-1] * len(seqs)
    first_of = {g: s for s, g in reversed(list(enumerate(groups))) if g >= 0}  # a sequence showing each group
    out: dict[str, torch.Tensor] = {}
    for name in order:
        role = roles.get(name, "token")
        runs = [per_seq[first_of[g]] for g in sorted(first_of)] if role == "vision" else per_seq
        if runs and all(name in r for r in runs):
            out[name] = _join([_join(r[name], role) for r in runs], role)
    return out


# --- comparison --------------------------------------------------------------------------------
def compare(engine: dict[str, torch.Tensor], policy: dict[str, torch.Tensor], order: list[str],
            image_tokens: torch.Tensor | None = None) -> list[dict]:
    """One row per module in forward order: max |engine − policy|, ‖engine − policy‖ / ‖policy‖, bitwise equal.
    With `image_tokens` (a mask over the packed row's tokens), a decoder activation's row also gives the max
    over image-token and over text-token positions apart (an image-only difference points at the tower)."""
    rows = []
    for name in order:
        a, b = engine.get(name), policy.get(name)
        if a is None or b is None:
            rows.append({"name": name, "missing_in": "engine" if a is None else "policy"})
            continue
        if a.shape != b.shape:
            rows.append({"name": name, "shape_engine": list(a.shape), "shape_policy": list(b.shape)})
            continue
        d = a.double() - b.double()
        rows.append({
            "name": name, "shape": list(a.shape), "dtype": str(a.dtype).replace("torch.", ""),
            "max_abs": float(d.abs().max()) if d.numel() else 0.0,
            "rel_l2": float(d.norm() / b.double().norm().clamp_min(1e-30)),
            "bitwise": a.dtype == b.dtype and torch.equal(a, b),
        })
        if image_tokens is not None and image_tokens.any() and d.dim() >= 2 and d.shape[0] == 1 \
                and d.shape[1] == image_tokens.numel():
            per_token = d[0].abs().reshape(d.shape[1], -1).amax(dim=1)
            rows[-1]["max_abs_image"] = float(per_token[image_tokens].max())
            rows[-1]["max_abs_text"] = float(per_token[~image_tokens].max()) if (~image_tokens).any() else 0.0
    return rows


def first_over(rows: list[dict], tol: float) -> str | None:
    """The first module whose max |diff| exceeds `tol`, or whose shapes disagree; None when all are within it."""
    for r in rows:
        if "shape_engine" in r or r.get("max_abs", 0.0) > tol:
            return r["name"]
    return None


def format_table(rows: list[dict], first: str | None) -> str:
    lines = [f"{'module':<62} {'max |diff|':>11} {'rel L2':>10} bitwise  (image / text tokens)"]
    for r in rows:
        mark = "  <-- first over tol" if r["name"] == first else ""
        if "missing_in" in r:
            lines.append(f"{r['name']:<62} (not captured in the {r['missing_in']})")
        elif "shape_engine" in r:
            lines.append(f"{r['name']:<62} shapes differ: engine {r['shape_engine']} "
                         f"policy {r['shape_policy']}{mark}")
        else:
            split = f"  ({r['max_abs_image']:.3e} / {r['max_abs_text']:.3e})" if "max_abs_image" in r else ""
            lines.append(f"{r['name']:<62} {r['max_abs']:>11.3e} {r['rel_l2']:>10.3e} "
                         f"{'yes' if r['bitwise'] else 'no':>7}{split}{mark}")
    return "\n".join(lines)


# --- the run -----------------------------------------------------------------------------------
def _config(args):
    return load_config(None, [
        f"model.path={args.model}", f"model.dtype={args.dtype}", f"data.train_path={args.data}",
        f"data.task={args.task}", f"rollout.engine={args.engine}", f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
        f"data.min_pixels={args.min_pixels}", f"data.max_pixels={args.max_pixels}",
        f"trainer.run_dir={scratch_run_dir('op_diff')}", "checkpoint.resume=never", "logging.tensorboard=false",
        f"data.prompts_per_step={args.num_prompts}", "model.compile=false", "rollout.enforce_eager=true",
        *(["rollout.exact=true"] if args.exact else []), *args.overrides,
    ])


def _responses(trainer, prompts, args):
    """(responses, the prompt of each, the engine's generations or None)."""
    if not args.random_responses:
        gens = trainer.generate(prompts, trainer.sampling_params())
        return [torch.tensor(g.token_ids, dtype=torch.long) for g in gens], [g.prompt_index for g in gens], gens
    vocab = min(len(trainer.tokenizer), trainer.adapter.lm_head(trainer.policy.model).weight.shape[0])
    allowed = torch.tensor(sorted(set(range(vocab)) - set(trainer.adapter.banned_token_ids)))
    g = torch.Generator().manual_seed(trainer.cfg.trainer.seed + trainer.dims.rank)
    prompt_of = [i for i in range(len(prompts)) for _ in range(args.n)]
    picks = [allowed[torch.randint(len(allowed), (args.max_new_tokens,), generator=g)] for _ in prompt_of]
    return picks, prompt_of, None


def _perturb(engine, spec: str) -> None:
    name, eps = spec.rsplit("=", 1)
    params = dict(engine.model.named_parameters())
    if name not in params:
        raise KeyError(f"--perturb-engine: no engine weight {name!r} (the built-in engine's names, e.g. "
                       "model.language_model.layers.0.mlp.down_proj.weight)")
    with torch.no_grad():
        params[name].add_(float(eps))


def op_diff(args) -> dict:
    """Build the trainer, run both forwards with hooks and compare; returns the report (this rank's)."""
    from grpo.trainer import Trainer
    from grpo.update import PackedStep
    from rollout.torch_engine import TorchEngine

    trainer = Trainer(_config(args))
    if trainer.dims.tp > 1:
        raise RuntimeError("op_diff compares whole activations: run it with parallel.tp=1")
    per_rank = max(args.num_prompts // trainer.dims.dp, 1)
    prompts = trainer.feeder.next(per_rank)
    responses, prompt_of, gens = _responses(trainer, prompts, args)
    batch = trainer._sequence_batch(prompts, responses, prompt_of)
    step = PackedStep(batch, 1 << 30, trainer.policy.device)  # one micro-batch holding every sequence
    mb = step.microbatches[0]
    policy_vals, order, roles = policy_forward(trainer.policy, mb, args.temperature)
    seqs = split_microbatch(batch, mb, [prompts[i].images for i in prompt_of])
    with trainer.colocation.generating() as engine:
        if args.perturb_engine:
            _perturb(engine, args.perturb_engine)
        side = _TorchSide(engine) if isinstance(engine, TorchEngine) else _VLLMSide(engine, trainer.policy)
        engine_vals = engine_forward(side, seqs, mb.image_group, order, roles, args.temperature)
    image_tokens = mb.input_ids.reshape(-1).cpu() == trainer.adapter.image_token_id
    rows = compare(engine_vals, policy_vals, order, image_tokens)
    first = first_over(rows, args.tol)
    report = {
        "engine": type(engine).__name__, "dtype": str(trainer.policy.dtype).replace("torch.", ""),
        "sequences": len(seqs), "tokens": int(mb.input_ids.numel()), "scored_tokens": int(mb.target_ids.numel()),
        "random_responses": args.random_responses, "tol": args.tol, "first_over_tol": first, "modules": rows,
        "exact": trainer.cfg.rollout.exact, "logprobs_bitwise": next(
            (bool(r.get("bitwise")) for r in rows if r["name"] == "logprobs"), False),
    }
    mode = getattr(engine, "_exact", None)
    if mode is not None:
        report["exact_report"] = mode.report
    if gens is not None:
        ours = torch.cat([torch.tensor(gens[i].logprobs, dtype=torch.float64) for i in mb.sample_indices])
        d = ours - policy_vals["logprobs"].double()
        report["generation_logprobs"] = {"max_abs": float(d.abs().max()) if d.numel() else 0.0,
                                         "mean_abs": float(d.abs().mean()) if d.numel() else 0.0}
    return report


# --- kernel probes (--kernels) ----------------------------------------------------------------------------------
# The exact mode's premises, on random tensors at Qwen2.5-VL-3B's shapes, with no model: (1) cuBLAS gives a row
# the same bits whatever the number of rows multiplied with it (the engine multiplies a decode batch or a few
# prompts, the policy a packed micro-batch of thousands of tokens); (2) vLLM's FlashAttention gives a token the
# same bits as a one-token decode query over its prefix as inside a causal prefill of its whole sequence. The tiny
# models cannot break either where it is most likely: sums over K in the thousands (where cuBLAS would split K),
# a K that is not a multiple of 8 (the vision MLP's 3420: another kernel family), 8 query heads per key/value head.
GEMM_SHAPES = {  # the 3b size's projections: name -> (K, N, bias)
    "text.qkv_proj": (2048, 2560, True), "text.o_proj": (2048, 2048, False),
    "text.gate_up_proj": (2048, 22016, False), "text.down_proj": (11008, 2048, False),
    "lm_head": (2048, 151936, False), "visual.patch_embed": (1176, 1280, False),
    "visual.qkv": (1280, 3840, True), "visual.proj": (1280, 1280, True),
    "visual.gate_up_proj": (1280, 6840, True), "visual.down_proj": (3420, 1280, True),
    "visual.merger.mlp.0": (5120, 5120, True), "visual.merger.mlp.2": (5120, 2048, True),
}
GEMM_ROWS = (1, 2, 3, 4, 7, 8, 16, 33, 64, 100, 128, 255, 256, 300, 1000, 1024, 4096)
ATTENTION_SHAPES = {"3b": (16, 2, 128), "gqa8": (8, 1, 128), "tiny_hd128": (2, 1, 128)}  # (q heads, kv heads, dim)
# around the 128-key tiles and the 3b's ~300-token prompts (256 image tokens each)
ATTENTION_LENGTHS = (37, 128, 129, 200, 256, 300, 333, 400)
ATTENTION_WAYS = ("pure_decode", "mixed_step", "prompt_prefill")  # the engine's calls a token's output can come from


def gemm_row_probe(k: int, n: int, bias: bool, rows=GEMM_ROWS, total: int = 8192, device="cuda",
                   dtype=torch.bfloat16, linear=None, seed: int = 0) -> dict:
    """`total` rows multiplied at once by an (n, k) weight against the same rows multiplied m at a time, for each m
    in `rows`: from the first row, from the second (an offset the engine's slices can have), and as a 3-D (m, 1, k)
    input (vLLM's vision tower). Returns the (m, start, 3-D, max |diff|) cases that are not bitwise."""
    import torch.nn.functional as F

    linear = linear or F.linear
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(total, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    full = linear(x, w, b)
    differs = []
    for m in (m for m in rows if m < total):
        for start, three_d in ((0, False), (1, False), (0, True)):
            part = x[start:start + m]
            out = linear(part.unsqueeze(1), w, b).squeeze(1) if three_d else linear(part, w, b)
            ref = full[start:start + m]
            if not torch.equal(out, ref):
                differs.append({"rows": m, "start": start, "three_d": three_d,
                                "max_abs": float((out.double() - ref.double()).abs().max())})
    return {"k": k, "n": n, "bias": bias, "total_rows": total, "bitwise": not differs, "differs": differs}


def gemm_pair_probe(k: int, n: int, linear_a, linear_b, rows: int = 300, device="cuda", dtype=torch.bfloat16,
                    seed: int = 0) -> dict:
    """Two implementations of x·Wᵀ + b on the same `rows` rows: bitwise with a zero bias (the random test models'
    biases) and with a drawn one (a released checkpoint's q/k/v and vision biases)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(dtype)
    out = {}
    for name, b in (("zero_bias", torch.zeros(n, device=device, dtype=dtype)),
                    ("bias", torch.randn(n, generator=g, device=device).to(dtype))):
        a, c = linear_a(x, w, b), linear_b(x, w, b)
        out[name] = {"bitwise": torch.equal(a, c), "max_abs": float((a.double() - c.double()).abs().max())}
    return out


def decode_layout(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token of a packed row with boundaries `cu`: its sequence and its position in that sequence."""
    lengths = (cu[1:] - cu[:-1]).to(torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    pos = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1].to(torch.int64)[seq]
    return seq, pos


def attention_probe(heads: int, kv_heads: int, dim: int, lengths=ATTENTION_LENGTHS, kernel=None, device="cuda",
                    dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Each token's causal attention output as the policy computes it (one prefill of the packed row over paged K/V,
    `models.attention.paged_flash`) against the engine's decode of it: a one-token query over its prefix in a
    pure decode step (every query one token long), and in a mixed step (decode rows sharing the call with the
    first sequence's prefill). `kernel` defaults to vLLM's flash_attn_varlen_func (its FlashAttention version).
    Returns, per way, whether every token is bitwise and the first differing position of each sequence."""
    from models.attention import _vllm_flash_kernel, paged_flash, paged_kv

    if kernel is None:  # vLLM's kernel at its FlashAttention version, for the policy's calls and the engine's
        kernel, version = _vllm_flash_kernel()
        kernel = functools.partial(kernel, fa_version=version) if version is not None else kernel
    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=g, device=device).to(dtype)
    k, v = (torch.randn(total, kv_heads, dim, generator=g, device=device).to(dtype) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest, scale = max(lengths), dim ** -0.5
    prefill = paged_flash(q, k, v, cu, longest, scale, kernel=kernel)
    k_cache, v_cache, table, seq_lengths = paged_kv(k, v, cu)
    seq, pos = decode_layout(cu)
    i32 = {"dtype": torch.int32, "device": device}

    def call(rows_q, cu_q, max_q, used, blocks):
        return kernel(q=rows_q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=used,
                      max_seqlen_k=longest, softmax_scale=scale, causal=True, block_table=blocks, num_splits=1)

    decode = call(q, torch.arange(total + 1, **i32), 1, (pos + 1).to(torch.int32), table[seq])
    # a mixed step: sequence 0 prefilled, every token of the others decoded, in one call
    first = int(cu[1])
    rest = torch.arange(first, total, device=device)
    cu_mixed = torch.cat([torch.tensor([0], **i32), first + torch.arange(0, total - first + 1, **i32)])
    mixed = call(torch.cat([q[:first], q[rest]]), cu_mixed, first,
                 torch.cat([seq_lengths[:1], (pos[rest] + 1).to(torch.int32)]), torch.cat([table[:1], table[seq[rest]]]))

    # the engine's prompt prefill: each sequence's first three quarters alone (its keys end there), all in one call
    cuts = [max(1, 3 * n // 4) for n in lengths]
    kept = torch.cat([torch.arange(int(cu[i]), int(cu[i]) + c, device=device) for i, c in enumerate(cuts)])
    cu_cut = torch.tensor([0, *torch.tensor(cuts).cumsum(0).tolist()], **i32)
    prompt = paged_flash(q[kept], k[kept], v[kept], cu_cut, max(cuts), scale, kernel=kernel)

    def verdict(out, rows=None):
        rows = torch.arange(total, device=device) if rows is None else rows
        same = torch.ones(total, dtype=torch.bool, device=device)
        same[rows] = (out == prefill[rows]).flatten(1).all(dim=1)
        firsts = [int(pos[(seq == s) & ~same].min()) if bool(((seq == s) & ~same).any()) else None
                  for s in range(len(lengths))]
        return {"bitwise": bool(same.all()), "tokens_differing": int((~same).sum()),
                "first_differing_position": firsts,
                "max_abs": float((out.double() - prefill[rows].double()).abs().max())}

    return {"heads": heads, "kv_heads": kv_heads, "dim": dim, "lengths": list(lengths),
            "pure_decode": verdict(decode), "mixed_step": verdict(mixed), "prompt_prefill": verdict(prompt, kept)}


def kernel_probes(device="cuda") -> dict:
    """The exact mode's process settings and vLLM's batch-invariant overrides, then every GEMM shape of
    `GEMM_SHAPES` and attention shape of `ATTENTION_SHAPES`: one report, `all_bitwise` on top."""
    from rollout import exact

    import torch.nn.functional as F

    exact.prepare_process()  # before this process's first GEMM: torch reads the cuBLAS workspace settings once
    state = {}
    exact.enable_batch_invariance(state)
    engine_linear = exact._engine_linear_fn()  # what vLLM's linear layers call under VLLM_BATCH_INVARIANT
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "batch_invariant": state,
              # the policy's GEMM before exact_linear (cuBLAS), then the engine's (and exact_linear's)
              "gemm": {name: gemm_row_probe(*shape, device=device) for name, shape in GEMM_SHAPES.items()},
              "gemm_engine": {name: gemm_row_probe(*shape, device=device, linear=engine_linear)
                              for name, shape in GEMM_SHAPES.items()},
              "engine_vs_cublas": {name: gemm_pair_probe(k, n, engine_linear, F.linear, device=device)
                                   for name, (k, n, _) in GEMM_SHAPES.items()},
              "attention": {name: attention_probe(*shape, device=device) for name, shape in ATTENTION_SHAPES.items()}}
    # what exact mode relies on: the engine's GEMM row-invariant, the attention decode-invariant
    report["all_bitwise"] = all(r["bitwise"] for r in report["gemm_engine"].values()) and all(
        r[way]["bitwise"] for r in report["attention"].values() for way in ATTENTION_WAYS)
    return report


def format_probes(report: dict) -> str:
    """`kernel_probes`' report as text: one line per GEMM shape and kernel, per engine-vs-cuBLAS pair, per
    attention shape and way, naming the row counts or positions that are not bitwise."""
    lines = [f"kernel probes ({report['device']}, torch {report['torch']}): all bitwise {report['all_bitwise']}"]
    for kind, label in (("gemm", "cuBLAS"), ("gemm_engine", "vLLM")):
        for name, r in report[kind].items():
            bad = ", ".join(f"{d['rows']}{'@1' if d['start'] else ''}{' 3-D' if d['three_d'] else ''}"
                            for d in r["differs"][:8])
            lines.append(f"  gemm {label:<6} {name:<22} K={r['k']:<6} N={r['n']:<7} "
                         + ("bitwise for every row count" if r["bitwise"] else f"NOT bitwise at rows {bad}"))
    for name, r in report["engine_vs_cublas"].items():
        lines.append(f"  vLLM's linear vs cuBLAS {name:<22} zero bias: "
                     + "  bias: ".join(f"{'bitwise' if v['bitwise'] else 'differ'} ({v['max_abs']:.2e})"
                                       for v in r.values()))
    for name, r in report["attention"].items():
        for way in ATTENTION_WAYS:
            v = r[way]
            lines.append(f"  attention {name:<10} {r['heads']}/{r['kv_heads']}x{r['dim']} {way:<11} "
                         + ("bitwise" if v["bitwise"] else f"NOT bitwise: {v['tokens_differing']} tokens, first "
                            f"positions {v['first_differing_position']}, max |diff| {v['max_abs']:.3e}"))
    return "\n".join(lines)


def kernels_main(argv: list[str]) -> int:
    """`op_diff.py --kernels [--out FILE]`: the kernel probes alone (a GPU with vLLM; no model)."""
    p = argparse.ArgumentParser(description="the exact mode's kernel probes at the 3b size's shapes")
    p.add_argument("--kernels", action="store_true", required=True)
    p.add_argument("--out", default=None, help="also write the JSON report here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("op_diff --kernels: needs CUDA and vLLM (it runs the engine's kernels)")
    report = kernel_probes()
    print(format_probes(report), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--kernels" in argv:
        return kernels_main(argv)
    args = _parse(argv)
    from models.parallel import init_distributed, shutdown_distributed

    init_distributed()
    clean = False
    try:
        report = op_diff(args)
        if dist.get_rank() == 0:
            print(format_table(report["modules"], report["first_over_tol"]), flush=True)
            gen = report.get("generation_logprobs")
            if gen:
                print(f"engine generation logprobs (KV cache) vs policy: max |diff| {gen['max_abs']:.3e}", flush=True)
            print(f"first module over tol={args.tol:g}: {report['first_over_tol']}", flush=True)
            if report["exact"]:
                print(f"exact mode: logprobs bitwise {report['logprobs_bitwise']}; "
                      f"{json.dumps(report.get('exact_report', {}), default=str)}", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report) + "\n")
        clean = True
    finally:
        shutdown_distributed(clean)
    return 0


if __name__ == "__main__":
    sys.exit(main())
