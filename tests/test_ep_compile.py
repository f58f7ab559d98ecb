"""HF transformers' own expert parallelism through the compiler (issue 37): an unmodified HF model with
DistributedConfig(ep_size=N) (AllToAllEP, transformers >= 5.23) compiled with backend="uniep" runs each MoE layer's
whole EP step as ONE uniep.ep_layer in the forward graph and one uniep.ep_layer_backward in the backward graph
(uniep_dynamo/hf_ep.py), with loss and every gradient equal to the same model without uniep, and two runs bitwise
equal. Another backend in the same process sees HF's code, unchanged. CPU, gloo, 2 and 4 processes."""
import os
import re
import tempfile
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from test_ep import run_workers
from test_ep_rewrite import _hf_ep_available, _init

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(_hf_ep_available() is not None, reason=str(_hf_ep_available())),
]


def _save_model(family: str, path: str, num_experts: int):
    """A tiny random-weight model of tests/hf_models.py's family, with `num_experts` experts, saved to `path`."""
    import transformers
    from hf_models import COMMON, FAMILIES

    config_name, extra = FAMILIES[family]
    key = "num_local_experts" if "num_local_experts" in extra else "num_experts"
    config = getattr(transformers, config_name)(**{**COMMON, **extra, key: num_experts})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _graph_ops(graphs) -> set:
    return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}


def _hf_ep_setup(rank, world, port, model_dir):
    """A worker's start: its process group's environment, uniep with hf_ep installed, the uniep log's messages collected
    in a list, and a loader of the saved model under HF's EP (ep_size = fsdp_size = world, fp32). Returns both."""
    _init(rank, world, port)
    import logging

    import uniep_dynamo  # noqa: F401
    from uniep_dynamo import hf_ep

    assert hf_ep.install()
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("uniep").addHandler(handler)

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, distributed_config=DistributedConfig(
            ep_size=world, fsdp_size=world, ep_implementation="all_to_all"))
    return load, messages


def _hf_worker(rank, world, port, model_dir, inductor, out_dir):
    load, _ = _hf_ep_setup(rank, world, port, model_dir)
    import uniep_dynamo
    from test_distributed_training import _counting_backend
    from torch._dynamo.utils import counters

    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(rank))
    results = {}
    try:
        # "uniep": aot_eager, whose AOT graphs recording() notes per compiled graph; "uniep_again": the same
        # AOTAutograd with eager kernels, through a counting inner backend that counts the uniep ops that RUN;
        # "uniep_inductor": the default inner backend
        # another backend beside uniep is checked at 2 ranks (it is a matter of the process, not of the EP size);
        # the layer with its plan on the device (ep_device_plan) beside the first family's run at 2 ranks
        names = ("eager", "uniep", "uniep_again") + (("other_backend",) if world == 2 else ()) + \
            (("uniep_inductor",) if inductor else ()) + (("uniep_device_plan",) if world == 2 and not inductor else ())
        for name in names:
            model = load()
            torch._dynamo.reset()
            counters.clear()
            dynamo_graphs = []
            ran = {}

            def other(gm, example_inputs):  # any backend but uniep: it must see HF's code as written
                dynamo_graphs.append(gm)
                return gm.forward
            if name == "eager":
                run = model
            elif name == "other_backend":
                run = torch.compile(model, backend=other)
            elif name in ("uniep", "uniep_device_plan"):
                run = torch.compile(model, backend="uniep", options={"inner_backend": "aot_eager", **(
                    {"ep_device_plan": True} if name == "uniep_device_plan" else {})})
            elif name == "uniep_inductor":
                run = torch.compile(model, backend="uniep")
            else:
                inner, graphs = _counting_backend()
                ran = graphs["ran"]
                run = torch.compile(model, backend="uniep", options={"inner_backend": inner})
            with uniep_dynamo.recording() as rec:
                loss = run(input_ids=input_ids, labels=input_ids).loss
                loss.backward()
            grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            aot = {}
            for g in rec.graphs:
                for kind, ops in (g.aot_graphs or {}).items():
                    for op, n in ops.items():
                        aot.setdefault(kind, {}).setdefault(op, 0)
                        aot[kind][op] += n
            from uniep_dynamo.explain import Report

            results[name] = {"loss": loss.detach(), "grads": grads, "counters": dict(counters["uniep"]), "aot": aot,
                             "ran": dict(ran), "other_ops": _graph_ops(dynamo_graphs),
                             "summary": Report.from_recorder(rec).summary().splitlines()[0],
                             "gaps": [gap for g in rec.graphs for gap in g.coverage_gaps()]}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


CASES = [
    # (family, world, experts, inductor), what it stresses
    ("qwen3_moe", 2, 4, False),  # two local experts a rank, norm_topk_prob router
    ("mixtral", 2, 4, True),  # Mixtral's experts and router; also behind inductor, the default inner backend
    ("qwen3_moe", 4, 8, False),  # four ranks, two local experts each
]


