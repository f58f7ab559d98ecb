"""An expert-parallel MoE layer, forward + backward, over NCCL: eager, inductor and uniep side by side.

The layer is examples/ep_moe.py's plain-PyTorch EP layer (router, argsort dispatch with a count
all-to-all, token all-to-alls, experts, unpermute-and-combine) with torchtitan-style grouped-GEMM
experts (stable sort, histc offsets, torch._grouped_mm), the way HF's AllToAllEP and torchtitan write
it. Providers, on the same module and inputs:
  eager      as written
  inductor   torch.compile(layer): the sequential path (NCCL all_to_all_single + torch._grouped_mm)
  uniep      torch.compile(layer, backend="uniep", options={"overlap_ep": True}): uniep.moe_router and
             uniep.ep_dispatch in the first graph;
             in the second, the token all-to-all, the experts and the all-to-all back become one
             uniep.ep_exchange (transfers beside the GEMMs, as in uniep_overlap_* below) and the combine
             uniep.ep_combine
  uniep_kernel  the same with options={"ep_knobs": {"copy_engine": False, "copy_kernel": True}}: the exchange's
             transfers on the SMs through uniep's Triton transfer kernel
  uniep_wgrad_chunks  the same with options={"ep_knobs": {"weight_grads_last": False}}: the backward's weight
             gradients chunk by chunk instead of one grouped GEMM each after the chunks
  uniep_sequential  the same compile with uniep's default options (overlap_ep=False): the token all-to-all, the
             experts and the all-to-all back are one uniep.ep_exchange that runs them one after another (NCCL
             all-to-alls through the process group, the received rows' plan in one launch)
  uniep_apart  the same with options={"rewrite_ep_exchange": False}: the token all-to-alls stay NCCL
             all_to_all_single as written around uniep.moe_experts
  uniep_default  torch.compile(layer, backend="uniep"), no option and no setting: uniep has Dynamo capture the
             split sizes (capture_ep_sizes), so the layer is one uniep.ep_layer (the rows above and below run with
             capture_ep_sizes=False, the layer in two graphs, where they are not one-graph rows)
  inductor_one_graph, uniep_one_graph, uniep_one_graph_sync  inductor and uniep's default compile with
             torch._dynamo.config.capture_scalar_outputs = True: Dynamo traces the split sizes' .tolist() and keeps
             the layer in one graph, which uniep runs as one uniep.ep_layer, its plan on the device by default
             (ep_device_plan "auto"; _sync: ep_device_plan=False, the plan read on the host); uniep_one_graph_graphs
             the default under mode="reduce-overhead" (inductor's CUDA graphs around uniep.ep_layer)
  uniep_overlap  the same router compiled with uniep, then uniep's overlapped EP experts layer
             (uniep_dynamo/ep/: token transfers through symmetric memory, copy-engine copies on
             their own streams, pipelined with the MegaKernel's GEMMs chunk by chunk; --chunks pipeline chunks): one
             copy per (chunk, source) into a stage, and a row gather into expert order
  uniep_overlap_streams  the same with those copies spread over 4 streams a direction
  uniep_overlap_sm  the same with each chunk's transfers as one SM copy kernel (torch._foreach_copy_) over its
             (expert, source) segments
  uniep_overlap_kernel  the same with uniep's Triton transfer kernel over a segment table on the device
             (kernels/triton_transfer.py; --copy-programs programs beside the GEMMs)
  uniep_overlap_off  the same with overlap off (each phase's transfers, then its GEMMs)
  uniep_overlap_kernel_wgrad_chunks  uniep_overlap_kernel with the weight gradients chunk by chunk
  uniep_overlap_kernel_pushes  uniep_overlap_kernel with the results pushed by the transfer kernel (by default the
             chunks' last GEMMs store them into the peers themselves: OverlapConfig.push_in_gemm)
  overlap_compute_only, overlap_comm_only, overlap_streams_comm_only, overlap_sm_comm_only,
  overlap_kernel_comm_only  the overlapped
             layer with its transfers (the receive buffers hold cached random values instead), or its GEMMs,
             skipped:
             timing only (their results are wrong), for the share of communication hidden
  hf_eager, hf_inductor, hf_uniep, hf_uniep_overlap  HF transformers' own EP (>= 5.23: `DistributedConfig(ep_size=world,
             ep_implementation="all_to_all")`, its AllToAllEP) on a Qwen3-MoE sparse block of the same shape
             (a one-layer model saved and loaded back, as users load one): eager, torch.compile with inductor, and
             with backend="uniep" (hf_uniep_overlap: options={"overlap_ep": True}, the overlapped exchange inside
             uniep.ep_layer). Left out, with a line saying why, where transformers has no EP. Their
             weights are HF's, not the layer's above, so their rows compare with hf_eager
  hf_inductor_graphs, hf_uniep_graphs  the same two compiles with mode="reduce-overhead" (inductor's CUDA graphs
             around what they cannot capture: uniep.ep_layer, HF's all-to-alls and host reads)
  hf_uniep_overlap_graphs  hf_uniep_overlap with mode="reduce-overhead"
  hf_uniep_device_plan, hf_layer_uniep_device_plan  hf_uniep and hf_layer_uniep with options={"ep_device_plan":
             True}: uniep.ep_layer keeps its routing plan on the device (no host synchronization in the layer)
             wherever it can run; the default ("auto") does so where its worst-case buffers fit (device_choice.choose)
  hf_uniep_sync, hf_layer_uniep_sync  the same with options={"ep_device_plan": False}: the layer reads its plan on
             the host (the synchronized path, the default before ep_device_plan="auto")
  hf_uniep_device_pipeline, hf_layer_uniep_device_pipeline, uniep_one_graph_pipeline  the device plan with its
             forward pipelined (options={"ep_device_plan": True, "overlap_ep": True}; ep/device_pipeline.py): HF's
             block, its decoder model, and the plain layer in one graph
  hf_layer_eager, hf_layer_inductor, hf_layer_uniep, hf_layer_inductor_graphs, hf_layer_uniep_graphs  a model
             of the same kind with --layers decoder layers (one by default), whole (each decoder layer with its
             attention at the shape's real head counts, the final norm, a 128-word head) on [1, T, H] input
             embeddings, as HF loads it under EP: the attention, norms and head sharded by FSDP2 (gathered in the
             forward and backward, their gradients reduce-scattered); eager and compiled; their rows compare with
             hf_layer_eager
  liger_experts  torch.compile of the same layer with Liger-Kernel's Triton fused MoE as its experts (the same
             weights, transposed to Liger's layout), if liger_kernel is installed
Each rank holds T tokens (bf16) and E / world experts. Two times per step, each of the slowest rank (CUDA events):
"ms", the median over steps timed one at a time (a synchronization after each), and "back to back", the mean
over steps issued without one between them, as a training loop runs (the host prepares a step while the GPU
finishes the last), with its spread (the largest distance of one step's time from their median, over the median;
and "p90 spread": the 90th percentile of those distances, which one host hiccup does not set).
With --rounds R each provider is timed R times, the providers interleaved round by round, and each time is the
median of its rounds' (the host's speed drifts over minutes). "peak GiB": rank 0's peak memory over one more step.
Each row also gives the largest relative difference of its output to eager's on each rank, and rank 0's
back-to-back step times (its first round's); --no-gc turns Python's garbage collector off while timing.

    python benchmarks/bench_ep.py --world 4 --shapes mixtral,qwen3-30b-a3b --tokens 8192
    python benchmarks/bench_ep.py --world 2 --device cpu --tokens 64 --shapes tiny   # a CPU smoke run (gloo)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_layer import time_cuda  # noqa: E402
from uniep_dynamo.tuner import time_host  # noqa: E402

# name: (hidden, moe intermediate, experts, top-k)
SHAPES = {"mixtral": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8), "tiny": (64, 96, 8, 2)}
# name: (attention heads, key/value heads, head dim) of the models these MoE shapes come from (the hf_layer_* rows)
ATTENTION = {"mixtral": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128), "tiny": (4, 2, 16)}
PROVIDERS = ("eager", "inductor", "uniep", "uniep_kernel", "uniep_wgrad_chunks", "uniep_sequential", "uniep_apart",
             "uniep_default", "inductor_one_graph", "uniep_one_graph", "uniep_one_graph_sync",
             "uniep_one_graph_graphs",
             "uniep_overlap",
             "uniep_overlap_sm", "uniep_overlap_kernel", "uniep_overlap_kernel_wgrad_chunks",
             "uniep_overlap_kernel_pushes", "uniep_overlap_off",
             "uniep_overlap_streams", "overlap_compute_only", "overlap_comm_only", "overlap_streams_comm_only",
             "overlap_sm_comm_only", "overlap_kernel_comm_only",
             "hf_eager", "hf_inductor", "hf_uniep", "hf_uniep_overlap", "hf_inductor_graphs", "hf_uniep_graphs",
             "hf_uniep_overlap_graphs", "hf_layer_eager", "hf_layer_inductor", "hf_layer_uniep",
             "hf_layer_inductor_graphs", "hf_layer_uniep_graphs", "hf_uniep_device_plan",
             "hf_layer_uniep_device_plan", "hf_uniep_sync", "hf_layer_uniep_sync", "hf_uniep_device_pipeline",
             "hf_layer_uniep_device_pipeline", "uniep_one_graph_pipeline")
OVERLAP = {"uniep_overlap": {"copy_engine": True}, "uniep_overlap_sm": {"copy_engine": False, "copy_kernel": False},
           "uniep_overlap_off": {"overlap": False}, "overlap_compute_only": {"timing": "compute"},
           "overlap_comm_only": {"timing": "comm", "copy_engine": True},
           "uniep_overlap_streams": {"copy_engine": True, "copy_streams": 4},
           "overlap_streams_comm_only": {"timing": "comm", "copy_engine": True, "copy_streams": 4},
           "overlap_sm_comm_only": {"timing": "comm", "copy_engine": False, "copy_kernel": False},
           "uniep_overlap_kernel": {"copy_engine": False, "copy_kernel": True},
           "uniep_overlap_kernel_wgrad_chunks": {"copy_engine": False, "copy_kernel": True, "weight_grads_last": False},
           # the transfer kernel pushes the results too (the GEMMs do not store them into the peers)
           "uniep_overlap_kernel_pushes": {"copy_engine": False, "copy_kernel": True, "push_in_gemm": False},
           "overlap_kernel_comm_only": {"timing": "comm", "copy_engine": False, "copy_kernel": True}}


def _overlapped_run(layer, chunks: int, copy_programs: int | None, **knobs):
    from uniep_dynamo.ep import OverlapConfig, ep_experts_overlapped
    from uniep_dynamo.kernels import gate_program
    from uniep_dynamo.spec import ExpertsSpec

    # GroupedGemmEPMoE's activation: silu(gate) * up over the [gate | up] halves of the up projection
    spec = ExpertsSpec("io", "io", gate_program.encode("chunk", gate_program.SILU_GLU_EXPR), layer.w1.dtype).encode()
    config = OverlapConfig(chunks=chunks, copy_programs=copy_programs, **knobs)
    route = torch.compile(layer.route, backend="uniep")

    def run(x):
        weights, ids = route(x)
        return ep_experts_overlapped(x, ids, weights, layer.w1, layer.w2, None, None, spec, layer.group,
                                     knobs=config)
    return run


def _layer_class():
    from ep_moe import ExpertParallelMoE

    class GroupedGemmEPMoE(ExpertParallelMoE):
        """ExpertParallelMoE with torchtitan-style grouped-GEMM experts ([E, H, 2I] and [E, I, H] weights)."""

        def __init__(self, hidden, intermediate, num_experts, top_k, dtype):
            super().__init__(hidden, intermediate, num_experts, top_k)
            del self.gate_up_proj, self.down_proj
            self.intermediate = intermediate
            self.w1 = nn.Parameter((torch.randn(self.local_experts, hidden, 2 * intermediate) * hidden ** -0.5).to(dtype))
            self.w2 = nn.Parameter((torch.randn(self.local_experts, intermediate, hidden) * intermediate ** -0.5)
                                   .to(dtype))
            self.gate.to(dtype)

        def experts(self, x, local_ids, weights):
            k, e = local_ids.shape[1], self.local_experts
            flat = local_ids.reshape(-1)
            perm = torch.sort(flat, stable=True)[1]
            offsets = torch.cumsum(torch.histc(flat.float(), bins=e, min=0, max=e - 1), 0).to(torch.int32)
            rows = x[perm // k]
            h = torch._grouped_mm(rows, self.w1, offs=offsets)
            gate, up = h[..., :self.intermediate], h[..., self.intermediate:]
            y = torch._grouped_mm(F.silu(gate) * up, self.w2, offs=offsets)
            y = y * weights.reshape(-1)[perm].unsqueeze(-1)
            back = torch.empty_like(y)
            back[perm] = y
            return back.view(x.shape[0], k, x.shape[1]).sum(dim=1)

    class LigerExpertsEPMoE(GroupedGemmEPMoE):
        """The same layer with Liger-Kernel's Triton fused MoE as the experts ([E, 2I, H] / [E, H, I] weights,
        SwiGLU): the single-GPU peer inside the same EP layer."""

        def load_from(self, other):
            with torch.no_grad():
                self.gate.weight.copy_(other.gate.weight)
                self.w1_oi = nn.Parameter(other.w1.transpose(1, 2).contiguous())
                self.w2_oi = nn.Parameter(other.w2.transpose(1, 2).contiguous())
            del self.w1, self.w2
            return self

        def experts(self, x, local_ids, weights):
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
            return LigerFusedMoEFunction.apply(x, self.w1_oi, self.w2_oi, local_ids.to(torch.int32), weights)

    return GroupedGemmEPMoE, LigerExpertsEPMoE


def _hf_model(shape, dims, rank, world, layers=1):
    """HF's Qwen3-MoE causal LM under transformers' own EP: ``layers`` decoder layers of these MoE dimensions and its
    model's attention heads (a 128-word vocabulary), saved by rank 0 and loaded by every rank with
    ``DistributedConfig`` (each rank keeps its experts; FSDP2 shards every other parameter, fsdp_size = ep_size)."""
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from transformers.distributed import DistributedConfig

    hidden, inter, experts, top_k = dims
    heads, kv_heads, head_dim = ATTENTION[shape]
    # transformers places each rank's shard on GPU LOCAL_RANK (torchrun's variables; mp.spawn sets none)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    path = os.path.join(tempfile.gettempdir(), f"uniep-bench-ep-hf-{shape}-{layers}-{os.getppid()}")
    if rank == 0:
        cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, distributed_config=DistributedConfig(
        ep_size=world, fsdp_size=world, ep_implementation="all_to_all"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return model


def _hf_block(shape, dims, rank, world):
    """HF's Qwen3-MoE sparse block of _hf_model's model. The decoder layer gathers the router's weight (sharded by
    FSDP2) when it runs: it is gathered once here, so that the block runs as in the layer, without the attention."""
    layer = _hf_model(shape, dims, rank, world).model.layers[0]
    layer.unshard()
    return layer.mlp


def _family(provider: str) -> str:
    """Which module a provider runs: "hf_layer" (HF's decoder), "hf" (HF's block) or "layer" (the plain EP layer)."""
    return "hf_layer" if provider.startswith("hf_layer_") else "hf" if provider.startswith("hf_") else "layer"


_GRADS: dict = {}
# each round's cudaMalloc calls of the caching allocator in each timed back-to-back step (this rank's): a
# step that grows the allocator's pool pays for them, and for the synchronization a freeing of cached blocks makes
DEVICE_ALLOCS: list = []
STEP_TIMES: list = []  # each round's back-to-back step times on this rank (ms); a row keeps its first round's


def _grad_like(out, rank):
    """A fixed random output gradient of ``out``'s shape (the logits of the hf_layer_* rows), made once."""
    key = (tuple(out.shape), out.dtype)
    if key not in _GRADS:
        _GRADS[key] = torch.randn(out.shape, generator=torch.Generator().manual_seed(200 + rank)).to(out.device,
                                                                                                     out.dtype)
    return _GRADS[key]


