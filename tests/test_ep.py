"""Expert parallelism on CPU: the sequential EP experts layer (uniep_dynamo/ep.py) in 2 and 4 gloo
processes against the single-process op over all tokens and all experts: output, every gradient, and
the routing plan each rank receives."""
import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_reference import GPT_OSS, SILU_GLU, make
from uniep_dynamo.ep import free_port, local_rank

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _case(routing, tokens, experts, top_k, gate, bias):
    hidden, ids, weights, w_up, w_down, b_up, b_down, spec = make(tokens, 16, 12, experts, top_k, gate=gate,
                                                                  bias=bias)
    if routing == "hot":  # every token's first slot on expert 1, the rest spread
        ids[:, 0] = 1
        ids[:, 1:] = torch.stack([torch.randperm(experts - 1, generator=torch.Generator().manual_seed(t))[:top_k - 1]
                                  + 2 for t in range(tokens)]) % experts
    elif routing == "rank0_only":  # every slot on rank 0's experts: the other ranks receive nothing
        ids = torch.stack([torch.randperm(2, generator=torch.Generator().manual_seed(t))[:top_k] for t in range(tokens)])
    return hidden, ids, weights, w_up, w_down, b_up, b_down, spec


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int, **env):
    """A worker's gloo process group, with `env` set first; destroyed on the way out."""
    os.environ.update(**env)
    with local_rank(rank, world, port, "cpu"):
        yield


def _worker(rank, world, port, case_args, out_dir):
    with gloo_group(rank, world, port, UNIEP_KERNELS="reference"):
        import uniep_dynamo  # noqa: F401
        from uniep_dynamo.ep import ep_experts

        hidden, ids, weights, w_up, w_down, b_up, b_down, spec = _case(*case_args)
        tokens = hidden.shape[0] // world
        e_local = w_up.shape[0] // world
        mine = slice(rank * tokens, (rank + 1) * tokens)
        experts = slice(rank * e_local, (rank + 1) * e_local)
        leaves = rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine, experts)
        out = ep_experts(leaves[0], ids[mine], leaves[1], *leaves[2:], spec.encode())
        grad = torch.randn(hidden.shape[0], out.shape[1], generator=torch.Generator().manual_seed(9))[mine]
        out.backward(grad)
        torch.save({"out": out.detach(), "grads": [t.grad if t is not None else None for t in leaves]},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def rank_leaves(hidden, weights, w_up, w_down, b_up, b_down, mine: slice, experts: slice) -> list:
    """This rank's tokens and experts, as fresh leaves that require grad (None stays None)."""
    leaves = [hidden[mine], weights[mine], w_up[experts], w_down[experts],
              b_up[experts] if b_up is not None else None, b_down[experts] if b_down is not None else None]
    return [t.clone().requires_grad_() if t is not None else None for t in leaves]


def single_process(hidden, ids, weights, w_up, w_down, b_up, b_down, spec):
    """(output, gradients of hidden, weights, w_up, w_down, b_up, b_down) of the single-process op over all
    tokens and experts, for the output gradient the EP workers use (seed 9)."""
    leaves = [t.clone().requires_grad_() if t is not None else None
              for t in (hidden, weights, w_up, w_down, b_up, b_down)]
    out = torch.ops.uniep.moe_experts(leaves[0], ids, *leaves[1:], [], spec.encode())[0]
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)))
    return out.detach(), [t.grad if t is not None else None for t in leaves]


def count_in_place_backwards() -> list:
    """A list that gains an entry each time the experts' in-place backward claims its saved buffers
    (megakernel.claim_saved_buffers, from the in-place op or the EP exchange's backward), in this worker process,
    which ends with the test."""
    from uniep_dynamo.kernels import megakernel

    claim, calls = megakernel.claim_saved_buffers, []

    def claiming(*args):
        calls.append(1)
        return claim(*args)
    megakernel.claim_saved_buffers = claiming
    return calls


def sorted_by_reference(ids, num_experts, clamp):
    """triton_routing.routing_plan's integers (tests/test_megakernel.py holds them equal) from the reference's sort,
    for tests that run the Triton kernels in the interpreter to check floating-point bits: there the Triton counting
    sort (a tl.sort of 1024 keys a block) takes some 2 s a call. Tests put it in triton_routing.routing_plan's place."""
    from uniep_dynamo.kernels import reference
    return reference.routing_plan(ids.clamp(0, num_experts - 1) if clamp else ids, num_experts)


