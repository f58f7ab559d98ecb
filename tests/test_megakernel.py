"""Layer 1: the Triton MegaKernel against the reference op (CPU: Triton's interpreter, fp32/fp16).

Each case runs the op twice through autograd -- once with UNIEP_KERNELS=triton, once with the
reference -- and compares the output and every gradient. The kernel counter proves the fused path ran.
"""
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import TOLERANCE, assert_routing_plan_equals_reference, max_rel_err
from test_reference import GELU_GLU, GELU_TANH_GLU, GPT_OSS, RELU2, SILU_GLU, SILU_INTERLEAVED, make
from uniep_dynamo.kernels import config as kconfig
from uniep_dynamo.kernels import gate_program, reference
from uniep_dynamo.spec import ExpertsSpec

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
if not kconfig.interpreting():
    pytest.skip("these run the kernels on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, which "
                "conftest sets on machines without a GPU); on a GPU, test_gpu_megakernel.py covers them",
                allow_module_level=True)
DEVICE = "cpu"


def run(args, mode, monkeypatch, grad_seed=1, spec=None):
    """(out, grads of hidden, weights, w_up, w_down, b_up, b_down) with UNIEP_KERNELS=mode."""
    monkeypatch.setenv("UNIEP_KERNELS", mode)
    hidden, ids, weights, w_up, w_down, b_up, b_down, make_spec = args
    spec = spec or make_spec
    leaves = [t.detach().clone().to(DEVICE).requires_grad_() if t is not None else None
              for t in (hidden, weights, w_up, w_down, b_up, b_down)]
    out = torch.ops.uniep.moe_experts(leaves[0], ids.to(DEVICE), *leaves[1:], [], spec.encode())[0]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    out.backward(grad)
    return [out] + [t.grad if t is not None else None for t in leaves]


def assert_close(fused, ref, dtype):
    names = ("out", "d_hidden", "d_weights", "d_w_up", "d_w_down", "d_b_up", "d_b_down")
    for name, a, b in zip(names, fused, ref):
        if b is None:
            assert a is None, name
            continue
        err = max_rel_err(a, b)
        assert err < TOLERANCE[dtype], f"{name}: max rel err {err:.3g}"


CASES = [
    # (T, H, I, E, K, gate, layout, bias)
    (1, 32, 16, 4, 2, SILU_GLU, "oi", False),            # T=1: one token, tiles are mostly padding
    (37, 40, 24, 4, 2, SILU_GLU, "oi", False),           # T, H and I not multiples of any tile size
    (23, 32, 16, 8, 8, SILU_GLU, "io", False),           # K == E == 8: every token visits every expert
    (29, 32, 16, 8, 1, GELU_GLU, "oi", False),           # K=1, erf GELU gate
    (19, 32, 16, 6, 3, GELU_TANH_GLU, "io", False),      # tanh GELU gate, odd K
    (21, 32, 24, 4, 2, RELU2, "oi", False),              # no gate: relu(x)^2, single accumulator
    (17, 32, 16, 4, 2, GPT_OSS, "io", True),             # GPT-OSS: interleaved clamped gate, both biases
    (17, 32, 16, 4, 2, SILU_INTERLEAVED, "oi", True),    # interleaved SiLU, biases, [E, out, in] weights
    (12, 32, 16, 256, 8, SILU_GLU, "oi", False),         # E=256: most experts get no token
    (40, 64, 32, 16, 4, SILU_GLU, "oi", False),          # several row tiles per expert
]


@pytest.mark.parametrize("case", CASES)
def test_megakernel_matches_reference_fp32(case, monkeypatch):
    T, H, I, E, K, gate, layout, bias = case
    args = make(T, H, I, E, K, gate, layout, bias)
    if gate == GPT_OSS:
        # Spread the projections past the clamp limit so that both sides of each clamp are exercised.
        args = (args[0] * 20,) + args[1:]
    counters.clear()
    fused = run(args, "triton", monkeypatch)
    assert counters["uniep_kernels"]["triton_forward"] == 1 and counters["uniep_kernels"]["triton_backward"] == 1
    ref = run(args, "reference", monkeypatch)
    assert_close(fused, ref, torch.float32)


@pytest.mark.parametrize("case", [CASES[1], CASES[6], CASES[8]])
def test_megakernel_matches_reference_fp16(case, monkeypatch):
    T, H, I, E, K, gate, layout, bias = case
    args = make(T, H, I, E, K, gate, layout, bias, dtype=torch.float16)
    assert_close(run(args, "triton", monkeypatch), run(args, "reference", monkeypatch), torch.float16)


def test_all_tokens_on_one_expert_and_idle_experts_get_exact_zero_grads(monkeypatch):
    ids = torch.full((30, 2), 3, dtype=torch.long)
    ids[:, 1] = 1
    args = make(30, 32, 16, 6, 2, ids=ids)
    fused = run(args, "triton", monkeypatch)
    assert_close(fused, run(args, "reference", monkeypatch), torch.float32)
    idle = [0, 2, 4, 5]
    assert torch.equal(fused[3][idle], torch.zeros_like(fused[3][idle]))
    assert torch.equal(fused[4][idle], torch.zeros_like(fused[4][idle]))


def test_empty_batch(monkeypatch):
    args = make(0, 32, 16, 4, 2)
    fused = run(args, "triton", monkeypatch)
    assert fused[0].shape == (0, 32) and fused[1].shape == (0, 32)
    assert torch.equal(fused[3], torch.zeros_like(fused[3]))


@pytest.mark.parametrize("mode", ["drop", "clamp"])
def test_out_of_range_ids(mode, monkeypatch):
    """HF's expert-parallel sentinels: dropped slots contribute nothing; clamped ones use expert E-1."""
    args = list(make(9, 32, 16, 4, 2))
    ids = args[1].clone()
    ids[0, 1], ids[5, 0], ids[7, 1] = 4, 9, -1
    args[1] = ids
    spec = ExpertsSpec("oi", "oi", SILU_GLU, torch.float32, mode)
    fused = run(args, "triton", monkeypatch, spec=spec)
    assert_close(fused, run(args, "reference", monkeypatch, spec=spec), torch.float32)
    if mode == "drop":
        assert fused[2][0, 1] == 0 and fused[2][5, 0] == 0 and fused[2][7, 1] == 0


def test_nan_in_hidden_stays_in_its_token(monkeypatch):
    args = list(make(8, 32, 16, 4, 2))
    args[0] = args[0].clone()
    args[0][2, 5] = float("nan")
    fused, ref = run(args, "triton", monkeypatch), run(args, "reference", monkeypatch)
    assert torch.equal(torch.isnan(fused[0]), torch.isnan(ref[0]))
    assert torch.isnan(fused[0][2]).all() and torch.isfinite(fused[0][[0, 1, 3, 4, 5, 6, 7]]).all()


def test_int32_index_kernel():
    """QuACK's group bounds ([0, each expert's end row]) and gather index (each row's token) from one launch each:
    what torch's cat / div / casts gave, across program boundaries, and with no rows."""
    from uniep_dynamo.kernels.triton_routing import INDEX_BLOCK, int32_index

    offsets = torch.tensor([0, 5, 5, 2049, 3000])
    assert torch.equal(int32_index(offsets, lead_zero=True), torch.tensor([0, 0, 5, 5, 2049, 3000], dtype=torch.int32))
    row_order = torch.randperm(2 * INDEX_BLOCK + 37, generator=torch.Generator().manual_seed(0))
    got = int32_index(row_order, 8)
    assert got.dtype == torch.int32 and torch.equal(got, torch.div(row_order, 8, rounding_mode="floor").int())
    assert torch.equal(int32_index(torch.empty(0, dtype=torch.int64), lead_zero=True), torch.zeros(1, dtype=torch.int32))
    assert torch.equal(int32_index(row_order[::3], 8), torch.div(row_order[::3], 8, rounding_mode="floor").int())


