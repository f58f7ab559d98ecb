"""uniep-diff: run a script (or module) that compiles with backend="uniep" and report what was rewritten.

    uniep-diff train.py --steps 1                       # terminal summary
    uniep-diff --html report.html --json report.json train.py
    uniep-diff --expect moe_experts=32 -m mypkg.train   # exit 1 unless exactly 32 rewrites
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


if __name__ == "__main__":
    sys.exit(main())
