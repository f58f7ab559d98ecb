"""The graph-diff report: explain(), its JSON and HTML, and the uniep-diff command."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import uniep_dynamo
from uniep_dynamo.cli import main as uniep_diff
from uniep_dynamo.explain import collapse_modules
from uniep_dynamo.report import GraphRecord

HERE = os.path.dirname(__file__)


def tiny_mixtral():
    from hf_models import build_model
    return build_model("mixtral")


def test_explain_full_match_json():
    model = tiny_mixtral()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    report = uniep_dynamo.explain(model, input_ids=ids, labels=ids)
    data = json.loads(report.to_json())
    assert data["totals"] == {"moe_experts": 2, "moe_router": 2, "ep_dispatch": 0, "ep_exchange": 0, "ep_combine": 0,
                              "unfused": 0,
                              "router_unmatched": 0, "ep_unmatched": 0, "all_to_all_unmatched": 0, "ep_layer": 0}
    (graph,) = data["graphs"]
    assert graph["traced_ops"] == {}  # the router and experts ops are rewrites, not traced ops
    assert [(r["op"], r["module"]) for r in graph["rewrites"]] == [
        ("moe_experts", "model.layers.0.mlp.experts"), ("moe_experts", "model.layers.1.mlp.experts"),
        ("moe_router", "model.layers.0.mlp.gate"), ("moe_router", "model.layers.1.mlp.gate")]
    assert graph["aot_graphs"]["forward"] == {"moe_experts": 2, "moe_router": 2}
    assert graph["aot_graphs"]["backward"] == {"moe_experts_backward": 2, "moe_experts_backward_combine": 2,
                                               "moe_router_backward": 2}
    assert graph["coverage_gaps"] == []
    before_ids = {n["id"] for n in graph["before"]}
    after_ids = {n["id"] for n in graph["after"]}
    for rewrite in graph["rewrites"]:
        assert set(rewrite["replaced"]) <= before_ids and not set(rewrite["replaced"]) & after_ids
        assert set(rewrite["added"]) <= after_ids
    assert all(p.grad is None for p in model.parameters()), "explain leaves .grad as it found it"
    assert "model.layers.{0-1}.mlp.experts (same match)" in report.summary()
    assert "model.layers.{0-1}.mlp.gate (same match): router (softmax_topk)" in report.summary()


def test_node_ids_are_stable_between_runs():
    model = tiny_mixtral()
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    first = uniep_dynamo.explain(model, input_ids=ids).data
    second = uniep_dynamo.explain(model, input_ids=ids).data
    assert [n["id"] for n in first["graphs"][0]["before"]] == [n["id"] for n in second["graphs"][0]["before"]]
    assert first["graphs"][0]["rewrites"] == second["graphs"][0]["rewrites"]


def test_near_miss_names_module_anchor_and_reason():
    from test_patterns import HandWrittenExperts, routed

    torch.manual_seed(0)
    report = uniep_dynamo.explain(HandWrittenExperts(descending=True), *routed())
    # transformers 5.17's fallback grouped-GEMM backward cannot be traced by AOTAutograd, so Dynamo
    # retries the unfused graph there and the report holds it twice; the first is the one to read.
    graph = report.data["graphs"][0]
    assert graph["rewrites"] == []
    (miss,) = graph["near_misses"]
    assert miss["pattern"] == "experts"
    assert miss["reason"] == "sort (sort): expert ids must be sorted ascending along their only dimension"
    assert (miss["expected"], miss["actual"]) == ("sort(dim=-1 or 0, descending=False)", "sort(dim=-1, descending=True)")
    assert miss["anchor"] == "h" and miss["module"] == "<root module>"
    assert miss["matched_nodes"] > 0 and miss["rejections"][0] == miss["reason"] and len(miss["rejections"]) > 1
    summary = report.summary()
    assert "unfused <root module> (at h, " in summary
    assert "expected sort(dim=-1 or 0, descending=False), got sort(dim=-1, descending=True)" in summary


def test_unmatched_router_is_a_near_miss_of_the_router_pattern():
    from test_router import HandRouter

    torch.manual_seed(0)
    data = uniep_dynamo.explain(HandRouter("smallest"), torch.randn(4, 16)).data
    (miss,) = [m for m in data["graphs"][0]["near_misses"] if m["pattern"] == "router"]
    assert miss["anchor"] == "topk" and "top-k of the smallest scores" in miss["reason"]
    assert data["totals"]["router_unmatched"] == 1 and data["totals"]["moe_router"] == 0


def test_coverage_gap_is_flagged():
    from uniep_dynamo.report import Rewrite

    rewrite = Rewrite("moe_experts", "m", "grouped_mm", "", [], [])
    record = GraphRecord("0/0", rewrites=[rewrite, rewrite],
                         aot_graphs={"forward": {"moe_experts": 2}, "backward": {"moe_experts_backward": 1}})
    assert record.coverage_gaps() == ["backward graph holds 1 uniep.moe_experts_backward for 2 rewrites"]


def test_frozen_layer_expects_no_backward_op():
    """Partial fine-tuning: layer 0 and the embeddings frozen, so layer 0's router and experts read no tensor that
    requires grad and AOTAutograd's backward holds one experts backward, not two. That is no coverage gap (it was
    reported as one); a trainable layer's missing backward op still is."""
    from uniep_dynamo.report import Rewrite

    model = tiny_mixtral()
    for name, p in model.named_parameters():
        if "embed" in name or ".layers.0." in name:
            p.requires_grad_(False)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    report = uniep_dynamo.explain(model, input_ids=ids, labels=ids)
    assert "rewrote model.layers.0.mlp.experts: " in report.summary()
    assert "(reads no tensor that requires grad, or runs with grad mode off: no backward op)" in report.summary().split(
        "rewrote model.layers.0.mlp.experts: ")[1].splitlines()[0]
    (graph,) = json.loads(report.to_json())["graphs"]
    assert {r["module"]: r["needs_grad"] for r in graph["rewrites"]} == {
        "model.layers.0.mlp.experts": False, "model.layers.1.mlp.experts": True,
        "model.layers.0.mlp.gate": False, "model.layers.1.mlp.gate": True}
    assert graph["aot_graphs"]["forward"] == {"moe_experts": 2, "moe_router": 2}
    assert graph["aot_graphs"]["backward"]["moe_experts_backward"] == 1
    assert graph["coverage_gaps"] == []
    trainable = Rewrite("moe_experts", "m", "grouped_mm", "", [], [])
    frozen = Rewrite("moe_experts", "m", "grouped_mm", "", [], [], needs_grad=False)
    missing = GraphRecord("0/0", rewrites=[trainable, frozen],
                          aot_graphs={"forward": {"moe_experts": 2}, "backward": {}})
    assert missing.coverage_gaps() == ["backward graph holds 0 uniep.moe_experts_backward for 1 rewrites needing a "
                                       "gradient"]
    # DDP's optimizer split the graph: the frozen layer's piece traced as inference, the other as forward
    pieces = GraphRecord("0/0", rewrites=[trainable, frozen], aot_graphs={
        "inference": {"moe_experts": 1}, "forward": {"moe_experts": 1}, "backward": {"moe_experts_backward": 1}})
    assert pieces.coverage_gaps() == []
    layers = GraphRecord("2/0", traced_ops={"ep_layer": 2}, traced_without_grad={"ep_layer": 1},
                         aot_graphs={"forward": {"ep_layer": 2}, "backward": {"ep_layer_backward": 1}})
    assert layers.coverage_gaps() == []
    layers.aot_graphs["backward"] = {}
    assert layers.coverage_gaps() == ["backward graph holds 0 uniep.ep_layer_backward for 1 traced uniep.ep_layer "
                                      "needing a gradient"]


