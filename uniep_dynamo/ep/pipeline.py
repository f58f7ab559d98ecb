"""The overlapped pipeline of one phase (forward or backward) of the EP layer: pulls, GEMMs and pushes, chunk by chunk.

    pipeline    chunk c's rows are pulled (one copy per (expert, source) segment) while chunk c - 1
                computes; chunk c's results are pushed back to their sources' ``back`` while chunk
                c + 1 computes (where the SMs move the rows, by the chunk's last GEMM itself: its epilogue
                stores each row into its source's ``back``, OverlapConfig.push_in_gemm)
    combine     after a barrier, the source sums each token's K rows from its ``back``, k in order, fp32

The backward runs the same way: the weighted output-gradient rows are the dispatched rows, the input gradient rows
come back, and each chunk's weight gradients follow its input-gradient GEMM (or all of them follow the last chunk).
The chunk size and overlap on/off only schedule: the bits are the single-GPU op's.
"""
from __future__ import annotations

import contextlib

import torch

from .chunks import Chunks, new_grads
from .config import OverlapConfig
from .layout import Layout
from .transfer import Streams, Window, segment_copies, sm_carveout, sm_count, window


LOOKAHEAD = 2  # chunks whose pulls are issued ahead of the GEMMs


_TIMING_ROWS: dict = {}


def receive_buffer(role: str, rows: int, hidden: int, dtype, device, knobs: "OverlapConfig") -> torch.Tensor:
    """A phase's receive buffer. With timing="compute" (no transfers) a cached one of random values instead:
    the GEMMs see real-looking inputs (zeros draw less power and run faster), at no cost per call."""
    if knobs.timing != "compute":
        return torch.empty(rows, hidden, dtype=dtype, device=device)
    buf = _TIMING_ROWS.get(role)
    if buf is None or buf.shape != (rows, hidden) or buf.dtype != dtype or buf.device != device:
        buf = _TIMING_ROWS[role] = torch.randn(rows, hidden, device=device).to(dtype)
    return buf


