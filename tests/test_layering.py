"""The package's layering (issue 40), read from every module's imports with ast: no import goes back up the pipeline.

Layers, top to bottom; a module imports modules of its own layer and the layers below, never above:

    front       the package, backend, capture, checkpoint_effects, cli, ddp, explain, report: what users and
                torch.compile call
    tuner       the parameter search (it runs the ops and writes the tuning cache)
    lowering    region -> op call (it consumes the patterns' matches, so it sits above them)
    patterns    the MoE region matchers
    ops         the torch.ops.uniep experts and router ops
    ep          expert parallelism (uniep_dynamo/ep/)
    spec        the ops' spec strings
    kernels     Triton kernels and the pure-PyTorch reference
    base        the tuning cache on disk and the version: what the kernels read without importing the tuner

Within ep/, each module imports only the ep modules before it in EP_ORDER. A private name (``_x``) of a module is
used only in its own layer, and within ep/ only in its own module: what another layer needs is a public API.
Lazy imports inside functions count the same as module-level ones.
"""
import ast
import pathlib

import pytest

PACKAGE = "uniep_dynamo"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE

LAYERS = [  # (layer, module prefixes): a prefix names a module and, for a package, everything under it
    ("front", ("uniep_dynamo.__init__", "uniep_dynamo.backend", "uniep_dynamo.capture",
               "uniep_dynamo.checkpoint_effects", "uniep_dynamo.cli", "uniep_dynamo.ddp",
               "uniep_dynamo.explain", "uniep_dynamo.hf_ep", "uniep_dynamo.report")),
    ("tuner", ("uniep_dynamo.tuner",)),
    ("lowering", ("uniep_dynamo.lowering",)),
    ("patterns", ("uniep_dynamo.patterns",)),
    ("ops", ("uniep_dynamo.ops",)),
    ("ep", ("uniep_dynamo.ep",)),
    ("spec", ("uniep_dynamo.spec",)),
    ("kernels", ("uniep_dynamo.kernels",)),
    ("base", ("uniep_dynamo.tuning_cache", "uniep_dynamo.version")),
]
EP_ORDER = ["processes", "config", "plan", "sequential", "layout", "transfer", "chunks", "pipeline", "overlap",
            "exchange", "custom_ops", "device_pipeline", "device_plan", "device_choice", "layer"]


def _modules() -> dict:
    """{dotted module name: path} of every module of the package (a package's __init__ as ``pkg.__init__``)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE,) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts)] = path
    return out


MODULES = _modules()
assert len(MODULES) > 20, f"found only {len(MODULES)} modules under {ROOT}"


def _target(name: str) -> str | None:
    """The module that importing dotted ``name`` loads last: the module itself, or a package's __init__."""
    if name in MODULES:
        return name
    if name + ".__init__" in MODULES:
        return name + ".__init__"
    return None


def _imports(module: str):
    """(imported module, line, private names used from it) for every import of a package module in ``module``."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module.rsplit(".", 1)[0]  # the package a relative import starts from (also for an __init__)
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _target(alias.name)
                if target is not None:
                    found.append((target, node.lineno, []))
                    if alias.asname:
                        aliases[alias.asname] = target
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith(PACKAGE):
                continue
            for alias in node.names:
                submodule = _target(f"{source}.{alias.name}")
                if submodule is not None:  # ``from pkg import module``
                    found.append((submodule, node.lineno, []))
                    aliases[alias.asname or alias.name] = submodule
                else:  # ``from module import name``
                    private = [alias.name] if alias.name.startswith("_") and not alias.name.startswith("__") else []
                    found.append((_target(source), node.lineno, private))
    for node in ast.walk(tree):  # module._private
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append((aliases[node.value.id], node.lineno, [node.attr]))
    return found


def _layer(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    return best[0] if best is not None else None


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if _layer(m) is None]
    assert not unplaced, f"modules in no layer of tests/test_layering.py (place them): {unplaced}"


def test_no_import_goes_up_the_pipeline():
    ups = []
    for module in MODULES:
        mine = _layer(module)
        for target, line, _ in _imports(module):
            theirs = _layer(target)
            if mine is not None and theirs is not None and theirs < mine:
                ups.append(f"{module}:{line} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not ups, "imports back up the pipeline:\n" + "\n".join(ups)


def test_ep_modules_import_only_the_ones_before_them():
    assert sorted(EP_ORDER) == sorted(m.rsplit(".", 1)[1] for m in MODULES
                                      if m.startswith("uniep_dynamo.ep.") and not m.endswith("__init__"))
    wrong = []
    for i, name in enumerate(EP_ORDER):
        for target, line, _ in _imports(f"uniep_dynamo.ep.{name}"):
            if target.startswith("uniep_dynamo.ep.") and target.rsplit(".", 1)[1] not in EP_ORDER[:i]:
                wrong.append(f"ep/{name}.py:{line} imports {target}")
    assert not wrong, "ep/ modules importing one after them in EP_ORDER:\n" + "\n".join(wrong)


def test_private_names_stay_in_their_layer():
    """A layer's private names stay in the layer (ep/'s in their module): the MegaKernel's API for the EP
    pipeline (Layer, rows_gemm, act_backward, weight_grad, warn_once) is public."""
    crossings = []
    for module in MODULES:
        for target, line, private in _imports(module):
            if not private or target == module:
                continue
            other_layer = _layer(target) != _layer(module)
            ep_files = target.startswith("uniep_dynamo.ep.") and module.startswith("uniep_dynamo.ep.")
            if other_layer or ep_files:
                crossings.append(f"{module}:{line} uses {target}.{', '.join(private)}")
    assert not crossings, "private names used outside their layer:\n" + "\n".join(crossings)


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("uniep_dynamo.ep.")])
def test_each_ep_module_says_what_it_owns_and_stays_small(module):
    tree = ast.parse(MODULES[module].read_text())
    assert ast.get_docstring(tree), f"{module} has no module docstring"
    assert len(MODULES[module].read_text().splitlines()) <= 400, f"{module} is over 400 lines"


def test_the_package_imports_without_triton():
    """The reference kernels run where Triton is not installed: importing the package, its EP ops included, imports
    no Triton module (each Triton kernel's module is imported where it runs). Checked in a fresh interpreter with
    Triton's import refused."""
    import os
    import subprocess
    import sys

    code = ("import builtins, sys\n"
            "real = builtins.__import__\n"
            "def refuse(name, *a, **k):\n"
            "    if name == 'triton' or name.startswith('triton.'):\n"
            "        raise ImportError('triton refused')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = refuse\n"
            "import uniep_dynamo, uniep_dynamo.ep, uniep_dynamo.ep.device_plan\n"
            "assert not [m for m in sys.modules if m == 'triton' or m.startswith('triton.')]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "UNIEP_KERNELS": "reference"})
    assert done.returncode == 0, done.stderr[-2000:]
