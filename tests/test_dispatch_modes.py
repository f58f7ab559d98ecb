"""uniep's ops where a Python dispatch handler runs them: compiled autograd (the backward traced and compiled by the
backend; AOT autograd checks each compiled graph's custom ops for aliasing on its first call, from inside a
TorchDispatchMode) and a user's mode (a FLOP counter, a debug mode). Such a handler runs an op with functorch's
dispatch keys excluded; the reference backward takes torch.func, whose wrapped tensors then reached the CPU kernel
("Cannot access storage of TensorWrapper"). Each case checks that the ops ran and that the results are those without
the handler (eager's, or the same bits)."""
import collections

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import uniep_dynamo  # noqa: F401
from conftest import TOLERANCE, max_rel_err
from hf_models import build_model
from test_models import loss_and_grads
from test_reference import GPT_OSS, SILU_GLU, make
from uniep_dynamo import report
from uniep_dynamo.ops import moe_experts_out


def test_hf_model_under_compiled_autograd():
    """Compiled autograd with uniep as its compiler (``torch._dynamo.compiled_autograd._enable``, what
    ``torch._dynamo.config.compiled_autograd`` turns on around a compiled backward): the backward is traced and
    compiled by uniep too, and runs the backward ops of the forward's rewrite (the reference kernels here; the fused
    ones: test_gpu_bf16_hf_model_under_compiled_autograd)."""
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, logits, grads = loss_and_grads(model, ids)
    compiled = torch.compile(model, backend="uniep")
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="uniep")), report.recording() as rec:
        c_loss, c_logits, c_grads = loss_and_grads(model, ids, compiled)
        again = loss_and_grads(model, ids, compiled)  # the compiled backward's second call (no aliasing check)
    assert counters["compiled_autograd"]["captures"] >= 1
    assert counters["uniep"]["moe_experts"] == 2 and counters["uniep"]["unfused"] == 0
    # the compiled-autograd graph, compiled by uniep as a graph of its own, calls the two layers' backward ops
    backward_calls = sum(n.get("moe_experts_backward", 0) for g in rec.graphs for n in (g.aot_graphs or {}).values())
    assert backward_calls >= 2, [g.aot_graphs for g in rec.graphs]
    assert max_rel_err(c_loss, loss) <= TOLERANCE[torch.float32]
    assert max_rel_err(c_logits, logits) <= TOLERANCE[torch.float32]
    assert c_grads.keys() == grads.keys()
    for name in grads:
        assert max_rel_err(c_grads[name], grads[name]) <= 1e-4, name
        assert torch.equal(again[2][name], c_grads[name]), name


class OpsSeen(TorchDispatchMode):
    """A user's mode: counts the ops it runs, by name (as a FLOP counter or a debug mode does)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", [(13, 16, 8, 4, 2, SILU_GLU, "oi", False), (11, 8, 4, 4, 2, GPT_OSS, "io", True)])
def test_op_under_a_users_dispatch_mode(case):
    """A user's TorchDispatchMode around forward and backward of the op (eager; Dynamo does not run a compiled
    region under a dispatch mode): its handler runs the uniep ops; output and gradients are those without it."""
    T, H, I, E, K, gate, layout, bias = case
    hidden, ids, weights, w_up, w_down, b_up, b_down, spec = make(T, H, I, E, K, gate, layout, bias)
    leaves = [t.requires_grad_() for t in (hidden, weights, w_up, w_down, b_up, b_down) if t is not None]

    def run():
        out = moe_experts_out(hidden, ids, weights, w_up, w_down, b_up, b_down, spec.encode())
        return (out, *torch.autograd.grad(out.square().sum(), leaves))
    expected = run()
    with OpsSeen() as seen:
        got = run()
    assert seen.ops["uniep.moe_experts"] == 1 and seen.ops["uniep.moe_experts_backward"] == 1, seen.ops
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_ep_layer_at_world_size_1_under_a_users_dispatch_mode(overlap, tmp_path):
    """uniep.ep_layer (a one-rank gloo group, the reference kernels) forward and backward under a user's mode: the
    mode runs the EP op and its backward, whose experts backward takes torch.func; output and gradients are the same
    bits as without the mode."""
    from test_ep_single_rank import ep_layer_fn, one_rank_group, qwen3_like_case, run_layer

    case = qwen3_like_case(12, 8, 6, 4, 2, torch.float32, torch.device("cpu"))
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        fn = ep_layer_fn(case[-1], group, overlap)
        want, _ = run_layer(fn, case)
        with OpsSeen() as seen:
            got, _ = run_layer(fn, case)
    assert seen.ops["uniep.ep_layer"] == 1 and seen.ops["uniep.ep_layer_backward"] == 1, seen.ops
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_bf16_hf_model_under_compiled_autograd():
    """On CUDA in bf16 (the fused kernels, QuACK's GEMMs where installed): compiled autograd runs the ops' backward
    with the gradients of the same compile without it, within bf16's tolerance, and the same bits twice."""
    model = build_model("qwen3_moe", dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(7)).cuda()
    options = {"inner_backend": "aot_eager"}
    compiled = torch.compile(model, backend="uniep", options=options)
    plain = loss_and_grads(model, ids, compiled)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="uniep", options=options)):
        first = loss_and_grads(model, ids, compiled)
        second = loss_and_grads(model, ids, compiled)
    assert counters["compiled_autograd"]["captures"] >= 1 and counters["uniep"]["moe_experts"] == 2
    assert counters["uniep_kernels"]["triton_backward"] == 6  # 2 layers, 3 steps: the fused backward each time
    assert torch.equal(first[0], plain[0])  # the forward is the same compiled graph
    for name in plain[2]:
        assert max_rel_err(first[2][name], plain[2][name]) <= TOLERANCE[torch.bfloat16], name
        assert torch.equal(second[2][name], first[2][name]), name