def start_exchange(layout: Layout, table: torch.Tensor, win_out: Window, win_in: Window, recv: torch.Tensor,
                   knobs: OverlapConfig, device):
    """The pipeline of one phase, started: issues the first chunks' pulls (out of the peers' ``send`` of win_out
    into recv) and returns run(compute, after=None), which does the rest. The caller does the host work that the
    first pulls need not wait for (the GEMMs' set-up) between the two: right after the count table's
    synchronization the GPU idles until the first pull is issued.

    run pulls every further chunk, runs compute(chunk, scatter) -> the chunk's result rows ([chunk rows, H], or
    None), pushes those rows into the sources' ``back`` of win_in; then after() (work that no transfer waits
    for, beside the last pushes). It ends with a barrier: every rank's ``back`` is complete and no one reads a
    ``send`` any more. ``scatter``: None, or (the layout's destinations, the sources' ``back``) for a compute that
    stores its results there itself (OverlapConfig.push_in_gemm) and returns None.

    The host issues chunk c + LOOKAHEAD's pulls after chunk c's GEMMs, so the first GEMMs start before
    every copy has been issued. ``table``: the layout's transfer table on the device."""
    from ..kernels import batch_copy
    from ..kernels.triton_transfer import copy_segments

    transfer = knobs.timing != "compute"
    # the paths the layout was laid out for (OverlapConfig.layout_knobs): the copy engines, the transfer kernel
    # (a block: its table), else torch._foreach_copy_
    copy_engine, kernel = layout.engine, layout.block is not None
    num_chunks = len(layout.chunks)
    sends = [win_out.send(s) for s in range(layout.world)]
    backs = [win_in.back(s) for s in range(layout.world)]
    pulled = []
    pushed = []  # the result rows, alive until the push stream is joined (their memory is not reused before)
    ahead = num_chunks if not knobs.overlap else min(num_chunks, LOOKAHEAD)

    # the copy engines' stages: chunk c is pulled into slot c % slots, which its row gather frees for chunk c + slots
    staged = [copy_engine and transfer and layout.staged[c] for c in range(num_chunks)]
    stage, freed, perm, inv = [], [None] * ahead, None, None
    if any(staged):
        perm, inv = layout.permutations(device)
        most = max(hi - lo for (_, _, lo, hi), st in zip(layout.chunks, staged) if st)
        stage = torch.empty(ahead, most, recv.shape[1], dtype=recv.dtype, device=device)

    streams = Streams(device, knobs.copy_streams if copy_engine else 1)
    streams.start_after_current()

    # a transfer no GEMM runs beside (the first pull, the last push, all of them without overlap) takes every SM
    programs = knobs.programs(layout.world)
    solo_programs = max(programs, sm_count(device))

    def move(c, local, peers, push):
        if not transfer:
            return
        if not kernel:
            segment_copies(layout.segments[c], local, peers, push)
        elif layout.chunks[c][3] > layout.chunks[c][2]:  # the chunk has rows
            first, rows = layout.table_chunks[c]
            solo = not knobs.overlap or c == (num_chunks - 1 if push else 0)
            copy_segments(table[first:first + rows], local, peers, push, solo_programs if solo else programs,
                          knobs.copy_block, knobs.copy_warps)

    def engine_copies(c, local, peers, push, after):
        """The copy engines' copies of chunk c, one per source (or its batches of (expert, source) runs), spread
        over the streams of the direction, each of which first waits for ``after``; returns the events of the
        streams that copied."""
        lanes = streams.pushes if push else streams.pulls
        if layout.batched:
            return batched_copies(c, local, peers, push, after, lanes)
        done = []
        for i, (s, peer_row, row, n) in enumerate(layout.blocks[c] if transfer else ()):
            lane = lanes[i % len(lanes)]
            if i < len(lanes):
                streams.wait(after, lane)
            with streams.on(lane):
                if push:
                    peers[s][peer_row:peer_row + n].copy_(local[row:row + n])
                else:
                    local[row:row + n].copy_(peers[s][peer_row:peer_row + n])
            if i + len(lanes) >= len(layout.blocks[c]):  # the lane's last copy of the chunk
                done.append(streams.record(lane))
        return done

    def batched_copies(c, local, peers, push, after, lanes):
        if not transfer:
            return []
        if not streams.cuda or not batch_copy.available():  # CPU, or a driver without batches: one copy a run
            with streams.on(lanes[0]):
                streams.wait(after, lanes[0])
                segment_copies(layout.segments[c], local, peers, push)
                return [streams.record(lanes[0])]
        if not local.is_contiguous():
            raise ValueError("uniep: the batched copies take contiguous chunk rows")
        done, bases, here = [], [p.data_ptr() for p in peers], local.data_ptr()
        for lane, (sources, peer_at, local_at, sizes) in zip(lanes, layout.batches(
                c, len(lanes), local.shape[1] * local.element_size())):
            streams.wait(after, lane)
            there = [bases[s] + at for s, at in zip(sources, peer_at)]
            mine = [here + at for at in local_at]
            batch_copy.copy_batch(there if push else mine, mine if push else there, sizes, lane.cuda_stream)
            done.append(streams.record(lane))
        return done

    def pull(c):
        _, _, lo, hi = layout.chunks[c]
        local = stage[c % ahead][:hi - lo] if staged[c] else recv[lo:hi]
        if copy_engine:  # after the slot's last chunk was gathered out of the stage
            pulled.append(engine_copies(c, local, sends, False, freed[c % ahead] if staged[c] else None))
            return
        with streams.on(streams.pull):
            move(c, local, sends, push=False)
            pulled.append(streams.record(streams.pull))

    def push(c, rows, done):
        if copy_engine:
            engine_copies(c, rows, backs, True, done)
        else:
            streams.wait(done, streams.push)
            with streams.on(streams.push):
                move(c, rows, backs, push=True)
        pushed.append(rows)

    for c in range(ahead):
        pull(c)

    def run(compute, after=None):
        # the last GEMM of a chunk stores its rows into the sources' ``back`` itself (OverlapConfig.gemm_pushes);
        # their table is built after the first pulls are issued, which do not read it
        scatter = (layout.destinations(device), backs) if knobs.gemm_pushes(layout.local_experts, layout.world) \
            else None
        first_scatter = knobs.first_gemm_push(num_chunks)
        if not knobs.overlap:  # every pull before the first GEMM
            streams.wait(pulled[-1])
        # SMs that the transfer kernel's programs hold beside the GEMMs, which torch._grouped_mm leaves out
        carve = programs if kernel and transfer and knobs.overlap and knobs.gemm_carveout and streams.cuda else 0
        gemm_pushes_from = first_scatter if scatter is not None else num_chunks

        def carved(c):  # around chunk c's GEMMs (c = num_chunks: the work after the last chunk's)
            if not carve:
                return contextlib.nullcontext()
            return sm_carveout(carve * _transfers_beside(c, num_chunks, gemm_pushes_from), device)

        results = []
        for c in range(num_chunks):
            _, _, lo, hi = layout.chunks[c]
            streams.wait(pulled[c])
            if staged[c]:  # the stage, ordered by source, into the receive order
                torch.index_select(stage[c % ahead][:hi - lo], 0, perm[lo:hi], out=recv[lo:hi])
                freed[c % ahead] = streams.record()
            with carved(c):
                result = compute(c, scatter if c >= first_scatter else None)
            if result is not None:
                if staged[c]:  # the results, in the receive order, into the stage order of the sources' blocks
                    result = torch.index_select(result, 0, inv[lo:hi])
                results.append((c, result, streams.record()))
            if knobs.overlap or c == num_chunks - 1:  # without overlap: every GEMM before the first push
                for done in results:
                    push(*done)
                results = []
            if c + ahead < num_chunks:
                pull(c + ahead)
        if after is not None:
            with carved(num_chunks):
                after()
        streams.join()
        pushed.clear()
        win_out.barrier()
    return run


