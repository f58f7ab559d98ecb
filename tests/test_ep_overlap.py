"""The overlapped EP experts layer (uniep_dynamo/ep/) on CPU: 2 and 4 gloo processes, the Triton
kernels in the interpreter, symmetric memory stood in by shared files. Outputs and every gradient must be
bitwise those of the single-process MegaKernel over all ranks' tokens and all experts, for every chunk
count and with overlap on or off."""
import os

import pytest
import torch
import torch.distributed as dist

from test_ep import gloo_group, rank_leaves, run_workers, single_process
from test_reference import GPT_OSS, RELU2, SILU_GLU, make

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for symmetric memory; "
                       "tests/test_gpu_ep.py runs the CUDA path"),
]

# OverlapConfig's (chunks, overlap, copy_engine, copy_kernel, copy_programs[, copy_block, copy_warps,
# weight_grads_last, copy_streams, push_in_gemm, timing, batch_copies, taper, push_in_gemm_from]). The two cases that
# run them have two experts a rank, so: the default (one chunk of both, by the copy engines through the stage), the
# copy engines over chunks of one expert (no stage) with overlap on and off, torch._foreach_copy_, the transfer kernel
# with one program walking every segment of two chunks (pushing the first chunk's results itself, the second chunk's
# GEMM storing its own into the peers) and with three over one chunk, the copy engines through the stage over three
# streams with overlap off, the transfer kernel pushing the results itself instead of the GEMMs storing them into
# the peers, and the copy engines' batches of (expert, source) runs (no stage) over one chunk of both experts and
# two streams, then over chunks of one expert without overlap. Where the SMs move the rows with overlap on, the GEMMs
# store them by default (push_in_gemm).
KNOBS = [(1, True, None), (2, True, True), (2, False, True), (2, True, False, False),
         (2, True, False, True, 1, 8192, 8, False, 1, True, "", False, False, -1), (1, True, False, True, 3),
         (1, False, True, True, None, 8192, 8, True, 3), (2, True, False, True, 1, 8192, 8, True, 1, False),
         (1, True, True, True, None, 8192, 8, True, 2, True, "", True),
         (2, False, True, True, None, 8192, 8, False, 1, True, "", True)]
# The gate and routing cases (what they stress is the plan and the epilogues, not the schedule) run three of
# them: the default (the stage; with a rank that receives nothing, an empty chunk), chunks of one expert by the copy
# engines, and the transfer kernel with the weight gradients between the chunks.
FEW_KNOBS = [KNOBS[0], KNOBS[1], KNOBS[4]]


def _case(routing, tokens, experts, top_k, gate, bias, split):
    total = sum(split)
    hidden, ids, weights, w_up, w_down, b_up, b_down, spec = make(total, 16, 12, experts, top_k, gate=gate,
                                                                  layout="io" if bias else "oi", bias=bias)
    if routing == "hot":  # every token's first slot on expert 1
        ids[:, 0] = 1
        ids[:, 1:] = (ids[:, 1:] % (experts - 1)) + 2
        ids %= experts
        for t in range(total):  # distinct ids per token
            seen = []
            for k in range(top_k):
                while int(ids[t, k]) in seen:
                    ids[t, k] = (ids[t, k] + 1) % experts
                seen.append(int(ids[t, k]))
    elif routing == "rank0_only":  # every slot on rank 0's experts: the others receive nothing
        ids = torch.stack([torch.randperm(experts // len(split), generator=torch.Generator().manual_seed(t))[:top_k]
                           for t in range(total)]) if total else ids
    elif routing == "dropped":  # out-of-range ids: the op drops those slots
        ids[::3, 0] = experts + 5
        ids[1::4, -1] = -1
    return hidden, ids, weights, w_up, w_down, b_up, b_down, spec


def _worker(rank, world, port, case_args, knobs_list, frozen, out_dir):
    with gloo_group(rank, world, port, UNIEP_KERNELS="triton"):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import OverlapConfig, ep_experts_overlapped, transfer

        barriers = []  # the window barriers this rank takes part in
        plain = transfer.Window.barrier
        transfer.Window.barrier = lambda win: (barriers.append(win), plain(win))[1]
        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = _case(*case_args)
        split = case_args[-1]
        start = sum(split[:rank])
        mine = slice(start, start + split[rank])
        e_local = w_up.shape[0] // world
        experts = slice(rank * e_local, (rank + 1) * e_local)
        results = []
        from torch._dynamo.utils import counters

        for knobs in knobs_list:
            before, scattered = len(barriers), counters["uniep_kernels"]["scattered_gemms"]
            leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine, experts)
            out = ep_experts_overlapped(leaves[0], ids[mine], leaves[1], *leaves[2:], spec.encode(),
                                        knobs=OverlapConfig(*knobs))
            grad = torch.randn(hidden.shape[0], out.shape[1], generator=torch.Generator().manual_seed(9))[mine]
            out.backward(grad)
            results.append({"out": out.detach(), "grads": [t.grad if t is not None else None for t in leaves],
                            "barriers": len(barriers) - before,
                            "scattered": counters["uniep_kernels"]["scattered_gemms"] - scattered})
        if frozen:  # routing weights that need no gradient: no result rows kept for one, the rest the same
            leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine, experts)
            leaves[1].requires_grad_(False)
            out = ep_experts_overlapped(leaves[0], ids[mine], leaves[1], *leaves[2:], spec.encode(),
                                        knobs=OverlapConfig(*knobs_list[0]))
            grad = torch.randn(hidden.shape[0], out.shape[1], generator=torch.Generator().manual_seed(9))[mine]
            out.backward(grad)
            results.append({"out": out.detach(), "grads": [t.grad if t is not None else None for t in leaves]})
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


