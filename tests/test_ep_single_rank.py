"""uniep.ep_layer at world size 1 (a one-rank process group in this process) against the single-GPU op
uniep.moe_experts on the same inputs and weights: output and every gradient bit for bit (issue 37: "one GPU: the op
at world size 1 against the single-GPU op, bitwise"), and on a GPU at most one host synchronization per forward and
per backward call (issue 37's goal). On CPU the same check runs over gloo with the reference kernels, so that its
logic runs in CI; the GPU cases (bf16, a small Qwen3-like shape, NCCL) carry the `gpu` marker."""
import contextlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from test_reference import SILU_GLU

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message


@contextlib.contextmanager
def one_rank_group(device: torch.device, store_dir):
    """The default process group of this process alone (rank 0 of 1, a FileStore in ``store_dir``): NCCL on a GPU
    (NVLink multicast off, as ep.local_rank has it), gloo on CPU. Destroyed on the way out, with the symmetric-memory
    windows cached for it (their key, the group's name, comes back with the next group)."""
    from uniep_dynamo.ep import MULTICAST_OFF, transfer

    store = dist.FileStore(os.path.join(str(store_dir), "one_rank_store"), 1)
    unset = [key for key in MULTICAST_OFF if key not in os.environ]  # restored on the way out
    if device.type == "cuda":
        for key, value in MULTICAST_OFF.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        transfer._WINDOWS.clear()
        dist.destroy_process_group()
        for key in unset:
            os.environ.pop(key, None)


def qwen3_like_case(tokens, hidden, inter, experts, top_k, dtype, device, seed=0):
    """hidden [T, H], top-k ids [T, K] (distinct per token; expert 1 gets no token), routing weights [T, K] summing
    to 1, w_up [E, 2I, H], w_down [E, H, I], the output gradient, and the spec (SiLU-GLU, chunked gate|up, out in
    the hidden dtype, out-of-range ids dropped: what hf_ep gives uniep.ep_layer)."""
    from uniep_dynamo.spec import ExpertsSpec

    g = torch.Generator().manual_seed(seed)
    routed = [e for e in range(experts) if e != 1]  # expert 1 idle: its weight gradients are zeros on both sides
    ids = torch.tensor(routed)[torch.stack([torch.randperm(len(routed), generator=g)[:top_k] for _ in range(tokens)])]
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    tensors = (torch.randn(tokens, hidden, generator=g), weights,
               torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5,
               torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5,
               torch.randn(tokens, hidden, generator=g))
    hidden_states, weights, w_up, w_down, grad = (t.to(device, dtype) for t in tensors)
    return hidden_states, ids.to(device), weights, w_up, w_down, grad, ExpertsSpec("oi", "oi", SILU_GLU, dtype).encode()


def run_layer(fn, case, counted=None):
    """(out, d_hidden, d_weights, d_w_up, d_w_down) of fn(hidden, ids, weights, w_up, w_down) -> out, forward and
    backward each under ``counted()`` (a context manager yielding a list of host synchronizations) if given."""
    hidden, ids, weights, w_up, w_down, grad, _ = case
    leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
    syncs = {}
    with counted() if counted else contextlib.nullcontext([]) as syncs["forward"]:
        out = fn(leaves[0], ids, *leaves[1:])
    with counted() if counted else contextlib.nullcontext([]) as syncs["backward"]:
        out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves], syncs


def ep_layer_fn(spec, group, overlap: bool, knobs: str = "", device_plan: int = 0):
    """uniep.ep_layer at world size 1 over ``group`` as fn(hidden, ids, weights, w_up, w_down) -> out (device_plan:
    ep_layer's argument, 0 never, 1 wherever it runs)."""
    return lambda x, i, w, a, b: torch.ops.uniep.ep_layer(x, i, w, a, b, None, None, spec, group.group_name, 1,
                                                          overlap, knobs, device_plan)[0]


def single_op_fn(spec):
    return lambda x, i, w, a, b: torch.ops.uniep.moe_experts(x, i, w, a, b, None, None, [], spec)[0]


NAMES = ("out", "d_hidden", "d_weights", "d_w_up", "d_w_down")


def record_phases(monkeypatch) -> list:
    """The overlapped pipeline's phases (exchange.py's forward_phase, backward_phase) that run from now on, in order:
    none where the layer takes its sequential steps."""
    from uniep_dynamo.ep import exchange

    phases = []
    for name in ("forward_phase", "backward_phase"):
        monkeypatch.setattr(exchange, name, lambda *a, _run=getattr(exchange, name), _name=name, **k:
                            (phases.append(_name), _run(*a, **k))[1])
    return phases


def assert_bitwise(got, want, label):
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), \
            f"{label}: {name} differs from the single-GPU op (max diff {(a.float() - b.float()).abs().max():.3g})"


@contextlib.contextmanager
def host_syncs():
    """The host synchronizations of the calls inside, as a list of what synchronized (filled on the way out): the
    calls torch's sync debug mode flags (a copy to or from pageable host memory, .item(), .tolist() of a CUDA tensor,
    a stream or device synchronization), and torch.cuda.Event.synchronize() on an event the GPU has not reached
    (which the debug mode does not see; on an event already reached it returns at once, waiting for nothing). The
    autograd engine replays a backward's warnings in the thread that called backward()."""
    found = []
    event_synchronize = torch.cuda.Event.synchronize

    def counted(event):
        if not event.query():
            found.append("torch.cuda.Event.synchronize on an event not reached")
        return event_synchronize(event)
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.Event.synchronize = counted
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode(mode)
    finally:
        torch.cuda.Event.synchronize = event_synchronize
    found.extend(f"{w.filename}:{w.lineno}: {w.message}" for w in caught if SYNC_WARNING in str(w.message))


