"""uniep.ep_exchange on CPU: the token all-to-all, the local experts and the all-to-all back as one op, whose
overlapped path (uniep_dynamo/ep/exchange.py) runs the transfers beside the grouped GEMMs. 2 and 4
gloo processes, the Triton kernels in the interpreter, symmetric memory stood in by shared files.

The overlapped path must give the bits of the sequential steps it replaces (the same experts kernels over the
received rows), for the op called directly with uneven split sizes and for a plain-PyTorch EP model compiled
with backend="uniep" (examples/ep_moe.py), against the same compile with the exchange rewrite off."""
import contextlib
import os
import sys

import pytest
import torch
import torch.distributed as dist

from test_ep import count_in_place_backwards, gloo_group, run_workers
from test_reference import GPT_OSS, SILU_GLU, make

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for symmetric memory; "
                       "tests/test_gpu_ep.py runs the CUDA path"),
]

INTERPRETER = {"UNIEP_KERNELS": "triton", "TRITON_INTERPRET": "1"}


def _counts(routing: str, world: int, local_experts: int) -> torch.Tensor:
    """[source, global expert] rows, the same on every rank."""
    experts = world * local_experts
    c = torch.randint(0, 5, (world, experts), generator=torch.Generator().manual_seed(3))
    if routing == "one_rank_receives_nothing":
        c[:, local_experts:2 * local_experts] = 0
    elif routing == "idle_expert":  # one expert gets no row from anyone, one source sends nothing
        c[:, 1] = 0
        c[world - 1] = 0
    elif routing == "empty":
        c.zero_()
    return c


class _Spy:
    """Counts the overlapped pipeline's phases on this rank."""

    def __init__(self):
        from uniep_dynamo.ep import pipeline

        self.calls, self._inner = 0, pipeline.start_exchange
        pipeline.start_exchange = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._inner(*args, **kwargs)


@contextlib.contextmanager
def _group(rank, world, port, device):
    """gloo with the interpreter on CPU; NCCL on GPU ``rank`` (tests/test_gpu_ep.py)."""
    if device == "cpu":
        with gloo_group(rank, world, port, **INTERPRETER):
            yield torch.device("cpu"), torch.float32, 1
    else:
        from uniep_dynamo.ep import local_rank

        with local_rank(rank, world, port) as dev:
            yield dev, torch.bfloat16, 97  # bf16, and about a hundred times the rows


def _op_worker(rank, world, port, routing, gate, device, out_dir):
    with _group(rank, world, port, device) as (device, dtype, scale):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import exchange

        local_experts = 2 if device.type == "cpu" else 4
        hidden, inter = (16, 12) if device.type == "cpu" else (512, 384)
        c = _counts(routing, world, local_experts) * scale
        block = c.view(world, world, local_experts)  # [source, destination rank, local expert]
        send_sizes = block[rank].sum(1).tolist()
        recv_sizes = block[:, rank].sum(1).tolist()
        recv_counts = block[:, rank].clone()
        bias = gate == GPT_OSS
        _, _, _, w_up, w_down, b_up, b_down, spec = make(1, hidden, inter, local_experts, 1, gate=gate, dtype=dtype,
                                                         layout="io" if bias else "oi", bias=bias, seed=10 + rank)
        w_up, w_down, b_up, b_down = (t.to(device) if t is not None else None for t in (w_up, w_down, b_up, b_down))
        recv_counts = recv_counts.to(device)
        g = torch.Generator().manual_seed(20 + rank)
        send = torch.randn(sum(send_sizes), hidden, generator=g).to(device, dtype)
        grad = torch.randn(sum(send_sizes), hidden, generator=g).to(device, dtype)
        group_name = dist.group.WORLD.group_name
        spy = _Spy()
        results = {}
        # the overlapped path with its defaults, with the transfer kernel over one chunk, with the copy engines over
        # one chunk (through the stage), and with torch._foreach_copy_ and the weight gradients chunk by chunk (the
        # knobs the compile rewrite passes from options={"ep_knobs": ...})
        knobs = {"overlapped": "", "overlapped_kernel": '{"chunks": 1, "copy_engine": false, "copy_kernel": true}',
                 "overlapped_engine": '{"chunks": 1, "copy_engine": true}',
                 "overlapped_foreach": '{"copy_engine": false, "copy_kernel": false, "weight_grads_last": false}',
                 "sequential": ""}
        for path in knobs:
            if path == "sequential":  # one rank cannot take the overlapped path, so no rank does
                real = exchange._exchange_unsupported
                exchange._exchange_unsupported = (lambda *a: "a test says so") if rank == world - 1 else real
            leaves = [t.clone().requires_grad_() if t is not None else None for t in (send, w_up, w_down, b_up, b_down)]
            back = torch.ops.uniep.ep_exchange(leaves[0], recv_counts, *leaves[1:], spec.encode(), group_name,
                                               send_sizes, recv_sizes, knobs[path])[0]
            back.backward(grad)
            results[path] = [back.detach().cpu()] + [t.grad.cpu() if t is not None else None for t in leaves]
            results[path + "_phases"] = spy.calls
            spy.calls = 0
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world,routing,gate", [
    (2, "random", SILU_GLU),
    (4, "random", SILU_GLU),
    (2, "random", GPT_OSS),  # [E, H, 2I] layout, interleaved clamped gate, biases
    (4, "one_rank_receives_nothing", SILU_GLU),
    (2, "idle_expert", SILU_GLU),
    (2, "empty", SILU_GLU),
], ids=lambda v: v if isinstance(v, (int, str)) and len(str(v)) < 30 else "gpt_oss" if v == GPT_OSS else "silu")
def test_exchange_op_overlapped_equals_sequential(world, routing, gate, tmp_path):
    """Rows back and the gradients of the rows and of every expert parameter: bitwise the sequential
    steps', on every rank; the overlapped path ran (a forward and a backward phase) unless no row moves."""
    check_op(run_workers(_op_worker, world, (routing, gate, "cpu"), tmp_path), routing)


