"""Triton kernels around the grouped GEMMs: the routing plan, the combine and the routing-weight gradient.

Routing plan: a deterministic counting sort of the S = T*K slots (slot s = t*K + k) by expert key,
stable by slot index, so rows are ordered by (expert, token, k). Three launches, no host sync (one, _plan_single,
where the slots fit in one block: up to PLAN_BLOCK, a decode step's):

    _plan_histogram   program b counts the keys of slots [b*B, (b+1)*B) -> hist[b, key]
    _plan_scan        one program: per key, the rows before block b (a sequential pass over blocks,
                      in block order) plus the key's start -> base[b, key]; writes expert_offsets
    _plan_scatter     program b sorts (key, local index) pairs of its slots (tl.sort, a bitonic
                      network: the result is unique because the pairs are distinct) and writes
                      row_order[base + rank] = slot and slot_row[slot] = base + rank

Keys: the expert id, or E for an id outside [0, E) when out-of-range slots are dropped (those rows sort
after every expert's rows, past expert_offsets[E-1]). Integer counts only: nothing depends on timing.

Combine (forward output and input gradient): out[t] = sum_k w[t,k] * rows[slot_row[t*K+k]] with the
K terms added in k order in fp32; rows past expert_offsets[E-1] (dropped slots) count as zero.

Routing-weight gradient: d_w[t,k] = <grad_out[t], rows[slot_row[t*K+k]]>, fp32, summed over H in
BLOCK_H chunks in order. Both kernels have a fixed configuration (no knobs), so their reduction
order never changes with the GEMM configuration.

Gather: the token rows (hidden states, or output-gradient rows times their routing weight) copied
into expert-sorted order for the GEMMs that read them as plain operands.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import cdiv as _cdiv
from .config import next_pow2 as _next_pow2
from .launch import launch

PLAN_BLOCK = 1024      # slots per histogram/scatter program: one tl.sort of 1024 keys
MIN_SORT_BLOCK = 16    # the fewest lanes a plan program sorts (a plan of fewer slots pads to it)
MAX_SLOTS = 2**31 - PLAN_BLOCK  # counts, bases and in-block ranks are int32
COMBINE_BLOCK_H = 256  # hidden columns per combine program
GRAD_W_BLOCK_H = 256   # hidden columns per step of the routing-weight gradient


@triton.jit
def _plan_key(ids_ptr, slots, num_slots, num_experts, CLAMP: tl.constexpr, PAD_KEY: tl.constexpr):
    # compared in the ids' own dtype, then narrowed: an int64 id at or past 2**31 must not wrap into [0, E)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=0)
    if CLAMP:
        key = tl.minimum(tl.maximum(ids, 0), num_experts - 1).to(tl.int32)
    else:
        key = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)
    return tl.where(slots < num_slots, key, PAD_KEY)


@triton.jit
def _plan_histogram(ids_ptr, hist_ptr, num_slots, num_experts, CLAMP: tl.constexpr, BLOCK: tl.constexpr,
                    NUM_KEYS: tl.constexpr):
    b = tl.program_id(0)
    slots = b * BLOCK + tl.arange(0, BLOCK)
    key = _plan_key(ids_ptr, slots, num_slots, num_experts, CLAMP, NUM_KEYS - 1)
    tl.store(hist_ptr + b * NUM_KEYS + tl.arange(0, NUM_KEYS), tl.histogram(key, NUM_KEYS))


@triton.jit
def _plan_scan(hist_ptr, base_ptr, offsets_ptr, num_blocks, num_experts, NUM_KEYS: tl.constexpr):
    keys = tl.arange(0, NUM_KEYS)
    total = tl.zeros([NUM_KEYS], dtype=tl.int32)
    for b in range(0, num_blocks):
        total += tl.load(hist_ptr + b * NUM_KEYS + keys)
    start = tl.cumsum(total, 0) - total
    tl.store(offsets_ptr + keys, (start + total).to(tl.int64), mask=keys < num_experts)
    running = start
    for b in range(0, num_blocks):
        h = tl.load(hist_ptr + b * NUM_KEYS + keys)
        # base[b, key] = first row of this block's slots with `key`, minus the rank of the first of
        # them inside the block's sorted keys; the scatter adds the sorted position.
        local_start = tl.cumsum(h, 0) - h
        tl.store(base_ptr + b * NUM_KEYS + keys, running - local_start)
        running += h


@triton.jit
def _plan_scatter(ids_ptr, base_ptr, row_order_ptr, slot_row_ptr, num_slots, num_experts, slots_per_block,
                  CLAMP: tl.constexpr, BLOCK: tl.constexpr, NUM_KEYS: tl.constexpr):
    """Block b holds slots [b * slots_per_block, (b + 1) * slots_per_block); BLOCK >= the slots it holds
    (min(slots_per_block, num_slots))."""
    b = tl.program_id(0)
    local = tl.arange(0, BLOCK)
    slots = b * slots_per_block + local
    key = _plan_key(ids_ptr, slots, num_slots, num_experts, CLAMP, NUM_KEYS - 1)
    key = tl.where(local < slots_per_block, key, NUM_KEYS - 1)
    packed = tl.sort(key * BLOCK + local)
    sorted_key = packed // BLOCK
    slot = b * slots_per_block + packed % BLOCK
    row = tl.load(base_ptr + b * NUM_KEYS + sorted_key) + local
    valid = (slot < num_slots) & (packed % BLOCK < slots_per_block)
    tl.store(row_order_ptr + row, slot.to(tl.int64), mask=valid)
    tl.store(slot_row_ptr + slot, row.to(tl.int64), mask=valid)


@triton.jit
def _plan_single(ids_ptr, row_order_ptr, slot_row_ptr, offsets_ptr, num_slots, num_experts, CLAMP: tl.constexpr,
                 BLOCK: tl.constexpr, NUM_KEYS: tl.constexpr):
    """The whole plan of at most BLOCK slots in one program (one launch instead of the three): with one block, the
    scan's base is 0 for every key, so a slot's row is its place among the sorted (key, slot) pairs, and the expert
    offsets are the histogram's running sum."""
    local = tl.arange(0, BLOCK)
    key = _plan_key(ids_ptr, local, num_slots, num_experts, CLAMP, NUM_KEYS - 1)
    keys = tl.arange(0, NUM_KEYS)
    tl.store(offsets_ptr + keys, tl.cumsum(tl.histogram(key, NUM_KEYS), 0).to(tl.int64), mask=keys < num_experts)
    slot = tl.sort(key * BLOCK + local) % BLOCK
    valid = slot < num_slots
    tl.store(row_order_ptr + local, slot.to(tl.int64), mask=valid)
    tl.store(slot_row_ptr + slot, local.to(tl.int64), mask=valid)


