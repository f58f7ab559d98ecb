"""The expert-parallel rewrites (patterns/ep.py -> uniep.ep_dispatch / uniep.ep_combine) in 2 and 4 gloo
processes: HF transformers' own AllToAllEP model (>= 5.23) and the same two steps written as plain
functions, compiled with backend="uniep" against eager: loss/outputs and every gradient, rewrite
counts, and two compiled runs bitwise equal. Plus graphs that must not match."""
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from test_ep import _case, run_workers
from test_reference import SILU_GLU

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), UNIEP_KERNELS="reference")


# ---- the two sides of an all-to-all EP layer, spelled as HF's AllToAllEP spells them ----------------

def dispatch_side(hidden, top_k_index, num_experts: int, group):
    world = dist.get_world_size(group)
    top_k = top_k_index.size(-1)
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids)
    send_tokens = hidden[order // top_k]
    send_counts = torch.zeros(num_experts, dtype=torch.long, device=hidden.device)
    send_counts = send_counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
    send_counts = send_counts.view(world, num_experts // world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return send_tokens, order, recv_counts, torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)])


def combine_side(expert_output, order, top_k_weights):
    token_outputs = torch.empty_like(expert_output)
    token_outputs[order] = expert_output
    token_outputs = token_outputs.view(*top_k_weights.shape, expert_output.size(-1))
    return (token_outputs * top_k_weights.unsqueeze(-1)).sum(dim=1)


def _layer(dispatch, combine, hidden, ids, weights, scale, num_experts, group):
    """dispatch, a2a, a per-(local expert) scaling as the experts, a2a back, combine."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    send, order, recv_counts, sizes = dispatch(hidden, ids, num_experts, group)
    send_sizes, recv_sizes = sizes.tolist()
    recv = wait_tensor(all_to_all_single_autograd(send, recv_sizes, send_sizes, group))
    e_local = num_experts // dist.get_world_size(group)
    local = torch.arange(e_local, device=hidden.device).repeat(len(recv_sizes)).repeat_interleave(recv_counts.reshape(-1))
    rows = recv * scale[local].unsqueeze(-1)
    back = wait_tensor(all_to_all_single_autograd(rows, send_sizes, recv_sizes, group))
    return combine(back, order, weights)


def _functions_worker(rank, world, port, case_args, device, out_dir):
    _init(rank, world, port)
    if device == "cuda":
        os.environ.update(UNIEP_KERNELS="auto", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                          NVSHMEM_DISABLE_NVLS="1")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import uniep_dynamo  # noqa: F401
        from torch._dynamo.utils import counters

        hidden, ids, weights, w_up, *_ = (t.to(device) if isinstance(t, torch.Tensor) else t for t in _case(*case_args))
        num_experts = w_up.shape[0]
        tokens = hidden.shape[0] // world
        mine = slice(rank * tokens, (rank + 1) * tokens)
        scale = torch.linspace(0.5, 2.0, num_experts, device=device)[rank * (num_experts // world):(rank + 1) * (num_experts // world)]
        group = dist.group.WORLD
        results = {}
        for name in ("eager", "uniep", "uniep_again"):
            torch._dynamo.reset()
            counters.clear()
            if name == "eager":
                dispatch, combine = dispatch_side, combine_side
            else:
                opts = {"inner_backend": "aot_eager"}
                dispatch = torch.compile(dispatch_side, backend="uniep", options=opts, fullgraph=True)
                combine = torch.compile(combine_side, backend="uniep", options=opts, fullgraph=True)
            h = hidden[mine].clone().requires_grad_()
            w = weights[mine].clone().requires_grad_()
            s = scale.clone().requires_grad_()
            out = _layer(dispatch, combine, h, ids[mine], w, s, num_experts, group)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(rank)).to(device))
            results[name] = {"out": out.detach().cpu(), "grads": [t.grad.cpu() for t in (h, w, s)],
                             "counters": dict(counters["uniep"])}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


FUNCTION_CASES = [
    # (world, (routing, tokens, experts, top_k, gate, bias)), what it stresses
    (2, ("random", 12, 4, 2, SILU_GLU, False)),  # two experts per rank
    (4, ("hot", 12, 8, 3, SILU_GLU, False)),  # one hot expert takes a slot of every token, K odd
    (2, ("rank0_only", 8, 4, 2, SILU_GLU, False)),  # rank 1 receives nothing
    (8, ("hot", 16, 8, 3, SILU_GLU, False)),  # a full node's EP size, one expert per rank, one of them hot
]


@pytest.mark.parametrize("world,case_args", FUNCTION_CASES, ids=lambda v: str(v[0]) if isinstance(v, tuple) else str(v))
def test_ep_steps_rewritten_and_equal_to_eager(world, case_args, tmp_path):
    check_functions(run_workers(_functions_worker, world, (case_args, "cpu"), tmp_path))


def check_functions(ranks):
    for r in ranks:
        assert r["uniep"]["counters"].get("ep_dispatch") == 1 and r["uniep"]["counters"].get("ep_combine") == 1, \
            r["uniep"]["counters"]
        torch.testing.assert_close(r["uniep"]["out"], r["eager"]["out"], atol=1e-5, rtol=1e-5)
        for got, want, name in zip(r["uniep"]["grads"], r["eager"]["grads"], ("d_hidden", "d_weights", "d_scale")):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(r["uniep"]["out"], r["uniep_again"]["out"])
        assert all(torch.equal(a, b) for a, b in zip(r["uniep"]["grads"], r["uniep_again"]["grads"]))


# ---- HF transformers' own expert parallelism ----------------------------------------------------

def dispatch_in_graph() -> bool:
    """Whether Dynamo captures AllToAllEP's dispatch side. HF runs it inside a generator context manager
    (`_use_local_dtensor_params`); torch 2.11's Dynamo cannot resume a graph break (the `.tolist()`)
    there and runs that whole frame in eager, so only the experts and the combine reach uniep. torch
    2.13 resumes it (both seen; 2.12 not tried)."""
    return tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)


def required_ops() -> tuple:
    return ("ep_combine", "moe_experts", "moe_router") + (("ep_dispatch",) if dispatch_in_graph() else ())


def _hf_ep_available() -> str | None:
    try:
        import accelerate  # noqa: F401
        from transformers.distributed import DistributedConfig  # noqa: F401
        from transformers.distributed.expert_parallel import AllToAllEP  # noqa: F401
    except ImportError as exc:
        return f"needs transformers >= 5.23 (DistributedConfig expert parallelism) and accelerate: {exc}"
    return None


def _tiny_qwen3_moe(path, num_experts=4):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=num_experts,
                         num_experts_per_tok=2, head_dim=8, norm_topk_prob=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def hf_ep_layer_ops() -> tuple:
    """What HF's AllToAllEP model becomes where uniep_dynamo/hf_ep.py takes the layer: one uniep.ep_layer per MoE
    layer beside the router's op."""
    return ("ep_layer", "moe_router")


def _hf_worker(rank, world, port, model_dir, capture_scalars, out_dir):
    _init(rank, world, port)
    import logging

    import uniep_dynamo  # noqa: F401
    from torch._dynamo.utils import counters
    from uniep_dynamo import hf_ep

    declines = []
    hf_ep.KNOWN_SOURCES = {}  # hf_ep.py declines (an AllToAllEP it was not checked against): HF's code is traced
    handler = logging.Handler()
    handler.emit = lambda record: declines.append(record.getMessage())
    logging.getLogger("uniep").addHandler(handler)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, distributed_config=DistributedConfig(
            ep_size=world, fsdp_size=world, ep_implementation="all_to_all"))

    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(rank))
    results = {}
    try:
        for name in ("eager", "uniep", "uniep_again"):
            model = load()
            torch._dynamo.reset()
            counters.clear()
            run = model if name == "eager" else torch.compile(model, backend="uniep",
                                                              options={"inner_backend": "aot_eager"})
            with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalars):
                loss = run(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            results[name] = {"loss": loss.detach(), "grads": grads, "counters": dict(counters["uniep"])}
        results["declines"] = [m for m in declines if "runs as HF wrote it" in m]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.skipif(_hf_ep_available() is not None, reason=str(_hf_ep_available()))
@pytest.mark.parametrize("capture_scalars", [
    False,  # hf_ep.py declines: HF's layer traced as written, its two graphs rewritten piece by piece
    True,  # the same, with the `.tolist()` kept in the dispatch graph (the token all-to-all joins it)
], ids=["declined", "declined-capture_scalar_outputs"])
def test_hf_all_to_all_ep_model_rewritten(capture_scalars, tmp_path):
    """HF's own EP model, compiled with backend="uniep": where uniep_dynamo/hf_ep.py declines the layer, its
    dispatch, experts and combine are rewritten piece by piece. Where it takes it (the default), the layer is one op:
    tests/test_ep_compile.py."""
    with tempfile.TemporaryDirectory() as model_dir:
        _tiny_qwen3_moe(model_dir)
        ranks = run_workers(_hf_worker, 2, (model_dir, capture_scalars), tmp_path, timeout=600)
    for r in ranks:
        c = r["uniep"]["counters"]
        assert not any(c.get(k) for k in ("unfused", "router_unfused", "ep_unfused")), c
        # the decline says why; every graph Dynamo compiled (the layers share them; the experts graph compiles
        # again once its split sizes turn dynamic) had its router, dispatch, experts and combine rewritten
        assert any("not a version uniep was checked against" in m for m in r["declines"]), r["declines"]
        assert "ep_layer" not in c, c
        assert all(c.get(op, 0) >= 1 for op in required_ops()), c
        assert c["ep_combine"] == c["moe_experts"], c
        torch.testing.assert_close(r["uniep"]["loss"], r["eager"]["loss"], atol=1e-5, rtol=1e-5)
        assert r["uniep"]["grads"].keys() == r["eager"]["grads"].keys()
        for name, want in r["eager"]["grads"].items():
            torch.testing.assert_close(r["uniep"]["grads"][name], want, atol=1e-5, rtol=1e-4, msg=name)
            assert torch.equal(r["uniep"]["grads"][name], r["uniep_again"]["grads"][name]), name
        assert torch.equal(r["uniep"]["loss"], r["uniep_again"]["loss"])


# ---- graphs that must not match ---------------------------------------------------------------------

class _Stop(Exception):
    pass


def _rewrites(fn, *args):
    """Compile fn with backend="uniep" and stop before running it: (uniep counters, EP near-miss reasons)."""
    import uniep_dynamo
    from torch._dynamo.utils import counters

    def stop(gm, example_inputs):
        def run(*a):
            raise _Stop
        return run

    torch._dynamo.reset()
    counters.clear()
    with uniep_dynamo.recording() as rec, pytest.raises(_Stop):
        torch.compile(fn, backend="uniep", options={"inner_backend": stop}, fullgraph=True)(*args)
    return dict(counters["uniep"]), [m.reason for g in rec.graphs for m in g.near_misses if m.pattern == "ep"]


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _dispatch_variant(descending=False, divisor=None, ranks=None, leak=False):
    def fn(hidden, top_k_index):
        world, top_k, num_experts = dist.get_world_size(), top_k_index.size(-1), 4
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, descending=descending)
        token = order // (divisor or top_k)
        send_tokens = hidden[token]
        send_counts = torch.zeros(num_experts, dtype=torch.long).scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        send_counts = send_counts.view(ranks or world, -1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        return (send_tokens, order, recv_counts) + ((token,) if leak else ())
    return fn


@pytest.mark.parametrize("variant,reason", [
    ({}, None),  # the HF spelling: rewritten
    ({"descending": True}, "the argsort is descending"),  # rows grouped by expert, but in the other order
    ({"divisor": 3}, "the sort order is not divided by the top-k"),  # a token index that is not slot // K
    ({"leak": True}, "is read 2 times"),  # the token index escapes: the op does not return it
], ids=["hf", "descending", "wrong_divisor", "token_index_escapes"])
def test_dispatch_must_not_match(one_rank_group, variant, reason):
    hidden, ids = torch.randn(6, 8), torch.randint(0, 4, (6, 2))
    counts, misses = _rewrites(_dispatch_variant(**variant), hidden, ids)
    if reason is None:
        assert counts.get("ep_dispatch") == 1 and not misses, (counts, misses)
    else:
        assert not counts.get("ep_dispatch") and any(reason in m for m in misses), (counts, misses)


def test_dispatch_refuses_a_count_view_over_other_ranks(one_rank_group):
    """The counts viewed [2, E/2] but exchanged in a group of one rank: the split is not the group's."""
    hidden, ids = torch.randn(6, 8), torch.randint(0, 4, (6, 2))
    counts, misses = _rewrites(_dispatch_variant(ranks=2), hidden, ids)
    assert not counts.get("ep_dispatch") and any("one row to each rank" in m for m in misses), (counts, misses)


def _combine_variant(kind):
    """combine_side with one step changed (`kind`), or combine_side itself for "hf"."""
    if kind == "hf":
        return combine_side

    def fn(expert_output, order, top_k_weights):
        token_outputs = (torch.zeros_like if kind == "zeros" else torch.empty_like)(expert_output)
        early = token_outputs.sum() if kind == "read_before_fill" else None
        token_outputs[order] = expert_output
        token_outputs = token_outputs.view(*top_k_weights.shape, expert_output.size(-1))
        out = (token_outputs * top_k_weights.unsqueeze(-1)).sum(dim=0 if kind == "sum_over_tokens" else 1)
        return out if early is None else (out, early)
    return fn


@pytest.mark.parametrize("kind,matched", [
    ("hf", True),  # HF's spelling
    ("zeros", False),  # zeros_like: rows the order misses read 0, not whatever empty_like held -- another op
    ("read_before_fill", False),  # the buffer is read before the unpermute fills it
    ("sum_over_tokens", False),  # summed over tokens, not over k
], ids=lambda v: str(v))
def test_combine_must_not_match(kind, matched):
    rows, weights = torch.randn(8, 5), torch.rand(4, 2)
    order = torch.randperm(8)
    counts, misses = _rewrites(_combine_variant(kind), rows, order, weights)
    assert bool(counts.get("ep_combine")) == matched, (counts, misses)


def test_combine_op_rejects_an_order_that_is_not_a_permutation():
    rows, weights = torch.randn(4, 3), torch.rand(2, 2)
    with pytest.raises(RuntimeError, match="not a permutation"):
        torch.ops.uniep.ep_combine(rows, torch.tensor([0, 1, 1, 3]), weights)
    with pytest.raises(RuntimeError, match="outside the rows"):
        torch.ops.uniep.ep_combine(rows, torch.tensor([0, 1, 2, 4]), weights)
    torch.testing.assert_close(torch.ops.uniep.ep_combine(rows, torch.tensor([3, 0, 2, 1]), weights),
                               combine_side(rows, torch.tensor([3, 0, 2, 1]), weights))


# ---- examples/ep_moe.py: plain PyTorch EP ---------------------------------------------------------

def _example_worker(rank, world, port, out_dir):
    _init(rank, world, port)
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from ep_moe import run
        saved = {}
        for name, options in (("default", {}), ("two_graphs", {"capture_ep_sizes": False})):
            torch._dynamo.reset()
            results, report = run(tokens=24, hidden=16, intermediate=24, num_experts=2 * world, top_k=2,
                                  inner_backend="aot_eager", options=options)
            saved[name] = {"results": results, "totals": report.totals()}
        torch.save(saved, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_example_plain_pytorch_ep_model(world, tmp_path):
    """examples/ep_moe.py, no setting of the user's: the layer is one uniep.ep_layer (uniep has Dynamo capture the
    split sizes: capture_ep_sizes), beside the router; with capture_ep_sizes=False the two graphs' router, dispatch,
    experts, exchange and combine are each rewritten. Output and every gradient equal to eager within fp32
    tolerance either way."""
    for r in run_workers(_example_worker, world, (), tmp_path):
        t = r["default"]["totals"]
        assert (t["moe_router"], t["ep_layer"], t["moe_experts"], t["ep_dispatch"], t["ep_exchange"], t["ep_combine"],
                t["unfused"], t.get("ep_unfused", 0)) == (1, 1, 1, 0, 0, 0, 0, 0), t
        t = r["two_graphs"]["totals"]
        # the experts are rewritten, then taken into the exchange with the all-to-alls around them
        assert (t["moe_router"], t["ep_dispatch"], t["moe_experts"], t["ep_exchange"], t["ep_combine"], t["unfused"],
                t.get("ep_unfused", 0)) == (1, 1, 1, 1, 1, 0, 0), t
        for path in ("default", "two_graphs"):
            eager, fused = r[path]["results"]["eager"], r[path]["results"]["uniep"]
            for name, a, b in zip(["out", "d_x", "d_gate_up_proj", "d_down_proj", "d_gate"], fused, eager):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{path}: {name}")


def _zero_rows_worker(rank, world, port, out_dir):
    """The example's layer where every token picks rank 0's experts: rank 1 receives no row."""
    _init(rank, world, port)
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import uniep_dynamo
        from ep_moe import ExpertParallelMoE

        torch.manual_seed(0)
        model = ExpertParallelMoE(16, 24, 2 * world, 2)
        with torch.no_grad():  # feature 0 (10 in every token) lifts experts 0 and 1 and sinks the others
            model.gate.weight.zero_()
            model.gate.weight[:2, 0] = 5.0
            model.gate.weight[2:, 0] = -5.0
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(rank))
        x[:, 0] = 10.0
        results, totals = {}, {}
        for name, options in (("eager", None), ("uniep", {}), ("two_graphs", {"capture_ep_sizes": False})):
            torch._dynamo.reset()
            model.zero_grad()
            xi = x.clone().requires_grad_()
            run = model if options is None else torch.compile(model, backend="uniep",
                                                              options={"inner_backend": "aot_eager", **options})
            with uniep_dynamo.recording() as report:
                out = run(xi)
            out.square().mean().backward()
            results[name] = {"out": out.detach(), "d_x": xi.grad,
                             **{f"d_{n}": p.grad.clone() for n, p in model.named_parameters()}}
            totals[name] = report.totals()
        torch.save({"results": results, "totals": totals}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_example_with_a_rank_that_receives_no_row(tmp_path):
    """examples/ep_moe.py where one rank's experts get no token: eager runs (its experts see 0 rows), and uniep's
    rewrite, one ep_layer by default and three ops in two graphs with capture_ep_sizes=False, gives eager's output
    and gradients (rank 1's expert gradients are zeros)."""
    for rank, r in enumerate(run_workers(_zero_rows_worker, 2, (), tmp_path)):
        t = r["totals"]["uniep"]
        assert (t["ep_layer"], t["moe_experts"], t["ep_dispatch"], t["unfused"]) == (1, 1, 0, 0), t
        t = r["totals"]["two_graphs"]
        assert (t["ep_dispatch"], t["moe_experts"], t["ep_exchange"], t["ep_combine"], t["unfused"]) == \
            (1, 1, 1, 1, 0), t
        eager = r["results"]["eager"]
        assert sorted(eager) == ["d_down_proj", "d_gate.weight", "d_gate_up_proj", "d_x", "out"]
        for path in ("uniep", "two_graphs"):
            for name in eager:
                torch.testing.assert_close(r["results"][path][name], eager[name], atol=1e-5, rtol=1e-5,
                                           msg=f"{path}: {name}")
        assert eager["d_gate_up_proj"].any() == (rank == 0) and eager["d_down_proj"].any() == (rank == 0)


def _one_graph_worker(rank, world, port, out_dir):
    """The example's layer compiled with its split sizes traced (capture_scalar_outputs): the variants in _ONE_GRAPH."""
    _init(rank, world, port)
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import uniep_dynamo
        from ep_moe import ExpertParallelMoE
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
        from uniep_dynamo.ep import device_pipeline, device_plan
        from uniep_dynamo.patterns.graph_utils import op_name

        asked = []  # the device plan's calls that asked for its pipeline, and the answers
        reason = device_pipeline.reason
        device_pipeline.reason = lambda *a: asked.append(reason(*a)) or asked[-1]

        class SizesRead(ExpertParallelMoE):
            """The layer with its received row count also read outside the exchange: not one op (the count read
            on the host stays)."""

            def forward(self, x):
                weights, ids = self.route(x)
                send, order, recv_counts, sizes = self.dispatch(x, ids)
                send_sizes, recv_sizes = sizes.tolist()
                recv = wait_tensor(all_to_all_single_autograd(send, recv_sizes, send_sizes, self.group))
                local_ids = torch.arange(self.local_experts).repeat(self.world)
                local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1),
                                                        output_size=sum(recv_sizes)).unsqueeze(-1)
                y = self.experts(recv, local_ids, torch.ones_like(local_ids, dtype=recv.dtype))
                back = wait_tensor(all_to_all_single_autograd(y, send_sizes, recv_sizes, self.group))
                out = self.combine(back, order, weights)
                if self.checked == "check":  # the model's own check on its sizes, which the one op would drop
                    torch._check(sum(recv_sizes) >= 0)
                    return out
                if self.checked == "assert":  # a Python assert: Dynamo checks it on the host read itself
                    assert sum(recv_sizes) <= 10 ** 6, "capacity"
                    return out
                return out + 0 * torch.scalar_tensor(sum(recv_sizes))

            checked = False

        class SizesChecked(SizesRead):
            checked = "check"

        class SizesAsserted(SizesRead):
            checked = "assert"

        torch.manual_seed(0)  # the same router on every rank; experts differ per rank
        plain = ExpertParallelMoE(16, 24, 2 * world, 2)
        sizes_read, sizes_checked = SizesRead(16, 24, 2 * world, 2), SizesChecked(16, 24, 2 * world, 2)
        sizes_asserted = SizesAsserted(16, 24, 2 * world, 2)
        for model in (sizes_read, sizes_checked, sizes_asserted):
            model.load_state_dict(plain.state_dict())
        stacked = torch.nn.Sequential(ExpertParallelMoE(16, 24, 2 * world, 2), ExpertParallelMoE(16, 24, 2 * world, 2))
        with torch.no_grad():
            for model in (plain, sizes_read, sizes_checked, sizes_asserted, *stacked):
                for p in (model.gate_up_proj, model.down_proj):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)) * p.shape[-1] ** -0.5)
        x = torch.randn(24, 16, generator=torch.Generator().manual_seed(100 + rank))
        graphs = []

        def inner(gm, inputs):  # the Dynamo graph as uniep hands it on, then AOTAutograd as the test backends run it
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            graphs.append([op_name(n) or n.op for n in gm.graph.nodes])
            return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, inputs)

        results = {}
        for name, capture, options in _ONE_GRAPH:
            model = {"sizes_read": sizes_read, "sizes_checked": sizes_checked, "sizes_asserted": sizes_asserted}.get(
                name, stacked if name.startswith("stacked") else plain)
            torch._dynamo.reset()
            graphs.clear()
            model.zero_grad()
            xi = x.clone().requires_grad_()
            if name == "eager":
                out = model(xi)
                report = None
            else:
                runs = dict(device_plan.RUNS)
                with torch._dynamo.config.patch(capture_scalar_outputs=capture), uniep_dynamo.recording() as report, \
                        torch.set_grad_enabled(not name.endswith("no_grad")):
                    out = torch.compile(model, backend="uniep", options={"inner_backend": inner, **options})(xi)
                    setting_after = torch._dynamo.config.capture_scalar_outputs  # as it was: the compile put it back
            if name.endswith("no_grad"):  # inference (generate() and the like): the forward only
                results[name] = {"values": [out]}
            else:
                out.square().mean().backward()
                results[name] = {"values": [out.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()]}
            if report is not None:
                results[name].update(setting_after=setting_after,
                                     totals=report.totals(), graphs=list(graphs), gaps=[g.coverage_gaps()
                                                                                      for g in report.graphs],
                                     device_plan_runs={k: device_plan.RUNS[k] - runs[k] for k in runs},
                                     pipeline_asked=list(asked))
                asked.clear()
        # another token count: Dynamo compiles the graph again with the count symbolic, and the layer is one op there too
        torch._dynamo.reset()
        compiled = torch.compile(plain, backend="uniep", options={"inner_backend": inner})
        dynamic = []
        with torch._dynamo.config.patch(capture_scalar_outputs=True), uniep_dynamo.recording() as report:
            for tokens in (24, 17):
                xi = torch.randn(tokens + rank, 16, generator=torch.Generator().manual_seed(tokens + rank))
                dynamic.append((compiled(xi), plain(xi)))
        results["dynamic"] = {"outs": dynamic, "totals": report.totals()}
        torch._dynamo.reset()
        compiled = torch.compile(plain, backend="uniep", options={"inner_backend": inner})
        dynamic = []
        with uniep_dynamo.recording() as report:  # the setting off: uniep captures the sizes in each compile
            for tokens in (24, 17):
                xi = torch.randn(tokens + rank, 16, generator=torch.Generator().manual_seed(tokens + rank))
                dynamic.append((compiled(xi), plain(xi)))
        results["dynamic_default"] = {"outs": dynamic, "totals": report.totals(),
                                      "setting_after": torch._dynamo.config.capture_scalar_outputs}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# (name, capture_scalar_outputs, the compile's options)
