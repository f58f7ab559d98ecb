"""The EP device plan's forward, pipelined (ep_layer with device_plan and overlap): chunk by chunk of local experts,
the pull of a chunk's rows, its up and down GEMMs and the push of its results, on three streams, so that one chunk's
transfers run beside another's GEMMs. The counts stay on the device as in device_plan.py: each chunk's transfers are
its rows of a transfer table made on the device (local rows counted from the receive buffer's first row), and its
GEMMs find the chunk's first row in the device's expert ends (rows_gemm's ``lead``). Each expert's GEMMs see the same
rows in the same order as the unpipelined path's experts op, by the MegaKernel's Triton GEMMs or QuACK's (chunk_config;
torch._grouped_mm's group bounds start at row 0): the same bits where that op's GEMMs are Triton's, and on a GPU where
the project's GEMM backends agree (kernels/config.py). The backward is device_plan.py's, over the same buffers, with
its pulls by the forward's chunks (each chunk's activation-gradient GEMM beside the next chunk's pull) and its d_x
pushes beside the weight gradients' GEMMs (experts_backward here).

Measured (BENCHMARKS.md, 2026-11-28, HF's 4-layer models, back to back): at 4 H200s on Qwen3-30B-A3B dims the
forward's pipeline took the step from 94.4 to 92.1 ms, and with the backward's d_x pushed beside the weight gradients
from 93.1 to 89.1 (synchronized 106.8 to 109.0: more launches on the host); on Mixtral-8x7B dims at 2 H200s 212.4 to
214.6. The backward's chunked pulls came after those runs: not measured yet.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.distributed as dist

from .config import CHUNKS_SM, even_chunks
from .transfer import Streams, sm_count, window

# forward calls that ran the pipeline, backward calls that pushed d_x beside the weight gradients (the tests read it)
RUNS = {"forward": 0, "backward": 0}


def transfer_rows(table, local, peers, push: bool, knobs, programs: int | None = None) -> None:
    """Every segment of ``table`` pulled into ``local`` or pushed from it, by ``programs`` programs (default: one an
    SM, the transfer alone on the GPU)."""
    from ..kernels.triton_transfer import copy_segments

    if table.shape[0]:
        copy_segments(table, local, peers, push, programs or sm_count(local.device), knobs.copy_block,
                      knobs.copy_warps)


def chunks(local: int, knobs) -> tuple:
    """The local experts of each pipeline chunk: OverlapConfig.chunks even chunks (CHUNKS_SM where None), at most
    MAX_CHUNKS."""
    from ..kernels.triton_transfer import MAX_CHUNKS

    count = min(knobs.chunks or CHUNKS_SM, MAX_CHUNKS, local)
    return even_chunks(local, math.ceil(local / max(1, count)))


# The chunk GEMMs' engines. torch._grouped_mm's group bounds start at row 0 and per_expert_mm reads them on the host,
# so a run of experts past row 0 (rows_gemm's ``lead``) takes Triton's GEMM or QuACK's (its group bounds from the run's
# first row; the same bits, as the backends give on the GPUs measured). Which, from benchmarks/probes/chunk_gemm_probe.py
# on an H200 (bf16, T = 8192 a rank, two chunks, a rank's receive buffer at 2 and 4 ranks; BENCHMARKS.md 2026-11-29),
# ms Triton / QuACK: with 16 or more local experts (Qwen3-30B-A3B, OLMoE) QuACK's down projection 0.415 / 0.328,
# 0.442 / 0.308, 0.560 / 0.415, 0.581 / 0.409 and activation gradient 0.377 / 0.347, 0.339 / 0.301, 0.504 / 0.431,
# 0.516 / 0.425, while Triton's up projection with its fused activation beat QuACK's GEMM and the activation pass
# (0.785 / 0.813, 0.778 / 0.971, 1.079 / 1.097, 1.109 / 1.290); with 2 or 4 (Mixtral-8x7B) the reverse for the up
# projection (7.012 / 6.506, 6.929 / 6.814), Triton's down projection (2.804 / 2.877, 2.715 / 2.852), and the
# activation gradient split (2.867 / 2.914, 2.975 / 2.808: Triton's kept).
MANY_LOCAL_EXPERTS = 16
CHUNK_QUACK = {True: ("down", "grad_act"), False: ("up",)}  # by local experts >= MANY_LOCAL_EXPERTS


def chunk_config(config, local_experts: int):
    """The chunk GEMMs' config: ``config`` without torch._grouped_mm and per_expert_mm, with QuACK's GEMM
    (config.QUACK_CONFIGS) where it led for this many local experts (CHUNK_QUACK) and Triton's elsewhere; where QuACK
    does not run (not installed, not a Hopper GPU, not bf16) rows_gemm takes Triton's. ``config``'s own QuACK
    choices (the heuristics', a tuned or a use_config one) apply to the unpipelined path, not to these chunks:
    UNIEP_QUACK=0 turns QuACK off here too. Only the scheduling changes: the backends give the same bits."""
    from ..kernels.config import QUACK_CONFIGS

    base = config.replace_gemms(grouped_mm=False, quack="", per_expert_mm=False)
    quack = CHUNK_QUACK[local_experts >= MANY_LOCAL_EXPERTS]
    return dataclasses.replace(base, **{g: dataclasses.replace(getattr(base, g), quack=QUACK_CONFIGS[g])
                                        for g in quack})


def pull_chunks(streams, table, sizes, local, sources, knobs) -> list:
    """Each chunk's rows of the absolute ``table`` pulled from ``sources`` into ``local`` on the pull stream, the
    first alone on the GPU (every SM), the others beside GEMMs; returns each chunk's pull event."""
    world, firsts = len(sources), [0, *itertools.accumulate(sizes)]
    beside, pulled = knobs.programs(world), []
    with streams.on(streams.pull):
        for c in range(len(sizes)):
            transfer_rows(table[world * firsts[c]:world * firsts[c + 1]], local, sources, False, knobs,
                          None if c == 0 else beside)
            pulled.append(streams.record(streams.pull))
    return pulled


def reason(full, w_up, w_down, s) -> str | None:
    """None where the forward's pipeline runs, else why not (the device plan then runs its steps one after another,
    with the same bits on the same GEMMs). Its chunk GEMMs are the MegaKernel's Triton GEMMs or QuACK's
    (chunk_config), with h in halves, and it pushes the down rows themselves as the results (the combine of
    one row a slot with a weight of one is a copy where the output dtype is theirs). ``full``: the MegaKernel's
    Layer over the receive buffer, None where the fused kernels do not run it."""
    if full is None:
        return "the fused kernels do not run this layer"
    if s.out_dtype != w_down.dtype:
        return f"the layer's output dtype ({s.out_dtype}) is not its weights' ({w_down.dtype})"
    if w_up.shape[0] < 2:
        return "one local expert: one chunk"
    if full.h_interleaved:
        return "config.gated_epilogue stores h interleaved, by QuACK's gated GEMM"
    return None


def forward(every, rank, x, full, ends, w_up, w_down, b_up, b_down, s, group, win_x, send_rows, knobs):
    """The forward's pull, experts and push, pipelined by chunks of local experts: chunk c's pull (the transfer kernel
    over the chunk's rows of an absolute table) on the pull stream, its up and down GEMMs on the current stream once
    pulled, its push on the push stream once computed, so a chunk's transfers run beside another's GEMMs. Each
    expert's GEMMs are the experts op's Triton or QuACK GEMMs (chunk_config) over the same rows in the same order
    (the chunk's first row read from the device's expert ends: ``lead``), so the bits are the same as the unpipelined
    path's where its GEMMs are those (GPU: the project's GEMM backends give the same bits, config.py). ``full``: the
    MegaKernel's Layer over the receive buffer ``x`` (its config, less the GEMM backends that cannot start past row
    0). Returns (up [capacity, up_width], None: the buffers the backward reads, the window the rows were pushed into,
    (the absolute transfer table, the chunks' expert counts): the backward's chunks)."""
    from ..kernels import megakernel
    from ..kernels.triton_gemm import GLU_FWD, STORE
    from ..kernels.triton_transfer import layout_tables

    RUNS["forward"] += 1
    world, capacity, size = dist.get_world_size(group), x.shape[0], x.shape[1]
    sizes = chunks(w_up.shape[0], knobs)
    firsts = [0, *itertools.accumulate(sizes)]
    _, _, _, table = layout_tables(every, rank, w_up.shape[0], firsts[:-1], size, knobs.copy_block, absolute=True)
    cfg = chunk_config(full.config, w_up.shape[0])
    up = torch.empty(capacity, full.up_width, dtype=w_up.dtype, device=x.device)
    act = torch.empty(capacity, full.inter, dtype=w_down.dtype, device=x.device)
    down = torch.empty(capacity, size, dtype=w_down.dtype, device=x.device)
    win_y = window(group, send_rows, size, down.dtype, x.device)
    streams = Streams(x.device)
    streams.start_after_current()  # the pulls follow the barrier; the pushes, the peers' reads of ``back``
    sources, backs = [win_x.send(p) for p in range(world)], [win_y.back(p) for p in range(world)]
    beside = knobs.programs(world)
    pulled = pull_chunks(streams, table, sizes, x, sources, knobs)
    for c in range(len(sizes)):
        e0, e1 = firsts[c], firsts[c + 1]
        layer = megakernel.Layer(x, (capacity, 1), w_up[e0:e1], w_down[e0:e1], s, cfg, up_bias=b_up is not None)
        offsets, lead = ends[e0:e1], e0 > 0
        streams.wait(pulled[c])
        megakernel.rows_gemm(layer, cfg.up, a=x, gather=False, row_order=None, b=layer.up_eff, n=layer.inter,
                             k=size, epilogue=GLU_FWD, c=up, d=act,
                             bias=b_up[e0:e1] if b_up is not None else None, offsets=offsets, lead=lead,
                             **layer.weight_halves())
        megakernel.rows_gemm(layer, cfg.down, a=act, gather=False, row_order=None, b=layer.down_eff, n=size,
                             k=layer.inter, epilogue=STORE, c=down,
                             bias=b_down[e0:e1] if b_down is not None else None, offsets=offsets, lead=lead)
        done = streams.record()
        with streams.on(streams.push):
            streams.wait(done, streams.push)
            # the last push has no GEMM beside it: every SM
            transfer_rows(table[world * e0:world * e1], down, backs, True, knobs,
                          None if c == len(sizes) - 1 else beside)
    streams.join()  # the buffers, made on the current stream, outlive the side streams' use of them
    megakernel.record_h_layout(up, False)
    return up, None, win_y, (table, sizes)


def beside_reason(pipelined: bool, config, x, ids, w_up, w_down, b_up, b_down, s, param_grads: bool) -> str | None:
    """None where the device plan's backward pushes the input-gradient rows beside the weight gradients' GEMMs
    (experts_backward), else why its steps run one after another (the same GEMMs, the same bits): the forward asked
    for the pipeline (``pipelined``), the fused kernels run the experts' backward (``config``: the forward's), there
    are weight gradients to run beside, and the rows are pushed as the GEMM writes them (the combine of one row a
    slot with a weight of one is a copy where their dtype is x's)."""
    from ..kernels import megakernel

    if not pipelined:
        return "not asked"
    if config is None or not megakernel.use_megakernel(x, ids, w_up, w_down, b_up, b_down, [], s):
        return "the fused kernels do not run this layer"
    if not param_grads:
        return "no weight gradients to push beside"
    if w_up.dtype != x.dtype:
        return f"the input-gradient rows ({w_up.dtype}) are not x's dtype ({x.dtype})"
    return None


def experts_backward(d_recv, sources, x, ids, ones, plan, up, down, w_up, w_down, b_up, b_down, s, table, chunked,
                     config, backs, knobs, param_grads: bool):
    """(d_x rows, d_w_up, d_w_down, d_b_up, d_b_down) of the device plan's experts backward: the gradient rows pulled
    from the peers' ``sources`` into ``d_recv``, the input gradient computed before the weight gradients
    (megakernel.experts_backward's ``input_first``) and its rows pushed into the peers' ``backs`` on the push stream,
    beside the weight gradients' GEMMs. ``chunked`` (the forward's pipeline ran: its absolute table and chunks, else
    None): the pulls chunk by chunk on the pull stream, and each chunk's activation-gradient GEMM (``lead``, by
    chunk_config as the forward's chunk GEMMs) once its rows are in, the next chunk's pull beside it; else one pull by
    ``table``.
    The current stream has joined the side streams when this returns. Run within the forward's config ``config``
    (use_config), where beside_reason is None."""
    from ..kernels import megakernel
    from ..kernels.triton_gemm import STORE

    RUNS["backward"] += 1
    world, capacity, size = len(backs), x.shape[0], x.shape[1]
    streams = Streams(x.device)
    streams.start_after_current()  # the pulls and the pushes follow the barrier before them
    d_act = None
    if chunked is None:
        transfer_rows(table, d_recv, sources, False, knobs)
    else:
        chunk_table, sizes = chunked
        firsts = [0, *itertools.accumulate(sizes)]
        pulled = pull_chunks(streams, chunk_table, sizes, d_recv, sources, knobs)
        cfg = chunk_config(config, w_up.shape[0])
        ends = plan[2]
        for c in range(len(sizes)):
            e0, e1 = firsts[c], firsts[c + 1]
            layer = megakernel.Layer(x, (capacity, 1), w_up[e0:e1], w_down[e0:e1], s, cfg,
                                     up_bias=b_up is not None)
            if d_act is None:
                d_act = torch.empty(capacity, layer.inter, dtype=w_down.dtype, device=x.device)
            streams.wait(pulled[c])
            # the experts op's activation-gradient GEMM over this chunk's rows (weights of one: the rows as pulled)
            megakernel.rows_gemm(layer, cfg.grad_act, a=d_recv, gather=False, row_order=None,
                                 b=layer.down_eff.transpose(1, 2), n=layer.inter, k=size, epilogue=STORE, c=d_act,
                                 offsets=ends[e0:e1], lead=e0 > 0)

    def push(rows):
        done = streams.record()
        with streams.on(streams.push):
            streams.wait(done, streams.push)
            transfer_rows(table, rows, backs, True, knobs, knobs.programs(world))

    d_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _, _, d_w_up, d_w_down, d_b_up, d_b_down, _ = megakernel.experts_backward(
        d_recv, x, ids, ones, w_up, w_down, b_up, b_down, *plan, up, down, s, weights_grad=False, input_rows=d_x,
        param_grads=param_grads, input_first=push, d_act=d_act)
    streams.join()
    return d_x, d_w_up, d_w_down, d_b_up, d_b_down
