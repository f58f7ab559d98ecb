"""The uniep custom ops (torch.library), their fake implementations and autograd.

``uniep::moe_experts`` is what a matched experts region becomes in the forward graph. Its backward
formula calls ``uniep::moe_experts_backward``, so AOTAutograd's backward graph holds one opaque node
as well. Besides the output the forward returns the routing plan (row_order, slot_row,
expert_offsets) and the two projections, which setup_context saves: backward reuses the forward's
token order instead of recomputing it. The down projection is not saved where the fused backward reads none
(config.late_routing_weight; megakernel.backward_reads_down), and the backward ops then get
``down_saved=False``. ``uniep::moe_experts_backward_`` is the same backward allowed
to consume those saved buffers as scratch (spec.reuse_saved, the backend's default), less the input
gradient's combine, which ``uniep::moe_experts_backward_combine`` runs after it. When the router
op has built the plan already (``plan_row_order=``, ``plan_slot_row=``, ``plan_offsets=``), the
forward uses it and returns empty tensors in its place; the given plan is what backward gets.

Both ops run the Triton MegaKernel (kernels/megakernel.py) where it applies -- CUDA, bf16/fp16, a gate
it implements -- and the pure-PyTorch reference otherwise. Both save the same tensors with the same
meaning, so the choice never has to agree between forward and backward.
"""
from __future__ import annotations

import torch

from .kernels import megakernel, op_graphs, reference, router_reference
from .spec import SECOND_BACKWARD_ERROR, autocast_off, decode_router_spec, decode_spec

_FWD_SCHEMA = ("(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w_up, Tensor w_down, "
               "Tensor? b_up, Tensor? b_down, Tensor[] post_operands, str spec, Tensor? plan_row_order=None, "
               "Tensor? plan_slot_row=None, Tensor? plan_offsets=None) "
               "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor grad_out, Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w_up, "
               "Tensor w_down, Tensor? b_up, Tensor? b_down, Tensor[] post_operands, Tensor row_order, "
               "Tensor slot_row, Tensor expert_offsets, Tensor up, Tensor down, str spec, bool weights_grad=True, "
               "bool param_grads=True, bool down_saved=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
               "Tensor[])")


@torch.library.custom_op("uniep::moe_experts", mutates_args=(), schema=_FWD_SCHEMA)
@autocast_off
def moe_experts(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands, spec,
                plan_row_order=None, plan_slot_row=None, plan_offsets=None):
    s = decode_spec(spec)
    plan = _checked_plan((plan_row_order, plan_slot_row, plan_offsets), topk_ids, w_up.shape[0])
    if megakernel.use_megakernel(hidden, topk_ids, w_up, w_down, b_up, b_down, post_operands, s):
        if s.inference:  # small calls from a CUDA graph of the op's own (kernels/op_graphs.py)
            out = op_graphs.forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, s, plan=plan)
        else:
            out = megakernel.experts_forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, s, plan=plan)
    else:
        out = reference.experts_forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands, s,
                                        plan=plan)
    if plan is not None:  # outputs may not alias inputs: the given plan is saved from the inputs instead
        out = (out[0],) + tuple(topk_ids.new_empty(0) for _ in range(3)) + tuple(out[4:])
    return out


def _checked_plan(plan, topk_ids, num_experts):
    """The routing plan the router op computed for these ids (row_order, slot_row, expert_offsets), or None."""
    if all(p is None for p in plan):
        return None
    if any(p is None for p in plan) or plan[0].shape != (topk_ids.numel(),) or plan[1].shape != (topk_ids.numel(),) \
            or plan[2].shape != (num_experts,):
        raise ValueError(f"uniep: moe_experts got a routing plan of shapes {[tuple(p.shape) for p in plan]} for "
                         f"{topk_ids.numel()} slots over {num_experts} experts")
    return tuple(plan)