@pytest.mark.parametrize("family,world,experts,inductor", CASES, ids=lambda v: str(v))
def test_hf_ep_layer_is_one_op(family, world, experts, inductor, tmp_path):
    with tempfile.TemporaryDirectory() as model_dir:
        _save_model(family, model_dir, experts)
        ranks = run_workers(_hf_worker, world, (model_dir, inductor), tmp_path, timeout=900)
    layers = 2  # tests/hf_models.py: two MoE layers
    for r in ranks:
        fused, eager = r["uniep"], r["eager"]
        c = fused["counters"]
        assert c.get("ep_layer", 0) >= 1, (c, fused["aot"])  # the layers share a compiled graph
        # the whole layer is the op: nothing of it is left to the piece-by-piece rewrite
        assert not any(c.get(op) for op in ("ep_dispatch", "ep_combine", "ep_exchange", "ep_unfused", "unfused")), c
        # recording(): every compiled forward graph that holds the op has its backward op in its backward graph
        assert fused["aot"].get("forward", {}).get("ep_layer", 0) >= 1, fused["aot"]
        # the report says so (the layers are traced as the op, not rewritten: before, its totals showed none)
        assert re.search(r", [1-9]\d* EP layer\(s\) as one uniep.ep_layer", fused["summary"]), fused["summary"]
        assert fused["aot"]["forward"]["ep_layer"] == fused["aot"].get("backward", {}).get("ep_layer_backward"), \
            fused["aot"]
        assert not any(op.startswith(("ep_dispatch", "ep_combine", "ep_exchange"))
                       for ops in fused["aot"].values() for op in ops), fused["aot"]
        assert fused["gaps"] == [], fused["gaps"]  # the report's own check of both graphs agrees
        # the ops that ran: one ep_layer per MoE layer forward, one ep_layer_backward per layer backward
        ran = r["uniep_again"]["ran"]
        assert ran.get("forward ep_layer") == layers, ran
        assert ran.get("backward ep_layer_backward") == layers, ran
        assert ran.get("forward moe_router") == layers and ran.get("backward moe_router_backward") == layers, ran
        torch.testing.assert_close(fused["loss"], eager["loss"], atol=1e-5, rtol=1e-5)
        assert fused["grads"].keys() == eager["grads"].keys()
        for name, want in eager["grads"].items():
            torch.testing.assert_close(fused["grads"][name], want, atol=1e-5, rtol=1e-4, msg=name)
            assert torch.equal(fused["grads"][name], r["uniep_again"]["grads"][name]), name
        assert torch.equal(fused["loss"], r["uniep_again"]["loss"])
        # another backend in the same process, after uniep was installed: HF's code, no uniep op, eager's numbers
        if "other_backend" in r:
            other = r["other_backend"]
            assert not any("uniep" in op for op in other["other_ops"]), other["other_ops"]
            assert not other["counters"], other["counters"]
            torch.testing.assert_close(other["loss"], eager["loss"], atol=1e-6, rtol=1e-6)
        # ep_device_plan: the same op in both graphs, its plan on the device, the same bits as the synchronized path
        if "uniep_device_plan" in r:
            planned = r["uniep_device_plan"]
            assert planned["aot"] == fused["aot"], (planned["aot"], fused["aot"])
            assert torch.equal(planned["loss"], fused["loss"])
            for name, want in fused["grads"].items():
                assert torch.equal(planned["grads"][name], want), name
        if inductor:  # the op under inductor: in its AOT graphs, both directions, eager's numbers
            ind = r["uniep_inductor"]
            assert ind["counters"].get("ep_layer", 0) >= 1, ind["counters"]
            assert ind["aot"].get("forward", {}).get("ep_layer", 0) >= 1, ind["aot"]
            assert ind["aot"].get("backward", {}).get("ep_layer_backward", 0) >= 1, ind["aot"]
            torch.testing.assert_close(ind["loss"], eager["loss"], atol=1e-5, rtol=1e-5)
            for name, want in eager["grads"].items():
                torch.testing.assert_close(ind["grads"][name], want, atol=1e-5, rtol=1e-4, msg=name)


# ---- Dynamo guards what the probed spec rests on (hf_ep._signature, compared in the trace by hf_ep._same) --------

