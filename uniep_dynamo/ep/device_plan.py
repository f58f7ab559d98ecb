"""The EP layer with its plan on the device: no host synchronization in the forward or the backward of a call (the
host waits for an event of a call only when it runs more than two calls ahead of the GPU: ``_compact_earlier``).

ep_layer's other paths read every rank's per-expert counts on the host (plan.count_table: the layer's one
synchronization). The host waits there for the GPU to finish all the work before it, so each MoE layer drains the
GPU's queue, and the host's time from the read to the next launch (split sizes, layout, launches) is GPU idle time
that varies with the host: the step time's spread (BENCHMARKS.md, sixth session). On this path the counts never go
to the host, so the host runs ahead of the GPU as it does in a dense model:

    plan        the routing plan (on the device); every rank's per-expert counts all-gathered on the device (one
                collective). The host learns only every rank's token count, from an all-gather over a CPU (gloo)
                group, which waits for the other ranks' hosts and for no GPU
    send        this rank's rows, gathered in plan order straight into its ``send`` window (symmetric memory)
    pull        after a barrier (a kernel on the stream), the transfer kernel pulls every (local expert, source)
                segment into a receive buffer sized for the most rows this rank could receive (every rank's T*K),
                in the overlapped layer's receive order (expert-major, then source, token, k). Its table comes from
                the device count table (kernels.layout_tables): the host never sees a split size
    experts     the experts op over the receive buffer with the identity plan and the device's expert ends: rows
                past the last end are dropped, never computed
    push        the result rows pushed into their sources' ``back`` windows at their plan-order places, a barrier
    combine     the single-GPU op's fixed-order combine

The backward runs the same steps reversed: the gradient rows into ``send``, pulled, the experts' backward, pushed
back, gather_sum. Where the forward was asked for its pipeline, the experts' backward computes the input gradient
before the weight gradients, and its rows are pushed on the push stream beside the weight gradients' GEMMs
(device_pipeline.beside_reason); where the forward's pipeline ran, the pulls go by its chunks, each chunk's
activation-gradient GEMM beside the next chunk's pull. Each expert's GEMMs see the same rows in the same order as on
the sequential path (which sorts its source-major received rows by expert, stably), so the bits are the same for one
tile configuration. One knob cannot run here: per_expert_mm (a cuBLAS matmul per expert) needs each expert's rows on
the host, so its GEMMs take the other knobs' path (megakernel.device_counts_only), as in a CUDA graph capture; the
heuristics pick it for few experts with many rows (config.py), which the worst-case buffer's row count reaches sooner
than the received rows.

The cost: the receive buffer and the experts' buffers are sized for the worst case (W * T * K rows at equal T), so
memory grows with the EP size; the rows past the received ones cost no GEMM work. What the backward reads is not left
at that size for long: the received row count goes to the host with no wait (a copy into pinned memory, an event),
and a later call's forward reads it and keeps only the received rows of the earlier call's buffers
(``_compact_earlier``: one copy of them, the same bits). In a model of L MoE layers the buffers held for the
backward are then the received rows of the earlier layers and the last layer's worst case, not L worst cases (while
the GPU runs behind the host, up to two layers more stay at the worst case until their counts have reached the
host; beyond that the host waits for the oldest). A call's backward reads its buffers through views of the received
rows where its count has reached the host by then (``_received_view``), so the buffers the backward makes are sized
by the received rows even for the last layer.
Where it cannot run (unsupported_reason) ep_layer takes the synchronized path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
import torch.distributed as dist

from . import device_pipeline
from .device_pipeline import transfer_rows
from .plan import all_gather_flat, device_count_table, routing_plan
from .sequential import combine_rows_backward, gather_sum
from .transfer import window

# process group name -> (that group, a group over the same ranks that takes CPU tensors); the group is compared too: a
# name comes back with the next process group once one is destroyed
_HOST_GROUPS: dict = {}


def _cpu_capable(group) -> bool:
    try:
        group._get_backend(torch.device("cpu"))
        return True
    except Exception:  # noqa: BLE001  (no CPU backend on this group: RuntimeError in torch 2.11-2.13)
        return False


def host_group(group):
    """A process group over ``group``'s ranks that takes CPU tensors: the group itself where it has a CPU backend,
    else a gloo twin, made once, at the members' first call of the layer (in the same order on each). The twin of an
    EP group smaller than the default group is made by its members alone (``use_local_synchronization``: a name
    hashed from the ranks, the default group's count of groups unchanged); the twin of the whole world by every
    rank."""
    name = group.group_name
    entry = _HOST_GROUPS.get(name)
    if entry is None or entry[0] is not group:
        host = group if _cpu_capable(group) else None
        if host is None:
            ranks = dist.get_process_group_ranks(group)
            for known, twin in _HOST_GROUPS.values():  # a twin over the same ranks, still alive
                if twin is not known and twin in dist.distributed_c10d._world.pg_names and \
                        sorted(dist.get_process_group_ranks(twin)) == sorted(ranks):
                    host = twin
                    break
            if host is None:  # the whole world: every rank makes it (as ran on GPUs); else its members alone
                host = dist.new_group(ranks=ranks, backend="gloo",
                                      use_local_synchronization=len(ranks) < dist.get_world_size())
        entry = _HOST_GROUPS[name] = (group, host)
    return entry[1]


def unsupported_reason(hidden, group) -> str | None:
    """None where the device-plan path runs, else why ep_layer takes the synchronized one."""
    from ..kernels import megakernel
    from ..kernels.config import interpreting

    if not megakernel.triton_available():  # checked before the transfer kernel's module imports it
        return "Triton is not installed (the transfer kernel is a Triton kernel)"
    if not (hidden.is_cuda or interpreting()):
        return "the transfer kernel runs on CUDA or in Triton's interpreter only"
    from ..kernels.triton_transfer import MAX_PEERS

    if group.size() > MAX_PEERS:
        return f"{group.size()} ranks; the transfer kernel takes at most {MAX_PEERS}"
    return None


def host_tokens(num_tokens: int, group) -> list:
    """Every rank's token count on the host, all-gathered over the host group (no GPU involved)."""
    hosts = host_group(group)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64)
    all_gather_flat(out, torch.tensor([num_tokens], dtype=torch.int64), hosts)
    return out.tolist()