INDEX_BLOCK = 1024  # elements a program of _int32_index


@triton.jit
def _int32_index(src_ptr, dst_ptr, n, divisor, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """dst[i + SHIFT] = src[i] // divisor as int32 (src >= 0), and dst[0] = 0 where SHIFT is 1."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + i, mask=i < n, other=0)
    tl.store(dst_ptr + i + SHIFT, (v // divisor).to(tl.int32), mask=i < n)
    if SHIFT == 1:
        if tl.program_id(0) == 0:
            tl.store(dst_ptr, 0)


def int32_index(src: torch.Tensor, divisor: int = 1, lead_zero: bool = False) -> torch.Tensor:
    """``src // divisor`` as int32 (src a non-negative int64 index, 1-D), after a 0 where ``lead_zero``: QuACK's group
    bounds ([0, each expert's end row]) and its gather index (each expert-sorted row's token) in one launch each,
    where torch took three and two ops."""
    src = src.reshape(-1).contiguous()  # (no copy for the plan's own tensors)
    n = src.numel()
    dst = torch.empty(n + int(lead_zero), dtype=torch.int32, device=src.device)
    launch(_int32_index, (max(1, _cdiv(n, INDEX_BLOCK)),), src, dst, n, divisor, SHIFT=int(lead_zero),
           BLOCK=INDEX_BLOCK)
    return dst


def plan_num_keys(num_experts: int) -> int:
    """Histogram bins: one per expert, one for dropped slots, one for the padding of a block."""
    return _next_pow2(num_experts + 2)


def plan_buffers(num_slots: int, num_experts: int, device):
    if num_slots >= MAX_SLOTS:
        raise ValueError(f"uniep: {num_slots} routed slots; the routing-plan kernels count in int32 (< {MAX_SLOTS})")
    row_order = torch.empty(num_slots, dtype=torch.int64, device=device)
    slot_row = torch.empty(num_slots, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int64, device=device)
    if num_slots == 0:
        offsets.zero_()
    return row_order, slot_row, offsets


def _single_plan(flat_ids, num_experts: int, clamp: bool, plan):
    """The plan of at most PLAN_BLOCK slots by _plan_single, into ``plan``."""
    num_slots = flat_ids.numel()
    launch(_plan_single, (1,), flat_ids, *plan, num_slots, num_experts, CLAMP=clamp,
           BLOCK=max(MIN_SORT_BLOCK, _next_pow2(num_slots)), NUM_KEYS=plan_num_keys(num_experts))
    return plan


def plan_from_histogram(flat_ids, hist, slots_per_block: int, num_experts: int, clamp: bool, plan):
    """Finish a plan whose per-block histograms are computed (by _plan_histogram, or by the router's
    select kernel in the same pass as the ids): the scan and the scatter, or, for one block of at most PLAN_BLOCK
    slots, _plan_single (which counts them again: one launch instead of two). Fills `plan` in place."""
    row_order, slot_row, offsets = plan
    num_blocks, num_keys = hist.shape
    num_slots = flat_ids.numel()
    if num_blocks == 1 and num_slots <= PLAN_BLOCK:  # one block: the single program's plan (its own histogram)
        return _single_plan(flat_ids, num_experts, clamp, plan)
    base = torch.empty_like(hist)
    launch(_plan_scan, (1,), hist, base, offsets, num_blocks, num_experts, NUM_KEYS=num_keys)
    # the sort's lanes: the most slots a block holds (one block of more than PLAN_BLOCK slots, a router's with
    # K >= 17, sorts no more lanes than it has slots; the same permutation)
    block = max(MIN_SORT_BLOCK, _next_pow2(min(slots_per_block, num_slots)))
    launch(_plan_scatter, (num_blocks,), flat_ids, base, row_order, slot_row, num_slots, num_experts,
           slots_per_block, CLAMP=clamp, BLOCK=block, NUM_KEYS=num_keys)
    return plan


def routing_plan(topk_ids: torch.Tensor, num_experts: int, clamp: bool):
    """(row_order, slot_row, expert_offsets), int64, equal to reference.routing_plan's."""
    flat = topk_ids.reshape(-1).contiguous()
    num_slots = flat.numel()
    plan = plan_buffers(num_slots, num_experts, flat.device)
    if num_slots == 0:
        return plan
    if num_slots <= PLAN_BLOCK:  # one block: one launch (a decode step's plan)
        return _single_plan(flat, num_experts, clamp, plan)
    num_keys = plan_num_keys(num_experts)
    num_blocks = _cdiv(num_slots, PLAN_BLOCK)
    hist = torch.empty(num_blocks, num_keys, dtype=torch.int32, device=flat.device)
    launch(_plan_histogram, (num_blocks,), flat, hist, num_slots, num_experts, CLAMP=clamp, BLOCK=PLAN_BLOCK,
           NUM_KEYS=num_keys)
    return plan_from_histogram(flat, hist, PLAN_BLOCK, num_experts, clamp, plan)


RECEIVED_BLOCK_R = 256  # rows a step of a received-plan program


@triton.jit
def _received_plan(counts_ptr, counts_stride, ids_ptr, ones_ptr, row_order_ptr, slot_row_ptr, offsets_ptr, world,
                   local_experts, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program i = s * local_experts + e: the rows received from source s for local expert e (a run of counts[s, e]
    rows, the runs in source-major order). Its rows start at q (the runs before it) and, sorted by expert (stable by
    row), at p (every run of a smaller expert, and expert e's runs from smaller sources)."""
    i = tl.program_id(0)
    s = i // local_experts
    e = i % local_experts
    idx = tl.arange(0, BLOCK_C)
    valid = idx < world * local_experts
    src = idx // local_experts
    exp = idx % local_experts
    c = tl.load(counts_ptr + src * counts_stride + exp, mask=valid, other=0).to(tl.int64)
    q = tl.sum(tl.where(idx < i, c, 0), axis=0)
    p = tl.sum(tl.where(valid & ((exp < e) | ((exp == e) & (src < s))), c, 0), axis=0)
    n = tl.sum(tl.where(idx == i, c, 0), axis=0)
    if s == world - 1:
        tl.store(offsets_ptr + e, p + n)
    expert = tl.zeros([BLOCK_R], dtype=tl.int64) + e
    one = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
    for start in range(0, n, BLOCK_R):
        j = start + tl.arange(0, BLOCK_R)
        mask = j < n
        tl.store(row_order_ptr + p + j, q + j, mask=mask)
        tl.store(slot_row_ptr + q + j, p + j, mask=mask)
        tl.store(ids_ptr + q + j, expert, mask=mask)
        tl.store(ones_ptr + q + j, one.to(ones_ptr.dtype.element_ty), mask=mask)


def received_plan(counts: torch.Tensor, num_rows: int, dtype):
    """The experts op's inputs and routing plan for rows received source by source, each source's rows grouped by local
    expert (an EP layer's received rows): ``counts`` [W, E_local] rows from each source for each local expert (any
    row stride), summing to ``num_rows``. Returns (ids [rows, 1] int64, ones [rows, 1] in ``dtype``, (row_order,
    slot_row, expert_offsets)): the local expert of each row, its routing weight 1, and the same integers as
    routing_plan(ids) (rows sorted by expert, stable by row), in one launch instead of the ids' construction and
    the plan's three."""
    world, local_experts = counts.shape
    device = counts.device
    ids = torch.empty(num_rows, 1, dtype=torch.int64, device=device)
    ones = torch.empty(num_rows, 1, dtype=dtype, device=device)
    plan = plan_buffers(num_rows, local_experts, device)
    if local_experts == 0 or world == 0:
        return ids, ones, plan
    if counts.stride(1) != 1:
        counts = counts.contiguous()
    launch(_received_plan, (world * local_experts,), counts, counts.stride(0), ids, ones, *plan, world, local_experts,
           BLOCK_C=max(16, _next_pow2(world * local_experts)), BLOCK_R=RECEIVED_BLOCK_R)
    return ids, ones, plan


@triton.jit
def _combine(rows_ptr, rows_stride, slot_row_ptr, weights_ptr, offsets_ptr, out_ptr, out_stride, copy_ptr, copy_stride,
             num_tokens, hidden, num_experts, TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, COPY: tl.constexpr,
             BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    ts = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = ts < num_tokens
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    routed_rows = tl.load(offsets_ptr + num_experts - 1)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(slot_row_ptr + ts * TOP_K + k, mask=t_mask, other=0)
        # a dropped slot's row (>= routed_rows) reads nothing
        mask = (t_mask & (row < routed_rows))[:, None] & col_mask[None, :]
        term = tl.load(rows_ptr + row[:, None] * rows_stride + cols[None, :], mask=mask, other=0.0)
        if COPY:  # every routed row is one slot's: each is copied once
            tl.store(copy_ptr + row[:, None] * copy_stride + cols[None, :], term, mask=mask)
        term = term.to(tl.float32)
        if HAS_WEIGHTS:
            term = term * tl.load(weights_ptr + ts * TOP_K + k, mask=t_mask, other=0.0).to(tl.float32)[:, None]
        acc += term
    tl.store(out_ptr + ts[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & col_mask[None, :])


def combine_block_t(top_k: int) -> int:
    """Tokens per combine program: 16 where each token reads one row (the EP exchange's received rows: 386 -> 213 µs
    for 65536 rows of 2048 on an H100, benchmarks/probes/combine_probe.py), else one (Mixtral's K = 2 and
    Qwen3-30B-A3B's K = 8 gained nothing measurable from more). The same arithmetic per element either way: the bits
    do not depend on it."""
    return 16 if top_k == 1 else 1


def combine(rows, slot_row, weights, offsets, num_tokens: int, top_k: int, out_dtype, copy=None) -> torch.Tensor:
    """[T, H] in out_dtype: sum over k (in order, fp32) of the (weighted) expert-sorted rows of each token.
    ``copy`` ([routed rows, H] of rows' dtype, or None) gets a copy of every routed row it reads."""
    hidden = rows.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=rows.device)
    if num_tokens == 0 or hidden == 0:
        return out
    if copy is not None and (copy.dtype != rows.dtype or copy.shape[1] != hidden or copy.stride(1) != 1):
        raise ValueError(f"uniep: combine copies [*, {hidden}] rows of {rows.dtype} into rows of their own dtype")
    weights_arg = weights.contiguous() if weights is not None else rows
    copy_arg = copy if copy is not None and copy.numel() else rows
    block_t = combine_block_t(top_k)
    grid = (_cdiv(num_tokens, block_t), _cdiv(hidden, COMBINE_BLOCK_H))
    launch(_combine, grid, rows, rows.stride(0), slot_row, weights_arg, offsets, out, out.stride(0), copy_arg,
           copy_arg.stride(0), num_tokens, hidden, offsets.numel(), TOP_K=top_k, HAS_WEIGHTS=weights is not None,
           COPY=copy is not None and copy.numel() > 0, BLOCK_T=block_t, BLOCK_H=COMBINE_BLOCK_H)
    return out


@triton.jit
def _routing_weight_grad(grad_ptr, grad_stride, rows_ptr, rows_stride, slot_row_ptr, offsets_ptr, out_ptr, hidden,
                         num_experts, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < TOP_K
    row = tl.load(slot_row_ptr + t * TOP_K + ks, mask=k_mask, other=0)
    routed = k_mask & (row < tl.load(offsets_ptr + num_experts - 1))
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_mask = cols < hidden
        g = tl.load(grad_ptr + t * grad_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = tl.load(rows_ptr + row[:, None] * rows_stride + cols[None, :], mask=routed[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(y * g[None, :], axis=1)
    tl.store(out_ptr + t * TOP_K + ks, acc.to(out_ptr.dtype.element_ty), mask=k_mask)


def routing_weight_grad(grad_out, rows, slot_row, offsets, num_tokens: int, top_k: int, dtype) -> torch.Tensor:
    """[T, K]: <grad_out[t], rows[slot_row[t*K+k]]> in fp32, zero for dropped slots."""
    out = torch.empty(num_tokens, top_k, dtype=dtype, device=rows.device)
    if num_tokens == 0:
        return out
    grad_out = grad_out.contiguous()
    launch(_routing_weight_grad, (num_tokens,), grad_out, grad_out.stride(0), rows, rows.stride(0), slot_row,
           offsets, out, rows.shape[1], offsets.numel(), TOP_K=top_k, BLOCK_K=max(2, _next_pow2(top_k)),
           BLOCK_H=GRAD_W_BLOCK_H)
    return out


GATHER_BLOCK_R, GATHER_BLOCK_C = 16, 256


@triton.jit
def _gather_rows(src_ptr, src_stride, row_order_ptr, weights_ptr, out_ptr, out_stride, num_rows, num_cols, top_k,
                 routed_ptr, SCALE: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if BOUNDED:  # rows past the routed ones (read from the device) are left as they are
        num_rows = tl.minimum(num_rows, tl.load(routed_ptr))
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < num_cols)[None, :]
    slots = tl.load(row_order_ptr + rows, mask=row_mask, other=0)
    vals = tl.load(src_ptr + (slots // top_k)[:, None] * src_stride + cols[None, :], mask=mask, other=0.0)
    if SCALE:
        w = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
        vals = vals.to(tl.float32) * w[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=mask)


def gather_rows(src, row_order, top_k: int, weights=None, out=None, dtype=None, offsets=None) -> torch.Tensor:
    """out[r] = src[row_order[r] // top_k] (times weights[row_order[r]] in fp32, rounded to src's dtype):
    the token rows in expert-sorted order, for GEMMs that read them as plain strided operands. With
    the routing weights this is bit for bit what the fused gather computes in a GEMM prologue
    (A_SCALE / Q_SCALE). ``out``: a contiguous [rows, cols] buffer of src's dtype to write into. ``dtype``: round to
    that dtype instead (for fp32 ``src``, the bits of the gather followed by ``.to(dtype)``, without the fp32 rows).
    ``offsets``: the plan's expert offsets (device): only the routed rows (before the last offset) are gathered,
    for GEMMs that read no other row; the rest of ``out`` is left as it was (an EP layer's receive buffer is sized
    for the most rows it could receive, and holds far fewer)."""
    num_rows, num_cols = row_order.numel(), src.shape[1]
    dtype = dtype or src.dtype
    if out is None or out.dtype != dtype or tuple(out.shape) != (num_rows, num_cols) or not out.is_contiguous():
        out = torch.empty(num_rows, num_cols, dtype=dtype, device=src.device)
    if num_rows == 0 or num_cols == 0:
        return out
    if src.stride(1) != 1:
        src = src.contiguous()
    grid = (_cdiv(num_rows, GATHER_BLOCK_R), _cdiv(num_cols, GATHER_BLOCK_C))
    bounded = offsets is not None and offsets.numel() > 0
    launch(_gather_rows, grid, src, src.stride(0), row_order, weights if weights is not None else src, out,
           out.stride(0), num_rows, num_cols, top_k, offsets[-1:] if bounded else row_order, SCALE=weights is not None,
           BOUNDED=bounded, BLOCK_R=GATHER_BLOCK_R, BLOCK_C=GATHER_BLOCK_C)
    return out
