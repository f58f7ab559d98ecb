"""Layer 1: the reference op against a naive per-token loop, its backward by gradcheck, bad input."""
import pytest
import torch
import torch.nn.functional as F

from conftest import TOLERANCE, max_rel_err
from uniep_dynamo.kernels import gate_program, reference
from uniep_dynamo.ops import moe_experts_out
from uniep_dynamo.spec import ExpertsSpec

SILU_GLU = gate_program.encode("chunk", ["call", "mul", [["call", "silu", [["gate"]], {}], ["up"]], {}])
GELU_GLU = gate_program.encode("chunk", ["call", "mul", [["call", "gelu", [["gate"]], {}], ["up"]], {}])
RELU2 = gate_program.encode("none", ["call", "square", [["call", "relu", [["h"]], {}]], {}])
GELU_TANH_GLU = gate_program.encode("chunk", ["call", "mul", [
    ["call", "gelu", [["gate"]], {"approximate": ["const", "tanh"]}], ["up"]], {}])
SILU_INTERLEAVED = gate_program.encode("interleave", gate_program.decode(SILU_GLU)[1])
# GPT-OSS: interleaved halves, clamps, alpha sigmoid, (up + 1)
GPT_OSS = gate_program.encode("interleave", [
    "call", "mul", [
        ["call", "add", [["call", "clamp", [["up"]], {"min": ["const", -7.0], "max": ["const", 7.0]}], ["const", 1]], {}],
        ["call", "mul", [
            ["call", "clamp", [["gate"]], {"min": ["const", None], "max": ["const", 7.0]}],
            ["call", "sigmoid", [["call", "mul", [
                ["call", "clamp", [["gate"]], {"min": ["const", None], "max": ["const", 7.0]}], ["const", 1.702]], {}]], {}],
        ], {}],
    ], {}])


# MuseSpark's post-expert norm: RMSNorm of (y * (1 + w)), w a vector operand
POST_RMS = gate_program.encode("post", [
    "call", "mul", [
        ["call", "mul", [["y"], ["operand", 0]], {}],
        ["call", "rsqrt", [["call", "add", [["call", "mean", [
            ["call", "pow", [["call", "mul", [["y"], ["operand", 0]], {}], ["const", 2]], {}], ["const", -1]],
            {"keepdim": ["const", True]}], ["const", 1e-6]], {}]], {}],
    ], {}])


def naive(hidden, ids, weights, w_up, w_down, b_up, b_down, spec: ExpertsSpec, post_operands=()):
    """One token and one slot at a time: the definition the op must equal."""
    rows = []
    for t in range(hidden.shape[0]):
        acc = torch.zeros(w_down.shape[1] if spec.down_layout == "oi" else w_down.shape[2], dtype=torch.float64)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            wu = w_up[e] if spec.up_layout == "io" else w_up[e].t()
            wd = w_down[e] if spec.down_layout == "io" else w_down[e].t()
            h = hidden[t] @ wu + (b_up[e] if b_up is not None else 0)
            a = gate_program.apply_gate(spec.gate, h.unsqueeze(0))[0]
            y = a @ wd + (b_down[e] if b_down is not None else 0)
            if spec.post is not None:
                y = gate_program.apply_post(gate_program.decode(spec.post)[1], y.unsqueeze(0), post_operands)[0]
            acc = acc + y.double() * weights[t, k].double()
        rows.append(acc)
    return torch.stack(rows) if rows else hidden.new_zeros(0, w_down.shape[1]).double()


