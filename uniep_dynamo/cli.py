"""The command line.

uniep-diff (or `uniep diff`): run a script (or module) that compiles with backend="uniep" and report what
was rewritten.

    uniep-diff train.py --steps 1                       # terminal summary
    uniep-diff --html report.html --json report.json train.py
    uniep-diff --expect moe_experts=32 -m mypkg.train   # exit 1 unless exactly 32 rewrites

uniep tune: search the MegaKernel's parameter space on this GPU and cache the winners (uniep_dynamo/tuner.py).

    uniep tune --hf-config Qwen/Qwen3-30B-A3B --tokens 8192
    uniep tune --shape 4096,14336,8,2 --shape 2048,768,128,8 --budget 8
    uniep tune --ep 4 --shape 2048,768,128,8 --tokens 8192     # the overlapped EP layer's knobs on 4 GPUs
"""
from __future__ import annotations

import argparse
import runpy
import sys

from .explain import Report
from .report import recording


def _parse_expect(items):
    expected = {}
    for item in items or []:
        key, _, value = item.partition("=")
        if not value.isdigit():
            raise SystemExit(f"uniep-diff: --expect takes NAME=COUNT, got {item!r}")
        expected[key] = int(value)
    return expected


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="uniep-diff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the JSON report here")
    parser.add_argument("--html", help="write the HTML report here")
    parser.add_argument("--expect", action="append", metavar="NAME=COUNT",
                        help="required total, e.g. moe_experts=32 (repeatable); exit 1 otherwise")
    parser.add_argument("-m", dest="module", help="run a module (as python -m) instead of a script")
    parser.add_argument("target", nargs="?", help="the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if not ns.module and not ns.target:
        parser.error("give a script or -m MODULE")
    expected = _parse_expect(ns.expect)
    saved_argv = sys.argv
    with recording() as recorder:
        try:
            if ns.module:
                sys.argv = [ns.module] + ([ns.target] if ns.target else []) + ns.args
                runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [ns.target] + ns.args
                runpy.run_path(ns.target, run_name="__main__")
        finally:
            sys.argv = saved_argv
    report = Report.from_recorder(recorder)
    print(report.summary())
    if ns.json:
        report.to_json(ns.json)
    if ns.html:
        report.to_html(ns.html)
    failed = [f"{key}: expected {want}, got {report.totals.get(key, 0)}"
              for key, want in expected.items() if report.totals.get(key, 0) != want]
    for line in failed:
        print(f"uniep-diff: --expect {line}", file=sys.stderr)
    return 1 if failed else 0



# ---- uniep tune ------------------------------------------------------------------------------------

_HF_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_HF_INTER = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")


def shapes_from_hf_config(cfg) -> tuple:
    """(hidden, expert intermediate, experts, top-k) of an HF MoE config (its text config for multimodal ones)."""
    cfg = getattr(cfg, "text_config", None) or cfg
    experts = next((getattr(cfg, n) for n in _HF_EXPERTS if getattr(cfg, n, None)), None)
    inter = next((getattr(cfg, n) for n in _HF_INTER if getattr(cfg, n, None)), None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not (experts and inter and top_k and getattr(cfg, "hidden_size", None)):
        raise SystemExit(f"uniep tune: {type(cfg).__name__} names no MoE experts (looked for {_HF_EXPERTS}, "
                         f"{_HF_INTER}, num_experts_per_tok)")
    return cfg.hidden_size, inter, experts, top_k


def _progress(label):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bar = {}

    def update(done, total, best_ms):
        if tqdm is not None:
            if "bar" not in bar:
                bar["bar"] = tqdm(total=total, desc=label, unit="config", leave=False)
            bar["bar"].n = done
            bar["bar"].set_postfix(best_ms=f"{best_ms:.3f}")
            if done >= total:
                bar["bar"].close()
        else:
            print(f"\r{label}: {done}/{total} configs, best {best_ms:.3f} ms", end="" if done < total else "\n",
                  file=sys.stderr, flush=True)
    return update


def tune_main(argv=None) -> int:
    """uniep tune: search the MegaKernel's space for the experts shapes of an HF config (or given shapes)
    on this GPU, print heuristic vs tuned time per shape, and store the winners in the tuning cache."""
    parser = argparse.ArgumentParser(prog="uniep tune", description=tune_main.__doc__)
    parser.add_argument("--hf-config", action="append", default=[],
                        help="an HF model id or config directory (AutoConfig.from_pretrained); repeatable")
    parser.add_argument("--shape", action="append", default=[], metavar="H,I,E,K",
                        help="hidden, expert intermediate size, experts, top-k; repeatable")
    parser.add_argument("--tokens", default="8192", help="comma-separated token counts per call (default 8192)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--budget", type=int, default=8, help="candidates per knob group (GEMM or layer)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-save", action="store_true", help="do not write the tuning cache")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--ep", type=int, default=1, metavar="N",
                        help="tune the overlapped EP layer's knobs over N ranks (N GPUs of this host; T tokens "
                             "per rank, the experts split evenly) instead of one GPU's MegaKernel")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run of --ep (gloo, Triton's interpreter, tiny shapes; its times mean "
                             "nothing and nothing is saved)")
    ns = parser.parse_args(argv)

    import json

    import torch

    from . import tuner

    shapes = []
    for name in ns.hf_config:
        from transformers import AutoConfig
        shapes.append((name, shapes_from_hf_config(AutoConfig.from_pretrained(name))))
    for text in ns.shape:
        try:
            shapes.append((text, tuple(int(v) for v in text.split(","))))
        except ValueError:
            parser.error(f"--shape takes H,I,E,K, got {text!r}")
        if len(shapes[-1][1]) != 4:
            parser.error(f"--shape takes H,I,E,K, got {text!r}")
    if not shapes:
        parser.error("give --hf-config or --shape")
    if ns.ep > 1:
        return _tune_ep_main(ns, shapes)
    if not torch.cuda.is_available():
        print("uniep tune: needs a CUDA GPU (the search times the Triton MegaKernel)", file=sys.stderr)
        return 2
    dtype = getattr(torch, ns.dtype)
    gpu = torch.cuda.get_device_name()
    rows = []
    for label, (hidden, inter, experts, top_k) in shapes:
        for tokens in (int(t) for t in ns.tokens.split(",")):
            result = tuner.tune_shape(tokens, hidden, inter, experts, top_k, dtype=dtype, budget=ns.budget,
                                      iters=ns.iters, progress=_progress(f"{label} T={tokens}"))
            rows.append((label, tokens, result))
            if not ns.no_save:
                path = tuner.store_entries(gpu, {result.key: {
                    "config": tuner.config_to_dict(result.config), "heuristic_ms": result.heuristic_ms,
                    "tuned_ms": result.tuned_ms, "tune_seconds": result.seconds}})
    print(f"\n{gpu}, {ns.dtype}, forward + backward of one experts layer (ms, median of {ns.iters})")
    print(f"{'shape':28s} {'T':>6s} {'heuristic':>10s} {'tuned':>9s} {'speedup':>8s} {'measured':>9s} "
          f"{'rejected':>9s} {'tune s':>7s}")
    for label, tokens, r in rows:
        print(f"{label[:28]:28s} {tokens:6d} {r.heuristic_ms:10.3f} {r.tuned_ms:9.3f} {r.speedup:7.2f}x "
              f"{r.measured:9d} {sum(r.rejected.values()):9d} {r.seconds:7.1f}")
    if not ns.no_save:
        print(f"tuning cache: {path}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"gpu": gpu, "dtype": ns.dtype, "rows": [
                {"shape": label, "tokens": tokens, "key": r.key, "heuristic_ms": r.heuristic_ms,
                 "tuned_ms": r.tuned_ms, "speedup": r.speedup, "measured": r.measured, "rejected": r.rejected,
                 "failures": r.failures, "tune_seconds": r.seconds, "config": tuner.config_to_dict(r.config)}
                for label, tokens, r in rows]},
                f, indent=1)
    return 0


