"""Expert parallelism: the MoE experts layer over the ranks of a process group, each owning E / W experts.

One module per concept; the imports go down this list, never up:

    processes      a rank of a process group on this host (NCCL or gloo), a free rendezvous port
    config         OverlapConfig: the overlapped layer's scheduling knobs (none changes numerics), the tuned ones'
                   lookup in the tuning cache
    plan           the routing plan across ranks and the exchange of its counts (all_to_all or all-gather, the
                   count table the dispatch hands to the exchange)
    sequential     ep_experts: the EP layer from torch.distributed collectives around the experts op (the
                   reference the overlapped layer equals bit for bit)
    layout         Layout: where every row of an overlapped call lives, and the device tables made from it
    transfer       the symmetric-memory windows, copy streams and copies (copy engines, Triton kernel, foreach)
    chunks         Chunks: the local experts' grouped GEMMs, chunk by chunk, through kernels/megakernel.py's API
    pipeline       one phase's pulls, GEMMs and pushes, overlapped chunk by chunk
    overlap        ep_experts_overlapped: the overlapped layer as an autograd op
    exchange       the compiled exchange (all-to-all, local experts, all-to-all back) on the same pipeline
    custom_ops     torch.ops.uniep.ep_dispatch / ep_combine / ep_exchange, what the compile rewrites lower to
    device_pipeline  the device plan's forward pipelined: chunk by chunk, pulls, Triton GEMMs and pushes beside
                   each other, from tables made on the device
    device_plan    the EP layer with its routing plan on the device (no host synchronization): the windows and the
                   transfer kernel over device-made tables, buffers sized for the most rows a rank can receive
    device_choice  which path ep_layer takes a call by (the device plan or the synchronized one): ep_device_plan's
                   "auto" rule, alike on every rank
    layer          torch.ops.uniep.ep_layer: the whole layer (plan, exchange, combine) as one op, what HF's AllToAllEP
                   becomes under the compile (uniep_dynamo/hf_ep.py)

Importing this package registers the torch.ops.uniep.ep_* ops.
"""
from . import custom_ops, layer  # noqa: F401  (registers torch.ops.uniep.ep_*)
from .config import OverlapConfig
from .custom_ops import ep_combine, ep_dispatch, ep_exchange
from .exchange import exchange_backward, exchange_forward
from .overlap import ep_experts_overlapped
from .plan import EPPlan, ep_plan
from .processes import MULTICAST_OFF, free_port, local_rank
from .sequential import ep_experts

__all__ = ["EPPlan", "MULTICAST_OFF", "OverlapConfig", "ep_combine", "ep_dispatch", "ep_exchange", "ep_experts",
           "ep_experts_overlapped", "ep_plan", "exchange_backward", "exchange_forward", "free_port", "local_rank"]