@moe_experts.register_fake
def _moe_experts_fake(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands, spec,
                      plan_row_order=None, plan_slot_row=None, plan_offsets=None):
    s = decode_spec(spec)
    num_tokens, top_k = topk_ids.shape
    rows = num_tokens * top_k
    up_width = w_up.shape[1] if s.up_layout == "oi" else w_up.shape[2]
    hidden_size = w_down.shape[1] if s.down_layout == "oi" else w_down.shape[2]
    out = hidden.new_empty(num_tokens, hidden_size, dtype=s.out_dtype)
    row_order = topk_ids.new_empty(rows, dtype=torch.int64)
    slot_row = topk_ids.new_empty(rows, dtype=torch.int64)
    offsets = topk_ids.new_empty(w_up.shape[0], dtype=torch.int64)
    up_dtype = torch.promote_types(w_up.dtype, b_up.dtype) if b_up is not None else w_up.dtype
    down_dtype = torch.promote_types(w_down.dtype, b_down.dtype) if b_down is not None else w_down.dtype
    up = hidden.new_empty(rows, up_width, dtype=up_dtype)
    down = hidden.new_empty(rows, hidden_size, dtype=down_dtype)
    if plan_row_order is not None:
        row_order, slot_row, offsets = (topk_ids.new_empty(0, dtype=torch.int64) for _ in range(3))
    return out, row_order, slot_row, offsets, up, down


def _backward_impl(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands,
                   row_order, slot_row, expert_offsets, up, down, spec, weights_grad=True, reuse_saved=False,
                   input_rows=None, param_grads=True, down_saved=True):
    s = decode_spec(spec)
    if megakernel.use_megakernel(hidden, topk_ids, w_up, w_down, b_up, b_down, post_operands, s):
        *grads, d_operands = megakernel.experts_backward(
            grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, row_order, slot_row,
            expert_offsets, up, down, s, reuse_saved=reuse_saved, weights_grad=weights_grad, input_rows=input_rows,
            param_grads=param_grads, down_saved=down_saved)
    else:
        *grads, d_operands = reference.experts_backward(
            grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands,
            row_order, slot_row, expert_offsets, up, down, s, input_rows=input_rows, down_saved=down_saved)
        if not param_grads:  # (the reference computes them; the op's contract is the same on every path)
            grads[2:6] = [None] * 4
    # A schema cannot return None: absent bias gradients, and the expert parameters' gradients under
    # param_grads=False, travel as empty tensors. Every output is contiguous, as the fake implementation promises.
    return (*(g.contiguous() if g is not None else hidden.new_empty(0) for g in grads),
            [g.contiguous() for g in d_operands])


@torch.library.custom_op("uniep::moe_experts_backward", mutates_args=(), schema=_BWD_SCHEMA)
@autocast_off
def moe_experts_backward(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands,
                         row_order, slot_row, expert_offsets, up, down, spec, weights_grad=True, param_grads=True,
                         down_saved=True):
    """``weights_grad=False`` (the routing weights need no gradient, as the constant ones of an EP layer's
    received rows): the fused path skips that gradient and returns zeros in its place. ``param_grads=False`` (the
    expert weights and biases need none: frozen experts, as in LoRA fine-tuning): their two weight-gradient GEMMs
    are not run, and empty tensors stand in their place; the other gradients keep their bits. ``down_saved=False``:
    the forward kept no ``down`` (an empty tensor stands in; megakernel.backward_reads_down)."""
    return _backward_impl(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands,
                          row_order, slot_row, expert_offsets, up, down, spec, weights_grad=weights_grad,
                          param_grads=param_grads, down_saved=down_saved)


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands,
                               row_order, slot_row, expert_offsets, up, down, spec, weights_grad=True,
                               param_grads=True, down_saved=True):
    def like(t, needed=True):
        return t.new_empty(t.shape) if t is not None and needed else hidden.new_empty(0)

    return (like(hidden), like(topk_weights), like(w_up, param_grads), like(w_down, param_grads),
            like(b_up, param_grads), like(b_down, param_grads), [like(t) for t in post_operands])


