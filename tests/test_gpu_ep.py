"""Multi-GPU: the sequential EP experts layer (uniep_dynamo/ep.py) over NCCL, bitwise equal to the
single-GPU op for one tile configuration, and run to run."""
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs (a device machine)")]

H, I = 512, 384


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _config(tokens, experts, top_k):
    from uniep_dynamo.kernels.config import heuristic_config
    return heuristic_config(tokens * top_k, experts, H, I, interpret=False)


def _run(hidden, ids, weights, w_up, w_down, grad, fn):
    leaves = [t.clone().requires_grad_() for t in (hidden, weights, w_up, w_down)]
    out = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _worker(rank, world, port, case, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import ep_experts
        from uniep_dynamo.kernels.config import use_config

        tokens, experts, top_k, routing = case
        data = [t.cuda() for t in _inputs(tokens, experts, top_k, routing)]
        hidden, ids, weights, w_up, w_down, grad = data
        per_rank, e_local = tokens // world, experts // world
        mine, local = slice(rank * per_rank, (rank + 1) * per_rank), slice(rank * e_local, (rank + 1) * e_local)
        spec = _spec()
        with use_config(_config(tokens, experts, top_k)):
            runs = [_run(hidden[mine], ids[mine], weights[mine], w_up[local], w_down[local], grad[mine],
                         lambda x, i, w, a, b: ep_experts(x, i, w, a, b, None, None, spec)) for _ in range(2)]
            single = _run(hidden, ids, weights, w_up, w_down, grad,
                          lambda x, i, w, a, b: torch.ops.uniep.moe_experts(x, i, w, a, b, None, None, [], spec)[0])
        torch.save({"runs": [[t.cpu() for t in r] for r in runs],
                    "single": [single[0][mine].cpu(), single[1][mine].cpu(), single[2][mine].cpu(),
                               single[3][local].cpu(), single[4][local].cpu()]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", [(2048, 8, 2, "random"), (1024, 16, 8, "random"), (512, 8, 2, "rank0_only")],
                         ids=["mixtral_like", "qwen_like", "lower_half_of_experts_only"])
def test_ep_layer_bitwise_equal_to_single_gpu(case, world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}")
    workers = mp.spawn(_worker, args=(world, _free_port(), case, str(tmp_path)), nprocs=world, join=False)
    deadline = time.monotonic() + 300
    while not workers.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            pytest.fail("the EP workers did not finish in 300 s")
    names = ("out", "d_hidden", "d_weights", "d_w_up", "d_w_down")
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        first, second = result["runs"]
        for name, a, b, s in zip(names, first, second, result["single"]):
            assert torch.equal(a, b), f"rank {rank}: {name} differs between two runs"
            assert torch.equal(a, s), f"rank {rank}: {name} differs from the single-GPU op " \
                                      f"(max diff {(a.float() - s.float()).abs().max():.3g})"
