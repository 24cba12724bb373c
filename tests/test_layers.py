"""The house's walls, checked on the import graph (every import, top-level or inside a function).

    pdd/              the command line, launcher, embedded servers  may import anything
    sim/              the simulator                                 benchmarks (the same workloads, stats
                                                                    and reports as live runs), shared,
                                                                    the scheduler's pure modules
    benchmarks/       live runs and micro-benchmarks                shared, the scheduler's pure modules,
                                                                    pdd below its command line (the
                                                                    launcher, certs, embedded servers),
                                                                    services.wanlink (they drive the
                                                                    emulated line); never sim
    services/X/       one process each                              shared, its own package only
    services/wanlink/ the WAN emulator                              imported by no other service and
                                                                    nothing in shared: pdd starts it,
                                                                    benchmarks drive it
    shared/           what two or more processes use                nothing above it
    shared/runtime/   the model runtime                             itself, shared.model_info,
                                                                    shared.prefix_hash, shared.messages,
                                                                    shared.pipelines (pure leaves);
                                                                    build.py, the one bridge from the
                                                                    cluster config to an engine, also
                                                                    shared.config and shared.security

Only the runtime touches KV blocks and the prefix cache: no process's code (services/, pdd/,
shared/ outside shared/runtime/) allocates, frees or caches a block, holds a block table or moves
KV in or out of a pool; they send the engine commands (`Engine.admit_with_kv`,
`export_and_release`, `extend_shadow`, `cache_events`, `flush_cache`). The benchmarks and the
simulator's measurements time the runtime's parts directly.

The scheduler's pure modules (`SCHEDULER_PURE`: its package, policy, estimates, inputs) plan on
plain data: the simulator plans with exactly them, and they import no I/O library.
Also: no module cycle anywhere; the gateway and `pdd --help` load neither torch nor transformers
(nor matplotlib).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pdd", "shared", "services", "benchmarks", "sim")
SCHEDULER_PURE = {
    "services.scheduler",
    "services.scheduler.policy",
    "services.scheduler.estimates",
    "services.scheduler.inputs",
}
# pure, and import nothing of the repo but each other (messages: the typed values the runtime shares with the wire,
# its sampling parameters, prefix-cache events and figures; pipelines: the names of roles the messages carry;
# cores: the host's board of busy instances, which the engine worker reads before each step)
RUNTIME_LEAVES = {"shared.model_info", "shared.prefix_hash", "shared.messages", "shared.pipelines", "shared.cores"}
RUNTIME_BRIDGE = {"shared.runtime.build": {"shared.config", "shared.security"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The repo module an import names (`a.b.c` or its package `a.b`), None if external."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str) -> tuple[set[str], set[str]]:
    """(repo modules, external top-level packages) that `module` imports anywhere in its body."""
    internal, external = set(), set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                internal.add(target)
            elif target is None:
                external.add(name.split(".")[0])
    return internal, external


GRAPH = {m: imports(m)[0] for m in MODULES}


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _violations(inside: tuple[str, ...], allowed) -> dict[str, list[str]]:
    """Per module under `inside`, the repo modules it imports that `allowed(module, dep)` refuses."""
    bad = {m: sorted(d for d in deps if not allowed(m, d)) for m, deps in GRAPH.items() if _under(m, *inside)}
    return {m: d for m, d in bad.items() if d}


def test_shared_imports_nothing_above_it():
    bad = {
        m: sorted(d for d in deps if not d.startswith("shared")) for m, deps in GRAPH.items() if m.startswith("shared")
    }
    assert not {m: d for m, d in bad.items() if d}


def test_no_service_imports_another_service():
    def service(m: str) -> str:
        return ".".join(m.split(".")[:2])

    bad = {
        m: sorted(d for d in deps if d.startswith("services.") and service(d) != service(m))
        for m, deps in GRAPH.items()
        if m.startswith("services.")
    }
    assert not {m: d for m, d in bad.items() if d}


def test_nothing_below_the_command_line_imports_it():
    assert not {m for m, deps in GRAPH.items() if "pdd.cli" in deps}


def test_no_import_cycle():
    """Tarjan's strongly connected components: any with two or more modules is a cycle."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert cycles == [], cycles


def test_sim_imports_benchmarks_shared_and_the_schedulers_pure_modules_only():
    assert not _violations(("sim",), lambda m, d: _under(d, "sim", "benchmarks", "shared") or d in SCHEDULER_PURE)


def test_benchmarks_import_no_service_but_the_wan_emulator_and_never_sim():
    def allowed(m: str, d: str) -> bool:
        if m == "benchmarks.fleet_pieces" and _under(d, "services.scheduler"):
            return True  # the fleet bench times the scheduler's own on_submit in process (issue #43)
        return _under(d, "benchmarks", "shared", "pdd", "services.wanlink") or d in SCHEDULER_PURE

    assert not _violations(("benchmarks",), allowed)


def test_no_production_service_reaches_the_wan_emulator():
    """Not even through another module: only pdd (its launcher starts it) and benchmarks import it."""
    production = [m for m in MODULES if _under(m, "services", "shared") and not _under(m, "services.wanlink")]
    assert not {m for m in production if any(_under(d, "services.wanlink") for d in _closure(m))}