@pytest.mark.parametrize("tokens", [625, 256, 40, 3, 1])
def test_routing_plan_kernel_equals_reference(tokens):
    """2500 slots: three plan blocks, the last one partial; 1024: one whole block; fewer: one block of as many sort
    lanes as the slots need (160 -> 256; 12 and 4 -> the 16 lanes of MIN_SORT_BLOCK); ids out of range in both
    directions."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-2, 70, (tokens, 4), generator=g)
    ids[0, :2] = torch.tensor([2**32 + 1, -(2**31) - 5])  # int64 ids past int32's range: dropped or clamped, not wrapped
    assert_routing_plan_equals_reference(ids, 64)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("top_k,block_t", [(1, None), (1, 1), (2, 8), (3, 4), (8, None)])
def test_combine_kernel_equals_reference_at_every_tokens_per_program(top_k, block_t, weighted, monkeypatch):
    """The combine kernel at several tokens a program (None: the default, 16 at the EP exchange's K = 1) against the
    reference's combine, bit for bit in fp32: T = 37 and H = 300 (no multiple of a program's tile), the last two rows
    dropped (read as zero, not copied), the rows read copied once each."""
    from uniep_dynamo.kernels import triton_routing

    assert [triton_routing.combine_block_t(k) for k in (1, 2, 8)] == [16, 1, 1]
    if block_t is not None:
        monkeypatch.setattr(triton_routing, "combine_block_t", lambda k: block_t)
    num_tokens, hidden = 37, 300
    g = torch.Generator().manual_seed(top_k)
    slots = num_tokens * top_k
    slot_row = torch.randperm(slots, generator=g)
    offsets = torch.tensor([(slots - 2) // 2, slots - 2])  # two experts; the last two rows belong to none
    rows = torch.randn(slots, hidden, generator=g)
    weights = torch.rand(num_tokens, top_k, generator=g) if weighted else None
    copy = torch.full((slots, hidden), float("nan"))
    out = triton_routing.combine(rows, slot_row, weights, offsets, num_tokens, top_k, torch.float32, copy=copy)
    want = reference.combine_slots(rows, slot_row, reference.routed_rows_mask(offsets, slots), weights, num_tokens,
                                   top_k, torch.float32)
    assert torch.equal(out, want)
    assert torch.equal(copy[:-2], rows[:-2]) and torch.isnan(copy[-2:]).all()


def test_gather_rounding_to_another_dtype_equals_a_cast_after_it():
    """gather_rows(dtype=): fp32 gradient rows scaled by fp32 routing weights and rounded to fp16 in the kernel are
    the bits of the fp32 gather followed by .to(float16) (the combine's backward under fp32 weights)."""
    from uniep_dynamo.kernels import triton_routing

    g = torch.Generator().manual_seed(5)
    grad, weights = torch.randn(37, 300, generator=g) * 100, torch.rand(37 * 3, generator=g)
    order = torch.randperm(37 * 3, generator=g)
    rounded = triton_routing.gather_rows(grad, order, 3, weights, dtype=torch.float16)
    assert rounded.dtype == torch.float16
    assert torch.equal(rounded, triton_routing.gather_rows(grad, order, 3, weights).to(torch.float16))


def test_received_plan_kernel_equals_the_ids_and_plan_of_torch_ops():
    """The EP layer's received rows (source by source, each source's rows by local expert): one launch gives the ids,
    weights 1 and routing plan that torch ops and the reference's sort give, with empty runs, an empty source, no rows
    at all, more than one row step a run, and the counts read through a strided view (a slice of the count table)."""
    from uniep_dynamo.kernels import triton_routing

    g = torch.Generator().manual_seed(5)
    for world, local in ((1, 4), (2, 3), (4, 8), (8, 16)):
        for kind in ("random", "sparse", "none", "long"):
            counts = torch.randint(0, 9, (world, local), generator=g)
            if kind == "sparse":
                counts[0] = 0
                counts[:, -1] = 0
            elif kind == "none":
                counts.zero_()
            elif kind == "long":
                counts[-1, 0] = triton_routing.RECEIVED_BLOCK_R + 3
            table = torch.cat([counts, torch.full((world, 2), 99)], dim=1)  # the counts, then other columns
            rows = int(counts.sum())
            ids, ones, plan = triton_routing.received_plan(table[:, :local], rows, torch.float16)
            want = torch.arange(local).repeat(world).repeat_interleave(counts.reshape(-1)).unsqueeze(1)
            assert torch.equal(ids, want), (world, local, kind)
            assert ones.dtype == torch.float16 and torch.equal(ones, torch.ones(rows, 1, dtype=torch.float16))
            for got, expected in zip(plan, reference.routing_plan(want, local)):
                assert torch.equal(got, expected), (world, local, kind)


def fixed_order_dot(self, a, b, d, input_precision=None, max_num_imprecise_acc=None):
    """The interpreter's tl.dot (InterpreterBuilder.create_dot) with each output element summed over k in order,
    from the accumulator up, whatever the operands' shapes (numpy's matmul blocks by shape)."""
    from triton.runtime.interpreter import TensorHandle

    acc = d.data.dtype
    a_data, b_data = a.data.astype(acc), b.data.astype(acc)
    out = d.data.copy()
    for k in range(a_data.shape[-1]):
        out = out + a_data[..., :, k:k + 1] * b_data[..., k:k + 1, :]
    return TensorHandle(out, d.dtype.scalar)


@pytest.mark.parametrize("change", [
    dict(num_programs=3),   # persistent grid: 3 programs walk every tile
    dict(group_m=1),        # no L2 swizzle
    dict(fuse_gather=True),  # gathers (and routing-weight scaling) inside the GEMMs
    dict(pack_gate_up=False),  # gate and up halves in two accumulators
    dict(num_programs=3, flatten=True, warp_specialize=True),  # Triton's loop options (the interpreter runs
                                                              # the same loop; the GPU test checks the bits)
], ids=["persistent", "group_m1", "fused_gather", "two_accumulators", "loop_options"])
def test_scheduling_knobs_do_not_change_results(change, monkeypatch):
    """Knobs that only schedule work give bitwise identical results (the GPU test sweeps all of them). The
    interpreter's tl.dot is numpy's matmul, whose rounding of one output element depends on the operands' shapes
    (its BLAS blocks them by size: with numpy 2.4 a [16, 32] x [32, 32] product differs from the first half of the
    [16, 32] x [32, 64] one), where a GPU's MMA adds each element's products in an order the tile's width does not
    change. So the dots run here in one fixed order per element (fixed_order_dot), as on the GPU: the knobs that
    split or merge tiles (two accumulators instead of the packed gate|up tile) compare their kernels' logic, not
    numpy's."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", fixed_order_dot)
    args = make(37, 40, 24, 8, 2, GPT_OSS, "io", True)
    base = kconfig.heuristic_config(74, 8, 40, 24, interpret=True)
    layer_knobs = {k: v for k, v in change.items() if k in kconfig.LAYER_SCHEDULING_KNOBS}
    other = base.replace_gemms(**{k: v for k, v in change.items() if k not in layer_knobs})
    other = dataclasses.replace(other, **layer_knobs)
    with kconfig.use_config(base):
        a = run(args, "triton", monkeypatch)
    with kconfig.use_config(other):
        b = run(args, "triton", monkeypatch)
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("case, kmajor, nmajor", [
    # (T, H, I, E, K, gate, layout, bias), then the expected K-major and N-major weight descriptors: one per
    # row GEMM, but none for the packed gate|up tile of a gated up projection (pointer loads) and none for an
    # interleaved gate's. Up and down weights are K-major when stored [E, out, in], the backward's the other way.
    ((150, 64, 32, 4, 2, SILU_GLU, "oi", False), 1, 2),  # ~75 rows per expert: whole and partial row chunks
    ((100, 64, 32, 4, 2, SILU_GLU, "io", True), 2, 1),   # biases
    ((29, 64, 32, 4, 2, RELU2, "oi", False), 2, 2),      # no gate: the up projection gets one too
    ((17, 64, 32, 4, 2, GPT_OSS, "io", True), 2, 1),     # interleaved clamped gate, biases
    ((37, 40, 24, 4, 2, SILU_GLU, "oi", False), 0, 0),   # K not a multiple of block_k: pointer loads throughout
], ids=["silu_oi", "silu_io_bias", "relu2", "gpt_oss", "uneven_k"])
def test_tma_tiles_do_not_change_results(case, kmajor, nmajor, monkeypatch):
    """config.tma and tma_weight_grad load the GEMMs' tiles through tensor descriptors (the interpreter emulates them):
    bitwise the results of pointer loads, and the descriptors are really made where the operands allow."""
    import triton.tools.tensor_descriptor as td

    from uniep_dynamo.kernels import megakernel

    made = []

    class Recording(td.TensorDescriptor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(tuple(self.block_shape))

    args = make(*case)
    t, h, i, e, k = case[:5]
    # Tile shapes that tell the descriptors apart: token [bm, bk] = [16, 32], N-major weight [bk, bn] =
    # [32, 64], K-major [bn, bk] = [64, 32]; the weight gradients' [bk, bm] = [32, 16] and [bk, 128].
    base = kconfig.heuristic_config(t * k, e, h, i, interpret=True).replace_gemms(block_n=64)
    wgrad = dataclasses.replace(base.wgrad_up, block_n=128)
    base = dataclasses.replace(base, wgrad_up=wgrad, wgrad_down=wgrad)
    assert (base.up.block_m, base.up.block_k) == (16, 32)
    with kconfig.use_config(base):
        a = run(args, "triton", monkeypatch)
    monkeypatch.setattr(td, "TensorDescriptor", Recording)
    with kconfig.use_config(dataclasses.replace(base, tma=True, tma_weight_grad=True)):
        b = run(args, "triton", monkeypatch)
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)
    tiles = {shape: made.count(shape) for shape in ((16, 32), (32, 64), (64, 32), (32, 16), (32, 128))}
    # token tiles of up, down, grad_act, grad_input (none where K is uneven); N-major weights; K-major ones
    # only on the GPU (below); both operands of both weight gradients (their rows need no evenness)
    even = h % 32 == 0 and i % 32 == 0
    assert tiles == {(16, 32): 4 if even else 0, (32, 64): nmajor, (64, 32): 0, (32, 16): 2, (32, 128): 2}
    # K-major weight tiles are transposed in the kernel. The interpreter's numpy matmul rounds a
    # transposed operand differently (see megakernel.TMA_KMAJOR_INTERPRETED), so here they are checked
    # for their indexing only; the GPU test checks their bits.
    made.clear()
    monkeypatch.setattr(megakernel, "TMA_KMAJOR_INTERPRETED", True)
    with kconfig.use_config(dataclasses.replace(base, tma=True, tma_weight_grad=True)):
        c = run(args, "triton", monkeypatch)
    assert made.count((64, 32)) == kmajor
    for x, y in zip(a, c):
        assert (x is None and y is None) or max_rel_err(x, y) < 1e-5


def test_unsupported_calls_say_why():
    from uniep_dynamo.kernels import megakernel

    args = make(4, 32, 16, 4, 2)
    hidden, ids, _, w_up, w_down, _, _, spec = args
    import os
    os.environ["UNIEP_KERNELS"] = "triton"
    try:
        assert megakernel.unsupported_reason(hidden, ids, w_up, w_down, None, None, [], spec) is None
        reason = megakernel.unsupported_reason(hidden.double(), ids, w_up.double(), w_down.double(), None, None, [],
                                               spec)
        assert "float64" in reason
        custom = ExpertsSpec("oi", "oi", gate_program.encode("none", ["call", "gelu", [["h"]], {}]), torch.float32)
        assert "no fused kernel" in megakernel.unsupported_reason(hidden, ids, w_up, w_down, None, None, [], custom)
        assert "post-expert" in megakernel.unsupported_reason(hidden, ids, w_up, w_down, None, None,
                                                              [torch.ones(32)], spec)
    finally:
        del os.environ["UNIEP_KERNELS"]


def test_cached_entry_of_the_removed_epilogue_knob():
    """act_grad_in_epilogue (the activation backward in the GEMM's epilogue) is gone: it never won (357 against
    690 TFLOP/s, BENCHMARKS.md) and the tuner never set it. A cache entry that still names it off reads as before;
    one that has it on asks for other numerics and is refused."""
    entry = kconfig.config_to_dict(kconfig.heuristic_config(50, 4, 32, 16, interpret=True))
    assert kconfig.config_from_dict({**entry, "act_grad_in_epilogue": False}) == kconfig.config_from_dict(entry)
    with pytest.raises(ValueError, match="act_grad_in_epilogue"):
        kconfig.config_from_dict({**entry, "act_grad_in_epilogue": True})


def test_in_place_backward_reuses_saved_buffers_and_refuses_a_second_backward(monkeypatch):
    """spec.reuse_saved (the backend's default): same bits as the out-of-place backward; the saved
    buffers are consumed, so retain_graph's second backward raises instead of reading them."""
    args = make(29, 32, 16, 6, 2, GPT_OSS, "io", True)
    in_place = dataclasses.replace(args[7], reuse_saved=True)
    counters.clear()
    a = run(args, "triton", monkeypatch, spec=in_place)
    b = run(args, "triton", monkeypatch)
    assert counters["uniep_kernels"]["triton_backward"] == 2
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    hidden = args[0].clone().requires_grad_()
    out = torch.ops.uniep.moe_experts(hidden, args[1], *args[2:7], [], in_place.encode())[0]
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="uniep: a second backward .*reuse_saved_buffers"):
        out.sum().backward()


@pytest.mark.parametrize("reuse_saved", [False, True], ids=["out_of_place", "in_place"])
def test_routing_weights_without_grad_skip_their_gradient(reuse_saved, monkeypatch):
    """Weights that need no gradient (an EP layer's received rows carry constant ones): the backward does not
    compute theirs, and every other gradient keeps its bits."""
    from uniep_dynamo.kernels import triton_routing

    args = make(29, 32, 16, 6, 2, GPT_OSS, "io", True)
    spec = dataclasses.replace(args[7], reuse_saved=reuse_saved)
    want = run(args, "triton", monkeypatch, spec=spec)
    calls = []
    inner = triton_routing.routing_weight_grad
    monkeypatch.setattr(triton_routing, "routing_weight_grad", lambda *a, **k: calls.append(1) or inner(*a, **k))
    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    hidden, ids, weights, w_up, w_down, b_up, b_down, _ = args
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, w_up, w_down, b_up, b_down)]
    out = torch.ops.uniep.moe_experts(leaves[0], ids, weights.detach(), *leaves[1:], [], spec.encode())[0]
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
    assert not calls
    got = [out] + [leaves[0].grad] + [t.grad for t in leaves[1:]]
    for name, x, y in zip(("out", "d_hidden", "d_w_up", "d_w_down", "d_b_up", "d_b_down"), got,
                          [want[0], want[1]] + want[3:]):
        assert torch.equal(x, y), name
    # and with weights that need it, the gradient is computed (the spy sees the call)
    run(args, "triton", monkeypatch, spec=spec)
    assert calls


