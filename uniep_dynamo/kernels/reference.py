"""Pure-PyTorch reference of the uniep experts op: the oracle for every test and the CPU path.

Data flow (S = T*K routed slots, slot s = t*K + k):

    routing plan   row_order[r]  = slot of expert-sorted row r, stable by (expert, token, k)
                   slot_row[s]   = row of slot s (inverse permutation)
                   expert_offsets[e] = end row of expert e (cumulative counts)
    forward        x_rows = hidden[row_order // K]
                   up     = x_rows @ W_up[e]   (+ b_up[e])        grouped GEMM over row blocks
                   act    = gate_program(up)                       element-wise
                   down   = act @ W_down[e] (+ b_down[e])          grouped GEMM
                   out[t] = sum_k w[t,k] * down[slot_row[t*K+k]]   fp32, k in order 0..K-1
    backward       the same plan; d_down rows from grad_out * w; d_w from <grad_out, down>;
                   weight and bias gradients are per-expert GEMMs over each expert's rows in row order;
                   d_hidden[t] = sum_k d_x_rows[slot_row[t*K+k]] in fp32, k in order.

Numerics: GEMMs accumulate in fp32 (torch.mm / torch._grouped_mm); the combine and the token
gradient sum the K partials in fp32 in k order. Nothing here uses index_add_, scatter_add or
index_put(accumulate=True): every write has a unique destination, so results are bitwise
reproducible run to run.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from . import gate_program

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def routing_plan(topk_ids: torch.Tensor, num_experts: int):
    """(row_order, slot_row, expert_offsets) for a [T, K] tensor of expert ids.

    Slots whose id lies outside [0, E) sort after every expert's rows (past expert_offsets[-1]); the
    grouped GEMMs never read them and the op zeroes them ("drop")."""
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    # A stable sort of the expert id keeps (token, k) order inside each expert: slot s = t*K + k.
    sorted_key, row_order = torch.sort(key, stable=True)
    slot_row = inverse_permutation(row_order)
    # offsets[e] = number of rows with key <= e, read off the sorted keys: no atomics, and unlike
    # bincount no device-to-host copy of the largest id.
    experts = torch.arange(num_experts, device=key.device, dtype=key.dtype)
    expert_offsets = torch.searchsorted(sorted_key, experts, right=True)
    return row_order, slot_row, expert_offsets


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """q with q[perm[i]] = i (row_order from slot_row and back); every index written once, so deterministic."""
    out = torch.empty_like(perm)
    out[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return out


def routed_rows_mask(expert_offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 1] bool: True for rows that belong to an expert (False for dropped out-of-range slots)."""
    total = expert_offsets[-1:] if expert_offsets.numel() else expert_offsets.new_zeros(1)
    return (torch.arange(rows, device=expert_offsets.device) < total).unsqueeze(-1)