def _buffer(rows: int, like: torch.Tensor, fused_kernels: bool) -> torch.Tensor:
    """A [rows, H] receive buffer. The rows past the received ones are never written: the MegaKernel (CUDA) reads
    none of them (its GEMMs and gathers stop at the expert ends on the device); elsewhere the buffer is zeroed
    first, so that no path reads uninitialized memory."""
    make = torch.empty if fused_kernels and like.is_cuda else torch.zeros
    return make(rows, like.shape[1], dtype=like.dtype, device=like.device)


@dataclasses.dataclass
class Saved:
    """What the device-plan forward keeps for its backward (beside the call's host table, layer._SAVED)."""
    y_rows: torch.Tensor | None  # the rows sent back, in plan order (the routing weights' gradient reads them)
    x: torch.Tensor | None  # the receive buffer [capacity, H]
    up: torch.Tensor | None  # the experts op's up projection of it
    down: torch.Tensor | None  # its down rows where the backward reads them (the reference path), else None
    ids: torch.Tensor
    ones: torch.Tensor
    plan: tuple  # the receive buffer's identity plan (row_order, slot_row, the local experts' ends)
    table: torch.Tensor  # the transfer table (device)
    send_rows: int  # capacity of the windows' rows (the most slots of any rank)
    fused_kernels: bool
    count: tuple | None = None  # (event or None, host tensor) of _received_rows_later: the received rows' count
    config: object = None  # the forward's MegaKernelConfig (the fused kernels' path): the backward's too
    pipelined: bool = False  # asked for the pipeline: the backward pushes d_x beside the weight gradients' GEMMs
    chunked: tuple | None = None  # the forward's pipeline ran: (its table, its chunks), the backward's pulls by them