@pytest.mark.parametrize("mode", ["triton", "reference"])
@pytest.mark.parametrize("reuse_saved", [False, True], ids=["out_of_place", "in_place"])
def test_frozen_experts_skip_their_weight_gradients(reuse_saved, mode, monkeypatch):
    """Expert weights and biases that need no gradient (frozen experts, as in LoRA fine-tuning): the fused backward
    runs neither weight-gradient GEMM (nor the hidden rows' gather they read), autograd gets no gradient for them,
    and the input and routing-weight gradients keep their bits. A trainable bias alone keeps them all computed."""
    from uniep_dynamo.kernels import megakernel

    args = make(29, 32, 16, 6, 2, GPT_OSS, "io", True)
    spec = dataclasses.replace(args[7], reuse_saved=reuse_saved)
    want = run(args, mode, monkeypatch, spec=spec)
    calls = []
    inner = megakernel.weight_grad
    monkeypatch.setattr(megakernel, "weight_grad", lambda *a, **k: calls.append(1) or inner(*a, **k))
    hidden, ids, weights, w_up, w_down, b_up, b_down, _ = args

    def frozen_run(trainable_bias=False):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weights)]
        params = [t.detach().clone() for t in (w_up, w_down, b_up, b_down)]
        params[3].requires_grad_(trainable_bias)
        out = torch.ops.uniep.moe_experts(leaves[0], ids, leaves[1], *params, [], spec.encode())[0]
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
        return out, leaves, params

    out, leaves, params = frozen_run()
    assert not calls
    assert all(p.grad is None for p in params)
    for name, x, y in zip(("out", "d_hidden", "d_weights"), [out, leaves[0].grad, leaves[1].grad], want[:3]):
        assert torch.equal(x, y), name
    _, _, params = frozen_run(trainable_bias=True)
    assert torch.equal(params[3].grad, want[6])
    if mode == "triton":
        assert len(calls) == 2


def _interpreter_config(args):
    """The interpreter's heuristic config for ``args`` (make's tuple)."""
    hidden, ids, _, w_up, w_down = args[:5]
    width = w_down.shape[1] if args[7].down_layout == "io" else w_down.shape[2]
    return kconfig.heuristic_config(ids.numel(), w_up.shape[0], hidden.shape[1], width, interpret=True)


def _late(args):
    """The interpreter's heuristic config for ``args`` with late_routing_weight on, and the one without."""
    base = _interpreter_config(args)
    return dataclasses.replace(base, late_routing_weight=True), base


@pytest.mark.parametrize("case, dtype", [
    ((37, 40, 24, 4, 2, SILU_GLU, "oi", False), torch.float32),   # no tile multiple
    ((23, 32, 16, 8, 8, SILU_GLU, "io", False), torch.float16),   # K == E, [E, in, out] weights, fp16
    ((21, 32, 24, 4, 2, RELU2, "oi", False), torch.float32),      # no gate
    ((3, 32, 16, 32, 8, SILU_GLU, "oi", False), torch.float32),   # idle experts
], ids=["silu", "fp16_k_eq_e", "relu2", "idle_experts"])
def test_late_routing_weight_matches_reference(case, dtype, monkeypatch):
    """The late_routing_weight numerics knob: the routing weights applied after the activation-gradient GEMM, their
    gradient from <dY W_down^T, act>; within tolerance of the reference (the same math, rounded elsewhere), its
    own pass run and the <dY, down> reduction not."""
    from uniep_dynamo.kernels import megakernel, triton_routing

    args = make(*case, dtype=dtype)
    late, base = _late(args)
    calls = []
    for mod, name in ((megakernel, "act_backward_late_weight"), (triton_routing, "routing_weight_grad")):
        inner = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _f=inner, **k: calls.append(_n) or _f(*a, **k))
    with kconfig.use_config(late):
        fused = run(args, "triton", monkeypatch)
    assert calls == ["act_backward_late_weight"]
    assert_close(fused, run(args, "reference", monkeypatch), dtype)
    with kconfig.use_config(base):
        assert not torch.equal(run(args, "triton", monkeypatch)[2], fused[2])  # a numerics knob: other bits


@pytest.mark.parametrize("change", [dict(fuse_gather=True, num_programs=3), dict(reuse_saved=True)],
                         ids=["fused_gather_persistent", "in_place"])
