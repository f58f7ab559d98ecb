"""The static attributes of one matched experts region, carried into the op as one string."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from .kernels import gate_program

# float64 is accepted by the op (tests use it as an oracle); the pattern never emits it.
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


# The tags of the EP ops: each synchronizes with the host, runs collectives, or keeps state on the host between ops,
# none of which a CUDA graph replays. Under mode="reduce-overhead" inductor then captures the rest of the graph in
# CUDA graphs and runs these ops between the captured parts (its graph partitions), or captures nothing where it
# cannot partition. Empty on a torch without the tag.
CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


# What a second backward through buffers a reuse_saved backward overwrote raises (the experts ops, the EP layer).
SECOND_BACKWARD_ERROR = (
    "uniep: a second backward through the same compiled MoE layer (retain_graph=True, or autograd.grad twice) "
    "would read the experts' saved buffers, which the first backward overwrote: uniep reuses them as scratch for "
    "a lower peak memory. Compile with torch.compile(model, backend=\"uniep\", "
    "options={\"reuse_saved_buffers\": False}) to keep them intact for another backward.")


def autocast_off(op):
    """``op``'s body with autocast off on the device of its first tensor argument. The uniep ops compute in the dtypes
    their inputs and spec name: where eager's autocast casts, the rewritten graph casts the op's inputs itself. A graph
    that runs eagerly under a live autocast (inner_backend="eager", or autocast entered around the call) would
    otherwise recast the matmuls inside the op: the reference's fp32 expert GEMMs ran fp16 under CPU fp16 autocast."""
    @functools.wraps(op)
    def run(*args, **kwargs):
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return op(*args, **kwargs)
        return op(*args, **kwargs)

    return run


@dataclass(frozen=True)
class ExpertsSpec:
    up_layout: str  # "oi": weight stored [E, out, in] (HF default); "io": [E, in, out] (is_transposed)
    down_layout: str
    gate: str  # a gate program (kernels/gate_program.py)
    out_dtype: torch.dtype
    # Expert ids outside [0, E) (HF's expert-parallel sentinels): "drop" -- the slot contributes nothing
    # (HF's grouped_mm spelling); "clamp" -- the slot uses expert clamp(id, 0, E-1) (HF's batched_mm
    # spelling clamps before gathering weights).
    out_of_range: str = "drop"
    # An optional post program on each down-projection row before the routing weight (HF's
    # post-expert norm); it reads the op's post_operands.
    post: str | None = None
    # Backward may reuse the forward's saved buffers as scratch (the in-place backward op): lower peak
    # memory, but a second backward through the same graph (retain_graph=True) then raises.
    reuse_saved: bool = False
    # Which rewritten experts call of its graph this is (1, 2, ... in the order the backend lowers them; 0: not
    # numbered), read by nothing: it keeps two calls on the same inputs (a block run twice on one batch) two ops. A
    # graph's common-subexpression elimination would otherwise merge them into one, whose saved buffers the two
    # in-place backwards (reuse_saved, whose writes the schema does not declare) would then both overwrite.
    site: int = 0
    # The op's graph reads only its first output, takes no gradient and runs outside inductor's CUDA graphs
    # (backend.mark_inference): a small call may then be served from a CUDA graph of the op's own
    # (kernels/op_graphs.py), and the op's other outputs are new tensors of their shapes with no values.
    inference: bool = False

    def encode(self) -> str:
        data = {"up": self.up_layout, "down": self.down_layout, "gate": self.gate,
                "out_dtype": str(self.out_dtype).replace("torch.", ""), "out_of_range": self.out_of_range,
                "post": self.post, "reuse_saved": self.reuse_saved}
        if self.site:
            data["site"] = self.site
        if self.inference:
            data["inference"] = True
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        post = f", post={gate_program.describe(self.post)}" if self.post else ""
        return (f"gate={gate_program.describe(self.gate)}{post}, weights up={self.up_layout} down={self.down_layout}, "
                f"out={str(self.out_dtype).replace('torch.', '')}")


