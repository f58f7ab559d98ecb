"""What the Triton kernels compile to for a Hopper GPU (sm_90), checked on any machine: Triton compiles for a target
without the GPU itself. Not timings: the width of the global loads and stores the activation passes issue, which
set their speed (they are bandwidth-bound), for h stored as [gate; up] halves and for config.gated_epilogue's
interleaved h. On an H200 the late-weight pass over the interleaved h took 0.42 ms against 0.16 over halves while
its pair mask, built by join and reshape, hid its runs from Triton's analysis and every element went alone
(BENCHMARKS.md, 2026-11-28 seventeenth session)."""
import collections
import re

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

# (kernel name, its arguments in order: a type, or None for a constexpr; the arguments Triton specializes as
# multiples of 16 in a real launch: pointers, strides, the widths)
ACT = {"COL_MULT": None, "TWO_HALVES": None, "ACT": None, "act_alpha": "fp32", "act_limit": "fp32",
       "act_up_add": "fp32", "BLOCK_R": None, "BLOCK_C": None}
KERNELS = {
    "_act_forward": {"h_ptr": "*bf16", "stride_hm": "i32", "act_ptr": "*bf16", "stride_am": "i32",
                     "offsets_ptr": "*i64", "num_experts": "i32", "N": "i32", "UP_SHIFT": "i32", **ACT},
    "_act_backward": {"d_act_ptr": "*bf16", "stride_dm": "i32", "h_ptr": "*bf16", "stride_hm": "i32",
                      "d_h_ptr": "*bf16", "stride_gm": "i32", "act_ptr": "*bf16", "stride_am": "i32",
                      "offsets_ptr": "*i64", "num_experts": "i32", "N": "i32", "UP_SHIFT": "i32", **ACT},
    "_act_backward_late_weight": {"d_raw_ptr": "*bf16", "stride_dm": "i32", "h_ptr": "*bf16", "stride_hm": "i32",
                                  "d_h_ptr": "*bf16", "stride_gm": "i32", "row_order_ptr": "*i64", "w_ptr": "*bf16",
                                  "part_ptr": "*fp32", "offsets_ptr": "*i64", "num_experts": "i32",
                                  "num_rows": "i32", "N": "i32", "UP_SHIFT": "i32", **ACT},
}
SPECIALIZED = {"h_ptr", "stride_hm", "act_ptr", "stride_am", "offsets_ptr", "N", "UP_SHIFT", "d_act_ptr", "stride_dm",
               "d_h_ptr", "stride_gm", "d_raw_ptr", "row_order_ptr", "w_ptr", "part_ptr", "num_rows"}


COMPILE = """
import collections, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from uniep_dynamo.kernels import triton_gemm
kernels, specialized = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
out = {}
for name, args in kernels.items():
    signature = {k: (v or "constexpr") for k, v in args.items()}
    names = list(signature)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in specialized if k in signature}
    for col_mult in (1, 2):
        consts = {"COL_MULT": col_mult, "TWO_HALVES": True, "ACT": triton_gemm.ACTIVATIONS["silu_glu"],
                  "BLOCK_R": 16, "BLOCK_C": 128}
        compiled = triton.compile(ASTSource(fn=getattr(triton_gemm, name), signature=signature, constexprs=consts,
                                            attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out[f"{name}/{col_mult}"] = collections.Counter(re.findall(r"(?:ld|st)\\.global[.a-z0-9]*",
                                                                   compiled.asm["ptx"]))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def accesses():
    """{kernel/COL_MULT: {global load or store instruction: count}} of each pass's PTX for sm_90 (bf16, 16 x 128
    tiles, 4 warps, SwiGLU), compiled in a process without Triton's interpreter (whose kernels do not compile);
    skips where this Triton cannot compile for that target here."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(KERNELS), json.dumps(sorted(SPECIALIZED))],
                         env=env, capture_output=True, text=True, timeout=600)
    if run.returncode:
        pytest.skip(f"this Triton does not compile for sm_90 here: {run.stderr.strip().splitlines()[-1:]}")
    return {k: collections.Counter(v) for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("name", list(KERNELS))
def test_interleaved_activation_passes_move_h_in_16_byte_vectors(name, accesses):
    """Over the interleaved h each pass issues at least the halves pass's 16-byte loads and stores (h, d_h, the
    activation and its gradient move in them) and no narrower store. (The per-row loads of routing weights and
    slots are narrow either way.)"""
    halves, interleaved = accesses[f"{name}/1"], accesses[f"{name}/2"]
    for wide in ("ld.global.v4.b32", "st.global.v4.b32"):
        assert interleaved[wide] >= halves[wide] > 0, (wide, halves, interleaved)
    assert interleaved["st.global.b16"] <= halves["st.global.b16"], (halves, interleaved)
