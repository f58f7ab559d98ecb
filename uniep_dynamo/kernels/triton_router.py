"""The fused routing kernel: logits, scores, (group-limited) top-k and routing weights in one pass.

One program takes BLOCK_T tokens and all E (padded to a power of two) experts: it accumulates the
router logits over H in BLOCK_H steps (a fixed order: the config is fixed, so results never depend on
a knob), stores them (they escape to the auxiliary loss), then computes the scores, the group limit,
the K selections and the weights in registers and stores ids and weights. Nothing goes through
memory between those steps and there is no host synchronization.

Selection order is torch.topk's: descending value, ties to the lower expert index, NaN above every
number (values are compared through a monotone int32 key that maps every NaN to the top).
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .config import interpreting

log = logging.getLogger("uniep")

MAX_EXPERTS = 256
_MODES = {"softmax_topk": 0, "sigmoid_topk": 1, "topk_softmax": 2}
_INT_MIN = -2147483648


@triton.jit
def _order_key(x):
    """int32 key with key(a) < key(b) iff a < b for floats; every NaN maps above +inf; -0 == +0."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, 0x7FC00000, key)


@triton.jit
def _take_max(key, values, idx, NONE: tl.constexpr):
    """Per row: the index of the largest key (lowest index on ties) and its value."""
    best = tl.max(key, axis=1)
    pick = tl.min(tl.where(key == best[:, None], idx, NONE), axis=1)
    chosen = idx == pick[:, None]
    return pick, chosen, tl.sum(tl.where(chosen, values, 0.0), axis=1)