def test_late_routing_weight_keeps_its_bits_across_schedules(change, monkeypatch):
    """Under late_routing_weight the scheduling knobs (the output-gradient rows gathered in the GEMMs or copied, a
    persistent grid) and the in-place backward give the same bits; dropped slots get a zero weight gradient."""
    args = list(make(29, 32, 16, 6, 2, SILU_INTERLEAVED, "oi", False))
    args[1] = args[1].clone()
    args[1][0, 1], args[1][7, 0] = 6, -1
    spec = dataclasses.replace(ExpertsSpec("oi", "oi", SILU_INTERLEAVED, torch.float32, "drop"),
                               reuse_saved=change.get("reuse_saved", False))
    late, _ = _late(args)
    with kconfig.use_config(late):
        want = run(args, "triton", monkeypatch, spec=dataclasses.replace(spec, reuse_saved=False))
    other = dataclasses.replace(late, fuse_gather=change.get("fuse_gather", False))
    if "num_programs" in change:
        other = other.replace_gemms(num_programs=change["num_programs"])
    with kconfig.use_config(other):
        got = run(args, "triton", monkeypatch, spec=spec)
    for x, y in zip(got, want):
        assert (x is None and y is None) or torch.equal(x, y)
    assert want[2][0, 1] == 0 and want[2][7, 0] == 0


def test_late_routing_weight_leaves_weights_without_grad_alone(monkeypatch):
    """Routing weights that need no gradient (what the EP layers hand the experts op: ones, the received rows arriving
    weighted) take the knob-off path, also where the forward kept no down rows (the knob decides that, not whether
    the weights need a gradient): the EP layers keep the single-GPU op's bits with the knob off."""
    from uniep_dynamo.kernels import megakernel

    hidden, ids, weights, w_up, w_down, _, _, spec = make(13, 32, 16, 4, 2, SILU_GLU, "oi", False)
    late, base = _late((hidden, ids, None, w_up, w_down, None, None, spec))
    calls = []
    monkeypatch.setattr(megakernel, "act_backward_late_weight", lambda *a, **k: calls.append(1))
    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    results = []
    for cfg in (late, base):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, w_up, w_down)]
        with kconfig.use_config(cfg):
            out = torch.ops.uniep.moe_experts(leaves[0], ids, weights, leaves[1], leaves[2], None, None, [],
                                              spec.encode())[0]
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
        results.append([out] + [t.grad for t in leaves])
    assert not calls
    for x, y in zip(*results):
        assert torch.equal(x, y)


def _saved_shapes(fn):
    """The shapes of the tensors autograd saves while ``fn`` runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, shapes


def test_late_routing_weight_keeps_no_down_rows(monkeypatch):
    """Under late_routing_weight the fused backward reads no down rows, so autograd keeps none ([rows, H] less
    between forward and backward: 268 MB a layer at Qwen3-30B-A3B's T = 8192); the gradients are those of a
    backward that had them, bit for bit, and where the reference runs that backward instead (UNIEP_KERNELS switched
    between the two), it computes them again. In place (the backend's default; test_backend.py compiles both)."""
    from uniep_dynamo.kernels import megakernel

    T, H, I, E, K = 13, 32, 24, 4, 2
    args = make(T, H, I, E, K, SILU_GLU, "oi", False)
    spec = dataclasses.replace(args[7], reuse_saved=True)
    late, _ = _late(args)
    with kconfig.use_config(late):
        got, shapes = _saved_shapes(lambda: run(args, "triton", monkeypatch, spec=spec))
    assert (T * K, 2 * I) in shapes and (T * K, H) not in shapes, shapes
    # the same backward handed the down rows (a direct call of the kernels' forward and backward)
    hidden, ids, weights, w_up, w_down = args[:5]
    with kconfig.use_config(late):
        out, row_order, slot_row, offsets, up, down = megakernel.experts_forward(hidden, ids, weights, w_up, w_down,
                                                                                 None, None, spec)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        want = megakernel.experts_backward(grad, hidden, ids, weights, w_up, w_down, None, None, row_order, slot_row,
                                           offsets, up, down, spec)
    assert torch.equal(got[0], out)
    for name, x, y in zip(("d_hidden", "d_weights", "d_w_up", "d_w_down"), got[1:5], want[:4]):
        assert torch.equal(x, y), name
    # the forward by the kernels, the backward by the reference: down computed again from up
    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
    with kconfig.use_config(late):
        out = torch.ops.uniep.moe_experts(leaves[0], ids, *leaves[1:], None, None, [], spec.encode())[0]
    monkeypatch.setenv("UNIEP_KERNELS", "reference")
    out.backward(grad)
    assert_close([out] + [t.grad for t in leaves], run(args, "reference", monkeypatch, spec=spec)[:5], torch.float32)


def test_late_routing_weight_config_entries(monkeypatch):
    """A numerics knob: in the numerics key; a tuning-cache entry written before it existed takes the heuristics'
    value (the tuner keeps their numerics), one that names it keeps its own. UNIEP_LATE_ROUTING_WEIGHT sets it over
    the heuristics both ways, and use_config over both."""
    late = dataclasses.replace(kconfig.heuristic_config(4096, 64, 256, 128), late_routing_weight=True)
    base = dataclasses.replace(late, late_routing_weight=False)
    assert "late_routing_weight" in kconfig.NUMERICS_KNOBS and late.numerics_key() != base.numerics_key()
    entry = kconfig.config_to_dict(base)
    old = {k: v for k, v in entry.items() if k != "late_routing_weight"}
    assert kconfig.config_from_dict(old, late) == late and kconfig.config_from_dict(old) == base
    assert kconfig.config_from_dict(entry, late) == base
    gpu = kconfig.heuristic_config(65536, 128, 2048, 768)
    # the heuristics' choice, read shape-free: the same for every shape (Mixtral-8x7B, DeepSeek-V3, decoding-sized)
    for shape in ((65536, 128, 2048, 768), (16384, 8, 4096, 14336), (65536, 256, 7168, 2048), (64, 64, 2048, 1024)):
        assert kconfig.heuristic_config(*shape).late_routing_weight == kconfig.late_routing_weight_on(False), shape
    assert not kconfig.late_routing_weight_on(True)  # the interpreter's heuristics keep it off
    for value in ("0", "1"):
        monkeypatch.setenv("UNIEP_LATE_ROUTING_WEIGHT", value)
        assert kconfig.current_config(65536, 128, 2048, 768, False) == \
            dataclasses.replace(gpu, late_routing_weight=value == "1")
        assert kconfig.current_config(4096, 64, 256, 128, True).late_routing_weight == (value == "1")
        assert kconfig.late_routing_weight_on(True) == (value == "1")
    with kconfig.use_config(base):
        assert not kconfig.late_routing_weight_on(True)


def _gated(args, on: bool = True):
    """The interpreter's heuristic config for ``args`` with gated_epilogue ``on``."""
    return dataclasses.replace(_interpreter_config(args), gated_epilogue=on)


@pytest.mark.parametrize("late, reuse_saved, gemm", [(False, False, "triton"), (True, True, "triton"),
                                                     (True, False, "per_expert_mm")],
                         ids=["weighted_rows", "late_weight_in_place", "per_expert_mm"])
def test_gated_epilogue_layout_keeps_the_knob_off_bits_where_quack_does_not_run(late, reuse_saved, gemm, monkeypatch):
    """config.gated_epilogue stores h with gate and up interleaved; where QuACK's gated GEMM does not run (here: the
    interpreter, the layout forced) the forward computes h and the activation as with the knob off and interleaves h,
    and the backward reads that layout (the activation passes) or a copy in halves (the input-gradient GEMM, the up
    weight's gradient): every output and gradient is the knob-off one, bit for bit, and the saved h is the knob-off
    h interleaved."""
    from uniep_dynamo.kernels import megakernel

    args = make(29, 32, 24, 6, 2, SILU_GLU, "oi", False)
    spec = dataclasses.replace(args[7], reuse_saved=reuse_saved)
    off = dataclasses.replace(_gated(args, False), late_routing_weight=late)
    if gemm == "per_expert_mm":
        monkeypatch.setattr(megakernel, "PER_EXPERT_MM_INTERPRETED", True)
        off = off.replace_gemms(per_expert_mm=True)
    on = dataclasses.replace(off, gated_epilogue=True)
    with kconfig.use_config(off):
        want = run(args, "triton", monkeypatch, spec=spec)
    monkeypatch.setattr(megakernel, "INTERLEAVED_H_INTERPRETED", True)
    copies = []
    for name in ("_interleave", "_deinterleave"):
        monkeypatch.setattr(megakernel, name, lambda *a, _n=name, _f=getattr(megakernel, name): copies.append(_n)
                            or _f(*a))
    with kconfig.use_config(on):
        got = run(args, "triton", monkeypatch, spec=spec)
    # forward: h interleaved once; backward: the input-gradient GEMM's and the up-weight gradient's copies in halves
    assert copies == ["_interleave", "_deinterleave", "_deinterleave"], copies
    for name, a, b in zip(("out", "d_hidden", "d_weights", "d_w_up", "d_w_down"), got, want):
        assert torch.equal(a, b), name
    hidden, ids, weights, w_up, w_down = (t.contiguous() for t in args[:5])
    with kconfig.use_config(on):
        got_up = megakernel.experts_forward(hidden, ids, weights, w_up, w_down, None, None, spec)[4]
    monkeypatch.setattr(megakernel, "INTERLEAVED_H_INTERPRETED", False)
    with kconfig.use_config(on):  # the interpreter's default: the knob leaves the layout as it is
        want_up = megakernel.experts_forward(hidden, ids, weights, w_up, w_down, None, None, spec)[4]
    inter = w_down.shape[2]
    assert torch.equal(got_up[:, 0::2], want_up[:, :inter]) and torch.equal(got_up[:, 1::2], want_up[:, inter:])


@pytest.mark.parametrize("forward_on", [True, False], ids=["on_then_off", "off_then_on"])
def test_gated_epilogue_flipped_between_forward_and_backward_is_refused(forward_on, monkeypatch):
    """UNIEP_GATED_EPILOGUE changed between a forward and its backward would make the backward read the saved h in
    the other layout (silently wrong gradients): the backward refuses with a message naming the variable. Unchanged,
    the same steps run; a later forward at the same address writes its own layout."""
    from uniep_dynamo.kernels import megakernel

    monkeypatch.setattr(megakernel, "INTERLEAVED_H_INTERPRETED", True)
    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    args = make(29, 32, 24, 6, 2, SILU_GLU, "oi", False)
    hidden, ids, weights, w_up, w_down = (t.contiguous() for t in args[:5])
    spec = args[7].encode()

    def step(forward, backward):
        leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
        monkeypatch.setenv("UNIEP_GATED_EPILOGUE", forward)
        out = torch.ops.uniep.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], None, None, [], spec)[0]
        monkeypatch.setenv("UNIEP_GATED_EPILOGUE", backward)
        out.backward(torch.ones_like(out))
        return [t.grad for t in leaves]
    first, second = ("1", "0") if forward_on else ("0", "1")
    want = step(first, first)
    with pytest.raises(RuntimeError, match="UNIEP_GATED_EPILOGUE .*changed between the forward and the backward"):
        step(first, second)
    assert all(torch.equal(a, b) for a, b in zip(step(first, first), want))
    step(second, second)  # the other layout, steps apart: allowed


