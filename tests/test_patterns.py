"""Layer 2: rewrites. What matched, what the graph holds afterwards, and the cases that must NOT match."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
import uniep_dynamo  # noqa: F401
from uniep_dynamo.report import count_uniep_ops
from uniep_dynamo.spec import decode_spec
from conftest import TOLERANCE, max_rel_err

E, H, I, K = 4, 16, 8, 2


class HandWrittenExperts(nn.Module):
    """The HF grouped_mm experts forward written out by hand, with knobs that change one constant."""

    def __init__(self, dtype=torch.float32, descending=False, histc_min=0, swap_halves=False, gate_scale=None,
                 leak_offsets=False, weights_as_buffers=False, combine="sum", out_casts=()):
        super().__init__()
        up = torch.randn(E, 2 * I, H, dtype=dtype) * 0.2
        down = torch.randn(E, H, I, dtype=dtype) * 0.2
        if weights_as_buffers:
            self.register_buffer("gate_up_proj", up)
            self.register_buffer("down_proj", down)
        else:
            self.gate_up_proj = nn.Parameter(up)
            self.down_proj = nn.Parameter(down)
        self.descending, self.histc_min, self.swap_halves = descending, histc_min, swap_halves
        self.gate_scale, self.leak_offsets, self.combine = gate_scale, leak_offsets, combine
        self.out_casts = out_casts

    def weights(self, hidden):
        """(gate_up_proj, down_proj) as the GEMMs read them (``hidden``: the layer's input)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, hidden, top_k_index, top_k_weights):
        k = top_k_index.size(-1)
        tokens = hidden.size(0)
        weights = top_k_weights.reshape(-1)
        ids = top_k_index.reshape(-1)
        ids_sorted, perm = torch.sort(ids, descending=self.descending)
        x = hidden[perm // k]
        w = weights[perm]
        counts = torch.histc(ids_sorted.float(), bins=E, min=self.histc_min, max=E - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate_up_proj, down_proj = self.weights(hidden)
        h = torch.ops.transformers.grouped_mm_fallback(x, gate_up_proj.transpose(-2, -1), offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        if self.swap_halves:
            gate, up = up, gate
        a = F.silu(gate) * up
        if self.gate_scale is not None:
            a = a * self.gate_scale
        y = torch.ops.transformers.grouped_mm_fallback(a, down_proj.transpose(-2, -1), offs=offsets)
        y = y * w.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        y = y[inv].view(tokens, k, -1)
        out = y.sum(dim=1) if self.combine == "sum" else y.mean(dim=1)
        for dtype in self.out_casts:
            out = out.to(dtype)
        if self.leak_offsets:
            return out, offsets
        return out


class LowRankDeltaExperts(HandWrittenExperts):
    """Expert weights that are no parameters: frozen base weights (buffers) plus a trainable low-rank delta per
    expert, computed in the forward, as PEFT (0.21.2; not 0.18.0) computes LoRA on the experts' 3-D parameters."""

    def __init__(self, rank=2):
        super().__init__(weights_as_buffers=True)
        self.a_up = nn.Parameter(torch.randn(E, rank, H) * 0.1)
        self.b_up = nn.Parameter(torch.randn(E, 2 * I, rank) * 0.1)
        self.a_down = nn.Parameter(torch.randn(E, rank, I) * 0.1)
        self.b_down = nn.Parameter(torch.randn(E, H, rank) * 0.1)

    def weights(self, hidden):
        return self.gate_up_proj + self.b_up @ self.a_up, self.down_proj + self.b_down @ self.a_down


class HiddenScaledExperts(HandWrittenExperts):
    """A down weight computed from the layer's input (not from its routed rows): its gradient reaches the hidden
    states through the weight as well."""

    def weights(self, hidden):
        return self.gate_up_proj, self.down_proj * (hidden.mean() + 1.0)


class TitanStyleExperts(nn.Module):
    """Plain PyTorch MoE written the torchtitan way: stable sort, histc of the unsorted ids, torch._grouped_mm with
    [E, H, I] weights, scatter back by assignment. bf16: torch._grouped_mm's meta function takes no other dtype."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.w1 = nn.Parameter((torch.randn(E, H, 2 * I) * 0.2).to(dtype))
        self.w2 = nn.Parameter((torch.randn(E, I, H) * 0.2).to(dtype))

    def forward(self, hidden, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.sort(flat, stable=True)
        perm = order[1]
        offsets = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E - 1), 0).to(torch.int32)
        x = hidden[perm // k]
        h = torch._grouped_mm(x, self.w1, offs=offsets)
        gate, up = h[..., :I], h[..., I:]
        y = torch._grouped_mm(F.gelu(gate, approximate="tanh") * up, self.w2, offs=offsets)
        y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        back = torch.empty_like(y)
        back[perm] = y
        return back.view(hidden.shape[0], k, H).sum(dim=1)


def routed(tokens=9, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g).to(dtype).requires_grad_()
    return x, ids, w


class GraphCapture:
    """An inner backend that keeps the graph uniep hands on."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [n.target for gm in self.graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def compile_and_compare(module, args, dtype=torch.float32, capture=None):
    capture = capture or GraphCapture()
    compiled = torch.compile(module, backend="uniep", options={"inner_backend": capture})
    x, ids, w = args
    eager = module(x, ids, w)
    eager_out = eager[0] if isinstance(eager, tuple) else eager
    eager_grads = torch.autograd.grad(eager_out.sum(), [x, w] + list(module.parameters()))
    out = compiled(x, ids, w)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out.sum(), [x, w] + list(module.parameters()))
    assert max_rel_err(out, eager_out) < TOLERANCE[dtype]
    for got, want in zip(grads, eager_grads):
        assert max_rel_err(got, want) < TOLERANCE[dtype]
    return capture


def test_hand_written_hf_spelling_rewrites_to_one_op():
    torch.manual_seed(0)
    capture = compile_and_compare(HandWrittenExperts(), routed())
    targets = capture.targets()
    assert targets.count(torch.ops.uniep.moe_experts.default) == 1
    for gone in ("sort", torch.sort, torch.histc, torch.cumsum, torch.ops.transformers.grouped_mm_fallback):
        assert gone not in targets, f"{gone} should have been rewritten away"
    assert counters["uniep"]["moe_experts"] == 1


def test_swapped_halves_and_a_scale_are_part_of_the_gate_program():
    """Structure, not spelling: act(up) * gate * 0.5 is recorded as such and still equals eager."""
    torch.manual_seed(0)
    compile_and_compare(HandWrittenExperts(swap_halves=True, gate_scale=0.5), routed())
    assert counters["uniep"]["moe_experts"] == 1


@pytest.mark.parametrize("module", ["buffers", "low_rank_delta", "hidden_scaled"])
def test_expert_weights_that_are_not_parameters_rewrite(module):
    """The op computes sum_k w * down_e(gate(up_e(x))) for any weight tensors of the right shapes: buffers (no weight
    gradient) and weights computed in the forward (a frozen base plus a trainable low-rank delta, PEFT's LoRA on
    expert parameters; a weight scaled by the layer's input), whose gradient reaches what they are computed from.
    Output and every gradient (the hidden states' included) equal eager's."""
    torch.manual_seed(0)
    experts = {"buffers": lambda: HandWrittenExperts(weights_as_buffers=True), "low_rank_delta": LowRankDeltaExperts,
               "hidden_scaled": HiddenScaledExperts}[module]()
    capture = compile_and_compare(experts, routed())
    assert counters["uniep"]["moe_experts"] == 1 and counters["uniep"]["unfused"] == 0
    assert capture.targets().count(torch.ops.uniep.moe_experts.default) == 1
    assert module != "low_rank_delta" or len(list(experts.parameters())) == 4


def test_torchtitan_style_plain_pytorch_rewrites():
    torch.manual_seed(0)
    capture = compile_and_compare(TitanStyleExperts(), routed(dtype=torch.bfloat16), dtype=torch.bfloat16)
    assert counters["uniep"]["moe_experts"] == 1
    assert torch._grouped_mm not in capture.targets()


@pytest.mark.parametrize("knobs, reason", [
    ({"descending": True}, "sorted ascending"),                     # a constant that differs: sort order
    ({"histc_min": 1}, "does not count experts"),                   # a constant that differs: histc range
    ({"combine": "mean"}, "combine is a sum over K"),                # mean over k is not the op's combine
    ({"leak_offsets": True}, "also used by"),                        # an intermediate escapes the region
])
def test_must_not_match(knobs, reason, caplog):
    torch.manual_seed(0)
    module = HandWrittenExperts(**knobs)
    x, ids, w = routed()
    capture = GraphCapture()
    with caplog.at_level(logging.WARNING, logger="uniep"):
        out = torch.compile(module, backend="uniep", options={"inner_backend": capture})(x, ids, w)
    eager = module(x, ids, w)
    out, eager = (out[0], eager[0]) if isinstance(out, tuple) else (out, eager)
    assert torch.equal(out, eager), "the unfused graph must run unchanged"
    assert counters["uniep"]["moe_experts"] == 0
    assert torch.ops.uniep.moe_experts.default not in capture.targets()
    messages = [r.getMessage() for r in caplog.records if r.name == "uniep"]
    assert len(messages) == 1, messages
    assert "runs unfused" in messages[0] and reason in messages[0]


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("dtype, out_casts, op_out, graph_cast", [
    (FP32, (BF16, FP32), BF16, FP32),  # review finding: eager rounds the fp32 sum to bf16 and back; so must we
    (FP32, (FP32,), FP32, None),       # x.to(x.dtype): no cast at all
    (FP32, (BF16,), BF16, None),       # one narrowing at the end: the op's own rounding of its fp32 combine
    (BF16, (FP32,), BF16, FP32),       # a bf16 sum widened: eager's bf16 rounding stays, the widening follows the op
    (FP32, (BF16, FP16), BF16, FP16),  # two narrowings: the op rounds to bf16, the graph casts that to fp16
], ids=["fp32-bf16-fp32", "fp32-fp32", "fp32-bf16", "bf16-fp32", "fp32-bf16-fp16"])
def test_casts_after_the_k_sum_keep_every_rounding(dtype, out_casts, op_out, graph_cast):
    """The root absorbs the casts after the K-sum; the op rounds its fp32 combine once (to its output dtype) and
    one cast may follow it, so every rounding eager does along the chain is done, in eager's order."""
    torch.manual_seed(0)
    module, (x, ids, w) = HandWrittenExperts(dtype=dtype, out_casts=out_casts), routed(dtype=dtype)
    capture = GraphCapture()
    out = torch.compile(module, backend="uniep", options={"inner_backend": capture})(x, ids, w)
    eager = module(x, ids, w)
    assert out.dtype == eager.dtype and max_rel_err(out, eager) < TOLERANCE[dtype]
    if dtype == FP32:
        assert torch.equal(out, eager), "an fp32 sum, then its casts: eager's bits"
    for rounded_to in {d for d in (dtype,) + out_casts if d != FP32}:
        assert torch.equal(out, out.to(rounded_to).to(out.dtype)), f"eager's {rounded_to} rounding was skipped"
    params = list(module.parameters())
    grads = torch.autograd.grad(out.float().sum(), [x, w] + params)
    for got, want in zip(grads, torch.autograd.grad(eager.float().sum(), [x, w] + params)):
        assert max_rel_err(got, want) < TOLERANCE[dtype]
    assert counters["uniep"]["moe_experts"] == 1
    (call,) = [n for gm in capture.graphs for n in gm.graph.nodes if n.target is torch.ops.uniep.moe_experts.default]
    assert decode_spec(call.args[-1]).out_dtype == op_out
    (result,) = call.users
    assert [u.args[1] for u in result.users if u.target == "to"] == ([graph_cast] if graph_cast else [])


def test_a_cast_chain_the_op_cannot_round_like_eager_is_declined(caplog):
    """fp32 sum -> fp16 -> fp32 -> bf16: the op rounds once and casts once; three roundings run unfused."""
    torch.manual_seed(0)
    module, (x, ids, w) = HandWrittenExperts(out_casts=(FP16, FP32, BF16)), routed()
    capture = GraphCapture()
    with caplog.at_level(logging.WARNING, logger="uniep"):
        out = torch.compile(module, backend="uniep", options={"inner_backend": capture})(x, ids, w)
    assert torch.equal(out, module(x, ids, w)), "the unfused graph must run unchanged"
    assert counters["uniep"]["moe_experts"] == 0
    assert torch.ops.uniep.moe_experts.default not in capture.targets()
    text = " ".join(r.getMessage() for r in caplog.records if r.name == "uniep")
    assert "runs unfused" in text and "float32 K-sum is cast float16 -> float32 -> bfloat16" in text, text


def test_float64_is_refused_with_a_clear_message(caplog):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "batched_mm"  # HF's eager grouped_mm path has no float64 kernel on CPU
    experts = MixtralExperts(cfg).double()
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    x, ids, w = routed(dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="uniep"):
        out = torch.compile(experts, backend="uniep", options={"inner_backend": "eager"})(x, ids, w)
    assert torch.equal(out, experts(x, ids, w))
    assert counters["uniep"]["moe_experts"] == 0
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "float64; supported dtypes are float32, float16, bfloat16" in text


def test_rewrite_is_logged_with_module_path(caplog):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "grouped_mm"  # what from_config/from_pretrained choose by default
    block = MixtralSparseMoeBlock(cfg)
    with caplog.at_level(logging.INFO, logger="uniep"):
        torch.compile(block, backend="uniep", options={"inner_backend": "eager"})(torch.randn(1, 5, H))
    lines = [r.getMessage() for r in caplog.records if r.name == "uniep"]
    assert any(line.startswith("uniep: rewrote experts (grouped_mm spelling") for line in lines), lines
    assert counters["uniep"]["moe_experts"] == 1


def test_backward_graph_holds_the_backward_op():
    """AOTAutograd sees one opaque node in the forward graph and one in the backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = [n.target for n in gm.graph.nodes]
            graphs[name + "_uniep"] = count_uniep_ops(gm.graph)
            return make_boxed_func(gm.forward)
        return compiler

    inner = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    torch.manual_seed(0)
    module = HandWrittenExperts()
    x, ids, w = routed()
    out = torch.compile(module, backend="uniep", options={"inner_backend": inner})(x, ids, w)
    out.sum().backward()
    assert graphs["forward"].count(torch.ops.uniep.moe_experts.default) == 1
    # the in-place backward (the backend's default, reuse_saved_buffers=True), auto-functionalized by
    # AOTAutograd (inductor runs it in place on the saved buffers), and its input gradient's combine
    assert graphs["backward_uniep"] == {"moe_experts_backward": 1, "moe_experts_backward_combine": 1}
    assert torch.ops.aten.sort.default not in graphs["forward"]


class BiasAfterViews(nn.Module):
    """Takes the gate/up views of the projection, then adds the bias in place: eager's views see the
    bias, so reading them as bias-free would be wrong. Must not be rewritten."""

    def __init__(self):
        super().__init__()
        self.w_up = nn.Parameter(torch.randn(E, 2 * I, H) * 0.2)
        self.b_up = nn.Parameter(torch.randn(E, 2 * I) * 0.2)
        self.w_down = nn.Parameter(torch.randn(E, H, I) * 0.2)

    def forward(self, hidden, top_k_index, top_k_weights):
        k = top_k_index.size(-1)
        ids_sorted, perm = torch.sort(top_k_index.reshape(-1))
        offsets = torch.cumsum(torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(hidden[perm // k], self.w_up.transpose(-2, -1), offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        h.add_(self.b_up[ids_sorted])
        y = torch.ops.transformers.grouped_mm_fallback(F.silu(gate) * up, self.w_down.transpose(-2, -1), offs=offsets)
        y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv].view(hidden.shape[0], k, -1).sum(dim=1)


def test_views_taken_before_an_in_place_bias_add_are_not_matched(caplog):
    torch.manual_seed(0)
    module = BiasAfterViews()
    x, ids, w = routed()
    with caplog.at_level(logging.WARNING, logger="uniep"), torch.no_grad():
        out = torch.compile(module, backend="uniep", options={"inner_backend": "eager"})(x, ids, w)
        assert torch.equal(out, module(x, ids, w))
    assert counters["uniep"]["moe_experts"] == 0
    assert "before its in-place bias add" in " ".join(r.getMessage() for r in caplog.records)


def test_equal_sizes_of_separate_symbols_are_proven_by_a_guard():
    """Two graph inputs whose sizes Dynamo gave separate symbols (no duck sizing, as HF's EP experts graph
    gets after its split sizes turn dynamic): equal in the trace, so same_int_or_guard installs a guard,
    and a call where they differ compiles a new graph instead of reusing the proven one."""
    import torch.fx.experimental._config as fx_config

    from uniep_dynamo.patterns import graph_utils as gu
    seen = []

    def backend(gm, example_inputs):
        a, b = (n.meta["example_value"].shape[0] for n in gm.graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor))
        seen.append((gu.same_int(a, b), gu.same_int_or_guard(a, b)))
        return gm.forward

    torch._dynamo.reset()
    with fx_config.patch(use_duck_shape=False):
        fn = torch.compile(lambda x, y: x.sum() + y.sum(), backend=backend, dynamic=True)
        fn(torch.randn(5), torch.randn(5))
        fn(torch.randn(7), torch.randn(7))  # the guard holds: no new graph
        assert seen == [(False, True)]
        fn(torch.randn(7), torch.randn(3))  # it fails: a new graph, where the sizes are not equal
        assert seen == [(False, True), (False, False)]
