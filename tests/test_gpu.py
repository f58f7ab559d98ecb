"""GPU checks (marked `gpu`): the bf16 aten._grouped_mm spelling, the CUDA histc(.int()) spelling,
tolerance against eager, and bitwise reproducibility. Run on the device machines."""
import pytest
import torch
from torch._dynamo.utils import counters

import uniep_dynamo  # noqa: F401
from conftest import TOLERANCE, max_rel_err
from hf_families import build_experts, discover_experts_classes, routed_inputs
from hf_models import build_model

pytestmark = pytest.mark.gpu
CLASSES = {c.__name__: c for _, c in discover_experts_classes()}


def on_cuda(experts, dtype, tokens=300, top_k=2):
    experts = experts.cuda()
    x, ids, w = routed_inputs(experts, tokens=tokens, top_k=top_k, dtype=dtype)
    return experts, x.detach().cuda().requires_grad_(), ids.cuda(), w.detach().cuda().requires_grad_()


def fwd_bwd(fn, experts, x, ids, w):
    out = fn(x, ids, w)
    grads = torch.autograd.grad(out.float().sum(), [x, w] + list(experts.parameters()))
    return [out] + list(grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", ["MixtralExperts", "GptOssExperts", "Qwen3MoeExperts", "DeepseekV3Experts"])
def test_cuda_spellings_rewrite_and_match_eager(name, dtype):
    experts, x, ids, w = on_cuda(build_experts(CLASSES[name], "grouped_mm", dtype), dtype)
    eager = fwd_bwd(experts, experts, x, ids, w)
    compiled = torch.compile(experts, backend="uniep")
    got = fwd_bwd(compiled, experts, x, ids, w)
    assert counters["uniep"]["moe_experts"] == 1
    for a, b in zip(got, eager):
        assert max_rel_err(a, b) <= TOLERANCE[dtype] * 2


def test_bf16_twenty_runs_bitwise_identical():
    experts, x, ids, w = on_cuda(build_experts(CLASSES["MixtralExperts"], "grouped_mm", torch.bfloat16),
                                 torch.bfloat16, tokens=1000)
    compiled = torch.compile(experts, backend="uniep")
    first = fwd_bwd(compiled, experts, x, ids, w)
    for _ in range(19):
        again = fwd_bwd(compiled, experts, x, ids, w)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_whole_model_bf16_training_step():
    model = build_model("mixtral", dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, 96, (2, 64), device="cuda")
    eager = model(input_ids=ids, labels=ids).loss
    compiled = torch.compile(model, backend="uniep")
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert counters["uniep"]["moe_experts"] == 2
    assert max_rel_err(loss, eager) <= TOLERANCE[torch.bfloat16]


def test_idle_experts_get_exact_zero_weight_grads():
    """torch._grouped_mm must leave zeros (not stale memory) for experts without rows."""
    experts = build_experts(CLASSES["MixtralExperts"], "grouped_mm", torch.bfloat16).cuda()
    num_experts = experts.gate_up_proj.shape[0]
    compiled = torch.compile(experts, backend="uniep")
    for trial in range(5):
        poison = torch.full((64 * 2**20,), float("nan"), device="cuda", dtype=torch.bfloat16)  # recycled below
        del poison
        x = torch.randn(50, experts.gate_up_proj.shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ids = torch.full((50, 2), trial % num_experts, device="cuda")
        ids[:, 1] = (trial + 1) % num_experts
        w = torch.rand(50, 2, device="cuda", dtype=torch.bfloat16)
        experts.zero_grad(set_to_none=True)
        compiled(x, ids, w).float().sum().backward()
        idle = [e for e in range(num_experts) if e not in (trial % num_experts, (trial + 1) % num_experts)]
        for grad in (experts.gate_up_proj.grad, experts.down_proj.grad):
            assert torch.equal(grad[idle], torch.zeros_like(grad[idle]))
            assert torch.isfinite(grad).all()


def test_gpt_oss_dynamic_bf16_rewrites_with_scalar_operands():
    model = build_model("gpt_oss", dtype=torch.bfloat16).cuda()
    compiled = torch.compile(model, backend="uniep", dynamic=True)
    for seq in (24, 40):
        ids = torch.randint(0, 96, (2, seq), device="cuda")
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        assert max_rel_err(loss, model(input_ids=ids, labels=ids).loss) <= TOLERANCE[torch.bfloat16]
    assert counters["uniep"]["moe_experts"] >= 2 and counters["uniep"]["unfused"] == 0


def scores_as_close_as_inductors(runs: dict, start: int, first_step: int = 0) -> int:
    """generate() runs by eager, inductor and uniep: each step's scores from ``first_step`` on are as close to eager's
    for uniep as twice inductor's error (or bf16's tolerance), up to the first step where uniep's or inductor's tokens
    so far differ from eager's (a near-tie in bf16 forks a sequence). Returns how many steps were compared."""
    want, baseline, got = runs["eager"], runs["inductor"], runs["uniep"]
    compared = 0
    for step in range(first_step, len(got.scores)):
        prefix = start + step
        if not (torch.equal(got.sequences[:, :prefix], want.sequences[:, :prefix])
                and torch.equal(baseline.sequences[:, :prefix], want.sequences[:, :prefix])):
            break
        err, inductor_err = (max_rel_err(run.scores[step], want.scores[step]) for run in (got, baseline))
        assert err <= max(2 * inductor_err, TOLERANCE[torch.bfloat16]), (step, err, inductor_err)
        compared += 1
    return compared


def test_generate_with_hf_compile_config_under_cuda_graphs():
    """generate()'s own compilation as HF documents it: a static cache and ``compile_config=CompileConfig(backend=...)``
    in HF's default mode, "reduce-overhead" (CUDA graphs around the decode steps' forward; the prefill runs eager).
    uniep rewrites both layers' router and experts in each decode graph, a second generate() (replaying the recorded
    graphs) gives the first's bits, and the decode steps' scores are as close to eager's as inductor's under the same
    config while the runs chose the same tokens (step 1 always: its prefix is the eager prefill's)."""
    from transformers import CompileConfig

    ids = torch.randint(0, 96, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                  cache_implementation="static")
    runs = {}
    for backend in ("eager", "inductor", "uniep"):
        torch._dynamo.reset()
        counters.clear()
        model = build_model("qwen3_moe", dtype=torch.bfloat16).cuda().eval()
        config = {"disable_compile": True} if backend == "eager" else {"compile_config": CompileConfig(backend=backend)}
        with torch.no_grad():
            runs[backend] = model.generate(ids, **kwargs, **config)
            if backend == "uniep":
                again = model.generate(ids, **kwargs, **config)  # replays the recorded graphs
                assert torch.equal(again.sequences, runs[backend].sequences)
                assert all(torch.equal(a, b) for a, b in zip(again.scores, runs[backend].scores))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and counters["uniep"]["moe_experts"] == counters["uniep"]["moe_router"] == 2 * graphs
    assert counters["uniep"]["unfused"] == 0
    assert scores_as_close_as_inductors(runs, ids.shape[1], first_step=1) >= 1  # step 0 is the eager prefill's


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_generate_bf16_runs_the_fused_ops_in_prefill_and_decode(family):
    """generate() on the GPU, bf16, the model compiled in place: the prefill and every decode step (two tokens a step,
    one a sequence) run the fused router and experts kernels, and each step's scores are as close to eager's as those
    of the same model compiled by inductor (in bf16 the compiled attention and norms round differently from eager, by
    more in the decode steps than in the prefill), while the runs have chosen the same tokens (a near-tie in bf16 may
    fork them; the steps after a fork see other prefixes and are not compared)."""
    ids = torch.randint(0, 96, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    kwargs = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    runs = {}
    for backend in ("eager", "inductor", "uniep"):
        model = build_model(family, dtype=torch.bfloat16).cuda().eval()
        if backend != "eager":
            model.compile(backend=backend)
        with torch.no_grad():
            runs[backend] = model.generate(ids, **kwargs)
    # both layers' router and experts rewritten in the prefill graph and at least one decode graph
    assert counters["uniep"]["moe_experts"] == counters["uniep"]["moe_router"] >= 4
    steps = len(runs["uniep"].scores)
    assert steps == len(runs["eager"].scores) == 5
    assert counters["uniep_kernels"]["triton_forward"] == 2 * steps  # the prefill and each decode step, both layers
    assert counters["uniep_kernels"]["triton_router"] == 2 * steps
    scores_as_close_as_inductors(runs, ids.shape[1])


def _op_graph_case(E=16, H=256, I=128, seed=0):
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    g = torch.Generator("cuda").manual_seed(seed)
    w_up = torch.randn(E, 2 * I, H, device="cuda", generator=g).bfloat16() * 0.05
    w_down = torch.randn(E, H, I, device="cuda", generator=g).bfloat16() * 0.05
    gate = encode("chunk", SILU_GLU_EXPR)
    specs = [ExpertsSpec("oi", "oi", gate, torch.bfloat16, inference=flag).encode() for flag in (False, True)]
    return w_up, w_down, specs, g


def _routed(T, E, H, K, g):
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=-1).indices
    weights = torch.rand(T, K, device="cuda", generator=g).bfloat16()
    return hidden, ids, weights


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_op_graphs_replay_gives_the_kernels_bits(mode):
    """The experts op marked for inference (ExpertsSpec.inference) serves small calls from a CUDA graph of its own
    (kernels/op_graphs.py): the first call of a kind runs the kernels, the second is captured and replayed, later
    ones replay; every call, on new inputs each time, gives the unmarked op's bits, with its outputs' shapes. A new
    size and expert weights at a new address are other graphs; more routed slots than MAX_SLOTS take none."""
    from uniep_dynamo.kernels import op_graphs

    op_graphs.clear()
    E, H, I, K = 16, 256, 128, 4
    w_up, w_down, (plain, marked), g = _op_graph_case(E, H, I)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    start = dict(op_graphs.counts)

    def check(T, w_up=w_up):
        hidden, ids, weights = _routed(T, E, H, K, g)
        with context():
            ref = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], plain)
            got = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], marked)
        assert torch.equal(got[0], ref[0])
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in ref]

    for T in (8, 8, 8, 8, 3):
        check(T)
    assert op_graphs.counts["captured"] - start["captured"] == 1
    assert op_graphs.counts["replayed"] - start["replayed"] == 3
    moved = w_up.clone()  # the same values at another address: another graph, the same bits
    for _ in range(3):
        check(8, moved)
    assert op_graphs.counts["captured"] - start["captured"] == 2
    # a prefill's size: captured too, into a pool of its own (the two small graphs share one), replayed in turn
    for T in (1024, 1024, 8, 1024, 8, 1024):
        check(T)
    assert op_graphs.counts["captured"] - start["captured"] == 3
    assert op_graphs.counts["replayed"] - start["replayed"] == 3 + 2 + 5
    assert sorted(pool.graphs for pool in op_graphs._POOLS.values()) == [1, 2]
    check(op_graphs.MAX_SLOTS // K + 1)  # too many slots for a graph: the kernels, as usual
    check(op_graphs.MAX_SLOTS // K + 1)
    assert op_graphs.counts["captured"] - start["captured"] == 3 and op_graphs.counts["failed"] == start["failed"]


def test_op_graphs_serve_each_stream_with_its_own_graph():
    """Calls on two streams, alternating: each stream gets a graph of its own (its buffers written and read in that
    stream's order), and every call gives the unmarked op's bits."""
    from uniep_dynamo.kernels import op_graphs

    op_graphs.clear()
    E, H, I, K = 16, 256, 128, 4
    w_up, w_down, (plain, marked), g = _op_graph_case(E, H, I, seed=2)
    side = torch.cuda.Stream()
    start = dict(op_graphs.counts)
    for i in range(8):
        hidden, ids, weights = _routed(6, E, H, K, g)
        stream = side if i % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            ref = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], plain)
            got = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], marked)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(got[0], ref[0])
    assert op_graphs.counts["captured"] - start["captured"] == 2
    assert op_graphs.counts["replayed"] - start["replayed"] == 6


