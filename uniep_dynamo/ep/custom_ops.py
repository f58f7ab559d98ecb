"""Expert parallelism, sequential form: the routing plan across ranks and an EP experts layer built from
torch.distributed collectives around the uniep experts op.

This is the path the compile rewrites run (ops at the end of this file) and the reference the overlapped
layer (ep_overlap.py, which pipelines the transfers with the GEMMs) equals bit for bit. Each rank holds T tokens and E_local = E / world experts (rank r owns experts
[r * E_local, (r + 1) * E_local)).

    plan        the single-rank routing plan of the local slots over the E global experts: rows sorted by
                (expert, token, k). Rank r's experts are contiguous in it, so it is also the send order:
                rows [offsets[r*E_local - 1], offsets[(r+1)*E_local - 1]) go to rank r.
    counts      each rank sends its per-expert counts (an all_to_all of [world, E_local] integers); the
                split sizes go to the host (one synchronization: the sequential path's, which the fused
                op removes).
    dispatch    all_to_all of the token rows. Rank r receives, source rank by source rank, each
                source's rows in (local expert, token, k) order: within an expert the received rows are
                ordered by (source rank, token, k), never by arrival.
    experts     the uniep experts op over the received rows (one expert each, weight 1): its stable sort
                by local expert keeps that order.
    combine     all_to_all of the result rows back to their source, then the fixed-order combine of
                the single-rank op: out[t] = sum_k w[t, k] * row, k in order, in fp32.

Backward runs the same way in reverse through autograd (the collectives are torch.distributed.nn's);
the dispatch's and the combine's own backward are the single-rank op's fixed-order reductions, so no
step adds in an order that depends on timing. On CUDA those steps are the MegaKernel's own kernels and
each expert's rows come in the single-rank order when each rank holds a contiguous shard of the
tokens, so, for one tile configuration, the EP layer is meant to equal the single-GPU op bit for bit
(tests/test_gpu_ep.py checks it).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from .kernels import reference
from .spec import decode_spec


@dataclasses.dataclass
class EPPlan:
    row_order: torch.Tensor  # [S] slot of each row, rows sorted by (global expert, token, k)
    slot_row: torch.Tensor  # [S] its inverse
    expert_offsets: torch.Tensor  # [E] cumulative rows per global expert
    send_counts: list  # rows to each rank
    recv_counts: list  # rows from each rank
    recv_expert: torch.Tensor  # [sum(recv_counts)] local expert of each received row


def _routing_plan(topk_ids: torch.Tensor, num_experts: int):
    """(row_order, slot_row, expert_offsets) of the single-rank op: on CUDA its Triton counting sort (three
    launches), elsewhere the reference's stable sort; the same integers either way."""
    from .kernels import megakernel

    if _fused(topk_ids) and num_experts <= megakernel.MAX_EXPERTS:
        from .kernels.triton_routing import MAX_SLOTS, routing_plan
        if topk_ids.numel() < MAX_SLOTS:
            return routing_plan(topk_ids, num_experts, clamp=False)
    return reference.routing_plan(topk_ids, num_experts)


