"""Small inference calls of the experts op, replayed from CUDA graphs of the op's own.

At decode sizes the op's kernels take a few microseconds each and the host sets the pace: Python picks the config
and the paths, allocates and launches five kernels, about 250-300 µs a call on the GPU hosts (op_host_probe.py),
where inductor's own code for HF's layer launches through its C++ launcher. Without ``mode="reduce-overhead"``
that made generate() with a compiled forward decode slower than inductor (BENCHMARKS.md). Here such a call is
captured once into a CUDA graph and replayed: the host then copies the inputs into the graph's buffers, replays,
and copies the output out.

Where it applies (``forward``): an op whose spec says its graph reads only its first output, takes no gradient and
runs outside inductor's CUDA-graph trees (``ExpertsSpec.inference``, backend.mark_inference), on CUDA, outside a
CUDA graph being captured, of a size ``worth_a_graph`` (Sizes, below), with a config whose forward GEMMs read no
host row counts (per_expert_mm), under ``UNIEP_OP_GRAPHS`` not 0. The first call of a kind runs the kernels as usual
(Triton compiles there, not inside a capture); the second is captured and replayed; later ones replay. Where such an
op's router op feeds it alone, the backend makes the two one ``uniep::moe_block`` (backend._fuse_block), and
``block_forward`` captures router and experts into one graph, under the same conditions: one host call and one
replay a layer instead of two ops' host paths (about 190 and 230 µs a call at 8 tokens on the GPU hosts).

A graph is keyed by what the captured launches bake in: the spec, the config (which the capture runs with), the
device and stream, the shapes, strides and dtypes of every tensor argument, and the addresses of the expert weights
and biases, which the graph reads where they are (the activations are copied in). The process-wide switches
UNIEP_QUACK and UNIEP_QUACK_DIRECT are not in it (set them before the first call; QuACK takes no call this small
under the heuristics). A weight at another address, a new config (use_config, the tuning cache,
the numerics variables) or another shape is another key. So the bits are those of the same call without the graph:
the same kernels read the same values. The op's outputs other than the first are new tensors with no values (the
graph that asked for this reads none of them); the first is a copy of the graph's, so that no caller holds memory
a later replay writes.

Memory. A replay's memory is scratch outside that replay: the host copies the activations into the graph's input
buffers, replays, and copies the output out of its output buffer, under one lock, in one stream's order. So graphs
share it: those of one stream and one size capture into one private memory pool (what their kernels allocate: the
gathered rows, the up projection, the activation; each capture reuses what the one before freed, since they allocate
alike), and the graphs of a stream read and write one input buffer of each position and layout and one output buffer
of each shape and dtype (made apart for inference_mode's calls, whose buffers are inference tensors). A model of 48
layers thus holds about one layer's scratch (70 MB measured at 1024 tokens of Qwen3-30B-A3B's shape), not 48; a pool
goes with the last graph of its size (a pool shared by sizes would keep every size's segments). ``MAX_BYTES`` bounds
the estimate of the pools and buffers held (a call whose own graph would exceed it takes none), and ``MAX_GRAPHS``
the graphs; the least recently used go first. A failed capture may leave its allocations in its pool (PyTorch does
not release them): no graph is captured into that pool again. ``clear()`` drops them all (a model deleted leaves
its graphs until they are evicted or cleared).

Sizes. Up to ``MAX_SLOTS`` routed slots: decode steps, and prefills of up to 1024 tokens at top-8 (8192 slots), where
the op's host time (about 0.9 ms a layer at 1024 tokens) exceeded its kernels' and made a compiled forward's prefill
slower than inductor's (BENCHMARKS.md, twenty-fourth session); and GEMMs of at most ``MAX_GRAPH_FLOP``, past which the
kernels hide the host time a graph saves (``worth_a_graph``). A graph serves one stream (the current stream is in the
key), and the lock keeps two threads from filling the buffers at once.
"""
from __future__ import annotations

import collections
import logging
import os
import threading

import torch
from torch._dynamo.utils import counters

MAX_SLOTS = 8192  # routed slots (tokens x top-k) of the largest call served from a graph
MAX_GRAPH_FLOP = 256e9  # and its GEMMs' work (worth_a_graph)
MAX_GRAPHS = 512
MAX_BYTES = 512 << 20  # the shared pools' and buffers' estimated bytes
MAX_SEEN = 4096  # kinds of call remembered as run once (forgotten all at once past it)
log = logging.getLogger("uniep")
counts = {"captured": 0, "replayed": 0, "failed": 0}  # tests and benchmarks read them