def test_the_model_runtime_imports_itself_and_pure_leaves_only():
    def allowed(m: str, d: str) -> bool:
        return _under(d, "shared.runtime") or d in RUNTIME_LEAVES or d in RUNTIME_BRIDGE.get(m, set())

    assert not _violations(("shared.runtime",), allowed)
    assert not {leaf: GRAPH[leaf] - RUNTIME_LEAVES for leaf in RUNTIME_LEAVES if GRAPH[leaf] - RUNTIME_LEAVES}


@pytest.mark.parametrize(
    "module",
    ["services.scheduler.policy", "services.scheduler.estimates", "services.scheduler.inputs", "shared.pipelines"],
)
def test_the_policy_imports_no_io_library(module):
    external = set().union(*(imports(m)[1] for m in _closure(module) | {module}))
    assert not external & {"nats", "redis", "torch", "transformers", "httpx", "socket", "asyncio"}, external


def _loaded_by(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {m.split(".")[0] for m in out.stdout.split()}


def test_the_gateway_imports_neither_torch_nor_transformers():
    gateway = {m for m in MODULES if m.startswith("services.gateway")}
    reached = set().union(*(_closure(m) for m in gateway)) | gateway
    external = set().union(*(imports(m)[1] for m in reached))
    assert not external & {"torch", "transformers", "matplotlib"}, sorted(reached)
    assert not _loaded_by("import services.gateway.app, services.gateway.__main__") & {"torch", "transformers"}


def test_pdd_help_loads_neither_torch_nor_matplotlib():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pdd.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert not loaded & {"torch", "transformers", "matplotlib"}
    assert "usage: pdd" in out.stdout


def test_pipeline_names_have_one_home():
    """Outside tests, a pipeline's or handoff's name is spelt only in shared/pipelines.py."""
    names = ("p-md", "p-rld-md", "p-rld", "oneshot", "catchup")
    spelt = {
        (module, node.value)
        for module, path in MODULES.items()
        if module != "shared.pipelines"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    }
    assert spelt == set(), sorted(spelt)


# "prefill" also names a stage, not the role: the `pdd` object's `timings_ms["prefill"]` and the
# waterfall's row (beside "queue", "kv_local", "relay", "main", ...); these modules spell it so,
# this many times each
PREFILL_STAGE = {
    "shared.waterfall": 4,  # the row, its bar and ticks, the timing it reads
    "services.gateway.pdd_object": 1,  # timings_ms
    "sim.records": 1,  # timings_ms
    "benchmarks.plots": 1,  # the timing it reads
    "benchmarks.waterfall": 3,  # the row's label (key and text) and colour
}


def test_role_names_have_one_home():
    """Outside tests, an instance role is spelt only in shared/pipelines.py (`Role`): everything
    else says `Role.MD`, or `ROLES` for the plain names."""
    spelt = Counter(
        (module, node.value)
        for module, path in MODULES.items()
        if module != "shared.pipelines"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in ("prefill", "rld", "md")
    )
    allowed = Counter({(m, "prefill"): n for m, n in PREFILL_STAGE.items()})
    assert spelt == allowed, {"spelt": sorted((spelt - allowed).items()), "gone": sorted((allowed - spelt).items())}


# what only the runtime may touch: block bookkeeping, KV moved in and out of a pool, the radix cache
BLOCK_ATTRIBUTES = {"allocator", "block_table", "allocate", "incref", "num_free_blocks"}
CACHE_METHODS = {"insert", "match", "evict", "clear", "drain_events", "all_events"}
RUNTIME_INTERNALS = {"import_kv", "export_kv", "import_layer", "KVPool", "BlockAllocator", "RadixCache"}


def _block_handling(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in BLOCK_ATTRIBUTES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in CACHE_METHODS:
            if isinstance(node.value, ast.Attribute) and node.value.attr == "cache":
                found.append(f"{node.lineno}: .cache.{node.attr}")
        elif (
            isinstance(node, ast.Name | ast.alias)
            and getattr(node, "id", getattr(node, "name", "")) in RUNTIME_INTERNALS
        ):
            found.append(f"{node.lineno}: {getattr(node, 'id', getattr(node, 'name', ''))}")
    return found


def test_only_the_runtime_allocates_frees_or_caches_blocks():
    processes = {
        m: p
        for m, p in MODULES.items()
        if m.split(".")[0] in ("services", "pdd", "shared") and not _under(m, "shared.runtime")
    }
    touching = {m: found for m, p in processes.items() if (found := _block_handling(p))}
    assert touching == {}, touching


def test_the_block_check_sees_what_it_forbids(tmp_path):
    """The check above would catch a decoder freeing blocks or caching a prefix itself."""
    code = tmp_path / "decoder.py"
    code.write_text("engine.pool.allocator.free(seq.block_table)\nengine.cache.insert(t, b)\nfrom x import import_kv\n")
    assert sorted(_block_handling(code)) == ["1: .allocator", "1: .block_table", "2: .cache.insert", "3: import_kv"]
