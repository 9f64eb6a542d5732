"""The lm_head's logits with fp32 output from model-dtype inputs (model.fp32_logits).

A bf16 head rounds every logit to bf16 (8 bits of mantissa) before the softmax; vLLM run with
`hf_overrides={"head_dtype": "float32"}` instead accumulates the projection straight into fp32
(`torch.mm(hidden, weight.t(), out_dtype=torch.float32)` on CUDA). `head_logits` computes the same on the
trainer and the torch engine: on CUDA the same fp32-output GEMM from the bf16 operands, elsewhere (no
`aten::mm.dtype` kernel on the CPU) the operands cast to fp32 first. The backward is the bf16 head's:
the fp32 gradient cast to the model dtype, then grad_h = g @ W and grad_W = gᵀ @ h in that dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class _Fp32OutputLinear(torch.autograd.Function):
    """h @ W.t() (+ b) with fp32 output from model-dtype h and W; the backward in the model dtype."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        flat = h.reshape(-1, h.shape[-1])
        if flat.is_cuda:
            out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
        else:
            out = flat.float() @ weight.float().t()
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


def fp32_head_logits(head: nn.Module, h: torch.Tensor) -> torch.Tensor | None:
    """fp32-output logits of a plain linear head (an nn.Linear with its own forward, no hooks of its own,
    a regular weight in h's dtype); None for any other head, which the caller runs as it is."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "forward" in head.__dict__:
        return None  # a subclass or a patched forward (exact mode's) computes something else
    if head._forward_hooks or head._forward_pre_hooks:
        return None
    weight, bias = head.weight, head.bias
    if isinstance(weight, DTensor) or isinstance(bias, DTensor) or weight.dtype != h.dtype:
        return None
    return _Fp32OutputLinear.apply(h, weight, bias)


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