# (tokens, hidden, inter, experts, top_k), what it stresses
GPU_SHAPE = (1000, 512, 256, 16, 4)  # Qwen3-like: 16 experts of ~250 rows, K = 4; T not a multiple of any tile
CPU_SHAPE = (40, 32, 16, 8, 3)  # the same logic, small enough for the reference on 2 CPU cores


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap,reuse_saved,gated", [(False, False, False), (True, False, False),
                                                      (False, True, False), (True, False, True), (False, True, True)],
                         ids=["sequential", "overlapped", "sequential-in-place", "overlapped-gated",
                              "sequential-in-place-gated"])
def test_ep_layer_world1_bitwise_and_one_sync_on_gpu(overlap, reuse_saved, gated, tmp_path, monkeypatch):
    """bf16, NCCL, one rank, the heuristic tile config on both sides: the sequential steps (all-to-alls around the
    experts op, overlap_ep off: HF's default) and the overlapped exchange (symmetric memory); "in-place": the
    compile's reuse_saved_buffers in the spec, so the experts' backward reuses the saved buffers on both sides (inside
    the EP layer, handed the received gradient rows' only reference). After one warm-up call (kernel compiles, the
    communicator, the window), each forward call synchronizes the host at most once (the split sizes) and each
    backward call at most once. "gated": every GEMM by QuACK with config.gated_epilogue (its gated up projection
    and interleaved h in the EP layer's chunks), where QuACK runs."""
    import dataclasses

    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.kernels import config as kconfig
    from uniep_dynamo.kernels import quack_gemm
    from uniep_dynamo.kernels.config import heuristic_config, use_config
    from uniep_dynamo.spec import decode_spec

    device = torch.device("cuda", torch.cuda.current_device())
    tokens, hidden, inter, experts, top_k = GPU_SHAPE
    case = qwen3_like_case(*GPU_SHAPE, torch.bfloat16, device)
    if reuse_saved:
        case = case[:-1] + (dataclasses.replace(decode_spec(case[-1]), reuse_saved=True).encode(),)
    spec = case[-1]
    phases = record_phases(monkeypatch)
    cfg = dataclasses.replace(heuristic_config(tokens * top_k, experts, hidden, inter, interpret=False),
                              late_routing_weight=False)
    if gated:
        if quack_gemm.unavailable_reason(device) is not None or quack_gemm._gated_entry() is None:
            pytest.skip(f"QuACK's gated GEMM does not run here: {quack_gemm.unavailable_reason(device)}")
        cfg = dataclasses.replace(cfg, gated_epilogue=True, **{
            g: dataclasses.replace(getattr(cfg, g), quack=kconfig.QUACK_CONFIGS[g], per_expert_mm=False)
            for g in kconfig.GEMMS})
    with one_rank_group(device, tmp_path) as group, use_config(cfg):
        layer = ep_layer_fn(spec, group, overlap)
        run_layer(layer, case)  # warm-up
        want, _ = run_layer(single_op_fn(spec), case)
        got, syncs = run_layer(layer, case, counted=host_syncs)
        again, _ = run_layer(layer, case)
    assert_bitwise(got, want, f"ep_layer at world size 1 ({'overlapped' if overlap else 'sequential'})")
    assert_bitwise(again, got, "ep_layer run to run")
    assert got[4][1].count_nonzero() == 0 and got[3][1].count_nonzero() == 0, "expert 1 got no token"
    assert phases == (["forward_phase", "backward_phase"] * 3 if overlap else []), phases  # 3 ep_layer calls
    for direction, found in syncs.items():
        assert len(found) <= 1, f"{direction}: {len(found)} host synchronizations in one call: {found}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts", [16, 6], ids=["many_local_experts", "few_local_experts"])