def _guard_worker(rank, world, port, model_dir, out_dir):
    load, declines = _hf_ep_setup(rank, world, port, model_dir)
    from test_distributed_training import _counting_backend

    model = load()
    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(rank))
    inner, graphs = _counting_backend()
    run = torch.compile(model, backend="uniep", options={"inner_backend": inner})

    def call(implementation):
        model.set_experts_implementation(implementation)
        compiled, ran = len(graphs["forward"]), graphs["ran"]
        ran.clear()
        with torch.no_grad():  # which path the forward takes is the question; no backward compiles
            loss = run(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            eager = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        return {"implementation": implementation, "loss": loss, "eager": eager, "ran": dict(ran),
                "compiled": len(graphs["forward"]) - compiled, "declines": list(declines)}
    try:
        calls = [call(implementation) for implementation in ("grouped_mm", "eager", "grouped_mm")]
        # an implementation registered with transformers that returns 2 * the grouped_mm experts' output: the experts
        # pattern proves the grouped_mm region inside it, but uniep.ep_layer would compute that region alone
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

        def doubled_experts(experts, hidden_states, top_k_index, top_k_weights):
            return 2 * grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
        ALL_EXPERTS_FUNCTIONS.register("uniep_test_doubled", doubled_experts)  # in this worker process only
        torch._dynamo.reset()  # traced afresh: the doubled implementation's decline, not an earlier entry
        calls.append(call("uniep_test_doubled"))
        torch.save(calls, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hf_ep_layer_follows_the_experts_implementation(tmp_path):
    """The experts' implementation switched after the first compiled call (config._experts_implementation, which
    hf_ep._signature reads): Dynamo's guard on it recompiles, the trace proves the layer again, and the call runs
    what the new implementation is. HF's "eager" experts forward (a loop over the hit experts) does not trace into
    one graph, so hf_ep declines it: no uniep.ep_layer runs, HF's layer is traced as written (a stale cache entry would
    run the grouped_mm experts' ep_layer). Switched back to grouped_mm, ep_layer runs again: the declined entry's trace
    compared the experts' signature too, so its guard fails (before, it served: no ep_layer). Then, traced afresh, an implementation registered with transformers that
    returns 2 * the grouped_mm experts' output: the experts pattern proves the region inside it, but the forward returns
    more than the region (hf_ep._require_returns_root), so hf_ep declines it (before that check, ep_layer ran and gave
    the plain experts' loss). Every call's loss is the uncompiled model's."""
    with tempfile.TemporaryDirectory() as model_dir:
        _save_model("qwen3_moe", model_dir, 4)
        ranks = run_workers(_guard_worker, 2, (model_dir,), tmp_path, timeout=600)
    layers = 2  # tests/hf_models.py: two MoE layers
    for first, switched, back, doubled in ranks:
        assert first["ran"].get("forward ep_layer") == layers, first["ran"]
        assert switched["compiled"] >= 1, "no recompile after the experts implementation changed"
        assert not switched["ran"].get("forward ep_layer"), switched["ran"]  # the stale entry did not serve
        assert any("does not trace into one graph" in m for m in switched["declines"][len(first["declines"]):]), \
            switched["declines"]
        # switched back: the entry traced after the decline guards the implementation too, so ep_layer comes back
        assert back["ran"].get("forward ep_layer") == layers, back["ran"]
        assert not doubled["ran"].get("forward ep_layer"), doubled["ran"]
        assert any("does not return the experts' output" in m and "(mul)" in m
                   for m in doubled["declines"][len(back["declines"]):]), doubled["declines"]
        assert (doubled["eager"] - first["eager"]).abs() > 1e-4, "the doubling does not show in the loss"
        for call in (first, switched, back, doubled):
            torch.testing.assert_close(call["loss"], call["eager"], atol=1e-5, rtol=1e-5, msg=call["implementation"])


# ---- the op against the single-process op, bit for bit (issue 37; DESIGN contract 3) ----------------------------

def _op_case(reuse_saved=False):
    """12 tokens a rank, 4 experts (2 a rank), K = 3 (an order of three partials is visible in fp32: two commute),
    the spec uniep.ep_layer gets from hf_ep._probe (out-of-range slots dropped; ``reuse_saved``: the compile's
    reuse_saved_buffers, which hf_ep hands on)."""
    import dataclasses

    from test_reference import SILU_GLU, make

    hidden, ids, weights, w_up, w_down, b_up, b_down, spec = make(24, 16, 12, 4, 3, gate=SILU_GLU)
    return hidden, ids, weights, w_up, w_down, b_up, b_down, dataclasses.replace(spec, out_of_range="drop",
                                                                                 reuse_saved=reuse_saved)


def _op_worker(rank, world, port, kernels, overlap, reuse_saved, out_dir):
    from test_ep import count_in_place_backwards, gloo_group, rank_leaves, sorted_by_reference

    with gloo_group(rank, world, port, UNIEP_KERNELS=kernels):
        import uniep_dynamo  # noqa: F401

        if kernels == "triton":  # the reference mode runs without triton installed
            from uniep_dynamo.kernels import triton_routing

            triton_routing.routing_plan = sorted_by_reference  # in this worker process, which ends with the test

        in_place = count_in_place_backwards()
        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = _op_case(reuse_saved)
        tokens, e_local = hidden.shape[0] // world, w_up.shape[0] // world
        mine, experts = slice(rank * tokens, (rank + 1) * tokens), slice(rank * e_local, (rank + 1) * e_local)
        leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine, experts)
        # at each token all-to-all: which of the rows sent before are alive, and (in the backward) which of the rows
        # sent back, the received rows and their up projection the forward kept
        import weakref

        from uniep_dynamo.ep import exchange, layer

        alive, sent, kept = [], [], []
        all_to_all = exchange._all_to_all

        def lives(ref, settle=1.0):
            """Whether the tensor is alive, given gloo's worker thread up to ``settle`` s to drop the references
            its finished collectives may hold a little longer (a NCCL work drops them as it completes)."""
            deadline = time.monotonic() + settle
            while ref() is not None and time.monotonic() < deadline:
                time.sleep(0.005)
            return ref() is not None

        def spy(t, *args):
            alive.append(([lives(ref) for ref in sent], [lives(ref, 1.0 if reuse_saved else 0.0) for ref in kept]))
            sent.append(weakref.ref(t))
            out = all_to_all(t, *args)
            received.append(weakref.ref(out))
            return out
        exchange._all_to_all = spy
        # inside the MegaKernel's experts backward, once the GEMMs run: whether the received gradient rows (the third
        # all-to-all's) are still alive
        from uniep_dynamo.kernels import megakernel

        received, grad_rows = [], []
        act_backward = megakernel.act_backward

        def act_spy(*args, **kwargs):
            grad_rows.append(lives(received[2], 1.0) if len(received) >= 3 else None)
            return act_backward(*args, **kwargs)
        megakernel.act_backward = act_spy
        out = torch.ops.uniep.ep_layer(leaves[0], ids[mine], leaves[1], *leaves[2:], spec.encode(),
                                       dist.group.WORLD.group_name, world, overlap, "")[0]
        grad = torch.randn(hidden.shape[0], out.shape[1], generator=torch.Generator().manual_seed(9))[mine]
        (_, rows), = layer._SAVED._entries.values()
        kept.extend(weakref.ref(t) for t in rows[:3])
        del rows
        out.backward(grad, retain_graph=reuse_saved)
        first = len(in_place)
        again = None
        if reuse_saved:  # the saved buffers were overwritten: a second backward must say so, naming the option
            try:
                out.backward(grad)
            except RuntimeError as exc:
                again = str(exc)
        torch.save({"out": out.detach(), "grads": [t.grad for t in leaves[:4]], "in_place": first,
                    "again": again, "alive": alive, "grad_rows": grad_rows}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("kernels,reuse_saved", [
    ("reference", False),  # CPU's default, and what the HF tests above run
    ("triton", False),  # the MegaKernel's kernels in Triton's interpreter (TRITON_INTERPRET=1, conftest): the EP
                        # layer's gather, combine and routing-weight gradient too, as the single-process op's
    ("triton", True),  # and the experts' in-place backward inside the exchange (the compile's reuse_saved_buffers)
])
def test_ep_layer_bitwise_equals_single_process_op(kernels, reuse_saved, tmp_path, monkeypatch):
    """uniep.ep_layer (what HF's AllToAllEP compiles to) at EP=2 against uniep.moe_experts over the global batch in
    one process, both under the same UNIEP_KERNELS: this rank's output rows and hidden-state and routing-weight
    gradients, and each rank's expert-weight gradients, concatenated over ranks, are the single-process op's bits.
    The EP layer runs the MegaKernel's routing kernels exactly where that op runs the MegaKernel (ep/plan.py's
    layer_fused; the Triton and the reference routing-weight gradients differ in the last bit). Within an expert the
    rows run in (source rank, token, k) order, and the combine sums the K = 3 partials in k order in fp32 (DESIGN
    contract 3): another row order changes the weight gradients' bits, another k order the output's. Both sides sort
    the slots by the reference (test_ep.sorted_by_reference: the same integers, 2 s a call less)."""
    from test_ep import single_process, use_kernels

    use_kernels(monkeypatch, kernels)
    ranks = run_workers(_op_worker, 2, (kernels, False, reuse_saved), tmp_path)
    # the in-place backward runs where the fused kernels and the option meet; a second backward then raises, naming
    # the option
    assert [r["in_place"] for r in ranks] == [int(reuse_saved and kernels == "triton")] * 2, ranks
    assert all(r["again"] is None if not reuse_saved else "reuse_saved_buffers" in r["again"] for r in ranks), \
        [r["again"] for r in ranks]
    # each buffer is freed after its last read (issue 37's peak memory): the forward's rows once sent, and its
    # experts' rows once sent back; under reuse_saved the backward frees the rows sent back before the gradient rows
    # go out, the received rows and their up projection before the input-gradient rows come back
    kept = [[False, True, True], [False, False, False]] if reuse_saved else [[True] * 3] * 2
    assert [r["alive"] for r in ranks] == [[([], []), ([False], []), ([False, False], kept[0]),
                                            ([False, False, False], kept[1])]] * 2, [r["alive"] for r in ranks]
    # under reuse_saved the MegaKernel's in-place backward is handed the received gradient rows' only reference and
    # frees them once gathered, before its GEMMs (the op's out-of-place backward holds its argument to the end)
    assert [r["grad_rows"] for r in ranks] == [[] if kernels == "reference" else [not reuse_saved]] * 2, \
        [r["grad_rows"] for r in ranks]
    ref_out, ref_grads = single_process(*_op_case())
    assert torch.equal(torch.cat([r["out"] for r in ranks]), ref_out), "output"
    for j, name in enumerate(("d_hidden", "d_weights", "d_w_up", "d_w_down")):  # per token / per expert
        assert torch.equal(torch.cat([r["grads"][j] for r in ranks]), ref_grads[j]), name


# ---- generate() on HF's EP model ---------------------------------------------------------------------------------

def _generate_worker(rank, world, port, model_dir, out_dir):
    load, _ = _hf_ep_setup(rank, world, port, model_dir)
    from test_distributed_training import _counting_backend
    from torch._dynamo.utils import counters

    from uniep_dynamo.ep import device_plan

    model = load().eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(rank))  # each rank its own prompts
    # every rank takes the same number of steps (each step's layers are collectives over the ranks)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
    try:
        with torch.no_grad():
            want = model.generate(ids, **kwargs)
            inner, graphs = _counting_backend()
            counters.clear()
            plain = model.forward
            model.forward = torch.compile(plain, backend="uniep", options={"inner_backend": inner})
            got = model.generate(ids, **kwargs)
            ran, graph_count = dict(graphs["ran"]), len(graphs["forward"])
            # the layer's plan on the device (the default on GPUs; forced here, on CPU): the same tokens and scores
            torch._dynamo.reset()
            planned_before = device_plan.RUNS["forward"]
            model.forward = torch.compile(plain, backend="uniep", options={"inner_backend": _counting_backend()[0],
                                                                           "ep_device_plan": True})
            planned = model.generate(ids, **kwargs)
        torch.save({"want": want.sequences, "got": got.sequences, "want_scores": list(want.scores),
                    "got_scores": list(got.scores), "ran": ran, "counters": dict(counters["uniep"]),
                    "graphs": graph_count, "planned": planned.sequences, "planned_scores": list(planned.scores),
                    "device_plan_calls": device_plan.RUNS["forward"] - planned_before},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hf_ep_generate_matches_eager(tmp_path):
    """generate() on HF's EP model (ep_size=2, each rank its own prompts), its forward compiled with uniep as users
    speed it up: greedy decoding with the KV cache gives eager's tokens and, step by step, its scores; the prefill
    and every decode step run each MoE layer as one uniep.ep_layer (forward only: no backward under no_grad). With the
    layer's plan on the device (ep_device_plan, the default on GPUs), every call takes it, with the same tokens and
    scores bit for bit."""
    with tempfile.TemporaryDirectory() as model_dir:
        _save_model("qwen3_moe", model_dir, 4)
        ranks = run_workers(_generate_worker, 2, (model_dir,), tmp_path, timeout=900)
    layers, steps = 2, 4  # tests/hf_models.py: two MoE layers; the prefill and three decode steps
    for r in ranks:
        assert torch.equal(r["got"], r["want"]), (r["got"], r["want"])
        assert len(r["got_scores"]) == len(r["want_scores"]) == steps
        for step, (a, b) in enumerate(zip(r["got_scores"], r["want_scores"])):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        assert r["ran"].get("forward ep_layer") == layers * steps, r["ran"]
        assert not any(k.startswith("backward") for k in r["ran"]), r["ran"]
        assert r["graphs"] >= 2, r["graphs"]  # the prefill and at least one decode graph
        assert r["device_plan_calls"] == layers * steps, r["device_plan_calls"]
        assert torch.equal(r["planned"], r["got"])
        assert all(torch.equal(a, b) for a, b in zip(r["planned_scores"], r["got_scores"]))


# ---- HF's EP model under gradient checkpointing ---------------------------------------------------------------------

def _checkpointing_worker(rank, world, port, model_dir, out_dir):
    load, messages = _hf_ep_setup(rank, world, port, model_dir)
    from test_distributed_training import _counting_backend
    from uniep_dynamo import hf_ep
    from uniep_dynamo.ep import device_plan

    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(rank))
    results = {}
    try:
        for name in ("eager", "model", "blocks", "blocks_device_plan"):
            messages.clear()
            model = load()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            torch._dynamo.reset()
            inner, graphs = _counting_backend()
            run = model
            if name == "model":  # the whole model compiled
                run = torch.compile(model, backend="uniep", options={"inner_backend": inner})
            elif name.startswith("blocks"):  # each MoE block compiled, inside the checkpointed decoder layer
                for layer in model.model.layers:  # (the device plan, the default on GPUs, forced here: CPU)
                    layer.mlp.compile(backend="uniep", options={"inner_backend": inner,
                                                                "ep_device_plan": name == "blocks_device_plan"})
            planned = device_plan.RUNS["forward"]
            losses = []
            for _ in range(2):  # the first step compiles inside the checkpointed region, the second does not
                model.zero_grad(set_to_none=True)
                loss = run(input_ids=input_ids, labels=input_ids, use_cache=False).loss
                loss.backward()
                losses.append(loss.detach())
            grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            results[name] = {"losses": losses, "grads": grads, "ran": dict(graphs["ran"]),
                             "graphs": len(graphs["forward"]), "warned": messages.count(hf_ep.EAGER_WARNING),
                             "device_plan_calls": device_plan.RUNS["forward"] - planned}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hf_ep_layer_under_gradient_checkpointing(tmp_path):
    """HF's EP model (ep_size=2) with HF's gradient checkpointing on (non-reentrant, as HF recommends). Compiled
    whole, Dynamo traces no checkpointed decoder layer, for any backend: FSDP2's hook on the experts module breaks the
    graph inside the checkpoint, so the layers run eagerly (README, Training set-ups); the loss is eager's, and uniep
    says once that HF's EP layers ran eagerly, with the recipe (before, nothing was said). With each MoE block
    compiled by uniep, each runs as one uniep.ep_layer in the forward and again in the recomputation, with its backward
    op; loss and every gradient equal the model without uniep over two steps; with the layer's plan on the device
    (ep_device_plan, the default on GPUs), the same bits as its synchronized path. The first step compiles inside the
    checkpointed region: hf_ep's trace-time probe of the experts saves its tensors apart from the checkpoint's, whose
    forward and recomputation must save as many (before, torch.utils.checkpoint raised "A different number of tensors
    was saved during the original forward and recomputation")."""
    with tempfile.TemporaryDirectory() as model_dir:
        _save_model("qwen3_moe", model_dir, 4)
        ranks = run_workers(_checkpointing_worker, 2, (model_dir,), tmp_path, timeout=900)
    layers, steps = 2, 2  # tests/hf_models.py: two MoE layers
    for r in ranks:
        eager, whole, blocks = r["eager"], r["model"], r["blocks"]
        assert not whole["ran"], whole["ran"]  # (if this fails, PyTorch or HF traces the layers now: update the docs)
        assert whole["graphs"] >= 1, "nothing compiled"  # the graphs around the layers: uniep compiled, and
        assert whole["warned"] == 1, whole  # says once that HF's EP layers ran eagerly (before: silent)
        assert eager["warned"] == 0, eager  # no compile in the process yet: running eagerly is what was asked
        assert blocks["ran"].get("forward ep_layer") == 2 * layers * steps, blocks["ran"]  # forward and recomputation
        assert blocks["ran"].get("backward ep_layer_backward") == layers * steps, blocks["ran"]
        planned = r["blocks_device_plan"]
        assert planned["device_plan_calls"] == 2 * layers * steps and blocks["device_plan_calls"] == 0, planned
        assert planned["ran"] == blocks["ran"], planned["ran"]
        assert all(torch.equal(a, b) for a, b in zip(planned["losses"], blocks["losses"]))
        assert all(torch.equal(planned["grads"][n], g) for n, g in blocks["grads"].items())
        for got in (whole, blocks):
            for a, b in zip(got["losses"], eager["losses"]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            assert got["grads"].keys() == eager["grads"].keys()
            for name, want in eager["grads"].items():
                torch.testing.assert_close(got["grads"][name], want, atol=1e-5, rtol=1e-4, msg=name)


# ---- HF's EP model under autocast -----------------------------------------------------------------------------------

def _autocast_worker(rank, world, port, model_dir, out_dir):
    load, messages = _hf_ep_setup(rank, world, port, model_dir)
    from test_distributed_training import _counting_backend
    from torch._dynamo.utils import counters

    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(rank))
    results = {}
    try:
        for name in ("eager", "uniep"):
            model = load()
            torch._dynamo.reset()
            counters.clear()
            inner, graphs = _counting_backend()
            run = model if name == "eager" else torch.compile(model, backend="uniep", options={"inner_backend": inner})
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = run(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            loss.backward()
            grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            results[name] = {"loss": loss.detach(), "grads": grads, "ran": dict(graphs["ran"]),
                             "counters": dict(counters["uniep"]), "messages": list(messages)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hf_ep_model_under_autocast(tmp_path):
    """HF's EP model (ep_size=2, fp32 weights) trained under CPU autocast to bf16, compiled with uniep: hf_ep declines
    the layer (uniep.ep_layer runs no autocast; the log says why), and HF's code, traced, is rewritten piece by piece
    (the router, dispatch, experts and combine ops run in both directions), with the loss and every gradient of the
    uncompiled model under the same autocast (bf16 tolerances)."""
    with tempfile.TemporaryDirectory() as model_dir:
        _save_model("qwen3_moe", model_dir, 4)
        ranks = run_workers(_autocast_worker, 2, (model_dir,), tmp_path, timeout=900)
    for r in ranks:
        fused, eager = r["uniep"], r["eager"]
        assert not fused["ran"].get("forward ep_layer"), fused["ran"]
        assert any("runs under autocast" in m for m in fused["messages"]), fused["messages"]
        layers = 2  # tests/hf_models.py: two MoE layers
        for op in ("moe_router", "ep_dispatch", "moe_experts", "ep_combine"):
            assert fused["ran"].get(f"forward {op}") == layers, fused["ran"]
        for op in ("moe_router_backward", "ep_dispatch_backward", "moe_experts_backward", "ep_combine_backward"):
            assert fused["ran"].get(f"backward {op}") == layers, fused["ran"]
        torch.testing.assert_close(fused["loss"], eager["loss"], atol=1e-2, rtol=1e-2)
        assert fused["grads"].keys() == eager["grads"].keys()
        for name, want in eager["grads"].items():
            got = fused["grads"][name]
            assert (got - want).abs().max() <= 2e-2 * want.abs().max().clamp_min(1e-6), name


# ---- HF's EP model with frozen experts (LoRA-style fine-tuning) -----------------------------------------------------

def _frozen_worker(rank, world, port, model_dir, out_dir):
    load, _ = _hf_ep_setup(rank, world, port, model_dir)
    from uniep_dynamo.ep import layer as ep_layer_module

    asked = []  # param_grads of each ep_layer backward's exchange
    inner = ep_layer_module.exchange_backward
    ep_layer_module.exchange_backward = lambda *a, **k: asked.append(k.get("param_grads", True)) or inner(*a, **k)
    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(rank))
    results = {}
    try:
        for name in ("eager", "uniep"):
            model = load()
            for n, p in model.named_parameters():
                if ".experts." in n:
                    p.requires_grad_(False)
            torch._dynamo.reset()
            asked.clear()
            run = model if name == "eager" else torch.compile(model, backend="uniep",
                                                              options={"inner_backend": "aot_eager"})
            loss = run(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            results[name] = {"loss": loss.detach(), "grads": grads, "asked": list(asked)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hf_ep_model_with_frozen_experts(tmp_path):
    """HF's EP model (ep_size=2) with its experts frozen, as LoRA fine-tuning leaves them: each MoE layer is one
    uniep.ep_layer whose backward asks the exchange for no expert weight gradient, and the loss and every gradient are
    the uncompiled model's."""
    with tempfile.TemporaryDirectory() as model_dir:
        _save_model("qwen3_moe", model_dir, 4)
        ranks = run_workers(_frozen_worker, 2, (model_dir,), tmp_path, timeout=900)
    for r in ranks:
        fused, eager = r["uniep"], r["eager"]
        assert fused["asked"] == [False, False], fused["asked"]  # tests/hf_models.py: two MoE layers
        assert not any(".experts." in name for name in eager["grads"])
        torch.testing.assert_close(fused["loss"], eager["loss"], atol=1e-5, rtol=1e-5)
        assert fused["grads"].keys() == eager["grads"].keys()
        for name, want in eager["grads"].items():
            torch.testing.assert_close(fused["grads"][name], want, atol=1e-5, rtol=1e-4, msg=name)


# ---- the layer with its plan on the device (no host synchronization) ------------------------------------------------

def _device_plan_worker(rank, world, port, kernels, shards, routing, pipelined, out_dir):
    from test_ep import gloo_group, rank_leaves, sorted_by_reference

    with gloo_group(rank, world, port, UNIEP_KERNELS=kernels):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import device_pipeline, device_plan, layer

        if kernels == "triton":
            from uniep_dynamo.kernels import triton_routing

            triton_routing.routing_plan = sorted_by_reference  # in this worker process, which ends with the test
        calls = {"host": 0, "device": 0}
        count_table, forward = layer.count_table, device_plan.forward
        layer.count_table = lambda *a, **k: (calls.__setitem__("host", calls["host"] + 1), count_table(*a, **k))[1]
        device_plan.forward = lambda *a, **k: (calls.__setitem__("device", calls["device"] + 1), forward(*a, **k))[1]
        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = _op_case()
        if routing == "rank0_only":  # rank 1's experts get no row: it receives nothing, and sends its rows away
            ids = ids % 2
        e_local = w_up.shape[0] // world
        start = sum(shards[:rank])
        mine, experts = slice(start, start + shards[rank]), slice(rank * e_local, (rank + 1) * e_local)
        leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine, experts)
        out = torch.ops.uniep.ep_layer(leaves[0], ids[mine], leaves[1], *leaves[2:], spec.encode(),
                                       dist.group.WORLD.group_name, world, pipelined, "", True)[0]
        grad = torch.randn(hidden.shape[0], out.shape[1], generator=torch.Generator().manual_seed(9))[mine]
        out.backward(grad)
        calls["pipelined"], calls["beside"] = device_pipeline.RUNS["forward"], device_pipeline.RUNS["backward"]
        torch.save({"out": out.detach(), "grads": [t.grad for t in leaves[:4]], "calls": calls},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("kernels,shards,routing,pipelined", [
    ("triton", (12, 12), "spread", False),  # the MegaKernel's kernels in the interpreter, as on a GPU
    ("reference", (5, 19), "spread", False),  # ranks of different token counts: the windows take the most rows of any
    ("reference", (12, 12), "rank0_only", False),  # a rank that receives no row
    ("reference", (0, 24), "spread", False),  # a rank with no token (an empty batch) beside one with all of them
    ("triton", (12, 12), "spread", True),  # the forward pipelined: a chunk a local expert, the second's rows past 0
    ("triton", (5, 19), "rank0_only", True),  # pipelined, uneven token counts, a rank whose chunks get no row
])
def test_ep_layer_device_plan_bitwise_equals_single_process_op(kernels, shards, routing, pipelined, tmp_path,
                                                               monkeypatch):
    """uniep.ep_layer with device_plan=True (the compile's ep_device_plan: no host synchronization) at EP=2: the
    counts never reach the host (ep_layer's count_table is not called), the transfer kernel pulls and pushes the rows
    through the symmetric-memory windows (a shared file on CPU) by tables made on the device, and output and every
    gradient are uniep.moe_experts' over the global batch in one process, bit for bit. ``pipelined`` (overlap on):
    the forward's pulls, chunk GEMMs and pushes by chunks of local experts (device_pipeline.py), and the backward's
    d_x pushed before the weight gradients' GEMMs, the same bits."""
    from test_ep import single_process, use_kernels

    use_kernels(monkeypatch, kernels)
    ranks = run_workers(_device_plan_worker, 2, (kernels, shards, routing, pipelined), tmp_path)
    want = {"host": 0, "device": 1, "pipelined": int(pipelined), "beside": int(pipelined)}
    assert [r["calls"] for r in ranks] == [want] * 2, [r["calls"] for r in ranks]
    case = list(_op_case())
    if routing == "rank0_only":
        case[1] = case[1] % 2
    ref_out, ref_grads = single_process(*case)
    assert torch.equal(torch.cat([r["out"] for r in ranks]), ref_out), "output"
    for j, name in enumerate(("d_hidden", "d_weights", "d_w_up", "d_w_down")):  # per token / per expert
        assert torch.equal(torch.cat([r["grads"][j] for r in ranks]), ref_grads[j]), name


def _row_dependent_layout_worker(rank, world, port, out_dir):
    from test_ep import gloo_group, rank_leaves, sorted_by_reference

    with gloo_group(rank, world, port, UNIEP_KERNELS="triton", UNIEP_GATED_EPILOGUE="1"):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.kernels import megakernel, triton_routing

        import dataclasses

        from uniep_dynamo.kernels import config as kconfig

        triton_routing.routing_plan = sorted_by_reference  # in this worker process, which ends with the test
        megakernel.INTERLEAVED_H_INTERPRETED = True
        pick, seen = kconfig.current_config, []

        def by_rows(rows, experts, *a, **k):  # as on a GPU, where QuACK's configs (the gated layout) need 512 rows
            cfg = pick(rows, experts, *a, **k)  # an expert: the knob's layout follows the row count
            if not kconfig._OVERRIDE:
                cfg = dataclasses.replace(cfg, gated_epilogue=rows >= 24 * experts)
            seen.append((rows, cfg.gated_epilogue))
            return cfg
        kconfig.current_config = by_rows
        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = _op_case()
        e_local = w_up.shape[0] // world
        mine, experts = slice(rank * 12, rank * 12 + 12), slice(rank * e_local, (rank + 1) * e_local)
        leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine, experts)
        out = torch.ops.uniep.ep_layer(leaves[0], ids[mine], leaves[1], *leaves[2:], spec.encode(),
                                       dist.group.WORLD.group_name, world, False, "", True)[0]
        out.backward(torch.ones_like(out))
        torch.save({"seen": seen}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_device_plan_backward_runs_with_its_forwards_config(tmp_path, monkeypatch):
    """The device plan's forward picks its experts' config for the receive buffer's worst-case rows, its backward
    sees the received rows only; a config picked for fewer rows may differ, and under config.gated_epilogue the
    layout of h follows the config (on a GPU, QuACK's heuristic configs need 512 rows an expert). Here the layout
    rule is made row-dependent that way: the backward runs with the forward's config, reads the layout the forward
    stored, and the step completes (before, the layout check refused a step in which nothing had changed)."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "triton")
    for r in run_workers(_row_dependent_layout_worker, 2, (), tmp_path):
        assert r["seen"][0] == (72, True), r["seen"]  # the forward's buffer: every rank's 12 tokens x 3 slots
        rows, interleaved = r["seen"][-1]  # the backward: the received rows, fewer, with the forward's config
        assert rows < 72 and rows < 24 * 2 and interleaved, r["seen"]


def _two_calls_worker(rank, world, port, kernels, routing, out_dir):
    from test_ep import gloo_group, rank_leaves, sorted_by_reference

    with gloo_group(rank, world, port, UNIEP_KERNELS=kernels):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import device_plan

        if kernels == "triton":
            from uniep_dynamo.kernels import triton_routing

            triton_routing.routing_plan = sorted_by_reference  # in this worker process, which ends with the test

        compacted = []
        compact = device_plan._compact

        def recording(saved, received):
            before = saved.x.shape[0]
            compact(saved, received)
            compacted.append((before, saved.x.shape[0], saved.up.shape[0], received))
        device_plan._compact = recording
        buffers = []  # the rows of every receive buffer made (forward: x; backward: the gradient rows received)
        make_buffer = device_plan._buffer

        def recording_buffer(rows, like, fused_kernels):
            buffers.append(rows)
            return make_buffer(rows, like, fused_kernels)
        device_plan._buffer = recording_buffer
        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = _op_case()
        if routing == "rank0_only":
            ids = ids % 2
        e_local = w_up.shape[0] // world
        mine, experts = slice(rank * 12, (rank + 1) * 12), slice(rank * e_local, (rank + 1) * e_local)
        leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine, experts)
        grad = torch.randn(hidden.shape[0], w_down.shape[1], generator=torch.Generator().manual_seed(9))[mine]

        def call():
            return torch.ops.uniep.ep_layer(leaves[0], ids[mine], leaves[1], *leaves[2:], spec.encode(),
                                            dist.group.WORLD.group_name, world, False, "", True)[0]
        # two calls before either backward (two MoE layers): the second call's forward shrinks the first's buffers
        first, second = call(), call()
        held_after_second = list(compacted)
        first.backward(grad)
        second.backward(grad)
        torch.save({"outs": [first.detach(), second.detach()], "grads": [t.grad for t in leaves[:4]],
                    "compacted": held_after_second, "buffers": buffers}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("kernels,routing", [("reference", "spread"), ("reference", "rank0_only"),
                                             ("triton", "spread")])  # triton: the MegaKernel's, in the interpreter
def test_ep_layer_device_plan_keeps_only_the_received_rows_of_earlier_calls(kernels, routing, tmp_path, monkeypatch):
    """With the plan on the device the forward sizes its buffers for the most rows a rank could receive; the next
    call's forward keeps only the received rows of what the earlier call saved for its backward (at least one: a
    rank that receives nothing keeps one dropped row). The second call, which no later forward shrinks, has its
    backward's buffers sized by its received rows too (its count is on the host by then: on CPU at once). Two calls,
    then both backwards: each output is the single-process op's, and the gradients are twice its gradients, bit for
    bit."""
    from test_ep import single_process, use_kernels

    use_kernels(monkeypatch, kernels)
    ranks = run_workers(_two_calls_worker, 2, (kernels, routing), tmp_path)
    case = list(_op_case())
    if routing == "rank0_only":
        case[1] = case[1] % 2
    ref_out, ref_grads = single_process(*case)
    capacity = 24 * 3  # every rank's tokens times K
    for rank, r in enumerate(ranks):
        assert len(r["compacted"]) == 1, r["compacted"]
        before, x_rows, up_rows, got = r["compacted"][0]
        want = int((case[1] // 2 == rank).sum())  # the rows routed to this rank's two experts
        assert (before, got, x_rows, up_rows) == (capacity, want, max(want, 1), max(want, 1)), r["compacted"]
        # two forwards at the worst case, then two backwards at the received rows (the second by views, no copy)
        assert r["buffers"] == [capacity, capacity, max(want, 1), max(want, 1)], r["buffers"]
        for out in r["outs"]:
            assert torch.equal(out, ref_out[rank * 12:(rank + 1) * 12]), rank
    assert routing != "rank0_only" or ranks[1]["compacted"][0][3] == 0, "rank 1 should receive nothing"
    for j, name in enumerate(("d_hidden", "d_weights", "d_w_up", "d_w_down")):  # per token / per expert
        assert torch.equal(torch.cat([r["grads"][j] for r in ranks]), 2 * ref_grads[j]), name


def test_device_plan_waits_only_for_calls_more_than_two_behind(monkeypatch):
    """_compact_earlier (no processes): an earlier call whose row count has reached the host is shrunk with no wait;
    one whose count has not stays at the worst case while it is among the two newest such calls, and past them the
    host waits for the oldest's event, then shrinks it; a call whose backward already ran is dropped untouched."""
    from uniep_dynamo.ep import device_plan

    class Event:
        def __init__(self, reached):
            self.reached, self.waited = reached, False

        def query(self):
            return self.reached

        def synchronize(self):
            self.waited = self.reached = True

    def saved(rows=10):
        x = torch.zeros(rows, 4)
        index = torch.arange(rows)
        return device_plan.Saved(None, x, torch.zeros(rows, 6), None, torch.zeros(rows, 1, dtype=torch.int64),
                                 torch.ones(rows, 1), (index, index, torch.tensor([3])), torch.zeros(0), 8, False)
    calls = [saved() for _ in range(5)]
    calls[4].x = None  # its backward ran
    events = [Event(reached) for reached in (False, True, False, False, False)]
    for i, (c, e) in enumerate(zip(calls, events)):
        c.count = (e, torch.tensor([3 + i]))
    monkeypatch.setattr(device_plan, "_EARLIER", [weakref.ref(c) for c in calls])
    device_plan._compact_earlier()
    assert [e.waited for e in events] == [True, False, False, False, False]
    assert [c.x.shape[0] if c.x is not None else None for c in calls] == [3, 4, 10, 10, None]
    assert calls[0].up.shape[0] == calls[0].ids.shape[0] == calls[0].plan[0].shape[0] == 3
    pending = [ref() for ref in device_plan._EARLIER]
    assert len(pending) == 2 and pending[0] is calls[2] and pending[1] is calls[3]
    events[2].reached = True
    device_plan._compact_earlier()  # reached now: shrunk with no wait
    assert [c.x.shape[0] for c in calls[:4]] == [3, 4, 5, 10] and not events[2].waited


def _subgroup_worker(rank, world, port, out_dir):
    from test_ep import gloo_group, rank_leaves

    with gloo_group(rank, world, port, UNIEP_KERNELS="reference"):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import device_plan

        device_plan._cpu_capable = lambda group: False  # as a NCCL group: the host group is a gloo twin
        groups = [dist.new_group([r]) for r in range(world)]  # an EP group of one rank each (every rank makes all)
        mine = groups[rank]
        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = _op_case()
        tokens = slice(rank * 12, (rank + 1) * 12)
        leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, tokens, slice(None))
        out = torch.ops.uniep.ep_layer(leaves[0], ids[tokens], leaves[1], *leaves[2:], spec.encode(), mine.group_name,
                                       1, False, "", True)[0]
        out.backward(torch.ones_like(out))
        twin = device_plan._HOST_GROUPS[mine.group_name][1]
        torch.save({"out": out.detach(), "grads": [t.grad for t in leaves[:4]],
                    "twin": (twin is not mine, dist.get_process_group_ranks(twin))},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def test_ep_layer_device_plan_in_an_ep_group_smaller_than_the_world(tmp_path, monkeypatch):
    """An EP group of one rank in a world of two, without a CPU backend of its own: each rank makes its gloo twin
    alone (no collective over the other rank, which is in another EP group), and the layer runs with its plan on the
    device, with the single-process op's bits over that rank's tokens."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "reference")
    ranks = run_workers(_subgroup_worker, 2, (), tmp_path)
    hidden, ids, weights, w_up, w_down, b_up, b_down, spec = _op_case()
    for rank, r in enumerate(ranks):
        assert r["twin"] == (True, [rank]), r["twin"]
        tokens = slice(rank * 12, (rank + 1) * 12)
        leaves = [t.clone().requires_grad_() for t in (hidden[tokens], weights[tokens], w_up, w_down)]
        want = torch.ops.uniep.moe_experts(leaves[0], ids[tokens], *leaves[1:], b_up, b_down, [], spec.encode())[0]
        want.backward(torch.ones_like(want))
        assert torch.equal(r["out"], want.detach()), rank
        for name, got, t in zip(("d_hidden", "d_weights", "d_w_up", "d_w_down"), r["grads"], leaves):
            assert torch.equal(got, t.grad), (rank, name)