_GRAPHS: collections.OrderedDict = collections.OrderedDict()  # key -> _Graph, least recently used first
_SEEN: set = set()  # keys run once without a graph (their kernels compiled)
_REFUSED: set = set()  # keys whose capture failed: they run without a graph
_BYTES = [0]  # the estimate of what _POOLS and _BUFFERS hold
_POOLS: dict = {}  # (device index, stream id, the activations' and the output's layouts) -> _Pool
_BUFFERS: dict = {}  # (device index, stream id, inference mode, position, shape, stride, dtype) -> [buffer, users]
_STREAMS: dict = {}  # device index -> the side stream graphs are captured on
_LOCK = threading.Lock()


class _Graph:
    __slots__ = ("graph", "inputs", "out", "shapes", "pool", "buffers")

    def __init__(self, graph, pool):
        self.graph, self.pool = graph, pool
        self.inputs, self.out, self.shapes, self.buffers = [], None, None, []


class _Pool:
    """A private memory pool that the graphs of one stream and one size capture into (their captures allocate
    alike, so each reuses what the one before freed), its estimated bytes, and how many graphs use it. It goes, and
    its memory with it, when its last graph does."""
    __slots__ = ("handle", "key", "nbytes", "graphs")

    def __init__(self, handle, key):
        self.handle, self.key, self.nbytes, self.graphs = handle, key, 0, 0


def enabled() -> bool:
    return os.environ.get("UNIEP_OP_GRAPHS", "1") != "0"


def forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, plan=None):
    """megakernel.experts_forward's outputs for an op whose spec says inference: from a CUDA graph where one serves
    the call (the module's docstring), else from the kernels run as usual."""
    from . import megakernel

    # looked up once: the kernels below run with the same config where no graph serves the call
    cfg = _graph_config(topk_ids.numel(), hidden, w_up, w_down, spec)
    if cfg is not None and not cfg.up.per_expert_mm and not cfg.down.per_expert_mm:  # (those read host row counts)
        out = _from_graph(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, plan, cfg)
        if out is not None:
            return out
    return megakernel.experts_forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, plan=plan,
                                      config=cfg)


def _graph_config(num_slots, hidden, w_up, w_down, spec):
    """The experts' config for a call of ``num_slots`` routed slots that a graph may serve (``worth_a_graph``, on
    CUDA, op graphs on, outside a capture), else None."""
    inter = _inter(w_down, spec)
    if not (worth_a_graph(num_slots, hidden.shape[1], inter) and hidden.is_cuda and enabled()
            and not torch.cuda.is_current_stream_capturing()):
        return None
    from . import config as config_mod

    return config_mod.current_config(num_slots, w_up.shape[0], hidden.shape[1], inter, False, dtype=hidden.dtype,
                                     device=hidden.device)


def worth_a_graph(num_slots: int, hidden_size: int, inter: int) -> bool:
    """Whether a call of this size may take a graph: at most MAX_SLOTS routed slots, and GEMMs of at most
    MAX_GRAPH_FLOP (6 * slots * H * I: the gated up projection and the down projection). A graph saves the call's host
    time (0.1-0.9 ms); past about MAX_GRAPH_FLOP the kernels take longer than that (0.5 ms at 500 TF/s) and hide it,
    and a graph would only hold its scratch: Mixtral-8x7B's and DeepSeek-V3's experts past about 360 tokens,
    GPT-OSS's past about 1280, while Qwen3-30B-A3B's prefills of 1024 tokens (77 GFLOP, the size measured) take theirs.
    Where the bound lies between has not been measured."""
    return 0 < num_slots <= MAX_SLOTS and 6 * num_slots * hidden_size * inter <= MAX_GRAPH_FLOP


def _inter(w_down, spec) -> int:
    return w_down.shape[2] if spec.down_layout == "oi" else w_down.shape[1]


def _meta(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype)


