"""Expert parallelism written in plain PyTorch, compiled with backend="uniep" -- no uniep import in the model.

    torchrun --nproc-per-node 2 examples/ep_moe.py      # gloo on CPU, or one GPU per rank (nccl) when there are
    torchrun --nproc-per-node 2 examples/ep_moe.py --two-graphs  # capture_ep_sizes=False: the layer in two graphs

Each rank holds its own tokens and E / world experts. The MoE layer routes (softmax, top-k, renormalize),
sorts its (token, expert) pairs by expert, exchanges per-expert counts, then the token rows, with
all-to-alls; runs its experts on what it received; sends the results back; and combines them per
token. That is the usual way to write it (HF transformers' AllToAllEP and torchtitan do the same). The split
sizes go to the host (`.tolist()`), where Dynamo breaks the graph. uniep's backend, handed the graph that ends
there, has Dynamo trace the frame again with that one read captured (`capture_scalar_outputs` for that call
only), so the layer is one graph, which uniep runs as one uniep.ep_layer (the router is one uniep.moe_router):
on CUDA by default its routing plan stays on the device, and the layer makes no host synchronization. With the
option `capture_ep_sizes=False` (`--two-graphs`) the layer stays in two graphs, and uniep rewrites each part:
the dispatch plan with its count exchange (uniep.ep_dispatch), the token all-to-all with the experts and the
all-to-all back (one uniep.ep_exchange, which takes its split sizes from the dispatch's count table), and the
combine (uniep.ep_combine).

The script compares one forward and backward with eager and prints what uniep rewrote.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor


class ExpertParallelMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, group=None):
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.num_experts, self.top_k, self.local_experts = num_experts, top_k, num_experts // self.world
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(self.local_experts, 2 * intermediate, hidden) * hidden ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(self.local_experts, hidden, intermediate) * intermediate ** -0.5)

    def route(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def dispatch(self, x, ids):
        """The rows to send, grouped by expert (so by owner rank), and the counts each rank gets."""
        expert_ids = ids.reshape(-1)
        order = torch.argsort(expert_ids)
        send = x[order // self.top_k]
        send_counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        send_counts = send_counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        send_counts = send_counts.view(self.world, self.local_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        return send, order, recv_counts, torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)])

    def experts(self, x, local_ids, weights):
        """This rank's experts on [rows, K] ids and weights (here K = 1: one expert per received row), as a
        batched matmul over gathered weights."""
        top_k = local_ids.size(-1)
        rows = x.repeat_interleave(top_k, dim=0)
        flat_ids, flat_w = local_ids.reshape(-1), weights.reshape(-1)
        h = torch.bmm(self.gate_up_proj[flat_ids], rows.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[flat_ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (y * flat_w.unsqueeze(-1)).view(x.shape[0], top_k, y.shape[-1]).sum(dim=1)  # 0 rows too

    @staticmethod
    def combine(rows, order, weights):
        out = torch.empty_like(rows)
        out[order] = rows
        return (out.view(*weights.shape, rows.size(-1)) * weights.unsqueeze(-1)).sum(dim=1)

    def forward(self, x):
        weights, ids = self.route(x)
        send, order, recv_counts, sizes = self.dispatch(x, ids)
        send_sizes, recv_sizes = sizes.tolist()
        recv = wait_tensor(all_to_all_single_autograd(send, recv_sizes, send_sizes, self.group))
        local_ids = torch.arange(self.local_experts, device=x.device).repeat(self.world)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
        y = self.experts(recv, local_ids, torch.ones_like(local_ids, dtype=recv.dtype))
        back = wait_tensor(all_to_all_single_autograd(y, send_sizes, recv_sizes, self.group))
        return self.combine(back, order, weights).to(x.dtype)


def run(tokens=64, hidden=64, intermediate=96, num_experts=8, top_k=2, inner_backend="inductor", options=None):
    """One forward and backward in eager and compiled with uniep (and these further options) on this rank; returns
    both and uniep's report."""
    import uniep_dynamo

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same router on every rank; experts differ per rank
    model = ExpertParallelMoE(hidden, intermediate, num_experts, top_k).to(device)
    with torch.no_grad():
        for p in (model.gate_up_proj, model.down_proj):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)) * p.shape[-1] ** -0.5)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(100 + rank)).to(device)
    results = {}
    report = None
    for name in ("eager", "uniep"):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        if name == "eager":
            out = model(xi)
        else:
            compiled = torch.compile(model, backend="uniep",
                                     options={"inner_backend": inner_backend, **(options or {})})
            with uniep_dynamo.recording() as report:
                out = compiled(xi)
        out.square().mean().backward()
        results[name] = [out.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()]
    return results, report


def main():
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) \
        else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    options = {"capture_ep_sizes": False} if "--two-graphs" in sys.argv[1:] else {}
    try:
        results, report = run(inner_backend="inductor" if backend == "nccl" else "aot_eager", options=options)
        eager, fused = results["eager"], results["uniep"]
        worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(fused, eager))
        if dist.get_rank() == 0:
            print(f"uniep rewrites: {report.totals()}")
            print(f"largest relative difference to eager over the output and every gradient: {worst:.2e}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
