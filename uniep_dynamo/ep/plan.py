"""The routing plan across ranks and the exchange of its counts.

Each rank sorts its own T*K slots by global expert (the single-rank op's routing plan: rows in (expert, token, k)
order; rank r's experts are contiguous in it, so it is also the send order). What the ranks exchange of it:

    sequential layer    the per-expert counts, by an all_to_all of [world, E_local] integers (plan_and_exchange;
                        ep_plan adds the split sizes on the host), or all-gathered into a [W, E] table
                        (plan_and_gather) that the dispatch hands to the next graph's exchange (stash_count_table,
                        take_count_table)
    overlapped layer    every rank's per-expert counts and token count, all-gathered and copied to the host, the
                        layer's one synchronization (count_table)

``layer_fused`` says whether the MegaKernel's own kernels run the EP layer's routing steps (routing plan, gather,
combine, routing-weight gradient): exactly where the single-process op runs the MegaKernel, so that EP rounds as that
op does. ``fused`` says it for the piece-by-piece rewrite's ops, which see no expert weights (CUDA only).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..kernels import reference


@dataclasses.dataclass
class EPPlan:
    row_order: torch.Tensor  # [S] slot of each row, rows sorted by (global expert, token, k)
    slot_row: torch.Tensor  # [S] its inverse
    expert_offsets: torch.Tensor  # [E] cumulative rows per global expert
    send_counts: list  # rows to each rank
    recv_counts: list  # rows from each rank
    recv_expert: torch.Tensor  # [sum(recv_counts)] local expert of each received row


def routing_plan(topk_ids: torch.Tensor, num_experts: int, fused_kernels: bool):
    """(row_order, slot_row, expert_offsets) of the single-rank op: with ``fused_kernels`` its Triton counting sort
    (three launches; one for at most 1024 slots), else the reference's stable sort; the same integers either way."""
    from ..kernels import megakernel

    if fused_kernels and num_experts <= megakernel.MAX_EXPERTS:
        from ..kernels.triton_routing import MAX_SLOTS, routing_plan
        if topk_ids.numel() < MAX_SLOTS:
            return routing_plan(topk_ids, num_experts, clamp=False)
    return reference.routing_plan(topk_ids, num_experts)


