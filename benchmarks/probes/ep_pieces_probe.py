"""Where the host time of one uniep.ep_layer call goes, piece by piece (issue 37: HF EP through uniep is host-bound).

One-rank NCCL group in this process (as ep_host_probe.py), Qwen3-30B-A3B's shape by default. The functions the layer
calls are wrapped with timers (inclusive µs, a piece called twice in a call counts twice); each forward and backward
is timed alone, the GPU synchronized before it, and the table gives each piece's median µs per layer call beside the
call's own median. Forward under torch.no_grad (what a compiled graph pays: AOTAutograd runs it below autograd),
backward as the op ``uniep.ep_layer_backward`` called directly on a forward's results.

    python benchmarks/probes/ep_pieces_probe.py [--shape qwen3-30b-a3b] [--tokens 8192] [--calls 30] [--overlap]

``--plain``: the ops the plain PyTorch EP compile makes instead (what examples/ep_moe.py's layer becomes): the
router op (``uniep.moe_router``, timed alone), the dispatch (``uniep.ep_dispatch`` with its count table for the exchange), the split sizes read to the host (outside
the timed ops, as the model's ``.tolist()``), the exchange (``uniep.ep_exchange``, sequential unless --overlap) and
the combine, then their backward ops in the order a backward graph calls them; each op timed alone ("op NAME")
beside the pieces inside it.

``--graph1``: the plain EP layer's first graph (the router and the dispatch with its count exchange, which ends in
the model's ``.tolist()`` of the split sizes, the step's synchronization), bench_ep.py's layer compiled by
inductor, by uniep, and by uniep with the router left to inductor: median µs from the call to the split sizes on
the host, the GPU synchronized before each call. Everything in that graph is on the step's critical path: the
GPU work is small and the host waits for it at the end.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

TIMES: dict = collections.defaultdict(float)


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
    return wrapper


def _wrap(module, attr, name=None):
    """Time module.attr where the module has it (the probe runs against older trees too, for a before/after)."""
    if hasattr(module, attr):
        setattr(module, attr, _timed(name or f"{module.__name__.rsplit('.', 1)[-1]}.{attr}", getattr(module, attr)))


def _graph1(bench, H, I, E, K, x, calls, sync):
    """{backend: [seconds a call]} of the plain EP layer's route + dispatch + .tolist(), compiled."""
    import bench_ep

    layer_cls, _ = bench_ep._layer_class()
    layer = layer_cls(H, I, E, K, x.dtype).to(x.device)

    def first(h):
        weights, ids = layer.route(h)
        send, order, recv_counts, sizes = layer.dispatch(h, ids)
        return sizes, send, order, recv_counts, weights
    out = {}
    for name, backend, options in (("inductor", "inductor", None), ("uniep", "uniep", None),
                                   ("uniep, router by inductor", "uniep", {"rewrite_router": False})):
        torch._dynamo.reset()
        compiled = torch.compile(first, backend=backend, options=options)
        times = []
        for i in range(5 + calls):
            h = x.detach().requires_grad_()
            sync()
            t0 = time.perf_counter()
            result = compiled(h)
            result[0].tolist()
            times.append(time.perf_counter() - t0)
            del result
        out[name] = times[5:]
    return out


def _plain_call(x, ids, w, w_up, w_down, grad, spec, group_name, overlap, sync):
    """One forward and backward of the plain EP compile's ops at world size 1, each op timed ("op NAME", beside the
    pieces' timers), the GPU synchronized before the router, the dispatch, the exchange and the backward:
    ({piece: seconds} forward, backward)."""
    from uniep_dynamo.spec import RouterSpec

    ops = torch.ops.uniep
    num_experts = w_up.shape[0]
    router = RouterSpec("softmax_topk", num_experts, ids.shape[1], renorm=True).encode()
    with torch.no_grad():
        sync()
        TIMES.clear()
        _timed("op moe_router", ops.moe_router)(x, w_up[:, 0], None, None, router)  # the graph's router
        sync()
        send, order, counts, recv, slot_row, offsets = _timed("op ep_dispatch", ops.ep_dispatch)(
            x, ids, num_experts, 1, group_name, True)
        sizes = [[int(counts.sum())], [int(recv.sum())]]  # the model's .tolist(): its synchronization
        sync()
        back, rx, up, table = _timed("op ep_exchange", ops.ep_exchange)(
            send, recv, w_up, w_down, None, None, spec, group_name, sizes[0], sizes[1], "", not overlap)
        _timed("op ep_combine", ops.ep_combine)(back, order, w)
        forward = dict(TIMES)
        sync()
        TIMES.clear()
        d_back, _ = _timed("op ep_combine_backward", ops.ep_combine_backward)(grad, back, order, w)
        d_send = _timed("op ep_exchange_backward", ops.ep_exchange_backward)(
            d_back, rx, up, recv, table, w_up, w_down, None, None, spec, group_name, sizes[0], sizes[1], "")[0]
        _timed("op ep_dispatch_backward", ops.ep_dispatch_backward)(d_send, slot_row, offsets, x.shape[0],
                                                                   ids.shape[1])
        backward = dict(TIMES)
    return forward, backward