@triton.jit
def _router_fwd(x_ptr, w_ptr, b_ptr, sb_ptr, logits_ptr, weights_ptr, ids_ptr, num_tokens, hidden_size,
                num_experts, stride_x, stride_w, scale, renorm_eps,
                MODE: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SB: tl.constexpr,
                DOT_FP32: tl.constexpr, ROUND_LOGITS: tl.constexpr, ROUND_SCORES: tl.constexpr,
                RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    for h0 in range(0, hidden_size, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden_size
        a = tl.load(x_ptr + rows64[:, None] * stride_x + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_w + hs[:, None], mask=col_ok[None, :] & h_ok[:, None], other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    logits = acc.to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + rows64[:, None] * num_experts + cols[None, :], logits, mask=out_ok)
    z = logits.to(tl.float32) if ROUND_LOGITS else acc
    neg_inf = float("-inf")

    if MODE == 0:  # softmax over the experts, then top-k of the probabilities
        zm = tl.where(col_ok[None, :], z, neg_inf)
        e = tl.exp(zm - tl.max(zm, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
        if ROUND_SCORES:
            scores = scores.to(logits_ptr.dtype.element_ty).to(tl.float32)
        choice = scores
    elif MODE == 1:  # sigmoid scores; the choice adds the correction bias and the group limit
        scores = 1.0 / (1.0 + tl.exp(-z))
        if ROUND_SCORES:
            scores = scores.to(logits_ptr.dtype.element_ty).to(tl.float32)
        choice = scores
        if HAS_SB:
            choice = choice + tl.load(sb_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if N_GROUP > 1:
            GROUP: tl.constexpr = E_PAD // N_GROUP
            c3 = tl.reshape(choice, [BLOCK_T, N_GROUP, GROUP])
            k3 = _order_key(c3)
            within = tl.arange(0, GROUP)[None, None, :]
            best = tl.max(k3, axis=2)
            first = tl.min(tl.where(k3 == best[:, :, None], within, GROUP), axis=2)
            is_first = within == first[:, :, None]
            top1 = tl.sum(tl.where(is_first, c3, 0.0), axis=2)
            k3 = tl.where(is_first, _INT_MIN, k3)
            best2 = tl.max(k3, axis=2)
            second = tl.min(tl.where(k3 == best2[:, :, None], within, GROUP), axis=2)
            top2 = tl.sum(tl.where(within == second[:, :, None], c3, 0.0), axis=2)
            group_scores = top1 + top2
            gkey = _order_key(group_scores)
            gidx = tl.arange(0, N_GROUP)[None, :]
            keep = tl.zeros([BLOCK_T, N_GROUP], dtype=tl.int32)
            for _g in tl.static_range(TOPK_GROUP):
                pick, chosen, _v = _take_max(gkey, group_scores, gidx, N_GROUP)
                keep = tl.where(chosen, 1, keep)
                gkey = tl.where(chosen, _INT_MIN, gkey)
            keep3 = tl.broadcast_to(keep[:, :, None], [BLOCK_T, N_GROUP, GROUP])
            choice = tl.where(tl.reshape(keep3, [BLOCK_T, E_PAD]) != 0, choice, neg_inf)
    else:  # top-k of the logits, then softmax over the K chosen
        scores = z
        choice = z

    key = tl.where(col_ok[None, :], _order_key(choice), _INT_MIN)
    kcols = tl.arange(0, K_PAD)[None, :]
    vals = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for k in tl.static_range(K):
        pick, chosen, v = _take_max(key, scores, cols[None, :], E_PAD)
        vals = tl.where(kcols == k, v[:, None], vals)
        ids = tl.where(kcols == k, pick[:, None], ids)
        key = tl.where(chosen, _INT_MIN, key)
    k_ok = kcols < K
    if MODE == 2:
        vm = tl.where(k_ok, vals, neg_inf)
        e = tl.where(k_ok, tl.exp(vm - tl.max(vm, axis=1)[:, None]), 0.0)
        vals = e / tl.sum(e, axis=1)[:, None]
    if RENORM:
        vals = vals / (tl.sum(tl.where(k_ok, vals, 0.0), axis=1) + renorm_eps)[:, None]
    vals = vals * scale
    out = rows64[:, None] * K + kcols
    tl.store(weights_ptr + out, vals.to(weights_ptr.dtype.element_ty), mask=row_ok[:, None] & k_ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=row_ok[:, None] & k_ok)


def unsupported_reason(hidden, weight, bias, score_bias, spec) -> str | None:
    """None if the fused routing kernel takes this call, else why the reference runs it."""
    from . import megakernel

    mode = megakernel.kernels_mode()
    if mode == "reference":
        return "UNIEP_KERNELS=reference"
    if hidden.device.type != "cuda":
        if mode != "triton":
            return "not a CUDA tensor: the reference is the CPU path"
        if not interpreting():
            return "UNIEP_KERNELS=triton on CPU needs TRITON_INTERPRET=1"
    fused = (torch.float32, torch.float16) if hidden.device.type != "cuda" else \
        (torch.float32, torch.float16, torch.bfloat16)
    if hidden.dtype not in fused or weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        return f"hidden {hidden.dtype}, router weight {weight.dtype}: the fused router takes one of {fused}"
    if spec.num_experts > MAX_EXPERTS:
        return f"{spec.num_experts} experts; the fused router takes at most {MAX_EXPERTS}"
    if spec.n_group > 1 and (spec.num_experts < 16 or spec.num_experts & (spec.num_experts - 1)
                             or spec.n_group & (spec.n_group - 1) or spec.num_experts // spec.n_group < 2):
        return (f"group-limited routing over E={spec.num_experts} in {spec.n_group} groups: the fused router "
                "takes E a power of two >= 16 in power-of-two groups of at least 2")
    if hidden.dim() != 2 or hidden.stride(-1) != 1 or weight.stride(-1) != 1:
        return "hidden states or router weight are not row-major 2-D"
    return None


_LOGGED: set = set()


def use_kernel(hidden, weight, bias, score_bias, spec) -> bool:
    reason = unsupported_reason(hidden, weight, bias, score_bias, spec)
    if reason is None:
        return True
    if reason not in _LOGGED and hidden.device.type == "cuda":
        _LOGGED.add(reason)
        log.warning("uniep: router op runs the PyTorch reference, not the fused kernel: %s", reason)
    return False


def router_forward(hidden, weight, bias, score_bias, spec):
    num_tokens, hidden_size = hidden.shape
    num_experts, k = spec.num_experts, spec.top_k
    logits_dtype = torch.float32 if spec.linear_fp32 else hidden.dtype
    logits = hidden.new_empty(num_tokens, num_experts, dtype=logits_dtype)
    weights = hidden.new_empty(num_tokens, k, dtype=spec.weights_dtype)
    ids = hidden.new_empty(num_tokens, k, dtype=torch.int64)
    if num_tokens == 0:
        return logits, weights, ids
    e_pad = max(16, triton.next_power_of_2(num_experts))
    interp = interpreting()
    block_t = 16 if interp else (64 if e_pad <= 64 else 32)
    block_h = 32 if interp else 64
    dot_fp32 = spec.linear_fp32 or hidden.dtype == torch.float32
    _router_fwd[(triton.cdiv(num_tokens, block_t),)](
        hidden, weight, bias if bias is not None else weight, score_bias if score_bias is not None else weight,
        logits, weights, ids, num_tokens, hidden_size, num_experts, hidden.stride(0), weight.stride(0),
        float(spec.scale), float(spec.renorm_eps),
        MODE=_MODES[spec.mode], K=k, K_PAD=max(2, triton.next_power_of_2(k)), E_PAD=e_pad,
        N_GROUP=spec.n_group, TOPK_GROUP=spec.topk_group, HAS_BIAS=bias is not None,
        HAS_SB=score_bias is not None, DOT_FP32=dot_fp32, ROUND_LOGITS=logits_dtype != torch.float32,
        ROUND_SCORES=not spec.score_fp32 and logits_dtype != torch.float32, RENORM=spec.renorm,
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4 if e_pad <= 64 else 8)
    from torch._dynamo.utils import counters
    counters["uniep_kernels"]["triton_router"] += 1
    return logits, weights, ids
