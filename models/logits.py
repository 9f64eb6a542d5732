"""The lm_head's logits with fp32 output from model-dtype inputs (model.fp32_logits).

A bf16 head rounds every logit to bf16 (8 bits of mantissa) before the softmax; vLLM run with
`hf_overrides={"head_dtype": "float32"}` instead accumulates the projection straight into fp32
(`torch.mm(hidden, weight.t(), out_dtype=torch.float32)` on CUDA). `head_logits` computes the same on the
trainer and the torch engine: on CUDA the same fp32-output GEMM from the bf16 operands, elsewhere (no
`aten::mm.dtype` kernel on the CPU) the operands cast to fp32 first. The backward is the bf16 head's:
the fp32 gradient cast to the model dtype, then grad_h = g @ W and grad_W = gᵀ @ h in that dtype.

`head_logprobs` takes the scored tokens' logprobs through such a head a chunk of tokens at a time in one
autograd node (`_ChunkedHeadLogprobs`): the forward keeps each chunk's log-normalizer, not its logits; the
backward recomputes a chunk's logits, turns them into the softmax's gradient in place, and accumulates the
head's weight gradient in the matrix product itself (`addmm_`), so no vocabulary-wide gradient is made per
chunk and added afterwards. Its forward values are the chunk-by-chunk ones bit for bit (the same products
and reductions in the same order).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _fp32_product(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """flat (N, H) @ weight.t() with fp32 output: accumulated straight into fp32 on CUDA, from fp32 copies elsewhere."""
    if flat.is_cuda:
        return torch.mm(flat, weight.t(), out_dtype=torch.float32)
    return flat.float() @ weight.float().t()


class _Fp32OutputLinear(torch.autograd.Function):
    """h @ W.t() (+ b) with fp32 output from model-dtype h and W; the backward in the model dtype."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = _fp32_product(h.reshape(-1, h.shape[-1]), weight)
        if bias is not None:
            out = out + bias.float()
        return out.reshape(*h.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(h.dtype)  # what `.float()`'s backward hands a bf16 head
        needs_h, needs_w, needs_b = ctx.needs_input_grad
        grad_h = (g @ weight).reshape(h.shape) if needs_h else None
        grad_w = (g.t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype) if needs_w else None
        grad_b = g.sum(0).to(ctx.bias_dtype) if needs_b and ctx.bias_dtype is not None else None
        return grad_h, grad_w, grad_b


def _plain_head_weight(head: nn.Module, h: torch.Tensor) -> torch.Tensor | None:
    """The weight of a head that is a plain projection (an nn.Linear with its own forward, no hooks of its own, a
    regular weight in h's dtype), whose logits this module computes itself; None for any other head."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "forward" in head.__dict__:
        return None  # a subclass or a patched forward (exact mode's) computes something else
    if head._forward_hooks or head._forward_pre_hooks:
        return None
    weight = head.weight
    if isinstance(weight, DTensor) or weight.dtype != h.dtype:
        return None
    return weight


def fp32_head_logits(head: nn.Module, h: torch.Tensor) -> torch.Tensor | None:
    """fp32-output logits of a plain linear head (an nn.Linear with its own forward, no hooks of its own,
    a regular weight in h's dtype); None for any other head, which the caller runs as it is."""
    weight = _plain_head_weight(head, h)
    if weight is None or isinstance(head.bias, DTensor):
        return None
    return _Fp32OutputLinear.apply(h, weight, head.bias)


def head_logits(head: nn.Module, h: torch.Tensor, fp32: bool) -> torch.Tensor:
    """The fp32 logits of `head` on hidden states `h`: with `fp32` (model.fp32_logits) and h in a narrower
    dtype, computed with fp32 output (`fp32_head_logits`, or the head's own `fp32_logits(h)` where it
    has more than a projection, e.g. Gemma's soft cap); otherwise, or for a head neither covers,
    `head(h).float()`, the logits rounded to the model dtype first."""
    if fp32 and h.dtype != torch.float32:
        own = getattr(head, "fp32_logits", None)
        logits = own(h) if callable(own) else fp32_head_logits(head, h)
        if logits is not None:
            return logits
    return head(h).float()


def entropy(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The entropy of softmax(logits) per row, given the rows' log-normalizers `lse`."""
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _chunk_head_logits(h: torch.Tensor, weight: torch.Tensor, fp32: bool, temperature: float) -> torch.Tensor:
    """One chunk's fp32 logits / temperature, as `head_logits` and the chunked path compute them."""
    if fp32 and h.dtype != torch.float32:
        logits = _fp32_product(h, weight)
    else:
        logits = torch.nn.functional.linear(h, weight).float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """Logprobs (N,) of `targets` under softmax(h @ Wᵀ / temperature), `chunk` rows at a time; the entropies
    (no gradient) where asked. See the module's docstring."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, fp32: bool, chunk: int, with_entropy: bool):
        lps, lses, ents = [], [], []
        for start in range(0, h.shape[0], chunk):
            logits = _chunk_head_logits(h[start:start + chunk], weight, fp32, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            lps.append(logits.gather(-1, targets[start:start + chunk].unsqueeze(-1)).squeeze(-1) - lse)
            lses.append(lse)
            if with_entropy:
                ents.append(entropy(logits, lse))
        lp = torch.cat(lps)
        ent = torch.cat(ents) if with_entropy else lp.new_zeros(0)
        ctx.save_for_backward(h, weight, targets, torch.cat(lses))
        ctx.settings = (temperature, fp32, chunk)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp: torch.Tensor, _grad_ent):
        h, weight, targets, lse = ctx.saved_tensors
        temperature, fp32, chunk = ctx.settings
        needs_h, needs_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h) if needs_h else None
        grad_w = torch.zeros_like(weight) if needs_w else None
        grad_lp = grad_lp.float()
        for start in range(0, h.shape[0], chunk):
            end = min(start + chunk, h.shape[0])
            g = grad_lp[start:end].unsqueeze(-1)
            # d lp / d logits = (onehot(target) - softmax) · upstream gradient, / temperature for the logits' division
            p = _chunk_head_logits(h[start:end], weight, fp32, temperature)
            p.sub_(lse[start:end].unsqueeze(-1)).exp_().mul_(-g)
            p.scatter_add_(-1, targets[start:end].unsqueeze(-1), g)
            if temperature != 1.0:
                p.div_(temperature)
            p = p.to(h.dtype)  # the bf16 head's backward: the fp32 gradient cast to the model dtype
            if needs_h:
                torch.mm(p, weight, out=grad_h[start:end])
            if needs_w:
                grad_w.addmm_(p.t(), h[start:end])
        return grad_h, grad_w, None, None, None, None, None


def head_logprobs(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float, fp32: bool,
                  chunk: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(logprobs (N,) of `targets`, entropies (N,) or None) from hidden states h (N, H) through `head`, `chunk`
    tokens at a time in one autograd node, the logits computed as `head_logits` computes them; None for a head
    that is not a plain projection without a bias (`_plain_head_weight`), which the caller runs chunk by chunk."""
    weight = _plain_head_weight(head, h)
    if weight is None or head.bias is not None:
        return None
    lp, ent = _ChunkedHeadLogprobs.apply(h, weight, targets, float(temperature), bool(fp32), int(chunk),
                                         bool(with_entropy))
    return lp, (ent if with_entropy else None)
