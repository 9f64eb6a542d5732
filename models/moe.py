"""Mixture-of-experts pieces the policy and the engines share across MoE families: the routers'
load-balancing loss, and routing replay.

Routing replay (`algorithm.routing_replay`): the engine reports, for every token it ran, the experts
each MoE layer's router chose ((tokens, MoE layers, top-k) ids; vLLM's `routed_experts`, the built-in
engine's `RouteRecorder`). The training forward then routes each token to those experts instead of
its own top-k, with the gate weights recomputed from the policy's own router logits over them
(softmax, then renormalized over the chosen k), so gradients still reach the router. A row of -1
(a token the engine did not run: the last sampled one) takes the policy's own top-k.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

_ROUTES: contextvars.ContextVar = contextvars.ContextVar("vlrl_replayed_routes", default=None)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over the router logits (tokens, experts) of every MoE layer.

    E · Σ_e f_e · P_e, with f_e the share of top-k assignments that went to expert e and P_e the mean
    routing probability of e, both pooled over the layers' tokens (as transformers' MoE models define
    it, so a coefficient means what it means there). 1·k when routing is uniform; it grows as the
    router favours some experts. f carries no gradient; P does.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss: no router logits (the model ran no MoE layer)")
    experts = router_logits[0].shape[-1]
    counts = torch.zeros(experts, device=router_logits[0].device)
    prob_sum = torch.zeros(experts, device=router_logits[0].device)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits.reshape(-1, experts).float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=experts).float()
        prob_sum = prob_sum + probs.sum(dim=0)
        rows += probs.shape[0]
    return experts * ((counts / rows) * (prob_sum / rows)).sum()


# --- routing replay -------------------------------------------------------------------------------

@contextlib.contextmanager
def routes_as(routes: torch.Tensor | None):
    """Within this block, replaying routers take their experts from `routes` ((tokens, layers, k) ids
    for the row the language model runs on; None: their own top-k)."""
    token = _ROUTES.set(routes)
    try:
        yield
    finally:
        _ROUTES.reset(token)


def current_routes() -> torch.Tensor | None:
    """The routes `routes_as` gave (activation checkpointing's recompute restores them)."""
    return _ROUTES.get()


def replay_topk(logits: torch.Tensor, forced: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights, expert ids) (tokens, k) of a softmax top-k router whose experts are `forced`.

    The weights are the softmax of the router's own `logits` at the forced experts, renormalized over
    them (Qwen-MoE's rule for its own top-k); a row of `forced` holding any id < 0 takes the router's
    own top-k."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    own = torch.topk(probs, top_k, dim=-1).indices
    known = (forced >= 0).all(dim=-1, keepdim=True)
    chosen = torch.where(known, forced.to(own.dtype), own)
    weights = probs.gather(-1, chosen)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), chosen


def _replaying_forward(router: nn.Module, layer: int, original):
    def forward(hidden_states):
        routes = _ROUTES.get()
        if routes is None:
            return original(hidden_states)
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        if routes.shape[0] != hidden.shape[0] or routes.shape[1] <= layer or routes.shape[2] != router.top_k:
            raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)} for MoE layer {layer} of a row "
                             f"of {hidden.shape[0]} tokens with top-{router.top_k} routing")
        logits = F.linear(hidden, router.weight)
        weights, chosen = replay_topk(logits, routes[:, layer].to(logits.device), router.top_k)
        return logits, weights, chosen

    return forward


def apply_routing_replay(routers: list[nn.Module]) -> None:
    """Make each softmax top-k router (`weight` (experts, hidden), `top_k`, `hidden_dim`: Qwen3.5-MoE's
    `mlp.gate`; router i is MoE layer i of the routes) replay routes given by `routes_as` (in place,
    once; its own routing outside such a block)."""
    for layer, router in enumerate(routers):
        if not getattr(router, "_vlrl_replay", False):
            router.forward = _replaying_forward(router, layer, router.forward)
            router._vlrl_replay = True


class RouteRecorder:
    """Records the experts each router chose in every forward (its output's third item, (tokens, k)),
    for an engine that reports its routing; `take()` returns them as (tokens, layers, k) int16."""

    def __init__(self, routers: list[nn.Module]):
        self.seen: list[torch.Tensor | None] = [None] * len(routers)
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._keeper(layer))

    def _keeper(self, layer: int):
        def keep(module, args, output):
            self.seen[layer] = output[2].detach().to("cpu", torch.int16)

        return keep

    def take(self) -> torch.Tensor:
        """The last forward's routing (tokens, layers, k), row-major over that forward's batch; cleared."""
        if any(s is None for s in self.seen):
            raise RuntimeError("RouteRecorder: a router did not run in the last forward")
        out = torch.stack(self.seen, dim=1)
        self.seen = [None] * len(self.seen)
        return out
