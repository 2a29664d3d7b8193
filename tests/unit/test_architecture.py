"""The house rules of services/, checked on the source: no import cycles; services meet only
through protos/ (the generated code in services/common) and services/common; tools reach a
service only through its public modules; the scheduler core imports no I/O."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.import_graph import cycles, external_imports, import_graph, module_names

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"gateway", "tokenizer", "scheduler", "worker", "embedder", "profiler", "supervisor",
            "kvstore"}
LIBRARIES = {"common", "models"}       # shared code, no service of its own
TOOLS = {"cli", "benchmark"}           # launchers and load generators
# What a tool may import from a service: its entry point, its config and the flags or launch
# helpers it publishes for launchers. Everything else is the service's own business.
PUBLIC = ("", ".main", ".config", ".flags", ".launch")
# The scheduler core is a pure state machine: values in, values out.
PURE_STDLIB = {"__future__", "abc", "bisect", "collections", "collections.abc", "dataclasses", "enum",
               "functools", "hashlib", "heapq", "itertools", "math", "typing"}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def boundary_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in graph.items():
        own = _package(module)
        for dep in deps:
            other = _package(dep)
            if other in ("", own, "common"):
                continue
            if own in SERVICES or own == "common":
                bad.append(f"{module} -> {dep}: a service meets others only through protos/ and services/common")
            elif own == "models" and other != "models":
                bad.append(f"{module} -> {dep}: services/models is a library and imports no service")
            elif own in TOOLS and other in SERVICES and not any(dep == f"services.{other}{p}" for p in PUBLIC):
                bad.append(f"{module} -> {dep}: tools use a service's main/config/flags/launch only")
    return sorted(bad)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, "services")


def test_services_have_no_import_cycles(graph):
    assert len(graph) > 100  # the whole tree was read
    assert cycles(graph) == []


def test_services_meet_only_through_protos_and_common(graph):
    packages = {_package(m) for m in graph} - {""}
    assert packages <= SERVICES | LIBRARIES | TOOLS, f"classify new packages: {packages - SERVICES - LIBRARIES - TOOLS}"
    assert boundary_violations(graph) == []


def test_scheduler_core_imports_no_io():
    core = module_names(ROOT, "services.scheduler.core")
    assert core
    for name, path in core.items():
        for imported in external_imports(path):
            assert imported in PURE_STDLIB or imported.startswith("services.scheduler.core"), \
                f"{name} imports {imported}: the scheduler core does no I/O (no sockets, threads, clocks)"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_a_cycle_a_lazy_import_and_a_reach_into_internals(tmp_path):
    _write(tmp_path, {
        "services/__init__.py": "",
        "services/common/__init__.py": "",
        "services/common/util.py": "X = 1\n",
        "services/gateway/__init__.py": "",
        "services/gateway/a.py": "from services.gateway.b import B\n",
        "services/gateway/b.py": "def f():\n    from .a import A  # lazy, still a cycle\n",
        "services/gateway/config.py": "from services.common.util import X\n",
        "services/worker/__init__.py": "",
        "services/worker/run.py": "import services.gateway.a\n",
        "services/cli/__init__.py": "",
        "services/cli/main.py": "from services.gateway import config\nfrom services.gateway.b import f\n",
    })
    g = import_graph(tmp_path, "services")
    assert cycles(g) == [["services.gateway.a", "services.gateway.b"]]
    assert boundary_violations(g) == [
        "services.cli.main -> services.gateway.b: tools use a service's main/config/flags/launch only",
        "services.worker.run -> services.gateway.a: a service meets others only through protos/ and services/common",
    ]
