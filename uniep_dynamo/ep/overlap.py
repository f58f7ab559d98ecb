"""The overlapped EP experts layer as an autograd op: ep_experts_overlapped.

Same arguments and result as the sequential layer (sequential.ep_experts), with the token transfers overlapped with
the grouped GEMMs through torch symmetric memory. Forward: the routing plan (plan.py), the all-gathered count table
and its layout (layout.py), the rows into this rank's ``send`` window (transfer.py), the pipeline of pulls, GEMMs and
pushes (pipeline.py, chunks.py), then the fixed-order combine out of the ``back`` window. Backward: the same pipeline
over the weighted output-gradient rows, the routing weights' gradient beside its first pulls. For one tile
configuration, outputs and all gradients are bitwise those of the single-GPU op over all ranks' tokens (each rank
holding a contiguous shard of the tokens); the knobs (config.py) only schedule.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..spec import decode_spec
from .chunks import Chunks, new_grads, zero_grads
from .config import OverlapConfig, default_knobs
from .layout import Layout
from .pipeline import backward_phase, forward_phase, receive_buffer
from .plan import count_table, layer_unsupported_reason
from .sequential import ep_experts
from .transfer import cached_window, copy_back


def _plan(ids, num_experts: int, spec):
    from ..kernels.triton_routing import routing_plan

    return routing_plan(ids, num_experts, clamp=spec.out_of_range == "clamp")


class _OverlapEP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weights, w_up, w_down, b_up, b_down, ids, spec, group, knobs):
        from ..kernels.triton_routing import combine, gather_rows

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local_experts = w_up.shape[0]
        num_experts = local_experts * world
        num_tokens, top_k = ids.shape
        device = hidden.device
        row_order, slot_row, offsets = _plan(ids, num_experts, spec)
        size = hidden.shape[1]
        slots = num_tokens * top_k
        # the rows go into this rank's ``send`` while the host waits for the count table and lays out the step,
        # when the cached window takes them (no peer reads it since the last phase's closing barrier), and the
        # barrier that tells the peers so is passed there too. Every rank has the same cached windows (they are made
        # together), so all of them take that barrier or none; if some rank's rows do not fit, the window is
        # replaced on every rank (window, from the all-gathered table) and forward_phase fills the new one.
        early = cached_window(group, hidden.dtype, size, device)

        def beside():
            if 0 < slots <= early.capacity:
                gather_rows(hidden, row_order, top_k, out=early.send(rank)[:slots])
            early.barrier()
        counts, tokens, every = count_table(offsets, num_tokens, group, beside=None if early is None else beside)
        chunk, block, engine, batched = knobs.layout_knobs(local_experts, world)
        layout = Layout(counts, tokens, top_k, rank, world, local_experts, chunk, size, block, engine, batched,
                        device_counts=every)
        offsets_dev, table = layout.to_device(device)
        ctx.layout, ctx.table, ctx.spec, ctx.group, ctx.knobs = layout, table, spec, group, knobs
        ctx.shape = (num_tokens, top_k)

        def setup():  # the GEMMs' set-up, which the first pulls do not wait for (forward_phase)
            chunks = Chunks(layout, offsets_dev, w_up, w_down, b_up, b_down, spec, hidden,
                            skip_gemms=knobs.timing == "comm")
            return chunks, torch.empty(layout.rows, chunks.up_width, dtype=w_up.dtype, device=device)
        if layout.capacity == 0:  # no rank has a token
            ctx.chunks = setup()[0]
            ctx.save_for_backward(hidden, weights, row_order, slot_row, offsets, None, None, None)
            return hidden.new_zeros(num_tokens, size, dtype=spec.out_dtype)
        x = receive_buffer("x", layout.rows, size, hidden.dtype, device, knobs)

        def fill(win):  # not the window found above (none, or one too small for some rank): the rows, the barrier
            if win is early:
                return False
            if slots:
                gather_rows(hidden, row_order, top_k, out=win.send(rank)[:slots])
            return True
        win_y, ctx.chunks, up = forward_phase(layout, table, group, knobs, x, w_down.dtype, fill, setup)
        rows = win_y.back(rank)[:slots]
        # the routing weights' gradient reads the result rows (y): a copy of them, since the window's ``back`` is
        # reused by the next call. On CUDA the copy runs beside the work after the combine (copy_back;
        # OverlapConfig.copy_back_beside), else the combine copies the rows it reads.
        y, ctx.y_ready = None, None
        if ctx.needs_input_grad[1]:
            y = torch.empty(layout.send_start[rank][-1], size, dtype=rows.dtype, device=device)
        side = y is not None and device.type == "cuda" and knobs.copy_back_beside
        out = combine(rows, slot_row, weights.reshape(num_tokens, top_k), offsets, num_tokens, top_k, spec.out_dtype,
                      copy=None if side else y)
        if side:
            ctx.y_ready = copy_back(rows, y)
        ctx.save_for_backward(hidden, weights, row_order, slot_row, offsets, x, up, y)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from ..kernels.triton_routing import combine, gather_rows, routing_weight_grad

        hidden, weights, row_order, slot_row, offsets, x, up, y = ctx.saved_tensors
        layout, chunks, group, knobs = ctx.layout, ctx.chunks, ctx.group, ctx.knobs
        w_up, w_down, b_up, b_down = chunks.w_up, chunks.w_down, chunks.b_up, chunks.b_down
        num_tokens, top_k = ctx.shape
        if layout.capacity == 0:
            grads = zero_grads(new_grads(w_up, w_down, b_up, b_down))
            return (torch.zeros_like(hidden), torch.zeros_like(weights), *grads, None, None, None, None)
        rank = layout.rank
        slots = num_tokens * top_k
        grad_out = grad_out.contiguous()
        # the routing weights' gradient reads no row of the phase: beside its first pulls
        def weight_grad():
            if ctx.y_ready is not None:
                torch.cuda.current_stream(y.device).wait_event(ctx.y_ready)
            return routing_weight_grad(grad_out, y, slot_row, offsets, num_tokens, top_k, weights.dtype)
        win_dx, grads, d_weights = backward_phase(
            layout, ctx.table, chunks, group, knobs, x, up, grad_out.dtype,
            lambda win: gather_rows(grad_out, row_order, top_k, weights.reshape(-1).contiguous(),
                                    out=win.send(rank)[:slots]),
            beside=None if y is None else weight_grad)
        d_hidden = combine(win_dx.back(rank)[:slots], slot_row, None, offsets, num_tokens, top_k, hidden.dtype)
        return (d_hidden, d_weights, *grads, None, None, None, None)


def ep_experts_overlapped(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec: str, group=None,
                          knobs: OverlapConfig | None = None):
    """The EP experts layer of ep.ep_experts (same arguments and result), with its transfers overlapped
    with the GEMMs through symmetric memory. It runs the MegaKernel's Triton kernels (on CPU only in the
    interpreter, with UNIEP_KERNELS=triton); a call they do not take (a dtype, a gate, the CPU path) runs the
    sequential ep.ep_experts instead, with one log line on CUDA. It takes them exactly where the single-process op
    over all ranks' tokens and experts runs the MegaKernel (plan.layer_unsupported_reason: every rank's experts
    counted, as for the sequential layer's routing kernels), so that its routing kernels are that op's."""
    from ..kernels import megakernel

    group = group if group is not None else dist.group.WORLD
    s = decode_spec(spec)
    if s.post is not None:
        raise ValueError("uniep: expert parallelism does not take post-expert programs yet")
    if w_up.shape[0] == 0:
        raise ValueError("uniep: every rank needs at least one expert")
    reason = layer_unsupported_reason(hidden, topk_ids, w_up, w_down, b_up, b_down, s, dist.get_world_size(group))
    if reason is not None:
        if hidden.is_cuda:
            megakernel.warn_once("ep_overlap", reason, "uniep: the overlapped EP layer runs the sequential one "
                                 "instead: %s")
        return ep_experts(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, group)
    return _OverlapEP.apply(hidden, topk_weights, w_up, w_down, b_up, b_down, topk_ids, s, group,
                            knobs if knobs is not None else default_knobs(hidden, topk_ids, w_up, w_down, s, group))