CASES = [
    # (world, (routing, tokens, experts, top_k, gate, bias, tokens per rank), knobs), what it stresses
    (2, ("random", 0, 4, 2, SILU_GLU, False, (6, 6)), KNOBS),  # Mixtral-like, two experts per rank
    (4, ("random", 0, 8, 3, SILU_GLU, False, (4, 4, 4, 4)), KNOBS[::2]),  # four ranks, K odd, chunks of 1 expert
                                                                          # (half the knob sets: 2 ranks take all)
    (2, ("random", 0, 4, 2, GPT_OSS, True, (5, 5)), FEW_KNOBS),  # [E, H, 2I] layout, interleaved clamped gate, biases
    (2, ("random", 0, 4, 2, RELU2, False, (5, 5)), FEW_KNOBS),  # no gate
    (4, ("hot", 0, 8, 3, SILU_GLU, False, (3, 3, 3, 3)), FEW_KNOBS),  # one hot expert takes a slot of every token
    (2, ("rank0_only", 0, 4, 2, SILU_GLU, False, (4, 4)), FEW_KNOBS),  # rank 1 receives nothing
    (2, ("random", 0, 8, 2, SILU_GLU, False, (3, 7)), FEW_KNOBS),  # uneven token counts per rank
    (2, ("random", 0, 4, 2, SILU_GLU, False, (5, 0)), FEW_KNOBS),  # a rank with no tokens
    (2, ("dropped", 0, 4, 2, SILU_GLU, False, (6, 6)), FEW_KNOBS),  # out-of-range ids are dropped slots
]


CASE_IDS = ["2-random", "4-random", "2-gpt_oss", "2-relu2", "4-hot", "2-rank0_only", "2-uneven", "2-empty_rank",
            "2-dropped"]