@pytest.mark.parametrize("case, why", [
    ((13, 16, 8, 4, 2, RELU2, "oi", False), "no gate"),
    ((13, 16, 8, 4, 2, SILU_INTERLEAVED, "oi", False), "the weight interleaves gate and up already"),
    ((13, 16, 8, 4, 2, GELU_GLU, "oi", False), "not SwiGLU"),
    ((11, 8, 4, 4, 2, SILU_GLU, "oi", True), "an up bias"),
    ((11, 8, 4, 4, 2, GPT_OSS, "io", True), "a clamped SwiGLU"),
], ids=["relu2", "interleaved_weight", "gelu", "up_bias", "gpt_oss"])
def test_gated_epilogue_layout_only_for_plain_swiglu_over_halves(case, why, monkeypatch):
    """The gated layout is decided per layer from what forward and backward both see: a SwiGLU (no clamp) over the
    weight's [gate; up] halves with no up bias; elsewhere the knob leaves h as it is."""
    from uniep_dynamo.kernels import megakernel

    monkeypatch.setattr(megakernel, "INTERLEAVED_H_INTERPRETED", True)
    hidden, ids, _, w_up, w_down, b_up, _, spec = make(*case)
    cfg = _gated((hidden, ids, None, w_up, w_down, b_up, None, spec))
    layer = megakernel.Layer(hidden, ids, w_up, w_down, spec, cfg, up_bias=b_up is not None)
    assert not layer.h_interleaved, why
    plain = make(13, 16, 8, 4, 2, SILU_GLU, "oi", False)
    assert megakernel.Layer(plain[0], plain[1], plain[3], plain[4], plain[7], cfg).h_interleaved
    assert not megakernel.Layer(plain[0], plain[1], plain[3], plain[4], plain[7], _gated(plain, False)).h_interleaved


def test_gated_epilogue_config(monkeypatch):
    """A numerics knob: in the numerics key; off in the heuristics (GPU and interpreter); gated_config turns it on
    with the dgated GEMM's tile where the activation-gradient GEMM runs by QuACK; a tuning-cache entry written before
    it existed takes the heuristics' value; UNIEP_GATED_EPILOGUE sets it both ways."""
    qwen = kconfig.heuristic_config(65536, 128, 2048, 768)
    assert "gated_epilogue" in kconfig.NUMERICS_KNOBS
    assert not qwen.gated_epilogue and qwen.up.quack
    assert not kconfig.heuristic_config(65536, 128, 2048, 768, interpret=True).gated_epilogue
    on = kconfig.gated_config(qwen)
    assert on.gated_epilogue and on.grad_act.quack == kconfig.GATED_GRAD_ACT_CONFIG and on.up == qwen.up
    assert on.numerics_key() != qwen.numerics_key()
    # under the knob the up projection's QuACK config decides the layout and the bits (not its tile: it schedules)
    assert on.gated_up() and not dataclasses.replace(on, up=dataclasses.replace(on.up, quack="")).gated_up()
    assert dataclasses.replace(on, up=dataclasses.replace(on.up, quack="")).numerics_key() != on.numerics_key()
    assert dataclasses.replace(on, up=dataclasses.replace(on.up, quack="192x128/pingpong/1x2")).numerics_key() == \
        on.numerics_key()
    mixtral = kconfig.heuristic_config(16384, 8, 4096, 14336)  # no QuACK: the knob alone (its layout needs QuACK)
    assert kconfig.gated_config(mixtral) == dataclasses.replace(mixtral, gated_epilogue=True)
    entry = {k: v for k, v in kconfig.config_to_dict(qwen).items() if k != "gated_epilogue"}
    assert kconfig.config_from_dict(entry, on).gated_epilogue and not kconfig.config_from_dict(entry).gated_epilogue
    assert kconfig.config_from_dict(kconfig.config_to_dict(on), qwen) == on
    for value in ("0", "1"):
        monkeypatch.setenv("UNIEP_GATED_EPILOGUE", value)
        assert kconfig.current_config(65536, 128, 2048, 768, False) == (on if value == "1" else qwen)
        assert kconfig.current_config(4096, 64, 256, 128, True).gated_epilogue == (value == "1")


@pytest.mark.parametrize("top_k", range(1, 9))
def test_every_top_k_from_1_to_8(top_k, monkeypatch):
    """K = 1..8 over 8 experts (K = 8: every token visits every expert), T = 13 (no tile multiple)."""
    args = make(13, 32, 16, 8, top_k)
    assert_close(run(args, "triton", monkeypatch), run(args, "reference", monkeypatch), torch.float32)


def _knob_case(case, reuse_saved):
    """The layer inputs and spec of a GEMM-knob test case (GPT-OSS's hidden states past its clamp limit)."""
    args = make(*case)
    if case[5] == GPT_OSS:
        args = (args[0] * 20,) + args[1:]
    return args, dataclasses.replace(args[7], reuse_saved=reuse_saved)


@pytest.mark.parametrize("case, reuse_saved, calls", [
    # (T, H, I, E, K, gate, layout, bias); expected torch._grouped_mm calls of forward + backward
    ((37, 40, 24, 8, 2, SILU_GLU, "oi", False), True, 5),   # in place: the input-gradient rows go to a saved buffer
    ((23, 32, 16, 8, 3, SILU_INTERLEAVED, "io", False), False, 6),  # interleaved gate, [E, in, out] weights
    ((21, 32, 24, 4, 2, RELU2, "oi", False), False, 6),     # no gate
    ((17, 32, 16, 4, 2, GPT_OSS, "io", True), False, 2),    # biases: only grad_act and grad_input qualify
    ((12, 32, 16, 64, 8, SILU_GLU, "oi", False), False, 6),  # most experts get no token (zero-row groups)
], ids=["silu_oi_in_place", "interleaved_io", "relu2", "gpt_oss_bias", "idle_experts"])
def test_grouped_mm_knob_runs_cutlass_gemms(case, reuse_saved, calls, monkeypatch):
    """GemmConfig.grouped_mm: the GEMMs that qualify run as torch._grouped_mm, with the activation of the up
    projection as an element-wise pass; the layer matches the reference. (On CPU torch._grouped_mm rounds
    differently from the interpreter, so this checks the plumbing; the GPU tests check that the bits hold.)"""
    from uniep_dynamo.kernels import megakernel

    T, H, I, E, K, gate, layout, bias = case
    args, spec = _knob_case(case, reuse_saved)
    monkeypatch.setattr(megakernel, "GROUPED_MM_INTERPRETED", True)
    seen = []
    inner = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: seen.append(1) or inner(*a, **k))
    cfg = kconfig.heuristic_config(T * K, E, H, I, interpret=True).replace_gemms(grouped_mm=True)
    counters.clear()
    with kconfig.use_config(cfg):
        fused = run(args, "triton", monkeypatch, spec=spec)
    assert len(seen) == calls == counters["uniep_kernels"]["grouped_mm_gemms"]
    assert_close(fused, run(args, "reference", monkeypatch), torch.float32)
    # without the flag the interpreter keeps Triton for every GEMM
    monkeypatch.setattr(megakernel, "GROUPED_MM_INTERPRETED", False)
    seen.clear()
    with kconfig.use_config(cfg):
        run(args, "triton", monkeypatch, spec=spec)
    assert not seen


