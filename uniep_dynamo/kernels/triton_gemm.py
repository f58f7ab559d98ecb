"""Triton grouped GEMMs of the MegaKernel, with the gather in the prologue and the activation in the epilogue.

Two kernels serve the six GEMMs of an MoE layer's forward and backward.

``_rows_gemm`` -- out[r, n] = sum_k A[a_row(r), k] * W[e(r)][k, n] for the expert-sorted rows r.
    Tiles: [BLOCK_M rows of one expert] x [BLOCK_N columns]; tile (m, n) -> expert by a prefix sum of
    cdiv(count_e, BLOCK_M) over the expert offsets, computed in each program from the routing plan
    (nothing on the host, no padding of the rows). With GATHER (config.fuse_gather), a_row(r) =
    row_order[r] // TOP_K: the token rows are read straight from the hidden states or the output
    gradient, so the dispatch never materialises a permuted copy (measured slower on Hopper for the
    weight gradients, hence not the default); with A_SCALE each gathered row is multiplied by its routing
    weight and rounded to the storage dtype first. Epilogues:
      STORE     out = acc (+ bias[e]), cast to the output dtype (down projection, input gradient); with
                SCATTER each row goes to a peer rank's buffer instead (the EP layer's push of its results,
                fused: a per-row table names the peer and the row there)
      GLU_FWD   gate and up halves in two accumulators, or (PACKED) one accumulator over a weight tile
                that holds a gate block and its up block side by side, split in the epilogue -- the
                same MMA chain per element either way; h = acc (+ bias) rounded to the storage dtype
                is stored (saved for backward) and act(h) is stored for the down projection
``_weight_grad_gemm`` -- G[e][m, n] = sum over expert e's rows r (in row order) of P[p_row(r), m] *
    Q[q_row(r), n], optionally Q scaled by the routing weight; bias gradient = column sums of Q as a
    GEMM against ones (the same MMA chain, so it follows the same numerics contract). Experts with no
    rows get exact zeros.
``_act_forward`` -- the GLU_FWD epilogue's activation as an element-wise pass over the routed rows of h (after
    an up projection that ran as torch._grouped_mm): act(h) from the rounded h, as the epilogue computes it.
``_act_backward`` -- the element-wise activation backward over the routed rows (the default path,
    after a STORE GEMM of the activation gradient): d_h from the rounded d_act and h; act(h) in place or into a buffer of its own.
``_act_backward_late_weight`` -- the same under config.late_routing_weight, where the activation-gradient GEMM read
    the unweighted output-gradient rows: d_act = w * (the GEMM's rounded output), rounded, for the activation
    backward, w * act (rounded) stored for the down weight's gradient, and each tile's part of the routing weight's
    gradient <GEMM output, act>, which ``_sum_weight_grad_parts`` adds up in column order (no atomics).

Numerics: fp32 accumulation in tensor-core MMAs; the reduction dimension is walked in BLOCK_K chunks
in order, with no split across programs and no atomics. Element-wise epilogue math in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_transfer import _peer

STORE, GLU_FWD = 0, 1
# Activation codes (gate_program.classify names).
ACTIVATIONS = {"silu_glu": 0, "gelu_glu": 1, "gelu_tanh_glu": 2, "relu2": 3, "clamped_swiglu": 4}
GATED = {"silu_glu", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu"}


@triton.jit
def _tile_schedule(offsets_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, LEAD: tl.constexpr = False):
    """Per expert: first row, row count, and the exclusive prefix sum of its row tiles. With LEAD, offsets_ptr[-1]
    is the first expert's first row (a view of a longer offsets tensor: a run of experts whose rows start past 0)."""
    e = tl.arange(0, BLOCK_E)
    in_range = e < num_experts
    ends = tl.load(offsets_ptr + e, mask=in_range, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=in_range & ((e > 0) | LEAD), other=0)
    counts = tl.where(in_range, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    return e, starts, ends, tiles, tile_end


@triton.jit
def _activation(g, u, ACT: tl.constexpr, alpha, limit, up_add):
    """act(gate, up) in fp32; for relu2 (no gate) both arguments are the whole projection."""
    if ACT == 0:
        return g * tl.sigmoid(g) * u
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        return 0.5 * g * (1.0 + t) * u
    elif ACT == 3:
        r = tl.maximum(g, 0.0)
        return r * r
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return (uc + up_add) * gc * tl.sigmoid(gc * alpha)


@triton.jit
def _activation_grad(g, u, d, ACT: tl.constexpr, alpha, limit, up_add):
    """(d_gate, d_up) for d = d(act); for relu2 (no gate) d_up is unused. A clamp passes the gradient
    where its input lies inside [min, max], bounds included (torch.clamp's rule)."""
    if ACT == 0:
        s = tl.sigmoid(g)
        return d * u * s * (1.0 + g * (1.0 - s)), d * g * s
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * g * g)
        return d * u * (cdf + g * pdf), d * 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        dinner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        return d * u * (0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * dinner), d * 0.5 * g * (1.0 + t)
    elif ACT == 3:
        return d * 2.0 * tl.maximum(g, 0.0), d
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(gc * alpha)
        d_gc = d * (uc + up_add) * (s + alpha * gc * s * (1.0 - s))
        d_uc = d * gc * s
        return tl.where(g <= limit, d_gc, 0.0), tl.where((u >= -limit) & (u <= limit), d_uc, 0.0)


