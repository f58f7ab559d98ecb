"""`uniep_dynamo.explain(model, *args)`: compile, run, and report what uniep rewrote and why not.

    report = uniep_dynamo.explain(model, input_ids=ids)
    print(report)                 # terminal summary
    report.to_json("report.json") # the machine-readable twin
    report.to_html("report.html") # before/after graphs side by side, regions coloured, near misses

explain() resets Dynamo's caches (it needs fresh compiles), compiles with uniep over AOTAutograd so
the forward and backward graphs can be checked for the uniep ops, runs the model once, and (if the
output needs grad) backward once, leaving the parameters' .grad as it found them.
"""
from __future__ import annotations

import html
import json

import torch

from .report import Recorder, recording
from .spec import ROUTER_MODES


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    for key in ("loss", "logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)):
        for item in out:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(out, dict):
        for item in out.values():
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def explain(model, *args, options: dict | None = None, backward: bool = True, **kwargs) -> "Report":
    torch._dynamo.reset()
    opts = {"inner_backend": "aot_eager", **(options or {})}
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    saved_grads = [p.grad for p in params]
    with recording() as recorder:
        out = torch.compile(model, backend="uniep", options=opts)(*args, **kwargs)
        tensor = _first_tensor(out)
        if backward and tensor is not None and tensor.requires_grad:
            tensor.float().sum().backward()
    for p, grad in zip(params, saved_grads):
        p.grad = grad
    return Report(recorder.to_dict())


def collapse_modules(modules: list[str]) -> str:
    """model.layers.0.mlp.experts, model.layers.1.mlp.experts -> model.layers.{0-1}.mlp.experts"""
    if len(modules) <= 1:
        return ", ".join(modules)
    parts = [m.split(".") for m in modules]
    if len({len(p) for p in parts}) == 1:
        differing = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
        if len(differing) == 1 and all(p[differing[0]].isdigit() for p in parts):
            i = differing[0]
            numbers = sorted(int(p[i]) for p in parts)
            span = f"{numbers[0]}-{numbers[-1]}" if numbers == list(range(numbers[0], numbers[-1] + 1)) else \
                ",".join(map(str, numbers))
            return ".".join(parts[0][:i] + ["{" + span + "}"] + parts[0][i + 1:])
    return ", ".join(modules)


class Report:
    def __init__(self, data: dict):
        self.data = data

    @classmethod
    def from_recorder(cls, recorder: Recorder) -> "Report":
        return cls(recorder.to_dict())

    @property
    def totals(self) -> dict:
        return self.data["totals"]

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.data, indent=1, sort_keys=True)
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def summary(self) -> str:
        t = self.totals
        ep = "".join(f", {t[op]} ({op})" for op in ("ep_dispatch", "ep_exchange", "ep_combine") if t.get(op))
        if t.get("ep_layer"):  # HF's AllToAllEP layers traced as one op (hf_ep.py), and plain EP layers in one graph
            ep += f", {t['ep_layer']} EP layer(s) as one uniep.ep_layer"
        lines = [f"uniep: {t['moe_experts']} rewrite(s) (moe_experts), {t.get('moe_router', 0)} (moe_router){ep}, "
                 f"{t['unfused']} unfused, "
                 f"{len(self.data['graphs'])} graph(s)"]
        for g in self.data["graphs"]:
            lines.append(f"graph {g['compile_id']}: {len(g['before'])} -> {len(g['after'])} nodes")
            groups: dict = {}
            for r in g["rewrites"]:
                key = (r["op"], r["spelling"], r["spec"], len(r["replaced"]), len(r["added"]), r.get("graph", ""),
                       r.get("needs_grad", True))
                groups.setdefault(key, []).append(r["module"])
            for (op, spelling, spec, removed, added, body, needs_grad), modules in groups.items():
                same = " (same match)" if len(modules) > 1 else ""
                what = f"router ({spelling})" if spelling in ROUTER_MODES else \
                    f"uniep.{op} ({spelling})" if op.startswith("ep_") else f"{spelling} spelling"
                inside = f" in {body}" if body else ""
                frozen = "" if needs_grad else \
                    " (reads no tensor that requires grad, or runs with grad mode off: no backward op)"
                lines.append(f"  rewrote {collapse_modules(modules)}{same}{inside}: {what}, "
                             f"-{removed}/+{added} nodes each [{spec}]{frozen}")
            if g["aot_graphs"] is not None:
                lines.append("  " + "; ".join(f"{kind} graph: " + (", ".join(f"{n} uniep.{op}" for op, n in ops.items())
                                                                  or "no uniep op")
                                              for kind, ops in g["aot_graphs"].items()))
            others = {}
            for m in g["near_misses"]:
                if m["pattern"] != "experts":
                    others.setdefault(m["pattern"], []).append(m)
            for miss in g["near_misses"]:
                if miss["pattern"] != "experts":
                    continue
                lines.append(f"  unfused {miss['module']} (at {miss['anchor']}, {miss['matched_nodes']} nodes matched): "
                             f"{miss['reason']}")
                if miss["expected"] is not None:
                    lines.append(f"    expected {miss['expected']}, got {miss['actual']}")
                for other in miss["rejections"][1:]:
                    lines.append(f"    also: {other}")
            for pattern, found in others.items():
                lines.append(f"  {pattern} not matched: {collapse_modules([m['module'] for m in found])} "
                             f"({found[0]['reason']})")
            for gap in g["coverage_gaps"]:
                lines.append(f"  COVERAGE GAP: {gap}")
        return "\n".join(lines)

    __str__ = summary

    def to_html(self, path: str | None = None) -> str:
        text = render_html(self.data)
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text