def _tune_ep_main(ns, shapes) -> int:
    import json
    import os
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from .ep import free_port

    if ns.device == "cuda" and torch.cuda.device_count() < ns.ep:
        print(f"uniep tune: --ep {ns.ep} needs {ns.ep} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    for label, (hidden, inter, experts, top_k) in shapes:
        if experts % ns.ep:
            print(f"uniep tune: {label}: {experts} experts do not split evenly over {ns.ep} ranks", file=sys.stderr)
            return 2
    port = free_port()
    # the CPU smoke run's workers run the MegaKernel in Triton's interpreter (they inherit the environment)
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "UNIEP_KERNELS")}
    if ns.device == "cpu":
        os.environ.update(TRITON_INTERPRET="1", UNIEP_KERNELS="triton")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(_tune_ep_worker, args=(ns.ep, port, ns, shapes, out), nprocs=ns.ep)
            with open(out) as f:
                data = json.load(f)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(f"\n{data['gpu']}, {data['dtype']}, EP over {ns.ep} ranks, forward + backward of the overlapped experts "
          f"layer (ms on the slowest rank, median of {ns.iters})")
    print(f"{'shape':28s} {'T/rank':>7s} {'default':>9s} {'tuned':>9s} {'speedup':>8s} {'measured':>9s} "
          f"{'rejected':>9s} {'tune s':>7s}  tuned knobs")
    for r in data["rows"]:
        knobs = {k: v for k, v in r["config"].items() if k != "timing"}
        print(f"{r['shape'][:28]:28s} {r['tokens']:7d} {r['default_ms']:9.3f} {r['tuned_ms']:9.3f} "
              f"{r['default_ms'] / r['tuned_ms']:7.2f}x {r['measured']:9d} {sum(r['rejected'].values()):9d} "
              f"{r['tune_seconds']:7.1f}  {knobs}")
    if data.get("cache"):
        print(f"tuning cache: {data['cache']}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


def _tune_ep_worker(rank, world, port, ns, shapes, out):
    import dataclasses
    import json

    import torch

    from . import tuner
    from .ep import local_rank
    from .kernels import gate_program
    from .spec import ExpertsSpec

    with local_rank(rank, world, port, ns.device) as device:
        # the CPU smoke run (see _tune_ep_main) runs float32 in Triton's interpreter
        dtype = getattr(torch, ns.dtype) if device.type == "cuda" else torch.float32
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        spec = ExpertsSpec("io", "io", gate_program.encode("chunk", gate_program.SILU_GLU_EXPR), dtype).encode()
        rows, path = [], None
        for label, (hidden, inter, experts, top_k) in shapes:
            local = experts // world
            for tokens in (int(t) for t in ns.tokens.split(",")):
                g = torch.Generator().manual_seed(1000 * rank + tokens)
                x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
                scores = torch.rand(tokens, experts, generator=g)
                weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
                w_up = (torch.randn(local, hidden, 2 * inter, generator=g) * hidden ** -0.5).to(device, dtype)
                w_down = (torch.randn(local, inter, hidden, generator=g) * inter ** -0.5).to(device, dtype)
                progress = _progress(f"{label} T={tokens} ep{world}") if rank == 0 else None
                r = tuner.tune_ep(x, ids.to(device), weights.to(device, dtype), w_up, w_down, spec, budget=ns.budget,
                                  iters=ns.iters, warmup=3 if device.type == "cuda" else 0,  # CPU: no meaning
                                  progress=progress)
                rows.append({"shape": label, "tokens": tokens, "key": r.key, "default_ms": r.default_ms,
                             "tuned_ms": r.tuned_ms, "measured": r.measured, "rejected": r.rejected,
                             "tune_seconds": r.seconds, "config": dataclasses.asdict(r.config)})
                if rank == 0 and not ns.no_save and device.type == "cuda":
                    path = tuner.store_entries(gpu, {r.key: {**tuner.ep_config_to_dict(r.config),
                                                             "default_ms": r.default_ms, "tuned_ms": r.tuned_ms,
                                                             "tune_seconds": r.seconds}})
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"gpu": gpu, "dtype": str(dtype).replace("torch.", ""), "ep": world, "rows": rows,
                           "cache": path}, f)


def uniep_main(argv=None) -> int:
    """uniep COMMAND: `uniep tune ...` (the MegaKernel search) or `uniep diff ...` (the same as uniep-diff)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("tune", "diff"):
        print("usage: uniep {tune,diff} ...   (uniep tune --help)", file=sys.stderr)
        return 2
    return tune_main(argv[1:]) if argv[0] == "tune" else main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
