"""The fused routing kernels: scores, (group-limited) top-k and routing weights in one pass over the
logits, and the logits gradient of the routing weights in one pass back.

The router's linear runs on cuBLAS (the same F.linear call as eager, so the logits are eager's; its
reduction order is cuBLAS's fixed one). ``_router_select`` then takes BLOCK_T tokens and all E experts
(padded to a power of two) per program: softmax or sigmoid, the score-correction bias, the group limit,
the K selections and the weights stay in registers; ids and weights are stored. ``_router_grad``
recomputes the scores from the logits and writes d_logits (plus the logits' own gradient), which two
cuBLAS GEMMs turn into the hidden-state and gate-weight gradients. Every reduction runs in a fixed order;
nothing is atomic; there is no host synchronization.

Selection order: descending value, ties to the lower expert index, NaN above every number (values are
compared through a monotone int32 key that maps every NaN to the top).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import cdiv as _cdiv
from .config import interpreting
from .config import next_pow2 as _next_pow2
from .launch import launch
from .router_reference import linear_backward, router_logits

_MODES = {"softmax_topk": 0, "sigmoid_topk": 1, "topk_softmax": 2}
_INT_MIN = tl.constexpr(-2147483648)


@triton.jit
def _order_key(x):
    """int32 key with key(a) < key(b) iff a < b for floats; every NaN maps above +inf; -0 == +0."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, 0x7FC00000, key)


@triton.jit
def _take_max(key, values, idx, NONE: tl.constexpr):
    """Per row: the index of the largest key (lowest index on ties), where it is, and its value."""
    best = tl.max(key, axis=1)
    pick = tl.min(tl.where(key == best[:, None], idx, NONE), axis=1)
    chosen = idx == pick[:, None]
    return pick, chosen, tl.sum(tl.where(chosen, values, 0.0), axis=1)


@triton.jit
def _token_block(pid, num_tokens, num_experts, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr):
    """Program pid's BLOCK_T tokens (int64 row indices) and the E_PAD expert columns, with their masks."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    return rows.to(tl.int64), cols, rows < num_tokens, cols < num_experts


@triton.jit
def _load_logits(logits_ptr, rows64, cols, row_ok, col_ok, num_experts):
    return tl.load(logits_ptr + rows64[:, None] * num_experts + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _scores(z, col_ok, MODE: tl.constexpr, ROUND_SCORES: tl.constexpr, round_ty):
    """softmax over the experts (MODE 0), sigmoid (MODE 1) or the logits themselves (MODE 2), fp32."""
    if MODE == 0:
        zm = tl.where(col_ok[None, :], z, float("-inf"))
        e = tl.exp(zm - tl.max(zm, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    elif MODE == 1:
        scores = 1.0 / (1.0 + tl.exp(-z))
    else:
        scores = z
    if ROUND_SCORES:
        scores = scores.to(round_ty).to(tl.float32)
    return scores


@triton.jit
def _router_select(logits_ptr, sb_ptr, weights_ptr, ids_ptr, hist_ptr, num_tokens, num_experts, scale, renorm_eps,
                   MODE: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                   N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, HAS_SB: tl.constexpr,
                   ROUND_SCORES: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
                   PLAN: tl.constexpr, NUM_KEYS: tl.constexpr):
    pid = tl.program_id(0)
    rows64, cols, row_ok, col_ok = _token_block(pid, num_tokens, num_experts, BLOCK_T, E_PAD)
    z = _load_logits(logits_ptr, rows64, cols, row_ok, col_ok, num_experts)
    scores = _scores(z, col_ok, MODE, ROUND_SCORES, logits_ptr.dtype.element_ty)
    choice = scores
    if MODE == 1:
        if HAS_SB:
            choice = choice + tl.load(sb_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if N_GROUP > 1:
            # a group scores the sum of its two best choices; the TOPK_GROUP best groups stay eligible
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
                _pick, chosen, _v = _take_max(gkey, group_scores, gidx, N_GROUP)
                keep = tl.where(chosen, 1, keep)
                gkey = tl.where(chosen, _INT_MIN, gkey)
            keep3 = tl.broadcast_to(keep[:, :, None], [BLOCK_T, N_GROUP, GROUP])
            choice = tl.where(tl.reshape(keep3, [BLOCK_T, E_PAD]) != 0, choice, float("-inf"))

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
    if MODE == 2:  # softmax over the K chosen logits
        vm = tl.where(k_ok, vals, float("-inf"))
        e = tl.where(k_ok, tl.exp(vm - tl.max(vm, axis=1)[:, None]), 0.0)
        vals = e / tl.sum(e, axis=1)[:, None]
    if RENORM:
        vals = vals / (tl.sum(tl.where(k_ok, vals, 0.0), axis=1) + renorm_eps)[:, None]
    vals = vals * scale
    out = rows64[:, None] * K + kcols
    tl.store(weights_ptr + out, vals.to(weights_ptr.dtype.element_ty), mask=row_ok[:, None] & k_ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=row_ok[:, None] & k_ok)
    if PLAN:  # the routing plan's histogram of this block of BLOCK_T * K slots (padding counts as the last key)
        pkey = tl.where(row_ok[:, None] & k_ok, ids, NUM_KEYS - 1)
        tl.store(hist_ptr + pid * NUM_KEYS + tl.arange(0, NUM_KEYS),
                 tl.histogram(tl.reshape(pkey, [BLOCK_T * K_PAD]), NUM_KEYS))


@triton.jit
def _chosen(ids_ptr, rows64, row_ok, scores, cols, k, K: tl.constexpr):
    """Where slot k's expert sits in each row, and its score there."""
    idk = tl.load(ids_ptr + rows64 * K + k, mask=row_ok, other=0).to(tl.int32)
    hit = cols[None, :] == idk[:, None]
    return hit, tl.sum(tl.where(hit, scores, 0.0), axis=1)


