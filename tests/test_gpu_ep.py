"""Multi-GPU: the sequential EP experts layer (uniep_dynamo/ep.py) over NCCL and the overlapped one
(uniep_dynamo/ep/) over symmetric memory, bitwise equal to the single-GPU op for one tile
configuration, run to run, and for every chunk count with overlap on or off."""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs (a device machine)")]

H, I = 512, 384


def _inputs(tokens, experts, top_k, routing, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g).bfloat16()
    if routing == "rank0_only":
        ids = torch.stack([torch.randperm(experts // 2, generator=g)[:top_k] for _ in range(tokens)])
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).bfloat16()
    w_up = (torch.randn(experts, 2 * I, H, generator=g) * 0.05).bfloat16()
    w_down = (torch.randn(experts, H, I, generator=g) * 0.05).bfloat16()
    grad = torch.randn(tokens, H, generator=g).bfloat16()
    return hidden, ids, weights, w_up, w_down, grad


def _spec():
    from test_reference import SILU_GLU
    from uniep_dynamo.spec import ExpertsSpec
    return ExpertsSpec("oi", "oi", SILU_GLU, torch.bfloat16).encode()


def _config(tokens, experts, top_k, per_expert_mm=False):
    from uniep_dynamo.kernels.config import heuristic_config
    # the EP layers' experts ops get the received rows already weighted, so they equal the single-GPU op with the
    # routing weights applied before its activation-gradient GEMM (config.late_routing_weight off)
    cfg = dataclasses.replace(heuristic_config(tokens * top_k, experts, H, I, interpret=False),
                              late_routing_weight=False)
    return cfg.replace_gemms(per_expert_mm=True) if per_expert_mm else cfg


def _run(hidden, ids, weights, w_up, w_down, grad, fn):
    leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
    out = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _worker(rank, world, port, case, out_dir):
    from uniep_dynamo.ep import local_rank

    with local_rank(rank, world, port):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import ep_experts
        from uniep_dynamo.ep import OverlapConfig, ep_experts_overlapped
        from torch._dynamo.utils import counters
        from uniep_dynamo.kernels.config import use_config

        tokens, experts, top_k, routing, *flags = case
        data = [t.cuda() for t in _inputs(tokens, experts, top_k, routing)]
        hidden, ids, weights, w_up, w_down, grad = data
        per_rank, e_local = tokens // world, experts // world
        mine, local = slice(rank * per_rank, (rank + 1) * per_rank), slice(rank * e_local, (rank + 1) * e_local)
        spec = _spec()
        with use_config(_config(tokens, experts, top_k, per_expert_mm="per_expert_mm" in flags)):
            runs = [_run(hidden[mine], ids[mine], weights[mine], w_up[local], w_down[local], grad[mine],
                         lambda x, i, w, a, b: ep_experts(x, i, w, a, b, None, None, spec)) for _ in range(2)]
            grouped_mm = []  # torch._grouped_mm calls of each overlapped run (the chunks' GEMMs with outputs of their own)
            scattered = []  # GEMMs of each overlapped run that stored their rows into the peers
            # per_expert_mm: cuBLAS matmuls per expert instead of torch._grouped_mm (it takes precedence)
            # QuACK's GEMMs (the quack knob, where quack-kernels is installed) give torch._grouped_mm's bits too
            gemm_counters = ("per_expert_mm_gemms",) if "per_expert_mm" in flags else ("grouped_mm_gemms", "quack_gemms")
            for knobs in OVERLAP_KNOBS:
                before = sum(counters["uniep_kernels"][c] for c in gemm_counters)
                pushes = counters["uniep_kernels"]["scattered_gemms"]
                runs.append(_run(hidden[mine], ids[mine], weights[mine], w_up[local], w_down[local], grad[mine],
                                 lambda x, i, w, a, b: ep_experts_overlapped(x, i, w, a, b, None, None, spec,
                                                                             knobs=OverlapConfig(*knobs))))
                grouped_mm.append(sum(counters["uniep_kernels"][c] for c in gemm_counters) - before)
                scattered.append(counters["uniep_kernels"]["scattered_gemms"] - pushes)
            single = _run(hidden, ids, weights, w_up, w_down, grad,
                          lambda x, i, w, a, b: torch.ops.uniep.moe_experts(x, i, w, a, b, None, None, [], spec)[0])
        torch.save({"runs": [[t.cpu() for t in r] for r in runs], "grouped_mm": grouped_mm, "scattered": scattered,
                    "single": [single[0][mine].cpu(), single[1][mine].cpu(), single[2][mine].cpu(),
                               single[3][local].cpu(), single[4][local].cpu()]},
                   os.path.join(out_dir, f"rank{rank}.pt"))


# OverlapConfig's (chunks, overlap, copy_engine, copy_kernel, copy_programs[, copy_block, copy_warps,
# weight_grads_last, copy_streams, push_in_gemm, timing, batch_copies, taper, push_in_gemm_from, copy_back_beside,
# gemm_carveout]) for the overlapped layer; the first twice (run to run); then the copy engines' batched driver copies
# (kernels/batch_copy.py) on one and three streams, tapered chunks (half-size first and last) on the transfer kernel
# and on the copy engines' batches, and the transfer kernel pushing every chunk's results but the last's, which its
# GEMM stores into the peers; then the combine copying the result rows itself (copy_back_beside=False); then the
# transfer kernel with torch._grouped_mm leaving its SMs out (gemm_carveout=True; the defaults use every SM)
OVERLAP_KNOBS = [(4, True, None), (4, True, None), (1, True, True), (2, False, True), (4, True, False, False),
                 (8, True, False, True, 7), (4, False, False, True, 132), (4, True, None, True, 32, 8192, 8, False),
                 (2, True, True, True, None, 8192, 8, True, 3), (4, True, False, True, None, 8192, 8, True, 1, False),
                 (2, True, True, True, None, 8192, 8, True, 1, True, "", True),
                 (4, False, True, True, None, 8192, 8, False, 3, True, "", True),
                 (3, True, False, True, None, 8192, 8, True, 1, True, "", False, True),
                 (3, True, True, True, None, 8192, 8, True, 3, True, "", True, True),
                 (4, True, False, True, None, 32768, 8, True, 1, True, "", False, False, -1),
                 (2, True, None, True, None, 32768, 8, True, 1, True, "", False, False, 0, False),
                 (2, True, False, True, None, 32768, 8, True, 1, True, "", False, False, 0, True, True)]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("case", [(2048, 8, 2, "random"), (1024, 16, 8, "random"), (512, 8, 2, "rank0_only"),
                                  (2048, 8, 2, "random", "per_expert_mm")],
                         ids=["mixtral_like", "qwen_like", "lower_half_of_experts_only", "per_expert_mm"])
def test_ep_layer_bitwise_equal_to_single_gpu(case, world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    from test_ep import run_workers
    names = ("out", "d_hidden", "d_weights", "d_w_up", "d_w_down")
    labels = ["sequential", "sequential again"] + [f"overlapped OverlapConfig{k}" for k in OVERLAP_KNOBS]
    results = run_workers(_worker, world, (case,), tmp_path)
    if torch.cuda.get_device_capability(0)[0] == 9 or "per_expert_mm" in case:
        # the heuristic config asks for torch._grouped_mm, which keeps the Triton GEMMs' bits there (a rank that
        # receives no rows runs no GEMM); the per_expert_mm case, for a cuBLAS matmul per expert (with the row
        # bounds from the host's layout), whose bits the GEMMs that store into the peers (Triton) must give too
        calls = [sum(r["grouped_mm"][i] for r in results) for i in range(len(OVERLAP_KNOBS))]
        assert all(calls), f"torch._grouped_mm or per-expert GEMMs per overlapped run, over the ranks: {calls}"
    from uniep_dynamo.ep import OverlapConfig

    scattered = [sum(r["scattered"][i] for r in results) for i in range(len(OVERLAP_KNOBS))]
    fused = [OverlapConfig(*k).gemm_pushes(case[1] // world, world) for k in OVERLAP_KNOBS]
    assert [bool(n) for n in scattered] == fused, f"GEMMs that stored into the peers, per run: {scattered}"
    for rank, result in enumerate(results):
        for label, run in zip(labels, result["runs"]):
            for name, a, s in zip(names, run, result["single"]):
                assert torch.equal(a, s), f"rank {rank}, {label}: {name} differs from the single-GPU op " \
                                          f"(max diff {(a.float() - s.float()).abs().max():.3g})"


def _stacked_worker(rank, world, port, out_dir):
    from uniep_dynamo.ep import local_rank

    with local_rank(rank, world, port) as device:
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import ep_experts_overlapped, transfer
        from uniep_dynamo.kernels.config import use_config

        tokens, experts, top_k = 1024, 16, 8
        per_rank, e_local = tokens // world, experts // world
        mine, local = slice(rank * per_rank, (rank + 1) * per_rank), slice(rank * e_local, (rank + 1) * e_local)
        spec = _spec()
        layers = [[t.cuda() for t in _inputs(tokens, experts, top_k, "random", seed=seed)] for seed in (1, 2)]
        # the copy of each layer's result rows out of the window (ep/transfer.py's copy_back) starts some 50 ms late:
        # the second layer's forward must not push its rows into the window's ``back`` before it is done
        late = transfer._COPY_BACK.setdefault(str(device), torch.cuda.Stream(device))

        def step(delay: bool):
            leaves, outs = [], []
            for hidden, ids, weights, w_up, w_down, grad in layers:
                leaves.append([t.clone().requires_grad_() for t in (hidden[mine], weights[mine], w_up[local],
                                                                    w_down[local])])
                if delay:
                    late.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(late):
                        torch.cuda._sleep(100_000_000)
                outs.append(ep_experts_overlapped(leaves[-1][0], ids[mine], *leaves[-1][1:], None, None, spec))
            torch.autograd.backward(outs, [layer[5][mine] for layer in layers])
            return outs, leaves
        with use_config(_config(tokens, experts, top_k)):
            step(False)  # the kernels compiled and the window made, so that the delayed step's host runs ahead
            outs, leaves = step(True)
            single = [_run(*layer, lambda x, i, w, a, b: torch.ops.uniep.moe_experts(x, i, w, a, b, None, None, [],
                                                                                       spec)[0])
                      for layer in layers]
        torch.save({"layers": [[o.detach().cpu()] + [t.grad.cpu() for t in lv] for o, lv in zip(outs, leaves)],
                    "single": [[s[0][mine].cpu(), s[1][mine].cpu(), s[2][mine].cpu(), s[3][local].cpu(),
                                s[4][local].cpu()] for s in single]},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, 4])
def test_stacked_layers_keep_their_result_rows(world, tmp_path):
    """Two overlapped layers' forwards, then one backward, with the copies of the result rows (which the routing
    weights' gradient reads) held back on their stream: each layer bitwise equal to the single-GPU op."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    from test_ep import run_workers
    names = ("out", "d_hidden", "d_weights", "d_w_up", "d_w_down")
    for rank, result in enumerate(run_workers(_stacked_worker, world, (), tmp_path)):
        for layer, (got, want) in enumerate(zip(result["layers"], result["single"])):
            for name, a, b in zip(names, got, want):
                assert torch.equal(a, b), f"rank {rank}, layer {layer}: {name} differs from the single-GPU op"


def _hf_gpu_worker(rank, world, port, model_dir, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    import uniep_dynamo  # noqa: F401
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from uniep_dynamo.ep import device_pipeline, device_plan
    from transformers.distributed import DistributedConfig

    input_ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(rank)).cuda()
    results = {}
    captures = []  # CUDA graphs captured (inductor's cudagraph trees capture through torch.cuda.CUDAGraph)
    capture_begin = torch.cuda.CUDAGraph.capture_begin
    torch.cuda.CUDAGraph.capture_begin = lambda self, *a, **k: (captures.append(1), capture_begin(self, *a, **k))[1]
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for name in ("eager", "uniep", "uniep_again", "uniep_graphs", "uniep_device_plan", "uniep_sync",
                         "uniep_overlap"):
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, distributed_config=(
                    DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation="all_to_all")))
                torch._dynamo.reset()
                counters.clear()
                # uniep_graphs: mode="reduce-overhead", inductor's CUDA graphs around the EP layers; three steps
                run = model if name == "eager" else torch.compile(
                    model, backend="uniep", mode="reduce-overhead" if name == "uniep_graphs" else None,
                    options={"uniep_device_plan": {"ep_device_plan": True},
                             "uniep_sync": {"ep_device_plan": False}, "uniep_overlap": {"overlap_ep": True}}.get(name))
                captures.clear()
                planned_before = device_plan.RUNS["forward"]
                piped_before = dict(device_pipeline.RUNS)
                try:
                    for _ in range(3 if name == "uniep_graphs" else 1):
                        torch.compiler.cudagraph_mark_step_begin()
                        model.zero_grad(set_to_none=True)
                        loss = run(input_ids=input_ids, labels=input_ids).loss
                        loss.backward()
                except Exception as exc:  # noqa: BLE001 -- the test reports it (the other runs raise as they are)
                    if name != "uniep_graphs":
                        raise
                    results[(dtype, name)] = {"error": repr(exc)[:2000]}
                    continue
                grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).float().cpu()
                         for n, p in model.named_parameters() if p.grad is not None}
                results[(dtype, name)] = {"loss": loss.detach().float().cpu(), "grads": grads,
                                          "counters": dict(counters["uniep"]),
                                          "captures": len(captures),
                                          "device_plan_calls": device_plan.RUNS["forward"] - planned_before,
                                          "pipelined": {k: device_pipeline.RUNS[k] - piped_before[k]
                                                        for k in piped_before}}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_hf_all_to_all_ep_model_on_gpus(world, tmp_path):
    """HF transformers' own EP (AllToAllEP, >= 5.23) over NCCL, compiled with backend="uniep" (inductor
    behind it): each layer one uniep.ep_layer; in fp32, loss and gradients within 1e-4 / 1e-3 of HF's eager EP
    path; in bf16, the loss within bf16 tolerance and two compiled runs bitwise equal. The default (ep_device_plan
    "auto") runs the layer with its plan on the device here in bf16 (a tiny model on one host; fp32 is not the fused
    kernels'), as True does; False (the synchronized path) gives the same bits, and so does overlap_ep (the device
    plan's pipeline). Under mode="reduce-overhead" (three steps) CUDA graphs are captured around the EP layers, and
    loss and gradients are the compile's without them, bit for bit."""
    import tempfile

    from test_ep_rewrite import _hf_ep_available, _tiny_qwen3_moe, hf_ep_layer_ops
    if _hf_ep_available() is not None:
        pytest.skip(_hf_ep_available())
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    from test_ep import run_workers
    with tempfile.TemporaryDirectory() as model_dir:
        _tiny_qwen3_moe(model_dir, num_experts=8)
        ranks = run_workers(_hf_gpu_worker, world, (model_dir,), tmp_path, timeout=500)
    for rank, r in enumerate(ranks):
        for dtype in (torch.float32, torch.bfloat16):
            eager, first, again = (r[(dtype, name)] for name in ("eager", "uniep", "uniep_again"))
            c = first["counters"]
            # uniep_dynamo/hf_ep.py takes each layer whole: one uniep.ep_layer (the piece-by-piece rewrite of HF's
            # code, where it declines, is tested on CPU: test_ep_rewrite.py's "declined" cases)
            assert all(c.get(op, 0) >= 1 for op in hf_ep_layer_ops()), c
            assert not any(c.get(k) for k in ("unfused", "router_unfused", "ep_unfused", "ep_dispatch")), c
            fp32 = dtype == torch.float32
            torch.testing.assert_close(first["loss"], eager["loss"], atol=1e-4 if fp32 else 2e-2,
                                       rtol=1e-4 if fp32 else 2e-2)
            assert torch.equal(first["loss"], again["loss"])
            for name, want in eager["grads"].items():
                got = first["grads"][name]
                rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
                # bf16: a token whose top-k choice is near a tie can pick another expert, so only gross
                # errors (a wrong permutation, a lost slot) are caught there; fp32 is the tight check
                assert rel < (1e-3 if fp32 else 0.25), f"rank {rank} {dtype}: {name} relative error {rel:.3g}"
                assert torch.equal(got, again["grads"][name]), f"rank {rank} {dtype}: {name} differs between runs"
            # under CUDA graphs (the EP ops run between the captured parts): the compile's loss and gradients
            graphs = r[(dtype, "uniep_graphs")]
            assert "error" not in graphs, graphs["error"]
            assert graphs["captures"] > 0 and graphs["counters"].get("ep_layer", 0) >= 1, (graphs["captures"],
                                                                                         graphs["counters"])
            assert first["captures"] == 0, first["captures"]
            # ep_device_plan: the layer's plan on the device (no host synchronization) by default ("auto") and with
            # True, eager's loss and gradients; False: the synchronized path, the same bits
            # On CUDA the device plan needs the fused kernels (bf16 here; fp32 runs the cuBLAS reference, which reads
            # the expert counts on the host): in fp32 every variant takes the synchronized path
            planned, sync = r[(dtype, "uniep_device_plan")], r[(dtype, "uniep_sync")]
            assert planned["counters"].get("ep_layer", 0) >= 1, planned["counters"]
            calls = (first["device_plan_calls"], planned["device_plan_calls"])
            assert (min(calls) >= 1) if not fp32 else calls == (0, 0), calls
            assert sync["device_plan_calls"] == 0 and sync["counters"].get("ep_layer", 0) >= 1, sync["counters"]
            torch.testing.assert_close(sync["loss"], first["loss"], atol=0, rtol=0)
            for name, want in first["grads"].items():
                assert torch.equal(sync["grads"][name], want), f"rank {rank} {dtype}: {name} synchronized path"
            torch.testing.assert_close(planned["loss"], eager["loss"], atol=1e-4 if fp32 else 2e-2,
                                       rtol=1e-4 if fp32 else 2e-2)
            for name, want in eager["grads"].items():
                rel = float((planned["grads"][name] - want).norm() / want.norm().clamp_min(1e-12))
                assert rel < (1e-3 if fp32 else 0.25), f"rank {rank} {dtype}, device plan: {name} error {rel:.3g}"
            torch.testing.assert_close(graphs["loss"], first["loss"], atol=0, rtol=0)
            for name, want in first["grads"].items():
                assert torch.equal(graphs["grads"][name], want), f"rank {rank} {dtype}: {name} under CUDA graphs"
            # overlap_ep under the default "auto": the device plan's pipeline (forward chunks, the backward's d_x
            # pushed beside the weight gradients), the device plan's bits (its chunk GEMMs are Triton's or QuACK's,
            # device_pipeline.chunk_config: the backends give the same bits on this GPU, as the layer test checks)
            piped = r[(dtype, "uniep_overlap")]
            if fp32:  # the synchronized path's overlapped exchange, which runs its steps in turn in fp32
                assert piped["device_plan_calls"] == 0, piped["device_plan_calls"]
            else:
                assert piped["device_plan_calls"] >= 1 and piped["pipelined"]["forward"] >= 1 and \
                    piped["pipelined"]["backward"] >= 1, (piped["device_plan_calls"], piped["pipelined"])
            assert first["pipelined"] == {"forward": 0, "backward": 0}, first["pipelined"]
            torch.testing.assert_close(piped["loss"], first["loss"], atol=0, rtol=0)
            for name, want in first["grads"].items():
                assert torch.equal(piped["grads"][name], want), f"rank {rank} {dtype}: {name} under overlap_ep"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ep_dispatch_and_combine_ops_on_gpus(world, tmp_path):
    """The dispatch and combine rewrites of tests/test_ep_rewrite.py over NCCL, the ops on CUDA (their
    Triton combine kernels): equal to eager within fp32 tolerance, bitwise run to run."""
    from test_ep import run_workers
    from test_ep_rewrite import FUNCTION_CASES, _functions_worker, check_functions
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    for case_world, case_args in FUNCTION_CASES:
        if case_world == world:
            out_dir = tmp_path / case_args[0]
            out_dir.mkdir()
            check_functions(run_workers(_functions_worker, world, (case_args, "cuda"), out_dir))


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("routing", ["random", "one_rank_receives_nothing", "idle_expert"])
def test_exchange_op_on_gpus(world, routing, tmp_path):
    """uniep.ep_exchange over symmetric memory (bf16, a few hundred rows per source and expert): the
    overlapped path bitwise equal to the sequential steps it replaces (NCCL all-to-alls around the experts
    op), on every rank."""
    from test_ep import run_workers
    from test_ep_exchange import _op_worker, check_op
    from test_reference import SILU_GLU
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    check_op(run_workers(_op_worker, world, (routing, SILU_GLU, "cuda"), tmp_path), routing)


@pytest.mark.parametrize("world", [2, 4])
def test_compiled_plain_ep_model_exchange_on_gpus(world, tmp_path):
    """examples/ep_moe.py in bf16 compiled with uniep over inductor: with uniep.ep_exchange, output and every
    gradient bitwise those of the same compile with the exchange rewrite off."""
    from test_ep import run_workers
    from test_ep_exchange import _model_worker, check_model
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    check_model(run_workers(_model_worker, world, ("cuda", "plain"), tmp_path, timeout=600))


def _one_graph_worker(rank, world, port, out_dir):
    """examples/ep_moe.py in bf16 over inductor with its split sizes traced (capture_scalar_outputs), by default (the
    device plan, "auto") and with ep_device_plan=False; and the two-graph compile: three steps, the last with the
    second's token count (no compile), its host synchronizations counted."""
    from test_ep_exchange import _group

    with _group(rank, world, port, "cuda") as (device, dtype, _):
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
        import uniep_dynamo
        from ep_moe import ExpertParallelMoE
        from test_ep_single_rank import host_syncs
        from uniep_dynamo.ep import device_plan

        torch.manual_seed(0)
        model = ExpertParallelMoE(512, 384, 4 * world, 2)
        with torch.no_grad():
            for p in (model.gate_up_proj, model.down_proj):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)) * 0.3)
        model.to(device, dtype)
        xs = [torch.randn(tokens + 3 * rank, 512, generator=torch.Generator().manual_seed(100 + rank))
              .to(device, dtype) for tokens in (970, 680, 680)]
        results = {}
        from torch._inductor import list_mode_options

        graphs = {"inductor": dict(list_mode_options("reduce-overhead"))}
        for name, capture, options in (("two_graphs", False, {"ep_device_plan": False, "capture_ep_sizes": False}),
                                       ("one_graph", True, {}), ("default", False, {}),
                                       ("one_graph_sync", True, {"ep_device_plan": False}),
                                       ("one_graph_cuda_graphs", True, graphs)):
            torch._dynamo.reset()
            runs = device_plan.RUNS["forward"]
            compiled = torch.compile(model, backend="uniep", options={"inner_backend": "inductor", **options})
            tensors, syncs = [], None
            with torch._dynamo.config.patch(capture_scalar_outputs=capture), uniep_dynamo.recording() as report:
                for step, x in enumerate(xs):
                    if options is graphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    model.zero_grad()
                    xi = x.clone().requires_grad_()
                    torch.cuda.synchronize(device)
                    with host_syncs() as found:
                        out = compiled(xi)
                        out.float().square().mean().backward()
                    if step == 2:
                        syncs = list(found)
                    tensors += [t.cpu() for t in [out.detach(), xi.grad] + [p.grad for p in model.parameters()]]
            results[name] = {"tensors": tensors, "totals": report.totals(), "syncs": syncs,
                             "device_plan_runs": device_plan.RUNS["forward"] - runs,
                             "gaps": [g.coverage_gaps() for g in report.graphs]}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, 4])