def test_op_graphs_take_the_router_ops_plan():
    """The router op's plan handed to the marked experts op (as the lowering passes it) is copied into the graph's
    buffers too: the bits of the unmarked op on the same plan, call after call."""
    from uniep_dynamo.kernels import op_graphs
    from uniep_dynamo.spec import RouterSpec

    op_graphs.clear()
    E, H, I, K = 16, 256, 128, 4
    w_up, w_down, (plain, marked), g = _op_graph_case(E, H, I, seed=1)
    router_w = torch.randn(E, H, device="cuda", generator=g).bfloat16() * 0.05
    router = RouterSpec("softmax_topk", E, K, renorm=True, weights_dtype=torch.bfloat16, plan=True).encode()
    for _ in range(5):
        hidden = torch.randn(6, H, device="cuda", generator=g).bfloat16()
        with torch.no_grad():
            _, weights, ids, row_order, slot_row, offsets = torch.ops.uniep.moe_router(hidden, router_w, None, None,
                                                                                       router)
            plan = dict(plan_row_order=row_order, plan_slot_row=slot_row, plan_offsets=offsets)
            ref = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], plain, **plan)
            got = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], marked, **plan)
        assert torch.equal(got[0], ref[0])
    assert op_graphs.counts["replayed"] >= 3


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_moe_block_replays_give_the_router_and_experts_ops_bits(mode):
    """uniep::moe_block (router and experts fused for inference, backend._fuse_block) from one CUDA graph of both:
    call after call, on new hidden states, the bits of the router op followed by the unmarked experts op, with the
    experts reading the router's tensor (one copy in) or another, and with a router that builds the routing plan the
    experts take, at a decode's and a prefill's size; more routed slots than MAX_SLOTS take no graph."""
    from uniep_dynamo.kernels import op_graphs
    from uniep_dynamo.spec import RouterSpec

    op_graphs.clear()
    E, H, I, K = 16, 256, 128, 4
    w_up, w_down, (plain, marked), g = _op_graph_case(E, H, I, seed=3)
    router_w = torch.randn(E, H, device="cuda", generator=g).bfloat16() * 0.05
    router = RouterSpec("softmax_topk", E, K, renorm=True, weights_dtype=torch.bfloat16).encode()
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    start = dict(op_graphs.counts)

    planned = RouterSpec("softmax_topk", E, K, renorm=True, weights_dtype=torch.bfloat16, plan=True).encode()

    def check(T, shared=True, router=router):
        hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        router_hidden = hidden if shared else torch.randn(T, H, device="cuda", generator=g).bfloat16()
        with context():
            _, weights, ids, *plan = torch.ops.uniep.moe_router(router_hidden, router_w, None, None, router)
            given = dict(zip(("plan_row_order", "plan_slot_row", "plan_offsets"), plan)) if router == planned else {}
            ref = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], plain, **given)[0]
            got = torch.ops.uniep.moe_block(router_hidden, router_w, None, None, router, hidden, w_up, w_down, None,
                                            None, marked)
        assert torch.equal(got, ref)

    for T in (8, 8, 8, 8, 3):
        check(T)
    assert op_graphs.counts["captured"] - start["captured"] == 1
    assert op_graphs.counts["replayed"] - start["replayed"] == 3
    for _ in range(3):
        check(8, shared=False)
    assert op_graphs.counts["captured"] - start["captured"] == 2
    check(op_graphs.MAX_SLOTS // K + 1)
    check(op_graphs.MAX_SLOTS // K + 1)
    assert op_graphs.counts["captured"] - start["captured"] == 2 and op_graphs.counts["failed"] == start["failed"]
    for T in (8, 8, 8, 2000, 2000, 2000, 8):  # a router that builds the plan (share_routing_plan), in graphs of a
        check(T, router=planned)              # decode's and a prefill's size
    assert op_graphs.counts["captured"] - start["captured"] == 4 and op_graphs.counts["failed"] == start["failed"]


def test_generate_with_a_compiled_forward_replays_op_graphs_with_the_same_tokens():
    """generate() with the forward compiled in the default mode (no CUDA graphs of inductor's): the decode steps'
    experts calls replay the op's own graphs, and the tokens and scores are those of the same run with
    UNIEP_OP_GRAPHS=0 (the kernels launched one by one), bit for bit."""
    import os

    from uniep_dynamo.kernels import op_graphs

    ids = torch.randint(0, 96, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    runs = {}
    for flag in ("0", "1"):
        torch._dynamo.reset()
        counters.clear()
        op_graphs.clear()
        os.environ["UNIEP_OP_GRAPHS"] = flag
        try:
            model = build_model("qwen3_moe", dtype=torch.bfloat16).cuda().eval()
            model.forward = torch.compile(model.forward, backend="uniep")
            with torch.no_grad():
                runs[flag] = model.generate(ids, **kwargs)
        finally:
            os.environ.pop("UNIEP_OP_GRAPHS")
        replays = counters["uniep_kernels"]["op_graph_replays"]
        assert (replays > 0) is (flag == "1"), replays
        assert counters["uniep_kernels"]["triton_router"] == counters["uniep_kernels"]["triton_forward"] > 0
    assert torch.equal(runs["0"].sequences, runs["1"].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs["0"].scores, runs["1"].scores))
