"""Expert parallelism, sequential form: an EP experts layer built from torch.distributed collectives around the
uniep experts op.

This is the reference the overlapped layer (overlap.py, which pipelines the transfers with the GEMMs) equals bit for
bit. Each rank holds T tokens and E_local = E / world experts (rank r owns experts
[r * E_local, (r + 1) * E_local)).

    plan        the single-rank routing plan of the local slots over the E global experts: rows sorted by
                (expert, token, k). Rank r's experts are contiguous in it, so it is also the send order:
                rows [offsets[r*E_local - 1], offsets[(r+1)*E_local - 1]) go to rank r.
    counts      each rank sends its per-expert counts (an all_to_all of [world, E_local] integers); the
                split sizes go to the host (one synchronization: the sequential path's, which the fused
                op removes). plan.py.
    dispatch    all_to_all of the token rows. Rank r receives, source rank by source rank, each
                source's rows in (local expert, token, k) order: within an expert the received rows are
                ordered by (source rank, token, k), never by arrival.
    experts     the uniep experts op over the received rows (one expert each, weight 1): its stable sort
                by local expert keeps that order.
    combine     all_to_all of the result rows back to their source, then the fixed-order combine of
                the single-rank op: out[t] = sum_k w[t, k] * row, k in order, in fp32.

Backward runs the same way in reverse through autograd (the collectives are torch.distributed.nn's);
the dispatch's and the combine's own backward are the single-rank op's fixed-order reductions, so no
step adds in an order that depends on timing. Where the single-rank op runs the MegaKernel (CUDA; the
interpreter under UNIEP_KERNELS=triton; plan.layer_fused) those steps are the MegaKernel's own kernels and
each expert's rows come in the single-rank order when each rank holds a contiguous shard of the
tokens, so, for one tile configuration, the EP layer is meant to equal the single-GPU op bit for bit
(tests/test_gpu_ep.py checks it). The compile rewrites' ops (custom_ops.py) reuse its gather and combine steps.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..kernels import reference
from ..spec import decode_spec
from .plan import ep_plan, layer_fused


# ``fused_kernels`` below: the MegaKernel's own routing kernels (plan.layer_fused, or plan.fused for the piece-by-piece
# rewrite's ops), else the reference's.

def gather_sum(d_rows, slot_row, expert_offsets, num_tokens: int, top_k: int, dtype, fused_kernels: bool):
    """d_hidden[t] = sum over k (in order, fp32) of the rows of token t's K slots: the backward of
    rows = hidden[row_order // K]."""
    if fused_kernels:
        from ..kernels.triton_routing import combine
        return combine(d_rows.contiguous(), slot_row, None, expert_offsets, num_tokens, top_k, dtype)
    routed = reference.routed_rows_mask(expert_offsets, slot_row.numel())
    return reference.combine_slots(d_rows, slot_row, routed, None, num_tokens, top_k, dtype)


def combine_rows(rows, weights, slot_row, expert_offsets, out_dtype, fused_kernels: bool):
    """out[t] = sum_k w[t, k] * rows[slot_row[t*K + k]], k in order, in fp32; rows past the routed ones are 0."""
    num_tokens, top_k = weights.shape
    if fused_kernels:
        from ..kernels.triton_routing import combine
        return combine(rows.contiguous(), slot_row, weights.contiguous(), expert_offsets, num_tokens, top_k,
                       out_dtype)
    routed = reference.routed_rows_mask(expert_offsets, slot_row.numel())
    return reference.combine_slots(rows, slot_row, routed, weights, num_tokens, top_k, out_dtype)


def combine_rows_backward(grad_out, rows, weights, row_order, slot_row, expert_offsets, fused_kernels: bool,
                          out=None):
    """(d_rows, d_weights) of combine_rows: d_w from <grad_out, row> and d_rows = w * grad_out rows, as the
    single-rank op has them. ``out``: a contiguous [S, H] buffer of the rows' dtype the fused gather writes d_rows
    into where it can (an EP window's ``send``); d_rows is then ``out``."""
    num_tokens, top_k = weights.shape
    if fused_kernels:
        from ..kernels.triton_routing import gather_rows, routing_weight_grad
        grad_out = grad_out.contiguous()
        d_weights = routing_weight_grad(grad_out, rows.contiguous(), slot_row, expert_offsets, num_tokens, top_k,
                                        weights.dtype)
        # rounded to the rows' dtype in the gather where that gives the bits of the gather and a cast after it: a
        # gradient in fp32 (a combine in fp32 weights' promotion) needs no [S, H] rows in fp32
        d_rows = gather_rows(grad_out, row_order, top_k, weights.reshape(-1).contiguous(), out=out,
                             dtype=rows.dtype if grad_out.dtype in (torch.float32, rows.dtype) else None)
    else:
        routed = reference.routed_rows_mask(expert_offsets, slot_row.numel())
        d_weights, d_rows = reference.slot_grads(grad_out, rows, slot_row, row_order, routed, weights)
    return d_rows.to(rows.dtype), d_weights.to(weights.dtype)


class _Dispatch(torch.autograd.Function):
    """Token rows in plan order, [S, H]; backward: the sum over each token's K rows, k in order."""

    @staticmethod
    def forward(ctx, hidden, row_order, slot_row, expert_offsets, top_k, fused_kernels):
        ctx.save_for_backward(slot_row, expert_offsets)
        ctx.shape = (hidden.shape[0], top_k, hidden.dtype, fused_kernels)
        return hidden[row_order // top_k]

    @staticmethod
    def backward(ctx, d_rows):
        slot_row, expert_offsets = ctx.saved_tensors
        return gather_sum(d_rows, slot_row, expert_offsets, *ctx.shape), None, None, None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * rows[slot_row[t*K + k]], k in order, in fp32; rows of dropped slots are 0."""

    @staticmethod
    def forward(ctx, rows, weights, row_order, slot_row, expert_offsets, out_dtype, fused_kernels):
        ctx.save_for_backward(rows, weights, row_order, slot_row, expert_offsets)
        ctx.fused_kernels = fused_kernels
        return combine_rows(rows, weights, slot_row, expert_offsets, out_dtype, fused_kernels)

    @staticmethod
    def backward(ctx, grad_out):
        d_rows, d_weights = combine_rows_backward(grad_out, *ctx.saved_tensors, ctx.fused_kernels)
        return d_rows, d_weights, None, None, None, None, None


def ep_experts(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec: str, group=None):
    """The experts layer under expert parallelism: hidden [T, H] and topk_ids/topk_weights [T, K] are this
    rank's tokens (ids global), w_up/w_down/b_up/b_down this rank's E_local experts. Same result as
    torch.ops.uniep.moe_experts over all ranks' tokens and all experts."""
    from torch.distributed.nn.functional import all_to_all_single

    s = decode_spec(spec)
    if s.post is not None:
        raise ValueError("uniep: expert parallelism does not take post-expert programs yet")
    world = dist.get_world_size(group)
    num_experts = w_up.shape[0] * world
    top_k = topk_ids.shape[1]
    ids = topk_ids.clamp(0, num_experts - 1) if s.out_of_range == "clamp" else topk_ids
    fused_kernels = layer_fused(hidden, ids, w_up, w_down, b_up, b_down, s, world)
    plan = ep_plan(ids, num_experts, group, fused_kernels)
    routed_rows = sum(plan.send_counts)
    hidden_size = hidden.shape[1]

    x_rows = _Dispatch.apply(hidden, plan.row_order, plan.slot_row, plan.expert_offsets, top_k, fused_kernels)
    x_recv = all_to_all_single(x_rows.new_empty(sum(plan.recv_counts), hidden_size), x_rows[:routed_rows],
                               plan.recv_counts, plan.send_counts, group=group)
    # one expert per received row, routing weight 1: the op returns each row's down projection exactly
    down_dtype = torch.promote_types(w_down.dtype, b_down.dtype) if b_down is not None else w_down.dtype
    local_spec = dataclasses.replace(s, out_dtype=down_dtype, out_of_range="drop", reuse_saved=False).encode()
    ones = torch.ones(x_recv.shape[0], 1, dtype=topk_weights.dtype, device=x_recv.device)
    y_recv = torch.ops.uniep.moe_experts(x_recv, plan.recv_expert.unsqueeze(1), ones, w_up, w_down, b_up, b_down,
                                         [], local_spec)[0]
    y_back = all_to_all_single(y_recv.new_empty(routed_rows, hidden_size), y_recv, plan.send_counts,
                               plan.recv_counts, group=group)
    y_rows = torch.cat([y_back, y_back.new_zeros(ids.numel() - routed_rows, hidden_size)])
    return _Combine.apply(y_rows, topk_weights, plan.row_order, plan.slot_row, plan.expert_offsets, s.out_dtype,
                          fused_kernels)