def use_kernels(monkeypatch, kernels: str) -> None:
    """UNIEP_KERNELS=kernels for this test ("reference" or "triton"). For "triton": skip unless Triton's interpreter
    is on (the kernels on CPU tensors run only there), and sort the slots by sorted_by_reference. The reference mode
    imports no triton, so it runs without triton installed."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU tensors run only in the interpreter (TRITON_INTERPRET=1, which "
                    "conftest sets without a GPU)")
    monkeypatch.setenv("UNIEP_KERNELS", kernels)
    if kernels == "triton":
        from uniep_dynamo.kernels import triton_routing

        monkeypatch.setattr(triton_routing, "routing_plan", sorted_by_reference)


def _reference(case_args):
    return single_process(*_case(*case_args))


CASES = [
    # (world, (routing, tokens, experts, top_k, gate, bias)), what it stresses
    (2, ("random", 12, 4, 2, SILU_GLU, False)),  # Mixtral-like, two experts per rank
    (4, ("random", 16, 8, 3, SILU_GLU, False)),  # four ranks, K odd
    (2, ("random", 10, 4, 2, GPT_OSS, True)),  # interleaved clamped gate with biases (bias gradients local)
    (4, ("hot", 12, 8, 3, SILU_GLU, False)),  # one hot expert takes a slot of every token
    (2, ("rank0_only", 8, 4, 2, SILU_GLU, False)),  # rank 1 receives nothing; its expert grads are zero
    (4, ("random", 8, 8, 8, SILU_GLU, False)),  # K = E: every token on every rank
    (8, ("random", 16, 8, 2, SILU_GLU, False)),  # a full node's EP size: one expert per rank
]


def _with_env(rank, env, worker, *args):
    """A worker with the test process's environment of now (a forkserver's children inherit the server's)."""
    os.environ.clear()
    os.environ.update(env)
    worker(rank, *args)


def run_workers(worker, world: int, args: tuple, tmp_path, timeout: float = 300) -> list:
    """Run worker(rank, world, port, *args, out_dir) in `world` processes; each saves rank{r}.pt there.

    Without CUDA the workers come from a forkserver that has imported torch and uniep once: a spawned worker
    spends 2-5 s of a 2-core CI machine importing them, and the multi-process tests are much of the CPU suite.
    The server forks a small single-threaded process, not this one (whose threads and heap a fork would copy).
    GPU runs spawn."""
    worker_args = (world, free_port(), *args, str(tmp_path))
    if torch.cuda.is_available():
        workers = mp.start_processes(worker, args=worker_args, nprocs=world, join=False, start_method="spawn")
    else:
        mp.set_forkserver_preload(["torch", "torch.distributed", "uniep_dynamo", "test_ep"])
        workers = mp.start_processes(_with_env, args=(dict(os.environ), worker, *worker_args), nprocs=world,
                                     join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not workers.join(timeout=5):  # raises if a worker fails
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            pytest.fail(f"the {world} EP workers did not finish in {timeout:.0f} s")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world,case_args", CASES, ids=lambda v: str(v[0]) if isinstance(v, tuple) else str(v))
def test_ep_layer_matches_single_process(world, case_args, tmp_path):
    import uniep_dynamo  # noqa: F401

    ranks = run_workers(_worker, world, (case_args,), tmp_path)
    ref_out, ref_grads = _reference(case_args)
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks]), ref_out, atol=1e-5, rtol=1e-5)
    # hidden and routing-weight gradients: per token, concatenated over ranks
    for i, name in ((0, "d_hidden"), (1, "d_weights")):
        torch.testing.assert_close(torch.cat([r["grads"][i] for r in ranks]), ref_grads[i], atol=1e-5, rtol=1e-5,
                                   msg=name)
    # expert weight and bias gradients: per expert, each rank its own slice
    for i, name in ((2, "d_w_up"), (3, "d_w_down"), (4, "d_b_up"), (5, "d_b_down")):
        if ref_grads[i] is None:
            continue
        torch.testing.assert_close(torch.cat([r["grads"][i] for r in ranks]), ref_grads[i], atol=1e-5, rtol=1e-5,
                                   msg=name)
    if case_args[0] == "rank0_only":
        assert all(torch.count_nonzero(g) == 0 for g in ranks[1]["grads"][2:4])