@triton.jit
def _pair_columns(cols, row_ok, N):
    """Where h interleaves gate and up (gate j at column 2j, up j at 2j + 1), the [1, 2C] columns of the activation
    columns ``cols`` (``program_id(1) * C + arange(C)``, as every caller tiles them) as one contiguous run, and their
    [R, 2C] mask from ``row_ok`` [R, 1] and the activation width N: a row's pairs are loaded and stored whole, in
    16-byte vectors. (Two accesses to every other element touch every sector of the run twice; a mask built from the
    [R, C] one by join and reshape hides its runs from Triton's analysis, which then loads one element at a time.)"""
    C: tl.constexpr = cols.shape[0]
    flat = tl.program_id(1) * (2 * C) + tl.arange(0, 2 * C)
    return flat[None, :], row_ok & (flat < 2 * N)[None, :]


@triton.jit
def _load_halves(h_ptr, stride_hm, rows64, cols, row_ok, N, UP_SHIFT, COL_MULT: tl.constexpr,
                 TWO_HALVES: tl.constexpr):
    """The gate and up values (fp32) of activation columns ``cols`` (< N) of the stored h rows ``rows64`` ([R, 1]
    int64; ``row_ok`` [R, 1] the rows to read); without a gate both are the whole projection. COL_MULT == 2 is the
    interleaved layout (UP_SHIFT 1)."""
    if TWO_HALVES and COL_MULT == 2:
        flat, pair_mask = _pair_columns(cols, row_ok, N)
        pairs = tl.load(h_ptr + rows64 * stride_hm + flat, mask=pair_mask, other=0.0).to(tl.float32)
        g, u = tl.split(tl.reshape(pairs, [rows64.shape[0], cols.shape[0], 2]))
    else:
        mask = row_ok & (cols < N)[None, :]
        gate_cols = cols * COL_MULT
        g = tl.load(h_ptr + rows64 * stride_hm + gate_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if TWO_HALVES:
            u = tl.load(h_ptr + rows64 * stride_hm + (gate_cols + UP_SHIFT)[None, :], mask=mask,
                        other=0.0).to(tl.float32)
        else:
            u = g
    return g, u


@triton.jit
def _store_halves(d_h_ptr, stride_gm, rows64, cols, row_ok, N, d_gate, d_up, UP_SHIFT, COL_MULT: tl.constexpr,
                  TWO_HALVES: tl.constexpr):
    """d_h's gate and up values of activation columns ``cols`` (rounded to d_h's dtype), as _load_halves reads h."""
    dtype = d_h_ptr.dtype.element_ty
    if TWO_HALVES and COL_MULT == 2:
        flat, pair_mask = _pair_columns(cols, row_ok, N)
        pairs = tl.reshape(tl.join(d_gate.to(dtype), d_up.to(dtype)), [rows64.shape[0], 2 * cols.shape[0]])
        tl.store(d_h_ptr + rows64 * stride_gm + flat, pairs, mask=pair_mask)
    else:
        mask = row_ok & (cols < N)[None, :]
        gate_cols = cols * COL_MULT
        tl.store(d_h_ptr + rows64 * stride_gm + gate_cols[None, :], d_gate.to(dtype), mask=mask)
        if TWO_HALVES:
            tl.store(d_h_ptr + rows64 * stride_gm + (gate_cols + UP_SHIFT)[None, :], d_up.to(dtype), mask=mask)


@triton.jit
def _act_backward_tile(d_act, rows64, cols, mask, row_ok, N, h_ptr, stride_hm, d_h_ptr, stride_gm, act_ptr,
                       stride_am, UP_SHIFT, COL_MULT: tl.constexpr, TWO_HALVES: tl.constexpr, ACT: tl.constexpr,
                       act_alpha, act_limit, act_up_add):
    """One tile of the activation backward: d_act (fp32, [rows, cols]) and the saved h of those rows
    -> d_h (both halves) and act(h). ``rows64`` is a [R, 1] column of int64 row indices. Each element
    of h is read before the same element of d_h is written, so d_h may be h itself. ``mask`` is ``row_ok`` [R, 1]
    and the columns below N."""
    g, u = _load_halves(h_ptr, stride_hm, rows64, cols, row_ok, N, UP_SHIFT, COL_MULT, TWO_HALVES)
    d_gate, d_up = _activation_grad(g, u, d_act, ACT, act_alpha, act_limit, act_up_add)
    _store_halves(d_h_ptr, stride_gm, rows64, cols, row_ok, N, d_gate, d_up, UP_SHIFT, COL_MULT, TWO_HALVES)
    act = _activation(g, u, ACT, act_alpha, act_limit, act_up_add)
    tl.store(act_ptr + rows64 * stride_am + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_gemm(
    a_ptr, stride_am, stride_ak, row_order_ptr, top_k,
    b_ptr, stride_be, stride_bk, stride_bn,
    bias_ptr, stride_bias_e,
    offsets_ptr, num_experts, N, K,
    c_ptr, stride_cm, d_ptr, stride_dm, w_ptr,
    UP_SHIFT, COL_MULT: tl.constexpr, act_alpha, act_limit, act_up_add,
    GATHER: tl.constexpr, A_SCALE: tl.constexpr, EPILOGUE: tl.constexpr, ACT: tl.constexpr, TWO_HALVES: tl.constexpr, TWO_ACC: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, num_programs,
    a_desc=None, b_desc=None, b_expert_rows=0,
    TMA_A: tl.constexpr = False, TMA_B: tl.constexpr = False, B_KMAJOR: tl.constexpr = False,
    FLATTEN: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
    dst_ptr=None, q0=None, q1=None, q2=None, q3=None, q4=None, q5=None, q6=None, q7=None,
    SCATTER: tl.constexpr = False, LEAD: tl.constexpr = False,
):
    e_idx, starts, ends, tiles, tile_end = _tile_schedule(offsets_ptr, num_experts, BLOCK_M, BLOCK_E, LEAD)
    total_m = tl.sum(tiles)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = total_m * num_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        # Group-M swizzle: GROUP_M row tiles walk the column tiles together (weight tiles stay in L2).
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        group_size = tl.minimum(total_m - first_m, GROUP_M)
        tm = first_m + (tile % per_group) % group_size
        tn = (tile % per_group) // group_size
        expert = tl.sum((tile_end <= tm).to(tl.int32))
        is_e = e_idx == expert
        row_start = tl.sum(tl.where(is_e, starts + (tm - (tile_end - tiles)) * BLOCK_M, 0))
        row_end = tl.sum(tl.where(is_e, ends, 0))
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        if GATHER:
            a_slots = tl.load(row_order_ptr + rows, mask=row_mask, other=0)
            a_rows = a_slots // top_k
            if A_SCALE:
                a_scale = tl.load(w_ptr + a_slots, mask=row_mask, other=0.0).to(tl.float32)
        else:
            a_rows = rows.to(tl.int64)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk
        if PACKED:
            # One [BLOCK_K, 2*BLOCK_N] weight tile: the gate columns of this tile, then its up columns.
            j = tl.arange(0, 2 * BLOCK_N)
            packed_cols = tn * BLOCK_N + j % BLOCK_N
            packed_mask = packed_cols < N
            b_cols = packed_cols * COL_MULT + tl.where(j >= BLOCK_N, UP_SHIFT, 0)
            b_ptrs = b_base + b_cols[None, :] * stride_bn
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        else:
            if EPILOGUE == 1:
                b_ptrs = b_base + (cols * COL_MULT)[None, :] * stride_bn
            else:
                b_ptrs = b_base + cols[None, :] * stride_bn
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if TWO_ACC:
            b2_ptrs = b_base + (cols * COL_MULT + UP_SHIFT)[None, :] * stride_bn
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # TMA_B: the weight's 2-D view stacks the experts' rows (descriptor coordinates are int32)
        b_row0 = expert.to(tl.int32) * b_expert_rows
        b_col0 = (tn * BLOCK_N * COL_MULT).to(tl.int32)
        for k0 in range(0, K, BLOCK_K):
            if PACKED:
                b_col_mask = packed_mask
            else:
                b_col_mask = col_mask
            if TMA_A or TMA_B:
                # Bulk tensor copies (EVEN_K only). Rows past this expert's end and columns past N come
                # from the next expert's rows or the tensor's zero fill and land only in masked outputs.
                if TMA_A:
                    a = a_desc.load([row_start.to(tl.int32), k0])
                else:
                    a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                if TMA_B:
                    if B_KMAJOR:
                        b = tl.trans(b_desc.load([b_row0 + b_col0, k0]))
                    else:
                        b = b_desc.load([b_row0 + k0, b_col0])
                else:
                    b = tl.load(b_ptrs, mask=b_col_mask[None, :], other=0.0)
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=b_col_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < K - k0
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & b_col_mask[None, :], other=0.0)
            if A_SCALE:
                # Gathered output-gradient rows times their routing weight, rounded to the storage
                # dtype: the same values the unfused path materialises (triton_routing.gather_rows).
                a = (a.to(tl.float32) * a_scale[:, None]).to(a_ptr.dtype.element_ty)
            acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
            if TWO_ACC:
                if TMA_B:
                    if B_KMAJOR:
                        b2 = tl.trans(b_desc.load([b_row0 + b_col0 + UP_SHIFT, k0]))
                    else:
                        b2 = b_desc.load([b_row0 + k0, b_col0 + UP_SHIFT])
                elif EVEN_K:
                    b2 = tl.load(b2_ptrs, mask=col_mask[None, :], other=0.0)
                else:
                    b2 = tl.load(b2_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc2 = tl.dot(a.to(b2.dtype), b2, acc2, input_precision=DOT_PRECISION)
                b2_ptrs += BLOCK_K * stride_bk
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        if EPILOGUE == 0:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if SCATTER:
                # each row to its peer's buffer: dst = (row there) * 8 + peer (the EP layer's push, fused)
                dst = tl.load(dst_ptr + rows, mask=row_mask, other=0)
                base = _peer((dst & 7).to(tl.int32), q0, q1, q2, q3, q4, q5, q6, q7)
                tl.store(base[:, None] + (dst >> 3)[:, None] * stride_cm + cols[None, :],
                         acc.to(q0.dtype.element_ty), mask=mask)
            else:
                tl.store(c_ptr + rows64[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                         mask=mask)
        else:
            if PACKED:
                halves = tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1))
                acc, acc2 = tl.split(halves)
            gate_cols = cols * COL_MULT
            if HAS_BIAS:
                acc += tl.load(bias_ptr + expert * stride_bias_e + gate_cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            h_gate = acc.to(c_ptr.dtype.element_ty)
            tl.store(c_ptr + rows64[:, None] * stride_cm + gate_cols[None, :], h_gate, mask=mask)
            if TWO_HALVES:
                up_cols = gate_cols + UP_SHIFT
                if HAS_BIAS:
                    acc2 += tl.load(bias_ptr + expert * stride_bias_e + up_cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                h_up = acc2.to(c_ptr.dtype.element_ty)
                tl.store(c_ptr + rows64[:, None] * stride_cm + up_cols[None, :], h_up, mask=mask)
                act = _activation(h_gate.to(tl.float32), h_up.to(tl.float32), ACT, act_alpha, act_limit, act_up_add)
            else:
                act = _activation(h_gate.to(tl.float32), h_gate.to(tl.float32), ACT, act_alpha, act_limit, act_up_add)
            tl.store(d_ptr + rows64[:, None] * stride_dm + cols[None, :], act.to(d_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weight_grad_gemm(
    p_ptr, stride_pr, stride_pm, q_ptr, stride_qr, stride_qn, row_order_ptr, w_ptr, top_k,
    offsets_ptr, num_experts, M, N,
    g_ptr, stride_ge, stride_gm, stride_gn, bias_ptr, stride_bias_e,
    P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, Q_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, num_programs,
    p_desc=None, q_desc=None, TMA: tl.constexpr = False,
    FLATTEN: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    offs_r = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_experts * per_expert, num_programs, flatten=FLATTEN,
                         warp_specialize=WARP_SPEC):
        expert = tile // per_expert
        local = tile % per_expert
        per_group = GROUP_M * num_n
        first_m = (local // per_group) * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        tm = first_m + (local % per_group) % group_size
        tn = (local % per_group) // group_size
        lo = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
        hi = tl.load(offsets_ptr + expert)
        offs_m = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        bias_acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        r_start = lo
        if TMA:
            # Whole BLOCK_K-row chunks of this expert by bulk tensor copies (P and Q neither gathered nor
            # scaled); the last partial chunk below by masked loads. The same chunks in the same order.
            r_full = lo + (hi - lo) // BLOCK_K * BLOCK_K
            m0 = (tm * BLOCK_M).to(tl.int32)
            n0 = (tn * BLOCK_N).to(tl.int32)
            for r0 in range(lo.to(tl.int32), r_full.to(tl.int32), BLOCK_K):
                p = p_desc.load([r0, m0])
                q = q_desc.load([r0, n0])
                acc = tl.dot(tl.trans(p), q.to(p.dtype), acc, input_precision=DOT_PRECISION)
                if HAS_BIAS:
                    if tm == 0:
                        ones = tl.full([16, BLOCK_K], 1.0, dtype=p.dtype)
                        bias_acc = tl.dot(ones, q.to(p.dtype), bias_acc, input_precision=DOT_PRECISION)
            r_start = r_full
        for r0 in range(r_start, hi, BLOCK_K):
            rows = r0 + offs_r
            r_mask = rows < hi
            if P_GATHER or Q_GATHER or Q_SCALE:
                slots = tl.load(row_order_ptr + rows, mask=r_mask, other=0)
            if P_GATHER:
                p_rows = slots // top_k
            else:
                p_rows = rows
            if Q_GATHER:
                q_rows = slots // top_k
            else:
                q_rows = rows
            p = tl.load(p_ptr + p_rows[:, None] * stride_pr + offs_m[None, :] * stride_pm,
                        mask=r_mask[:, None] & m_mask[None, :], other=0.0)
            q = tl.load(q_ptr + q_rows[:, None] * stride_qr + offs_n[None, :] * stride_qn,
                        mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            if Q_SCALE:
                w = tl.load(w_ptr + slots, mask=r_mask, other=0.0).to(tl.float32)
                q = (q.to(tl.float32) * w[:, None]).to(q_ptr.dtype.element_ty)
            # P's dtype is the weight's (the caller makes it so).
            acc = tl.dot(tl.trans(p), q.to(p.dtype), acc, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                if tm == 0:
                    ones = tl.full([16, BLOCK_K], 1.0, dtype=p.dtype)
                    bias_acc = tl.dot(ones, q.to(p.dtype), bias_acc, input_precision=DOT_PRECISION)
        g_ptrs = g_ptr + expert.to(tl.int64) * stride_ge + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn
        tl.store(g_ptrs, acc.to(g_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
        if HAS_BIAS:
            col_sum = tl.sum(tl.where(tl.arange(0, 16)[:, None] == 0, bias_acc, 0.0), axis=0)
            tl.store(bias_ptr + expert * stride_bias_e + offs_n, col_sum.to(bias_ptr.dtype.element_ty),
                     mask=n_mask & ((offs_n * 0 + tm) == 0))


@triton.jit
def _act_backward(d_act_ptr, stride_dm, h_ptr, stride_hm, d_h_ptr, stride_gm, act_ptr, stride_am, offsets_ptr,
                  num_experts, N, UP_SHIFT, COL_MULT: tl.constexpr, TWO_HALVES: tl.constexpr, ACT: tl.constexpr,
                  act_alpha, act_limit, act_up_add, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Activation backward over the routed rows, element-wise: reads d_act (the activation-gradient
    GEMM's rounded output) and h, writes d_h (both halves) and act(h) (into d_act itself when act_ptr is
    d_act_ptr: each element is read before it is written)."""
    routed_rows = tl.load(offsets_ptr + num_experts - 1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = (rows < routed_rows)[:, None]
    mask = row_ok & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    d = tl.load(d_act_ptr + rows64 * stride_dm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    _act_backward_tile(d, rows64, cols, mask, row_ok, N, h_ptr, stride_hm, d_h_ptr, stride_gm, act_ptr, stride_am,
                       UP_SHIFT, COL_MULT, TWO_HALVES, ACT, act_alpha, act_limit, act_up_add)


@triton.jit
def _act_backward_late_weight(d_raw_ptr, stride_dm, h_ptr, stride_hm, d_h_ptr, stride_gm, row_order_ptr, w_ptr,
                              part_ptr, offsets_ptr, num_experts, num_rows, N, UP_SHIFT, COL_MULT: tl.constexpr,
                              TWO_HALVES: tl.constexpr, ACT: tl.constexpr, act_alpha, act_limit, act_up_add,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Activation backward with the routing weight applied after the activation-gradient GEMM, element-wise over
    [BLOCK_R, BLOCK_C] tiles: reads that GEMM's rounded output g (the unweighted output gradient times W_down^T) and h;
    writes d_h (both halves) from d_act = w * g rounded to the storage dtype, and w * act(h) (act rounded as the
    forward stored it, the product rounded) over g in place. Each tile's part of the routing weight's gradient
    <g, act> (an fp32 sum over its columns; zero for rows past the routed ones) goes to part[column tile, row], which
    _sum_weight_grad_parts adds in column order. Each element of g and h is read before it is written."""
    routed_rows = tl.load(offsets_ptr + num_experts - 1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows = rows < num_rows
    routed = rows < routed_rows
    mask = routed[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    slots = tl.load(row_order_ptr + rows, mask=routed, other=0)
    w = tl.load(w_ptr + slots, mask=routed, other=0.0).to(tl.float32)[:, None]
    dtype = d_raw_ptr.dtype.element_ty
    g_out = tl.load(d_raw_ptr + rows64 * stride_dm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g, u = _load_halves(h_ptr, stride_hm, rows64, cols, routed[:, None], N, UP_SHIFT, COL_MULT, TWO_HALVES)
    act = _activation(g, u, ACT, act_alpha, act_limit, act_up_add).to(dtype).to(tl.float32)
    tl.store(part_ptr + tl.program_id(1).to(tl.int64) * num_rows + rows, tl.sum(g_out * act, axis=1), mask=in_rows)
    d_act = (g_out * w).to(dtype).to(tl.float32)
    d_gate, d_up = _activation_grad(g, u, d_act, ACT, act_alpha, act_limit, act_up_add)
    _store_halves(d_h_ptr, stride_gm, rows64, cols, routed[:, None], N, d_gate, d_up, UP_SHIFT, COL_MULT, TWO_HALVES)
    tl.store(d_raw_ptr + rows64 * stride_dm + cols[None, :], (act * w).to(dtype), mask=mask)


@triton.jit
def _sum_weight_grad_parts(part_ptr, row_order_ptr, d_w_ptr, num_rows, num_parts, BLOCK_R: tl.constexpr):
    """d_w[slot of row r] = the sum of part[0..num_parts-1, r] in that order (fp32): every slot written once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < num_rows
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for p in range(0, num_parts):
        acc += tl.load(part_ptr + p * num_rows + rows, mask=in_rows, other=0.0)
    slots = tl.load(row_order_ptr + rows, mask=in_rows, other=0)
    tl.store(d_w_ptr + slots, acc.to(d_w_ptr.dtype.element_ty), mask=in_rows)


@triton.jit
def _act_forward(h_ptr, stride_hm, act_ptr, stride_am, offsets_ptr, num_experts, N,
                 UP_SHIFT, COL_MULT: tl.constexpr, TWO_HALVES: tl.constexpr, ACT: tl.constexpr,
                 act_alpha, act_limit, act_up_add, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 LEAD: tl.constexpr = False):
    """act(h) over the routed rows, element-wise, from the stored (rounded) h: the GLU_FWD epilogue's values. With
    LEAD the rows from offsets_ptr[-1] on (a run of experts past row 0, as _tile_schedule's LEAD)."""
    routed_rows = tl.load(offsets_ptr + num_experts - 1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if LEAD:
        row_ok = ((rows < routed_rows) & (rows >= tl.load(offsets_ptr - 1)))[:, None]
    else:
        row_ok = (rows < routed_rows)[:, None]
    mask = row_ok & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    g, u = _load_halves(h_ptr, stride_hm, rows64, cols, row_ok, N, UP_SHIFT, COL_MULT, TWO_HALVES)
    act = _activation(g, u, ACT, act_alpha, act_limit, act_up_add)
    tl.store(act_ptr + rows64 * stride_am + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=mask)
