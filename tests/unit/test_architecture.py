"""Repository-wide guards for the rooms of docs/architecture.md.

Each test reads the sources as text (``ast``) and runs nothing, so it is fast and exact:
- a core module (anything under ``services/`` but the boundary files) imports no gRPC;
- the model-runner's ``model/``, ``attention/`` and ``native/`` depend one way, with no import
  cycle, and no module imports a private name of another;
- every ``.py`` file under ``services/`` and ``shared/`` has a row in docs/architecture.md, and
  every row names a file that exists;
- a service imports another service only through its ``client``, ``types`` and ``config`` rooms;
- the kv-cache-manager never hashes (the scheduler owns the block hashes).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# The files where a service meets the network; gRPC belongs there and nowhere else in services/.
BOUNDARY_FILES = frozenset({"servicer.py", "main.py", "client.py"})
# Today's known exceptions, each with its reason. Debt: the test fails when a file not listed
# here imports gRPC, and when a listed one no longer does (then delete its line).
GRPC_EXCEPTIONS = {
    "services/cli.py": "the command line is an entry point, like main.py: `up` waits on the suite's start-up",
    "services/suite.py": "`kvmesh up` is an entry point: it waits on the services' gRPC health checks",
    "services/client_cli.py": "`kvmesh generate`/`chat` are entry points: they turn an RpcError into one line",
    "services/mesh.py": "`kvmesh up --replicas` is an entry point, like suite.py (the launcher's health checks)",
    "services/scheduler/auth.py": "the public API's auth is a gRPC server interceptor (transport, like servicer.py)",
}
# model -> attention -> native: a package may import only the packages after it.
MODEL_RUNNER_LAYERS = ("model", "attention", "native")


@dataclass(frozen=True)
class Import:
    """One imported module, and the names taken from it (``from module import names``)."""

    module: str
    names: tuple[str, ...]
    line: int


def _sources(*folders: str) -> list[Path]:
    files = [p for folder in folders for p in (ROOT / folder).rglob("*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts and not _rel(p).startswith("shared/pb/"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[Import]:
    """Every import in the file, nested ones included (a lazy import is still a dependency)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    return _imports_in(path.read_text(), package)


