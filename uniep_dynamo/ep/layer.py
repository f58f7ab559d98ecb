"""torch.ops.uniep.ep_layer: a whole expert-parallel MoE layer -- the routing plan and count exchange, the token
all-to-all, the local experts, the all-to-all back and the combine -- as ONE op, forward and backward.

What HF transformers' ``AllToAllEP`` becomes under ``torch.compile(backend="uniep")`` (uniep_dynamo/hf_ep.py puts the
call in the graph while Dynamo traces). The steps are the three ops the piece-by-piece rewrite makes, run back to
back inside one call:

    forward     the stable routing plan (rows ordered by expert, token, k); every rank's per-expert counts and
                slot count all-gathered (one collective) and copied to the host (plan.count_table: the layer's
                one synchronization), from which every rank checks every rank's ids (all raise together) and
                takes the split sizes, and the exchange its table (no collective of its own);
                exchange_forward: the overlapped exchange (transfers beside the grouped GEMMs) where every rank
                can take it and ``overlap`` is on, else the all-to-all, the experts op, the all-to-all back;
                combine_rows: out[t] = sum_k w[t, k] * row, k in order, in fp32.
    backward    combine_rows_backward, exchange_backward on the path the forward took (the host table says
                which), gather_sum: each token's K row gradients summed in k order. No collective of the
                backward waits on the host: the sizes are saved on the host.

So the bits are those of ep_dispatch + ep_exchange + ep_combine, and, for one tile configuration, those of the
single-GPU op over all ranks' tokens (each rank holding a contiguous shard of them).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from ..spec import CUDAGRAPH_UNSAFE, SECOND_BACKWARD_ERROR, autocast_off, decode_spec
from .config import OverlapConfig, knobs_from_json
from .exchange import KeptByTable, exchange_backward, exchange_forward, schema_param_grads
from . import device_choice, device_plan as device_plan_path
from .plan import count_table, layer_fused, routing_plan
from .sequential import combine_rows, combine_rows_backward, gather_sum


def _process_group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


_LAYER_SCHEMA = ("(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w_up, Tensor w_down, Tensor? b_up, "
                 "Tensor? b_down, str spec, str group_name, int world, bool overlap=False, str knobs=\"\", "
                 "int device_plan=0) "
                 "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


# The rows sent back, the received rows and their up projection of each forward call, and whether it ran the
# MegaKernel's routing kernels (plan.layer_fused, decided at run time: setup_context sees fake tensors under
# AOTAutograd), for its backward: kept beside the call's host table (an output the backward is handed back), dropped
# when the table dies, or when the backward takes them under reuse_saved_buffers. Kept here and not saved by autograd,
# so that the backward holds the only references and frees each buffer after its last read (a compiled backward
# holds the saved tensors it hands an op until the op returns).
_SAVED = KeptByTable()


def _keep(table, y_rows, x, up, fused_kernels: bool):
    _SAVED.keep(table, [y_rows, x, up, fused_kernels])


def _take(table, release: bool):
    """[y_rows, x, up, fused_kernels] kept by the forward that returned ``table``; ``release``: forgotten here."""
    saved = _SAVED.get(table, release)
    if saved is None:
        if release:  # taken by an earlier backward: the compile's reuse_saved_buffers allows one
            raise RuntimeError(SECOND_BACKWARD_ERROR)
        raise RuntimeError("uniep.ep_layer_backward: the forward call's received rows are gone (its host table is "
                           "not the one the forward returned)")
    return saved


def _out_dtype(spec, weights):
    return torch.promote_types(spec.out_dtype, weights.dtype)


@torch.library.custom_op("uniep::ep_layer", mutates_args=(), tags=CUDAGRAPH_UNSAFE, schema=_LAYER_SCHEMA)
@autocast_off
def ep_layer(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, group_name, world, overlap=False,
             knobs="", device_plan=0):
    """The EP layer over the `world` ranks of `group_name`, each owning E / W consecutive experts (w_up, w_down,
    b_up, b_down are this rank's): hidden [T, H], topk_ids [T, K] (global ids), topk_weights [T, K] are this
    rank's tokens. ``spec``: the experts op's spec for the received rows (each one expert, weight 1; its out_dtype
    the dtype of the rows sent back). Returns (out [T, H] in promote(rows, weights), the rows sent back in plan order
    [T*K, H], then what the backward reads: row_order, slot_row, expert_offsets, the received counts [W, E/W], and on
    the host the exchange's table and the split sizes [2, W]). The rows sent back, the received rows and their up
    projection (whose row count only the run knows: an output of that shape would make Dynamo break the graph at
    the op) are kept for the backward beside the table (_keep), not saved by autograd. ``device_plan``: 1 (True)
    keeps the plan on the device (ep/device_plan.py: no host synchronization; with ``overlap`` its forward pipelines
    its transfers with its GEMMs, device_pipeline.reason says where, and its backward pushes d_x beside the weight
    gradients' GEMMs) where that path runs, 2 ("auto") where device_choice.choose's rule says so, 0 never (with
    ``overlap``: the overlapped exchange of the synchronized path); the host table and sizes are then
    placeholders of their shapes, and the received counts are on the device as ever."""
    group = _process_group(group_name)
    if group.size() != world:
        raise ValueError(f"uniep.ep_layer: compiled for {world} ranks, but process group {group_name!r} has "
                         f"{group.size()}")
    s = decode_spec(spec)
    num_tokens, top_k = topk_ids.shape
    num_experts = w_up.shape[0] * world
    fused_kernels = layer_fused(hidden, topk_ids, w_up, w_down, b_up, b_down, s, world)
    auto = device_plan == device_choice.AUTO
    if device_plan:
        why, tokens = device_choice.choose(hidden, topk_ids, w_up, group, auto, fused_kernels)
        from ..kernels import megakernel
        if why is None:
            if auto:
                megakernel.warn_once("ep_layer", f"{world} ranks of group {group_name}",
                                     "uniep: the EP layer keeps its routing plan on the device (ep_device_plan "
                                     "\"auto\"; False turns it off): %s", logging.INFO)
            return _device_plan_forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, s, spec, group,
                                        knobs, fused_kernels, tokens, overlap)
        if auto:
            megakernel.warn_once("ep_layer", why, "uniep: the EP layer reads its plan on the host (ep_device_plan "
                                 "\"auto\" leaves the device plan off here): %s", logging.INFO)
        else:
            megakernel.warn_once("ep_layer", why,
                                 "uniep: ep_device_plan cannot run here; the EP layer reads its plan on the host: %s")
    row_order, slot_row, offsets = routing_plan(topk_ids, num_experts, fused_kernels)
    counts, slots, every = count_table(offsets, topk_ids.numel(), group)  # the layer's one host synchronization
    # an id outside [0, E) sorts past every expert's rows: that rank's counts then sum to fewer than its slots
    short = [r for r in range(world) if sum(counts[r]) != slots[r]]
    if short:
        raise ValueError(f"uniep.ep_layer: an expert id lies outside [0, {num_experts}) on rank(s) {short}")
    rank, local = dist.get_rank(group), w_up.shape[0]
    send_sizes = [sum(counts[rank][r * local:(r + 1) * local]) for r in range(world)]
    recv_sizes = [sum(row[rank * local:(rank + 1) * local]) for row in counts]
    recv = every[:, rank * local:(rank + 1) * local].contiguous()
    sizes = torch.tensor([send_sizes, recv_sizes], dtype=torch.int64)
    # every slot is routed (checked above), so the rows sent are all of them and y_rows needs no padding
    if fused_kernels:
        from ..kernels.triton_routing import gather_rows
        send = gather_rows(hidden, row_order, top_k)
    else:
        send = hidden[row_order // top_k]
    send = [send]  # the only reference, which the exchange drops once the rows are sent
    back, x, up, table = exchange_forward(send, recv, w_up, w_down, b_up, b_down, spec, group, send_sizes,
                                          recv_sizes, knobs_from_json(knobs), sequential=not overlap,
                                          count_table=counts)
    y_rows = back.to(s.out_dtype)
    out = combine_rows(y_rows, topk_weights, slot_row, offsets, _out_dtype(s, topk_weights), fused_kernels)
    _keep(table, y_rows, x, up, fused_kernels)
    return out, y_rows, row_order, slot_row, offsets, recv, table, sizes


def _device_plan_forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, s, spec, group, knobs,
                         fused_kernels, tokens, overlap):
    world, local = group.size(), w_up.shape[0]
    rank = dist.get_rank(group)
    back, row_order, slot_row, offsets, every, saved = device_plan_path.forward(
        hidden, topk_ids, w_up, w_down, b_up, b_down, spec, group, knobs_from_json(knobs) or OverlapConfig(),
        fused_kernels, tokens, pipelined=overlap)
    saved.y_rows = back.to(s.out_dtype)
    out = combine_rows(saved.y_rows, topk_weights, slot_row, offsets, _out_dtype(s, topk_weights), fused_kernels)
    recv = every[:, rank * local:(rank + 1) * local].contiguous()
    # placeholders of the host outputs' shapes: nothing of this call is on the host; the table object finds Saved
    table = torch.zeros(world, 3 * world + 2 + local, dtype=torch.int64)
    _SAVED.keep(table, saved)
    return out, saved.y_rows, row_order, slot_row, offsets, recv, table, torch.zeros(2, world, dtype=torch.int64)


@ep_layer.register_fake
def _ep_layer_fake(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, group_name, world,
                   overlap=False, knobs="", device_plan=0):
    s = decode_spec(spec)
    num_tokens, top_k = topk_ids.shape
    slots, size = topk_ids.numel(), hidden.shape[1]
    local_experts = w_up.shape[0]
    index = [topk_ids.new_empty(slots, dtype=torch.int64) for _ in range(2)]
    return (hidden.new_empty(num_tokens, size, dtype=_out_dtype(s, topk_weights)),
            hidden.new_empty(slots, size, dtype=s.out_dtype), index[0], index[1],
            topk_ids.new_empty(local_experts * world, dtype=torch.int64),
            topk_ids.new_empty(world, local_experts, dtype=torch.int64),
            torch.empty(world, 3 * world + 2 + local_experts, dtype=torch.int64, device="cpu"),
            torch.empty(2, world, dtype=torch.int64, device="cpu"))


_BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor topk_weights, Tensor row_order, Tensor slot_row, "
                    "Tensor expert_offsets, Tensor recv_counts, Tensor table, Tensor sizes, Tensor hidden_like, "
                    "Tensor w_up, Tensor w_down, Tensor? b_up, Tensor? b_down, str spec, str group_name, bool overlap, "
                    "str knobs, bool param_grads=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor[])")


@torch.library.custom_op("uniep::ep_layer_backward", mutates_args=(), tags=CUDAGRAPH_UNSAFE, schema=_BACKWARD_SCHEMA)
@autocast_off
def ep_layer_backward(grad_out, topk_weights, row_order, slot_row, expert_offsets, recv_counts, table, sizes,
                      hidden_like, w_up, w_down, b_up, b_down, spec, group_name, overlap, knobs, param_grads=True):
    """(d_hidden, d_topk_weights, d_w_up, d_w_down, [d_b_up, d_b_down for the biases given]) of ep_layer.
    ``hidden_like``: a 0-row tensor of the hidden states' dtype. Under ``spec.reuse_saved`` the forward's kept rows
    are taken from _SAVED, and each is freed after its last read: the rows sent back after the combine's backward,
    the received rows and their up projection after the experts' backward (exchange_backward). ``param_grads=False``
    (frozen experts): the exchange runs no weight-gradient GEMM, and empty tensors stand in for those gradients."""
    reuse_saved = decode_spec(spec).reuse_saved
    held = _take(table, reuse_saved)  # [y_rows, x, up, fused_kernels], or device_plan.Saved
    if isinstance(held, device_plan_path.Saved):
        if not reuse_saved:  # a second backward reads them again
            held = dataclasses.replace(held)
        *grads, d_b_up, d_b_down = device_plan_path.backward(
            grad_out, topk_weights, row_order, slot_row, expert_offsets, held, w_up, w_down, b_up, b_down, spec,
            _process_group(group_name), knobs_from_json(knobs) or OverlapConfig(), param_grads)
        return tuple(grads[:2]) + schema_param_grads(grads[2], grads[3], d_b_up, d_b_down, b_up, b_down, hidden_like)
    fused_kernels, dtype = held[3], held[1].dtype
    num_tokens, top_k = topk_weights.shape
    send_sizes, recv_sizes = sizes.tolist()  # on the host: no synchronization
    d_rows, d_weights = combine_rows_backward(grad_out, held[0], topk_weights, row_order, slot_row, expert_offsets,
                                              fused_kernels)
    # one-element lists holding the only references (once released from _SAVED), which the exchange empties
    d_rows, x, up = [d_rows.to(dtype)], held[1:2], held[2:3]
    del held
    d_send, d_w_up, d_w_down, d_b_up, d_b_down = exchange_backward(
        d_rows, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec,
        _process_group(group_name), send_sizes, recv_sizes, knobs_from_json(knobs), param_grads=param_grads)
    d_hidden = gather_sum(d_send, slot_row, expert_offsets, num_tokens, top_k, dtype, fused_kernels)
    return (d_hidden, d_weights) + schema_param_grads(d_w_up, d_w_down, d_b_up, d_b_down, b_up, b_down, hidden_like)


@ep_layer_backward.register_fake
def _ep_layer_backward_fake(grad_out, topk_weights, row_order, slot_row, expert_offsets, recv_counts, table,
                            sizes, hidden_like, w_up, w_down, b_up, b_down, spec, group_name, overlap, knobs,
                            param_grads=True):
    def like(t):
        return torch.empty_like(t) if param_grads else hidden_like.new_empty(0)

    return (grad_out.new_empty(topk_weights.shape[0], grad_out.shape[1], dtype=hidden_like.dtype),
            torch.empty_like(topk_weights), like(w_up), like(w_down),
            [like(b) for b in (b_up, b_down) if b is not None])


def _setup_context(ctx, inputs, output):
    hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, group_name, world, *rest = inputs
    _, _y_rows, row_order, slot_row, offsets, recv, table, sizes = output  # y_rows is kept in _SAVED
    ctx.set_materialize_grads(False)  # no zeros for the outputs after the first ([S, H] y_rows among them)
    ctx.save_for_backward(topk_weights, row_order, slot_row, offsets, recv, table, sizes, hidden[:0], w_up,
                          w_down, b_up, b_down)
    ctx.args = (spec, group_name, bool(rest[0]) if rest else False, rest[1] if len(rest) > 1 else "")  # not device_plan
    ctx.num_inputs = len(inputs)
    ctx.has_bias = (b_up is not None, b_down is not None)


def _backward(ctx, grad_out, *_unused):
    if grad_out is None:
        return (None,) * ctx.num_inputs
    param_grads = any(ctx.needs_input_grad[3:7])  # False for frozen experts: no weight-gradient GEMM
    d_hidden, d_weights, d_w_up, d_w_down, d_biases = torch.ops.uniep.ep_layer_backward(grad_out, *ctx.saved_tensors,
                                                                                        *ctx.args, param_grads)
    it = iter(d_biases)
    d_b_up = next(it) if ctx.has_bias[0] else None
    d_b_down = next(it) if ctx.has_bias[1] else None
    if not param_grads:
        d_w_up = d_w_down = d_b_up = d_b_down = None
    return (d_hidden, None, d_weights, d_w_up, d_w_down, d_b_up, d_b_down) + (None,) * (ctx.num_inputs - 7)


ep_layer.register_autograd(_backward, setup_context=_setup_context)
