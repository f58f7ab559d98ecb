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

from .config import cdiv
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
def _copy_segments(table_ptr, num_blocks, local_ptr, p0, p1, p2, p3, p4, p5, p6, p7, PUSH: tl.constexpr,
                   VEC: tl.constexpr, BLOCK: tl.constexpr):
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
    """Host rows of the table for segments [(source, peer row, local row, rows)] of [*, width] buffers, and the
    chunk's block count."""
    table, end = [], 0
    for source, peer_row, local_row, rows in segments:
        numel = rows * width
        end += cdiv(numel, block)
        table.append((source, peer_row * width, local_row * width, numel, end))
    return table, end


def copy_segments(table: torch.Tensor, num_blocks: int, local: torch.Tensor, peers, push: bool, programs: int,
                  block: int, warps: int) -> None:
    """Pull (peer -> local) or push (local -> peer) every segment of ``table`` ([n, 5] int64 on the device,
    from segment_table with the same block) with ``programs`` programs of ``warps`` warps. local and peers[s]:
    contiguous buffers of one dtype."""
    if num_blocks == 0:
        return
    if len(peers) > MAX_PEERS:
        raise ValueError(f"uniep: the transfer kernel takes at most {MAX_PEERS} ranks, got {len(peers)}")
    bits = _BITS[local.element_size()]
    width = local.shape[-1] if local.dim() > 1 else 1
    # table offsets are multiples of the row width: aligned vectors when a row is a whole number of 16 bytes
    vec = max(1, 16 // local.element_size()) if (width * local.element_size()) % 16 == 0 else 1
    ptrs = [p.view(bits) for p in peers]
    ptrs += [ptrs[0]] * (MAX_PEERS - len(ptrs))
    launch(_copy_segments, (max(1, min(programs, num_blocks)),), table, num_blocks, local.view(bits), *ptrs,
           PUSH=push, VEC=vec, BLOCK=block, num_warps=warps)


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