def test_experts_taken_into_an_ep_exchange_are_covered():
    """Plain PyTorch EP: the experts rewrite runs inside uniep.ep_exchange (and its backward inside the exchange's
    backward), so the graphs holding the exchange ops are no gap; missing them is."""
    from uniep_dynamo.report import Rewrite

    rewrites = [Rewrite(op, "m", "", "", [], []) for op in ("moe_experts", "ep_exchange")]
    covered = GraphRecord("1/0", rewrites=rewrites, aot_graphs={"forward": {"ep_exchange": 1, "ep_combine": 1},
                                                                "backward": {"ep_exchange_backward": 1}})
    assert covered.coverage_gaps() == []
    missing = GraphRecord("1/0", rewrites=rewrites, aot_graphs={"forward": {"ep_exchange": 1}, "backward": {}})
    assert missing.coverage_gaps() == ["backward graph holds 0 uniep.moe_experts_backward and 0 "
                                       "uniep.ep_exchange_backward for 1 rewrites"]
    # an exchange op does not stand in for experts that no exchange took in
    alone = GraphRecord("1/0", rewrites=rewrites[:1], aot_graphs={"forward": {"ep_exchange": 1}})
    assert alone.coverage_gaps() == ["forward graph holds 0 uniep.moe_experts for 1 rewrites"]
    # the layer in one graph (split sizes traced): its exchange became part of a rewritten uniep.ep_layer, which holds
    # the experts, and whose backward op the backward graph must hold
    layer = [Rewrite(op, "m", "", "", [], []) for op in ("moe_experts", "ep_layer")]
    covered = GraphRecord("1/0", rewrites=layer, aot_graphs={"forward": {"ep_layer": 1},
                                                             "backward": {"ep_layer_backward": 1}})
    assert covered.coverage_gaps() == []
    missing = GraphRecord("1/0", rewrites=layer, aot_graphs={"forward": {"ep_layer": 1}, "backward": {}})
    assert missing.coverage_gaps() == [
        "backward graph holds 0 uniep.moe_experts_backward and 0 uniep.ep_layer_backward for 1 rewrites",
        "backward graph holds 0 uniep.ep_layer_backward for 1 traced uniep.ep_layer"]