def make(T, H, I, E, K, gate=SILU_GLU, layout="oi", bias=False, dtype=torch.float32, ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = I if gate_program.decode(gate)[0] == "none" else 2 * I
    shape_up = (E, width, H) if layout == "oi" else (E, H, width)
    shape_down = (E, H, I) if layout == "oi" else (E, I, H)
    w_up = (torch.randn(shape_up, generator=g) * 0.2).to(dtype)
    w_down = (torch.randn(shape_down, generator=g) * 0.2).to(dtype)
    b_up = (torch.randn(E, width, generator=g) * 0.1).to(dtype) if bias else None
    b_down = (torch.randn(E, H, generator=g) * 0.1).to(dtype) if bias else None
    hidden = torch.randn(T, H, generator=g).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    weights = torch.rand(T, K, generator=g).to(dtype)
    spec = ExpertsSpec(layout, layout, gate, dtype)
    return hidden, ids, weights, w_up, w_down, b_up, b_down, spec


CASES = [
    # (T, H, I, E, K, gate, layout, bias)
    (1, 8, 4, 4, 2, SILU_GLU, "oi", False),    # a single token
    (13, 16, 8, 4, 2, SILU_GLU, "oi", False),  # Mixtral-like
    (9, 8, 4, 8, 8, SILU_GLU, "oi", False),    # K == E: every token visits every expert
    (9, 8, 4, 8, 1, GELU_GLU, "oi", False),    # K == 1, GELU gate
    (10, 8, 6, 4, 2, RELU2, "oi", False),      # no gate: relu(x)^2
    (11, 8, 4, 4, 2, GPT_OSS, "io", True),     # GPT-OSS: [E, H, 2I] layout, biases, interleaved clamped gate
    (5, 8, 4, 64, 4, SILU_GLU, "oi", False),   # many experts, most get no token
]


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_naive_loop(case):
    T, H, I, E, K, gate, layout, bias = case
    args = make(T, H, I, E, K, gate, layout, bias)
    out = moe_experts_out(*args[:7], args[7].encode())
    assert max_rel_err(out, naive(*args)) < 1e-6


@pytest.mark.parametrize("case", CASES)
def test_backward_gradcheck(case):
    """The hand-written backward equals autograd's numerical Jacobian (float64)."""
    T, H, I, E, K, gate, layout, bias = case
    hidden, ids, weights, w_up, w_down, b_up, b_down, spec = make(min(T, 5), 4, 3, E, K, gate, layout, bias,
                                                                  dtype=torch.float64)
    spec = ExpertsSpec(spec.up_layout, spec.down_layout, spec.gate, torch.float64)
    tensors = [t.requires_grad_() if t is not None else None for t in (hidden, weights, w_up, w_down, b_up, b_down)]
    h, w, wu, wd, bu, bd = tensors

    def fn(h, w, wu, wd, *biases):
        bu_, bd_ = (biases + (None, None))[:2] if biases else (None, None)
        return torch.ops.uniep.moe_experts(h, ids, w, wu, wd, bu_, bd_, [], spec.encode())[0]

    inputs = (h, w, wu, wd) + ((bu, bd) if bias else ())
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_match_naive(dtype):
    args = make(12, 16, 8, 4, 2, dtype=dtype)
    out = moe_experts_out(*args[:7], args[7].encode())
    assert out.dtype == dtype
    assert max_rel_err(out, naive(*args)) < TOLERANCE[dtype] * 2


def test_empty_batch():
    args = make(0, 8, 4, 4, 2)
    hidden = args[0].requires_grad_()
    out = moe_experts_out(hidden, *args[1:7], args[7].encode())
    assert out.shape == (0, 8)
    out.sum().backward()
    assert hidden.grad.shape == (0, 8)


def test_all_tokens_on_one_expert_and_idle_experts_get_zero_grads():
    T, K = 6, 1
    ids = torch.full((T, K), 2, dtype=torch.long)
    hidden, ids, weights, w_up, w_down, _, _, spec = make(T, 8, 4, 4, K, ids=ids)
    w_up.requires_grad_()
    w_down.requires_grad_()
    out = moe_experts_out(hidden, ids, weights, w_up, w_down, None, None, spec.encode())
    assert max_rel_err(out, naive(hidden, ids, weights, w_up, w_down, None, None, spec)) < 1e-6
    out.sum().backward()
    idle = [0, 1, 3]
    assert torch.equal(w_up.grad[idle], torch.zeros_like(w_up.grad[idle]))
    assert torch.equal(w_down.grad[idle], torch.zeros_like(w_down.grad[idle]))
    assert w_up.grad[2].abs().sum() > 0


def test_nan_and_inf_propagate_per_token_like_eager():
    hidden, ids, weights, w_up, w_down, _, _, spec = make(6, 8, 4, 4, 2)
    hidden[1, 3] = float("nan")
    hidden[4, 0] = float("inf")
    out = moe_experts_out(hidden, ids, weights, w_up, w_down, None, None, spec.encode())
    expected = naive(hidden, ids, weights, w_up, w_down, None, None, spec)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    clean = [0, 2, 3, 5]
    assert torch.isfinite(out[clean]).all()
    assert max_rel_err(out[clean], expected[clean]) < 1e-6


def test_non_contiguous_inputs():
    hidden, ids, weights, w_up, w_down, _, _, spec = make(10, 8, 4, 4, 2)
    wide = torch.randn(10, 16)
    wide[:, ::2] = hidden
    ids_t = ids.t().contiguous().t()
    out = moe_experts_out(wide[:, ::2], ids_t, weights.t().contiguous().t(), w_up, w_down, None, None, spec.encode())
    assert torch.equal(out, moe_experts_out(hidden, ids, weights, w_up, w_down, None, None, spec.encode()))


def test_out_of_range_ids_are_dropped_or_clamped():
    """HF's expert-parallel sentinels (id >= E): "drop" makes the slot contribute nothing, output and
    gradients; "clamp" computes it with expert E-1, as HF's batched_mm spelling does."""
    hidden, ids, weights, w_up, w_down, _, _, spec = make(5, 8, 4, 4, 2)
    sentinel = ids.clone()
    sentinel[0, 1] = 4
    sentinel[3, 0] = 7
    w = weights.clone().requires_grad_()
    out = torch.ops.uniep.moe_experts(hidden, sentinel, w, w_up, w_down, None, None, [], spec.encode())[0]
    dropped = weights.clone()
    dropped[0, 1] = dropped[3, 0] = 0
    assert max_rel_err(out, naive(hidden, ids, dropped, w_up, w_down, None, None, spec)) < 1e-6
    out.sum().backward()
    assert w.grad[0, 1] == 0 and w.grad[3, 0] == 0 and w.grad[1, 0] != 0

    clamp = ExpertsSpec(spec.up_layout, spec.down_layout, spec.gate, spec.out_dtype, "clamp")
    out = moe_experts_out(hidden, sentinel, weights, w_up, w_down, None, None, clamp.encode())
    assert max_rel_err(out, naive(hidden, sentinel.clamp(0, 3), weights, w_up, w_down, None, None, clamp)) < 1e-6


def test_two_runs_are_bitwise_equal():
    hidden, ids, weights, w_up, w_down, b_up, b_down, spec = make(33, 16, 8, 8, 2, GPT_OSS, "io", True)
    results = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down, b_up, b_down)]
        out = torch.ops.uniep.moe_experts(leaves[0], ids, *leaves[1:], [], spec.encode())[0]
        out.backward(torch.ones_like(out))
        results.append([out] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_routing_plan_is_stable_by_expert_token_k():
    ids = torch.tensor([[2, 0], [0, 2], [1, 0]])
    row_order, slot_row, offsets = reference.routing_plan(ids, 3)
    # expert 0: slots 1 (t0,k1), 2 (t1,k0), 5 (t2,k1); expert 1: slot 4; expert 2: slots 0, 3
    assert row_order.tolist() == [1, 2, 5, 4, 0, 3]
    assert offsets.tolist() == [3, 4, 6]
    assert torch.equal(row_order[slot_row], torch.arange(6))


def test_gate_program_classify_and_describe():
    assert gate_program.classify(SILU_GLU) == "silu_glu"
    assert gate_program.classify(GELU_GLU) == "gelu_glu"
    assert gate_program.classify(RELU2) == "relu2"
    assert gate_program.classify(GPT_OSS) == "clamped_swiglu"
    assert gate_program.clamped_glu_params(GPT_OSS) == (1.702, 7.0, 1.0)
    assert gate_program.classify(gate_program.encode("interleave", gate_program.decode(SILU_GLU)[1])) == "silu_glu"
    # GELU gating the up half of a relu2-style single projection is not a program any kernel knows
    assert gate_program.classify(gate_program.encode("none", ["call", "gelu", [["h"]], {}])) is None
    assert gate_program.describe(SILU_GLU) == "(silu(gate) * up) [chunk]"
    h = torch.randn(3, 8)
    assert torch.equal(gate_program.apply_gate(SILU_GLU, h), F.silu(h[:, :4]) * h[:, 4:])


def test_compiled_glue_matches_eager_glue(monkeypatch):
    """The CUDA path fuses the element-wise glue with inductor; the same functions compile on CPU."""
    args = make(17, 16, 8, 4, 2, GPT_OSS, "io", True)
    spec = args[7].encode()
    leaves = [t.clone().requires_grad_() for t in (args[0], args[2], args[3], args[4], args[5], args[6])]
    out = torch.ops.uniep.moe_experts(leaves[0], args[1], *leaves[1:], [], spec)[0]
    out.backward(torch.ones_like(out))
    monkeypatch.setenv("UNIEP_COMPILE_GLUE", "always")
    leaves2 = [t.detach().clone().requires_grad_() for t in leaves]
    out2 = torch.ops.uniep.moe_experts(leaves2[0], args[1], *leaves2[1:], [], spec)[0]
    out2.backward(torch.ones_like(out2))
    assert max_rel_err(out2, out) < 1e-6
    for a, b in zip(leaves2, leaves):
        assert max_rel_err(a.grad, b.grad) < 1e-5


def test_post_program_rms_norm_forward_and_gradcheck():
    """A post-expert norm with a learned vector: forward against the naive loop, backward by gradcheck."""
    hidden, ids, weights, w_up, w_down, _, _, spec = make(6, 4, 3, 4, 2, dtype=torch.float64)
    spec = ExpertsSpec("oi", "oi", SILU_GLU, torch.float64, post=POST_RMS)
    scale = (torch.rand(4, dtype=torch.float64) + 0.5)
    out = moe_experts_out(hidden, ids, weights, w_up, w_down, None, None, spec.encode(), [scale])
    assert max_rel_err(out, naive(hidden, ids, weights, w_up, w_down, None, None, spec, [scale])) < 1e-10

    def fn(h, w, wu, wd, s):
        return torch.ops.uniep.moe_experts(h, ids, w, wu, wd, None, None, [s], spec.encode())[0]

    inputs = tuple(t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down, scale))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)