_PALETTE = ["#cfe8ff", "#d8f5d0", "#ffe7c2", "#f0d9ff", "#fff6b3", "#d1f2f0"]


def _node_rows(nodes, colour_of, title_of) -> str:
    rows = []
    for n in nodes:
        if n["op"] == "placeholder":
            continue  # graph inputs are listed once, above the tables
        colour = colour_of.get(n["id"])
        style = f' style="background:{colour}"' if colour else ""
        title = title_of.get(n["id"])
        title_attr = f' title="{html.escape(title)}"' if title else ""
        cls = ' class="miss"' if n["id"] in title_of and not colour else ""
        rows.append(f'<tr id="n-{html.escape(n["id"])}"{style}{title_attr}{cls}><td>{html.escape(n["id"])}</td>'
                    f'<td>{html.escape(n["target"])}</td><td>{html.escape(", ".join(n["args"]))}</td>'
                    f'<td>{html.escape(n["module"])}</td><td>{html.escape(n["source"])}</td></tr>')
    return "\n".join(rows)


def render_html(data: dict) -> str:
    """One self-contained page: no scripts from elsewhere, no server."""
    sections = []
    for gi, g in enumerate(data["graphs"]):
        before_colour, after_colour, titles, after_titles = {}, {}, {}, {}
        legend = []
        for ri, r in enumerate(g["rewrites"]):
            colour = _PALETTE[ri % len(_PALETTE)]
            for node_id in r["replaced"]:
                before_colour[node_id] = colour
                titles[node_id] = f"rewritten into uniep.{r['op']} ({r['module']})"
            for node_id in r["added"]:
                after_colour[node_id] = colour
                after_titles[node_id] = f"{r['module']}: replaces {', '.join(r['replaced'])}"
            first = html.escape(r["replaced"][0]) if r["replaced"] else ""
            legend.append(f'<li><span class="swatch" style="background:{colour}"></span>'
                          f'<a href="#n-{first}">{html.escape(r["module"])}</a>'
                          f'{" in " + html.escape(r["graph"]) if r.get("graph") else ""}: '
                          f'{html.escape(r["spelling"])} spelling, {len(r["replaced"])} nodes &rarr; '
                          f'{len(r["added"])} <code>{html.escape(r["spec"])}</code></li>')
        misses = []
        for m in g["near_misses"]:
            titles.setdefault(m["anchor"], f"near miss ({m['pattern']}): {m['reason']}")
            detail = ""
            if m["expected"] is not None:
                detail = (f"<br>expected <code>{html.escape(m['expected'])}</code>, "
                          f"got <code>{html.escape(m['actual'])}</code>")
            others = "".join(f"<br>also: {html.escape(r)}" for r in m["rejections"][1:])
            misses.append(f'<li>{html.escape(m["pattern"])} pattern: <a href="#n-{html.escape(m["anchor"])}">'
                          f'{html.escape(m["anchor"])}</a> in {html.escape(m["module"])} '
                          f'({m["matched_nodes"]} nodes matched): {html.escape(m["reason"])}{detail}{others}</li>')
        coverage = ""
        if g["aot_graphs"] is not None:
            coverage = "<p>" + "; ".join(f"{html.escape(kind)} graph: " + html.escape(json.dumps(ops))
                                         for kind, ops in g["aot_graphs"].items()) + "</p>"
        gaps = "".join(f'<p class="gap">coverage gap: {html.escape(x)}</p>' for x in g["coverage_gaps"])
        header = "<tr><th>node</th><th>op</th><th>args</th><th>module</th><th>source</th></tr>"
        inputs = [n["id"] for n in g["before"] if n["op"] == "placeholder"]
        inputs_html = (f"<details><summary>{len(inputs)} graph inputs</summary><p><code>"
                       f"{html.escape(', '.join(inputs))}</code></p></details>")
        sections.append(f"""
<section id="graph-{gi}">
<h2>graph {html.escape(g['compile_id'])}: {len(g['before'])} &rarr; {len(g['after'])} nodes</h2>
<ul class="legend">{''.join(legend) or '<li>no rewrite</li>'}</ul>
{coverage}{gaps}
<h3>near misses</h3><ul class="misses">{''.join(misses) or '<li>none</li>'}</ul>
{inputs_html}
<div class="sides">
<div class="side before"><h3>before</h3><table>{header}{_node_rows(g['before'], before_colour, titles)}</table></div>
<div class="side after"><h3>after</h3><table>{header}{_node_rows(g['after'], after_colour, after_titles)}</table></div>
</div>
</section>""")
    totals = data["totals"]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>uniep report</title>
