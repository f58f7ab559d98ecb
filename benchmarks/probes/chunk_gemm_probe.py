"""Which GEMMs should the EP device plan pipeline's chunks run (ep/device_pipeline.py)? Each chunk is a run of local
experts past row 0 of the receive buffer (rows_gemm's ``lead``), which torch._grouped_mm and per_expert_mm cannot take
without the host's row counts; Triton's GEMM and QuACK's can. (issue 37)

On one GPU, for a rank's receive buffer of the named shape at ``--world`` ranks (T tokens a rank, top-k K: the local
experts E / world with about world * T * K / E rows each), the pipeline's chunk GEMMs over ``--chunks`` runs of
experts, timed back to back (CUDA events around ``--calls`` calls, median of ``--rounds``):

  up      the up projection with its activation (GLU_FWD; QuACK: its GEMM, then the activation pass over the run)
  down    the down projection
  grad_act  the backward's activation-gradient GEMM (dY rows against the down weight)

each by: ``triton`` (every chunk GEMM Triton's, as before device_pipeline.chunk_config), ``quack`` (QuACK at
config.QUACK_CONFIGS over the runs), ``chosen`` (device_pipeline.chunk_config's mix), and, over every expert at once as
the unpipelined device plan runs them, ``whole`` (its config from the heuristics at the buffer's rows, under
device_counts_only as the device plan calls it). The chunked outputs are checked bit for bit against
``whole``'s. Writes $OUT/chunk_gemm_probe.json.

    python benchmarks/probes/chunk_gemm_probe.py --shapes mixtral,qwen3-30b-a3b --world 2,4
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_layer import SHAPES  # noqa: E402
from gemm_schedule_probe import back_to_back_ms  # noqa: E402


def main():
    from uniep_dynamo.ep import device_pipeline
    from uniep_dynamo.ep.config import even_chunks
    from uniep_dynamo.kernels import config as kconfig
    from uniep_dynamo.kernels import megakernel
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.kernels.triton_gemm import GLU_FWD, STORE
    from uniep_dynamo.spec import ExpertsSpec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mixtral,qwen3-30b-a3b")
    parser.add_argument("--world", default="2,4")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "chunk_gemm_probe.json"))
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype)
    rows_out = []
    for shape in args.shapes.split(","):
        H, I, E, K = SHAPES[shape]
        for world in (int(w) for w in args.world.split(",")):
            local = E // world
            capacity = world * args.tokens * K  # the device plan's receive buffer: every rank's rows
            g = torch.Generator(device=dev).manual_seed(0)
            # about capacity / world rows reach this rank, spread near evenly (+-3%) over its local experts
            mean = capacity // world // local
            counts = (mean * (1 + 0.03 * (2 * torch.rand(local, generator=g, device=dev) - 1))).long().tolist()
            routed = sum(counts)
            ends = torch.tensor(counts, device=dev).cumsum(0)
            x = torch.randn(capacity, H, device=dev, generator=g).to(dtype)
            dy = torch.randn(capacity, H, device=dev, generator=g).to(dtype)
            w_up = (torch.randn(local, 2 * I, H, device=dev, generator=g) * 0.02).to(dtype)
            w_down = (torch.randn(local, H, I, device=dev, generator=g) * 0.02).to(dtype)
            full = kconfig.heuristic_config(capacity, local, H, I)
            triton = full.replace_gemms(grouped_mm=False, quack="", per_expert_mm=False)
            quack = dataclasses.replace(triton, **{n: dataclasses.replace(getattr(triton, n),
                                                                          quack=kconfig.QUACK_CONFIGS[n])
                                                   for n in kconfig.GEMMS})
            sizes = even_chunks(local, -(-local // args.chunks))
            firsts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
            bufs = {n: torch.empty(capacity, w, dtype=dtype, device=dev)
                    for n, w in (("up", 2 * I), ("act", I), ("down", H), ("grad_act", I))}

            def gemms(cfg, which, runs, given: bool):
                """The GEMM over ``runs``; ``given`` False (whole): its output allocated by rows_gemm, as the
                experts op does (torch._grouped_mm takes no given output), then kept in bufs."""
                def run():
                    with megakernel.device_counts_only():
                        for e0, e1 in runs:
                            layer = megakernel.Layer(x, (capacity, 1), w_up[e0:e1], w_down[e0:e1], spec, cfg)
                            lead = e0 > 0
                            if which == "up":
                                out = megakernel.rows_gemm(
                                    layer, cfg.up, a=x, gather=False, row_order=None, b=layer.up_eff, n=layer.inter,
                                    k=H, epilogue=GLU_FWD, c=bufs["up"] if given else None, d=bufs["act"],
                                    offsets=ends[e0:e1], lead=lead, **layer.weight_halves())
                            elif which == "down":
                                out = megakernel.rows_gemm(
                                    layer, cfg.down, a=bufs["act"], gather=False, row_order=None, b=layer.down_eff,
                                    n=H, k=I, epilogue=STORE, c=bufs["down"] if given else None,
                                    offsets=ends[e0:e1], lead=lead)
                            else:
                                out = megakernel.rows_gemm(
                                    layer, cfg.grad_act, a=dy, gather=False, row_order=None,
                                    b=layer.down_eff.transpose(1, 2), n=I, k=H, epilogue=STORE,
                                    c=bufs["grad_act"] if given else None, offsets=ends[e0:e1], lead=lead)
                            if not given:
                                bufs[which] = out
                return run

            chunk_runs = [(firsts[c], firsts[c + 1]) for c in range(len(sizes))]
            whole_runs = [(0, local)]
            for which in ("up", "down", "grad_act"):
                expected = None
                chosen = device_pipeline.chunk_config(full, local)
                for label, cfg, runs in (("whole", full, whole_runs), ("triton", triton, chunk_runs),
                                         ("quack", quack, chunk_runs), ("chosen", chosen, chunk_runs)):
                    run = gemms(cfg, which, runs, label != "whole")
                    try:
                        ms = back_to_back_ms(run, args.calls, args.rounds)
                    except Exception as exc:  # noqa: BLE001 -- say what failed, go on
                        print(f"{shape} world {world} {which} {label}: failed {exc!r}"[:300], flush=True)
                        continue
                    names = ("up", "act") if which == "up" else (which,)
                    for n in names:  # one more call into NaN: a row it does not write shows
                        bufs[n].fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    bufs_now = {n: t[:routed].clone() for n, t in bufs.items()}
                    if expected is None:
                        expected, same = {n: bufs_now[n] for n in names}, None
                    else:
                        same = all(torch.equal(bufs_now[n], expected[n]) for n in names)
                    flops = 2.0 * routed * H * (2 * I if which == "up" else I)
                    row = dict(shape=shape, world=world, local_experts=local, rows_each=mean, gemm=which,
                               engine=label, chunks=len(runs), ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                               same_bits_as_whole=same)
                    rows_out.append(row)
                    print(f"{shape:<14} world {world} ({local} experts x ~{mean} rows) {which:<8} {label:<7} "
                          f"{ms:8.4f} ms {flops / ms / 1e9:7.1f} TF/s  same bits as whole: {same}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
