"""Mixture-of-experts pieces the policy shares across MoE families: the routers' load-balancing loss."""

from __future__ import annotations

import torch


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