def test_gate_program_with_scalar_operands_gradcheck():
    """Under dynamic=True GPT-OSS's limit and alpha arrive as 0-d tensors: the gate reads them as
    operands, and their gradients come back too."""
    gate = gate_program.encode("interleave", [
        "call", "mul", [
            ["call", "add", [["call", "clamp", [["up"]], {"min": ["call", "neg", [["operand", 0]], {}],
                                                        "max": ["operand", 0]}], ["const", 1]], {}],
            ["call", "mul", [["gate"], ["call", "sigmoid", [["call", "mul", [["gate"], ["operand", 1]], {}]], {}]], {}],
        ], {}])
    hidden, ids, weights, w_up, w_down, b_up, b_down, _ = make(5, 4, 3, 4, 2, gate, "io", True, dtype=torch.float64)
    spec = ExpertsSpec("io", "io", gate, torch.float64).encode()
    limit, alpha = torch.tensor(7.0, dtype=torch.float64), torch.tensor(1.702, dtype=torch.float64)

    def fn(h, wu, wd, a):
        return torch.ops.uniep.moe_experts(h, ids, weights, wu, wd, b_up, b_down, [limit, a], spec)[0]

    inputs = tuple(t.clone().requires_grad_() for t in (hidden, w_up, w_down, alpha))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)
