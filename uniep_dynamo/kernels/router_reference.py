"""Pure-PyTorch reference of ``uniep::moe_router`` (the oracle and the CPU path) and its backward.

Forward, for a RouterSpec (spec.py), on hidden [T, H], gate weight [E, H], bias [E]:

    logits = linear(hidden, weight, bias)              (on fp32 casts when spec.linear_fp32)
    z      = logits, in fp32 when spec.score_fp32
    softmax_topk:  p = softmax(z);  v, ids = topk(p, K)
    sigmoid_topk:  s = sigmoid(z);  c = s (+ score_bias);  group limit;  ids = topk(c, K);  v = s[ids]
    topk_softmax:  top, ids = topk(z, K);  v = softmax(top)
    w = v / (sum_k v + eps) if renorm;  w = w * scale;  w.to(weights_dtype)

Top-k order: descending value, ties to the lower expert index, NaN above every number, on every
device (``topk`` below; the fused kernel keeps the same order). torch.topk's order among equal values
is implementation-defined (on CPU, 16 equal values gave ids [10, 11, 12, 9] for K=4), so where scores
tie exactly at the K-th place eager may pick other, equally top, experts. HF calls topk with
``sorted=False`` in some routers; that order is unspecified too, and uniep returns the sorted one, so
the K slots may be permuted against eager (the same set of experts and weights).

The backward is written with torch ops on purpose: AOTAutograd traces it into the backward graph,
where inductor fuses it; its reductions run in inductor's fixed order (no atomics), and the scatter
writes distinct ids per row, so it is deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def router_logits(hidden, weight, bias, spec):
    if spec.linear_fp32:
        return F.linear(hidden.float(), weight.float(), bias.float() if bias is not None else None)
    return F.linear(hidden, weight, bias)


def topk(x: torch.Tensor, k: int):
    """torch.topk along the last dim with a defined order: descending, ties to the lower index, NaN
    first (a stable descending sort). torch.topk's own order among ties is implementation-defined."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def group_limited(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Mask (to -inf) every expert outside the topk_group groups whose two best choices sum highest."""
    num_experts = choice.shape[-1]
    grouped = choice.view(-1, n_group, num_experts // n_group)
    group_scores = topk(grouped, 2)[0].sum(dim=-1)
    group_idx = topk(group_scores, topk_group)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    return choice.masked_fill(~score_mask.bool(), float("-inf"))


def router_forward(hidden, weight, bias, score_bias, spec):
    """(logits, weights, ids) of the router; ids are int64."""
    logits = router_logits(hidden, weight, bias, spec)
    z = logits.float() if spec.score_fp32 else logits
    k = spec.top_k
    if spec.mode == "softmax_topk":
        v, ids = topk(torch.softmax(z, dim=-1), k)
    elif spec.mode == "sigmoid_topk":
        s = torch.sigmoid(z)
        choice = s + score_bias if score_bias is not None else s
        if spec.n_group > 1:
            choice = group_limited(choice, spec.n_group, spec.topk_group)
        ids = topk(choice, k)[1]
        v = s.gather(1, ids)
    elif spec.mode == "topk_softmax":
        top, ids = topk(z, k)
        v = torch.softmax(top, dim=-1)
    else:
        raise ValueError(f"uniep: unknown router mode {spec.mode!r}")
    if spec.renorm:
        v = v / (v.sum(dim=-1, keepdim=True) + spec.renorm_eps)
    if spec.scale != 1.0:
        v = v * spec.scale
    return logits, v.to(spec.weights_dtype), ids


def router_backward(grad_logits, grad_weights, hidden, weight, bias, logits, ids, spec):
    """Gradients (hidden, weight, bias) from the gradients of the logits and of the routing weights,
    recomputing the scores from the saved logits. Either gradient may be None (output unused)."""
    z = logits.float()
    g_logits = None
    if grad_weights is not None:
        g_v = grad_weights.float() * spec.scale
        if spec.mode == "softmax_topk":
            p = torch.softmax(z, dim=-1)
            v = p.gather(1, ids)
        elif spec.mode == "sigmoid_topk":
            v = torch.sigmoid(z).gather(1, ids)
        else:
            v = torch.softmax(z.gather(1, ids), dim=-1)
        if spec.renorm:
            total = v.sum(dim=-1, keepdim=True) + spec.renorm_eps
            g_v = g_v / total - (g_v * v).sum(dim=-1, keepdim=True) / (total * total)
        if spec.mode == "softmax_topk":
            g_p = torch.zeros_like(p).scatter(1, ids, g_v)
            g_z = p * (g_p - (g_p * p).sum(dim=-1, keepdim=True))
        elif spec.mode == "sigmoid_topk":
            g_z = torch.zeros_like(z).scatter(1, ids, g_v * v * (1 - v))
        else:
            g_z = torch.zeros_like(z).scatter(1, ids, v * (g_v - (g_v * v).sum(dim=-1, keepdim=True)))
        g_logits = g_z.to(logits.dtype)
    if grad_logits is not None:
        g_logits = grad_logits if g_logits is None else g_logits + grad_logits
    if g_logits is None:
        g_logits = torch.zeros_like(logits)
    return linear_backward(g_logits, hidden, weight, bias, spec)


def linear_backward(g_logits, hidden, weight, bias, spec):
    """(d_hidden, d_weight, d_bias) of the router's linear from the logits' gradient."""
    if spec.linear_fp32:
        d_hidden = (g_logits @ weight.float()).to(hidden.dtype)
        d_weight = (g_logits.t() @ hidden.float()).to(weight.dtype)
    else:
        d_hidden = g_logits @ weight
        d_weight = g_logits.t() @ hidden
    d_bias = g_logits.sum(0).to(bias.dtype) if bias is not None else None
    return d_hidden, d_weight, d_bias