def _decoder_call(run, embeds):
    """HF's model (``run``: it or its compile) on input embeddings: its logits."""
    return run(inputs_embeds=embeds, use_cache=False).logits


def _hf_missing() -> str | None:
    try:
        import accelerate  # noqa: F401
        from transformers.distributed.expert_parallel import AllToAllEP  # noqa: F401
    except ImportError as exc:
        return f"needs transformers >= 5.23 (DistributedConfig expert parallelism) and accelerate: {exc!r}"
    return None


def _time(step, iters, warmup, device):
    """Median ms of one step (CUDA events on a GPU, the host clock on CPU), every rank starting together."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return (time_cuda if device.type == "cuda" else time_host)(step, iters, warmup=0)


def _time_back_to_back(step, iters, device):
    """(mean ms, spread, p90 spread, each step's ms) of ``iters`` steps issued back to back (no synchronization
    between them, as in a training loop: the host may prepare a step while the GPU finishes the last one), every rank
    starting together. The spread is the largest distance of one step's time from the median step's, over the median
    (on a GPU each step's time is the distance between CUDA events recorded after consecutive steps: the pace the GPU
    got them at); the p90 spread is the 90th percentile of those distances over the median. One step runs before the
    first event: the steady state is timed, not the first step's start on an idle GPU (that step waited for the
    host's whole launch path: 8-28% above the median in every row of a 2-GPU run, the largest spread in six rows of
    eight; BENCHMARKS.md 2026-11-27, fifth session)."""
    import statistics
    import time

    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    step()  # (not timed: it fills the GPU's queue)
    if device.type != "cuda":
        stamps = [time.perf_counter()]
        for _ in range(iters):
            step()
            stamps.append(time.perf_counter())
        times = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    else:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        # the caching allocator's cudaMalloc calls so far: before the first timed step, then after each one's launch
        mallocs = [torch.cuda.memory_stats(device).get("num_device_alloc", -1)]
        events[0].record()
        for event in events[1:]:
            step()
            event.record()
            mallocs.append(torch.cuda.memory_stats(device).get("num_device_alloc", -1))
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        DEVICE_ALLOCS.append([b - a for a, b in zip(mallocs, mallocs[1:])])
    median = statistics.median(times)
    distances = sorted(abs(t - median) / median for t in times)
    return sum(times) / len(times), distances[-1], distances[min(len(distances) - 1, int(0.9 * len(distances)))], times


def _round(step, args, device):
    """(this rank's median ms, the slowest rank's median ms, back-to-back mean ms, spread and p90 spread) of ``step``:
    one round of the two timings; with --no-gc, Python's garbage collector is off in both (collected before). Each
    back-to-back step's ms (this rank's) goes to ``STEP_TIMES``."""
    import gc

    if args.no_gc:
        gc.collect()
        gc.disable()
    try:
        ms = _time(step, args.iters, args.warmup, device)
        flowing, spread, spread90, times = _time_back_to_back(step, args.iters, device)
    finally:
        if args.no_gc:
            gc.enable()
    STEP_TIMES.append(times)
    worst = torch.tensor([ms, flowing, spread, spread90], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return (ms,) + tuple(float(v) for v in worst)


def _profile(step, label, rank, device):
    """One step under the torch profiler on every rank (the collectives need them all); rank 0 prints its device
    time per kernel and its host time per op, and the step's wall time against its GPU's busy time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    if rank != 0:
        return
    busy, reach = 0.0, None  # the union of the kernels' intervals, in µs
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                             if e.device_type == torch.autograd.DeviceType.CUDA):
        busy += max(0, end - max(start, reach if reach is not None else start))
        reach = end if reach is None else max(reach, end)
    events = prof.key_averages()
    print(f"# profile {label}: step {wall:.3f} ms wall (under the profiler), rank 0's GPU busy {busy / 1e3:.3f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70), flush=True)


def _trace_steps(step, iters, rank):
    """Each rank's back-to-back steps under the profiler (CUDA activity only, so the host is slowed little), cut at a
    marker kernel (``torch.cuda._sleep``) issued between steps: per step, its span on the GPU, the time the GPU was
    busy (the union of kernel and copy intervals), the NCCL kernels' union (their time includes waiting for the
    peers), the rest's union, and the host's time for the step's issue (µs; for each rank). Which of them moves in
    the slow steps says what the spread is: the host (idle grows), the peers (NCCL grows) or the kernels (the rest
    grows)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    def union(intervals):
        total, reach = 0.0, None
        for start, end in sorted(intervals):
            total += max(0.0, end - max(start, reach if reach is not None else start))
            reach = end if reach is None else max(reach, end)
        return total

    torch.cuda.synchronize()
    dist.barrier()
    step()
    host = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(100)
        for _ in range(iters):
            start = time.perf_counter()
            step()
            host.append((time.perf_counter() - start) * 1e6)
            torch.cuda._sleep(100)
        torch.cuda.synchronize()
    work = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    marks = [s for s, _, name in work if "spin_kernel" in name]
    steps = []
    for i, (a, b) in enumerate(zip(marks, marks[1:])):
        inside = [(max(s, a), min(e, b), n) for s, e, n in work if e > a and s < b and "spin_kernel" not in n]
        nccl = union([(s, e) for s, e, n in inside if "nccl" in n.lower()])
        rest = union([(s, e) for s, e, n in inside if "nccl" not in n.lower()])
        busy = union([(s, e) for s, e, _ in inside])
        gaps, reach, last = [], a, "(step start)"
        for s_, e_, n in sorted(inside):
            if s_ - reach > 20:
                gaps.append([last[:70], n[:70], round(s_ - reach, 1)])
            if e_ > reach:
                reach, last = e_, n
        steps.append({"span": round(b - a, 1), "busy": round(busy, 1), "idle": round(b - a - busy, 1),
                      "nccl": round(nccl, 1), "rest": round(rest, 1),
                      "host": round(host[i], 1) if i < len(host) else None, "gaps": gaps})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    return gathered


def _chrome_trace(step, path):
    """Three back-to-back steps (after one untimed) under the profiler, host and GPU, written as a chrome trace: which
    host work lies between two launches where the GPU waits."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)


def _cprofile(step, iters, label, rank, device):
    """``iters`` back-to-back steps with rank 0's Python under cProfile (the other ranks run them plain): its host time
    by function, own time and cumulative, for where a host-bound step's host time goes (cProfile slows Python code,
    not the ops' C++ and CUDA calls, so Python's share reads high)."""
    import cProfile
    import io
    import pstats

    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    step()
    profiler = cProfile.Profile() if rank == 0 else None
    if profiler is not None:
        profiler.enable()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if profiler is None:
        return
    profiler.disable()
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(45)
        print(f"# cProfile {label}, {iters} steps, by {key}:\n" + text.getvalue(), flush=True)


def _worker(rank, world, port, args, out_path):
    from torch._dynamo.utils import counters

    from uniep_dynamo.ep import local_rank  # (importing uniep_dynamo registers backend="uniep")

    dtype = torch.bfloat16
    rows = []
    if args.pin_cores:
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // world)
        os.sched_setaffinity(0, cores[rank * share:(rank + 1) * share])
    with local_rank(rank, world, port, args.device) as device:
        for shape in args.shapes.split(","):
            hidden, inter, experts, top_k = SHAPES[shape]
            torch.manual_seed(0)  # one router for all ranks
            layer_cls, liger_cls = _layer_class()
            layer = layer_cls(hidden, inter, experts, top_k, dtype).to(device)
            with torch.no_grad():
                for p in (layer.w1, layer.w2):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)).to(p.dtype)
                            * p.shape[1] ** -0.5)
            g = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(args.tokens, hidden, generator=g).to(device, dtype).requires_grad_()
            grad = torch.randn(args.tokens, hidden, generator=g).to(device, dtype)
            ref, liger, hf, hf_decoder = {}, None, None, None
            providers = [p for p in PROVIDERS if p not in args.skip.split(",")]
            if args.device != "cuda":
                providers = [p for p in providers if p not in OVERLAP]
            if any(p.startswith("hf_") for p in providers):
                missing = _hf_missing()
                if missing is None:
                    if any(_family(p) == "hf" for p in providers):
                        hf = _hf_block(shape, SHAPES[shape], rank, world)
                    if any(_family(p) == "hf_layer" for p in providers):  # another model: FSDP2 wants its root
                        hf_decoder = _hf_model(shape, SHAPES[shape], rank, world, args.layers)  # run first
                else:
                    providers = [p for p in providers if not p.startswith("hf_")]
                    if rank == 0:
                        print(f"# hf_* providers left out: {missing}", file=sys.stderr)
            try:
                import liger_kernel.ops.fused_moe  # noqa: F401
                liger = liger_cls(hidden, inter, experts, top_k, dtype).to(device).load_from(layer)
                if "liger_experts" not in args.skip.split(","):
                    providers.append("liger_experts")
            except ImportError as exc:
                if rank == 0:
                    print(f"# liger_experts unavailable: {exc!r}", file=sys.stderr)
            timed = []  # (row, step) of each provider, for the later rounds
            if args.rounds > 1:  # every provider's compiled code stays cached for the later rounds
                torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                torch._dynamo.config.accumulated_cache_size_limit = max(
                    torch._dynamo.config.accumulated_cache_size_limit, 512)
            for provider in providers:
                if args.rounds == 1:
                    torch._dynamo.reset()
                counters.clear()
                # HF's block takes [batch, sequence, hidden]; its weights are its own (compared with hf_eager), and
                # its decoder's (hf_layer_*) with hf_layer_eager
                batched = provider.startswith("hf_")
                family = _family(provider)
                module = liger if provider == "liger_experts" else \
                    {"hf": hf, "hf_layer": hf_decoder}.get(family, layer)
                if batched:
                    backend = {"eager": None, "inductor": "inductor"}.get(
                        provider[len(family) + 1:].removesuffix("_graphs"), "uniep")
                    options = {"overlap_ep": True} if "_uniep_overlap" in provider else \
                        {"ep_device_plan": True} if provider.endswith("_device_plan") else \
                        {"ep_device_plan": True, "overlap_ep": True} if provider.endswith("_device_pipeline") else \
                        {"ep_device_plan": False} if provider.endswith("_sync") else None
                    mode = "reduce-overhead" if provider.endswith("_graphs") else None
                    if options and mode:  # torch.compile takes one of them: the mode's settings go in uniep's options
                        options["inductor"], mode = dict(torch._inductor.list_mode_options(mode)), None
                    run = module if backend is None else torch.compile(module, backend=backend, options=options,
                                                                       mode=mode)
                    if family == "hf_layer":
                        run = functools.partial(_decoder_call, run)
                elif provider in OVERLAP:
                    run = _overlapped_run(layer, args.chunks, args.copy_programs, **OVERLAP[provider])
                elif "_one_graph" in provider:
                    options = {"ep_device_plan": False} if provider.endswith("_sync") else \
                        {"ep_device_plan": True, "overlap_ep": True} if provider.endswith("_pipeline") else {}
                    if provider.endswith("_graphs"):  # reduce-overhead's settings, through uniep's options
                        from torch._inductor import list_mode_options

                        options["inductor"] = dict(list_mode_options("reduce-overhead"))
                    compiled = torch.compile(module, backend=provider.split("_")[0], options=options or None)

                    def run(x, compiled=compiled):  # the config as Dynamo traces, and for its guards
                        with torch._dynamo.config.patch(capture_scalar_outputs=True):
                            return compiled(x)
                elif provider == "uniep_default":
                    run = torch.compile(module, backend="uniep")
                elif provider.startswith("uniep"):
                    # the exchange's rows: the layer in the two graphs Dynamo makes at the split sizes' host read
                    options = {"overlap_ep": provider not in ("uniep_sequential", "uniep_apart"),
                               "capture_ep_sizes": False}
                    if provider == "uniep_apart":
                        options["rewrite_ep_exchange"] = False
                    if provider == "uniep_kernel":
                        options["ep_knobs"] = {"copy_engine": False, "copy_kernel": True}
                    elif provider == "uniep_wgrad_chunks":
                        options["ep_knobs"] = {"weight_grads_last": False}
                    run = torch.compile(module, backend="uniep", options=options)
                else:
                    run = module if provider == "eager" else torch.compile(module, backend="inductor")

                def step(module=module, run=run, batched=batched, graphs=provider.endswith("_graphs")):
                    if graphs:  # a new iteration for inductor's CUDA-graph trees (bound now: later rounds call it)
                        torch.compiler.cudagraph_mark_step_begin()
                    module.zero_grad(set_to_none=True)
                    x.grad = None
                    out = run(x.unsqueeze(0) if batched else x)
                    out.backward(grad.view(out.shape) if out.numel() == grad.numel() else _grad_like(out, rank))
                    return out

                failed = None
                try:
                    out = step().detach().clone()  # a CUDA graph's output is overwritten by its next replay
                except Exception as exc:  # noqa: BLE001 -- a peer kernel that does not take this shape or stack
                    if provider != "liger_experts":
                        raise
                    failed = exc
                ok = torch.tensor([0 if failed else 1], device=device)
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # skip the provider on every rank, or on none
                if not ok.item():
                    if failed is not None:
                        print(f"# rank {rank}: liger_experts failed on {shape}: {failed!r}", file=sys.stderr)
                    continue
                ms, worst, flowing, spread, spread90 = _round(step, args, device)
                peak = None
                if device.type == "cuda":  # one more step, its peak memory (this rank's)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    step()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() / 2 ** 30
                if provider in args.profile.split(",") and device.type == "cuda":
                    _profile(step, f"{shape} {provider}", rank, device)
                if args.trace_dir and provider in args.profile.split(",") and device.type == "cuda":
                    _chrome_trace(step, os.path.join(args.trace_dir, f"{shape}-{provider}-rank{rank}.json.gz"))
                if provider in args.cprofile.split(","):
                    _cprofile(step, 20, f"{shape} {provider}", rank, device)
                traced = _trace_steps(step, args.trace_steps, rank) if args.trace_steps and device.type == "cuda" \
                    else None
                ref.setdefault(family, out)
                if provider.startswith("overlap_"):  # timing only: no result to compare
                    diff = float("nan")
                else:
                    base = ref[family]
                    diff = float((out.float() - base.float()).abs().max() / base.float().abs().max().clamp_min(1e-12))
                rows.append({"shape": shape, "provider": provider, "world": world, "tokens_per_rank": args.tokens,
                             "layers": args.layers if family == "hf_layer" else None,
                             "chunks": args.chunks if provider in OVERLAP else None,
                             "copy_programs": args.copy_programs if provider in OVERLAP else None,
                             "ms": worst, "rank_ms": ms, "ms_back_to_back": flowing,
                             "back_to_back_spread": spread, "back_to_back_spread_p90": spread90,
                             "back_to_back_steps_rank0": [round(t, 4) for t in STEP_TIMES[-1]],
                             "back_to_back_device_allocs_rank0": DEVICE_ALLOCS[-1] if DEVICE_ALLOCS else None,
                             "peak_gib": peak,
                             "traced_steps": traced,
                             "max_rel_vs_eager": diff,
                             "rewrites": {k: v for k, v in counters["uniep"].items()},
                             "rounds": [[worst, flowing, spread, spread90]]})
                timed.append((rows[-1], step))
                if rank == 0:
                    print(f"{shape:14s} {provider:20s} {worst:9.3f} ms ({flowing:.3f} back to back, spread "
                          f"{100 * spread:.1f}%, p90 {100 * spread90:.1f}%)  rel diff vs eager {diff:.2e}  "
                          + (f"peak {peak:.2f} GiB  " if peak is not None else "") +
                          f"{dict(counters['uniep']) if 'uniep' in provider else ''}", flush=True)
            for _ in range(args.rounds - 1):  # the providers again, interleaved: each round times every one
                for row, step in timed:
                    row["rounds"].append(list(_round(step, args, device)[1:]))
            for row, _ in timed:  # the median of the rounds' times (a round's spread: its own)
                if len(row["rounds"]) > 1:
                    import statistics

                    row["ms"], row["ms_back_to_back"] = (statistics.median(r[i] for r in row["rounds"]) for i in (0, 1))
                    row["back_to_back_spread"] = max(r[2] for r in row["rounds"])
                    row["back_to_back_spread_p90"] = max(r[3] for r in row["rounds"])
            timed.clear()  # the steps hold their modules: this shape's are freed before the next is built
            del layer, module
            liger = hf = hf_decoder = step = run = None
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                           "torch": torch.__version__, "no_gc": args.no_gc, "rows": rows}, f, indent=1)


