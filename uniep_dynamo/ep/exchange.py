"""The compiled exchange: the token all-to-all, the local experts and the all-to-all back, as one overlapped call.

What the compile rewrite of a plain EP layer's second graph runs (custom_ops.py's uniep::ep_exchange, patterns/ep.py's
exchange match): the rows arrive in the sender's order (the dispatch graph sorted them), with the split sizes the
host read and the per-(source, local expert) counts of the count exchange. The same windows, chunks and transfers as
the overlapped layer (overlap.py); only the layout comes from those sizes (layout.exchange_layout) instead of an
all-gathered routing table. Every rank all-gathers its claims (or takes the dispatch's count table), checks every
rank's sizes, and runs the overlapped path only where every rank can; else the sequential steps the rewrite replaced.
"""
from __future__ import annotations

import array

import torch
import torch.distributed as dist

from ..spec import SECOND_BACKWARD_ERROR, decode_spec
from .chunks import Chunks, new_grads, zero_grads
from .config import OverlapConfig, cached_knobs
from .layout import exchange_layout
from .pipeline import backward_phase, forward_phase, receive_buffer
from .plan import COUNT_TABLE_PATHS, all_to_all, take_count_table


def _exchange_unsupported(send, recv_counts, w_up, w_down, b_up, b_down, spec) -> str | None:
    """None if this rank can run the overlapped exchange, else why the sequential steps run."""
    from ..kernels import megakernel

    reason = megakernel.unsupported_reason(send, recv_counts, w_up, w_down, b_up, b_down, [], spec)
    if reason is None and spec.out_dtype != send.dtype:
        reason = f"the experts' output is {spec.out_dtype} and their input {send.dtype}"
    if reason is None and recv_counts.dtype != torch.int64:
        reason = f"the received counts are {recv_counts.dtype}"
    return reason


def _table_from_counts(table, rank: int, local_experts: int, ok: bool, send_sizes, recv_sizes,
                       sent: int) -> torch.Tensor:
    """The exchange's host table (_exchange_host's layout) from the dispatch's count table: every rank's send
    sizes (per owner, the sums of its counts), ``ok`` for every rank (the path decision reads only dtypes, the
    spec and the expert count, which SPMD ranks share), the claims the sizes imply, and this rank's received
    counts. This rank's own split sizes must be the table's: they came from the same dispatch (``sent``: the rows
    it sends, which _check_exchange holds against them)."""
    world = len(table)
    sizes = [[sum(row[r * local_experts:(r + 1) * local_experts]) for r in range(world)] for row in table]
    if sizes[rank] != list(send_sizes) or [sizes[s][rank] for s in range(world)] != list(recv_sizes):
        raise ValueError(f"uniep.ep_exchange: split sizes {list(send_sizes)} / {list(recv_sizes)} on rank {rank} "
                         f"disagree with the dispatch's count table (send sizes per rank {sizes})")
    mine = slice(rank * local_experts, (rank + 1) * local_experts)
    host = array.array("q", [v for s in range(world) for v in (
        sizes[s] + [int(ok)] + [sizes[q][s] for q in range(world)] + [sent if s == rank else sum(sizes[s])]
        + [sizes[q][s] for q in range(world)] + table[s][mine])])
    # through an int64 buffer: 6 µs a call at one rank (E = 128), where torch.tensor of the nested lists took 12
    return torch.frombuffer(host, dtype=torch.int64).view(world, -1).clone()


def _exchange_claims(send, recv_counts, send_sizes, recv_sizes, ok: bool) -> torch.Tensor:
    """What a rank all-gathers, [3W + 2] on the device: its send sizes, whether it takes the overlapped path, and
    for the ranks' common size check its receive sizes, its rows, and the per-source sums of its received
    counts."""
    host = torch.tensor(list(send_sizes) + [int(ok)] + list(recv_sizes) + [send.shape[0]], dtype=torch.int64,
                        pin_memory=send.is_cuda)  # pinned: the copy does not wait for the stream's earlier work
    return torch.cat([host.to(send.device, non_blocking=True), recv_counts.sum(1).to(torch.int64)])