@triton.jit
def _slot(ids_ptr, gw_ptr, rows64, row_ok, scores, cols, vmax, e_sum, scale, k, K: tl.constexpr,
          MODE: tl.constexpr):
    """Slot k: where its expert sits, v_k (MODE 2: its share of the softmax over the K chosen logits)
    and g_k = grad_weights * scale, the gradient of v_k before the renorm."""
    hit, vk = _chosen(ids_ptr, rows64, row_ok, scores, cols, k, K)
    if MODE == 2:
        vk = tl.exp(vk - vmax) / e_sum
    gk = tl.load(gw_ptr + rows64 * K + k, mask=row_ok, other=0.0).to(tl.float32) * scale
    return hit, vk, gk


@triton.jit
def _router_grad(logits_ptr, ids_ptr, gw_ptr, gl_ptr, dl_ptr, num_tokens, num_experts, scale, renorm_eps,
                 MODE: tl.constexpr, K: tl.constexpr, E_PAD: tl.constexpr, HAS_GW: tl.constexpr,
                 HAS_GL: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr):
    """d_logits = d(weights)/d(logits)^T grad_weights (+ grad_logits), with the forward's ids. Every sum
    over the K slots runs in k order."""
    pid = tl.program_id(0)
    rows64, cols, row_ok, col_ok = _token_block(pid, num_tokens, num_experts, BLOCK_T, E_PAD)
    g_z = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    if HAS_GW:
        z = _load_logits(logits_ptr, rows64, cols, row_ok, col_ok, num_experts)
        scores = _scores(z, col_ok, MODE, False, tl.float32)
        # MODE 2: v is the softmax of the K chosen logits; its max and normalizer first
        vmax = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
        e_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
        if MODE == 2:
            for k in tl.static_range(K):
                vmax = tl.maximum(vmax, _chosen(ids_ptr, rows64, row_ok, scores, cols, k, K)[1])
            for k in tl.static_range(K):
                e_sum += tl.exp(_chosen(ids_ptr, rows64, row_ok, scores, cols, k, K)[1] - vmax)
        # sum_k v_k and sum_k g_k v_k, with g_k = grad_weights * scale (the gradient of v before renorm)
        v_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
        gv_v = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k in tl.static_range(K):
            _hit, vk, gk = _slot(ids_ptr, gw_ptr, rows64, row_ok, scores, cols, vmax, e_sum, scale, k, K, MODE)
            v_sum += vk
            gv_v += gk * vk
        total = v_sum + renorm_eps
        # each slot's gradient through the renorm, then its share of g_z
        gvv_renormed = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k in tl.static_range(K):
            hit, vk, gk = _slot(ids_ptr, gw_ptr, rows64, row_ok, scores, cols, vmax, e_sum, scale, k, K, MODE)
            if RENORM:
                gk = gk / total - gv_v / (total * total)
            gvv_renormed += gk * vk
            if MODE == 0:
                share = gk
            elif MODE == 1:
                share = gk * vk * (1.0 - vk)
            else:
                share = gk * vk  # minus v_k * sum_j g_j v_j, subtracted below
            g_z += tl.where(hit, share[:, None], 0.0)
        if MODE == 0:  # softmax backward over all experts
            g_z = scores * (g_z - tl.sum(g_z * scores, axis=1)[:, None])
        elif MODE == 2:
            for k in tl.static_range(K):
                hit, vk = _chosen(ids_ptr, rows64, row_ok, scores, cols, k, K)
                g_z -= tl.where(hit, ((tl.exp(vk - vmax) / e_sum) * gvv_renormed)[:, None], 0.0)
    ptrs = rows64[:, None] * num_experts + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    d = g_z.to(dl_ptr.dtype.element_ty)
    if HAS_GL:
        d = (d.to(tl.float32) + tl.load(gl_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)).to(dl_ptr.dtype.element_ty)
    tl.store(dl_ptr + ptrs, d, mask=mask)