def _use_grouped_mm(a: torch.Tensor, w: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _host_bounds(expert_offsets: torch.Tensor) -> list[int]:
    return [0] + expert_offsets.tolist()


def grouped_mm(rows: torch.Tensor, w_eff: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """rows [R, in] sorted by expert; w_eff [E, in, out] (any strides) -> [R, out]."""
    if rows.shape[0] > 0 and _use_grouped_mm(rows, w_eff):
        return torch._grouped_mm(rows, w_eff, offs=expert_offsets.to(torch.int32))
    out = rows.new_zeros(rows.shape[0], w_eff.shape[-1])
    bounds = _host_bounds(expert_offsets)
    for e in range(w_eff.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = rows[lo:hi] @ w_eff[e]
    return out


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """Per expert e: a[rows of e]^T @ b[rows of e] -> [E, a.cols, b.cols]; zero for experts without rows."""
    num_experts = expert_offsets.shape[0]
    if a.shape[0] > 0 and _use_grouped_mm(a, b):
        # torch._grouped_mm writes an exact zero for a group with no rows (a K=0 GEMM); the GPU test
        # test_idle_experts_get_exact_zero_weight_grads holds it to that, with a poisoned allocator.
        return torch._grouped_mm(a.t(), b, offs=expert_offsets.to(torch.int32))
    out = a.new_zeros(num_experts, a.shape[1], b.shape[1])
    bounds = _host_bounds(expert_offsets)
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[e] = a[lo:hi].t() @ b[lo:hi]
    return out


def weight_grad(inputs: torch.Tensor, d_outputs: torch.Tensor, layout: str, expert_offsets: torch.Tensor):
    """Gradient of an expert weight in its stored layout, with no transpose copy: [E, out, in] ("oi")
    is d_out^T @ in per expert, [E, in, out] ("io") is in^T @ d_out."""
    if layout == "oi":
        return grouped_weight_grad(d_outputs, inputs, expert_offsets)
    return grouped_weight_grad(inputs, d_outputs, expert_offsets)


def effective_weight(w: torch.Tensor, layout: str) -> torch.Tensor:
    """The [E, in, out] view of an expert weight stored as [E, out, in] ("oi") or [E, in, out] ("io")."""
    return w.transpose(-2, -1) if layout == "oi" else w


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/fp16/bf16; fp64 stays fp64 (the tests' float64 oracle)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def combine_k_in_order(slot_values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """slot_values [T, K, H] -> [T, H] in fp32: sum over k in order 0..K-1, each term optionally weighted."""
    acc_dtype = accumulation_dtype(slot_values)
    acc = None
    for k in range(slot_values.shape[1]):
        term = slot_values[:, k].to(acc_dtype)
        if weights is not None:
            term = term * weights[:, k : k + 1].to(acc_dtype)
        acc = term if acc is None else acc + term
    if acc is None:
        return slot_values.new_zeros(slot_values.shape[0], slot_values.shape[2], dtype=acc_dtype)
    return acc


# -- element-wise glue between the GEMMs ----------------------------------------------------------
# Plain torch functions: eager on CPU (the oracle), fused by inductor on CUDA, where a chain of
# separate element-wise kernels would cost more than the GEMMs of a small-expert model. Same ops,
# same k order either way; no reduction here uses atomics.

def combine_slots(rows, slot_row, routed, weights, num_tokens: int, top_k: int, out_dtype):
    """out[t] = sum_k w[t,k] * rows[slot_row[t*K+k]] (fp32, k in order); unrouted rows count as zero."""
    rows = rows.masked_fill(~routed, 0)
    slot_values = rows[slot_row].view(num_tokens, top_k, rows.shape[-1])
    return combine_k_in_order(slot_values, weights).to(out_dtype)


def slot_grads(grad_out, down, slot_row, row_order, routed, weights):
    """(d_weights [T,K], d_down [rows,H] in expert-sorted order) from the combine's output gradient."""
    num_tokens, top_k = weights.shape
    hidden_size = down.shape[-1]
    acc_dtype = accumulation_dtype(down)
    g = grad_out.to(acc_dtype).unsqueeze(1)
    slot_down = down.masked_fill(~routed, 0)[slot_row].view(num_tokens, top_k, hidden_size).to(acc_dtype)
    # d w[t,k] = <grad_out[t], down[t,k]>, one fp32 reduction over H per slot.
    d_weights = (g * slot_down).sum(-1).to(weights.dtype)
    d_down_slots = (g * weights.to(acc_dtype).unsqueeze(-1)).to(down.dtype)
    d_down = d_down_slots.reshape(-1, hidden_size)[row_order].masked_fill(~routed, 0)
    return d_weights, d_down


def _gate_functions(program: str):
    """(forward, backward) of one gate program, closed over its decoded form so torch.compile sees
    the program as constants. backward returns (act, d_up, d_operands): the value and the
    vector-Jacobian products, from torch.func since autograd's own dispatch is below us inside a
    custom op."""
    split, expr = gate_program.decode(program)

    def gate_forward(up, *operands):
        return gate_program.apply_decoded(split, expr, up, operands)

    def gate_backward(up, d_act, *operands):
        act, vjp = torch.func.vjp(gate_forward, up, *operands)
        d_up, *d_operands = vjp(d_act.to(act.dtype))
        return act, d_up, d_operands

    return gate_forward, gate_backward


def _post_functions(program: str):
    """(forward, backward) of a post program. backward runs the post program forward again, takes
    the slot gradients of its output, and pulls them back to the down rows and the operands."""
    _split, expr = gate_program.decode(program)

    def post_forward(down, *operands):
        return gate_program.apply_post(expr, down, operands)

    def post_backward(down, operands, grad_out, slot_row, row_order, routed, weights):
        rows, vjp = torch.func.vjp(post_forward, down, *operands)
        d_weights, d_rows = slot_grads(grad_out, rows, slot_row, row_order, routed, weights)
        d_down, *d_operands = vjp(d_rows.to(rows.dtype))
        return rows, (d_weights, d_down.masked_fill(~routed, 0)), d_operands

    return post_forward, post_backward


_GLUE = {"combine": combine_slots, "slot_grads": slot_grads}
_COMPILED_GLUE: dict = {}


def _compile_glue_on(device: torch.device) -> bool:
    """Glue is compiled by inductor on CUDA. UNIEP_COMPILE_GLUE=0 turns that off, =always turns it on
    for every device (the tests use it on CPU)."""
    mode = os.environ.get("UNIEP_COMPILE_GLUE", "1")
    return mode != "0" and (device.type == "cuda" or mode == "always")


def glue(name: str, device: torch.device):
    """The glue function `name`, compiled where _compile_glue_on says so."""
    if not _compile_glue_on(device):
        return _GLUE[name]
    if name not in _COMPILED_GLUE:
        _COMPILED_GLUE[name] = torch.compile(_GLUE[name], fullgraph=True, dynamic=None)
    return _COMPILED_GLUE[name]


# functorch's dispatch keys. A Python dispatch handler that runs an op (a TorchDispatchMode's __torch_dispatch__:
# AOT autograd's custom-op aliasing check on a compiled graph's first call, which compiled autograd makes of every
# backward, or a user's FlopCounterMode) runs it with every key above the Python key excluded, functorch's among
# them. torch.func.vjp's wrapped tensors then reach the CPU kernel ("Cannot access storage of TensorWrapper").
_FUNCTORCH_KEYS = functools.reduce(
    lambda a, b: a | b, (torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, k)) for k in (
        "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode", "FuncTorchGradWrapper",
        "FuncTorchBatched", "FuncTorchVmapMode")))


@contextlib.contextmanager
def functorch_dispatch():
    """torch.func usable inside a custom op's kernel: functorch's keys taken out of the thread's excluded keys (they
    are excluded there only under a Python dispatch handler), everything else as it is."""
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    if not exclude.has(torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode):
        yield
        return
    with torch._C._ForceDispatchKeyGuard(include, exclude - _FUNCTORCH_KEYS):
        yield


def _with_functorch(backward):
    @functools.wraps(backward)
    def run(*args):
        with functorch_dispatch():
            return backward(*args)
    return run


def _program_glue(program: str, device: torch.device, make):
    """(forward, backward) of a program; the backward takes torch.func (functorch_dispatch)."""
    if _compile_glue_on(device):
        if program not in _COMPILED_GLUE:
            forward, backward = (torch.compile(f, fullgraph=True, dynamic=None) for f in make(program))
            _COMPILED_GLUE[program] = forward, _with_functorch(backward)
        return _COMPILED_GLUE[program]
    forward, backward = make(program)
    return forward, _with_functorch(backward)


def gate_glue(program: str, device: torch.device):
    """(forward, backward) of a gate program, compiled where _compile_glue_on says so."""
    return _program_glue(program, device, _gate_functions)


def post_glue(program: str, device: torch.device):
    """(forward, backward) of a post program, compiled where _compile_glue_on says so."""
    return _program_glue(program, device, _post_functions)


def _down_projection(up, w_down, post_operands, spec, expert_offsets):
    """act(up) @ W_down[e] per expert (no bias): the forward's down rows, and the backward's where none were kept."""
    act = gate_glue(spec.gate, up.device)[0](up, *post_operands)
    return grouped_mm(act.to(w_down.dtype), effective_weight(w_down, spec.down_layout), expert_offsets)


def experts_forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands, spec, plan=None):
    """Returns (out, row_order, slot_row, expert_offsets, up_out, down_out); the last five are saved for
    backward. `plan`: the routing plan of topk_ids, when the router op computed it already."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w_up.shape[0]
    if spec.out_of_range == "clamp":
        topk_ids = topk_ids.clamp(0, num_experts - 1)
    row_order, slot_row, expert_offsets = plan if plan is not None else routing_plan(topk_ids, num_experts)
    routed = routed_rows_mask(expert_offsets, row_order.numel())
    if b_up is not None or b_down is not None:
        row_expert = topk_ids.reshape(-1)[row_order].clamp(0, num_experts - 1)
    x_rows = hidden[row_order // top_k]
    up = grouped_mm(x_rows, effective_weight(w_up, spec.up_layout), expert_offsets)
    if b_up is not None:
        up = up + b_up[row_expert]
    # Rows of dropped slots (past expert_offsets[-1]) are never computed: torch._grouped_mm leaves them
    # uninitialised and never reads them either. Only the [rows, H] results that leave the grouped
    # GEMMs are masked (inside the combines); masking the wide [rows, 2I] intermediates would cost a pass.
    if post_operands:
        # Operand gradients sum over rows: rows past the last expert must hold zeros, not stale memory.
        up = up.masked_fill(~routed, 0)
    down = _down_projection(up, w_down, post_operands, spec, expert_offsets)
    if b_down is not None:
        down = down + b_down[row_expert]
    rows = down
    if spec.post is not None:
        # A post program may reduce over a row and its operand gradients sum over rows: unrouted rows
        # must hold zeros, not stale memory, before it runs.
        down = down.masked_fill(~routed, 0)
        rows = post_glue(spec.post, down.device)[0](down, *post_operands)
    out = glue("combine", rows.device)(rows, slot_row, routed, topk_weights, num_tokens, top_k, spec.out_dtype)
    return out, row_order, slot_row, expert_offsets, up, down


def experts_backward(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands,
                     row_order, slot_row, expert_offsets, up, down, spec, input_rows=None, down_saved=True):
    """Gradients (d_hidden, d_topk_weights, d_w_up, d_w_down, d_b_up, d_b_down, [d_post_operands]);
    bias grads None if no bias. With ``input_rows`` (a [rows, H] buffer) the input-gradient rows are copied
    there and not combined (d_hidden None; combine_input_rows sums them). ``down_saved=False`` (the forward kept no
    down for the fused backward, which then fell back here): down is computed again from ``up`` (no down bias and no
    post program in that case)."""
    num_tokens, top_k = topk_ids.shape
    routed = routed_rows_mask(expert_offsets, row_order.numel())
    if not down_saved:
        if b_down is not None or spec.post is not None:
            raise ValueError("uniep: the experts' backward needs the forward's down rows here")
        down = _down_projection(up, w_down, post_operands, spec, expert_offsets)
    d_operands = []
    if spec.post is None:
        d_weights, d_down = glue("slot_grads", down.device)(grad_out, down, slot_row, row_order, routed, topk_weights)
    else:
        rows, d_rows, d_operands = post_glue(spec.post, down.device)[1](down, post_operands, grad_out, slot_row,
                                                                        row_order, routed, topk_weights)
        d_weights, d_down = d_rows

    w_down_eff = effective_weight(w_down, spec.down_layout)
    d_act = grouped_mm(d_down, w_down_eff.transpose(-2, -1), expert_offsets)
    if post_operands:
        d_act = d_act.masked_fill(~routed, 0)
    act, d_up, d_gate_operands = gate_glue(spec.gate, up.device)[1](up, d_act, *post_operands)
    if post_operands:
        d_operands = [g if p is None else g + p for g, p in
                      zip(d_gate_operands, d_operands or [None] * len(d_gate_operands))]
    d_w_down = weight_grad(act.to(w_down.dtype), d_down, spec.down_layout, expert_offsets)

    d_up = d_up.to(w_up.dtype)
    x_rows = hidden[row_order // top_k].to(w_up.dtype)
    w_up_eff = effective_weight(w_up, spec.up_layout)
    d_x_rows = grouped_mm(d_up, w_up_eff.transpose(-2, -1), expert_offsets)
    d_w_up = weight_grad(x_rows, d_up, spec.up_layout, expert_offsets)
    if input_rows is None:
        d_hidden = glue("combine", d_x_rows.device)(d_x_rows, slot_row, routed, None, num_tokens, top_k, hidden.dtype)
    else:
        input_rows.copy_(d_x_rows)
        d_hidden = None

    d_b_up = d_b_down = None
    if b_up is not None or b_down is not None:
        # Bias gradients are per-expert column sums, done as GEMMs against ones so the row order is
        # fixed; 8 columns keep the ones matrix 16-byte aligned for torch._grouped_mm (only column 0 is used).
        ones = d_up.new_ones(d_up.shape[0], 8)
        if b_up is not None:
            d_b_up = grouped_weight_grad(d_up, ones, expert_offsets)[..., 0].to(b_up.dtype)
        if b_down is not None:
            d_b_down = grouped_weight_grad(d_down, ones.to(d_down.dtype), expert_offsets)[..., 0].to(b_down.dtype)
    return d_hidden, d_weights, d_w_up, d_w_down, d_b_up, d_b_down, list(d_operands)


def combine_input_rows(rows, slot_row, expert_offsets, num_tokens: int, top_k: int, dtype):
    """d_hidden from the input-gradient rows experts_backward left in ``input_rows``."""
    routed = routed_rows_mask(expert_offsets, rows.shape[0])
    return glue("combine", rows.device)(rows, slot_row, routed, None, num_tokens, top_k, dtype)
