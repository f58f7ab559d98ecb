"""Triton kernel of the EP layer's transfers: every (expert, source) segment of one pipeline chunk moved
by one launch, from a segment table on the device.

A segment is a run of whole rows that is contiguous on both sides (rows of one expert from one source:
contiguous in the source's ``send``/``back`` buffer and in the expert rank's receive buffer), so it is
a flat copy of ``numel`` elements. The chunk's segments are cut into blocks of BLOCK elements; program
p of the grid copies blocks p, p + grid, p + 2 grid, ... (the grid size is the number of SMs the
transfer takes from the GEMMs that run beside it). Table row (int64):

    source   the peer whose buffer is read (pull) or written (push)
    peer     the segment's first element in that peer's buffer
    local    its first element in this rank's buffer
    numel    its elements
    end      blocks of the chunk up to and including this segment (a running sum)

Bits are copied as integers of the element's width, so the kernel takes every dtype (the interpreter
included, where bfloat16 loads are broken) and never rounds anything.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

TABLE_COLUMNS = 5
MAX_PEERS = 8

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _peer(source, p0, p1, p2, p3, p4, p5, p6, p7):
    base = p0
    base = tl.where(source == 1, p1, base)
    base = tl.where(source == 2, p2, base)
    base = tl.where(source == 3, p3, base)
    base = tl.where(source == 4, p4, base)
    base = tl.where(source == 5, p5, base)
    base = tl.where(source == 6, p6, base)
    base = tl.where(source == 7, p7, base)
    return base


@triton.jit
def _copy_segments(table_ptr, rows, local_ptr, p0, p1, p2, p3, p4, p5, p6, p7, PUSH: tl.constexpr,
                   VEC: tl.constexpr, BLOCK: tl.constexpr):
    num_blocks = tl.load(table_ptr + (rows - 1) * 5 + 4)  # the last row's running sum: the chunk's blocks
    seg = 0
    start = tl.load(table_ptr + 4) * 0
    end = tl.load(table_ptr + 4)
    lanes = tl.arange(0, BLOCK)
    for block in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        while block >= end:
            seg += 1
            start = end
            end = tl.load(table_ptr + seg * 5 + 4)
        row = table_ptr + seg * 5
        base = _peer(tl.load(row), p0, p1, p2, p3, p4, p5, p6, p7)
        peer_at = tl.multiple_of(tl.load(row + 1), VEC)
        local_at = tl.multiple_of(tl.load(row + 2), VEC)
        numel = tl.multiple_of(tl.load(row + 3), VEC)
        offs = (block - start) * BLOCK + lanes
        mask = offs < numel
        if PUSH:
            tl.store(base + peer_at + offs, tl.load(local_ptr + local_at + offs, mask=mask), mask=mask)
        else:
            tl.store(local_ptr + local_at + offs, tl.load(base + peer_at + offs, mask=mask), mask=mask)


def segment_table(segments, width: int, block: int):
    """The table of segments [(source, peer row, local row, rows)] of [*, width] buffers, flat (TABLE_COLUMNS
    integers a row, in the segments' order), and the chunk's block count."""
    table, end = [], 0
    for source, peer_row, local_row, rows in segments:
        numel = rows * width
        end += -(-numel // block)
        table += (source, peer_row * width, local_row * width, numel, end)
    return table, end


def copy_segments(table: torch.Tensor, local: torch.Tensor, peers, push: bool, programs: int, block: int,
                  warps: int) -> None:
    """Pull (peer -> local) or push (local -> peer) every segment of ``table`` ([n >= 1, 5] int64 on the device,
    made with the same block; the kernel reads the block count from its last row) with ``programs`` programs of
    ``warps`` warps. local and peers[s]: contiguous buffers of one dtype."""
    if len(peers) > MAX_PEERS:
        raise ValueError(f"uniep: the transfer kernel takes at most {MAX_PEERS} ranks, got {len(peers)}")
    bits = _BITS[local.element_size()]
    width = local.shape[-1] if local.dim() > 1 else 1
    # table offsets are multiples of the row width: aligned vectors when a row is a whole number of 16 bytes
    vec = max(1, 16 // local.element_size()) if (width * local.element_size()) % 16 == 0 else 1
    ptrs = [p.view(bits) for p in peers]
    ptrs += [ptrs[0]] * (MAX_PEERS - len(ptrs))
    launch(_copy_segments, (max(1, programs),), table, table.shape[0], local.view(bits), *ptrs, PUSH=push, VEC=vec,
           BLOCK=block, num_warps=warps)


@triton.jit
def _chunk_bounds(e, last, b1, b2, b3, b4, b5, b6, b7):
    """(first expert, end) of the chunk of each local expert e; b1..b7: the chunks' first experts after the first
    (``last``, the local experts, for chunks that do not exist)."""
    start = e * 0
    start = tl.where(e >= b1, b1, start)
    start = tl.where(e >= b2, b2, start)
    start = tl.where(e >= b3, b3, start)
    start = tl.where(e >= b4, b4, start)
    start = tl.where(e >= b5, b5, start)
    start = tl.where(e >= b6, b6, start)
    start = tl.where(e >= b7, b7, start)
    end = e * 0 + last
    end = tl.where(e < b7, b7, end)
    end = tl.where(e < b6, b6, end)
    end = tl.where(e < b5, b5, end)
    end = tl.where(e < b4, b4, end)
    end = tl.where(e < b3, b3, end)
    end = tl.where(e < b2, b2, end)
    end = tl.where(e < b1, b1, end)
    return start, end


@triton.jit
def _layout_tables(counts_ptr, out_ptr, stride, rank, world, experts, width, block, b1, b2, b3, b4, b5, b6, b7,
                   BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr, ABSOLUTE: tl.constexpr = False):
    # one program; pair i = e * world + s of local expert e and source s, in receive order
    pairs = world * experts
    i = tl.arange(0, BLOCK_P)
    ok = i < pairs
    e = i // world
    s = i % world
    g = rank * experts + e  # the global expert
    mine = tl.load(counts_ptr + s * stride + g, mask=ok, other=0).to(tl.int64)
    # where the pair's rows start in its source's buffer: the source's rows for the experts before g
    peer = tl.zeros([BLOCK_P], dtype=tl.int64)
    for g0 in range(0, (rank + 1) * experts, BLOCK_G):
        j = g0 + tl.arange(0, BLOCK_G)
        before = ok[:, None] & (j[None, :] < g[:, None])
        peer += tl.sum(tl.load(counts_ptr + s[:, None] * stride + j[None, :], mask=before, other=0).to(tl.int64), 1)
    ends = tl.cumsum(mine, 0)  # the pair's end row in the receive buffer
    at = ends - mine
    rel_out = out_ptr
    ends_out = rel_out + experts
    dest_out = ends_out + experts
    table_out = dest_out + 3 * pairs
    scratch = table_out + 5 * pairs  # 3 * pairs: ends by pair, blocks by table row, their running sum
    tl.store(scratch + i, ends, mask=ok)
    tl.debug_barrier()
    # per local expert: its end row, and counted from its chunk's first row (the grouped GEMMs' offsets)
    first, last = _chunk_bounds(e, experts, b1, b2, b3, b4, b5, b6, b7)
    lo = tl.load(scratch + first * world - 1, mask=ok & (first > 0), other=0)  # the chunk's first row
    expert_end = tl.load(scratch + i * world + world - 1, mask=i < experts, other=0)
    expert_first, _ = _chunk_bounds(i, experts, b1, b2, b3, b4, b5, b6, b7)
    expert_lo = tl.load(scratch + expert_first * world - 1, mask=(i < experts) & (expert_first > 0), other=0)
    tl.store(ends_out + i, expert_end, mask=i < experts)
    tl.store(rel_out + i, expert_end - expert_lo, mask=i < experts)
    # the destinations' runs: receive row at + r goes back to row peer + r of source s
    tl.store(dest_out + 3 * i, at, mask=ok)
    tl.store(dest_out + 3 * i + 1, (peer - at) * 8 + s, mask=ok)
    tl.store(dest_out + 3 * i + 2, mine, mask=ok)
    # the transfer table: chunk by chunk, source by source from this rank, expert by expert
    row = world * first + ((s - rank + world) % world) * (last - first) + (e - first)
    numel = mine * width
    out = table_out + 5 * row
    tl.store(out, s.to(tl.int64), mask=ok)
    tl.store(out + 1, peer * width, mask=ok)
    tl.store(out + 2, (at if ABSOLUTE else at - lo) * width, mask=ok)
    tl.store(out + 3, numel, mask=ok)
    tl.store(scratch + pairs + row, (numel + block - 1) // block, mask=ok)
    tl.debug_barrier()
    blocks = tl.cumsum(tl.load(scratch + pairs + i, mask=ok, other=0), 0)  # by table row
    tl.store(scratch + 2 * pairs + i, blocks, mask=ok)
    tl.debug_barrier()
    row_first, _ = _chunk_bounds(i // world, experts, b1, b2, b3, b4, b5, b6, b7)
    before = tl.load(scratch + 2 * pairs + row_first * world - 1, mask=ok & (row_first > 0), other=0)
    tl.store(table_out + 5 * i + 4, blocks - before, mask=ok)


MAX_CHUNKS = 8  # layout_tables' chunks at most


def layout_tables(counts: torch.Tensor, rank: int, experts: int, chunk_firsts, width: int, block: int,
                  absolute: bool = False):
    """The EP layer's device tables from the all-gathered count table ``counts`` ([W, >= W * experts] integers on
    the device, W sources' rows per global expert) by one launch, no host integer of the counts needed: (rel
    [experts], each local expert's end row counted from its chunk's first row; ends [experts], its end row;
    dest [W * experts, 3], the destinations' runs (expand_runs), one per (expert, source) pair in receive order;
    table [W * experts, 5], the transfer table of segment_table, chunk by chunk, each chunk's pairs source by
    source from ``rank``, then expert by expert, pairs without rows included). chunk_firsts: the first local expert
    of each chunk, in order, at most MAX_CHUNKS; width: a row's elements; block: the transfer kernel's. A table row's
    local element counts from its chunk's first row, or with ``absolute`` from the receive buffer's first (the EP
    device plan, whose chunk bounds are on the device only: each chunk's rows of the table, one launch each)."""
    world = counts.shape[0]
    pairs = world * experts
    if len(chunk_firsts) > MAX_CHUNKS or list(chunk_firsts[:1]) != [0]:
        raise ValueError(f"uniep: layout_tables takes up to {MAX_CHUNKS} chunks, the first from expert 0, got "
                         f"{list(chunk_firsts)}")
    out = torch.empty(2 * experts + (3 + TABLE_COLUMNS + 3) * pairs, dtype=torch.int64, device=counts.device)
    if pairs:
        block_p = max(2, 1 << (pairs - 1).bit_length())
        firsts = list(chunk_firsts[1:]) + [experts] * (MAX_CHUNKS - len(chunk_firsts))
        launch(_layout_tables, (1,), counts, out, counts.stride(0), rank, world, experts, width, block, *firsts,
               BLOCK_P=block_p, BLOCK_G=max(2, min(64, 8192 // block_p)), ABSOLUTE=absolute, num_warps=4)
    rel, ends = out[:experts], out[experts:2 * experts]
    dest = out[2 * experts:2 * experts + 3 * pairs].view(pairs, 3)
    table = out[2 * experts + 3 * pairs:2 * experts + (3 + TABLE_COLUMNS) * pairs].view(pairs, TABLE_COLUMNS)
    return rel, ends, dest, table


@triton.jit
def _expand_runs(runs_ptr, out_ptr, scale, BLOCK: tl.constexpr):
    run = runs_ptr + tl.program_id(0) * 3
    start = tl.load(run)
    delta = tl.load(run + 1)
    rows = tl.load(run + 2)
    for r0 in range(0, rows, BLOCK):
        i = r0 + tl.arange(0, BLOCK)
        row = start + i
        tl.store(out_ptr + row, row * scale + delta, mask=i < rows)


EXPAND_BLOCK = 1024


def expand_runs(runs: torch.Tensor, total: int, scale: int = 1) -> torch.Tensor:
    """[total] int64: row i * scale + the delta of the run that holds row i. ``runs``: [n, 3] int64 on the device,
    (first row, delta, rows) per run, the runs covering rows 0 .. total - 1 in order. One launch (the torch ops
    that do the same take seven): the layout's tables are made between the count table's synchronization and the
    GEMMs' first launch."""
    out = torch.empty(total, dtype=torch.int64, device=runs.device)
    if runs.shape[0] and total:
        launch(_expand_runs, (runs.shape[0],), runs, out, scale, BLOCK=EXPAND_BLOCK)
    return out