def _launch(num_tokens, num_experts):
    e_pad = max(16, _next_pow2(num_experts))
    block_t = 16 if interpreting() else max(1, min(64, 4096 // e_pad))
    return e_pad, block_t, (_cdiv(num_tokens, block_t),)


def router_forward(hidden, weight, bias, score_bias, spec):
    """(logits, weights, ids, row_order, slot_row, expert_offsets): the logits from cuBLAS; weights, ids
    and the histograms of the routing plan from one _router_select launch; with spec.plan, the plan's
    scan and scatter after it, or for one block of at most 1024 slots the one-program plan (else the plan tensors
    are empty)."""
    from .triton_routing import plan_buffers, plan_from_histogram, plan_num_keys

    num_tokens = hidden.shape[0]
    logits = router_logits(hidden, weight, bias, spec).contiguous()
    weights = hidden.new_empty(num_tokens, spec.top_k, dtype=spec.weights_dtype)
    ids = hidden.new_empty(num_tokens, spec.top_k, dtype=torch.int64)
    plan = plan_buffers(num_tokens * spec.top_k if spec.plan else 0, spec.num_experts if spec.plan else 0,
                        hidden.device)
    if num_tokens == 0:
        return (logits, weights, ids) + plan
    e_pad, block_t, grid = _launch(num_tokens, spec.num_experts)
    num_keys = plan_num_keys(spec.num_experts)
    hist = torch.empty(grid[0], num_keys, dtype=torch.int32, device=hidden.device) if spec.plan else ids
    k_pad = max(2, _next_pow2(spec.top_k))
    launch(
        _router_select, grid,
        logits, score_bias if score_bias is not None else logits, weights, ids, hist, num_tokens, spec.num_experts,
        float(spec.scale), float(spec.renorm_eps), MODE=_MODES[spec.mode], K=spec.top_k, K_PAD=k_pad, E_PAD=e_pad,
        N_GROUP=spec.n_group, TOPK_GROUP=spec.topk_group, HAS_SB=score_bias is not None,
        ROUND_SCORES=not spec.score_fp32 and logits.dtype != torch.float32, RENORM=spec.renorm, BLOCK_T=block_t,
        PLAN=spec.plan, NUM_KEYS=num_keys, num_warps=4)
    from torch._dynamo.utils import counters
    counters["uniep_kernels"]["triton_router"] += 1
    if spec.plan:
        plan_from_histogram(ids.reshape(-1), hist, block_t * spec.top_k, spec.num_experts, False, plan)
    return (logits, weights, ids) + plan


def router_backward(grad_logits, grad_weights, hidden, weight, bias, logits, ids, spec):
    """(d_hidden, d_weight, d_bias): d_logits from one _router_grad launch, then two cuBLAS GEMMs."""
    num_tokens = hidden.shape[0]
    logits, ids = logits.contiguous(), ids.contiguous()
    d_logits = torch.empty_like(logits)
    if num_tokens:
        e_pad, block_t, grid = _launch(num_tokens, spec.num_experts)
        gw = grad_weights.contiguous() if grad_weights is not None else logits
        gl = grad_logits.contiguous() if grad_logits is not None else logits
        launch(_router_grad, grid, logits, ids, gw, gl, d_logits, num_tokens, spec.num_experts, float(spec.scale),
               float(spec.renorm_eps), MODE=_MODES[spec.mode], K=spec.top_k, E_PAD=e_pad,
               HAS_GW=grad_weights is not None, HAS_GL=grad_logits is not None, RENORM=spec.renorm,
               BLOCK_T=block_t, num_warps=4)
        from torch._dynamo.utils import counters
        counters["uniep_kernels"]["triton_router_backward"] += 1
    return linear_backward(d_logits, hidden, weight, bias, spec)