def test_device_plan_pipeline_world1_on_gpu(experts, tmp_path):
    """The device plan's pipeline (ep_layer with device_plan and overlap) at world size 1 over NCCL and symmetric
    memory, bf16: its chunk GEMMs past row 0 by device_pipeline.chunk_config (QuACK's down projection and activation
    gradient with 16 local experts, its up projection with 6, where QuACK runs; Triton's for the rest), the
    single-GPU op's bits (which runs CUTLASS's GEMMs here; with late_routing_weight off, as the EP layers' experts
    ops get their rows weighted), no host synchronization after a warm-up call."""
    import dataclasses

    from torch._dynamo.utils import counters

    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.ep import device_pipeline
    from uniep_dynamo.kernels import quack_gemm
    from uniep_dynamo.kernels.config import heuristic_config, use_config

    device = torch.device("cuda", torch.cuda.current_device())
    tokens, hidden, inter, _, top_k = GPU_SHAPE
    case = qwen3_like_case(tokens, hidden, inter, experts, top_k, torch.bfloat16, device)
    spec = case[-1]
    cfg = dataclasses.replace(heuristic_config(tokens * top_k, experts, hidden, inter, interpret=False),
                              late_routing_weight=False)
    with one_rank_group(device, tmp_path) as group, use_config(cfg):
        layer = ep_layer_fn(spec, group, True, device_plan=1)
        run_layer(layer, case)  # warm-up
        want, _ = run_layer(single_op_fn(spec), case)
        runs = dict(device_pipeline.RUNS)
        counters.clear()
        got, syncs = run_layer(layer, case, counted=host_syncs)
    assert device_pipeline.RUNS == {"forward": runs["forward"] + 1, "backward": runs["backward"] + 1}
    assert_bitwise(got, want, f"the device plan's pipeline at world size 1, {experts} local experts")
    assert syncs == {"forward": [], "backward": []}, syncs
    if quack_gemm.unavailable_reason(device) is None:  # two chunks: QuACK's GEMMs in each, as chunk_config says
        assert counters["uniep_kernels"]["quack_gemms"] == (4 if experts >= 16 else 2), counters["uniep_kernels"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_ep_layer_world1_under_cuda_graphs(overlap, tmp_path):
    """mode="reduce-overhead" around uniep.ep_layer (what HF's AllToAllEP compiles to): the op synchronizes with the
    host and runs collectives, which a CUDA graph cannot replay, so it carries torch.Tag.cudagraph_unsafe; inductor
    then captures the rest of the forward and the backward graph in CUDA graphs and runs the op between the captured
    parts. Output and gradients are those of the same compile without CUDA graphs, bit for bit, on every step."""
    import uniep_dynamo  # noqa: F401
    from torch._dynamo.utils import counters

    device = torch.device("cuda", torch.cuda.current_device())
    tokens, hidden, inter, experts, top_k = GPU_SHAPE
    hidden_states, ids, weights, w_up, w_down, grad, spec = qwen3_like_case(*GPU_SHAPE, torch.bfloat16, device)

    class Block(torch.nn.Module):  # a projection before the layer and one after it: work for the CUDA graphs
        def __init__(self, group_name):
            super().__init__()
            g = torch.Generator().manual_seed(5)
            self.group_name = group_name
            self.before = torch.nn.Parameter((torch.randn(hidden, hidden, generator=g) * hidden ** -0.5).to(device,
                                                                                                         w_up.dtype))
            self.after = torch.nn.Parameter((torch.randn(hidden, hidden, generator=g) * hidden ** -0.5).to(device,
                                                                                                        w_up.dtype))
            self.w_up, self.w_down = torch.nn.Parameter(w_up.clone()), torch.nn.Parameter(w_down.clone())

        def forward(self, x, ids, weights):
            y = torch.ops.uniep.ep_layer(x @ self.before, ids, weights, self.w_up, self.w_down, None, None, spec,
                                         self.group_name, 1, overlap, "")[0]
            return torch.nn.functional.silu(y) @ self.after

    def steps(compiled, block, n=3):
        results = []
        for _ in range(n):
            torch.compiler.cudagraph_mark_step_begin()
            block.zero_grad(set_to_none=True)
            x, w = hidden_states.clone().requires_grad_(), weights.clone().requires_grad_()
            out = compiled(x, ids, w)
            out.backward(grad)
            # a CUDA graph's outputs (the gradients too) are overwritten by its next replay
            results.append([t.clone() for t in [out.detach(), x.grad, w.grad] + [p.grad for p in block.parameters()]])
        return results

    with one_rank_group(device, tmp_path) as group:
        block = Block(group.group_name)
        torch._dynamo.reset()
        want = steps(torch.compile(block, backend="uniep"), block)
        torch._dynamo.reset()
        counters.clear()
        got = steps(torch.compile(block, backend="uniep", mode="reduce-overhead"), block)
        inductor = dict(counters["inductor"])
    print("inductor counters:", {k: v for k, v in inductor.items() if "cudagraph" in k})
    assert inductor.get("cudagraph_partitions", 0) >= 2, inductor  # the captured parts, forward and backward
    for step, (a, b) in enumerate(zip(got, want)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"step {step}: result {i} differs under CUDA graphs"


def test_ep_ops_are_marked_cudagraph_unsafe_and_the_experts_ops_are_not():
    """What lets mode="reduce-overhead" take a graph holding EP ops (the GPU test above runs it): every EP op carries
    torch.Tag.cudagraph_unsafe, so inductor runs it between CUDA graphs; the single-GPU experts and router ops, which
    CUDA graphs capture (tests/test_gpu_megakernel.py), carry no such tag."""
    import uniep_dynamo  # noqa: F401

    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no torch.Tag.cudagraph_unsafe")
    ep_ops = ("ep_layer", "ep_layer_backward", "ep_dispatch", "ep_dispatch_backward", "ep_combine",
              "ep_combine_backward", "ep_exchange", "ep_exchange_backward_send", "ep_exchange_backward")
    captured = ("moe_experts", "moe_experts_backward", "moe_experts_backward_", "moe_experts_backward_combine",
                "moe_router", "moe_router_backward")
    for name in ep_ops + captured:
        tagged = torch.Tag.cudagraph_unsafe in getattr(torch.ops.uniep, name).default.tags
        assert tagged == (name in ep_ops), name


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("op", ["moe_experts", "ep_layer", "ep_layer_overlap", "ep_layer_device_plan"])
def test_ops_take_no_zero_gradients_for_their_buffer_outputs(op, tmp_path, monkeypatch):
    """Called outside a compiled graph, the ops whose extra outputs are buffers for their backward (the plan, h, the
    rows) get no zero-filled gradients for them (ctx.set_materialize_grads(False)): autograd makes no tensor before
    the backward op runs (it used to fill an [S, H] and an [S, 2I] zeros for moe_experts, an [S, H] one for
    ep_layer). The gradients are unchanged (the world-1 tests compare them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from test_ep import use_kernels

    use_kernels(monkeypatch, "triton")  # (the reference's Python cannot run under a dispatch mode)
    import uniep_dynamo  # noqa: F401

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    case = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    hidden, ids, weights, w_up, w_down, grad, spec = case
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        fn = single_op_fn(spec) if op == "moe_experts" else \
            ep_layer_fn(spec, group, op == "ep_layer_overlap", device_plan=int(op == "ep_layer_device_plan"))
        leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
        out = fn(leaves[0], ids, *leaves[1:])
        record = Record()
        with record:
            out.backward(grad)
    backward_op = next(i for i, name in enumerate(record.ops) if name.startswith("uniep."))
    made = [name for name in record.ops[:backward_op] if not name.startswith("aten.detach")]
    assert made == [], f"autograd made {made} before {record.ops[backward_op]}"
    assert all(t.grad is not None for t in leaves)
    if op == "moe_experts":  # a loss of the saved h alone: the op's backward runs, and no gradient reaches its inputs
        leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
        outs = torch.ops.uniep.moe_experts(leaves[0], ids, *leaves[1:], None, None, [], spec)
        outs[4].float().sum().backward()
        assert all(t.grad is None for t in leaves)


CPU_CASES = [
    # (UNIEP_KERNELS, dtype, overlap), what it stresses
    ("reference", torch.bfloat16, False),  # CPU's default path, in the GPU test's dtype
    ("triton", torch.float32, True),  # the overlapped exchange at one rank (a shared file for the window), with the
                                      # MegaKernel's kernels in Triton's interpreter (its bf16 is broken)
    ("triton", torch.float32, False),  # the sequential steps with the MegaKernel: its backward keeps no down rows
]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("kernels,dtype,overlap", CPU_CASES,
                         ids=["reference-bf16", "interpreter-overlapped", "interpreter-sequential"])
def test_ep_layer_world1_bitwise_on_cpu(kernels, dtype, overlap, tmp_path, monkeypatch):
    """The GPU test's check on CPU: gloo, one rank. In the interpreter both sides sort the slots by the reference
    (test_ep.sorted_by_reference: the same integers, 2 s a call less)."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, kernels)
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.ep import exchange

    phases = record_phases(monkeypatch)
    experts_forwards = []  # the sequential steps' experts-op forwards: one a layer call, none again in its backward
    monkeypatch.setattr(exchange, "_sequential_experts", lambda *a, _run=exchange._sequential_experts:
                        (experts_forwards.append(1), _run(*a))[1])
    case = qwen3_like_case(*CPU_SHAPE, dtype, torch.device("cpu"))
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        got, _ = run_layer(ep_layer_fn(case[-1], group, overlap), case)
        if not overlap:  # the backward without the forward's kept results runs the experts' forward again: same bits
            monkeypatch.setattr(exchange, "_saved_sequential", lambda table, up, release=False: None)
            recomputed, _ = run_layer(ep_layer_fn(case[-1], group, overlap), case)
            assert_bitwise(recomputed, got, "ep_layer's sequential backward from a recomputed forward")
    want, _ = run_layer(single_op_fn(case[-1]), case)
    assert_bitwise(got, want, f"ep_layer at world size 1 (gloo, {kernels})")
    assert got[4][1].count_nonzero() == 0 and got[3][1].count_nonzero() == 0, "expert 1 got no token"
    assert phases == (["forward_phase", "backward_phase"] if overlap else []), phases
    assert len(experts_forwards) == (0 if overlap else 1 + 2), experts_forwards


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "sequential"])
def test_ep_layer_world1_keeps_the_gated_epilogue_layout(overlap, tmp_path, monkeypatch):
    """config.gated_epilogue's interleaved h in the EP layer's chunks (their forward, activation backward, input
    gradient and weight gradients): at world size 1 the same bits as the single-GPU op with the knob, here in the
    interpreter with the layout forced (its stand-in GEMMs give the knob-off bits on both sides)."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "triton")
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.kernels import megakernel

    monkeypatch.setattr(megakernel, "INTERLEAVED_H_INTERPRETED", True)
    monkeypatch.setenv("UNIEP_GATED_EPILOGUE", "1")
    interleaved = []
    monkeypatch.setattr(megakernel, "_interleave", lambda *a, _f=megakernel._interleave: interleaved.append(1)
                        or _f(*a))
    case = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        got, _ = run_layer(ep_layer_fn(case[-1], group, overlap), case)
    assert interleaved, "the EP layer's up projections did not store h interleaved"
    want, _ = run_layer(single_op_fn(case[-1]), case)
    assert_bitwise(got, want, "ep_layer at world size 1 with config.gated_epilogue's layout")
    monkeypatch.setenv("UNIEP_GATED_EPILOGUE", "0")
    assert_bitwise(run_layer(single_op_fn(case[-1]), case)[0], want, "the knob-off op (the interpreter's stand-in)")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_an_ep_layer_run_twice_on_one_input_takes_one_backward(tmp_path):
    """The EP layer as HF's substitution traces it (an ep_layer call in the traced code, its spec under
    reuse_saved_buffers) run twice on the same input in one compiled step, then one backward: the backend numbers
    the calls (ExpertsSpec.site), so common-subexpression elimination no longer merges them into one op whose kept
    rows the second backward would find taken (it raised the second-backward error). Output and gradients equal
    eager's."""
    import dataclasses

    import uniep_dynamo
    from uniep_dynamo.spec import decode_spec

    hidden, ids, weights, w_up, w_down, _, spec = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    spec = dataclasses.replace(decode_spec(spec), reuse_saved=True).encode()
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        def step(x, w, a, b):
            def layer():
                return torch.ops.uniep.ep_layer(x, ids, w, a, b, None, None, spec, group.group_name, 1, False, "")[0]
            return layer() * layer().tanh()

        results = []
        for fn in (step, torch.compile(step, backend="uniep")):
            leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
            with uniep_dynamo.recording() as report:
                out = fn(*leaves)
            out.square().sum().backward()
            results.append([out.detach()] + [t.grad for t in leaves])
    assert report.totals()["ep_layer"] == 2, report.totals()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("kernels,dtype,overlap", CPU_CASES,
                         ids=["reference-bf16", "interpreter-overlapped", "interpreter-sequential"])
