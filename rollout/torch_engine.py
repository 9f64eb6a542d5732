"""The built-in torch engine: batched KV-cache generation with a plain, unsharded transformers VLM.

It is the CPU path (tests, the demo) and the reference the vLLM engine is measured against, so
it favours being exactly right over being fast:

- prompts are right-padded into one batch and prefilled once, with the images of all prompts
  and the explicit position ids the family adapter computes (Qwen-VL: m-rope; the same ids the trainer
  packs), plus a 2-D attention mask that hides the padding. Right padding keeps every query row
  attending to at least one real token, so no softmax row is fully masked;
- the KV cache rows are repeated `n` times after prefill (the vision tower and the prompt run
  once per prompt), then decoding appends one token per row at position
  `next_rope_position + t`; rows that sampled a stop token are dropped from the batch;
- logits are fp32, and the reported logprob of a sampled token is
  `log_softmax(logits / temperature)` over the full vocabulary, exactly what
  `Policy.logprobs(mb, temperature=...)` computes. Banned tokens (image placeholders) are
  removed only from the sampling distribution, not from the reported one: the trainer scores
  the unbanned distribution, and both sides must agree. Top-k and top-p likewise shape only
  the sampling distribution. Greedy decoding (temperature 0) reports `log_softmax(logits)`;
- with `record_routing` (MoE routing replay) each Generation carries the experts every token of its
  prompt and response was routed to (`models.moe.RouteRecorder`), as vLLM reports them.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from models.family import FamilyAdapter, build_adapter
from models.logits import head_logits
from models.moe import RouteRecorder
from models.policy import canonical_weight_name, conv3d_windows_as_linear, load_model_config
from rollout.base import Engine, Generation, PromptInput, SamplingParams


class TorchEngine(Engine):
    """An in-process engine over a plain transformers model (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        max_batch_size: int = 64,
        adapter: FamilyAdapter | None = None,
        record_routing: bool = False,
        fp32_logits: bool = False,
    ):
        from transformers import AutoModelForImageTextToText

        if max_batch_size < 1:
            raise ValueError(f"TorchEngine: max_batch_size must be >= 1, got {max_batch_size}")
        config = load_model_config(model_path)
        self.adapter: FamilyAdapter = adapter if adapter is not None else build_adapter(config)  # the policy's, once
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        # model.fp32_logits: the lm_head's logits with fp32 output, as the policy computes them (models/logits.py)
        self.fp32_logits = fp32_logits
        model = AutoModelForImageTextToText.from_pretrained(
            model_path, config=config, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation
        )
        self.model: nn.Module = model.to(self.device).eval()
        conv3d_windows_as_linear(self.model)  # the patch embedding as the policy and vLLM compute it
        self.vocab_size: int = self.adapter.lm_head(self.model).weight.shape[0]
        self._cache_kwarg = cache_kwarg_name(self.model.model)
        self._asleep = False
        self.last_stats: dict[str, float] = {}
        # MoE routing replay: each Generation carries the experts its tokens were routed to
        self.routes = RouteRecorder(self.adapter.routers(self.model)) if record_routing else None

    # --- weights ---------------------------------------------------------------------------
    def _named_tensors(self) -> dict[str, torch.Tensor]:
        # remove_duplicate=False keeps both names of a tied weight (lm_head / embed_tokens).
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        return named

    def refit(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors into the model's existing parameters, in place, cast to the engine's dtype.

        Names are transformers checkpoint names (legacy hub names are mapped to current ones).
        The whole iterable is consumed before an unknown name is reported: on several ranks the
        iterable is a collective (gathering sharded weights), and stopping early would hang the
        other ranks.
        """
        targets = self._named_tensors()
        unknown: list[str] = []
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(canonical_weight_name(name, self.adapter))
                if target is None:
                    unknown.append(name)
                    continue
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"TorchEngine.refit: weight {name} has shape {tuple(tensor.shape)}, "
                        f"the engine's model has {tuple(target.shape)}"
                    )
                target.copy_(tensor)
        if unknown:
            raise KeyError(
                f"TorchEngine.refit: {len(unknown)} weights are not in the engine's model, e.g. {unknown[:5]}; "
                "the engine expects transformers names (model.language_model.*, model.visual.*, lm_head.*)"
            )

    def sleep(self) -> None:
        """Offload weights to CPU when on an accelerator (a no-op on CPU); the KV cache lives only inside `generate`."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._clear_model_state()
        self._asleep = True

    def wake(self) -> None:
        """Bring the weights back to the engine's device."""
        if self.device.type != "cpu":
            self.model.to(self.device)
        self._asleep = False

    def _clear_model_state(self) -> None:
        # transformers' Qwen-VL models remember rope deltas between calls of their own generate();
        # we always pass positions explicitly, but a stale value must never survive a sleep.
        if hasattr(self.model.model, "rope_deltas"):
            self.model.model.rope_deltas = None

    # --- generation ------------------------------------------------------------------------
    def generate(self, prompts: list[PromptInput], params: SamplingParams) -> list[Generation]:
        """`params.n` responses per prompt, prompt-major; fills `last_stats` with throughput."""
        if self._asleep:
            raise RuntimeError("TorchEngine.generate called while the engine is asleep; call wake() first")
        check_sampling_params(params)
        vocab = self.vocab_size
        banned = sorted(set(params.banned_token_ids) | set(self.adapter.banned_token_ids))
        bad = [t for t in banned + list(params.stop_token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"SamplingParams: token ids {bad} are outside the vocabulary [0, {vocab})")
        prepared = [self._prepare(i, p) for i, p in enumerate(prompts)]
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        per_chunk = max(1, self.max_batch_size // params.n) if self.adapter.batch_with_padding else 1
        start = time.perf_counter()
        out: list[Generation] = []
        with torch.no_grad():
            for first in range(0, len(prepared), per_chunk):
                out += self._generate_chunk(prepared[first : first + per_chunk], params, banned, generator)
        seconds = time.perf_counter() - start
        gen_tokens = sum(len(g.token_ids) for g in out)
        self.last_stats = {
            "prompts": len(prompts),
            "sequences": len(out),
            "prompt_tokens": sum(len(p.input_ids) for p in prompts),
            "gen_tokens": gen_tokens,
            "seconds": seconds,
            "tokens_per_s": gen_tokens / seconds if seconds > 0 else 0.0,
        }
        return out

    def _prepare(self, index: int, prompt: PromptInput) -> "_Prepared":
        """Token ids and (4, L) position ids of one prompt; inconsistent inputs name the prompt."""
        if not prompt.input_ids:
            raise ValueError(f"prompt {index} has no tokens")
        ids = torch.tensor(prompt.input_ids, dtype=torch.long)
        grid = prompt.image_grid_thw
        if (grid is None) != (prompt.pixel_values is None):
            raise ValueError(f"prompt {index}: pixel_values and image_grid_thw must be given together")
        if grid is not None:
            grid = grid.reshape(-1, 3).long().cpu()
            try:
                self.adapter.check_pixels(prompt.pixel_values, grid)
            except ValueError as err:
                raise ValueError(f"prompt {index}: {err}") from err
        vgrid = prompt.video_grid_thw
        if (vgrid is None) != (prompt.pixel_values_videos is None):
            raise ValueError(f"prompt {index}: pixel_values_videos and video_grid_thw must be given together")
        if vgrid is not None:
            vgrid = vgrid.reshape(-1, 3).long().cpu()
        try:
            positions = self.adapter.position_ids(ids, grid, vgrid, prompt.second_per_grid_ts)
        except ValueError as err:
            raise ValueError(f"prompt {index}: {err}") from err
        return _Prepared(index, ids, positions, prompt.pixel_values, grid, prompt.pixel_values_videos, vgrid,
                         prompt.second_per_grid_ts)

    def _generate_chunk(
        self, chunk: list["_Prepared"], params: SamplingParams, banned: list[int], generator: torch.Generator
    ) -> list[Generation]:
        n, budget = params.n, params.max_new_tokens
        logits, cache, mask = self._prefill(chunk)
        routes = self._prompt_routes(chunk, n)
        # One prefill per prompt, then n decoding rows per prompt sharing its cached prompt.
        logits = logits.repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        cache.batch_repeat_interleave(n)
        next_pos = torch.tensor(
            [self.adapter.next_rope_position(p.positions) for p in chunk for _ in range(n)], device=self.device
        )
        rows = [p.index for p in chunk for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in rows]
        lps: list[list[float]] = [[] for _ in rows]
        finish: list[str] = ["length"] * len(rows)
        stop = set(params.stop_token_ids)
        active = list(range(len(rows)))
        for step in range(budget):
            token, logprob = sample_tokens(logits, params, banned, generator)
            keep = []
            for j, (row, tok, lp) in enumerate(zip(active, token.tolist(), logprob.tolist())):
                tokens[row].append(tok)
                lps[row].append(lp)
                if tok in stop:
                    finish[row] = "stop"
                else:
                    keep.append(j)
            if not keep or step == budget - 1:
                break
            if len(keep) < len(active):
                # Finished rows leave the batch: their tokens are final and they cost no more compute.
                sel = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(sel)
                token, mask, next_pos = token[sel], mask[sel], next_pos[sel]
                active = [active[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            logits = self._decode(token, next_pos + step, mask, cache)
            if routes is not None:  # the routing of each active row's token just fed
                for row, r in zip(active, self.routes.take()):
                    routes[row].append(r[None])
        if routes is None:
            return [Generation(r, t, lp, f) for r, t, lp, f in zip(rows, tokens, lps, finish)]
        # the last sampled token is never fed back: its row is -1
        return [Generation(r, t, lp, f, _padded(torch.cat(rt), chunk[i // n].ids.numel() + len(t)))
                for i, (r, t, lp, f, rt) in enumerate(zip(rows, tokens, lps, finish, routes))]

    def _prompt_routes(self, chunk: list["_Prepared"], n: int) -> list[list[torch.Tensor]] | None:
        """Per decoding row, the routing of its prompt's tokens in the prefill just run (its n rows share it)."""
        if self.routes is None:
            return None
        width = max(p.ids.numel() for p in chunk)
        prefill = self.routes.take()
        prefill = prefill.reshape(len(chunk), width, *prefill.shape[1:])
        return [[prefill[b, : p.ids.numel()]] for b, p in enumerate(chunk) for _ in range(n)]

    def _prefill(self, chunk: list["_Prepared"]):
        """Run the right-padded prompts once: last-token fp32 logits (B, V), the KV cache and the 2-D mask."""
        lengths = [p.ids.numel() for p in chunk]
        width = max(lengths)
        pad_id = self._pad_id()
        rows = [self.adapter.rope_rows(p.positions) for p in chunk]
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        positions = torch.zeros(rows[0].shape[0], len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, p in enumerate(chunk):
            ids[b, : lengths[b]] = p.ids
            positions[:, b, : lengths[b]] = rows[b]
            mask[b, : lengths[b]] = 1
        pixels = grid = None
        images = [p for p in chunk if p.grid is not None]
        if images:
            # The model scatters image features into placeholders in row-major order: prompt order.
            pixels = torch.cat([p.pixels for p in images]).to(self.device, self.dtype)
            grid = torch.cat([p.grid for p in images]).to(self.device)
        kwargs = self.adapter.engine_inputs(ids.to(self.device), positions.to(self.device), mask.to(self.device),
                                            pixels, grid)
        videos = [p for p in chunk if p.video_grid is not None]
        if videos:  # in prompt order, as the model scatters them
            seconds = [p.video_seconds for p in videos]
            kwargs.update(self.adapter.video_engine_inputs(
                torch.cat([p.video_pixels for p in videos]).to(self.device, self.dtype),
                torch.cat([p.video_grid for p in videos]).to(self.device),
                torch.cat(seconds).to(self.device) if all(s is not None for s in seconds) else None))
        kwargs["use_cache"] = True
        out = self.model.model(**kwargs)
        cache = getattr(out, "cache", None)
        if cache is None:
            cache = getattr(out, "past_key_values", None)
        if cache is None:
            raise RuntimeError("the model returned no KV cache from a use_cache=True forward")
        last = torch.tensor(lengths, device=self.device) - 1
        hidden = out.last_hidden_state[torch.arange(len(chunk), device=self.device), last]
        return self._logits(hidden), cache, mask.to(self.device)

    def _decode(self, token: torch.Tensor, position: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """One decoding step for the active rows: fp32 logits (R, V) of the next token."""
        rows = self.adapter.rope_row_count
        kwargs = self.adapter.engine_inputs(token.view(-1, 1), position.view(1, -1, 1).expand(rows, -1, 1), mask,
                                            None, None)
        out = self.model.model(use_cache=True, **{self._cache_kwarg: cache}, **kwargs)
        return self._logits(out.last_hidden_state[:, -1])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self.adapter.lm_head(self.model), hidden, self.fp32_logits)

    def _pad_id(self) -> int:
        # Any token that is not a placeholder: the model counts image tokens against image features.
        banned = set(self.adapter.banned_token_ids)
        return next(t for t in range(self.vocab_size) if t not in banned)


@dataclass
class _Prepared:
    """A validated prompt: its index, token ids, (4, L) positions and images."""

    index: int
    ids: torch.Tensor
    positions: torch.Tensor
    pixels: torch.Tensor | None
    grid: torch.Tensor | None
    video_pixels: torch.Tensor | None = None
    video_grid: torch.Tensor | None = None
    video_seconds: torch.Tensor | None = None


def _padded(routes: torch.Tensor, tokens: int) -> torch.Tensor:
    """`routes` (rows, layers, k) extended with rows of -1 to `tokens` rows."""
    extra = routes.new_full((tokens - routes.shape[0], *routes.shape[1:]), -1)
    return torch.cat([routes, extra])


def cache_kwarg_name(inner: nn.Module) -> str:
    """The KV-cache keyword of the inner model's forward: `cache` (transformers >= 5.24) or `past_key_values`."""
    names = inspect.signature(inner.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in names:
            return name
    raise RuntimeError(f"{type(inner).__name__}.forward takes neither `cache` nor `past_key_values`")


def check_sampling_params(params: SamplingParams) -> None:
    """Reject sampling parameters no engine can honour, naming the field."""
    if params.n < 1:
        raise ValueError(f"SamplingParams.n must be >= 1, got {params.n}")
    if params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {params.top_k}")


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, banned: list[int], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of fp32 logits (R, V); return the tokens and their reported logprobs.

    Reported: log_softmax(logits / T) of the full, unbanned vocabulary (T = 1 when greedy), the
    trainer's distribution. Sampled from: banned tokens removed, then temperature, top-k, top-p.
    """
    greedy = params.temperature == 0
    scaled = logits if greedy or params.temperature == 1.0 else logits / params.temperature
    reported = torch.log_softmax(scaled, dim=-1)
    allowed = scaled.clone()
    if banned:
        allowed[:, banned] = float("-inf")
    if greedy:
        token = allowed.argmax(dim=-1)
    else:
        allowed = _top_p(_top_k(allowed, params.top_k), params.top_p)
        token = torch.multinomial(torch.softmax(allowed, dim=-1), 1, generator=generator).squeeze(-1)
    return token, reported.gather(-1, token.unsqueeze(-1)).squeeze(-1)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k < 1 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches p (always at least the top one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