def test_hf_ep_layers_traced_as_the_op_are_checked_in_both_graphs():
    """HF's EP layers are traced as uniep.ep_layer (no rewrite record, traced_ops counts them): a forward graph without
    the op, or a backward graph without its backward op, is a gap; a record with no backward graph checks the
    forward only."""
    traced = {"ep_layer": 2, "moe_router": 0}
    covered = GraphRecord("2/0", traced_ops=traced, aot_graphs={"forward": {"ep_layer": 2, "moe_router": 2},
                                                                "backward": {"ep_layer_backward": 2}})
    assert covered.coverage_gaps() == []
    short = GraphRecord("2/0", traced_ops=traced, aot_graphs={"forward": {"ep_layer": 2}, "backward": {}})
    assert short.coverage_gaps() == ["backward graph holds 0 uniep.ep_layer_backward for 2 traced uniep.ep_layer"]
    inference = GraphRecord("2/0", traced_ops=traced, aot_graphs={"inference": {"ep_layer": 1}})
    assert inference.coverage_gaps() == ["forward graph holds 1 uniep.ep_layer for 2 traced uniep.ep_layer"]
    assert GraphRecord("2/0", traced_ops=traced).coverage_gaps() == []  # no AOT graph traced: nothing to check


def test_collapse_identical_layers():
    assert collapse_modules([f"model.layers.{i}.mlp.experts" for i in range(32)]) == "model.layers.{0-31}.mlp.experts"
    assert collapse_modules(["a.0.x", "a.2.x"]) == "a.{0,2}.x"
    assert collapse_modules(["a.x", "b.y"]) == "a.x, b.y"


SCRIPT = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, {tests!r})
    from hf_models import build_model
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (1, 8))
    torch.compile(model, backend="uniep", options={{"inner_backend": "eager"}})(input_ids=ids)
''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(tests=HERE))
    return str(path)


def test_cli_expect_passes_and_fails(script, tmp_path, capsys):
    out_json, out_html = str(tmp_path / "r.json"), str(tmp_path / "r.html")
    assert uniep_diff(["--expect", "moe_experts=2", "--json", out_json, "--html", out_html, script]) == 0
    assert json.load(open(out_json))["totals"]["moe_experts"] == 2
    assert "uniep: 2 rewrite(s)" in capsys.readouterr().out
    torch._dynamo.reset()
    assert uniep_diff(["--expect", "moe_experts=3", script]) == 1
    assert "expected 3, got 2" in capsys.readouterr().err


def test_html_is_self_contained_and_marks_regions(tmp_path):
    model = tiny_mixtral()
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    page = uniep_dynamo.explain(model, input_ids=ids).to_html()
    assert "<script src" not in page and "http://" not in page and "https://" not in page
    assert page.count('class="side before"') == 1 and page.count('class="side after"') == 1
    assert "background:#cfe8ff" in page and "model.layers.0.mlp.experts" in page
    assert 'title="model.layers.0.mlp.experts: replaces sample_weights, ' in page  # op call -> replaced nodes


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_html_loads_in_headless_chromium(tmp_path):
    """The page renders from a file with no console errors; the DOM holds both graphs and the regions."""
    model = tiny_mixtral()
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "report.html"
    uniep_dynamo.explain(model, input_ids=ids).to_html(str(path))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'ud'}",
             "--enable-logging=stderr", "--v=0"]
    done = subprocess.run([CHROMIUM, *flags, "--dump-dom", path.as_uri()], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'class="side before"' in dom and 'class="side after"' in dom
    assert "background:#cfe8ff" in dom and "2 experts and 2 router rewrite(s)" in dom
    console_errors = [line for line in done.stderr.splitlines() if "CONSOLE" in line and "ERROR" in line.upper()]
    assert not console_errors, console_errors
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1400,900", path.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


def test_report_is_a_structured_trace_artifact(tmp_path):
    """With TORCH_TRACE set, tlparse finds the report beside inductor's artifacts, explain() or not."""
    code = textwrap.dedent('''
        import torch, uniep_dynamo
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
        cfg._experts_implementation = "grouped_mm"
        block = MixtralSparseMoeBlock(cfg)
        torch.compile(block, backend="uniep", options={"inner_backend": "eager"})(torch.randn(1, 5, 16))
    ''')
    env = dict(os.environ, TORCH_TRACE=str(tmp_path / "trace"))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=300)
    logs = "".join(p.read_text() for p in (tmp_path / "trace").iterdir())
    assert '"name": "uniep_report"' in logs


def test_aot_counts_add_up_over_the_pieces_of_a_split_graph():
    """DDP's optimizer splits one Dynamo graph into pieces that share its record (uniep_dynamo/ddp.py): each piece's
    forward and backward graph adds its uniep ops to the record, so no piece's count hides another's."""
    def graph_with(*ops):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        for op in ops:
            graph.call_function(op, (x,))
        graph.output(x)
        return graph

    record = GraphRecord("0/0")
    record.note_aot_graph("forward", graph_with(torch.ops.uniep.moe_experts.default))
    record.note_aot_graph("forward", graph_with(torch.ops.uniep.moe_experts.default, torch.ops.uniep.moe_router.default))
    assert record.aot_graphs["forward"] == {"moe_experts": 2, "moe_router": 1}