def test_ep_layer_with_frozen_experts(kernels, dtype, overlap, tmp_path, monkeypatch):
    """Frozen experts (their weights need no gradient, as in LoRA fine-tuning) under ep_layer: the input and
    routing-weight gradients are those of trainable experts, bit for bit, the weights get none, and neither the
    sequential steps nor the overlapped pipeline run a weight-gradient GEMM (interpreter)."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, kernels)
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.kernels import megakernel

    case = qwen3_like_case(*CPU_SHAPE, dtype, torch.device("cpu"))
    hidden, ids, weights, w_up, w_down, grad, spec = case
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        layer = ep_layer_fn(spec, group, overlap)
        want, _ = run_layer(layer, case)
        calls = []
        monkeypatch.setattr(megakernel, "weight_grad", lambda *a, _run=megakernel.weight_grad, **k:
                            (calls.append(1), _run(*a, **k))[1])
        leaves = [t.clone().requires_grad_() for t in (hidden, weights)]
        out = layer(leaves[0], ids, leaves[1], w_up, w_down)
        out.backward(grad)
    for name, a, b in zip(NAMES, [out.detach(), leaves[0].grad, leaves[1].grad], want):
        assert torch.equal(a, b), name
    if kernels == "triton":
        assert not calls


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_ep_exchange_sequential_backward_reads_its_forward_in_eager_autograd(tmp_path, monkeypatch):
    """The compile op uniep.ep_exchange under eager autograd (as inner_backend="eager" / "aot_eager" run it, where the
    saved up projection comes back to the backward as another tensor object over the same storage): its sequential
    backward reads the experts op's results its forward kept (one experts forward a call, none in the backward), with
    the bits of the backward that runs that forward again."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "reference")
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.ep import exchange

    forwards = []
    monkeypatch.setattr(exchange, "_sequential_experts", lambda *a, _run=exchange._sequential_experts:
                        (forwards.append(1), _run(*a))[1])
    hidden, ids, _, w_up, w_down, _, spec = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    flat = ids.reshape(-1)
    send = hidden[torch.argsort(flat, stable=True) // ids.shape[1]]  # rows in send (expert) order
    counts = torch.bincount(flat, minlength=w_up.shape[0]).view(1, -1)
    grad = torch.randn(send.shape, generator=torch.Generator().manual_seed(7))

    def run(group):
        leaves = [t.clone().requires_grad_() for t in (send, w_up, w_down)]
        back = torch.ops.uniep.ep_exchange(leaves[0], counts, leaves[1], leaves[2], None, None, spec,
                                           group.group_name, [send.shape[0]], [send.shape[0]])[0]
        back.backward(grad)
        return [back.detach()] + [t.grad for t in leaves]

    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        got = run(group)
        assert len(forwards) == 1, forwards
        monkeypatch.setattr(exchange, "_saved_sequential", lambda table, up, release=False: None)
        recomputed = run(group)
    assert len(forwards) == 3, forwards
    for a, b in zip(got, recomputed):
        assert torch.equal(a, b)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "overlapped"])
