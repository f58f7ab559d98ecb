"""Probe: one EP pipeline chunk's pull through the copy engines, four ways (issue 4).

Each of --world ranks holds a symmetric buffer of rows; a chunk is --experts local experts, and each
(expert, source) pair a run of rows (the sizes of a uniform routing). Every rank pulls its chunk from all
ranks into expert order:

  blocks      one copy per source into a stage ordered by source, then one row gather into expert order (the
              layer's copy-engine path before kernels/batch_copy.py)
  segments    one copy per (expert, source), torch's copy_ each
  batch       every (expert, source) copy in one cuMemcpyBatchAsync (kernels/batch_copy.py), one stream
  batch_lanes one batch per source, each on its own stream

GPU time (CUDA events, median of --iters, after a barrier each) and host time of the issuing call; the
batches' rows are checked against the segments'.

    python benchmarks/probes/batch_copy_probe.py --world 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _worker(rank, world, port, args):
    import torch.distributed._symmetric_memory as symm_mem

    from uniep_dynamo.ep import local_rank
    from uniep_dynamo.kernels import batch_copy

    with local_rank(rank, world, port) as device:
        group = dist.group.WORLD
        hidden, dtype = args.hidden, torch.bfloat16
        gen = torch.Generator().manual_seed(0)
        # rows[s][e]: rows source s sends to this chunk's expert e (every rank draws the same table)
        rows = torch.randint(args.rows // 2, args.rows * 3 // 2, (world, world, args.experts), generator=gen)
        mine = rows[:, rank]  # [source, expert] rows this rank receives
        cap = int(rows.sum(dim=(1, 2)).max())  # the most rows a rank sends (every destination): one size a rank
        buf = symm_mem.empty(cap * hidden, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buf, group.group_name)
        peers = [handle.get_buffer(p, (cap, hidden), dtype, 0) for p in range(world)]
        peers[rank].copy_(torch.randn(cap, hidden, generator=torch.Generator().manual_seed(rank)).to(dtype))
        handle.barrier(channel=0)
        total = int(mine.sum())
        recv = torch.empty(total, hidden, dtype=dtype, device=device)
        stage = torch.empty_like(recv)
        # where source s's rows for expert e start in its buffer: destinations before this rank, then experts
        segs = []  # (source, row in its buffer, row in expert order, rows)
        recv_at = 0
        for e in range(args.experts):
            for s in range(world):
                start = int(rows[s, :rank].sum()) + int(rows[s, rank, :e].sum())
                segs.append((s, start, recv_at, int(mine[s, e])))
                recv_at += int(mine[s, e])
        blocks, perm, at = [], torch.empty(total, dtype=torch.int64), 0
        for s in range(world):
            n = int(mine[s].sum())
            blocks.append((s, int(rows[s, :rank].sum()), at, n))
            at += n
        for s, start, row, n in segs:  # stage row of each receive row
            perm[row:row + n] = torch.arange(n) + blocks[s][2] + (start - blocks[s][1])
        perm = perm.to(device)
        row_bytes = hidden * recv.element_size()
        streams = [torch.cuda.Stream(device) for _ in range(world)]
        main = streams[0]

        def blocks_pull():
            with torch.cuda.stream(main):
                for s, start, row, n in blocks:
                    stage[row:row + n].copy_(peers[s][start:start + n])
                torch.index_select(stage, 0, perm, out=recv)

        def segments_pull():
            with torch.cuda.stream(main):
                for s, start, row, n in segs:
                    recv[row:row + n].copy_(peers[s][start:start + n])

        bases = [p.data_ptr() for p in peers]

        def batch(which, stream):
            dsts = [recv.data_ptr() + row * row_bytes for s, start, row, n in which]
            srcs = [bases[s] + start * row_bytes for s, start, row, n in which]
            batch_copy.copy_batch(dsts, srcs, [n * row_bytes for *_, n in which], stream.cuda_stream)

        def batch_pull():
            batch(segs, main)

        def batch_lanes_pull():
            cur = torch.cuda.current_stream()
            for s in range(world):
                streams[s].wait_stream(cur)
                batch([g for g in segs if g[0] == s], streams[s])
            for s in range(world):
                cur.wait_stream(streams[s])

        methods = {"blocks": blocks_pull, "segments": segments_pull}
        if batch_copy.available():
            methods.update(batch=batch_pull, batch_lanes=batch_lanes_pull)
        elif rank == 0:
            print("cuMemcpyBatchAsync not available: batch rows skipped", flush=True)
        results, reference = {}, None
        for name, fn in methods.items():
            gpu, host = [], []
            for it in range(args.iters + 3):
                recv.zero_()
                torch.cuda.synchronize()
                handle.barrier(channel=0)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(main)
                cur = torch.cuda.current_stream()
                main.wait_stream(cur)
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                cur.wait_stream(main)
                end.record(cur)
                torch.cuda.synchronize()
                if it >= 3:
                    gpu.append(start.elapsed_time(end))
                    host.append((t1 - t0) * 1e3)
            if name == "segments":
                reference = recv.clone()
            elif reference is not None and not torch.equal(recv, reference):
                raise AssertionError(f"rank {rank}: {name} rows differ from the segments'")
            results[name] = (statistics.median(gpu), statistics.median(host))
        mb = total * row_bytes / 1e6
        remote = sum(n for s, _, _, n in segs if s != rank) * row_bytes / 1e6
        out = [None] * world
        dist.all_gather_object(out, (rank, results, mb, remote, len(segs)))
        if rank == 0:
            print(f"world {world}, {args.experts} experts a chunk, {len(segs)} segments, hidden {hidden}")
            for r, res, mb, remote, n in out:
                line = "  ".join(f"{k} {g:.3f} ms (host {h:.3f})" for k, (g, h) in res.items())
                rate = f"; batch {remote / res['batch'][0]:.0f} GB/s remote" if "batch" in res else ""
                print(f"rank {r}: {mb:.1f} MB ({remote:.1f} remote): {line}{rate}", flush=True)
        handle.barrier(channel=0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--experts", type=int, default=16, help="local experts a chunk")
    p.add_argument("--rows", type=int, default=512, help="mean rows of an (expert, source) run")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    from uniep_dynamo.ep import free_port

    mp.spawn(_worker, args=(args.world, free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