@functools.lru_cache(maxsize=256)
def decode_spec(text: str) -> ExpertsSpec:
    data = json.loads(text)
    for key in ("up", "down"):
        if data[key] not in ("oi", "io"):
            raise ValueError(f"uniep: unknown weight layout {data[key]!r}")
    gate_program.decode(data["gate"])
    out_of_range = data.get("out_of_range", "drop")
    if out_of_range not in ("drop", "clamp"):
        raise ValueError(f"uniep: unknown out_of_range mode {out_of_range!r}")
    post = data.get("post")
    if post is not None and gate_program.decode(post)[0] != "post":
        raise ValueError("uniep: malformed post program")
    return ExpertsSpec(data["up"], data["down"], data["gate"], _DTYPES[data["out_dtype"]], out_of_range, post,
                       bool(data.get("reuse_saved", False)), int(data.get("site", 0)),
                       bool(data.get("inference", False)))


@dataclass(frozen=True)
class RouterSpec:
    """The static attributes of one matched router region (see kernels/router_reference.py for the math).

    mode "softmax_topk": p = softmax(z) over experts; ids, v = topk(p); HF Mixtral, Qwen2/3-MoE, OLMoE.
    mode "sigmoid_topk": s = sigmoid(z); choice c = s (+ score bias), optionally limited to the
        topk_group best of n_group expert groups (a group scores the sum of its two best choices);
        ids = topk(c).indices; v = s[ids]. DeepSeek-V3 and the families that copy it.
    mode "topk_softmax": ids, top = topk(z); v = softmax(top) over the K slots. GPT-OSS.
    Then v / (sum_k v + renorm_eps) when renorm, times scale, cast to weights_dtype.
    """

    mode: str
    num_experts: int
    top_k: int
    linear_fp32: bool = False  # the linear runs on fp32 casts of hidden and weight (logits are fp32)
    score_fp32: bool = True  # scores are computed in fp32 (else rounded to the logits dtype)
    has_bias: bool = False  # the linear has a bias [E]
    has_score_bias: bool = False  # sigmoid_topk: a correction added to the scores for the choice only
    n_group: int = 1
    topk_group: int = 1
    renorm: bool = False
    renorm_eps: float = 0.0
    scale: float = 1.0
    weights_dtype: torch.dtype = torch.float32
    # The op also returns the routing plan of its ids (row_order, slot_row, expert_offsets), for the
    # experts op those ids feed (the lowering sets it); else those three outputs are empty.
    plan: bool = False

    def encode(self) -> str:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["weights_dtype"] = str(self.weights_dtype).replace("torch.", "")
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        parts = [self.mode, f"E={self.num_experts}", f"K={self.top_k}"]
        if self.n_group > 1:
            parts.append(f"groups {self.topk_group}/{self.n_group}")
        if self.has_score_bias:
            parts.append("score bias")
        if self.renorm:
            parts.append("renorm" + (f"+{self.renorm_eps:g}" if self.renorm_eps else ""))
        if self.scale != 1.0:
            parts.append(f"scale {self.scale:g}")
        if self.linear_fp32:
            parts.append("fp32 linear")
        if self.plan:
            parts.append("routing plan")
        return ", ".join(parts) + f", weights {str(self.weights_dtype).replace('torch.', '')}"


ROUTER_MODES = ("softmax_topk", "sigmoid_topk", "topk_softmax")


@functools.lru_cache(maxsize=256)
def decode_router_spec(text: str) -> RouterSpec:
    data = json.loads(text)
    if data["mode"] not in ROUTER_MODES:
        raise ValueError(f"uniep: unknown router mode {data['mode']!r}")
    data["weights_dtype"] = _DTYPES[data["weights_dtype"]]
    spec = RouterSpec(**data)
    if not 1 <= spec.top_k <= spec.num_experts:
        raise ValueError(f"uniep: router top_k={spec.top_k} outside [1, {spec.num_experts}]")
    if spec.num_experts % spec.n_group or not 1 <= spec.topk_group <= spec.n_group:
        raise ValueError(f"uniep: router groups {spec.topk_group}/{spec.n_group} do not divide E={spec.num_experts}")
    return spec