@pytest.mark.parametrize("case, reuse_saved, calls", [
    # (T, H, I, E, K, gate, layout, bias); expected per-expert GEMMs of forward + backward
    ((37, 40, 24, 8, 2, SILU_GLU, "oi", False), True, 6),   # in place: the input-gradient rows into a saved buffer
    ((23, 32, 16, 8, 3, SILU_INTERLEAVED, "io", False), False, 6),  # interleaved gate, [E, in, out] weights
    ((21, 32, 24, 4, 2, RELU2, "oi", False), False, 6),     # no gate
    ((17, 32, 16, 4, 2, GPT_OSS, "io", True), False, 2),    # biases: only grad_act and grad_input qualify
    ((12, 32, 16, 64, 8, SILU_GLU, "oi", False), False, 6),  # most experts get no token (zeroed weight gradients)
], ids=["silu_oi_in_place", "interleaved_io", "relu2", "gpt_oss_bias", "idle_experts"])
def test_per_expert_mm_knob_runs_one_matmul_per_expert(case, reuse_saved, calls, monkeypatch):
    """GemmConfig.per_expert_mm: the GEMMs that qualify run as one torch.mm per expert with rows (into the
    expert's rows of the output, or its slice of a weight gradient; zeros for an expert without rows), from row
    bounds read on the host once per op call; the layer matches the reference. (On CPU this checks the
    plumbing; the GPU tests check the bits.)"""
    from uniep_dynamo.kernels import megakernel

    T, H, I, E, K, gate, layout, bias = case
    args, spec = _knob_case(case, reuse_saved)
    monkeypatch.setattr(megakernel, "PER_EXPERT_MM_INTERPRETED", True)
    mm_calls, reads = [], []
    inner_mm, inner_bounds = torch.mm, megakernel.Layer.host_bounds
    monkeypatch.setattr(torch, "mm", lambda *a, **k: mm_calls.append(1) or inner_mm(*a, **k))

    def counted_bounds(layer, offsets):
        fresh = layer._host_bounds is None or layer._host_bounds[0] is not offsets
        reads.append(fresh)
        return inner_bounds(layer, offsets)

    monkeypatch.setattr(megakernel.Layer, "host_bounds", counted_bounds)
    # grouped_mm stays on too: per_expert_mm takes precedence where both apply
    cfg = kconfig.heuristic_config(T * K, E, H, I, interpret=True).replace_gemms(per_expert_mm=True, grouped_mm=True)
    counters.clear()
    with kconfig.use_config(cfg):
        fused = run(args, "triton", monkeypatch, spec=spec)
    assert counters["uniep_kernels"]["per_expert_mm_gemms"] == calls
    assert counters["uniep_kernels"]["grouped_mm_gemms"] == 0
    routed = int(torch.bincount(args[1].reshape(-1), minlength=E).gt(0).sum())
    # a matmul per expert with rows in each GEMM that qualifies
    assert len(mm_calls) == calls * routed
    # one host read in each op call with a GEMM that qualifies (the biased forward has none)
    assert reads.count(True) == (1 if bias else 2), reads
    monkeypatch.setattr(torch, "mm", inner_mm)
    assert_close(fused, run(args, "reference", monkeypatch), torch.float32)
    # without the flag the interpreter keeps its own GEMMs
    monkeypatch.setattr(megakernel, "PER_EXPERT_MM_INTERPRETED", False)
    counters.clear()
    with kconfig.use_config(cfg.replace_gemms(grouped_mm=False)):
        run(args, "triton", monkeypatch, spec=spec)
    assert counters["uniep_kernels"]["per_expert_mm_gemms"] == 0


def test_per_expert_mm_is_a_numerics_knob_and_the_heuristics_pick_it_for_few_large_experts():
    """The knob is part of numerics_key (a tuned config may not flip it), and the GPU heuristics turn it on for
    the Mixtral-8x7B shape's GEMMs but the up projection, and for none of the many-expert shapes."""
    base = kconfig.heuristic_config(16384, 8, 4096, 14336)
    assert [getattr(base, g).per_expert_mm for g in kconfig.GEMMS] == [False, True, True, True, True, True]
    assert base.numerics_key() != base.replace_gemms(per_expert_mm=False).numerics_key()
    for rows, experts, hidden, inter in ((65536, 128, 2048, 768), (65536, 64, 2048, 1024), (65536, 256, 7168, 2048),
                                         (64, 8, 4096, 14336)):
        cfg = kconfig.heuristic_config(rows, experts, hidden, inter)
        assert not any(getattr(cfg, g).per_expert_mm for g in kconfig.GEMMS), (rows, experts)
    assert not any(getattr(kconfig.heuristic_config(16384, 8, 64, 64, interpret=True), g).per_expert_mm
                   for g in kconfig.GEMMS)


def test_heuristics_run_decode_sized_forward_gemms_by_triton():
    """Decode-sized calls (one to 63 rows an expert on average) run the forward's up and down GEMMs by Triton and the
    backward's by torch._grouped_mm; fewer rows than experts (one token over many experts) and training-sized calls
    run all six by torch._grouped_mm (or QuACK). Scheduling only: the numerics key is the same either way."""
    for rows, experts in ((256, 128), (2048, 128), (64, 8), (8, 8), (8191, 128)):  # Qwen3 T=32 / 256, Mixtral T=32
        cfg = kconfig.heuristic_config(rows, experts, 2048, 768)
        assert [getattr(cfg, g).grouped_mm for g in kconfig.GEMMS] == [False, False, True, True, True, True], rows
        assert cfg.numerics_key() == cfg.replace_gemms(grouped_mm=True).numerics_key()
    for rows, experts in ((8, 128), (2, 8), (8192, 128), (65536, 128), (16384, 8)):
        cfg = kconfig.heuristic_config(rows, experts, 2048, 768)
        assert cfg.up.grouped_mm and cfg.down.grouped_mm, (rows, experts)


def test_quack_knob_config_and_heuristics(monkeypatch):
    """The quack knob: its config strings parse or are refused with the expected form; it is a scheduling knob
    (not in numerics_key); the GPU heuristics set it on every GEMM of many-expert shapes and on none of the Mixtral
    shape's (one matmul per expert there), the interpreter's on none; cache entries written before it read as off;
    and it stays off, with the reason, where QuACK cannot run (here: no CUDA device, or UNIEP_QUACK=0)."""
    from uniep_dynamo.kernels import quack_gemm

    assert quack_gemm.parse_config("192x128/pingpong/1x2") == (192, 128, True, 1, 2)
    assert quack_gemm.gathers("128x256/coop/2x1") and not quack_gemm.gathers("192x128/pingpong/1x2")
    for bad in ("192x128", "192x128/fast/1x2", "100x128/coop/1x1", "128x128/coop/2x2", "128x250/coop/1x1"):
        with pytest.raises(ValueError, match="quack config"):
            quack_gemm.parse_config(bad)
        with pytest.raises(ValueError, match="quack config"):
            kconfig.GemmConfig(quack=bad).validate()
    qwen = kconfig.heuristic_config(65536, 128, 2048, 768)
    assert {g: getattr(qwen, g).quack for g in kconfig.GEMMS} == kconfig.QUACK_CONFIGS
    assert qwen.numerics_key() == qwen.replace_gemms(quack="").numerics_key()
    # under gated_epilogue the dgated GEMM's column tile sets the routing-weight gradient's sum; the rest schedules
    gated = kconfig.gated_config(qwen)
    assert gated.grad_act.quack == kconfig.GATED_GRAD_ACT_CONFIG
    other = gated.replace_gemms(quack="128x192/pingpong/2x1")
    assert dataclasses.replace(other, grad_act=gated.grad_act).numerics_key() == gated.numerics_key()
    assert other.numerics_key() != gated.numerics_key()
    assert "quack" in kconfig.SCHEDULING_KNOBS
    for rows, experts, hidden, inter in ((16384, 8, 4096, 14336), (4096, 8, 4096, 14336), (64, 128, 2048, 768),
                                         (16384, 128, 2048, 768), (65536, 256, 7168, 2048)):
        # few experts (Mixtral-8x7B, measured slower), fewer than 512 rows an expert (unmeasured): off
        cfg = kconfig.heuristic_config(rows, experts, hidden, inter)
        assert not any(getattr(cfg, g).quack for g in kconfig.GEMMS), (rows, experts)
    assert kconfig.heuristic_config(65536, 64, 2048, 1024).up.quack  # OLMoE at T = 8192
    assert not any(getattr(kconfig.heuristic_config(65536, 128, 2048, 768, interpret=True), g).quack
                   for g in kconfig.GEMMS)
    entry = kconfig.config_to_dict(qwen)
    assert kconfig.config_from_dict(entry) == qwen
    old = {**entry, **{g: {k: v for k, v in entry[g].items() if k != "quack"} for g in kconfig.GEMMS}}
    assert kconfig.config_from_dict(old) == qwen.replace_gemms(quack="")
    with pytest.raises(ValueError, match="quack config"):  # a cache entry naming a malformed config: refused
        kconfig.config_from_dict({**entry, "down": {**entry["down"], "quack": "128x128"}})
    assert quack_gemm.unavailable_reason(torch.device("cpu")) == "not a CUDA device"
    assert not quack_gemm.usable(torch.device("cpu"), "192x128/pingpong/1x2")
    assert not quack_gemm.usable(torch.device("cpu"), "")
    monkeypatch.setenv("UNIEP_QUACK", "0")
    assert quack_gemm.unavailable_reason(torch.device("cuda")) == "UNIEP_QUACK=0"
    monkeypatch.delenv("UNIEP_QUACK")
    monkeypatch.setattr(quack_gemm, "_FAILED", [])
    monkeypatch.setattr(quack_gemm, "_device_ok", lambda device: True)
    monkeypatch.setattr(quack_gemm, "_module", lambda: ((None, None), None))
    assert quack_gemm.unavailable_reason(torch.device("cuda")) is None
    quack_gemm.failed(quack_gemm.NotCompiledBeforeCapture("not launched before"))  # that call only: the knob stays on
    assert quack_gemm.unavailable_reason(torch.device("cuda")) is None
    quack_gemm.failed(RuntimeError("no kernel image"))  # a QuACK call raised: off for the process, with the error
    assert quack_gemm.unavailable_reason(torch.device("cuda")) == \
        "a QuACK GEMM failed earlier (RuntimeError: no kernel image)"