def test_ep_exchange_with_frozen_experts(sequential, tmp_path, monkeypatch):
    """The plain EP compile's exchange op with frozen experts: the rows' gradient is that of trainable experts, bit
    for bit, the weights get none, and neither path runs a weight-gradient GEMM (interpreter)."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "triton")
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.kernels import megakernel

    hidden, ids, _, w_up, w_down, _, spec = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    flat = ids.reshape(-1)
    send = hidden[torch.argsort(flat, stable=True) // ids.shape[1]]  # rows in send (expert) order
    counts = torch.bincount(flat, minlength=w_up.shape[0]).view(1, -1)
    grad = torch.randn(send.shape, generator=torch.Generator().manual_seed(7))

    def run(group, frozen):
        leaves = [t.clone().requires_grad_(t is send or not frozen) for t in (send, w_up, w_down)]
        back = torch.ops.uniep.ep_exchange(leaves[0], counts, leaves[1], leaves[2], None, None, spec,
                                           group.group_name, [send.shape[0]], [send.shape[0]], "", sequential)[0]
        back.backward(grad)
        return [back.detach()] + [t.grad for t in leaves]

    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        want = run(group, frozen=False)
        calls = []
        monkeypatch.setattr(megakernel, "weight_grad", lambda *a, _run=megakernel.weight_grad, **k:
                            (calls.append(1), _run(*a, **k))[1])
        got = run(group, frozen=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2] is None and got[3] is None
    assert not calls


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_ep_layer_refuses_an_expert_id_out_of_range_before_any_transfer(tmp_path, monkeypatch):
    """An id outside [0, E) is an error the layer raises from the host count table (on every rank alike, so none is
    left waiting in a collective), before any row moves; the same call with the ids in range runs."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "reference")
    import uniep_dynamo  # noqa: F401

    hidden, ids, weights, w_up, w_down, _, spec = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    bad = ids.clone()
    bad[3, 1] = w_up.shape[0]
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        layer = ep_layer_fn(spec, group, False)
        with pytest.raises(ValueError, match=rf"an expert id lies outside \[0, {w_up.shape[0]}\) on rank\(s\) \[0\]"):
            layer(hidden, bad, weights, w_up, w_down)
        assert layer(hidden, ids, weights, w_up, w_down).shape == hidden.shape


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_ep_layer_device_plan_at_world_1_and_its_fallback(tmp_path, monkeypatch, caplog):
    """device_plan=True at world size 1 (gloo, the transfer kernel in Triton's interpreter): the single-GPU op's bits
    in two process groups one after the other (the second reuses the first's name), without the host count table; an
    id out of range stops the call with the layer's message; frozen experts get the same other gradients. Where the
    path cannot run (no interpreter on CPU tensors) the layer says why once and takes the synchronized path, with the
    same bits."""
    import logging

    from test_ep import use_kernels

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the transfer kernel on CPU tensors runs only in Triton's interpreter (conftest sets it)")
    use_kernels(monkeypatch, "reference")
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.ep import layer

    tables = []  # the synchronized path's host count tables
    monkeypatch.setattr(layer, "count_table", lambda *a, _run=layer.count_table, **k:
                        (tables.append(1), _run(*a, **k))[1])
    case = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    hidden, ids, weights, w_up, w_down, _, spec = case
    want, _ = run_layer(single_op_fn(spec), case)

    def planned(group):
        return ep_layer_fn(spec, group, False, device_plan=True)
    for attempt in range(2):
        (tmp_path / str(attempt)).mkdir()
        with one_rank_group(torch.device("cpu"), tmp_path / str(attempt)) as group:
            got, _ = run_layer(planned(group), case)
            assert_bitwise(got, want, f"ep_layer(device_plan=True), group {attempt}")
            if attempt == 0:
                bad = ids.clone()
                bad[3, 1] = w_up.shape[0]
                with pytest.raises(RuntimeError, match=rf"an expert id lies outside \[0, {w_up.shape[0]}\)"):
                    planned(group)(hidden, bad, weights, w_up, w_down)
                # frozen experts: the same input and routing-weight gradients, none for the weights
                leaves = [t.clone().requires_grad_() for t in (hidden, weights)]
                planned(group)(leaves[0], ids, leaves[1], w_up, w_down).backward(case[5])
                assert torch.equal(leaves[0].grad, got[1]) and torch.equal(leaves[1].grad, got[2])
    assert not tables
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at the call: the transfer kernel cannot run on CPU tensors
    from uniep_dynamo.kernels import megakernel

    monkeypatch.setattr(megakernel, "_LOGGED", set())  # said once a process: this test reads it whatever ran before
    (tmp_path / "2").mkdir()
    with caplog.at_level(logging.WARNING, logger="uniep"), \
            one_rank_group(torch.device("cpu"), tmp_path / "2") as group:
        got, _ = run_layer(planned(group), case)
    assert_bitwise(got, want, "ep_layer(device_plan=True) on its synchronized fallback")
    assert tables and "the transfer kernel runs on CUDA or in Triton's interpreter only" in caplog.text, caplog.text


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_device_plan_reads_no_expert_bounds_on_the_host(tmp_path, monkeypatch):
    """A config with per_expert_mm (one matmul per expert, from each expert's rows read on the host): the device
    plan's experts ops read no row bound on the host (on a GPU that read was a host synchronization inside its
    pipeline, found at 4 ranks, where the worst-case buffer's rows turn the heuristics' per_expert_mm on); their
    GEMMs take the other knobs' path, the single-GPU op's bits with the knob off. The synchronized path, whose counts
    are on the host, runs the knob."""
    from test_ep import use_kernels
    from torch._dynamo.utils import counters

    use_kernels(monkeypatch, "triton")
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.kernels import config as kconfig
    from uniep_dynamo.kernels import megakernel

    monkeypatch.setattr(megakernel, "PER_EXPERT_MM_INTERPRETED", True)
    reads = []
    monkeypatch.setattr(megakernel.Layer, "host_bounds", lambda layer, offsets, _f=megakernel.Layer.host_bounds:
                        reads.append(_f(layer, offsets)) or reads[-1])
    case = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    spec = case[-1]
    tokens, hidden_size, inter, experts, top_k = CPU_SHAPE
    cfg = kconfig.heuristic_config(tokens * top_k, experts, hidden_size, inter, interpret=True)
    with kconfig.use_config(cfg.replace_gemms(per_expert_mm=False)):
        want, _ = run_layer(single_op_fn(spec), case)

    def layer(group, device_plan):
        return ep_layer_fn(spec, group, False, device_plan=device_plan)
    with one_rank_group(torch.device("cpu"), tmp_path) as group, \
            kconfig.use_config(cfg.replace_gemms(per_expert_mm=True)):
        counters.clear()
        got, _ = run_layer(layer(group, True), case)
        assert reads and all(r is None for r in reads), reads
        assert counters["uniep_kernels"]["per_expert_mm_gemms"] == 0
        assert_bitwise(got, want, "the device plan with per_expert_mm in the config")
        reads.clear()
        run_layer(layer(group, False), case)
        assert any(r is not None for r in reads) and counters["uniep_kernels"]["per_expert_mm_gemms"] > 0


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_device_plan_pipeline_at_world_1(tmp_path, monkeypatch, caplog):
    """The device plan's pipelined forward (device_plan=True with overlap) at world size 1 in the interpreter, at 2
    and 4 chunks of the 8 local experts (OverlapConfig.chunks), and its backward with the gradient rows pulled by
    the same chunks (each chunk's activation-gradient GEMM once its rows are in) and the input-gradient rows pushed
    before the weight gradients' GEMMs (to run beside them): the single-GPU op's bits. Where it cannot run
    (config.gated_epilogue's interleaved h) the layer says why and runs the steps one after another, with the same
    bits as the op under that knob."""
    import json
    import logging

    from test_ep import use_kernels

    use_kernels(monkeypatch, "triton")
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.ep import device_pipeline
    from uniep_dynamo.kernels import megakernel

    case = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    spec = case[-1]
    want, _ = run_layer(single_op_fn(spec), case)

    def planned(group, knobs):
        return ep_layer_fn(spec, group, True, knobs, device_plan=True)
    from uniep_dynamo.kernels import triton_transfer

    copies = []  # (push, table rows) of each transfer-kernel launch, "wgrad" of each weight-gradient GEMM
    monkeypatch.setattr(triton_transfer, "copy_segments", lambda table, *a, _f=triton_transfer.copy_segments, **k:
                        copies.append((a[2], table.shape[0])) or _f(table, *a, **k))
    monkeypatch.setattr(megakernel, "weight_grad", lambda *a, _f=megakernel.weight_grad, **k:
                        copies.append("wgrad") or _f(*a, **k))
    runs, beside = device_pipeline.RUNS["forward"], device_pipeline.RUNS["backward"]
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        for chunks in (2, 4):
            copies.clear()
            got, _ = run_layer(planned(group, json.dumps({"chunks": chunks})), case)
            assert_bitwise(got, want, f"the device plan pipelined in {chunks} chunks")
            # the forward pulls and pushes each chunk's rows of the table once (8 experts, one rank: a row an
            # expert); the backward pulls them chunk by chunk too, and pushes d_x at once, before the weight
            # gradients' GEMMs
            each = [8 // chunks] * chunks
            assert copies == [(False, n) for n in each] + [(True, n) for n in each] + \
                [(False, n) for n in each] + [(True, 8), "wgrad", "wgrad"], copies
        assert device_pipeline.RUNS["forward"] == runs + 2
        assert device_pipeline.RUNS["backward"] == beside + 2
        monkeypatch.setattr(megakernel, "INTERLEAVED_H_INTERPRETED", True)
        monkeypatch.setenv("UNIEP_GATED_EPILOGUE", "1")
        monkeypatch.setattr(megakernel, "_LOGGED", set())
        with caplog.at_level(logging.WARNING, logger="uniep"):
            got, _ = run_layer(planned(group, ""), case)
    assert device_pipeline.RUNS["forward"] == runs + 2
    assert "without its pipeline" in caplog.text and "gated_epilogue" in caplog.text, caplog.text
    assert_bitwise(got, run_layer(single_op_fn(spec), case)[0], "the device plan under gated_epilogue's layout")


@pytest.mark.parametrize("local", [2, 4, 15, 16, 64])
def test_chunk_config_picks_quack_by_local_experts(local):
    """device_pipeline.chunk_config, the device plan pipeline's chunk GEMMs: never torch._grouped_mm or per_expert_mm
    (a chunk starts past row 0); QuACK's down projection and activation gradient with 16 or more local experts, its
    up projection with fewer (as measured, chunk_gemm_probe.py), Triton's for the rest; the other knobs kept."""
    import dataclasses

    from uniep_dynamo.ep import device_pipeline
    from uniep_dynamo.kernels import config as kconfig

    for full in (kconfig.heuristic_config(65536, local, 2048, 768),
                 kconfig.heuristic_config(32768, local, 4096, 14336)):
        cfg = device_pipeline.chunk_config(full, local)
        quack = {"down", "grad_act"} if local >= 16 else {"up"}
        for g in kconfig.GEMMS:
            gemm, was = getattr(cfg, g), getattr(full, g)
            assert not gemm.grouped_mm and not gemm.per_expert_mm, g
            assert gemm.quack == (kconfig.QUACK_CONFIGS[g] if g in quack else ""), (g, gemm.quack)
            assert dataclasses.replace(gemm, quack="", grouped_mm=False, per_expert_mm=False) == \
                dataclasses.replace(was, quack="", grouped_mm=False, per_expert_mm=False), g
        assert (cfg.late_routing_weight, cfg.tma, cfg.gated_epilogue) == \
            (full.late_routing_weight, full.tma, full.gated_epilogue)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("overlap", [False, True], ids=["steps", "overlap"])
def test_auto_device_plan_pipelines_under_overlap(overlap, tmp_path, monkeypatch):
    """ep_device_plan="auto" (ep_layer's device_plan 2) where the auto rule runs the device plan: with overlap
    (the compile's overlap_ep) its pipeline runs (the forward's chunks, the backward's d_x pushed beside the weight
    gradients), not the synchronized path's overlapped exchange; without, its steps one after another. Either way
    the single-GPU op's bits and no host count table."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "triton")
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.ep import device_choice, device_pipeline, device_plan, layer

    case = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    spec = case[-1]
    want, _ = run_layer(single_op_fn(spec), case)
    monkeypatch.setattr(device_choice, "_auto_facts", lambda hidden, group: (None, 80 * 2**30))  # as on one host
    host_tables = []
    monkeypatch.setattr(layer, "count_table", lambda *a, _f=layer.count_table: host_tables.append(1) or _f(*a))
    runs, beside, planned = device_pipeline.RUNS["forward"], device_pipeline.RUNS["backward"], \
        device_plan.RUNS["forward"]
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        got, _ = run_layer(ep_layer_fn(spec, group, overlap, device_plan=device_choice.AUTO), case)
    assert_bitwise(got, want, f"the auto device plan, overlap={overlap}")
    assert host_tables == [] and device_plan.RUNS["forward"] == planned + 1
    assert device_pipeline.RUNS["forward"] == runs + int(overlap)
    assert device_pipeline.RUNS["backward"] == beside + int(overlap)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("overlap,device_plan", [(True, 0), (False, 0), (False, 1), (True, 1)],
                         ids=["overlapped", "sequential", "device_plan", "device_plan_pipelined"])
def test_gated_epilogue_flipped_inside_an_ep_step_is_refused(overlap, device_plan, tmp_path, monkeypatch):
    """UNIEP_GATED_EPILOGUE flipped between an EP layer's forward and its backward, never silently wrong gradients:
    the host-plan paths' backwards refuse (the overlapped exchange's chunks record and check the layout of their rows
    of h as the experts op does); the device plan's backward runs with its forward's config (it sees fewer rows, for
    which the heuristics may pick another), so it reads the layout its forward stored whatever the variable says."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "triton")
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.kernels import megakernel

    monkeypatch.setattr(megakernel, "INTERLEAVED_H_INTERPRETED", True)
    case = qwen3_like_case(*CPU_SHAPE, torch.float32, torch.device("cpu"))
    hidden, ids, weights, w_up, w_down, grad, spec = case
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        def step(forward, backward):
            leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
            monkeypatch.setenv("UNIEP_GATED_EPILOGUE", forward)
            out = ep_layer_fn(spec, group, overlap, device_plan=device_plan)(leaves[0], ids, *leaves[1:])
            monkeypatch.setenv("UNIEP_GATED_EPILOGUE", backward)
            out.backward(grad)
            return [out.detach()] + [t.grad for t in leaves]
        want = step("0", "0")
        if device_plan:
            for flip in (("1", "0"), ("0", "1")):
                assert_bitwise(step(*flip), want, f"the device plan, the variable flipped {flip}")
        else:
            with pytest.raises(RuntimeError, match="UNIEP_GATED_EPILOGUE"):
                step("1", "0")
            assert_bitwise(step("1", "1"), want, "the layer under the gated layout (the interpreter's stand-in)")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_device_plan_auto_rule(tmp_path, monkeypatch):
    """ep_device_plan="auto" (the default): off CUDA the synchronized path; on a GPU the device plan where its
    worst-case buffers above the synchronized path's fit in AUTO_MEMORY_SHARE of the group's smallest GPU, decided
    from every rank's token count (so every rank decides alike), and never where the group's facts rule it out.
    The numbers: HF's Qwen3-30B-A3B dims at T = 8192 a rank (H 2048, up width 1536, K 8, bf16) on an 80 GiB GPU are
    on at 2 and 4 ranks and off at 8; True runs it whatever the memory."""
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.ep import device_choice

    hidden = torch.zeros(8192, 2048, dtype=torch.bfloat16)
    ids = torch.zeros(8192, 8, dtype=torch.int64)
    w_up = torch.empty(1, 1536, 2048, dtype=torch.bfloat16)
    with one_rank_group(torch.device("cpu"), tmp_path) as group:
        monkeypatch.setattr(device_choice, "unsupported_reason", lambda hidden, group: None)
        why, tokens = device_choice.choose(hidden, ids, w_up, group, auto=True)
        assert why == "not on CUDA" and tokens is None
        why, tokens = device_choice.choose(hidden, ids, w_up, group, auto=False)  # True: no auto rule
        assert why is None and tokens == [8192]
        gib = 2**30
        monkeypatch.setattr(device_choice, "_auto_facts", lambda hidden, group: (None, 80 * gib))
        for world, runs in ((1, True), (2, True), (4, True), (8, False)):
            monkeypatch.setattr(device_choice, "host_tokens", lambda n, group, w=world: [n] * w)
            why, tokens = device_choice.choose(hidden, ids, w_up, group, auto=True)
            assert (why is None) == runs, (world, why)
            if runs:
                assert tokens == [8192] * world
            else:
                assert "above the synchronized path's" in why and "ep_device_plan=True" in why, why
                assert device_choice.choose(hidden, ids, w_up, group, auto=False)[0] is None
        excess = device_choice.worst_case_excess([8192] * 4, 8, 2048, 1536, 2)
        assert excess == (device_choice.AHEAD + 1) * 3 * 8192 * 8 * (2048 + 1536) * 2
        # uneven token counts: the same answer on every rank (the excess reads every rank's counts)
        assert device_choice.worst_case_excess([100, 300], 8, 2048, 1536, 2) == \
            device_choice.worst_case_excess([300, 100], 8, 2048, 1536, 2)
        monkeypatch.setattr(device_choice, "_auto_facts", lambda hidden, group: ("the EP group spans several hosts", 0))
        assert device_choice.choose(hidden, ids, w_up, group, auto=True)[0] == "the EP group spans several hosts"


def _windows_probe_worker(rank, world, port, out_dir):
    from uniep_dynamo.ep import device_choice, local_rank

    with local_rank(rank, world, port, "cpu"):
        group, hidden = dist.group.WORLD, torch.zeros(4, 8)
        works = device_choice._windows_reason(group, hidden)

        def refused(*args, **kwargs):
            raise PermissionError("opening a peer's memory is not permitted")
        if rank == 1:
            device_choice.window = refused
        fails = device_choice._windows_reason(group, hidden)
    torch.save({"works": works, "fails": fails}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_device_plan_auto_rule_probes_symmetric_memory_on_every_rank(tmp_path):
    """The auto rule's one-time check that the group's windows can be made: where they can, no reason; where one
    rank fails (here its window raises, as a container that forbids opening a peer's memory would), every rank gets
    a reason naming that rank, so all of them take the synchronized path together."""
    from test_ep import run_workers

    ranks = run_workers(_windows_probe_worker, 2, (), tmp_path)
    assert [r["works"] for r in ranks] == [None, None]
    assert all(r["fails"] and "symmetric memory failed on rank(s) [1]" in r["fails"] for r in ranks), ranks
    assert "PermissionError: opening a peer's memory is not permitted" in ranks[1]["fails"]
