"""Probe: pull peer rows out of torch symmetric memory with the copy engines, and how such copies
overlap a bf16 GEMM. Run with torchrun --nproc-per-node N."""
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem


def main():
    rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    print(rank, "backend", symm_mem.get_backend(torch.device("cuda")) if hasattr(symm_mem, "get_backend") else "?",
          "nvshmem", symm_mem.is_nvshmem_available(), flush=True)
    n = 64 * 1024 * 1024  # bf16 elements: 128 MB
    buf = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    h = symm_mem.rendezvous(buf, group.group_name)
    print(rank, "rendezvous s", round(time.perf_counter() - t0, 3), flush=True)
    buf.fill_(rank + 1)
    h.barrier(channel=0)
    peers = [(rank + j) % world for j in range(1, world)]
    out = torch.empty(world, n, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    for p in peers:
        out[p].copy_(h.get_buffer(p, (n,), torch.bfloat16, 0))
    torch.cuda.synchronize()
    ok = all(bool((out[p] == p + 1).all()) for p in peers)
    print(rank, "pull values ok", ok, flush=True)
    # bandwidth: pull from every peer, one stream
    def pulls(stream):
        with torch.cuda.stream(stream):
            for p in peers:
                out[p].copy_(h.get_buffer(p, (n,), torch.bfloat16, 0))
    for _ in range(3):
        pulls(side)
    torch.cuda.synchronize(); dist.barrier()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(side); pulls(side); e1.record(side); torch.cuda.synchronize()
    ms = e0.elapsed_time(e1)
    print(rank, f"pull {len(peers)} x 128MB one stream {ms:.3f} ms = {len(peers)*n*2/ms/1e6:.0f} GB/s", flush=True)
    streams = [torch.cuda.Stream() for _ in peers]
    dist.barrier(); torch.cuda.synchronize()
    t = time.perf_counter()
    for s, p in zip(streams, peers):
        with torch.cuda.stream(s):
            out[p].copy_(h.get_buffer(p, (n,), torch.bfloat16, 0))
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    print(rank, f"pull {len(peers)} x 128MB one stream each {ms:.3f} ms = {len(peers)*n*2/ms/1e6:.0f} GB/s", flush=True)
    # overlap with a GEMM
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(); dist.barrier()
    e0.record(); [a @ b for _ in range(10)]; e1.record(); torch.cuda.synchronize()
    gemm = e0.elapsed_time(e1)
    dist.barrier()
    e0.record()
    with torch.cuda.stream(side):
        for _ in range(3):
            pulls(torch.cuda.current_stream())
    [a @ b for _ in range(10)]
    e1.record(); torch.cuda.current_stream().wait_stream(side); torch.cuda.synchronize()
    both = e0.elapsed_time(e1)
    print(rank, f"10 GEMMs alone {gemm:.3f} ms, with 3x pulls on a side stream (gemm stream time) {both:.3f} ms", flush=True)
    # push into peer memory then barrier
    h.barrier(channel=0)
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