_ONE_GRAPH = [("eager", False, {}), ("two_graphs", False, {"capture_ep_sizes": False}), ("one_graph", True, {}),
              ("default", False, {}),
              ("one_graph_device_plan", True, {"ep_device_plan": True}),
              ("one_graph_device_pipeline", True, {"ep_device_plan": True, "overlap_ep": True}),
              ("one_graph_exchange_apart", True, {"rewrite_ep_exchange": False}), ("sizes_read", True, {}),
              ("one_graph_no_grad", True, {}), ("one_graph_device_plan_no_grad", True, {"ep_device_plan": True}),
              ("stacked_two_graphs", False, {"capture_ep_sizes": False}), ("stacked_one_graph", True, {}),
              ("stacked_default", False, {"ep_device_plan": True}), ("sizes_checked", True, {}),
              ("sizes_asserted", True, {})]


@pytest.mark.parametrize("world", [2, 4])
def test_plain_ep_layer_in_one_graph_is_one_op_with_no_host_read(world, tmp_path):
    """examples/ep_moe.py's layer with torch._dynamo.config.capture_scalar_outputs = True: Dynamo traces the split
    sizes' .tolist() as unbacked ints and keeps the layer in one graph, whose dispatch, exchange and combine become
    one uniep.ep_layer; the host reads of the counts and Dynamo's asserts on them go with them, so nothing in the graph
    reads a count on the host, and with its plan on the device (forced here, on CPU) the layer never does. The output
    and every gradient equal the two-graph rewrite's bit for bit. With the exchange left as written
    (rewrite_ep_exchange=False) the dispatch and combine, rewritten in one graph, read each other's replaced nodes
    (before, the backend raised: a node used before its definition). A layer that reads a split size outside the
    exchange, or checks one (torch._check, or a Python assert: the one op would drop the check), stays three ops.
    Under no_grad (inference) the layer is the same one op, with the same output; two stacked layers in one graph are
    two. The default compile, with the setting off, gets the same: uniep has Dynamo trace the frame again with the
    sizes captured (capture_ep_sizes), and puts the setting back; capture_ep_sizes=False leaves two graphs."""
    ranks = run_workers(_one_graph_worker, world, (), tmp_path)
    host_reads = {"item", "_local_scalar_dense", "_assert_scalar", "tolist"}
    for r in ranks:
        two, eager = r["two_graphs"], r["eager"]
        assert (two["totals"]["ep_dispatch"], two["totals"]["ep_exchange"], two["totals"]["ep_layer"]) == (1, 1, 0)
        for name in ("one_graph", "default", "one_graph_device_plan", "one_graph_device_pipeline", "one_graph_no_grad",
                     "one_graph_device_plan_no_grad"):
            got = r[name]
            t = got["totals"]
            assert (t["moe_router"], t["moe_experts"], t["ep_layer"], t["ep_dispatch"], t["ep_exchange"],
                    t["ep_combine"], t["unfused"], t["ep_unmatched"]) == (1, 1, 1, 0, 0, 0, 0, 0), (name, t)
            assert len(got["graphs"]) == 1, (name, len(got["graphs"]))
            ops = got["graphs"][0]
            assert ops.count("ep_layer") == 1 and not host_reads & set(ops), (name, ops)
            assert got["gaps"] == [[]], got["gaps"]
            assert all(torch.equal(a, b) for a, b in zip(got["values"], two["values"])), name
        assert r["one_graph"]["device_plan_runs"] == r["one_graph_no_grad"]["device_plan_runs"] == {"forward": 0}
        assert r["one_graph_device_plan"]["device_plan_runs"] == {"forward": 1}
        # overlap_ep with ep_device_plan: the device plan asks for its pipeline (which the reference kernels, this
        # test's, do not run: the steps one after another, the same bits); without overlap_ep it does not ask
        assert r["one_graph_device_pipeline"]["device_plan_runs"] == {"forward": 1}
        assert r["one_graph_device_pipeline"]["pipeline_asked"] == ["the fused kernels do not run this layer"]
        assert r["one_graph_device_plan"]["pipeline_asked"] == []
        assert r["one_graph_device_plan_no_grad"]["device_plan_runs"] == {"forward": 1}
        apart = r["one_graph_exchange_apart"]
        t = apart["totals"]
        assert (t["ep_dispatch"], t["ep_combine"], t["ep_exchange"], t["ep_layer"]) == (1, 1, 0, 0), t
        assert len(apart["graphs"]) == 1
        stacked, apart_stacked = r["stacked_one_graph"], r["stacked_two_graphs"]  # two layers: one graph, two ops
        t = stacked["totals"]
        assert (t["ep_layer"], t["ep_dispatch"], t["ep_exchange"], t["ep_combine"]) == (2, 0, 0, 0), t
        assert len(stacked["graphs"]) == 1 and stacked["graphs"][0].count("ep_layer") == 2
        assert apart_stacked["totals"]["ep_exchange"] == 2 and len(apart_stacked["graphs"]) >= 3
        assert all(torch.equal(a, b) for a, b in zip(stacked["values"], apart_stacked["values"]))
        # by default (capture_scalar_outputs off, capture_ep_sizes on) the stacked layers are one graph of two ops
        # too: the default's compile above made the layer's split-size read a capture site, which the inlined
        # layers' trace captures at once
        t = r["stacked_default"]["totals"]
        assert (t["ep_layer"], t["ep_dispatch"], t["ep_exchange"], t["ep_combine"]) == (2, 0, 0, 0), t
        assert len(r["stacked_default"]["graphs"]) == 1
        assert r["stacked_default"]["device_plan_runs"] == {"forward": 2}
        assert all(torch.equal(a, b) for a, b in zip(r["stacked_default"]["values"], apart_stacked["values"]))
        # the setting is back as it was after each compile: uniep turned it on for the default's compiles only
        assert all(r[name]["setting_after"] == capture for name, capture, _ in _ONE_GRAPH if name != "eager")
        for dynamic in (r["dynamic"], r["dynamic_default"]):  # the second token count compiled again, symbolic
            assert dynamic["totals"]["ep_layer"] == 2 and dynamic["totals"]["ep_dispatch"] == 0, dynamic["totals"]
            for got, want in dynamic["outs"]:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # a split size read outside the exchange, or checked by the model: three ops, the host read (and the check)
        # kept
        for read in (r["sizes_read"], r["sizes_checked"], r["sizes_asserted"]):
            t = read["totals"]
            assert (t["ep_dispatch"], t["ep_exchange"], t["ep_combine"], t["ep_layer"]) == (1, 1, 1, 0), t
            assert len(read["graphs"]) == 1 and "item" in read["graphs"][0]
        assert all("_assert_scalar" in r[name]["graphs"][0] for name in ("sizes_checked", "sizes_asserted"))
        for got in (apart, two, r["sizes_read"], r["sizes_checked"], r["sizes_asserted"]):
            for i, (a, b) in enumerate(zip(got["values"], eager["values"])):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=str(i))


