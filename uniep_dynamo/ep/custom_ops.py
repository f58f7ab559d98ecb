"""The torch.ops.uniep.ep_* ops that the expert-parallel compile rewrites (patterns/ep.py, lowering/ep.py) lower to.

    ep_dispatch         the send side of an all-to-all dispatch: the routing plan, the rows in send order, the
                        per-expert counts sent and (exchanged or all-gathered) received
    ep_combine          the receive side of the combine: a permutation back to (token, k) and the fixed-order sum
    ep_exchange         the token all-to-all, the local experts and the all-to-all back as one op: the overlapped
                        exchange (exchange.py), or the sequential steps where a rank cannot take it

Each comes with its backward op and its autograd registration. The dispatch hands its row order's inverse to the
combine of the next graph (the inverses below) and, with ``gather_counts``, its count table to the exchange
(plan.stash_count_table), so neither is computed or synchronized again.
"""
from __future__ import annotations

import torch

from ..kernels import reference
from ..spec import CUDAGRAPH_UNSAFE, autocast_off, decode_spec
from .exchange import exchange_backward, exchange_backward_send, exchange_forward, schema_param_grads
from .config import knobs_from_json
from .plan import address_key, fused, plan_and_exchange, plan_and_gather
from .sequential import combine_rows, combine_rows_backward, gather_sum


def _process_group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


