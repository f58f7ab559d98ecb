"""Which path ep_layer takes for a call: the device plan (device_plan.py) or the synchronized one. ep_layer's
``device_plan`` argument (the compile's ep_device_plan) is OFF, ON (wherever the path can run) or AUTO (the default):
on CUDA, within one host, where what the path may hold above the synchronized one at the worst case fits in
AUTO_MEMORY_SHARE of the group's smallest GPU. Every rank decides from what all of them gathered, so no rank takes
the other path (their collectives differ); the bits are the same either way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .device_plan import AHEAD, host_group, host_tokens, unsupported_reason
from .plan import all_gather_flat
from .transfer import window

# ep_layer's device_plan argument (the compile's ep_device_plan: False, True, "auto")
OFF, ON, AUTO = 0, 1, 2


def mode(option) -> int:
    """ep_layer's device_plan argument for the compile's ep_device_plan option (False, True or "auto")."""
    return AUTO if option == "auto" else ON if option else OFF

# "auto" runs the device plan where the buffers it holds above the synchronized path's, at the worst case, fit in this
# share of the GPU's memory (the smallest of the group's GPUs)
AUTO_MEMORY_SHARE = 1 / 16
# process group name -> (that group, why the auto rule leaves the group on the synchronized path or None, the
# smallest total memory of its GPUs): found once per group, the same on every rank
_GROUP_FACTS: dict = {}


def _group_facts(group, hidden):
    """(reason or None, smallest GPU memory in bytes) of ``group`` for the auto rule, gathered over the host group at
    the group's first call: its ranks must share one host (the transfer kernel reads and writes the peers' memory
    directly), each GPU must reach every other one (peer access), and symmetric memory must work (_windows_reason);
    every rank learns the same answer."""
    import socket
    import zlib

    entry = _GROUP_FACTS.get(group.group_name)
    if entry is None or entry[0] is not group:
        world, hosts, device = dist.get_world_size(group), host_group(group), hidden.device
        mine = torch.tensor([zlib.crc32(socket.gethostname().encode()), device.index,
                             torch.cuda.get_device_properties(device).total_memory], dtype=torch.int64)
        every = torch.empty(3 * world, dtype=torch.int64)
        all_gather_flat(every, mine, hosts)
        names, devices, memory = every[0::3].tolist(), every[1::3].tolist(), min(every[2::3].tolist())
        reason = None
        if len(set(names)) > 1:
            reason = "the EP group spans several hosts (its transfers address the peers' GPU memory within one host)"
        else:
            reach = torch.tensor([all(d == device.index or torch.cuda.can_device_access_peer(device, d)
                                      for d in devices)], dtype=torch.int64)
            reaches = torch.empty(world, dtype=torch.int64)
            all_gather_flat(reaches, reach, hosts)
            if not all(reaches.tolist()):
                reason = "a GPU of the EP group has no peer access to another"
            else:
                reason = _windows_reason(group, hidden)
        entry = _GROUP_FACTS[group.group_name] = (group, reason, memory)
    return entry[1], entry[2]


def _windows_reason(group, hidden) -> str | None:
    """Why this group cannot use symmetric-memory windows here, or None: one window is made (the one the layer's
    first call would make) with each rank's failure caught, and the ranks' outcomes all-gathered, so that a
    container that forbids opening a peer's memory, say, gets the synchronized path on every rank instead of an
    error on some."""
    try:
        window(group, 1, hidden.shape[1], hidden.dtype, hidden.device)
        failed = ""
    except Exception as exc:  # noqa: BLE001  (any failure: this rank cannot take the path)
        failed = f"{type(exc).__name__}: {exc}"
    world = dist.get_world_size(group)
    flags = torch.empty(world, dtype=torch.int64)
    all_gather_flat(flags, torch.tensor([int(bool(failed))], dtype=torch.int64), host_group(group))
    bad = [r for r, flag in enumerate(flags.tolist()) if flag]
    if not bad:
        return None
    return f"symmetric memory failed on rank(s) {bad} of the EP group ({failed or 'see their log'})"


def _auto_facts(hidden, group):
    """(why the auto rule does not run the path here or None, the smallest GPU memory of the group in bytes)."""
    if not hidden.is_cuda:
        return "not on CUDA", 0
    return _group_facts(group, hidden)


def worst_case_excess(tokens: list, top_k: int, hidden_size: int, up_width: int, itemsize: int) -> int:
    """Bytes the path may hold above the synchronized one, at the worst case: the receive buffer and its up
    projection at the most rows this rank can receive (every rank's T * K) instead of its own T * K rows (the mean
    at even routing), for the layer whose backward is next and the AHEAD layers whose counts the host has not
    seen yet."""
    extra_rows = (sum(tokens) - max(tokens)) * top_k
    return (AHEAD + 1) * extra_rows * (hidden_size + up_width) * itemsize


def choose(hidden, topk_ids, w_up, group, auto: bool, fused_kernels: bool = True):
    """(None, every rank's token count) where this path runs, else (why not, None). ``auto`` (the compile's default,
    ep_device_plan="auto"): also only on CUDA, within one host, and where worst_case_excess fits in
    AUTO_MEMORY_SHARE of the smallest GPU of the group; every rank decides alike (from gathered counts), so the
    group's collectives match. ``fused_kernels``: whether the MegaKernel runs the layer (plan.layer_fused); on CUDA
    the path needs it, since the reference experts op reads each expert's row count on the host."""
    why = unsupported_reason(hidden, group)
    if why is None and hidden.is_cuda and not fused_kernels:
        why = ("the fused kernels do not run this layer, and the reference experts op reads the expert counts on "
               "the host")
    if why is None and auto:
        why, memory = _auto_facts(hidden, group)
    if why is not None:
        return why, None
    tokens = host_tokens(topk_ids.shape[0], group)
    if auto:
        up_width = w_up[0].numel() // hidden.shape[1]
        excess = worst_case_excess(tokens, topk_ids.shape[1], hidden.shape[1], up_width, hidden.element_size())
        if excess > memory * AUTO_MEMORY_SHARE:
            return (f"its worst-case buffers would hold {excess / 2**30:.1f} GiB above the synchronized path's, over "
                    f"{AUTO_MEMORY_SHARE:.3g} of the GPU's {memory / 2**30:.0f} GiB (ep_device_plan=True runs it "
                    "anyway)"), None
    return None, tokens