def _host_list(t):
    return t.tolist()


def test_default_compile_captures_only_the_split_sizes_read(one_rank_group):
    """The default compile (capture_ep_sizes) of the example's layer followed, in the same frame, by a Python branch on
    an unrelated `.item()` (the truth value of a captured int is a hard error in Dynamo, where it was a graph break):
    only the split sizes' host read is captured, so the layer is one uniep.ep_layer and the `.item()` still breaks the
    graph, as does the split sizes' line (a helper function) reached with a tensor no all-to-all exchanged; the same
    under DDP (whose wrapper rewrites the graph before uniep's backend sees it). Output and gradients equal eager's;
    the process-wide setting is never changed, and another backend's compile still breaks the graph at the read uniep
    captured."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
    import uniep_dynamo
    from ep_moe import ExpertParallelMoE

    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    class CountAfter(ExpertParallelMoE):
        def forward(self, x):  # the example's forward, then a count read on the host in the same frame
            weights, ids = self.route(x)
            send, order, recv_counts, sizes = self.dispatch(x, ids)
            send_sizes, recv_sizes = _host_list(sizes)
            recv = wait_tensor(all_to_all_single_autograd(send, recv_sizes, send_sizes, self.group))
            local_ids = torch.arange(self.local_experts).repeat(self.world)
            local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
            y = self.experts(recv, local_ids, torch.ones_like(local_ids, dtype=recv.dtype))
            back = wait_tensor(all_to_all_single_autograd(y, send_sizes, recv_sizes, self.group))
            out = self.combine(back, order, weights)
            n = (ids == 0).sum().item()  # tokens routed to expert 0
            if n:
                out = out * 2
            per_expert = _host_list(torch.bincount(ids.reshape(-1), minlength=4))  # the split sizes' line, other data
            if per_expert[1]:
                out = out * 3
            return out

    torch.manual_seed(0)
    model = CountAfter(16, 24, 4, 2)
    x = torch.randn(24, 16)
    results = []
    for wrap in (None, "compile", "ddp"):
        torch._dynamo.reset()
        model.zero_grad()
        xi = x.clone().requires_grad_()
        run = model if wrap is None else torch.compile(
            model if wrap == "compile" else torch.nn.parallel.DistributedDataParallel(model), backend="uniep",
            options={"inner_backend": "aot_eager"})
        with uniep_dynamo.recording() as report:
            out = run(xi)
        out.square().mean().backward()
        results.append([out.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()])
        assert not torch._dynamo.config.capture_scalar_outputs
        if wrap is not None:
            t = report.totals()
            assert (t["ep_layer"], t["ep_dispatch"], t["ep_exchange"], t["ep_combine"]) == (1, 0, 0, 0), (wrap, t)
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    graphs = []

    def counting(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(ExpertParallelMoE.forward, backend=counting)(model, x)  # the read uniep captured, another backend
    assert len(graphs) == 2, "another backend's compile captured the split sizes"


def test_one_rank_recompile_and_host_copies_of_the_sizes_are_one_op(one_rank_group):
    """At one rank the sent size is all T*K rows: in the compile for a second token count (T symbolic) Dynamo replaces
    the read size by 2*T and keeps its check ``u0 >= 4`` as ``2*T >= 4``, which every input of the graph satisfies
    (a dynamic size is at least 2, which Dynamo guards). The layer is then one uniep.ep_layer in that compile too
    (before, uniep took the check for the model's own and left three ops), with eager's output and gradients. The
    model's own ``torch._check`` on a size it read still keeps the layer three ops, in both compiles, and so does a
    Python ``assert`` of a size's value (Dynamo substitutes the value into the size, after which its check's condition
    reads True in the graph: uniep judges the check as Dynamo stated it; before, the assert was dropped). Sizes copied to
    the host before they are listed (torchtitan's ``.to(torch.device("cpu"), non_blocking=True).tolist()``, or
    ``.cpu()``) make one op too (before, three: the copy was not followed)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
    import uniep_dynamo
    from ep_moe import ExpertParallelMoE
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    # the example's forward with its split sizes read (and checked) otherwise, compiled from a string, since pytest
    # rewrites the asserts of a test module into branches of its own
    template = """
def forward(self, x):
    weights, ids = self.route(x)
    send, order, recv_counts, sizes = self.dispatch(x, ids)
    {read}
    recv = wait_tensor(all_to_all_single_autograd(send, recv_sizes, send_sizes, self.group))
    local_ids = torch.arange(self.local_experts).repeat(self.world)
    local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
    y = self.experts(recv, local_ids, torch.ones_like(local_ids, dtype=recv.dtype))
    back = wait_tensor(all_to_all_single_autograd(y, send_sizes, recv_sizes, self.group))
    return self.combine(back, order, weights)
"""
    reads = {  # the model's own torch._check; a Python assert, which Dynamo substitutes into the size (u1 = 80);
               # torchtitan's spelling: the sizes copied to the host, then listed
        "AtLeast80": "send_sizes, recv_sizes = sizes.tolist()\n    torch._check(sum(recv_sizes) >= 80)",
        "AssertsEqual": "send_sizes, recv_sizes = sizes.tolist()\n    assert sum(recv_sizes) == 80, 'the model check'",
        "CopiedToHost": "send_sizes = sizes[0].to(torch.device('cpu'), non_blocking=True).tolist()\n"
                        "    recv_sizes = sizes.cpu()[1].tolist()"}
    import linecache

    variants = {}
    for name, read in reads.items():
        source, filename = template.format(read=read), f"<uniep test: {name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        scope = {"torch": torch, "wait_tensor": wait_tensor, "all_to_all_single_autograd": all_to_all_single_autograd}
        exec(compile(source, filename, "exec"), scope)
        variants[name] = type(name, (ExpertParallelMoE,), {"forward": scope["forward"]})
    AtLeast80, AssertsEqual, CopiedToHost = (variants[name] for name in reads)

    for cls, layers in ((AssertsEqual, (0,)), (ExpertParallelMoE, (1, 1)), (AtLeast80, (0, 0)), (CopiedToHost, (1, 1))):
        torch.manual_seed(0)
        model = cls(16, 24, 4, 2)
        torch._dynamo.reset()
        run = torch.compile(model, backend="uniep", options={"inner_backend": "aot_eager"})
        for tokens, want in zip((40, 56), layers):
            x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(tokens))
            got = []
            for fn in (model, run):
                model.zero_grad()
                xi = x.clone().requires_grad_()
                with uniep_dynamo.recording() as report:
                    out = fn(xi)
                out.square().mean().backward()
                got.append([out.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()])
            t = report.totals()
            assert (t["ep_layer"], t["ep_dispatch"], t["ep_combine"]) == (want, 1 - want, 1 - want), \
                (cls.__name__, tokens, t)
            for a, b in zip(*got):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_dispatch_op_refuses_a_group_of_another_size(one_rank_group):
    """The rank count is an argument of the op (so a compiled-graph cache keyed on the graph cannot hand a
    graph proven for 4 ranks to a run on 2); a group of another size is an error, not a wrong split."""
    hidden, ids = torch.randn(6, 8), torch.randint(0, 4, (6, 2))
    with pytest.raises(ValueError, match="compiled for 2 ranks"):
        torch.ops.uniep.ep_dispatch(hidden, ids, 4, 2, one_rank_group.group_name)
    rows, order, send, recv, *_ = torch.ops.uniep.ep_dispatch(hidden, ids, 4, 1, one_rank_group.group_name)
    assert torch.equal(order, torch.sort(ids.reshape(-1), stable=True)[1]) and torch.equal(rows, hidden[order // 2])
    assert torch.equal(send, recv) and send.tolist() == [torch.bincount(ids.reshape(-1), minlength=4).tolist()]


def test_dispatch_gathering_its_counts_equals_the_exchange_of_them(one_rank_group):
    """gather_counts (what the rewrite passes where the exchange is rewritten too): the same outputs; the count
    table and the inverse order are handed on, once each, and an expert id out of range is an error."""
    from uniep_dynamo.ep import custom_ops, plan

    hidden, ids = torch.randn(6, 8), torch.randint(0, 4, (6, 2))
    plain = torch.ops.uniep.ep_dispatch(hidden, ids, 4, 1, one_rank_group.group_name)
    gathered = torch.ops.uniep.ep_dispatch(hidden, ids, 4, 1, one_rank_group.group_name, True)
    for a, b in zip(plain, gathered):
        assert torch.equal(a, b)
    recv, order = gathered[3], gathered[1]
    assert plan.take_count_table(recv) == [torch.bincount(ids.reshape(-1), minlength=4).tolist()]
    assert plan.take_count_table(recv) is None  # taken once
    assert torch.equal(custom_ops._known_inverse(order), gathered[4])
    order.add_(0)  # an order written since (its version moved) is not the dispatch's any more
    assert custom_ops._known_inverse(order) is None
    with pytest.raises(RuntimeError, match=r"an expert id lies outside \[0, 4\)"):
        torch.ops.uniep.ep_dispatch(hidden, torch.full((6, 2), 4), 4, 1, one_rank_group.group_name, True)


def test_ep_ops_on_an_empty_batch(one_rank_group):
    """No tokens on this rank: the dispatch sends nothing, the combine returns [0, H], and backward runs."""
    hidden = torch.randn(0, 8, requires_grad=True)
    ids = torch.zeros(0, 2, dtype=torch.long)
    rows, order, send, recv, *_ = torch.ops.uniep.ep_dispatch(hidden, ids, 4, 1, one_rank_group.group_name)
    assert rows.shape == (0, 8) and order.shape == (0,) and send.sum() == 0 and recv.sum() == 0
    weights = torch.rand(0, 2, requires_grad=True)
    out = torch.ops.uniep.ep_combine(rows, order, weights)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert hidden.grad.shape == (0, 8) and weights.grad.shape == (0, 2)


def test_combine_refuses_float64_with_a_reason():
    rows, weights = torch.randn(8, 5, dtype=torch.float64), torch.rand(4, 2, dtype=torch.float64)
    counts, misses = _rewrites(combine_side, rows, torch.randperm(8), weights)
    assert not counts.get("ep_combine") and any("float64" in m for m in misses), (counts, misses)


_RETURNS = {  # what an experts implementation returns of the grouped_mm experts' output `out` (hidden states `h`)
    "contiguous": lambda out, h: out.contiguous(),
    "view_roundtrip": lambda out, h: out.unsqueeze(1).view(h.shape[0], -1),
    "same_dtype_cast": lambda out, h: out.to(out.dtype).clone(),
    "doubled": lambda out, h: 2 * out,
    "plus_one": lambda out, h: out + 1,
    "detach": lambda out, h: out.detach(),
    "flip": lambda out, h: out.flip(0),
    "narrowing_cast": lambda out, h: out.to(torch.bfloat16),
    "cast_roundtrip": lambda out, h: out.to(torch.bfloat16).to(torch.float32),
    "tuple": lambda out, h: (out,),
    "unsqueezed": lambda out, h: out.unsqueeze(0),
    "hidden_instead": lambda out, h: h,
}
_PROBE_CASES = [  # (what the experts forward returns, the decline reason or None: proven), what it stresses
    ("contiguous", None),  # steps that keep every value and the gradient path: proven, ep_layer serves
    ("view_roundtrip", None),  # reshapes that end in the experts' [T, H]
    ("same_dtype_cast", None),
    ("doubled", "(mul) changes it"),  # arithmetic after the region: ep_layer computes the region alone
    ("plus_one", "(add) changes it"),
    ("detach", "(detach) changes it"),  # the same values, but eager sends no gradient to the experts
    ("flip", "(flip) changes it"),  # the rows in another order
    ("narrowing_cast", "cast from torch.float32 to torch.bfloat16"),  # another dtype than the hidden states'
    ("cast_roundtrip", "cast their K-sum's result"),  # a bf16 rounding and back: the match's op out dtype and out cast
    ("tuple", "returns tuple"),  # the graph's output, wrapped by Python code after the graph
    ("unsqueezed", "returns shape [1, 8, 32]"),  # not the [T, H] AllToAllEP combines
    ("hidden_instead", "is also read by"),  # the experts' output is not what the forward returns
]


@pytest.mark.skipif(_hf_ep_available() is not None, reason=str(_hf_ep_available()))
@pytest.mark.parametrize("returns,reason", _PROBE_CASES, ids=[returns for returns, _ in _PROBE_CASES])
def test_hf_ep_probe_requires_the_experts_output_returned(returns, reason, monkeypatch):
    """hf_ep's probe proves the experts computation AND that the experts forward returns it: only value-preserving
    steps (a no-op cast, a reshape back to [T, H], a copy) may follow the proven region (hf_ep._require_returns_root).
    In-process, the probe alone: a tiny Qwen3-MoE's experts with a registered implementation per case."""
    from hf_models import build_model
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    from uniep_dynamo import hf_ep

    def experts_forward(experts, hidden_states, top_k_index, top_k_weights):
        out = grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
        return _RETURNS[returns](out, hidden_states)
    name = f"uniep_test_{returns}"
    monkeypatch.setitem(ExpertsInterface._global_mapping, name, experts_forward)
    model = build_model("qwen3_moe", implementation=name)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    probe_args = (experts, torch.float32, model.config.hidden_size, torch.device("cpu"))
    if reason is None:
        names = hf_ep._probe(*probe_args)[1]
        assert names == ("gate_up_proj", "down_proj", None, None), names
    else:
        with pytest.raises(hf_ep._Decline, match=re.escape(reason)):
            hf_ep._probe(*probe_args)


def _effect(kind):
    """An experts forward step that changes state beside the output (each case of _SIDE_EFFECT_CASES)."""
    def step(experts, out):
        if kind == "buffer_in_place":
            experts.uniep_test_seen.add_(1)
        elif kind == "child_buffer":
            experts.uniep_test_child.seen.add_(1)
        elif kind == "weight_data":
            experts.gate_up_proj.data.mul_(1)
        elif kind == "weight_no_grad":
            with torch.no_grad():
                experts.down_proj.mul_(1)
        elif kind == "attribute_set":
            experts.uniep_test_calls = experts.uniep_test_calls + 1
        elif kind == "config_attribute":
            experts.config.uniep_test_x += 1
        elif kind == "private_dict":
            experts._uniep_test_cache["k"] = 1
        elif kind == "nested_list":
            experts.uniep_test_nested[0].append(1)
        elif kind == "list_append":
            experts.uniep_test_log.append(1)
        return out
    return step


_SIDE_EFFECT_CASES = [  # (what the experts forward does beside returning the grouped_mm experts' output, reason regex)
    ("buffer_in_place", r"uniep_test_seen\S* in place"),  # a tensor changed in place in the graph
    ("child_buffer", r"uniep_test_child\S* in place"),  # a child module's buffer
    ("weight_data", r"gate_up_proj\S* in place"),  # through .data
    ("weight_no_grad", r"down_proj\S* in place"),
    ("attribute_set", r"L\['module'\]\.uniep_test_calls"),  # Python state, from Dynamo's side-effect record
    ("config_attribute", r"config\.uniep_test_x"),
    ("private_dict", r"_uniep_test_cache"),
    ("nested_list", r"uniep_test_nested"),
    ("list_append", r"uniep_test_log"),
]


@pytest.mark.skipif(_hf_ep_available() is not None, reason=str(_hf_ep_available()))
@pytest.mark.parametrize("case,reason", _SIDE_EFFECT_CASES, ids=[c for c, _ in _SIDE_EFFECT_CASES])
def test_hf_ep_probe_declines_side_effects_of_the_experts_forward(case, reason, monkeypatch):
    """An experts forward that changes state beside its output (a buffer or weight in place, a child module's
    buffer, an attribute, the config, a dict or list) is declined with what it changes: uniep.ep_layer never runs
    the forward, so the change would be lost. The probe declines before its graph runs, so it changes nothing of
    the model's."""
    from hf_models import build_model
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    from uniep_dynamo import hf_ep

    effect = _effect(case)

    def experts_forward(experts, hidden_states, top_k_index, top_k_weights):
        return effect(experts, grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights))
    name = f"uniep_test_{case}"
    monkeypatch.setitem(ExpertsInterface._global_mapping, name, experts_forward)
    model = build_model("qwen3_moe", implementation=name)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    experts.register_buffer("uniep_test_seen", torch.zeros(()))
    experts.uniep_test_child = torch.nn.Module()
    experts.uniep_test_child.register_buffer("seen", torch.zeros(()))
    experts.uniep_test_calls, experts.uniep_test_log, experts._uniep_test_cache = 0, [], {}
    experts.uniep_test_nested = [[]]
    experts.config.uniep_test_x = 0
    weights = {n: (p.detach().clone(), p._version) for n, p in experts.named_parameters()}
    with pytest.raises(hf_ep._Decline, match=reason):
        hf_ep._probe(experts, torch.float32, model.config.hidden_size, torch.device("cpu"))
    assert experts.uniep_test_seen.item() == 0 and experts.uniep_test_child.seen.item() == 0
    assert (experts.uniep_test_calls, experts.uniep_test_log, experts._uniep_test_cache, experts.uniep_test_nested,
            experts.config.uniep_test_x) == (0, [], {}, [[]], 0)
    for n, p in experts.named_parameters():
        assert torch.equal(p, weights[n][0]) and p._version == weights[n][1], n


@pytest.mark.skipif(_hf_ep_available() is not None, reason=str(_hf_ep_available()))
@pytest.mark.parametrize("in_place_on", ["gathered_copy", "hidden_states", "hidden_states_view"])
def test_hf_ep_probe_tells_a_copy_from_its_input(in_place_on, monkeypatch):
    """An in-place step on rows gathered from the hidden states (HF's own EP path masks its gathered rows so) changes
    no input: proven. The same step on the hidden states, or on a view of them, changes the caller's tensor:
    declined."""
    from hf_models import build_model
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    from uniep_dynamo import hf_ep

    def experts_forward(experts, hidden_states, top_k_index, top_k_weights):
        with torch.no_grad():  # (the probe's hidden states are a leaf that requires grad)
            if in_place_on == "hidden_states":
                hidden_states.mul_(1)
            elif in_place_on == "hidden_states_view":
                hidden_states[:1].mul_(1)
        return grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
    name = f"uniep_test_{in_place_on}"
    monkeypatch.setitem(ExpertsInterface._global_mapping, name, experts_forward)
    model = build_model("qwen3_moe", implementation=name)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    experts._is_expert_parallel = True  # HF's EP path: masked_fill_ on hidden_states[perm // top_k]
    args = (experts, torch.float32, model.config.hidden_size, torch.device("cpu"))
    if in_place_on == "gathered_copy":
        assert hf_ep._probe(*args)[1] == ("gate_up_proj", "down_proj", None, None)
    else:
        with pytest.raises(hf_ep._Decline, match=r"in place \(mul_\)"):
            hf_ep._probe(*args)


@pytest.mark.skipif(_hf_ep_available() is not None, reason=str(_hf_ep_available()))
def test_hf_ep_probe_names_a_matcher_failure(monkeypatch):
    """An unexpected error inside the matcher declines with the matcher named (it was reported as "does not trace
    into one graph", which sent the reader to the experts' code)."""
    from hf_models import build_model

    from uniep_dynamo import hf_ep

    def broken(*args):
        raise KeyError("meta")
    monkeypatch.setattr(hf_ep, "_match_probe_or_decline", broken)
    model = build_model("qwen3_moe", implementation="grouped_mm")
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    with pytest.raises(hf_ep._Decline, match=re.escape("uniep could not match the experts graph (KeyError")):
        hf_ep._probe(experts, torch.float32, model.config.hidden_size, torch.device("cpu"))


def test_hf_ep_source_hash_reads_text_not_the_ast(tmp_path, monkeypatch):
    """hf_ep.source_hash is a hash of the methods' text: blank and whole-line comment lines do not change it, code
    does, and it does not go through ast.dump (whose output changed between Python 3.11 and 3.12, so an AST hash
    taken on CI's Python declined the same transformers on the GPU machines' Python)."""
    import ast
    import importlib.util

    from uniep_dynamo import hf_ep

    body = '''
class Layer:
    def __call__(self, x):
        return self._combine_tokens(self._dispatch_tokens(x))

    def _dispatch_tokens(self, x):
{extra}        return x * 2

    def _combine_tokens(self, x):
        return x + 1
'''

    def load(name, extra):
        path = tmp_path / f"{name}.py"
        path.write_text(body.format(extra=extra))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.Layer

    plain = hf_ep.source_hash(load("plain", ""))
    assert hf_ep.source_hash(load("commented", "        # a comment\n\n")) == plain
    assert hf_ep.source_hash(load("changed", "        x = x - 1\n")) != plain
    monkeypatch.setattr(ast, "dump", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ast.dump called")))
    assert hf_ep.source_hash(load("again", "        y = x\n")) not in (plain, None)