<style>
body {{ font: 13px/1.4 system-ui, sans-serif; margin: 1em; }}
.sides {{ display: flex; gap: 1em; }} .side {{ flex: 1; overflow-x: auto; }}
table {{ border-collapse: collapse; width: 100%; }} td, th {{ border-bottom: 1px solid #ddd; padding: 1px 4px;
  text-align: left; white-space: nowrap; font-family: ui-monospace, monospace; font-size: 12px; }}
.swatch {{ display: inline-block; width: 1em; height: 1em; margin-right: .4em; vertical-align: middle; }}
tr.miss {{ outline: 2px solid #d33; }} .gap {{ color: #b00; font-weight: bold; }}
</style></head><body>
<h1>uniep report</h1>
<p id="totals">{totals['moe_experts']} experts and {totals.get('moe_router', 0)} router rewrite(s), {totals.get('ep_dispatch', 0)} EP dispatch, {totals.get('ep_exchange', 0)} EP exchange and {totals.get('ep_combine', 0)} EP combine rewrite(s), {totals.get('ep_layer', 0)} EP layer(s) as one uniep.ep_layer, {totals['unfused']} unfused, {len(data['graphs'])} graph(s);
uniep {html.escape(str(data['uniep']))}, torch {html.escape(str(data['torch']))}</p>
{''.join(sections)}
</body></html>
"""