def _weight(t):
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _pool_bytes(sizes) -> int:
    """About what a graph's private memory pool holds for buffers of these sizes (bytes): PyTorch's caching allocator
    gives a pool a 2 MiB segment for its buffers of at most 1 MiB and segments of at least 20 MiB for larger ones
    (counted here one a buffer: an upper bound where several share one)."""
    return (2 << 20) + sum(max(20 << 20, -(-n // (2 << 20)) * (2 << 20)) for n in sizes if n > (1 << 20))


def _from_graph(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, plan, cfg):
    """The call's outputs from its CUDA graph, or None where none serves it (yet). ``plan``: the router op's routing
    plan, or None."""
    from . import megakernel

    activations = (hidden, topk_ids, topk_weights) + (tuple(plan) if plan is not None else ())
    if not all(t.is_contiguous() for t in activations):  # (copied into buffers of their layout)
        return None
    # the current stream is in the key: a graph's buffers are written and read in one stream's order
    stream = torch.cuda.current_stream(hidden.device)
    key = (spec, cfg, hidden.device.index, stream.stream_id, torch.is_inference_mode_enabled(), plan is not None,
           tuple(_meta(t) for t in activations), _weight(w_up), _weight(w_down), _weight(b_up), _weight(b_down))

    def run(inputs):
        return megakernel.experts_forward(inputs[0], inputs[1], inputs[2], w_up, w_down, b_up, b_down, spec,
                                          plan=tuple(inputs[3:6]) if plan is not None else None, config=cfg)

    served = _serve(key, activations, run, lambda: _sizes(topk_ids.numel(), hidden, w_down, spec))
    if served is None:
        return None
    out, entry = served
    counters["uniep_kernels"]["triton_forward"] += 1
    rows = topk_ids.numel()
    dev = hidden.device
    if plan is not None:
        row_order, slot_row, offsets = plan  # (the op returns empty tensors in their place)
    else:
        row_order, slot_row = (torch.empty(rows, dtype=torch.int64, device=dev) for _ in range(2))
        offsets = torch.empty(w_up.shape[0], dtype=torch.int64, device=dev)
    up, down = (torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in entry.shapes[4:6])
    return out, row_order, slot_row, offsets, up, down


def block_forward(router_hidden, router_weight, router_bias, score_bias, router_spec, hidden, w_up, w_down, b_up,
                  b_down, spec, eager):
    """uniep::moe_block's output (the router op's routing, then the experts op's output, in one op: ops.moe_block):
    from a CUDA graph of router and experts together where one serves the call, else ``eager(cfg)``, which runs
    them one after the other with the experts' config ``cfg`` (or None) and returns the output."""
    cfg = _graph_config(router_hidden.shape[0] * router_spec.top_k, hidden, w_up, w_down, spec)
    if cfg is None:
        return eager(None)
    return _block_from_graph(router_hidden, router_weight, router_bias, score_bias, router_spec, hidden, w_up, w_down,
                             b_up, b_down, spec, cfg, eager)


def _block_from_graph(router_hidden, router_weight, router_bias, score_bias, router_spec, hidden, w_up, w_down, b_up,
                      b_down, spec, cfg, eager):
    """block_forward's output for a call that may take a graph, with the experts' config ``cfg``. The key is the
    experts call's (_from_graph) with the router's spec, weight, bias and score bias, cuBLAS's math flags (the
    router's logits GEMM), and ``shared``: the experts' hidden states are the router's memory (HF's layers pass a
    view of one tensor to both), copied in once. A call is captured only where both the router's and the experts'
    fused kernels take it (checked again at the capture, so that a refusal forgotten is not a capture of the wrong
    kernels)."""
    from . import megakernel, triton_router

    shared = (hidden.data_ptr() == router_hidden.data_ptr() and hidden.numel() == router_hidden.numel()
              and hidden.dtype == router_hidden.dtype)
    activations = (router_hidden,) if shared else (router_hidden, hidden)
    if cfg.up.per_expert_mm or cfg.down.per_expert_mm or not (router_hidden.is_contiguous() and hidden.is_contiguous()):
        return eager(cfg)
    stream = torch.cuda.current_stream(hidden.device)
    matmul = torch.backends.cuda.matmul  # the router's logits GEMM is cuBLAS's: its math follows these flags
    key = ("block", router_spec, spec, cfg, hidden.device.index, stream.stream_id, torch.is_inference_mode_enabled(),
           shared, _meta(router_hidden), _meta(hidden), _weight(router_weight), _weight(router_bias),
           _weight(score_bias), _weight(w_up), _weight(w_down), _weight(b_up), _weight(b_down),
           matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction,
           matmul.allow_fp16_reduced_precision_reduction, torch.get_float32_matmul_precision())

    def run(inputs):
        x = inputs[0].view(hidden.shape) if shared else inputs[1]
        routed = triton_router.router_forward(inputs[0], router_weight, router_bias, score_bias, router_spec)
        _, weights, ids = routed[:3]
        return megakernel.experts_forward(x, ids, weights, w_up, w_down, b_up, b_down, spec,
                                          plan=tuple(routed[3:6]) if router_spec.plan else None, config=cfg)

    def fused():  # (checked before a capture: the graph runs the fused kernels with no check of its own)
        ids = torch.empty(router_hidden.shape[0], router_spec.top_k, dtype=torch.int64, device="meta")
        return megakernel.router_unsupported_reason(router_hidden, router_weight, router_bias, router_spec) is None \
            and megakernel.unsupported_reason(hidden, ids, w_up, w_down, b_up, b_down, [], spec) is None

    tokens = router_hidden.shape[0]
    served = _serve(key, activations, run, lambda: _sizes(tokens * router_spec.top_k, hidden, w_down, spec,
                                                          extra=tokens * router_spec.num_experts * 4), fused)
    if served is not None:
        counters["uniep_kernels"]["triton_router"] += 1
        counters["uniep_kernels"]["triton_forward"] += 1
        return served[0]
    return eager(cfg)  # (a kind whose kernels are not the fused ones is refused at its capture: fused() above)


def _serve(key, activations, run, sizes, ready=None):
    """(a copy of the first output, the graph) of the call of ``key`` replayed from its CUDA graph, or None where none
    serves it (yet): the first call of a key is left to the caller; the second captures ``run(input buffers)``, which
    returns the op's outputs (the experts': their first, and the up and down rows at 4 and 5), where ``ready()`` (if
    given) says the call may be captured, else the key is refused. ``activations``: the tensors copied into the
    graph's input buffers at each call; ``sizes()``: (the estimated bytes its kernels allocate, (shape, dtype) of
    the first output), asked at a capture only (_sizes)."""
    with _LOCK:  # another thread's copies into the same buffers would race with this call's
        entry = _GRAPHS.get(key)
        if entry is None:
            if key in _REFUSED:
                return None
            if key not in _SEEN:  # the first call of its kind runs as usual: its kernels compile outside a capture
                if len(_SEEN) >= MAX_SEEN:
                    _SEEN.clear()
                _SEEN.add(key)
                return None
            if ready is not None and not ready():
                _refuse(key)
                return None
            entry = _capture(key, activations, run, *sizes())
            if entry is None:
                return None
        else:
            _GRAPHS.move_to_end(key)
        for static, given in zip(entry.inputs, activations):
            static.copy_(given)
        entry.graph.replay()
        out = entry.out.clone()
    counts["replayed"] += 1
    counters["uniep_kernels"]["op_graph_replays"] += 1
    return out, entry


def _refuse(key) -> None:
    if len(_REFUSED) >= MAX_SEEN:
        _REFUSED.clear()
    _REFUSED.add(key)


def _sizes(slots: int, hidden, w_down, spec, extra: int = 0):
    """(about what a call's kernels allocate in its graph's pool, in bytes as _pool_bytes counts segments: the
    output, the gathered rows, the up projection (gate and up), the activation, the down rows, the routing's few
    bytes a slot, and ``extra`` (the block's router logits); (shape, dtype) of its output)."""
    (tokens, hidden_size), size, inter = hidden.shape, hidden.element_size(), _inter(w_down, spec)
    scratch = _pool_bytes([tokens * hidden_size * size, slots * hidden_size * size, slots * 2 * inter * size,
                           slots * inter * size, slots * hidden_size * size, slots * 32, extra])
    return scratch, ((tokens, hidden_size), spec.out_dtype)


def _buffer(place, slot, shape, stride, dtype, device, taken):
    """The shared buffer of this shape, stride and dtype for the graphs of ``place`` (device index, stream id) at
    ``slot`` (an input's position, or "out"; two inputs of one call of the same layout are two buffers), made under
    the current inference mode (inference_mode's buffers are inference tensors, which a no_grad call may not write):
    a replay's inputs and output are read and written only inside its call, under the lock, in the stream's order."""
    key = place + (torch.is_inference_mode_enabled(), slot, tuple(shape), tuple(stride), dtype)
    held = _BUFFERS.get(key)
    if held is None:
        held = _BUFFERS[key] = [torch.empty_strided(shape, stride, dtype=dtype, device=device), 0]
        _BYTES[0] += _nbytes([held[0]])
    held[1] += 1
    taken.append(key)
    return held[0]


def _release(entry) -> None:
    """An evicted graph's share of the buffers and its pool: those no graph uses any more are dropped."""
    for key in entry.buffers:
        held = _BUFFERS.get(key)
        if held is not None:
            held[1] -= 1
            if not held[1]:
                _BYTES[0] -= _nbytes([held[0]])
                del _BUFFERS[key]
    pool = entry.pool
    pool.graphs -= 1
    if not pool.graphs:
        _BYTES[0] -= pool.nbytes
        if _POOLS.get(pool.key) is pool:
            del _POOLS[pool.key]


def _capture(key, activations, run, scratch, out_like):
    """Capture ``run`` into a new graph in the pool of its stream and size, reading the shared input buffers of the
    activations' layouts and writing its first output into the shared output buffer of ``out_like``; or None where
    it cannot be (the key then runs without a graph, and the reason is logged)."""
    device = activations[0].device
    current = torch.cuda.current_stream(device)
    out_shape, out_dtype = out_like
    out_meta = torch.empty(out_shape, dtype=out_dtype, device="meta")
    own = scratch + _nbytes(activations) + _nbytes([out_meta])
    if own > MAX_BYTES:  # (alone over the bound: it would evict every other graph and still exceed it)
        _refuse(key)
        log.info("uniep: an experts call would hold about %d MB in a CUDA graph of its own (op_graphs.MAX_BYTES: %d "
                 "MB); calls of its shapes run their kernels one by one", own >> 20, MAX_BYTES >> 20)
        return None
    place = (device.index, current.stream_id)
    size = place + (tuple(_meta(t) for t in activations), tuple(out_shape), out_dtype, scratch)  # (alike captures)
    pool = _POOLS.get(size)
    if pool is None:
        pool = _POOLS[size] = _Pool(torch.cuda.graph_pool_handle(), size)
    graph = torch.cuda.CUDAGraph()
    entry = _Graph(graph, pool)
    pool.graphs += 1
    if scratch > pool.nbytes:
        _BYTES[0] += scratch - pool.nbytes
        pool.nbytes = scratch
    side = _STREAMS.get(device.index)
    if side is None:
        side = _STREAMS[device.index] = torch.cuda.Stream(device)
    calls_before = dict(counters["uniep_kernels"])  # a capture is no call: the replay counts it

    def restore_counts():
        counters["uniep_kernels"].clear()
        counters["uniep_kernels"].update(calls_before)

    try:
        entry.inputs = [_buffer(place, i, t.shape, t.stride(), t.dtype, device, entry.buffers)
                        for i, t in enumerate(activations)]
        out = entry.out = _buffer(place, "out", out_shape, out_meta.stride(), out_dtype, device, entry.buffers)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
            try:
                outputs = run(entry.inputs)
                if (outputs[0].shape, outputs[0].dtype) != (out.shape, out.dtype):
                    raise RuntimeError(f"the output is {tuple(outputs[0].shape)} of {outputs[0].dtype}, not "
                                       f"{tuple(out.shape)} of {out.dtype}")
                _write(out, outputs[0])
            finally:
                graph.capture_end()
    except Exception as exc:  # noqa: BLE001 -- any failure to capture: this kind of call runs without a graph
        current.wait_stream(side)
        restore_counts()
        # a failed capture may leave its allocations in the pool for good (PyTorch does not release them): no graph
        # is captured into it again, and it goes with the graphs that use it
        if _POOLS.get(pool.key) is pool:
            del _POOLS[pool.key]
        _release(entry)
        _refuse(key)
        counts["failed"] += 1
        log.warning("uniep: an experts call could not be captured into a CUDA graph (%s: %s); calls of its shapes "
                    "run their kernels one by one", type(exc).__name__, exc)
        return None
    current.wait_stream(side)
    restore_counts()
    # the other outputs' shapes and dtypes (_from_graph hands back new tensors of them); their memory is the pool's
    entry.shapes = [(t.shape, t.dtype) for t in outputs]
    del outputs
    _GRAPHS[key] = entry
    counts["captured"] += 1
    while len(_GRAPHS) > 1 and (len(_GRAPHS) > MAX_GRAPHS or _BYTES[0] > MAX_BYTES):
        _, old = _GRAPHS.popitem(last=False)
        _release(old)
    return entry


def _write(out, value):
    """out.copy_(value) inside a capture (a function of its own: the tests' stand-in graphs record it)."""
    out.copy_(value)
    return (out,)


def clear() -> None:
    """Drop every graph, pool and buffer (their memory returns to PyTorch's allocator once no replay is pending)."""
    with _LOCK:  # (not in the middle of another thread's capture or replay)
        _GRAPHS.clear()
        _SEEN.clear()
        _REFUSED.clear()
        _POOLS.clear()
        _BUFFERS.clear()
        _BYTES[0] = 0