def _exchange_host(table: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """The all-gathered [W, 3W + 2] claims beside this rank's received counts, [W, 3W + 2 + E_local], on the
    host: one device-to-host copy, the exchange's one synchronization. The backward reads it again from the
    host, without another."""
    return torch.cat([table, recv_counts.to(table.dtype)], dim=1).cpu()


def _split_host(host: torch.Tensor):
    """(rows [s] = send sizes of rank s to each rank, then its flag; counts [s] = rows from s per local expert;
    claims [s] = rank s's receive sizes, its rows, and the sums of its received counts per source)."""
    world = host.shape[0]
    flat = host.tolist()
    return ([row[:world + 1] for row in flat], [row[3 * world + 2:] for row in flat],
            [row[world + 1:3 * world + 2] for row in flat])


def _sequential_path(rows) -> bool:
    """Whether the exchange takes the sequential steps (some rank cannot overlap), from _split_host's rows."""
    return not all(row[len(rows)] for row in rows)


def _check_exchange(rows, claims):
    """Every rank checks every rank's split sizes on the same all-gathered table, so that all of them raise the
    same error together (one rank raising alone would leave the others waiting in a collective)."""
    world = len(rows)
    problems = []
    for r in range(world):
        recv_sizes, sent, sums = claims[r][:world], claims[r][world], claims[r][world + 1:]
        if sum(rows[r][:world]) != sent:
            problems.append(f"rank {r}: send sizes {rows[r][:world]} for {sent} rows")
        got = [rows[s][r] for s in range(world)]
        if got != recv_sizes:
            problems.append(f"rank {r}: receive sizes {recv_sizes}, but the sources send {got}")
        if sums != recv_sizes:
            problems.append(f"rank {r}: received per-expert counts that sum to {sums} per source, receive sizes "
                            f"{recv_sizes}")
    if problems:
        raise ValueError("uniep.ep_exchange: inconsistent split sizes: " + "; ".join(problems))


def _all_to_all(t, out_splits, in_splits, group):
    out = t.new_empty(sum(out_splits), *t.shape[1:])
    all_to_all(out, t.contiguous(), out_splits, in_splits, group)
    return out


def _local_ids(recv_counts, rows: int):
    world, local_experts = recv_counts.shape
    ids = torch.arange(local_experts, device=recv_counts.device).repeat(world)
    return ids.repeat_interleave(recv_counts.reshape(-1), output_size=rows).unsqueeze(-1)


class KeptByTable:
    """Values kept beside a call's host table (an output the call's backward is handed back): found by that table
    object, dropped when it dies (a forward without a backward: inference, or a graph that never runs backward)."""

    def __init__(self):
        self._entries: dict = {}

    def keep(self, table, value) -> None:
        import weakref

        key = id(table)

        def forget(ref, key=key):
            if self._entries.get(key, (None,))[0] is ref:
                self._entries.pop(key, None)
        self._entries[key] = (weakref.ref(table, forget), value)

    def get(self, table, release: bool = False):
        """The value kept beside this table object, or None. ``release``: and forget it, so that the caller's
        references are the last (a backward that frees each buffer after its last read)."""
        entry = self._entries.get(id(table))
        if entry is None or entry[0]() is not table:
            return None
        if release:
            del self._entries[id(table)]
        return entry[1]


# The sequential path's experts-op results that its backward reads (up, then ids, weights, row_order, slot_row,
# expert_offsets, down), beside the call's host table; the up projection travels in the call's ``up`` output too. So
# the backward does not run the experts' forward again.
_SEQUENTIAL = KeptByTable()


def _saved_sequential(table, up, release: bool = False):
    """What _SEQUENTIAL keeps for this table, with the up projection it travelled beside, or None (none kept,
    or an ``up`` that is not the forward's: the backward then runs the experts' forward again). The ``up`` handed to
    the backward may be another tensor object over the same storage (autograd's saved outputs, outside inductor).
    ``release``: forget the entry (KeptByTable.get)."""
    entry = _SEQUENTIAL.get(table, release)
    if entry is None:
        return None
    kept, *saved = entry
    if kept.data_ptr() != up.data_ptr() or kept.shape != up.shape or kept.stride() != up.stride() \
            or kept.dtype != up.dtype:
        return None
    return saved


def _sequential_experts(x, recv_counts, w_up, w_down, b_up, b_down, spec: str):
    """(ids, weights, the experts op's outputs) over the received rows, as the replaced graph ran it. Where Triton's
    kernels run (CUDA, or the interpreter under UNIEP_KERNELS=triton) the ids, the weights and the rows' routing plan
    come from one launch (triton_routing.received_plan), and the op is handed the plan; elsewhere from torch ops, and
    the op sorts the rows itself. The same integers either way, so the same bits."""
    from ..kernels import megakernel

    if megakernel.triton_runs(x):
        from ..kernels.triton_routing import received_plan

        ids, ones, plan = received_plan(recv_counts, x.shape[0], x.dtype)
        out = torch.ops.uniep.moe_experts(x, ids, ones, w_up, w_down, b_up, b_down, [], spec, *plan)
        return ids, ones, (out[0], *plan, *out[4:])  # the op returns empty tensors in the given plan's place
    ids = _local_ids(recv_counts, x.shape[0])
    ones = torch.ones_like(ids, dtype=x.dtype)
    return ids, ones, torch.ops.uniep.moe_experts(x, ids, ones, w_up, w_down, b_up, b_down, [], spec)


def _owned(value):
    """The tensor a caller hands over as a one-element list holding its only reference (the list emptied, so that
    freeing the local name frees the tensor), or the tensor given as such."""
    return value.pop() if isinstance(value, list) else value


def exchange_forward(send, recv_counts, w_up, w_down, b_up, b_down, spec: str, group, send_sizes, recv_sizes,
                     knobs: OverlapConfig | None = None, sequential: bool = False, count_table=None):
    """back rows [S, H] (the experts' rows returned to this rank, in its send order), and for the backward: the
    received rows and the up projection (the overlapped path's, in its layout), and on the host the
    [W, 3W + 2 + E_local] table of every rank's send sizes, whether it takes the overlapped path, what its size
    check reads (_exchange_claims), and the rows this rank receives from it per local expert.

    Every rank all-gathers its send sizes with that flag; the overlapped path runs only where every rank takes
    it (the ranks meet in its barriers), else the sequential steps the rewrite replaced: the all-to-all, the
    experts op on the received rows (local expert ids from the counts, weight 1), the all-to-all back.
    ``sequential``: those steps in any case (the compile's ``overlap_ep=False``); every rank is given the same.
    ``count_table``: every rank's per-expert counts ([W][E] on the host) where the caller has them (ep_layer); else
    the dispatch's (take_count_table), or the claims are all-gathered here. ``send`` may be a one-element list holding
    the caller's only reference (ep_layer): the sequential path then frees the rows once sent. It frees the experts'
    output rows once sent back, and their pre-combine rows at once where the backward does not read them."""
    from ..kernels import megakernel
    from ..kernels import reference

    send = _owned(send)
    s = decode_spec(spec)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local_experts, size, device = w_up.shape[0], send.shape[1], send.device
    received = sum(recv_sizes)
    up_width = reference.effective_weight(w_up, s.up_layout).shape[2]
    reason = "overlap_ep is off" if sequential else _exchange_unsupported(send, recv_counts, w_up, w_down, b_up,
                                                                          b_down, s)
    gathered = count_table if count_table is not None else take_count_table(recv_counts)
    if gathered is not None:  # the dispatch's table: no collective, no synchronization here
        COUNT_TABLE_PATHS["dispatch"] += 1
        table = _table_from_counts(gathered, rank, local_experts, reason is None, send_sizes, recv_sizes,
                                   send.shape[0])
    else:
        COUNT_TABLE_PATHS["gathered"] += 1
        mine = _exchange_claims(send, recv_counts, send_sizes, recv_sizes, reason is None)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        table = _exchange_host(torch.stack(parts), recv_counts)
    rows, counts, claims = _split_host(table)
    _check_exchange(rows, claims)
    if _sequential_path(rows):
        why = reason or "another rank cannot take it"
        if send.is_cuda and not sequential:
            megakernel.warn_once("ep_exchange", why, "uniep: the overlapped EP exchange runs the sequential steps "
                                 "instead: %s")
        x = _all_to_all(send, recv_sizes, send_sizes, group)
        del send
        ids, ones, (y, row_order, slot_row, offsets, up_rows, down_rows) = _sequential_experts(
            x, recv_counts, w_up, w_down, b_up, b_down, spec)
        # down is read by the backward only on the reference path (the fused one takes weights_grad=False, so no
        # routing-weight gradient, and no in-place scratch): kept only there
        if megakernel.use_megakernel(x, ids, w_up, w_down, b_up, b_down, [], s):
            down_rows = None
        back = _all_to_all(y, send_sizes, recv_sizes, group)
        del y
        if tuple(up_rows.shape) != (received, up_width) or up_rows.dtype != w_up.dtype:
            # an up projection of another shape or dtype than the op's output (a bias of another dtype promotes
            # it): an empty buffer in its place, and the backward runs the experts' forward again
            return back, x, x.new_empty(received, up_width, dtype=w_up.dtype), table
        _SEQUENTIAL.keep(table, (up_rows, ids, ones, row_order, slot_row, offsets, down_rows))
        return back, x, up_rows, table
    knobs = knobs or cached_knobs(send, send.shape[0], w_up, w_down, s, group)
    layout = exchange_layout(rows, counts, rank, local_experts, knobs, size)
    offsets, transfers = layout.to_device(device)
    x = receive_buffer("x", layout.rows, size, send.dtype, device, knobs)

    def setup():  # the GEMMs' set-up, which the first pulls do not wait for (forward_phase)
        chunks = Chunks(layout, offsets, w_up, w_down, b_up, b_down, s, send,
                        config_shape=(layout.rows, local_experts))
        return chunks, torch.empty(layout.rows, up_width, dtype=w_up.dtype, device=device)
    if layout.capacity == 0:  # no rank sends a row
        return send.new_empty(0, size), x, setup()[1], table

    def fill(win):
        win.send(rank)[:send.shape[0]].copy_(send)
        return True
    win_y, _, up = forward_phase(layout, transfers, group, knobs, x, w_down.dtype, fill, setup)
    return win_y.back(rank)[:send.shape[0]].clone(), x, up, table


# The gradient rows between the exchange backward's two steps (exchange_backward_send, then exchange_backward with
# sent=True), beside the call's host table: the rows received from every rank on the sequential path, a copy of the
# rows as given where the overlapped path ran (its pipeline pulls them out of the window).
_SENT = KeptByTable()


def exchange_backward_send(grad_back, table, group, send_sizes, recv_sizes) -> None:
    """The sequential exchange backward's first step, an op of its own (custom_ops.ep_exchange_backward_send) so that
    a compiled backward frees the gradient rows, this step's input, before the experts' backward allocates its
    buffers: their all-to-all to the experts' ranks. The rows received are kept beside the table for
    exchange_backward(..., sent=True), which takes them. Meant for the compile's sequential exchange (overlap_ep
    off); where the table says the overlapped path ran, the rows are kept as a copy (the caller's buffer may be
    reused once this returns), which that path pulls out of its window."""
    if _sequential_path(_split_host(table)[0]):
        _SENT.keep(table, _all_to_all(grad_back, recv_sizes, send_sizes, group))
    else:
        _SENT.keep(table, grad_back.clone(memory_format=torch.contiguous_format))


def schema_param_grads(d_w_up, d_w_down, d_b_up, d_b_down, b_up, b_down, like: torch.Tensor):
    """exchange_backward's expert-parameter gradients as an op's schema returns them: (d_w_up, d_w_down, [the biases'
    for the biases given]), an empty tensor like ``like`` where one was not computed (param_grads=False): a schema
    returns no None."""
    def given(g):
        return g if g is not None else like.new_empty(0)
    return given(d_w_up), given(d_w_down), [given(g) for g, b in ((d_b_up, b_up), (d_b_down, b_down)) if b is not None]


def exchange_backward(grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec: str, group, send_sizes,
                      recv_sizes, knobs: OverlapConfig | None = None, sent: bool = False, param_grads: bool = True):
    """(d_send, d_w_up, d_w_down, d_b_up, d_b_down) of exchange_forward, on the path the forward took (the
    table says). The sequential path reads the experts op's saved results its forward kept (_SEQUENTIAL), or,
    where none were kept, runs that op's forward again on the saved received rows. ``grad_back`` may be a
    one-element list holding the caller's only reference (ep_layer's backward): it is emptied, so that the sequential
    path frees those rows once sent; so may ``x`` and ``up``, which that path then frees once the experts' backward
    has read them. ``sent``: exchange_backward_send ran first for this table (``grad_back`` is then not read): the
    rows it left are taken. Under ``spec.reuse_saved`` (the compile's reuse_saved_buffers, which refuses a second
    backward) the forward's kept experts-op results are forgotten as they are taken. ``param_grads=False`` (frozen
    experts): neither path runs a weight-gradient GEMM, and None comes back for those gradients."""
    if sent:
        grad_back = _SENT.get(table, release=True)
        if grad_back is None:
            raise RuntimeError("uniep.ep_exchange_backward: the gradient rows' first step "
                               "(uniep.ep_exchange_backward_send) did not run for this call's table")
    else:
        grad_back = _owned(grad_back)
    x, up = _owned(x), _owned(up)
    s = decode_spec(spec)
    rank = dist.get_rank(group)
    local_experts, size, device = w_up.shape[0], grad_back.shape[1], grad_back.device
    grad_back = grad_back.contiguous()
    rows, counts, _ = _split_host(table)
    if _sequential_path(rows):
        d_rows = grad_back if sent else _all_to_all(grad_back, recv_sizes, send_sizes, group)
        del grad_back
        saved = _saved_sequential(table, up, release=s.reuse_saved)
        if saved is not None and saved[-1] is None and s.reuse_saved and x.dtype == w_up.dtype:
            # the forward's experts-op results on the fused path (no down kept), with the compile's
            # reuse_saved_buffers: the MegaKernel's in-place backward, as the experts op's in-place op runs it, called
            # here directly so that it can be handed the received gradient rows' only reference and free them once
            # gathered (an op's arguments live until it returns). The saved up projection becomes its gradient, a
            # new [rows, H] buffer takes the gathered gradient rows and then the input-gradient rows, and no
            # [rows, 2I] buffer is allocated (the same bits). Each [rows, H] buffer is dropped once read for the last
            # time, as a compiled backward frees it
            from ..kernels import megakernel

            ids, ones, row_order, slot_row, offsets, _ = saved
            rows_buf = d_rows.new_empty(x.shape[0], size, dtype=w_up.dtype)
            held = [d_rows]
            del d_rows
            with megakernel.overwriting_saved_buffers(up, rows_buf, SECOND_BACKWARD_ERROR):
                _, _, *grads, _ = megakernel.experts_backward(
                    held, x, ids, ones, w_up, w_down, b_up, b_down, row_order, slot_row, offsets, up, rows_buf, s,
                    reuse_saved=True, weights_grad=False, input_rows=rows_buf, param_grads=param_grads)
            d_w_up, d_w_down, d_b_up, d_b_down = (g.contiguous() if g is not None else None for g in grads)
            del up, grads
            d_x = megakernel.combine_input_rows(rows_buf, slot_row, offsets, x.shape[0], 1, x.dtype)
            del rows_buf, x
        else:
            if saved is not None:  # the forward's experts-op results
                ids, ones, row_order, slot_row, offsets, down_rows = saved
                up_rows = up
                if down_rows is None:  # the fused backward reads no down (weights_grad=False, not in place)
                    down_rows = d_rows.new_empty(0, size)
            else:  # the experts op's forward again on the saved received rows, for the saved tensors its backward reads
                ids, ones, (_, row_order, slot_row, offsets, up_rows, down_rows) = _sequential_experts(
                    x, recv_counts, w_up, w_down, b_up, b_down, spec)
            d_x, _, d_w_up, d_w_down, d_b_up, d_b_down, _ = torch.ops.uniep.moe_experts_backward(
                d_rows, x, ids, ones, w_up, w_down, b_up, b_down, [], row_order, slot_row, offsets, up_rows,
                down_rows, spec, False, param_grads)
            if not param_grads:
                d_w_up = d_w_down = d_b_up = d_b_down = None
            del d_rows, down_rows, up_rows, up, x
        return (_all_to_all(d_x, send_sizes, recv_sizes, group), d_w_up, d_w_down,
                d_b_up if b_up is not None and param_grads else None,
                d_b_down if b_down is not None and param_grads else None)
    knobs = knobs or cached_knobs(grad_back, grad_back.shape[0], w_up, w_down, s, group)
    layout = exchange_layout(rows, counts, rank, local_experts, knobs, size)
    offsets, transfers = layout.to_device(device)
    chunks = Chunks(layout, offsets, w_up, w_down, b_up, b_down, s, grad_back,
                    config_shape=(layout.rows, local_experts))
    if layout.capacity == 0:
        return (grad_back.new_zeros(0, size), *zero_grads(new_grads(w_up, w_down, b_up, b_down)))
    sent_rows, dtype, held = grad_back.shape[0], grad_back.dtype, [grad_back]
    del grad_back  # the fill below drops the last reference once the rows are in the window

    def fill(win):
        win.send(rank)[:sent_rows].copy_(held.pop())
    win_dx, grads, _ = backward_phase(layout, transfers, chunks, group, knobs, x, up, dtype, fill,
                                      param_grads=param_grads)
    return (win_dx.back(rank)[:sent_rows].clone(), *grads)