def test_quack_knob_in_the_interpreter_keeps_the_triton_path(monkeypatch):
    """A config asking for QuACK in Triton's interpreter (CPU) runs the Triton GEMMs: the same bits as without it."""
    args = make(37, 32, 16, 6, 4, SILU_GLU, "oi", False)
    base = kconfig.heuristic_config(37 * 4, 6, 32, 16, interpret=True)
    with kconfig.use_config(base):
        expected = run(args, "triton", monkeypatch)
    counters.clear()
    with kconfig.use_config(dataclasses.replace(base, **{g: dataclasses.replace(getattr(base, g), quack=q)
                                                         for g, q in kconfig.QUACK_CONFIGS.items()})):
        got = run(args, "triton", monkeypatch)
    assert counters["uniep_kernels"]["quack_gemms"] == 0 and counters["uniep_kernels"]["triton_backward"] == 1
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, expected))


class _FakeQuackConfig:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def _fake_quack_gemm(calls, first_row_zero: bool = True):
    """QuACK's gemm_tuned.fn contract (quack 0.4.1's gemm_interface/gemm.py), computed by torch in fp32: varlen_m --
    A k-major, out n-major, out[r] = A[A_idx[r] or r] @ B[e(r)] for the rows of each group (cu[e] to cu[e + 1]; the
    rows before cu[0] and from cu[-1] on are not written, and cu[0] is 0 unless ``first_row_zero`` is False);
    varlen_k -- A [M, K rows] m-major, B [K rows, N] n-major, out[e] = A[:, A_idx[k] or k over e's rows] @ B[e's
    rows]; gather needs cluster_n == 1."""
    def gemm(A, B, out, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None, config=None):
        calls.append("m" if cu_seqlens_m is not None else "k")
        assert A_idx is None or (config.cluster_n == 1 and A_idx.dtype == torch.int32)
        bounds = cu_seqlens_m if cu_seqlens_m is not None else cu_seqlens_k
        assert bounds.dtype == torch.int32 and (cu_seqlens_m is None) != (cu_seqlens_k is None)
        cu = bounds.tolist()
        assert cu[0] == 0 or (not first_row_zero and cu_seqlens_m is not None), cu
        if cu_seqlens_m is not None:  # its shape assertions: out [A_idx's or A's rows, B's columns]
            assert A.stride(-1) == 1 and out.stride(-1) == 1
            assert tuple(out.shape) == ((A_idx if A_idx is not None else A).shape[0], B.shape[-1])
            rows = A.float()[A_idx.long()] if A_idx is not None else A.float()
            for e in range(len(cu) - 1):
                out[cu[e]:cu[e + 1]] = (rows[cu[e]:cu[e + 1]] @ B[e].float()).to(out.dtype)
        else:  # out [E, A's rows, B's columns]; A's K (or the gather index) as long as B's rows
            assert A.stride(-2) == 1 and B.stride(-1) == 1
            assert tuple(out.shape) == (len(cu) - 1, A.shape[0], B.shape[-1])
            assert (A_idx.shape[0] if A_idx is not None else A.shape[1]) == B.shape[0]
            cols = A.float()[:, A_idx.long()] if A_idx is not None else A.float()
            for e in range(len(cu) - 1):
                out[e] = (cols[:, cu[e]:cu[e + 1]] @ B[cu[e]:cu[e + 1]].float()).to(out.dtype)
    return gemm


@pytest.mark.parametrize("quack", [False, True], ids=["triton", "quack_contract"])
def test_gemms_over_runs_of_experts_past_row_0(quack, monkeypatch):
    """rows_gemm's ``lead`` (the EP device plan pipeline's chunk GEMMs: up with its activation, down, the activation
    gradient): each run of experts past row 0 writes its own rows only (test_gpu_megakernel.run_expert_runs checks
    after each run) and, over the runs, the bits of the same GEMMs over every expert at once; an expert with no rows
    and a run of one expert included. By Triton (fp32), and by QuACK where a config asks for it (here a stand-in for
    QuACK's GEMM that keeps its contract, taking the run's group bounds from its first row; bf16 as QuACK takes)."""
    from test_gpu_megakernel import run_expert_runs
    from uniep_dynamo.kernels import megakernel, quack_gemm
    from uniep_dynamo.kernels.triton_gemm import STORE

    E, H, I = 5, 32, 16
    counts = [7, 0, 20, 1, 13]
    capacity = sum(counts) + 5
    dtype = torch.bfloat16 if quack else torch.float32
    g = torch.Generator().manual_seed(11)
    x = torch.randn(capacity, H, generator=g).to(dtype)
    w_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype)
    w_down = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    spec = ExpertsSpec("oi", "oi", SILU_GLU, dtype)
    cfg = kconfig.heuristic_config(capacity, E, H, I, interpret=True)
    calls = []
    monkeypatch.setattr(quack_gemm, "_FAILED", [])  # nothing has turned the knob off
    if quack:  # QuACK's configs on the GEMMs, run as on a GPU by the stand-in
        cfg = dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), quack=kconfig.QUACK_CONFIGS[g])
                                          for g in kconfig.GEMMS})
        monkeypatch.setattr(quack_gemm, "unavailable_reason", lambda device: None)
        monkeypatch.setattr(quack_gemm, "_module", lambda: ((_fake_quack_gemm(calls, first_row_zero=False),
                                                             _FakeQuackConfig), None))
        plain = megakernel.Layer

        class OnGpu(plain):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.interpret = False  # as on a GPU: QuACK's path

        monkeypatch.setattr(megakernel, "Layer", OnGpu)
    runs = [(0, 2), (2, 3), (3, 5)]
    whole = run_expert_runs(x, w_up, w_down, spec, cfg, counts, runs, lead=False)
    by_runs = run_expert_runs(x, w_up, w_down, spec, cfg, counts, runs, lead=True)
    assert len(calls) == (3 + 3 * len(runs) if quack else 0)
    routed = sum(counts)
    for name, a, b in zip(("up", "act", "down", "grad_act"), by_runs, whole):
        assert torch.equal(a[:routed], b[:routed]), name
        assert a[routed:].isnan().all() and b[routed:].isnan().all(), f"{name}: rows past the routed end written"
    # the activation pass of a run past row 0 leaves the rows before it (here marked 7) alone
    layer = megakernel.Layer(x, (capacity, 1), w_up[2:], w_down[2:], spec, cfg)
    ends = torch.tensor(counts).cumsum(0)
    act = by_runs[1].clone()
    act[:counts[0]] = 7
    megakernel._act_forward(layer, up=by_runs[0], act=act, offsets=ends[2:], lead=True, **layer.weight_halves())
    assert torch.equal(act[counts[0]:routed], by_runs[1][counts[0]:routed]) and (act[:counts[0]] == 7).all()
    # offsets that are no view past the first element of their tensor: refused before any GEMM (QuACK's knob stays on)
    with pytest.raises(ValueError, match="view past the first element"):
        megakernel.rows_gemm(layer, cfg.down, a=x[:, :I].contiguous(), gather=False, row_order=None,
                             b=layer.down_eff, n=H, k=I, epilogue=STORE, offsets=ends[2:].clone(), lead=True)
    assert quack_gemm.failure() is None
    # torch._grouped_mm's and per_expert_mm's group bounds start at row 0: a run past it refuses them
    for knob in ("grouped_mm", "per_expert_mm"):
        with pytest.raises(ValueError, match="lead"):
            megakernel.rows_gemm(layer, dataclasses.replace(cfg.down, **{knob: True}), a=x[:, :I], gather=False,
                                 row_order=None, b=layer.down_eff, n=H, k=I, epilogue=STORE, offsets=ends[2:], lead=True)