def check_op(ranks, routing):
    for r in ranks:
        assert r["sequential_phases"] == 0
        for path in ("overlapped", "overlapped_kernel", "overlapped_engine", "overlapped_foreach"):
            assert r[path + "_phases"] == (0 if routing == "empty" else 2), path
            for i, (a, b) in enumerate(zip(r[path], r["sequential"])):
                assert (a is None) == (b is None), (path, i)
                if a is not None:
                    assert torch.equal(a, b), (path, i)


def _send_first_worker(rank, world, port, out_dir):
    import time
    import weakref

    with gloo_group(rank, world, port, **INTERPRETER):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import exchange

        c = _counts("random", world, 2).view(world, world, 2)  # [source, destination rank, local expert]
        send_sizes, recv_sizes, recv_counts = c[rank].sum(1).tolist(), c[:, rank].sum(1).tolist(), c[:, rank].clone()
        _, _, _, w_up, w_down, _, _, spec = make(1, 16, 12, 2, 1, gate=SILU_GLU, seed=10 + rank)
        g = torch.Generator().manual_seed(20 + rank)
        send, grad = (torch.randn(sum(send_sizes), 16, generator=g) for _ in range(2))
        group_name = dist.group.WORLD.group_name
        args = (recv_counts, w_up, w_down, None, None, spec.encode(), group_name, send_sizes, recv_sizes)
        _, x, up, table = torch.ops.uniep.ep_exchange(send, *args, "", True)  # the compile's sequential steps
        saved = (x, up, recv_counts, table, w_up, w_down, None, None, spec.encode(), group_name, send_sizes,
                 recv_sizes, "")
        one_op = torch.ops.uniep.ep_exchange_backward(grad, *saved)
        # what the compiled backward runs by default: the all-to-all in an op of its own, after which the graph drops
        # the gradient rows; the experts' backward then runs without them
        rows = grad.clone()
        ref = weakref.ref(rows)
        sent = torch.ops.uniep.ep_exchange_backward_send(rows, table, group_name, send_sizes, recv_sizes)
        del rows
        deadline = time.monotonic() + 1.0  # gloo's worker thread may hold a finished collective's tensors a little
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.005)
        freed = ref() is None
        two_ops = torch.ops.uniep.ep_exchange_backward(sent, *saved, True)
        # the second step takes what the first left: without it, it says so
        try:
            torch.ops.uniep.ep_exchange_backward(sent, *saved, True)
            missing = None
        except RuntimeError as exc:
            missing = str(exc)
        torch.save({"freed": freed, "sent": tuple(sent.shape), "missing": missing,
                    "equal": [torch.equal(a, b) for a, b in zip(one_op[:3], two_ops[:3])]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        assert not exchange._SENT._entries


def test_exchange_backward_sends_the_rows_in_an_op_of_its_own(tmp_path):
    """The sequential exchange's backward as the compile runs it (overlap_ep off): uniep.ep_exchange_backward_send
    all-to-alls the gradient rows and keeps no reference to them, so a compiled backward frees them before the
    experts' backward (its peak memory: the exchange apart's); uniep.ep_exchange_backward then takes the received
    rows, and the gradients are bitwise those of the one-op backward."""
    for r in run_workers(_send_first_worker, 2, (), tmp_path):
        assert r["freed"] and r["sent"] == (0,), r
        assert r["equal"] == [True] * 3, r
        assert "ep_exchange_backward_send" in r["missing"], r["missing"]


def test_exchange_op_refuses_inconsistent_sizes(tmp_path):
    run_workers(_inconsistent_worker, 2, (), tmp_path)


def _inconsistent_worker(rank, world, port, out_dir):
    with gloo_group(rank, world, port, **INTERPRETER):
        import uniep_dynamo  # noqa: F401

        _, _, _, w_up, w_down, _, _, spec = make(1, 8, 4, 1, 1)
        # rank 1's received counts say 3 rows from rank 1, its sizes and the senders' say 2: both ranks raise
        # the same error (rank 0 alone would otherwise wait for rank 1 in the exchange's barriers)
        recv_counts = torch.tensor([[2], [3]]) if rank == 1 else torch.tensor([[2], [2]])
        with pytest.raises(ValueError, match=r"inconsistent split sizes: rank 1: received per-expert counts that "
                                             r"sum to \[2, 3\] per source, receive sizes \[2, 2\]$"):
            torch.ops.uniep.ep_exchange(torch.randn(4, 8), recv_counts, w_up, w_down, None, None, spec.encode(),
                                        dist.group.WORLD.group_name, [2, 2], [2, 2])
        # a rank whose send sizes do not cover its rows
        with pytest.raises(ValueError, match=r"rank 0: send sizes \[2, 2\] for 5 rows$"):
            torch.ops.uniep.ep_exchange(torch.randn(5 if rank == 0 else 4, 8), torch.tensor([[2], [2]]), w_up,
                                        w_down, None, None, spec.encode(), dist.group.WORLD.group_name, [2, 2],
                                        [2, 2])
        torch.save({}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_dispatch_count_table_gives_the_gathered_claims():
    """The exchange's host table built from the dispatch's all-gathered counts is the one the all-gathered
    claims give (what the backward and the layout read), and sizes that disagree with it raise."""
    from uniep_dynamo.ep import exchange

    world, local_experts = 3, 2
    table = torch.randint(0, 5, (world, world * local_experts), generator=torch.Generator().manual_seed(0))
    table[1, 2:4] = 0  # rank 1 sends rank 1 nothing
    blocks = table.view(world, world, local_experts)  # [source, owner, local expert]
    claims = []
    for r in range(world):
        send_sizes, recv_sizes = blocks[r].sum(1).tolist(), blocks[:, r].sum(1).tolist()
        claims.append(exchange._exchange_claims(torch.empty(sum(send_sizes), 4), blocks[:, r], send_sizes,
                                                  recv_sizes, True))
    for r in range(world):
        send_sizes, recv_sizes = blocks[r].sum(1).tolist(), blocks[:, r].sum(1).tolist()
        gathered = exchange._exchange_host(torch.stack(claims), blocks[:, r])
        ours = exchange._table_from_counts(table.tolist(), r, local_experts, True, send_sizes, recv_sizes,
                                           sum(send_sizes))
        assert torch.equal(ours, gathered), r
    with pytest.raises(ValueError, match="disagree with the dispatch's count table"):
        exchange._table_from_counts(table.tolist(), 0, local_experts, True, [0, 0, 0], [0, 0, 0], 0)


class _Wait(torch.autograd.Function):
    """What torch 2.11's all_to_all_single_autograd wraps its result in (_FromTorchTensor): a wait forward,
    the gradient passed through backward."""

    @staticmethod
    def forward(ctx, x):
        from torch.distributed._functional_collectives import wait_tensor
        return wait_tensor(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Double(torch.autograd.Function):
    """Not a pass-through: the exchange must not be matched across it."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


# the compile options of each mode: the overlapped exchange, the default (the exchange's steps one after another in
# one op), and the all-to-alls left apart around uniep.moe_experts; each with the layer in two graphs as Dynamo makes
# them (capture_ep_sizes=False: the graph after the split sizes' host read holds the exchange)
MODES = {"overlap": {"overlap_ep": True, "capture_ep_sizes": False}, "default": {"capture_ep_sizes": False},
         "apart": {"rewrite_ep_exchange": False, "capture_ep_sizes": False}}


def _model_worker(rank, world, port, device, spelling, out_dir):
    with _group(rank, world, port, device) as (device, dtype, scale):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
        import ep_moe
        import uniep_dynamo
        from ep_moe import ExpertParallelMoE
        from uniep_dynamo.ep import custom_ops, plan

        if spelling != "plain":
            wrap = {"torch_2_11": _Wait, "doubling_function": _Double}[spelling]
            a2a = ep_moe.all_to_all_single_autograd
            ep_moe.all_to_all_single_autograd = lambda *args: wrap.apply(a2a(*args))

        hidden, inter = (16, 12) if device.type == "cpu" else (512, 384)
        torch.manual_seed(0)
        model = ExpertParallelMoE(hidden, inter, 2 * world, 2)
        with torch.no_grad():
            for p in (model.gate_up_proj, model.down_proj):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)) * 0.3)
        model.to(device, dtype)
        # two steps with other token counts: the second compiles the graphs again with dynamic split sizes
        xs = [torch.randn((tokens + 3 * rank) * scale, hidden, generator=torch.Generator().manual_seed(100 + rank))
              .to(device, dtype) for tokens in (10, 7)]
        inner = "aot_eager" if device.type == "cpu" else "inductor"
        spy = _Spy()
        in_place = count_in_place_backwards()
        results = {}
        for mode, options in MODES.items():
            paths, inverses = dict(plan.COUNT_TABLE_PATHS), dict(custom_ops.INVERSE_PATHS)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="uniep", options={"inner_backend": inner, **options})
            tensors = []
            with uniep_dynamo.recording() as report:
                for x in xs:
                    model.zero_grad()
                    xi = x.clone().requires_grad_()
                    out = compiled(xi)
                    out.square().mean().backward()
                    tensors += [t.cpu() for t in [out.detach(), xi.grad] + [p.grad for p in model.parameters()]]
            results[mode] = {"tensors": tensors, "totals": report.totals(), "phases": spy.calls,
                             "tables": {k: v - paths[k] for k, v in plan.COUNT_TABLE_PATHS.items()},
                             "inverses": {k: v - inverses[k] for k, v in custom_ops.INVERSE_PATHS.items()},
                             "in_place": len(in_place)}
            spy.calls = 0
            in_place.clear()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("spelling", ["plain", "torch_2_11", "doubling_function"])
def test_compiled_plain_ep_model_exchange_equals_unfused(spelling, tmp_path):
    """examples/ep_moe.py compiled: the graph after the host sync becomes one uniep.ep_exchange (and the combine),
    by default (its steps one after another) and with overlap_ep (its transfers beside the GEMMs), and the output
    and every gradient are bitwise those of the same compile with the all-to-alls and uniep.moe_experts left apart
    (rewrite_ep_exchange=False). torch 2.11 wraps each all-to-all's result in a pass-through autograd.Function,
    which the match looks through; a function that changes the rows leaves the all-to-alls apart."""
    check_model(run_workers(_model_worker, 2, ("cpu", spelling), tmp_path, timeout=600),
                exchanges=0 if spelling == "doubling_function" else 1)


def check_model(ranks, exchanges=1):
    for r in ranks:
        apart = r["apart"]
        # each of the two steps compiles its graphs (the second with dynamic split sizes) and runs a forward and
        # a backward phase
        assert apart["totals"]["ep_exchange"] == 0 and apart["phases"] == 0, apart["totals"]
        assert apart["tables"] == {"dispatch": 0, "gathered": 0}, apart["tables"]
        for mode in ("overlap", "default"):
            got = r[mode]
            assert got["totals"]["ep_exchange"] == 2 * exchanges, (mode, got["totals"])
            # the overlapped pipeline runs on the overlap_ep compile only
            assert got["phases"] == (4 * exchanges if mode == "overlap" else 0), (mode, got["phases"])
            # each exchange took its split sizes and layout from its dispatch's count table, without a collective
            # of its own
            assert got["tables"] == {"dispatch": 2 * exchanges, "gathered": 0}, (mode, got["tables"])
        # the experts' backward reuses its saved buffers (the compile's default) in each step's backward, inside the
        # default exchange too; the overlapped pipeline has its own backward
        assert apart["in_place"] == r["default"]["in_place"] == 2, (apart["in_place"], r["default"]["in_place"])
        assert r["overlap"]["in_place"] == 2 * (1 - exchanges), r["overlap"]["in_place"]
        for mode, got in r.items():
            assert got["totals"]["ep_dispatch"] == 2, (mode, got["totals"])
            # the combine too after the recompile, where the returned rows' count and the order's are separate
            # symbols
            assert got["totals"]["ep_combine"] == 2, (mode, got["totals"])
            # each combine (forward and backward, two steps) took its dispatch's inverse order
            assert got["inverses"] == {"dispatch": 4, "computed": 0}, (mode, got["inverses"])
            for i, (a, b) in enumerate(zip(got["tensors"], apart["tensors"])):
                assert torch.equal(a, b), (mode, i)
