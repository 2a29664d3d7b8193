"""Programmatic dependent launch (kernels/pdl.py): off wherever it cannot apply, and every forward
kernel that can be launched with it waits for the previous kernel before touching memory."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

from services.worker.kernels import pdl

KERNELS = Path(__file__).resolve().parents[2] / "services" / "worker" / "kernels"


def test_launch_args_are_off_on_the_cpu_and_when_disabled(monkeypatch):
    assert pdl.launch_args(torch.zeros(1)) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.enabled(torch.zeros(1))


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            out[node.name] = node
    return out


def _launches(tree: ast.Module) -> list[tuple[str, ast.Call]]:
    """kernel[grid](...) calls: (kernel name, call)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name):
            found.append((node.func.value.id, node))
    return found


def test_every_launched_kernel_waits_first_and_every_launch_passes_the_pdl_arguments():
    trees = {p.name: ast.parse(p.read_text()) for p in KERNELS.glob("*.py")}
    kernels = {name: fn for t in trees.values() for name, fn in _jit_kernels(t).items()}
    launched = set()
    for fname, tree in trees.items():
        for name, call in _launches(tree):
            if name not in kernels:
                continue
            launched.add(name)
            spread = [k.value for k in call.keywords if k.arg is None]
            assert any(isinstance(v, ast.Call) and ast.unparse(v.func) == "launch_args" for v in spread), \
                f"{fname}: {name} is launched without **launch_args(...)"
    assert {"_paged_attn_kernel", "gemv_kernel", "_add_rms_norm_kernel", "_qkv_prep_kernel"} <= launched
    for name in launched:
        fn = kernels[name]
        assert "USE_PDL" in [a.arg for a in fn.args.args], name
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
            else fn.body
        if name in WEIGHTS_BEFORE_WAIT:
            _check_weights_only_before_the_wait(fn)
        else:
            assert ast.unparse(body[0]) == "wait_prior(USE_PDL)", f"{name} does not wait for the previous kernel first"


# Kernels that may load their weights (which no kernel writes) before the wait, and nothing else.
WEIGHTS_BEFORE_WAIT = {"gemv_kernel": {"w_ptr"}}


def _check_weights_only_before_the_wait(fn: ast.FunctionDef) -> None:
    """Every tl.load / tl.store before the function's wait_prior call reads a weight pointer."""
    waits = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == "wait_prior"]
    assert len(waits) == 1, f"{fn.name}: one wait_prior"
    wait_line = waits[0].lineno
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("tl.load", "tl.store", "tl.atomic_add") \
                and node.lineno < wait_line:
            names = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
            assert ast.unparse(node.func) == "tl.load" and names & WEIGHTS_BEFORE_WAIT[fn.name], \
                f"{fn.name} touches {ast.unparse(node.args[0])} before waiting for the previous kernel"