def _transfers_beside(c: int, chunks: int, first_scatter: int) -> int:
    """How many of the transfer kernel's launches run beside chunk c's GEMMs in an overlapped phase of ``chunks``
    chunks (c = chunks: the work after the last chunk's), where the chunks from ``first_scatter`` on store their
    results into the peers in their GEMMs: the next chunk's pull (issued before the GEMMs; the first pull goes alone)
    and the previous chunk's push, unless its GEMM stored the rows itself."""
    return int(c + 1 < chunks) + int(0 < c <= chunks and c - 1 < first_scatter)


def forward_phase(layout: Layout, table, group, knobs: OverlapConfig, x, out_dtype, fill, setup):
    """The forward's transfers and GEMMs: fill(window) writes this rank's rows into the window's ``send`` and
    returns True, and the peers wait for them in a barrier (or returns False: the rows and that barrier went
    before, every rank's alike), then every chunk is pulled into ``x``, runs its up and down GEMMs and is pushed
    back. setup() -> (the Chunks, the [rows, up_width] buffer that keeps the up
    projection) runs once the first pulls are issued (start_exchange). Returns the window whose ``back`` holds
    this rank's result rows ([*, H] of out_dtype, in its send order), the chunks and the up projection."""
    size, device = x.shape[1], x.device
    win_x = window(group, layout.capacity, size, x.dtype, device)
    win_y = window(group, layout.capacity, size, out_dtype, device)
    if fill(win_x):
        win_x.barrier()
    run = start_exchange(layout, table, win_x, win_y, x, knobs, device)
    chunks, up = setup()
    act = torch.empty(layout.rows, chunks.inter, dtype=chunks.w_down.dtype, device=device)
    run(lambda c, scatter: chunks.forward(c, x, up, act, scatter))
    return win_y, chunks, up


def backward_phase(layout: Layout, table, chunks: Chunks, group, knobs: OverlapConfig, x, up, dy_dtype, fill,
                   beside=None, param_grads: bool = True):
    """The backward's transfers and GEMMs: fill(window) writes this rank's output-gradient rows into the
    window's ``send``; every chunk's rows are pulled, run the input- and weight-gradient GEMMs and the
    input-gradient rows are pushed back. beside() (work of the current stream that reads no row of the phase)
    runs once the first pulls are issued, beside them. Returns the window whose ``back`` holds this rank's
    input-gradient rows, in its send order, [d_w_up, d_w_down, d_b_up, d_b_down] (None for a missing bias; all None
    with ``param_grads=False``: frozen experts, whose weight-gradient GEMMs do not run) and what beside returned
    (None without it)."""
    size, device = x.shape[1], x.device
    win_dy = window(group, layout.capacity, size, dy_dtype, device)
    win_dx = window(group, layout.capacity, size, chunks.w_up.dtype, device)
    fill(win_dy)
    win_dy.barrier()
    dy = receive_buffer("dy", layout.rows, size, dy_dtype, device, knobs)
    run = start_exchange(layout, table, win_dy, win_dx, dy, knobs, device)
    extra = beside() if beside is not None else None
    act = torch.empty(layout.rows, chunks.inter, dtype=chunks.w_down.dtype, device=device)
    d_up = torch.empty_like(up)
    last = knobs.weight_grads_last or not param_grads
    grads = new_grads(chunks.w_up, chunks.w_down, chunks.b_up, chunks.b_down, weights=not last) if param_grads \
        else [None] * 4
    run(lambda c, scatter: chunks.backward(c, x, up, dy, act, d_up, grads=grads, weight_grads=not last,
                                           scatter=scatter),
        after=(lambda: chunks.weight_grads(x, dy, act, d_up, grads)) if last and param_grads else None)
    return win_dx, grads, extra