@pytest.mark.parametrize("layout", ["oi", "io"])
def test_quack_calls_follow_its_operand_contract(layout, monkeypatch):
    """Where the quack knob runs (a Hopper GPU; here a stand-in for QuACK's GEMM that checks its operand contract and
    computes in torch), the rows GEMMs with and without the token gather, and both weight gradients (the gathered one
    written through the gradient's transpose for [out, in] weights), give what the GEMMs compute."""
    from uniep_dynamo.kernels import megakernel, quack_gemm
    from uniep_dynamo.kernels.triton_gemm import STORE

    calls = []
    monkeypatch.setattr(quack_gemm, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(quack_gemm, "_module", lambda: ((_fake_quack_gemm(calls), _FakeQuackConfig), None))
    T, H, I, E, K = 10, 16, 8, 4, 2
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[:, 0] = torch.where(ids[:, 0] == 3, 0, ids[:, 0])  # expert 3 may get fewer rows; an empty group is fine
    w_up = torch.randn(*((E, 2 * I, H) if layout == "oi" else (E, H, 2 * I)), generator=g).bfloat16()
    w_down = torch.randn(*((E, H, I) if layout == "oi" else (E, I, H)), generator=g).bfloat16()
    spec = ExpertsSpec(layout, layout, SILU_GLU, torch.bfloat16)
    cfg = kconfig.heuristic_config(T * K, E, H, I)  # the GPU heuristics, with QuACK's configs on every GEMM
    cfg = dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), quack=q)
                                      for g, q in kconfig.QUACK_CONFIGS.items()})
    layer = megakernel.Layer(hidden, ids, w_up, w_down, spec, config=cfg)
    layer.interpret = False  # as on a GPU
    row_order = torch.argsort(ids.reshape(-1), stable=True)
    offsets = torch.bincount(ids.reshape(-1), minlength=E).cumsum(0)
    bounds = [0, *offsets.tolist()]
    tok = row_order // K
    d_up = torch.randn(T * K, 2 * I, generator=g).bfloat16()
    dy = torch.randn(T * K, H, generator=g).bfloat16()

    def per_expert(fn):
        return [fn(slice(bounds[e], bounds[e + 1]), e) for e in range(E)]

    assert megakernel.quack_gathers_rows(layer, cfg.up, hidden, layer.up_eff)
    up = megakernel.rows_gemm(layer, cfg.up, a=hidden, gather=True, row_order=row_order, b=layer.up_eff, n=2 * I, k=H,
                              epilogue=STORE, offsets=offsets)
    want = torch.cat(per_expert(lambda s, e: (hidden[tok[s]].float() @ layer.up_eff[e].float()).bfloat16()))
    assert torch.equal(up, want)
    down_b = layer.down_eff.transpose(1, 2)
    act = megakernel.rows_gemm(layer, cfg.grad_act, a=dy, gather=False, row_order=row_order, b=down_b, n=I, k=H,
                               epilogue=STORE, offsets=offsets)
    assert torch.equal(act, torch.cat(per_expert(lambda s, e: (dy[s].float() @ down_b[e].float()).bfloat16())))
    dims = (1, 2) if layout == "io" else (2, 1)
    assert megakernel.quack_gathers_weight_rows(layer, cfg.wgrad_up, hidden, d_up, dims[0])
    d_w_up = megakernel.weight_grad(layer, cfg.wgrad_up, p=hidden, p_gather=True, q=d_up, q_gather=False,
                                    q_scale=False, row_order=row_order, w=None, offsets=offsets, grad=w_up.shape,
                                    m_dim=dims[0], n_dim=dims[1])
    want = torch.stack(per_expert(lambda s, e: (hidden[tok[s]].float().t() @ d_up[s].float()).bfloat16()))
    assert torch.equal(d_w_up, want if layout == "io" else want.transpose(1, 2))
    d_w_down = megakernel.weight_grad(layer, cfg.wgrad_down, p=act, p_gather=False, q=dy, q_gather=False,
                                      q_scale=False, row_order=row_order, w=None, offsets=offsets, grad=w_down.shape,
                                      m_dim=dims[0], n_dim=dims[1])
    want = torch.stack(per_expert(lambda s, e: (act[s].float().t() @ dy[s].float()).bfloat16()))
    assert torch.equal(d_w_down, want if layout == "io" else want.transpose(1, 2))
    assert d_w_up.is_contiguous() and d_w_down.is_contiguous()
    assert calls == ["m", "m", "k", "k"]
    # Where QuACK's path would not compute the same thing, it stands aside: a bias (the gather then stays with the
    # rows copy), an output buffer of other rows, a GEMM writing fewer columns than the weight has
    assert not megakernel.quack_gathers_rows(layer, cfg.up, hidden, layer.up_eff, torch.zeros(E, 2 * I).bfloat16())
    assert not megakernel.quack_gathers_weight_rows(layer, cfg.wgrad_up, hidden, d_up, dims[0],
                                                    torch.zeros(E, 2 * I).bfloat16())
    assert not megakernel._use_quack(layer, cfg.grad_act, dy, down_b, torch.empty(T * K + 8, I).bfloat16())
    assert megakernel._use_quack(layer, cfg.grad_act, dy, down_b, torch.empty(T * K, I).bfloat16())
    assert not megakernel._use_quack(layer, cfg.grad_act, torch.cat([dy, dy[:8]]), down_b)
    # A QuACK call that raises turns the knob off and the GEMM takes its other path (here, as on a GPU, a weight
    # gradient with an output of its own: torch._grouped_mm, stood in by its per-expert products)
    def raising(*args, **kwargs):
        raise RuntimeError("compile failed")
    monkeypatch.setattr(quack_gemm, "_FAILED", [])
    monkeypatch.setattr(quack_gemm, "_module", lambda: ((raising, _FakeQuackConfig), None))
    monkeypatch.setattr(megakernel, "_use_grouped_mm", lambda *args: True)
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: torch.stack(
        per_expert(lambda s, e: (a[:, s].float() @ b[s].float()).bfloat16())))
    again = megakernel.weight_grad(layer, cfg.wgrad_down, p=act, p_gather=False, q=dy, q_gather=False, q_scale=False,
                                   row_order=row_order, w=None, offsets=offsets, grad=w_down.shape, m_dim=dims[0],
                                   n_dim=dims[1])
    assert torch.equal(again, d_w_down) and "compile failed" in quack_gemm._FAILED[0]


@pytest.mark.parametrize("late", [False, True], ids=["weighted_rows", "late_routing_weight"])
def test_input_first_keeps_the_bits(late, monkeypatch):
    """experts_backward's input_first (the EP device plan's pipelined backward): the input-gradient GEMM runs as soon
    as d_up is ready and the hook gets its rows before either weight-gradient GEMM runs; the input-gradient rows and
    every other gradient are those of the usual order, bit for bit, on both branches of the backward
    (late_routing_weight's and the weighted rows'). Without input_rows, or with reuse_saved, it is refused; so is a
    given d_act under late_routing_weight."""
    from uniep_dynamo.kernels import megakernel

    args = make(29, 32, 24, 6, 2, SILU_GLU, "oi", False)
    hidden, ids, weights, w_up, w_down = args[:5]
    spec = args[7]
    cfg = _late(args)[0 if late else 1]
    events = []
    monkeypatch.setattr(megakernel, "weight_grad", lambda *a, _f=megakernel.weight_grad, **k:
                        events.append("wgrad") or _f(*a, **k))
    with kconfig.use_config(cfg):
        out, row_order, slot_row, offsets, up, down = megakernel.experts_forward(hidden, ids, weights, w_up, w_down,
                                                                                 None, None, spec)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))

        def backward(**kw):
            rows = torch.empty(ids.numel(), hidden.shape[1], dtype=w_up.dtype)
            got = megakernel.experts_backward(grad, hidden, ids, weights, w_up, w_down, None, None, row_order,
                                              slot_row, offsets, up, down, spec, input_rows=rows, **kw)
            return rows, got
        want_rows, want = backward()
        assert events == ["wgrad", "wgrad"]
        events.clear()
        handed = []
        got_rows, got = backward(input_first=lambda rows: events.append("rows") or handed.append(rows))
        with pytest.raises(ValueError, match="input_first"):
            megakernel.experts_backward(grad, hidden, ids, weights, w_up, w_down, None, None, row_order, slot_row,
                                        offsets, up, down, spec, input_first=lambda rows: None)
        if late:  # a given activation gradient is the weighted rows' GEMM: refused where the weights come later
            with pytest.raises(ValueError, match="d_act"):
                megakernel.experts_backward(grad, hidden, ids, weights, w_up, w_down, None, None, row_order,
                                            slot_row, offsets, up, down, spec, d_act=torch.empty(0))
    assert events == ["rows", "wgrad", "wgrad"], events
    assert handed[0].data_ptr() == got_rows.data_ptr()
    assert torch.equal(got_rows, want_rows), "input-gradient rows"
    assert got[0] is None and want[0] is None  # input_rows: the rows are not combined
    for name, a, b in zip(("d_weights", "d_w_up", "d_w_down"), got[1:4], want[1:4]):
        assert torch.equal(a, b), name
