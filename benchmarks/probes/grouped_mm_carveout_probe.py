"""Probe: torch._grouped_mm (CUTLASS) under torch's SM carve-out values: does it run, and does it give the same bits
as without one? (BENCHMARKS.md session 24; the EP layer's OverlapConfig.gemm_carveout.)

    python benchmarks/probes/grouped_mm_carveout_probe.py
"""
import torch
E, rows, K, N = 16, 512, 2048, 768
a = torch.randn(E * rows, K, device="cuda", dtype=torch.bfloat16)
b = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * rows
ref = torch._grouped_mm(a, b, offs=offs)
for c in (None, 8, 7, 24, 66, 100, 124, 129, 130, 131):
    torch._C._set_sm_carveout_experimental(c)
    try:
        out = torch._grouped_mm(a, b, offs=offs); torch.cuda.synchronize()
        print(c, "ok", torch.equal(out, ref))
    except Exception as exc:
        print(c, "FAILED", type(exc).__name__, str(exc)[:200])
torch._C._set_sm_carveout_experimental(None)