def test_plain_ep_model_in_one_graph_on_gpus(world, tmp_path):
    """examples/ep_moe.py with capture_scalar_outputs, and by default without it (uniep captures the sizes:
    capture_ep_sizes): one uniep.ep_layer per compile, which by default keeps its plan
    on the device: a step makes no host synchronization, and the output and every gradient are bitwise those of
    the two-graph compile (which reads the counts on the host), of ep_device_plan=False, and of the default under
    mode="reduce-overhead" (inductor's CUDA graphs around the op: the graph has no data-dependent shape left)."""
    from test_ep import run_workers
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    for r in run_workers(_one_graph_worker, world, (), tmp_path, timeout=600):
        two = r["two_graphs"]
        assert two["totals"]["ep_exchange"] == 2 and two["totals"]["ep_layer"] == 0, two["totals"]
        assert two["syncs"], "the two-graph compile reads the split sizes on the host"
        for name in ("one_graph", "default", "one_graph_sync", "one_graph_cuda_graphs"):
            got = r[name]
            # the first step's compile and the second's (dynamic token count); the third runs the second's
            assert got["totals"]["ep_layer"] == 2 and got["totals"]["ep_exchange"] == 0, (name, got["totals"])
            assert all(g == [] for g in got["gaps"]), got["gaps"]
            assert all(torch.equal(a, b) for a, b in zip(got["tensors"], two["tensors"])), name
        assert r["one_graph"]["device_plan_runs"] == r["one_graph_cuda_graphs"]["device_plan_runs"] == 3
        assert r["default"]["device_plan_runs"] == 3
        assert r["one_graph_sync"]["device_plan_runs"] == 0
        assert r["one_graph"]["syncs"] == r["default"]["syncs"] == [], (r["one_graph"]["syncs"], r["default"]["syncs"])