@pytest.mark.parametrize("world,case_args,knobs_list", CASES, ids=CASE_IDS)
def test_overlapped_ep_bitwise_equals_single_process(world, case_args, knobs_list, tmp_path, monkeypatch):
    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    import uniep_dynamo  # noqa: F401

    from uniep_dynamo.ep import OverlapConfig

    frozen = knobs_list is KNOBS
    ranks = run_workers(_worker, world, (case_args, knobs_list, frozen), tmp_path)
    ref_out, ref_grads = single_process(*_case(*case_args))
    if frozen:
        last = [r.pop() for r in ranks]
        assert torch.equal(torch.cat([r["out"] for r in last]), ref_out), "frozen routing weights"
        assert all(r["grads"][1] is None for r in last), "frozen routing weights got a gradient"
        for j in (0, 2, 3):
            assert torch.equal(torch.cat([r["grads"][j] for r in last]), ref_grads[j]), f"frozen routing weights {j}"
    for i, knobs in enumerate(knobs_list):
        knob = f"OverlapConfig{knobs}"
        # a step takes four barriers: rows in ``send``, results in ``back``; the same in the backward (from the
        # second call on, the forward's rows go into the cached window while the host waits for the count table)
        assert [r[i]["barriers"] for r in ranks] == [4] * world, knob
        # the GEMMs stored the results into the peers themselves exactly where the SMs move the rows with overlap on
        cfg = OverlapConfig(*knobs)
        scattered = sum(r[i]["scattered"] for r in ranks)
        fused = cfg.gemm_pushes(case_args[2] // world, world)
        assert bool(scattered) == fused, f"{knob}: {scattered} scattered GEMMs"
        assert torch.equal(torch.cat([r[i]["out"] for r in ranks]), ref_out), knob
        for j, name in ((0, "d_hidden"), (1, "d_weights")):  # per token, concatenated over ranks
            assert torch.equal(torch.cat([r[i]["grads"][j] for r in ranks]), ref_grads[j]), f"{name} {knob}"
        for j, name in ((2, "d_w_up"), (3, "d_w_down"), (4, "d_b_up"), (5, "d_b_down")):  # per expert
            if ref_grads[j] is None:
                continue
            assert torch.equal(torch.cat([r[i]["grads"][j] for r in ranks]), ref_grads[j]), f"{name} {knob}"


def _fallback_worker(rank, world, port, out_dir):
    with gloo_group(rank, world, port, UNIEP_KERNELS="triton"):
        from uniep_dynamo.ep import ep_experts
        from uniep_dynamo.ep import ep_experts_overlapped

        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = make(8, 16, 12, 4, 2, dtype=torch.float64)
        mine, experts = slice(rank * 4, rank * 4 + 4), slice(rank * 2, rank * 2 + 2)
        outs = []
        for fn in (ep_experts_overlapped, ep_experts):
            leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine, experts)
            out = fn(leaves[0], ids[mine], leaves[1], *leaves[2:], spec.encode())
            out.sum().backward()
            outs.append([out.detach()] + [t.grad for t in leaves[:4]])
        torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))


def test_kernels_refuse_float64_and_the_sequential_layer_runs(tmp_path):
    """float64 is not a MegaKernel dtype: the overlapped layer runs the sequential one, same results."""
    for overlapped, sequential in run_workers(_fallback_worker, 2, (), tmp_path):
        for a, b in zip(overlapped, sequential):
            assert a.dtype == torch.float64 and torch.equal(a, b)


def _choice_worker(rank, world, port, max_experts, out_dir):
    with gloo_group(rank, world, port, UNIEP_KERNELS="triton"):
        from uniep_dynamo.ep import ep_experts_overlapped, overlap
        from uniep_dynamo.kernels import megakernel

        megakernel.MAX_EXPERTS = max_experts  # in this worker process, which ends with the test
        # which layer runs is all this test asks: neither runs (no kernel in the interpreter, no collective)
        overlap._OverlapEP.apply = lambda *args: "overlapped"
        overlap.ep_experts = lambda *args, **kwargs: "sequential"
        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = make(8, 16, 12, 4, 2)
        mine, experts = slice(rank * 4, rank * 4 + 4), slice(rank * 2, rank * 2 + 2)
        layer = ep_experts_overlapped(hidden[mine], ids[mine], weights[mine], w_up[experts], w_down[experts], None,
                                      None, spec.encode())
        # the single-process op's choice (ops.py: megakernel.use_megakernel) over all tokens and all experts
        single = megakernel.unsupported_reason(hidden, ids, w_up, w_down, b_up, b_down, [], spec) is None
        torch.save({"layer": layer, "single_process_fused": single}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("max_experts", [
    4,  # every rank's experts within the MegaKernel's limit: the overlapped layer's Triton kernels run
    2,  # this rank's 2 experts within it, all 4 past it: the single-process op runs the reference, so does the layer
])
def test_overlapped_layer_takes_its_kernels_where_the_single_process_op_does(max_experts, tmp_path, monkeypatch):
    """ep_experts_overlapped runs its Triton kernels (the MegaKernel's routing plan, gather, combine and routing-weight
    gradient) exactly where the single-process op over all ranks' experts runs the MegaKernel, as the sequential
    layer's routing kernels do (ep/plan.py layer_fused): where E_local <= megakernel.MAX_EXPERTS < E, the sequential
    layer runs (its routing kernels the reference's), else the routing-weight gradient would differ from that op's in
    the last bit. The limit is lowered in the workers (1024 experts would not run in the interpreter)."""
    from test_ep import use_kernels

    use_kernels(monkeypatch, "triton")
    ranks = run_workers(_choice_worker, 2, (max_experts,), tmp_path)
    assert [r["single_process_fused"] for r in ranks] == [max_experts == 4] * 2, ranks  # the case is what it says
    for r in ranks:
        assert r["layer"] == ("overlapped" if r["single_process_fused"] else "sequential"), (max_experts, r)