# forward calls of this path in this process (the tests read it: which path ep_layer took)
RUNS = {"forward": 0}

# weak references to earlier calls' Saved, whose buffers _compact_earlier shrinks at the next forward
_EARLIER: list = []


def _received_rows_later(ends: torch.Tensor):
    """(event or None, host tensor) that will hold the rows this rank receives (the last local expert's end), copied
    with no wait: the copy into pinned memory is queued, and the event tells when it has landed."""
    if not ends.is_cuda:
        return None, ends[-1:].clone()
    host = torch.empty(1, dtype=ends.dtype, pin_memory=True)
    host.copy_(ends[-1:], non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return event, host


def _first_rows(saved: Saved, received: int):
    """(x, up, down, ids, ones, plan) of the first ``received`` rows (at least one) of the buffers a call saved for
    its backward, as views, or None where that cuts nothing or they are not row for row with the receive buffer. The
    rows past them were never received, and the backward drops them (their expert id is past the local experts), so
    the bits do not change."""
    keep, rows = max(received, 1), saved.x.shape[0]
    if keep >= rows or any(t is not None and t.shape[0] != rows for t in (saved.up, saved.down)):
        return None
    index = saved.plan[0][:keep]
    return (*(t[:keep] if t is not None else None for t in (saved.x, saved.up, saved.down, saved.ids, saved.ones)),
            (index, index, saved.plan[2]))


def _compact(saved: Saved, received: int) -> None:
    """Keep only the first ``received`` rows (at least one) of the buffers a call saved for its backward (_first_rows),
    as copies, so that the worst-case buffers are freed."""
    cut = _first_rows(saved, received) if saved.x is not None else None
    if cut is None:
        return
    from ..kernels import megakernel

    *buffers, plan = cut
    up = saved.up
    saved.x, saved.up, saved.down, saved.ids, saved.ones = (t.clone() if t is not None else None for t in buffers)
    if up is not None:  # the copy's layout is the forward's (config.gated_epilogue)
        megakernel.copy_h_layout(up, saved.up)
    index = plan[0].clone()
    saved.plan = (index, index, plan[2])


def _received_now(saved: Saved) -> int | None:
    """The rows the call received where that count has reached the host (its event has passed: no wait), else
    None."""
    if saved.count is None:
        return None
    event, host = saved.count
    return int(host[0]) if event is None or event.query() else None


def _received_view(saved: Saved):
    """(x, up, down, ids, ones, plan) of a call for its backward: its saved buffers' first received rows as views
    (_first_rows) where the count has reached the host, else the buffers as saved. A call that no later forward
    shrank (the model's last MoE layer, or one the host ran ahead of) is held at the worst case until its backward;
    sized by the views, the backward's own buffers (the gradient rows received, the experts' backward) are not."""
    keep = _received_now(saved)
    cut = _first_rows(saved, keep) if keep is not None else None
    return cut if cut is not None else (saved.x, saved.up, saved.down, saved.ids, saved.ones, saved.plan)


# earlier calls whose buffers may stay at the worst-case size while the GPU has not yet copied their row count: the
# host runs up to this many MoE layers ahead of the GPU before it waits
AHEAD = 2


def _compact_earlier() -> None:
    """Shrink the saved buffers of the earlier calls to their received rows (_compact): those whose row count has
    reached the host, and, past the AHEAD newest, the oldest ones after waiting for theirs (an event the GPU reaches
    at that call's tables, before the work queued since). A call whose backward already ran, or whose graph is gone,
    is skipped."""
    pending = []
    for ref in _EARLIER:
        saved = ref()
        if saved is None or saved.x is None:
            continue
        received = _received_now(saved)
        if received is not None:
            _compact(saved, received)
        else:
            pending.append(ref)
    while len(pending) > AHEAD:
        saved = pending.pop(0)()
        if saved is not None and saved.x is not None:
            saved.count[0].synchronize()
            _compact(saved, int(saved.count[1][0]))
    _EARLIER[:] = pending


def _identity_plan(ends: torch.Tensor, rows: int, dtype):
    """(ids [rows, 1], ones [rows, 1], (row_order, slot_row, ends)) of a receive buffer whose rows are in expert order
    already: local expert e's rows end at ends[e]; rows past the last end get the id E_local (dropped)."""
    index = torch.arange(rows, device=ends.device)
    ids = torch.searchsorted(ends, index, right=True).unsqueeze(1)
    ones = torch.ones(rows, 1, dtype=dtype, device=ends.device)
    return ids, ones, (index, index, ends)


def forward(hidden, topk_ids, w_up, w_down, b_up, b_down, spec: str, group, knobs, fused_kernels: bool, tokens: list,
            pipelined: bool = False):
    """(rows sent back [T*K, H] in plan order, row_order, slot_row, offsets, every rank's counts [W, E + 1] on the
    device, Saved) of the EP layer's exchange with the plan on the device; ``tokens``: every rank's token count
    (choose). ``pipelined``: the pulls, GEMMs and pushes chunk by chunk, beside each other (device_pipeline.py), where
    that runs (device_pipeline.reason)."""
    from ..kernels import megakernel
    from ..kernels.triton_transfer import layout_tables
    from ..spec import decode_spec

    _compact_earlier()
    RUNS["forward"] += 1
    s = decode_spec(spec)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    top_k = topk_ids.shape[1]
    slots, size, local = topk_ids.numel(), hidden.shape[1], w_up.shape[0]
    num_experts = local * world
    row_order, slot_row, offsets = routing_plan(topk_ids, num_experts, fused_kernels)
    every = device_count_table(offsets, slots, group)
    # an id outside [0, E) sorts past every expert's rows: its rank's counts sum to fewer than its slots. Checked on
    # the device (a failed check stops the process with this message), not lost
    torch._assert_async(every[:, :num_experts].sum(1).eq(every[:, num_experts]).all(),
                        f"uniep.ep_layer: an expert id lies outside [0, {num_experts})")
    send_rows, capacity = max(tokens) * top_k, sum(tokens) * top_k
    win_x = window(group, send_rows, size, hidden.dtype, hidden.device)
    send = win_x.send(rank)[:slots]
    if fused_kernels:
        from ..kernels.triton_routing import gather_rows
        gather_rows(hidden, row_order, top_k, out=send)
    else:
        send.copy_(hidden[row_order // top_k])
    _, ends, _, table = layout_tables(every, rank, local, [0], size, knobs.copy_block)
    received = _received_rows_later(ends)
    x = _buffer(capacity, hidden, fused_kernels)
    ids, ones, plan = _identity_plan(ends, capacity, x.dtype)
    # the experts op's config over the receive buffer, which the backward runs with too: it sees the received rows
    # only (_received_view), and a config picked for fewer rows may differ (config.gated_epilogue's layout of h)
    fused = megakernel.use_megakernel(x, ids, w_up, w_down, b_up, b_down, [], s)
    full = megakernel.Layer(x, ids, w_up, w_down, s, up_bias=b_up is not None) if fused else None
    why = device_pipeline.reason(full, w_up, w_down, s) if pipelined else "not asked"
    win_x.barrier()  # every rank's rows are in its window
    chunked = None
    if why is None:  # the pipeline pulls chunk by chunk
        up, down, win_y, chunked = device_pipeline.forward(every, rank, x, full, ends, w_up, w_down, b_up, b_down,
                                                           s, group, win_x, send_rows, knobs)
    else:
        if pipelined:
            megakernel.warn_once("ep_layer", why, "uniep: the EP device plan runs without its pipeline: %s")
        transfer_rows(table, x, [win_x.send(p) for p in range(world)], False, knobs)
        with megakernel.device_counts_only():  # per_expert_mm's GEMMs would read the expert ends on the host
            out = torch.ops.uniep.moe_experts(x, ids, ones, w_up, w_down, b_up, b_down, [], spec, *plan)
        y, up, down = out[0], out[4], out[5]
        if fused:
            down = None  # the fused backward (weights_grad=False) reads no down rows
        win_y = window(group, send_rows, size, y.dtype, hidden.device)
        # no barrier before the pushes: each peer read its ``back`` before the barrier above
        transfer_rows(table, y, [win_y.back(p) for p in range(world)], True, knobs)
        del y
    win_y.barrier()  # every rank's rows are back
    back = win_y.back(rank)[:slots].clone()  # the next call's pushes overwrite the window
    saved = Saved(None, x, up, down, ids, ones, plan, table, send_rows, fused_kernels, received,
                  full.config if full is not None else None, pipelined, chunked)
    _EARLIER.append(weakref.ref(saved))
    return back, row_order, slot_row, offsets, every, saved


def backward(grad_out, topk_weights, row_order, slot_row, offsets, saved: Saved, w_up, w_down, b_up, b_down,
             spec: str, group, knobs, param_grads: bool):
    """(d_hidden, d_topk_weights, d_w_up, d_w_down, d_b_up, d_b_down) of forward + the combine; the Saved's buffers
    are dropped from it once read."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    num_tokens, top_k = topk_weights.shape
    x, up, down, ids, ones, plan = _received_view(saved)
    fused_kernels = saved.fused_kernels
    dtype, size = x.dtype, x.shape[1]
    win_x = window(group, saved.send_rows, size, dtype, x.device)
    send = win_x.send(rank)[:num_tokens * top_k]
    y_rows, saved.y_rows = saved.y_rows, None
    # the gradient rows, gathered straight into the window where the fused gather can write them there
    d_rows, d_weights = combine_rows_backward(grad_out, y_rows, topk_weights, row_order, slot_row, offsets,
                                              fused_kernels, out=send if y_rows.dtype == dtype else None)
    if d_rows.data_ptr() != send.data_ptr():
        send.copy_(d_rows)
    del d_rows, y_rows
    d_recv = _buffer(x.shape[0], x, fused_kernels)
    win_x.barrier()
    sources = [win_x.send(p) for p in range(world)]
    down = down if down is not None else d_recv.new_empty(0, size)
    saved.x = saved.up = saved.down = None
    from ..kernels import megakernel
    from ..kernels.config import use_config
    from ..spec import decode_spec

    pinned = use_config(saved.config) if saved.config is not None else contextlib.nullcontext()
    win_dx = window(group, saved.send_rows, size, dtype, x.device)
    backs = [win_dx.back(p) for p in range(world)]
    s = decode_spec(spec)
    with megakernel.device_counts_only(), pinned:
        why = device_pipeline.beside_reason(saved.pipelined, saved.config, x, ids, w_up, w_down, b_up, b_down, s,
                                            param_grads)
        if why is None:  # the input gradient first, its pushes beside the weight gradients' GEMMs
            d_x, d_w_up, d_w_down, d_b_up, d_b_down = device_pipeline.experts_backward(
                d_recv, sources, x, ids, ones, plan, up, down, w_up, w_down, b_up, b_down, s, saved.table,
                saved.chunked, saved.config, backs, knobs, param_grads)
        else:
            transfer_rows(saved.table, d_recv, sources, False, knobs)
            d_x, _, d_w_up, d_w_down, d_b_up, d_b_down, _ = torch.ops.uniep.moe_experts_backward(
                d_recv, x, ids, ones, w_up, w_down, b_up, b_down, [], *plan, up, down, spec, False, param_grads)
            transfer_rows(saved.table, d_x, backs, True, knobs)
    del d_recv, x, up, down, ids, ones, plan, d_x
    win_dx.barrier()
    # read before any later barrier: no peer writes this window's ``back`` until then
    d_hidden = gather_sum(win_dx.back(rank)[:num_tokens * top_k], slot_row, offsets, num_tokens, top_k, dtype,
                          fused_kernels)
    if not param_grads:
        d_w_up = d_w_down = d_b_up = d_b_down = None
    return (d_hidden, d_weights, d_w_up, d_w_down, d_b_up if b_up is not None else None,
            d_b_down if b_down is not None else None)

