"""Processes on this host: a free rendezvous port and one rank of a process group (NCCL on a GPU, gloo on CPU), with
NVLink multicast off for NCCL, symmetric memory and NVSHMEM."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


# NVLink multicast (NVLS) off for NCCL, torch symmetric memory and NVSHMEM: the multi-GPU hosts this project
# runs on need it (set only where the environment does not say otherwise)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    """A free TCP port on this host, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_rank(rank: int, world: int, port: int, device_type: str = "cuda"):
    """Rank ``rank`` of a ``world``-process group on this host (rendezvous at ``port``): NCCL on GPU
    ``rank``, or gloo on CPU; yields the rank's device. On the way out the ranks meet at a barrier before
    the group is destroyed (unless this rank failed), so that no rank tears down its connections while a
    peer still uses them."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type != "cuda":
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        for key, value in MULTICAST_OFF.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        yield device
        dist.barrier()
    finally:
        dist.destroy_process_group()