def plan_and_exchange(topk_ids: torch.Tensor, num_experts: int, world: int, group, fused_kernels: bool):
    """The single-rank routing plan (row_order, slot_row, expert_offsets) and the per-expert counts this
    rank sends and, exchanged over `group`, receives ([world, E / world] each)."""
    row_order, slot_row, offsets = routing_plan(topk_ids, num_experts, fused_kernels)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).view(world, num_experts // world)
    recv = torch.empty_like(counts)
    all_to_all(recv, counts, [], [], group)  # no split sizes: one row of counts to each rank
    return row_order, slot_row, offsets, counts, recv


def plan_and_gather(topk_ids: torch.Tensor, num_experts: int, world: int, group, fused_kernels: bool):
    """plan_and_exchange with the counts all-gathered instead of exchanged: every rank's per-expert counts
    ([world, E], one collective, as the all_to_all was) give this rank's received counts, and the whole table
    goes to the host behind the model's own synchronization (stash_count_table), for the exchange
    of the next graph to lay out its transfers without a collective of its own."""
    row_order, slot_row, offsets = routing_plan(topk_ids, num_experts, fused_kernels)
    flat = torch.diff(offsets, prepend=offsets.new_zeros(1))
    table = flat.new_empty(world * num_experts)
    all_gather_flat(table, flat, group)
    table = table.view(world, num_experts)
    e_local = num_experts // world
    rank = dist.get_rank(group)
    recv = table[:, rank * e_local:(rank + 1) * e_local].contiguous()
    stash_count_table(recv, table)
    return row_order, slot_row, offsets, flat.view(world, e_local), recv


def all_to_all(out: torch.Tensor, t: torch.Tensor, out_splits, in_splits, group) -> None:
    """dist.all_to_all_single(out, t, out_splits, in_splits, group=group), called on the process group itself: the same
    collective with the same options, without torch.distributed's Python wrapper (its checks and loggers took 50-60 µs
    of the 87-92 µs of a one-rank gloo call on a CPU, torch 2.11 and 2.13). ``group``: a ProcessGroup this rank is in,
    or None for the default one; ``out`` and ``t`` contiguous, of one dtype."""
    from torch._C._distributed_c10d import AllToAllOptions

    opts = AllToAllOptions()
    opts.asyncOp = False
    group = group if group is not None else dist.group.WORLD
    work = group.alltoall_base(out, t, list(out_splits), list(in_splits), opts)
    if work is not None:
        work.wait()


def all_gather_flat(out: torch.Tensor, t: torch.Tensor, group) -> None:
    """dist.all_gather_into_tensor(out, t, group=group) (a flat output of world * n elements on gloo and NCCL alike),
    called on the process group itself, as all_to_all is."""
    from torch._C._distributed_c10d import AllgatherOptions

    opts = AllgatherOptions()
    opts.asyncOp = False
    group = group if group is not None else dist.group.WORLD
    work = group._allgather_base(out, t, opts)
    if work is not None:
        work.wait()


def ep_plan(topk_ids: torch.Tensor, num_experts: int, group=None, fused_kernels: bool | None = None) -> EPPlan:
    """``fused_kernels``: run the MegaKernel's routing plan (layer_fused's answer); None: where ``fused`` says."""
    if fused_kernels is None:
        fused_kernels = fused(topk_ids)
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ValueError(f"uniep: {num_experts} experts do not split evenly over {world} ranks")
    e_local = num_experts // world
    row_order, slot_row, offsets, counts, recv = plan_and_exchange(topk_ids, num_experts, world, group,
                                                                   fused_kernels)
    recv_expert = torch.repeat_interleave(
        torch.arange(e_local, device=counts.device).repeat(world), recv.reshape(-1))
    return EPPlan(row_order, slot_row, offsets, counts.sum(1).tolist(), recv.sum(1).tolist(), recv_expert)


def layer_fused(hidden, topk_ids, w_up, w_down, b_up, b_down, spec, world: int) -> bool:
    """Whether the single-process op over every rank's tokens and all E_local * world experts runs the MegaKernel
    (layer_unsupported_reason is None). Where it does, the EP layer's routing plan, gather, combine and routing-weight
    gradient are the MegaKernel's own kernels, elsewhere the reference's, so that the layer rounds as that op does:
    the two routing-weight gradients differ in the last bit (on CUDA, and in the interpreter under
    UNIEP_KERNELS=triton)."""
    return layer_unsupported_reason(hidden, topk_ids, w_up, w_down, b_up, b_down, spec, world) is None


def layer_unsupported_reason(hidden, topk_ids, w_up, w_down, b_up, b_down, spec, world: int) -> str | None:
    """None if the single-process op over every rank's tokens and all E_local * world experts runs the MegaKernel,
    else why it runs the reference (megakernel.unsupported_reason: the kernel mode, the device or Triton's
    interpreter, the dtypes, the gate; the expert count is all ranks' experts, not this rank's). ``spec``: decoded;
    its gate and post program are the single-process op's. Only the slot count is this rank's (that op holds every
    rank's against MAX_SLOTS, 2^31)."""
    from ..kernels import megakernel

    if w_up.shape[0] * world > megakernel.MAX_EXPERTS:
        return (f"{w_up.shape[0] * world} experts over {world} ranks; the single-process op runs the MegaKernel for "
                f"at most {megakernel.MAX_EXPERTS}")
    return megakernel.unsupported_reason(hidden, topk_ids, w_up, w_down, b_up, b_down, [], spec)


def fused(t: torch.Tensor) -> bool:
    """The piece-by-piece rewrite's ops (custom_ops.py: the dispatch and the combine, which see no expert weights):
    the MegaKernel's own gather/combine kernels on CUDA, the reference's elsewhere (the interpreter included)."""
    from ..kernels import megakernel

    return t.is_cuda and megakernel.kernels_mode() != "reference" and megakernel.triton_available()


def device_count_table(offsets: torch.Tensor, num_tokens: int, group) -> torch.Tensor:
    """Every rank's per-expert counts and then its ``num_tokens``, [W, E + 1] on the device: one all-gather."""
    experts = offsets.numel()
    mine = offsets.new_empty(experts + 1)
    if experts:
        mine[:1].copy_(offsets[:1])
        torch.sub(offsets[1:], offsets[:-1], out=mine[1:experts])
    mine[experts:].fill_(num_tokens)
    every = offsets.new_empty(dist.get_world_size(group) * (experts + 1))  # flat: gloo takes no [W, n] output
    all_gather_flat(every, mine, group)
    return every.view(-1, experts + 1)


def count_table(offsets: torch.Tensor, num_tokens: int, group, beside=None):
    """All ranks' per-expert counts and token counts, on the host: one all-gather (device_count_table) and one copy
    to the host, the layer's one synchronization. beside() (work of the current stream) is issued after that copy and
    before the host waits for it: the GPU runs it while the host lays out the step. No other host copy or
    synchronization: a host tensor copied to the device would wait for the stream's earlier work first."""
    every = device_count_table(offsets, num_tokens, group)
    host, copied = host_copy(every)
    if beside is not None:
        beside()
    if copied is not None:
        copied.synchronize()
    table = host.tolist()
    return [row[:-1] for row in table], [row[-1] for row in table], every


def host_copy(t: torch.Tensor):
    """(host tensor, event): a copy of ``t`` into pinned host memory on the current stream and the event recorded
    after it, to wait on before reading; on the CPU ``t`` itself and None."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def address_key(t: torch.Tensor):
    """(device, address) of a tensor's data, what the dispatch's hand-overs are found by; None for an empty tensor
    (empty tensors may share an address)."""
    return (str(t.device), t.data_ptr()) if t.numel() else None


# ---- the count table from the dispatch ------------------------------------------------------------------------
#
# uniep.ep_dispatch(gather_counts=True) all-gathers every rank's per-expert counts and starts copying the [W, E]
# table to the host; the model's own .tolist() of the split sizes (its one synchronization) then waits for that
# copy too. The exchange of the next graph takes the table by its received counts: the dispatch returned that
# tensor, and the entry holds it, so its memory cannot belong to another tensor while the entry lives. So the
# exchange lays out its transfers without a collective and a synchronization of its own. Every rank runs the
# same graphs, so every rank finds its table or none does; one that finds none all-gathers its claims.

_COUNT_TABLES: dict = {}  # (device, address of the received counts) -> (received counts, host table, copy event)
MAX_COUNT_TABLES = 8  # tables of dispatches no exchange read (an exchange left unfused, say) are dropped
COUNT_TABLE_PATHS = {"dispatch": 0, "gathered": 0}  # where the exchanges' count tables came from (tests read it)


def stash_count_table(recv: torch.Tensor, table: torch.Tensor) -> None:
    """Keep the all-gathered [W, E] count ``table`` for the exchange that receives ``recv`` (the dispatch's
    received counts, a slice of it): a copy to pinned host memory on the current stream, read after the
    model's synchronization."""
    key = address_key(recv)
    if key is None:
        return
    host, event = host_copy(table)
    _COUNT_TABLES.pop(key, None)
    _COUNT_TABLES[key] = (recv, host, event)
    while len(_COUNT_TABLES) > MAX_COUNT_TABLES:
        _COUNT_TABLES.pop(next(iter(_COUNT_TABLES)))


def take_count_table(recv_counts: torch.Tensor):
    """The dispatch's [W, E] count table (host lists) for these received counts, or None; taken once."""
    entry = _COUNT_TABLES.pop(address_key(recv_counts), None)
    if entry is None:
        return None
    recv, host, event = entry
    if recv.shape != recv_counts.shape or recv.dtype != recv_counts.dtype:
        return None
    if event is not None:
        event.synchronize()  # done already: the model's .tolist() after the copy waited for the stream
    return host.tolist()