_DISPATCH_SCHEMA = ("(Tensor hidden, Tensor topk_ids, int num_experts, int world, str group_name, "
                    "bool gather_counts=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("uniep::ep_dispatch", mutates_args=(), tags=CUDAGRAPH_UNSAFE, schema=_DISPATCH_SCHEMA)
def ep_dispatch(hidden, topk_ids, num_experts, world, group_name, gather_counts=False):
    """The send side of an all-to-all dispatch over the `world` ranks of `group_name`, each owning E / W
    consecutive experts. Returns (rows [S, H], row_order [S], send_counts [W, E/W], recv_counts [W, E/W],
    slot_row [S], expert_offsets [E]): the rows to send, hidden[row_order // K], ordered by (expert, token,
    k); the per-expert counts this rank sends and, exchanged, receives; and the plan backward reads.
    `world` is an argument, not read off the group, so that the graph (and any compiled-graph cache keyed
    on it) holds the shapes it was proven for. ``gather_counts`` (the compile rewrite sets it where the next
    graph's exchange is rewritten too): all-gather every rank's counts instead of exchanging this rank's,
    and hand the table to that exchange (plan_and_gather)."""
    group = _process_group(group_name)
    if group.size() != world:
        raise ValueError(f"uniep.ep_dispatch: compiled for {world} ranks, but process group {group_name!r} has "
                         f"{group.size()}")
    plan = plan_and_gather if gather_counts else plan_and_exchange
    row_order, slot_row, offsets, counts, recv = plan(topk_ids, num_experts, world, group, fused(topk_ids))
    # what eager's scatter_add of the counts would fault on, as a device-side check (no host sync): the plan
    # sorts an id outside [0, E) past every expert's rows, so the experts then hold fewer than all T*K slots
    if topk_ids.numel():
        torch._assert_async(offsets[-1] == topk_ids.numel(),
                            f"uniep.ep_dispatch: an expert id lies outside [0, {num_experts})")
    if fused(hidden):
        from ..kernels.triton_routing import gather_rows
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


@torch.library.custom_op("uniep::ep_dispatch_backward", mutates_args=(), tags=CUDAGRAPH_UNSAFE,
                         schema="(Tensor d_rows, Tensor slot_row, Tensor expert_offsets, SymInt num_tokens, "
                                "int top_k) -> Tensor")
def ep_dispatch_backward(d_rows, slot_row, expert_offsets, num_tokens, top_k):
    return gather_sum(d_rows, slot_row, expert_offsets, num_tokens, top_k, d_rows.dtype, fused(d_rows))


@ep_dispatch_backward.register_fake
def _ep_dispatch_backward_fake(d_rows, slot_row, expert_offsets, num_tokens, top_k):
    return d_rows.new_empty(num_tokens, d_rows.shape[1])


def _dispatch_setup_context(ctx, inputs, output):
    hidden, topk_ids = inputs[0], inputs[1]
    ctx.set_materialize_grads(False)  # no zeros for the plan's outputs
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


def _remember_inverse(row_order, slot_row):
    key = address_key(row_order)
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
    entry = _INVERSES.get(address_key(row_order))
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


@torch.library.custom_op("uniep::ep_combine", mutates_args=(), tags=CUDAGRAPH_UNSAFE,
                         schema="(Tensor rows, Tensor row_order, Tensor weights) -> Tensor")
def ep_combine(rows, row_order, weights):
    """out[t] = sum_k weights[t, k] * rows[r] where row_order[r] = t*K + k, k in order, in fp32, in the
    promotion of the rows' and weights' dtypes: `buf = empty_like(rows); buf[row_order] = rows;
    (buf.view(T, K, H) * weights[..., None]).sum(1)` with one fixed rounding."""
    slot_row, offsets = _unpermute_plan(row_order, weights)
    return combine_rows(rows, weights, slot_row, offsets, torch.promote_types(rows.dtype, weights.dtype),
                        fused(rows))


@ep_combine.register_fake
def _ep_combine_fake(rows, row_order, weights):
    return rows.new_empty(weights.shape[0], rows.shape[1], dtype=torch.promote_types(rows.dtype, weights.dtype))


@torch.library.custom_op("uniep::ep_combine_backward", mutates_args=(), tags=CUDAGRAPH_UNSAFE,
                         schema="(Tensor grad_out, Tensor rows, Tensor row_order, Tensor weights) -> (Tensor, Tensor)")
def ep_combine_backward(grad_out, rows, row_order, weights):
    slot_row, offsets = _unpermute_plan(row_order, weights)
    return combine_rows_backward(grad_out, rows, weights, row_order.long(), slot_row, offsets, fused(rows))


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
                    "str spec, str group_name, SymInt[] send_sizes, SymInt[] recv_sizes, str knobs=\"\", "
                    "bool sequential=False) -> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("uniep::ep_exchange", mutates_args=(), tags=CUDAGRAPH_UNSAFE, schema=_EXCHANGE_SCHEMA)
@autocast_off
def ep_exchange(send, recv_counts, w_up, w_down, b_up, b_down, spec, group_name, send_sizes, recv_sizes, knobs="",
                sequential=False):
    """``back = all_to_all(experts(all_to_all(send)))``: this rank's rows [S, H] (in the order the dispatch sorted
    them) to the local experts' ranks by ``send_sizes``, rows from every rank by ``recv_sizes`` into the experts
    op (local expert ids ``arange(E_local).repeat(W).repeat_interleave(recv_counts)``, weight 1, spec ``spec``),
    and the results back the same way. ``knobs``: OverlapConfig fields as JSON ("" for the defaults). On the
    overlapped path (exchange.exchange_forward) the transfers run beside the grouped GEMMs, chunk by chunk, with
    the same bits; ``sequential`` (the compile's overlap_ep off) runs the all-to-all, the experts op and the
    all-to-all back one after another. Returns (back, then what the backward reads: the received rows, the up
    projection, and on the host the [W, 3W + 2 + E_local] table of send sizes, paths, the size check's claims and
    received counts, so that the backward does not synchronize again)."""
    return exchange_forward(send, recv_counts, w_up, w_down, b_up, b_down, spec, _process_group(group_name),
                            send_sizes, recv_sizes, knobs_from_json(knobs), sequential=sequential)


@ep_exchange.register_fake
def _ep_exchange_fake(send, recv_counts, w_up, w_down, b_up, b_down, spec, group_name, send_sizes, recv_sizes,
                      knobs="", sequential=False):
    s = decode_spec(spec)
    received = sum(recv_sizes)
    up_width = reference.effective_weight(w_up, s.up_layout).shape[2]
    world = recv_counts.shape[0]
    return (send.new_empty(send.shape[0], send.shape[1], dtype=s.out_dtype), send.new_empty(received, send.shape[1]),
            send.new_empty(received, up_width, dtype=w_up.dtype),
            torch.empty(world, 3 * world + 2 + recv_counts.shape[1], dtype=torch.int64, device="cpu"))


_SEND_SCHEMA = ("(Tensor grad_back, Tensor table, str group_name, SymInt[] send_sizes, SymInt[] recv_sizes) "
                "-> Tensor")


@torch.library.custom_op("uniep::ep_exchange_backward_send", mutates_args=(), tags=CUDAGRAPH_UNSAFE,
                         schema=_SEND_SCHEMA)
def ep_exchange_backward_send(grad_back, table, group_name, send_sizes, recv_sizes):
    """The sequential exchange backward's first step: the all-to-all of the gradient rows [S, H] to the experts'
    ranks (exchange.exchange_backward_send keeps the received rows beside ``table``), so that a compiled
    backward frees the gradient rows, this op's input, before ep_exchange_backward allocates the experts' buffers.
    Returns an empty tensor, which ep_exchange_backward takes (``sent=True``) and which orders it after this op."""
    exchange_backward_send(grad_back, table, _process_group(group_name), send_sizes, recv_sizes)
    return grad_back.new_empty(0)


@ep_exchange_backward_send.register_fake
def _ep_exchange_backward_send_fake(grad_back, table, group_name, send_sizes, recv_sizes):
    return grad_back.new_empty(0)


@torch.library.custom_op("uniep::ep_exchange_backward", mutates_args=(), tags=CUDAGRAPH_UNSAFE,
                         schema="(Tensor grad_back, Tensor x, Tensor up, Tensor recv_counts, Tensor table, Tensor w_up, "
                                "Tensor w_down, Tensor? b_up, Tensor? b_down, str spec, str group_name, "
                                "SymInt[] send_sizes, SymInt[] recv_sizes, str knobs, bool sent=False, "
                                "bool param_grads=True) -> (Tensor, Tensor, Tensor, Tensor[])")
@autocast_off
def ep_exchange_backward(grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec, group_name,
                         send_sizes, recv_sizes, knobs, sent=False, param_grads=True):
    """(d_send, d_w_up, d_w_down, [d_b_up, d_b_down for the biases given]). ``sent``: ``grad_back`` is
    ep_exchange_backward_send's output (unread), and the rows it received are taken from beside ``table``.
    ``param_grads=False`` (frozen experts): empty tensors for the expert parameters' gradients, which neither path
    computes."""
    d_send, d_w_up, d_w_down, d_b_up, d_b_down = exchange_backward(
        grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec, _process_group(group_name),
        send_sizes, recv_sizes, knobs_from_json(knobs), sent=sent, param_grads=param_grads)
    return (d_send,) + schema_param_grads(d_w_up, d_w_down, d_b_up, d_b_down, b_up, b_down, x)


@ep_exchange_backward.register_fake
def _ep_exchange_backward_fake(grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec, group_name,
                               send_sizes, recv_sizes, knobs, sent=False, param_grads=True):
    def like(t):
        return torch.empty_like(t) if param_grads else x.new_empty(0)

    d_send = x.new_empty(sum(send_sizes), x.shape[1]) if sent else torch.empty_like(grad_back)
    return d_send, like(w_up), like(w_down), [like(b) for b in (b_up, b_down) if b is not None]


def _exchange_setup_context(ctx, inputs, output):
    send, recv_counts, w_up, w_down, b_up, b_down, spec, group_name, send_sizes, recv_sizes, *rest = inputs
    ctx.set_materialize_grads(False)  # no zeros for the outputs after the first (the received rows and h among them)
    ctx.save_for_backward(output[1], output[2], recv_counts, output[3], w_up, w_down, b_up, b_down)
    # the backward takes the path the forward's host table records, so ``sequential`` is not handed on; where the
    # forward was told to take the sequential steps the backward sends the gradient rows in an op of their own
    ctx.args = (spec, group_name, send_sizes, recv_sizes, rest[0] if rest else "")
    ctx.sequential = bool(rest[1]) if len(rest) > 1 else False
    ctx.num_inputs = len(inputs)
    ctx.has_bias = (b_up is not None, b_down is not None)


def _exchange_backward(ctx, grad_back, *_unused):
    x, up, recv_counts, table, w_up, w_down, b_up, b_down = ctx.saved_tensors
    if grad_back is None:
        return (None,) * ctx.num_inputs
    if ctx.sequential:  # the all-to-all first, in an op of its own: a compiled backward frees the rows after it
        _, group_name, send_sizes, recv_sizes, _ = ctx.args
        grad_back = torch.ops.uniep.ep_exchange_backward_send(grad_back, table, group_name, send_sizes, recv_sizes)
    param_grads = any(ctx.needs_input_grad[2:6])  # False for frozen experts: no weight-gradient GEMM
    d_send, d_w_up, d_w_down, d_biases = torch.ops.uniep.ep_exchange_backward(
        grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, *ctx.args, ctx.sequential, param_grads)
    it = iter(d_biases)
    d_b_up = next(it) if ctx.has_bias[0] else None
    d_b_down = next(it) if ctx.has_bias[1] else None
    if not param_grads:
        d_w_up = d_w_down = d_b_up = d_b_down = None
    return (d_send, None, d_w_up, d_w_down, d_b_up, d_b_down) + (None,) * (ctx.num_inputs - 6)


ep_exchange.register_autograd(_exchange_backward, setup_context=_exchange_setup_context)