def _imports_in(source: str, package: str) -> Iterator[Import]:
    """:func:`_imports` of ``source``, a module of ``package`` (relative imports resolve against it)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            yield Import(module, tuple(a.name for a in node.names), node.lineno)


def _is_grpc(module: str, grpc_helpers: frozenset[str]) -> bool:
    return (module.split(".")[0].startswith("grpc") or module.endswith("_pb2_grpc")
            or module in grpc_helpers)  # fmt: skip


def _grpc_helpers() -> frozenset[str]:
    """``shared`` modules that import gRPC themselves (importing one is importing gRPC)."""
    return frozenset(
        _module_name(p) for p in _sources("shared") if any(_is_grpc(i.module, frozenset()) for i in _imports(p))
    )


def _grpc_importers() -> dict[str, str]:
    """Core modules of ``services/`` that import gRPC -> the first such import, for the message."""
    helpers = _grpc_helpers()
    found: dict[str, str] = {}
    for path in _sources("services"):
        if path.name in BOUNDARY_FILES:
            continue
        for imp in _imports(path):
            if _is_grpc(imp.module, helpers) or any(_is_grpc(f"{imp.module}.{n}", helpers) for n in imp.names):
                found[_rel(path)] = f"line {imp.line}: {imp.module}"
                break
    return found


def test_no_core_module_imports_grpc() -> None:
    importers = _grpc_importers()
    new = {f: where for f, where in importers.items() if f not in GRPC_EXCEPTIONS}
    assert not new, (
        "core modules must not import gRPC (directly, through generated *_pb2_grpc stubs or a shared gRPC "
        f"helper); move the gRPC part into servicer.py / main.py / client.py: {new}"
    )
    paid = sorted(set(GRPC_EXCEPTIONS) - set(importers))
    assert not paid, f"these files no longer import gRPC: delete them from GRPC_EXCEPTIONS: {paid}"


def test_the_grpc_guard_sees_each_kind_of_import() -> None:
    """The detector itself, on the kinds of import it must catch (and one it must not)."""
    helpers = _grpc_helpers()
    assert "shared.grpc_server" in helpers and "shared.errors" not in helpers
    for module in ("grpc", "grpc.aio", "grpc_health.v1", "shared.pb.kvmesh.v1.scheduler_pb2_grpc",
                   "shared.grpc_server"):  # fmt: skip
        assert _is_grpc(module, helpers), module
    assert not _is_grpc("shared.pb.kvmesh.v1.scheduler_pb2", helpers)  # messages are plain data


def _internal_graph(prefix: str) -> dict[str, set[str]]:
    """Import graph among the modules whose name starts with ``prefix``."""
    paths = {_module_name(p): p for p in _sources(prefix.replace(".", "/"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for imp in _imports(path):
            for candidate in (imp.module, *(f"{imp.module}.{n}" for n in imp.names)):
                if candidate in paths and candidate != name:
                    targets.add(candidate)
        graph[name] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_model_runner_modules_import_in_no_cycle() -> None:
    cycle = _cycle(_internal_graph("services.model_runner"))
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_model_attention_native_depend_one_way() -> None:
    """``model`` may import ``attention`` and ``native``; ``attention`` only ``native``; ``native`` neither."""
    base = "services.model_runner"
    wrong = []
    for i, layer in enumerate(MODEL_RUNNER_LAYERS):
        forbidden = tuple(f"{base}.{other}" for other in MODEL_RUNNER_LAYERS[:i])
        for path in _sources(f"services/model_runner/{layer}"):
            wrong += [f"{_rel(path)}:{imp.line} imports {imp.module}" for imp in _imports(path)
                      if imp.module.startswith(forbidden)]  # fmt: skip
    assert not wrong, f"the model-runner's packages depend {' -> '.join(MODEL_RUNNER_LAYERS)} only: {wrong}"


def _private_imports(rel: str, imports: Iterator[Import]) -> list[str]:
    found = []
    for imp in imports:
        if not imp.module.startswith(("services", "shared")):
            continue  # a third-party library's internals are its own business
        private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        private += [p for p in imp.module.split(".") if p.startswith("_") and not p.startswith("__")]
        found += [f"{rel}:{imp.line} imports {name} from {imp.module}" for name in private]
    return found


def test_no_module_imports_a_private_name() -> None:
    found = [hit for path in _sources("services", "shared") for hit in _private_imports(_rel(path), _imports(path))]
    assert not found, f"a leading underscore means 'this module only'; make the name public or move it: {found}"


def test_private_import_detector() -> None:
    source = ("from services.model_runner.attention.torch_backend import Chunk, _Plan\n"
              "from .x import _y, __version__\nimport torch._C\nfrom shared._hidden import x\n")  # fmt: skip
    assert _private_imports("probe.py", _imports_in(source, "services")) == [
        "probe.py:1 imports _Plan from services.model_runner.attention.torch_backend",
        "probe.py:2 imports _y from services.x",
        "probe.py:4 imports _hidden from shared._hidden",
    ]


def _documented_files(text: str) -> dict[str, int]:
    """Files named by the tables of docs/architecture.md -> line: a heading names a folder in
    backticks (``## `services/scheduler/` ...``), each table row below it a file (``| `a.py` |``);
    one cell may name several (``| `a.h`, `b.h` |``)."""
    files: dict[str, int] = {}
    folder: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        heading = re.match(r"#+ `([^`]+/)`", line)
        if heading:
            folder = heading.group(1)
            continue
        if folder is None or not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first_cell):
            files[folder + name] = number
    return files


def test_every_source_file_is_in_the_architecture_map() -> None:
    text = ARCHITECTURE.read_text()
    documented = _documented_files(text)
    folders = {f.rpartition("/")[0] + "/" for f in documented}
    missing = []
    for path in _sources("services", "shared"):
        rel = _rel(path)
        if rel in documented or (path.name == "__init__.py" and rel.removesuffix("__init__.py") in folders):
            continue  # a folder's heading covers its __init__.py
        folder = rel.rpartition("/")[0] + "/"
        where = f"under its heading ## `{folder}`" if folder in folders else f"under a new heading ## `{folder}`"
        missing.append(f"{rel}: add a row | `{path.name}` | what it owns | who may call it | {where}")
    assert not missing, "docs/architecture.md does not list:\n" + "\n".join(missing)


def test_every_file_in_the_architecture_map_exists() -> None:
    stale = [f"line {line}: {name}" for name, line in _documented_files(ARCHITECTURE.read_text()).items()
             if not (ROOT / name).is_file()]  # fmt: skip
    assert not stale, f"docs/architecture.md names files that do not exist (renamed or deleted?): {stale}"


def test_map_parser_reads_headings_and_rows() -> None:
    text = (
        "## `services/x/` the x\n\n| file | owns |\n|---|---|\n| `a.py` | A |\n| `b.h`, `c.h` | C |\n"
        "prose `not_a_row.py`\n### `services/x/y/`\n| `d.py` | D |\n"
    )
    assert _documented_files(text) == {"services/x/a.py": 5, "services/x/b.h": 6, "services/x/c.h": 6,
                                       "services/x/y/d.py": 9}  # fmt: skip


# The hash functions of shared/hashing.py; only the seed's owner (the scheduler) and the router,
# which predicts the scheduler's hashes, may call them (docs/design.md, "Prefix hashes").
HASHERS = frozenset({"hash_blocks", "hash_block", "hash_seed"})


def _hash_callers(rel: str, imports: Iterator[Import]) -> list[str]:
    return [f"{rel}:{imp.line} imports {name}" for imp in imports if imp.module == "shared.hashing"
            for name in imp.names if name in HASHERS]  # fmt: skip


def test_the_kv_cache_manager_never_hashes() -> None:
    """One owner for block hashes: the scheduler computes them once and sends them."""
    found = [hit for path in _sources("services/kv_cache_manager") for hit in _hash_callers(_rel(path), _imports(path))]
    assert not found, f"the kv-cache-manager is sent the scheduler's hashes; it must not compute them: {found}"
    probe = "from shared.hashing import BlockHash, hash_blocks\nimport shared.hashing\n"
    assert _hash_callers("probe.py", _imports_in(probe, "services")) == ["probe.py:1 imports hash_blocks"]


# What one service may import of another: the rooms made for callers (docs/architecture.md).
PUBLIC_ROOMS = frozenset({"client", "types", "config"})
# Known exceptions, each with its reason. Debt: the test fails on a new one, and on a listed one
# that is gone (then delete its line).
PEER_IMPORT_EXCEPTIONS = {
    ("services/router/main.py", "services.scheduler.auth"):
        "the router runs the scheduler's own AuthInterceptor so its tenant is the replica's (docs/mesh.md)",
    ("services/router/servicer.py", "services.scheduler.auth"):
        "the router reads the tenant the scheduler's AuthInterceptor set (current_tenant)",
    ("services/router/main.py", "services.scheduler.tokenizer"):
        "the router tokenizes text and chat exactly as the replicas do (the scheduler's Tokenizer)",
    ("services/router/servicer.py", "services.scheduler.tokenizer"):
        "the router tokenizes text and chat exactly as the replicas do (the scheduler's Tokenizer)",
}


def _service_of(rel: str) -> str | None:
    """``services/<svc>/...`` -> ``svc``; None for the composition roots (``services/cli.py`` ...)."""
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "services" else None


def _peer_imports(rel: str, imports: Iterator[Import]) -> set[tuple[str, str]]:
    """(file, module) for each import of another service's module that is not a public room."""
    own = _service_of(rel)
    found: set[tuple[str, str]] = set()
    for imp in imports:
        for module in (imp.module, *(f"{imp.module}.{n}" for n in imp.names)):
            parts = module.split(".")
            if len(parts) < 3 or parts[0] != "services" or parts[1] == own:
                continue
            if parts[2] not in PUBLIC_ROOMS and (module == imp.module or imp.module == ".".join(parts[:2])):
                found.add((rel, ".".join(parts[:3])))
    return found


def test_services_import_each_other_only_through_client_types_and_config() -> None:
    found = set().union(*(_peer_imports(_rel(p), _imports(p)) for p in _sources("services")
                          if _service_of(_rel(p)) is not None))  # fmt: skip
    new = sorted(found - set(PEER_IMPORT_EXCEPTIONS))
    assert not new, ("a service may import another service's client, types and config only (its core and "
                     f"converters are its own; give its client what you need): {new}")
    paid = sorted(set(PEER_IMPORT_EXCEPTIONS) - found)
    assert not paid, f"these imports are gone: delete them from PEER_IMPORT_EXCEPTIONS: {paid}"


def test_the_peer_import_detector() -> None:
    source = ("from services.kv_cache_manager.client import RemoteKVCache\n"
              "from services.kv_cache_manager.manager import KVCacheManager\n"
              "from services.model_runner import convert, types\nimport services.offload_store.store\n"
              "from services.scheduler.request import Request\n")  # fmt: skip
    assert _peer_imports("services/scheduler/x.py", _imports_in(source, "services.scheduler")) == {
        ("services/scheduler/x.py", "services.kv_cache_manager.manager"),
        ("services/scheduler/x.py", "services.model_runner.convert"),
        ("services/scheduler/x.py", "services.offload_store.store"),
    }
    assert _service_of("services/cli.py") is None and _service_of("services/router/client.py") == "router"


# The naming rule of docs/architecture.md: each service's core entry class is the service's name.
CORE_CLASSES = {
    "services.kv_cache_manager.manager": "KVCacheManager",
    "services.model_runner.runner": "ModelRunner",
    "services.offload_store.store": "OffloadStore",
    "services.scheduler.scheduler": "Scheduler",
    "services.router.routing": "Router",
    "services.gateway.core": "Gateway",
}


def test_each_service_core_is_named_after_the_service() -> None:
    import importlib

    text = (ROOT / "docs" / "architecture.md").read_text()
    for module, name in CORE_CLASSES.items():
        assert isinstance(getattr(importlib.import_module(module), name, None), type), (module, name)
        assert f"`{name}`" in text, f"docs/architecture.md does not name the core class {name}"
    services = {p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()}
    assert services == {m.split(".")[1] for m in CORE_CLASSES}, "a new service needs its core class listed here"