def main():
    import bench_moe_layer as bench

    import uniep_dynamo  # noqa: F401  (registers the ops)
    from uniep_dynamo.ep import MULTICAST_OFF
    from uniep_dynamo.ep import exchange, layer, plan, sequential
    from uniep_dynamo.kernels import megakernel, triton_routing
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(bench.SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--plain", action="store_true", help="the plain EP compile's ops (dispatch, exchange, combine)")
    parser.add_argument("--graph1", action="store_true", help="the plain EP layer's first graph, per backend")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (gloo, float32)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ep_pieces_probe.json"))
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dev, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(dev)
    H, I, E, K = bench.SHAPES[args.shape]
    x, ids, w, grad = bench.make_inputs(H, I, E, K, args.tokens, dtype, dev.type)
    x, w = x.detach(), w.detach()
    w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02
    w_down = torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02
    spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype).encode()
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    if cuda:
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group_name = dist.group.WORLD.group_name

    for attr in ("plan_and_gather", "routing_plan", "count_table", "exchange_forward", "exchange_backward",
                 "combine_rows", "combine_rows_backward", "gather_sum", "layer_fused", "_process_group", "_keep",
                 "_take"):
        _wrap(layer, attr)
    for attr in ("take_count_table", "_table_from_counts", "_split_host", "_check_exchange", "_all_to_all",
                 "_sequential_experts", "_exchange_unsupported", "_saved_sequential", "_local_ids"):
        _wrap(exchange, attr)
    for attr in ("routing_plan", "stash_count_table", "all_gather_flat", "all_to_all"):
        _wrap(plan, attr)
    _wrap(megakernel, "use_megakernel")
    _wrap(triton_routing, "gather_rows")
    _wrap(triton_routing, "received_plan")
    _wrap(exchange, "decode_spec")
    from uniep_dynamo.ep import custom_ops
    for attr in ("_process_group", "plan_and_gather", "_remember_inverse", "_unpermute_plan", "combine_rows",
                 "combine_rows_backward", "gather_sum", "exchange_forward", "exchange_backward", "fused"):
        _wrap(custom_ops, attr, f"custom_ops.{attr}")
    torch._assert_async = _timed("torch._assert_async", torch._assert_async)
    for attr in ("get_rank", "get_world_size", "all_to_all_single"):
        setattr(dist, attr, _timed(f"dist.{attr}", getattr(dist, attr)))
    class _Uniep:  # the inner experts ops, timed where exchange.py calls them (torch.ops.uniep.*)
        def __getattr__(self, name):
            value = getattr(torch.ops.uniep, name)
            return _timed(f"op {name}", value) if name in ("moe_experts", "moe_experts_backward") else value

    class _Ops:
        def __getattr__(self, name):
            return _Uniep() if name == "uniep" else getattr(torch.ops, name)

    class _Torch:
        def __getattr__(self, name):
            return _Ops() if name == "ops" else getattr(torch, name)
    exchange.torch = _Torch()

    def call():
        return torch.ops.uniep.ep_layer(x, ids, w, w_up, w_down, None, None, spec, group_name, 1, args.overlap, "")

    rows = collections.defaultdict(list)
    if args.graph1:
        for name, micros in _graph1(bench, H, I, E, K, x, args.calls, sync).items():
            rows[("graph1", name)] = micros
    for i in range(5 + args.calls if args.plain else 0):
        forward, backward = _plain_call(x, ids, w, w_up, w_down, grad, spec, group_name, args.overlap, sync)
        if i >= 5:
            for way, times in (("forward", forward), ("backward", backward)):
                for key, value in times.items():
                    rows[(way, key)].append(value)
    for i in range(0 if args.plain or args.graph1 else 5 + args.calls):
        sync()
        TIMES.clear()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = call()
        forward = dict(TIMES, total=time.perf_counter() - t0)
        sync()
        TIMES.clear()
        t0 = time.perf_counter()
        torch.ops.uniep.ep_layer_backward(grad, w, *out[2:], x[:0], w_up, w_down, None, None, spec, group_name,
                                          args.overlap, "")
        backward = dict(TIMES, total=time.perf_counter() - t0)
        del out
        if i >= 5:
            for key, value in forward.items():
                rows[("forward", key)].append(value)
            for key, value in backward.items():
                rows[("backward", key)].append(value)
    sync()
    dist.destroy_process_group()
    table = {}
    for (way, name), values in sorted(rows.items(), key=lambda kv: (kv[0][0], -sorted(kv[1])[len(kv[1]) // 2])):
        median = sorted(values)[len(values) // 2] * 1e6
        table.setdefault(way, {})[name] = round(median, 1)
        print(f"{way:9s} {name:40s} {median:9.1f} µs  (in {len(values)} of {args.calls} calls)")
    with open(args.out, "w") as f:
        json.dump({"shape": args.shape, "tokens": args.tokens, "overlap": args.overlap, "plain": args.plain,
                   "gpu": torch.cuda.get_device_name(0) if cuda else None, "us": table}, f, indent=1)


if __name__ == "__main__":
    main()