def _print_traced(rows):
    """Per traced row and rank: the median step's span, busy, idle, NCCL and other GPU time and host issue time (ms),
    and the same for the slowest 20% of steps: which of them grows in the slow steps."""
    import statistics

    keys = ("span", "busy", "idle", "nccl", "rest", "host")
    for r in rows:
        for rank, steps in enumerate(r.get("traced_steps") or []):
            if not steps:
                continue
            slow = sorted(steps, key=lambda s: s["span"])[-max(1, len(steps) // 5):]
            mid = {k: statistics.median(s[k] for s in steps if s[k] is not None) / 1e3 for k in keys}
            top = {k: statistics.mean(s[k] for s in slow if s[k] is not None) / 1e3 for k in keys}
            print(f"# traced {r['shape']} {r['provider']} rank {rank}, {len(steps)} steps (ms): median " +
                  " ".join(f"{k} {mid[k]:.3f}" for k in keys) + " | slowest fifth " +
                  " ".join(f"{k} {top[k]:.3f}" for k in keys))
            pairs = {}  # the GPU's idle gaps over 20 µs by the kernels around them: µs a step, all steps / slowest
            for group, chosen in ((0, steps), (1, slow)):
                for s in chosen:
                    for before, after, us in s.get("gaps", []):
                        pairs.setdefault((before, after), [0.0, 0.0])[group] += us / len(chosen)
            for (before, after), (every, worst) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:6]:
                print(f"#   gap {every:7.1f} / {worst:7.1f} µs a step after {before} before {after}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--shapes", default="mixtral,qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the hf_layer_* providers' model")
    parser.add_argument("--no-gc", action="store_true",
                        help="Python's garbage collector off while timing (collected first): is it the hiccups?")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default="ep.json")
    parser.add_argument("--chunks", type=int, default=None,
                        help="pipeline chunks of the overlapped layer (default: the library's, OverlapConfig.chunks)")
    parser.add_argument("--copy-programs", type=int, default=None,
                        help="programs of the transfer kernel (default: the library's, 8 per peer rank)")
    parser.add_argument("--skip", default="", help="comma-separated providers to leave out")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every provider this many times, the providers interleaved round by round, and "
                             "report the median of the rounds (the host's speed drifts: one round each compares "
                             "providers timed minutes apart)")
    parser.add_argument("--profile", default="",
                        help="comma-separated providers to profile one step of (after timing): rank 0's kernels by "
                             "device time and ops by host time")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="after timing, this many back-to-back steps under the profiler on every rank: per step "
                             "the GPU's span, busy, idle, NCCL and other time, and the host's issue time (JSON "
                             "\"traced_steps\"; a summary printed)")
    parser.add_argument("--trace-dir", default="",
                        help="with --profile: also write each rank's chrome trace of three back-to-back steps of those "
                             "providers here")
    parser.add_argument("--cprofile", default="",
                        help="comma-separated providers whose rank 0 runs 20 back-to-back steps under cProfile (after "
                             "timing): host time by Python function")
    parser.add_argument("--pin-cores", action="store_true",
                        help="pin each rank's process to its own share of the host's cores (os.sched_setaffinity)")
    args = parser.parse_args()
    from uniep_dynamo.ep import free_port

    mp.spawn(_worker, args=(args.world, free_port(), args, args.out), nprocs=args.world)
    with open(args.out) as f:
        data = json.load(f)
    print(f"\n{data['device']}, torch {data['torch']}, world {args.world}, T={args.tokens} tokens per rank, bf16, "
          "forward + backward (ms, slowest rank, median)" + (", Python's gc off while timing" if data.get("no_gc") else ""))
    print("ms: each step timed alone (synchronized), the median; back to back: the mean of steps issued without a "
          "synchronization between them. Ratios against inductor (hf_* rows: against hf_inductor, hf_layer_* rows: "
          "against hf_layer_inductor)")
    print("spread: the largest distance of one back-to-back step's time from their median, over the median; p90: the "
          "90th percentile of those distances (the largest of the ranks'" + (
              ", and of the rounds'" if args.rounds > 1 else "") + ")")
    if args.rounds > 1:
        print(f"{args.rounds} rounds, the providers interleaved: each time is the median of the rounds'")
    print(f"{'shape':20s} {'provider':24s} {'ms':>9s} {'ratio':>7s} {'back to back':>13s} {'ratio':>7s} {'spread':>7s} "
          f"{'p90':>6s} {'peak GiB':>9s}")
    base = {(r["shape"], r["provider"]): r for r in data["rows"]
            if r["provider"] in ("inductor", "hf_inductor", "hf_layer_inductor")}
    for r in data["rows"]:
        family = _family(r["provider"])
        b = base.get((r["shape"], "inductor" if family == "layer" else f"{family}_inductor"))
        ratio = f"{b['ms'] / r['ms']:6.2f}x" if b else ""
        ratio2 = f"{b['ms_back_to_back'] / r['ms_back_to_back']:6.2f}x" if b else ""
        print(f"{r['shape']:20s} {r['provider']:24s} {r['ms']:9.3f} {ratio:>7s} {r['ms_back_to_back']:13.3f} {ratio2:>7s} "
              f"{100 * r['back_to_back_spread']:6.1f}% {100 * r.get('back_to_back_spread_p90', float('nan')):5.1f}% "
              + (f"{r['peak_gib']:9.2f}" if r.get("peak_gib") is not None else f"{'-':>9s}"))
    _print_traced(data["rows"])
    if args.rounds > 1:
        print("each round's ms / back to back:")
        for r in data["rows"]:
            print(f"{r['shape']:20s} {r['provider']:24s} " + "  ".join(f"{r_[0]:.3f}/{r_[1]:.3f}" for r_ in r["rounds"]))
    for shape in dict.fromkeys(r["shape"] for r in data["rows"]):
        ms = {r["provider"]: r["ms"] for r in data["rows"] if r["shape"] == shape}
        for layer, comm in (("uniep_overlap", "overlap_comm_only"), ("uniep_overlap_sm", "overlap_sm_comm_only"),
                            ("uniep_overlap_streams", "overlap_streams_comm_only"),
                            ("uniep_overlap_kernel", "overlap_kernel_comm_only"),
                            ("uniep_overlap_kernel_pushes", "overlap_kernel_comm_only")):
            if all(p in ms for p in (layer, "overlap_compute_only", comm)):
                hidden = 1 - (ms[layer] - ms["overlap_compute_only"]) / ms[comm]
                print(f"{shape}: {layer} {ms[layer]:.3f} ms, compute only {ms['overlap_compute_only']:.3f} ms, "
                      f"communication only {ms[comm]:.3f} ms: {100 * hidden:.0f}% of the communication hidden")


if __name__ == "__main__":
    main()