# The in-place variant (spec.reuse_saved, the backend's default): the fused backward uses the saved
# ``up`` as d_up and ``down`` as scratch for its [rows, H] buffers, so it needs no [rows, 2I] buffer of
# its own. It computes every gradient but d_hidden and leaves the input-gradient rows in ``down``;
# ``moe_experts_backward_combine`` sums them into d_hidden. Two ops, so that a compiled backward frees
# ``up`` (read for the last time by the first) before d_hidden is allocated: the peak is then that of
# autograd's op-by-op backward (the saved tensors and the two weight gradients). This variant serves layers
# without post operands (the only ones the fused path runs) whose ``down`` has w_up's dtype (it holds the
# input-gradient rows), and returns the five other gradients.
#
# The schema does not declare the writes to up and down. Declared, they make a compiled backward copy both
# buffers first: inductor re-inplaces a mutation of a graph input only where the graph copies the result
# back, and a backward graph's saved tensors get no copy back. That copy (into the same memory, which inductor
# reuses) is a full read and write of both, 0.22 ms a step on Qwen3-30B-A3B's layer (BENCHMARKS.md). What the
# declaration gave is kept by hand: (1) up and down are this op's own saved tensors (the forward's outputs,
# read by nothing else); (2) a second backward through the same graph (retain_graph) raises: the op records
# the storages it overwrites (megakernel.claim_saved_buffers) and refuses them a second time, with an error that names
# the option that avoids it (bumping their version counters instead made autograd raise first, before the op
# ran, with PyTorch's "modified by an inplace operation", which names neither uniep nor the option); (3) the
# combine takes this op's first output as an input, so no scheduler can run it before the rows it reads are
# written.
# Where the forward kept no ``down`` (down_saved=False) the op allocates the [rows, H] buffer it would have taken
# from it, and returns it as its sixth output for the combine (else an empty tensor: an output may not alias the
# ``down`` it was given).
_BWD_INPLACE_SCHEMA = (_BWD_SCHEMA.replace("-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])",
                                "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
assert _BWD_INPLACE_SCHEMA.endswith("-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _input_rows_buffer(hidden, topk_ids, w_up, down, down_saved: bool, new_empty):
    """The in-place backward's [rows, H] buffer where the forward kept no ``down`` (then an empty [0, H] stand-in),
    else an empty tensor."""
    if down_saved:
        return hidden.new_empty(0)
    return new_empty((topk_ids.numel(), down.shape[1]), dtype=w_up.dtype, device=hidden.device)


@torch.library.custom_op("uniep::moe_experts_backward_", mutates_args=(), schema=_BWD_INPLACE_SCHEMA)
@autocast_off
def moe_experts_backward_(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands,
                          row_order, slot_row, expert_offsets, up, down, spec, weights_grad=True, param_grads=True,
                          down_saved=True):
    if post_operands or down.dtype != w_up.dtype:
        raise ValueError("uniep: moe_experts_backward_ takes no post operands, and a saved `down` of w_up's dtype")
    rows = _input_rows_buffer(hidden, topk_ids, w_up, down, down_saved, torch.empty)
    scratch = down if down_saved else rows
    with megakernel.overwriting_saved_buffers(up, down, SECOND_BACKWARD_ERROR):  # (the reference's writes too)
        grads = _backward_impl(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands,
                               row_order, slot_row, expert_offsets, up, scratch, spec, weights_grad=weights_grad,
                               reuse_saved=True, input_rows=scratch, param_grads=param_grads,
                               down_saved=down_saved)[1:6]
    return (*grads, rows)


@moe_experts_backward_.register_fake
def _moe_experts_backward_inplace_fake(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down,
                                       post_operands, row_order, slot_row, expert_offsets, up, down, spec,
                                       weights_grad=True, param_grads=True, down_saved=True):
    grads = _moe_experts_backward_fake(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down,
                                       post_operands, row_order, slot_row, expert_offsets, up, down, spec,
                                       param_grads=param_grads)[1:6]
    return (*grads, _input_rows_buffer(hidden, topk_ids, w_up, down, down_saved, hidden.new_empty))


_BWD_COMBINE_SCHEMA = ("(Tensor input_rows, Tensor after, Tensor hidden, Tensor topk_ids, Tensor topk_weights, "
                       "Tensor w_up, Tensor w_down, Tensor? b_up, Tensor? b_down, Tensor slot_row, "
                       "Tensor expert_offsets, str spec) -> Tensor")


@torch.library.custom_op("uniep::moe_experts_backward_combine", mutates_args=(), schema=_BWD_COMBINE_SCHEMA)
@autocast_off
def moe_experts_backward_combine(input_rows, after, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down,
                                 slot_row, expert_offsets, spec):
    """d_hidden from the input-gradient rows moe_experts_backward_ left in ``down``: each token's K rows summed
    in k order, by the same implementation (fused or reference) as the backward that wrote them. ``after``: an
    output of that backward, unread, which orders this op after it."""
    num_tokens, top_k = topk_ids.shape
    if megakernel.use_megakernel(hidden, topk_ids, w_up, w_down, b_up, b_down, [], decode_spec(spec)):
        return megakernel.combine_input_rows(input_rows, slot_row, expert_offsets, num_tokens, top_k, hidden.dtype)
    return reference.combine_input_rows(input_rows, slot_row, expert_offsets, num_tokens, top_k, hidden.dtype)


@moe_experts_backward_combine.register_fake
def _moe_experts_backward_combine_fake(input_rows, after, hidden, topk_ids, topk_weights, w_up, w_down, b_up,
                                       b_down, slot_row, expert_offsets, spec):
    return hidden.new_empty(hidden.shape)


def _setup_context(ctx, inputs, output):
    hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, post_operands, spec, *given_plan = inputs
    if decode_spec(spec).inference:  # its outputs but the first may hold no values (kernels/op_graphs.py)
        raise RuntimeError("uniep: an experts op compiled for a graph that takes no gradient is being recorded for "
                           "a backward, whose saved buffers may hold no values (kernels/op_graphs.py). Please report "
                           "the graph; compiling it with gradients enabled avoids this.")
    _, row_order, slot_row, expert_offsets, up, down = output
    # the outputs after the first are the backward's buffers, whose gradients it never reads: no zeros for them
    # (autograd fills one for each by default, an [S, H] and an [S, 2I] memset a call outside a compiled graph)
    ctx.set_materialize_grads(False)
    # Autograd wants one gradient per argument passed (defaults left out), and the plan is passed whole
    # (the lowering's plan_row_order=, plan_slot_row=, plan_offsets=) or not at all.
    ctx.num_plan_inputs = 3 if given_plan and given_plan[0] is not None else 0
    if given_plan and given_plan[0] is not None:
        row_order, slot_row, expert_offsets = given_plan
    ctx.reuse_saved = decode_spec(spec).reuse_saved and not post_operands and down.dtype == w_up.dtype
    # config.late_routing_weight's fused backward reads no `down`: not kept, [rows, H] less between the forward and
    # the backward
    ctx.down_saved = megakernel.backward_reads_down(hidden, topk_ids, w_up, w_down, b_up, b_down, post_operands,
                                                    decode_spec(spec))
    ctx.down_shape = (0, down.shape[1])
    # row_order is kept (8 bytes a row): computing it again as slot_row's inverse took two kernels and about 0.1 ms of
    # host time a backward (benchmarks/probes/queued_step_probe.py's host trace)
    ctx.save_for_backward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, *post_operands,
                          row_order, slot_row, expert_offsets, up,
                          down if ctx.down_saved else None)
    ctx.spec = spec
    ctx.num_operands = len(post_operands)
    ctx.has_bias = (b_up is not None, b_down is not None)


def _backward(ctx, grad_out, *_unused_grads):
    if grad_out is None:  # the output took no gradient: none flows to the inputs
        return (None,) * 7 + ([None] * ctx.num_operands, None) + (None,) * ctx.num_plan_inputs
    saved = list(ctx.saved_tensors)
    head, operands, plan = saved[:7], saved[7:7 + ctx.num_operands], saved[7 + ctx.num_operands:]
    weights_grad = ctx.needs_input_grad[2]  # False for weights that need none (the ones of an EP layer's rows)
    param_grads = any(ctx.needs_input_grad[3:7])  # False for frozen experts: their weight-gradient GEMMs are skipped
    if not ctx.down_saved:  # an empty stand-in of w_up's dtype (the in-place op's check)
        plan[-1] = head[3].new_empty(ctx.down_shape)
    if ctx.reuse_saved:
        d_weights, d_w_up, d_w_down, d_b_up, d_b_down, rows = torch.ops.uniep.moe_experts_backward_(
            grad_out, *head, operands, *plan, ctx.spec, weights_grad, param_grads, ctx.down_saved)
        _, slot_row, expert_offsets, _, down = plan  # down (or rows, where none was kept) holds the input-gradient rows
        d_hidden = torch.ops.uniep.moe_experts_backward_combine(down if ctx.down_saved else rows, d_weights,
                                                                *head[:7], slot_row, expert_offsets, ctx.spec)
        d_operands = []
    else:
        d_hidden, d_weights, d_w_up, d_w_down, d_b_up, d_b_down, d_operands = torch.ops.uniep.moe_experts_backward(
            grad_out, *head, operands, *plan, ctx.spec, weights_grad, param_grads, ctx.down_saved)
    if not param_grads:
        d_w_up = d_w_down = d_b_up = d_b_down = None
    return (d_hidden, None, d_weights if weights_grad else None, d_w_up, d_w_down, d_b_up if ctx.has_bias[0] else None,
            d_b_down if ctx.has_bias[1] else None, list(d_operands), None) + (None,) * ctx.num_plan_inputs


moe_experts.register_autograd(_backward, setup_context=_setup_context)


def moe_experts_out(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec: str,
                    post_operands=()) -> torch.Tensor:
    """Eager convenience: the op's output alone."""
    return torch.ops.uniep.moe_experts(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down,
                                       list(post_operands), spec)[0]


# -- the router ---------------------------------------------------------------------------------
# ``uniep::moe_router`` is what a matched router region becomes: (logits, routing weights, top-k ids).
# Its backward calls ``uniep::moe_router_backward``, which recomputes the scores from the saved logits
# with the forward's ids. Both run the fused routing kernels (kernels/triton_router.py) where they
# apply, else the reference (kernels/router_reference.py).

_ROUTER_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor? bias, Tensor? score_bias, str spec) "
                  "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("uniep::moe_router", mutates_args=(), schema=_ROUTER_SCHEMA)
@autocast_off
def moe_router(hidden, weight, bias, score_bias, spec):
    return _router_forward(hidden, weight, bias, score_bias, decode_router_spec(spec))


def _router_forward(hidden, weight, bias, score_bias, s):
    if megakernel.use_fused_router(hidden, weight, bias, s):
        from .kernels import triton_router
        return triton_router.router_forward(hidden, weight, bias, score_bias, s)
    logits, weights, ids = (t.contiguous() for t in
                            router_reference.router_forward(hidden, weight, bias, score_bias, s))
    if s.plan:
        plan = reference.routing_plan(ids, s.num_experts)
    else:
        plan = tuple(ids.new_empty(0) for _ in range(3))
    return (logits, weights, ids) + tuple(plan)


@moe_router.register_fake
def _moe_router_fake(hidden, weight, bias, score_bias, spec):
    s = decode_router_spec(spec)
    num_tokens = hidden.shape[0]
    logits = hidden.new_empty(num_tokens, s.num_experts, dtype=torch.float32 if s.linear_fp32 else hidden.dtype)
    weights = hidden.new_empty(num_tokens, s.top_k, dtype=s.weights_dtype)
    ids = hidden.new_empty(num_tokens, s.top_k, dtype=torch.int64)
    slots = num_tokens * s.top_k if s.plan else 0
    plan = (ids.new_empty(slots), ids.new_empty(slots), ids.new_empty(s.num_experts if s.plan else 0))
    return (logits, weights, ids) + plan


_ROUTER_BWD_SCHEMA = ("(Tensor? grad_logits, Tensor? grad_weights, Tensor hidden, Tensor weight, Tensor? bias, "
                      "Tensor logits, Tensor ids, str spec) -> (Tensor, Tensor, Tensor)")


@torch.library.custom_op("uniep::moe_router_backward", mutates_args=(), schema=_ROUTER_BWD_SCHEMA)
@autocast_off
def moe_router_backward(grad_logits, grad_weights, hidden, weight, bias, logits, ids, spec):
    s = decode_router_spec(spec)
    if megakernel.use_fused_router(hidden, weight, bias, s):
        from .kernels import triton_router
        grads = triton_router.router_backward(grad_logits, grad_weights, hidden, weight, bias, logits, ids, s)
    else:
        grads = router_reference.router_backward(grad_logits, grad_weights, hidden, weight, bias, logits, ids, s)
    # a schema cannot return None: an absent bias gradient travels as an empty tensor
    return tuple(g.contiguous() if g is not None else hidden.new_empty(0) for g in grads)


@moe_router_backward.register_fake
def _moe_router_backward_fake(grad_logits, grad_weights, hidden, weight, bias, logits, ids, spec):
    return (hidden.new_empty(hidden.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else hidden.new_empty(0))


def _router_setup_context(ctx, inputs, output):
    hidden, weight, bias, _score_bias, spec = inputs
    logits, _weights, ids, *plan = output
    ctx.save_for_backward(hidden, weight, bias, logits, ids)
    ctx.spec = spec
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(ids, *plan)


def _router_backward(ctx, grad_logits, grad_weights, _grad_ids, *_grad_plan):
    hidden, weight, bias, logits, ids = ctx.saved_tensors
    d_hidden, d_weight, d_bias = torch.ops.uniep.moe_router_backward(grad_logits, grad_weights, hidden, weight, bias,
                                                                     logits, ids, ctx.spec)
    return d_hidden, d_weight, d_bias if ctx.has_bias else None, None, None


moe_router.register_autograd(_router_backward, setup_context=_router_setup_context)


# -- router and experts in one op, for inference ------------------------------------------------------
# ``uniep::moe_block`` is a router op whose top-k ids and weights (and routing plan, where it builds one) only the
# experts op after it reads, and that experts op, in a graph that takes no gradient (backend._fuse_block): one call
# where there were two, and for a decode-sized call one CUDA graph of both (kernels/op_graphs.block_forward). It
# returns the experts op's first output, computed by the same kernels, so with the same bits as the two ops. A router
# spec with ``plan`` builds the plan the experts then take (share_routing_plan), as the two ops did.

_BLOCK_SCHEMA = ("(Tensor router_hidden, Tensor router_weight, Tensor? router_bias, Tensor? score_bias, "
                 "str router_spec, Tensor hidden, Tensor w_up, Tensor w_down, Tensor? b_up, Tensor? b_down, "
                 "str spec) -> Tensor")


@torch.library.custom_op("uniep::moe_block", mutates_args=(), schema=_BLOCK_SCHEMA)
@autocast_off
def moe_block(router_hidden, router_weight, router_bias, score_bias, router_spec, hidden, w_up, w_down, b_up, b_down,
              spec):
    rs, s = decode_router_spec(router_spec), decode_spec(spec)

    def eager(cfg):
        routed = _router_forward(router_hidden, router_weight, router_bias, score_bias, rs)
        _, weights, ids = routed[:3]
        plan = tuple(routed[3:6]) if rs.plan else None  # (share_routing_plan: the router built it)
        if megakernel.use_megakernel(hidden, ids, w_up, w_down, b_up, b_down, [], s):
            return megakernel.experts_forward(hidden, ids, weights, w_up, w_down, b_up, b_down, s, plan=plan,
                                              config=cfg)[0]
        return reference.experts_forward(hidden, ids, weights, w_up, w_down, b_up, b_down, [], s, plan=plan)[0]

    return op_graphs.block_forward(router_hidden, router_weight, router_bias, score_bias, rs, hidden, w_up, w_down,
                                   b_up, b_down, s, eager)


@moe_block.register_fake
def _moe_block_fake(router_hidden, router_weight, router_bias, score_bias, router_spec, hidden, w_up, w_down, b_up,
                    b_down, spec):
    s = decode_spec(spec)
    hidden_size = w_down.shape[1] if s.down_layout == "oi" else w_down.shape[2]
    return hidden.new_empty(hidden.shape[0], hidden_size, dtype=s.out_dtype)


def _block_setup_context(ctx, inputs, output):
    raise RuntimeError("uniep: a uniep.moe_block op (router and experts fused for a graph that takes no gradient) is "
                       "being recorded for a backward, which it has none of. Please report the graph; compiling it "
                       "with gradients enabled avoids this.")


moe_block.register_autograd(lambda ctx, grad: None, setup_context=_block_setup_context)