def _plan_and_exchange(topk_ids: torch.Tensor, num_experts: int, world: int, group):
    """The single-rank routing plan (row_order, slot_row, expert_offsets) and the per-expert counts this
    rank sends and, exchanged over `group`, receives ([world, E / world] each)."""
    row_order, slot_row, offsets = _routing_plan(topk_ids, num_experts)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).view(world, num_experts // world)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    return row_order, slot_row, offsets, counts, recv


def _plan_and_gather(topk_ids: torch.Tensor, num_experts: int, world: int, group):
    """_plan_and_exchange with the counts all-gathered instead of exchanged: every rank's per-expert counts
    ([world, E], one collective, as the all_to_all was) give this rank's received counts, and the whole table
    goes to the host behind the model's own synchronization (ep_overlap.stash_count_table), for the exchange
    of the next graph to lay out its transfers without a collective of its own."""
    from .ep_overlap import stash_count_table

    row_order, slot_row, offsets = _routing_plan(topk_ids, num_experts)
    flat = torch.diff(offsets, prepend=offsets.new_zeros(1))
    table = flat.new_empty(world * num_experts)
    _all_gather_flat(table, flat, group=group)
    table = table.view(world, num_experts)
    e_local = num_experts // world
    rank = dist.get_rank(group)
    recv = table[:, rank * e_local:(rank + 1) * e_local].contiguous()
    stash_count_table(recv, table)
    return row_order, slot_row, offsets, flat.view(world, e_local), recv


# torch 2.13 renamed all_gather_into_tensor (a flat output of world * n elements on gloo and NCCL alike)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ep_plan(topk_ids: torch.Tensor, num_experts: int, group=None) -> EPPlan:
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ValueError(f"uniep: {num_experts} experts do not split evenly over {world} ranks")
    e_local = num_experts // world
    row_order, slot_row, offsets, counts, recv = _plan_and_exchange(topk_ids, num_experts, world, group)
    recv_expert = torch.repeat_interleave(
        torch.arange(e_local, device=counts.device).repeat(world), recv.reshape(-1))
    return EPPlan(row_order, slot_row, offsets, counts.sum(1).tolist(), recv.sum(1).tolist(), recv_expert)


def _fused(t: torch.Tensor) -> bool:
    """The MegaKernel's own gather/combine kernels on CUDA (so the EP layer rounds exactly as the
    single-rank op does), the reference's elsewhere."""
    from .kernels import megakernel

    return t.is_cuda and megakernel.kernels_mode() != "reference" and megakernel.triton_available()


def _gather_sum(d_rows, slot_row, expert_offsets, num_tokens: int, top_k: int, dtype):
    """d_hidden[t] = sum over k (in order, fp32) of the rows of token t's K slots: the backward of
    rows = hidden[row_order // K]."""
    if _fused(d_rows):
        from .kernels.triton_routing import combine
        return combine(d_rows.contiguous(), slot_row, None, expert_offsets, num_tokens, top_k, dtype)
    routed = reference.routed_rows_mask(expert_offsets, slot_row.numel())
    return reference.combine_slots(d_rows, slot_row, routed, None, num_tokens, top_k, dtype)


def _combine_rows(rows, weights, slot_row, expert_offsets, out_dtype):
    """out[t] = sum_k w[t, k] * rows[slot_row[t*K + k]], k in order, in fp32; rows past the routed ones are 0."""
    num_tokens, top_k = weights.shape
    if _fused(rows):
        from .kernels.triton_routing import combine
        return combine(rows.contiguous(), slot_row, weights.contiguous(), expert_offsets, num_tokens, top_k,
                       out_dtype)
    routed = reference.routed_rows_mask(expert_offsets, slot_row.numel())
    return reference.combine_slots(rows, slot_row, routed, weights, num_tokens, top_k, out_dtype)


def _combine_rows_backward(grad_out, rows, weights, row_order, slot_row, expert_offsets):
    """(d_rows, d_weights) of _combine_rows: d_w from <grad_out, row> and d_rows = w * grad_out rows, as the
    single-rank op has them."""
    num_tokens, top_k = weights.shape
    if _fused(rows):
        from .kernels.triton_routing import gather_rows, routing_weight_grad
        grad_out = grad_out.contiguous()
        d_weights = routing_weight_grad(grad_out, rows.contiguous(), slot_row, expert_offsets, num_tokens, top_k,
                                        weights.dtype)
        d_rows = gather_rows(grad_out, row_order, top_k, weights.reshape(-1).contiguous())
    else:
        routed = reference.routed_rows_mask(expert_offsets, slot_row.numel())
        d_weights, d_rows = reference.slot_grads(grad_out, rows, slot_row, row_order, routed, weights)
    return d_rows.to(rows.dtype), d_weights.to(weights.dtype)


class _Dispatch(torch.autograd.Function):
    """Token rows in plan order, [S, H]; backward: the sum over each token's K rows, k in order."""

    @staticmethod
    def forward(ctx, hidden, row_order, slot_row, expert_offsets, top_k):
        ctx.save_for_backward(slot_row, expert_offsets)
        ctx.shape = (hidden.shape[0], top_k, hidden.dtype)
        return hidden[row_order // top_k]

    @staticmethod
    def backward(ctx, d_rows):
        slot_row, expert_offsets = ctx.saved_tensors
        return _gather_sum(d_rows, slot_row, expert_offsets, *ctx.shape), None, None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * rows[slot_row[t*K + k]], k in order, in fp32; rows of dropped slots are 0."""

    @staticmethod
    def forward(ctx, rows, weights, row_order, slot_row, expert_offsets, out_dtype):
        ctx.save_for_backward(rows, weights, row_order, slot_row, expert_offsets)
        return _combine_rows(rows, weights, slot_row, expert_offsets, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        d_rows, d_weights = _combine_rows_backward(grad_out, *ctx.saved_tensors)
        return d_rows, d_weights, None, None, None, None


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
    plan = ep_plan(ids, num_experts, group)
    routed_rows = sum(plan.send_counts)
    hidden_size = hidden.shape[1]

    x_rows = _Dispatch.apply(hidden, plan.row_order, plan.slot_row, plan.expert_offsets, top_k)
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
    return _Combine.apply(y_rows, topk_weights, plan.row_order, plan.slot_row, plan.expert_offsets, s.out_dtype)


# The ops the expert-parallel patterns (patterns/ep.py) lower to. ------------------------------------

def _process_group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


_DISPATCH_SCHEMA = ("(Tensor hidden, Tensor topk_ids, int num_experts, int world, str group_name, "
                    "bool gather_counts=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("uniep::ep_dispatch", mutates_args=(), schema=_DISPATCH_SCHEMA)
def ep_dispatch(hidden, topk_ids, num_experts, world, group_name, gather_counts=False):
    """The send side of an all-to-all dispatch over the `world` ranks of `group_name`, each owning E / W
    consecutive experts. Returns (rows [S, H], row_order [S], send_counts [W, E/W], recv_counts [W, E/W],
    slot_row [S], expert_offsets [E]): the rows to send, hidden[row_order // K], ordered by (expert, token,
    k); the per-expert counts this rank sends and, exchanged, receives; and the plan backward reads.
    `world` is an argument, not read off the group, so that the graph (and any compiled-graph cache keyed
    on it) holds the shapes it was proven for. ``gather_counts`` (the compile rewrite sets it where the next
    graph's exchange is rewritten too): all-gather every rank's counts instead of exchanging this rank's,
    and hand the table to that exchange (_plan_and_gather)."""
    group = _process_group(group_name)
    if group.size() != world:
        raise ValueError(f"uniep.ep_dispatch: compiled for {world} ranks, but process group {group_name!r} has "
                         f"{group.size()}")
    plan = _plan_and_gather if gather_counts else _plan_and_exchange
    row_order, slot_row, offsets, counts, recv = plan(topk_ids, num_experts, world, group)
    # what eager's scatter_add of the counts would fault on, as a device-side check (no host sync): the plan
    # sorts an id outside [0, E) past every expert's rows, so the experts then hold fewer than all T*K slots
    if topk_ids.numel():
        torch._assert_async(offsets[-1] == topk_ids.numel(),
                            f"uniep.ep_dispatch: an expert id lies outside [0, {num_experts})")
    if _fused(hidden):
        from .kernels.triton_routing import gather_rows
        rows = gather_rows(hidden, row_order, topk_ids.shape[1])
    else:
        rows = hidden[row_order // topk_ids.shape[1]]
    _remember_inverse(row_order, slot_row)
    return rows, row_order, counts, recv, slot_row, offsets


@ep_dispatch.register_fake
def _ep_dispatch_fake(hidden, topk_ids, num_experts, world, group_name, gather_counts=False):
    slots = topk_ids.numel()
    index = [topk_ids.new_empty(slots, dtype=torch.int64) for _ in range(2)]
    counts = [topk_ids.new_empty(world, num_experts // world, dtype=torch.int64) for _ in range(2)]
    return (hidden.new_empty(slots, hidden.shape[1]), index[0], counts[0], counts[1], index[1],
            topk_ids.new_empty(num_experts, dtype=torch.int64))


@torch.library.custom_op("uniep::ep_dispatch_backward", mutates_args=(),
                         schema="(Tensor d_rows, Tensor slot_row, Tensor expert_offsets, SymInt num_tokens, "
                                "int top_k) -> Tensor")
def ep_dispatch_backward(d_rows, slot_row, expert_offsets, num_tokens, top_k):
    return _gather_sum(d_rows, slot_row, expert_offsets, num_tokens, top_k, d_rows.dtype)


@ep_dispatch_backward.register_fake
def _ep_dispatch_backward_fake(d_rows, slot_row, expert_offsets, num_tokens, top_k):
    return d_rows.new_empty(num_tokens, d_rows.shape[1])


def _dispatch_setup_context(ctx, inputs, output):
    hidden, topk_ids = inputs[0], inputs[1]
    ctx.save_for_backward(output[4], output[5])
    ctx.num_tokens, ctx.top_k = hidden.shape[0], topk_ids.shape[1]
    ctx.num_inputs = len(inputs)


def _dispatch_backward(ctx, d_rows, *_int_grads):
    slot_row, offsets = ctx.saved_tensors
    d_hidden = None if d_rows is None else \
        torch.ops.uniep.ep_dispatch_backward(d_rows, slot_row, offsets, ctx.num_tokens, ctx.top_k)
    return (d_hidden,) + (None,) * (ctx.num_inputs - 1)


ep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup_context)


# The inverse of each dispatch's row order, for the combine of the next graph, which reads that order back: the
# dispatch sorted it, so it is a permutation, and its inverse is the plan's slot_row. An entry lives as long as the
# order does (a weak reference; a live tensor's memory is its own, so an order at that address is this one) and
# serves while the order is unchanged (its version counter).
_INVERSES: dict = {}  # (device, address of the row order) -> (weak reference to it, its version, slot_row)
MAX_INVERSES = 1024
INVERSE_PATHS = {"dispatch": 0, "computed": 0}  # where the combines' inverses came from (tests read it)


def _address_key(t: torch.Tensor):
    """(device, address) of a tensor's data, what the dispatch's hand-overs are found by; None for an empty tensor
    (empty tensors may share an address)."""
    return (str(t.device), t.data_ptr()) if t.numel() else None


def _remember_inverse(row_order, slot_row):
    key = _address_key(row_order)
    if key is None:
        return
    import weakref


    def forget(ref, key=key):  # the order died (maybe on the autograd engine's thread): its entry goes too
        if _INVERSES.get(key, (None,))[0] is ref:
            _INVERSES.pop(key, None)
    _INVERSES.pop(key, None)
    _INVERSES[key] = (weakref.ref(row_order, forget), row_order._version, slot_row)
    while len(_INVERSES) > MAX_INVERSES:
        _INVERSES.pop(next(iter(_INVERSES)), None)


def _known_inverse(row_order):
    """The dispatch's slot_row for this row order, or None."""
    entry = _INVERSES.get(_address_key(row_order))
    if entry is None:
        return None
    ref, version, slot_row = entry
    order = ref()
    if order is None or order.shape != row_order.shape or order.dtype != row_order.dtype \
            or row_order._version != version or order._version != version:
        return None
    return slot_row


def _unpermute_plan(row_order, weights):
    """(slot_row, expert_offsets) of a permutation `row_order` of the T*K slots: its inverse, and one
    "expert" holding every row. A row_order that is not a permutation (eager's index_put would leave
    rows unwritten) fails a device-side check. The order of a dispatch (uniep.ep_dispatch) comes with its
    inverse: neither is computed again."""
    slots = row_order.numel()
    if slots != weights.numel():
        raise ValueError(f"uniep.ep_combine: {slots} rows for {weights.shape[0]} tokens x {weights.shape[1]} slots")
    known = _known_inverse(row_order)
    if known is not None:
        INVERSE_PATHS["dispatch"] += 1
        return known.long(), row_order.new_full((1,), slots, dtype=torch.int64)
    INVERSE_PATHS["computed"] += 1
    order = row_order.long()
    torch._assert_async(((order >= 0) & (order < slots)).all(),
                        "uniep.ep_combine: the unpermute order indexes outside the rows")
    slot_row = torch.full_like(order, -1)
    slot_row[order.clamp(0, max(slots - 1, 0))] = torch.arange(slots, device=order.device)
    torch._assert_async((slot_row >= 0).all(), "uniep.ep_combine: the unpermute order is not a permutation")
    return slot_row, order.new_full((1,), slots)


@torch.library.custom_op("uniep::ep_combine", mutates_args=(),
                         schema="(Tensor rows, Tensor row_order, Tensor weights) -> Tensor")
def ep_combine(rows, row_order, weights):
    """out[t] = sum_k weights[t, k] * rows[r] where row_order[r] = t*K + k, k in order, in fp32, in the
    promotion of the rows' and weights' dtypes: `buf = empty_like(rows); buf[row_order] = rows;
    (buf.view(T, K, H) * weights[..., None]).sum(1)` with one fixed rounding."""
    slot_row, offsets = _unpermute_plan(row_order, weights)
    return _combine_rows(rows, weights, slot_row, offsets, torch.promote_types(rows.dtype, weights.dtype))


@ep_combine.register_fake
def _ep_combine_fake(rows, row_order, weights):
    return rows.new_empty(weights.shape[0], rows.shape[1], dtype=torch.promote_types(rows.dtype, weights.dtype))


@torch.library.custom_op("uniep::ep_combine_backward", mutates_args=(),
                         schema="(Tensor grad_out, Tensor rows, Tensor row_order, Tensor weights) -> (Tensor, Tensor)")
def ep_combine_backward(grad_out, rows, row_order, weights):
    slot_row, offsets = _unpermute_plan(row_order, weights)
    return _combine_rows_backward(grad_out, rows, weights, row_order.long(), slot_row, offsets)


@ep_combine_backward.register_fake
def _ep_combine_backward_fake(grad_out, rows, row_order, weights):
    return torch.empty_like(rows), torch.empty_like(weights)


def _combine_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _combine_backward(ctx, grad_out):
    rows, row_order, weights = ctx.saved_tensors
    d_rows, d_weights = torch.ops.uniep.ep_combine_backward(grad_out, rows, row_order, weights)
    return d_rows, None, d_weights


ep_combine.register_autograd(_combine_backward, setup_context=_combine_setup_context)



# ---- the token all-to-all, the local experts and the all-to-all back, as one op ------------------------------

_EXCHANGE_SCHEMA = ("(Tensor send, Tensor recv_counts, Tensor w_up, Tensor w_down, Tensor? b_up, Tensor? b_down, "
                    "str spec, str group_name, SymInt[] send_sizes, SymInt[] recv_sizes, str knobs=\"\") "
                    "-> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("uniep::ep_exchange", mutates_args=(), schema=_EXCHANGE_SCHEMA)
def ep_exchange(send, recv_counts, w_up, w_down, b_up, b_down, spec, group_name, send_sizes, recv_sizes, knobs=""):
    """``back = all_to_all(experts(all_to_all(send)))``: this rank's rows [S, H] (in the order the dispatch sorted
    them) to the local experts' ranks by ``send_sizes``, rows from every rank by ``recv_sizes`` into the experts
    op (local expert ids ``arange(E_local).repeat(W).repeat_interleave(recv_counts)``, weight 1, spec ``spec``),
    and the results back the same way. ``knobs``: OverlapConfig fields as JSON ("" for the defaults). On the
    overlapped path (ep_overlap.exchange_forward) the transfers run
    beside the grouped GEMMs, chunk by chunk, with the same bits. Returns (back, then what the backward reads:
    the received rows, the up projection, and on the host the [W, 3W + 2 + E_local] table of send sizes, paths,
    the size check's claims and received counts, so that the backward does not synchronize again)."""
    from .ep_overlap import exchange_forward, knobs_from_json

    return exchange_forward(send, recv_counts, w_up, w_down, b_up, b_down, spec, _process_group(group_name),
                            send_sizes, recv_sizes, knobs_from_json(knobs))


@ep_exchange.register_fake
def _ep_exchange_fake(send, recv_counts, w_up, w_down, b_up, b_down, spec, group_name, send_sizes, recv_sizes,
                      knobs=""):
    s = decode_spec(spec)
    received = sum(recv_sizes)
    up_width = reference.effective_weight(w_up, s.up_layout).shape[2]
    world = recv_counts.shape[0]
    return (send.new_empty(send.shape[0], send.shape[1], dtype=s.out_dtype), send.new_empty(received, send.shape[1]),
            send.new_empty(received, up_width, dtype=w_up.dtype),
            torch.empty(world, 3 * world + 2 + recv_counts.shape[1], dtype=torch.int64, device="cpu"))


@torch.library.custom_op("uniep::ep_exchange_backward", mutates_args=(),
                         schema="(Tensor grad_back, Tensor x, Tensor up, Tensor recv_counts, Tensor table, Tensor w_up, "
                                "Tensor w_down, Tensor? b_up, Tensor? b_down, str spec, str group_name, "
                                "SymInt[] send_sizes, SymInt[] recv_sizes, str knobs) -> (Tensor, Tensor, Tensor, Tensor[])")
def ep_exchange_backward(grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec, group_name,
                         send_sizes, recv_sizes, knobs):
    """(d_send, d_w_up, d_w_down, [d_b_up, d_b_down for the biases given])."""
    from .ep_overlap import exchange_backward, knobs_from_json

    d_send, d_w_up, d_w_down, d_b_up, d_b_down = exchange_backward(
        grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec, _process_group(group_name),
        send_sizes, recv_sizes, knobs_from_json(knobs))
    return d_send, d_w_up, d_w_down, [g for g in (d_b_up, d_b_down) if g is not None]


@ep_exchange_backward.register_fake
def _ep_exchange_backward_fake(grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec, group_name,
                               send_sizes, recv_sizes, knobs):
    return (torch.empty_like(grad_back), torch.empty_like(w_up), torch.empty_like(w_down),
            [torch.empty_like(b) for b in (b_up, b_down) if b is not None])


def _exchange_setup_context(ctx, inputs, output):
    send, recv_counts, w_up, w_down, b_up, b_down, spec, group_name, send_sizes, recv_sizes, *knobs = inputs
    ctx.save_for_backward(output[1], output[2], recv_counts, output[3], w_up, w_down, b_up, b_down)
    ctx.args = (spec, group_name, send_sizes, recv_sizes, knobs[0] if knobs else "")
    ctx.num_inputs = len(inputs)
    ctx.has_bias = (b_up is not None, b_down is not None)


def _exchange_backward(ctx, grad_back, *_unused):
    x, up, recv_counts, table, w_up, w_down, b_up, b_down = ctx.saved_tensors
    if grad_back is None:
        return (None,) * ctx.num_inputs
    d_send, d_w_up, d_w_down, d_biases = torch.ops.uniep.ep_exchange_backward(
        grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, *ctx.args)
    it = iter(d_biases)
    d_b_up = next(it) if ctx.has_bias[0] else None
    d_b_down = next(it) if ctx.has_bias[1] else None
    return (d_send, None, d_w_up, d_w_down, d_b_up, d_b_down) + (None,) * (ctx.num_inputs - 6)


ep_exchange.register_autograd(_exchange_backward, setup_context=_exchange_setup_context)


# ---- processes on this host ----------------------------------------------------------------------

# NVLink multicast (NVLS) off for NCCL, torch symmetric memory and NVSHMEM: the multi-GPU hosts this project
# runs on need it (set only where the environment does not say otherwise)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    """A free TCP port on this host, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_rank(rank: int, world: int, port: int, device_type: str = "cuda"):
    """Rank ``rank`` of a ``world``-process group on this host (rendezvous at ``port``): NCCL on GPU
    ``rank``, or gloo on CPU; yields the rank's device. On the way out the ranks meet at a barrier before
    the group is destroyed (unless this rank failed), so that no rank tears down its connections while a
    peer still uses them."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type != "cuda":
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        for key, value in MULTICAST_OFF.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        yield device
        dist.barrier()
    finally:
        dist.destroy_process_group()