def _device_plan_worker(rank, world, port, case, pipelined, out_dir):
    from uniep_dynamo.ep import local_rank

    with local_rank(rank, world, port) as device:
        import uniep_dynamo  # noqa: F401
        from test_ep_single_rank import host_syncs
        from uniep_dynamo.ep import device_pipeline, device_plan, layer
        from uniep_dynamo.kernels.config import use_config

        tokens, experts, top_k, routing = case
        hidden, ids, weights, w_up, w_down, grad = [t.cuda() for t in _inputs(tokens, experts, top_k, routing)]
        per_rank, e_local = tokens // world, experts // world
        mine, local = slice(rank * per_rank, (rank + 1) * per_rank), slice(rank * e_local, (rank + 1) * e_local)
        spec = _spec()
        host_tables = []
        count_table = layer.count_table
        layer.count_table = lambda *a, **k: (host_tables.append(1), count_table(*a, **k))[1]

        def planned(x, i, w, a, b):
            return torch.ops.uniep.ep_layer(x, i, w, a, b, None, None, spec, dist.group.WORLD.group_name, world,
                                            pipelined, "", True)[0]
        with use_config(_config(tokens, experts, top_k)):
            runs = [_run(hidden[mine], ids[mine], weights[mine], w_up[local], w_down[local], grad[mine], planned)]
            torch.cuda.synchronize(device)
            with host_syncs() as forward_syncs:  # the kernels are compiled and the windows made by now
                leaves = [t.clone().requires_grad_() for t in (hidden[mine], weights[mine], w_up[local],
                                                               w_down[local])]
                out = planned(leaves[0], ids[mine], *leaves[1:])
            with host_syncs() as backward_syncs:
                out.backward(grad[mine])
            runs.append([out.detach()] + [t.grad for t in leaves])
            single = _run(hidden, ids, weights, w_up, w_down, grad,
                          lambda x, i, w, a, b: torch.ops.uniep.moe_experts(x, i, w, a, b, None, None, [], spec)[0])
        gloo_twin = any(entry[1] is not entry[0] for entry in device_plan._HOST_GROUPS.values())  # NCCL: a twin
        torch.save({"runs": [[t.cpu() for t in r] for r in runs], "host_tables": len(host_tables),
                    "pipelined": device_pipeline.RUNS["forward"], "beside": device_pipeline.RUNS["backward"],
                    "syncs": (forward_syncs, backward_syncs), "host_group": gloo_twin,
                    "single": [single[0][mine].cpu(), single[1][mine].cpu(), single[2][mine].cpu(),
                               single[3][local].cpu(), single[4][local].cpu()]},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pipelined", [False, True], ids=["steps", "pipelined"])
@pytest.mark.parametrize("case", [(1024, 16, 8, "random"), (512, 8, 2, "rank0_only")],
                         ids=["qwen_like", "lower_half_of_experts_only"])
def test_ep_layer_device_plan_on_gpus(case, world, pipelined, tmp_path):
    """uniep.ep_layer with device_plan=True (the compile's ep_device_plan) over NCCL and symmetric memory: no host
    synchronization in its forward or its backward (torch's sync debug mode, after a first call), the counts never
    on the host, and output and every gradient the single-GPU op's bits, twice. ``pipelined`` (overlap on): the
    forward pipelined (ep/device_pipeline.py), its chunk GEMMs by Triton or QuACK (chunk_config) where the
    single-GPU op's config runs CUTLASS's, the backward's gradient rows pulled by the same chunks and its d_x pushed
    beside its weight gradients' GEMMs: the same bits, as the backends' probes found."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    from test_ep import run_workers
    names = ("out", "d_hidden", "d_weights", "d_w_up", "d_w_down")
    for rank, result in enumerate(run_workers(_device_plan_worker, world, (case, pipelined), tmp_path)):
        assert result["pipelined"] == (2 if pipelined else 0), result["pipelined"]  # two calls a worker
        assert result["beside"] == (2 if pipelined else 0), result["beside"]
        assert result["host_tables"] == 0 and result["host_group"], result["host_tables"]
        assert result["syncs"] == ([], []), result["syncs"]
        for i, run in enumerate(result["runs"]):
            for name, a, s in zip(names, run, result["single"]):
                assert torch.equal(a, s), f"rank {rank}, run {i}: {name} differs from the single-GPU op " \
                                          f"(max diff {(a.float() - s.float()).abs().max():.3g})"
