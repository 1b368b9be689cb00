"""The ``kvmesh`` command line.

    kvmesh model prepare          convert the embedded SmolLM2-135M-Instruct into a cached HF folder
    kvmesh serve <service>        run one service in the foreground (what containers run)
    kvmesh up                     run the whole suite on loopback until Ctrl-C
    kvmesh generate "prompt"      stream a completion from a running suite
    kvmesh chat                   an interactive chat with a running suite
    kvmesh demo                   model prepare + up + one streamed chat answer (``make run``)
    kvmesh bench serve|compare    serving benchmark against a suite; side by side with the peers

Service entry points are imported lazily so ``kvmesh serve kv-cache-manager`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.scheduler.config import DEFAULT_PORT

SERVICES: dict[str, str] = {
    "kv-cache-manager": "services.kv_cache_manager.main",
    "model-runner": "services.model_runner.main",
    "scheduler": "services.scheduler.main",
    "offload-store": "services.offload_store.main",
    "gateway": "services.gateway.main",
    "router": "services.router.main",
}
DEMO_QUESTION = "What is the capital of France? Answer in one sentence."


def _serve(ns: argparse.Namespace) -> int:
    from shared.errors import PortInUseError

    module = importlib.import_module(SERVICES[ns.service])
    try:
        result: int = module.main()
    except PortInUseError as exc:  # one line, no traceback: the operator's fix is obvious
        print(f"kvmesh {ns.service}: {exc}", file=sys.stderr, flush=True)
        return 1
    return result


def _checkpoint_problem(folder: Path) -> str:
    """Why ``folder`` is not a checkpoint the model-runner can load ("" when it is one)."""
    if not folder.is_dir():
        return "no such folder"
    if not (folder / "config.json").is_file():
        return "not a checkpoint folder (no config.json)"
    if not any(folder.glob("*.safetensors")):
        return "not a checkpoint folder (no *.safetensors weights)"
    return ""


def _model_dir(ns: argparse.Namespace) -> str:
    # NOTE: --model, else KVMESH_MODEL_DIR (as every service reads it), else the embedded model.
    chosen = ns.model or os.environ.get("KVMESH_MODEL_DIR", "")
    if chosen:
        folder = Path(chosen).resolve()
        problem = _checkpoint_problem(folder)
        if problem:
            source = "--model" if ns.model else "KVMESH_MODEL_DIR"
            raise SystemExit(f"kvmesh: error: {source} {folder}: {problem}")
        return str(folder)
    from services.model_runner.prepare import default_cache_dir, prepare_default_model

    return str(prepare_default_model(default_cache_dir(), progress=True))


def _start_suite(ns: argparse.Namespace, cancel: threading.Event | None = None, model_dir: str = "") -> Any:
    from services.suite import Suite, SuiteConfig

    model_dir = model_dir or _model_dir(ns)
    print(f"kvmesh: starting the suite for {model_dir} ...", flush=True)
    started = time.monotonic()
    suite: Any
    roles = tuple(r for r in (getattr(ns, "roles", "") or "").split(",") if r)
    if getattr(ns, "replicas", 1) > 1 or roles:  # N suites behind a router (services/mesh.py)
        from services.mesh import Mesh, MeshConfig

        suite = Mesh(MeshConfig(model_dir=model_dir, replicas=len(roles) or ns.replicas, port=ns.port,
                                with_offload=not ns.no_offload, log_dir=ns.log_dir or "", roles=roles))
    else:
        suite = Suite(SuiteConfig(model_dir=model_dir, scheduler_port=ns.port, with_offload=not ns.no_offload,
                                  log_dir=ns.log_dir or "",
                                  gateway_port=None if ns.http_port < 0 else ns.http_port,
                                  metrics_port=int(os.environ.get("KVMESH_METRICS_PORT", "0") or 0)),
                      cancel=cancel, progress=lambda line: print(line, flush=True))
    print(f"kvmesh: suite up in {time.monotonic() - started:.1f}s", flush=True)
    for name, proc in suite.services.items():
        print(f"  {name:<17} {proc.address:<22} log: {proc.log_path}", flush=True)
    return suite


def _wait_for_interrupt() -> None:
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass


def _up(ns: argparse.Namespace) -> int:
    """The suite until SIGTERM / Ctrl-C: 0 on a signal (also during start-up), 1 if it cannot start.

    NOTE: the handler is installed before any child starts (after the model is prepared, which
    starts none and stays interruptible) and only sets an event that the start-up polls, so a
    signal at any moment stops whatever has started and leaves no child.
    """
    from shared.errors import PortInUseError
    from shared.launcher import ServiceStartError

    model_dir = _model_dir(ns)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        suite = _start_suite(ns, cancel=stop, model_dir=model_dir)
    except PortInUseError as exc:
        print(f"kvmesh: {exc}", file=sys.stderr, flush=True)
        return 1
    except ServiceStartError as exc:
        if stop.is_set():
            print("kvmesh: stopped during start-up", flush=True)
            return 0
        print(f"kvmesh: the suite did not start: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        print(f"kvmesh: serving on {suite.address}; Ctrl-C to stop", flush=True)
        if "gateway" in suite.services:
            print(f"kvmesh: OpenAI-compatible API on http://{suite.services['gateway'].address}/v1", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        print("kvmesh: stopping ...", flush=True)
        suite.stop()
    return 0


def _demo(ns: argparse.Namespace) -> int:
    from services.client_cli import stream

    suite = _start_suite(ns)
    try:
        print(f"\nuser> {DEMO_QUESTION}\nassistant> ", end="", flush=True)
        stream(suite.address, [("user", DEMO_QUESTION)], ns.max_tokens, temperature=0.0)
        if ns.exit_after_demo:
            return 0
        print(f"\nkvmesh: the suite keeps serving on {suite.address}; try in another terminal:\n"
              f"  .venv/bin/kvmesh chat --address {suite.address}\nCtrl-C to stop.", flush=True)
        _wait_for_interrupt()
    finally:
        print("kvmesh: stopping ...", flush=True)
        suite.stop()
    return 0


def _add_suite_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="",
                   help="checkpoint folder (default: $KVMESH_MODEL_DIR, else the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="the public gRPC API's port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the OpenAI-compatible HTTP API's port (0 = any free port, -1 = no gateway)")
    p.add_argument("--no-offload", action="store_true", help="run without the offload-store")
    p.add_argument("--log-dir", default="", help="where service logs go (default: a temp folder)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    from services.model_runner.prepare import add_model_subcommand

    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: a KV-cache-centric LLM server")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one service in the foreground")
    serve.add_argument("service", choices=sorted(SERVICES))
    serve.set_defaults(func=_serve)
    add_model_subcommand(sub)
    from services.bench_cli import add_bench_subcommand
    from services.client_cli import add_client_subcommands

    add_bench_subcommand(sub)
    up = sub.add_parser("up", help="run the whole suite on loopback until Ctrl-C")
    _add_suite_args(up)
    up.add_argument("--replicas", type=int, default=1, help="N suites behind a KV-aware router on --port")
    up.add_argument("--roles", default="", help="one role per replica (mixed, prefill, decode), e.g. prefill,decode: "
                    "prefill/decode disaggregation through KVMESH_OFFLOAD_REMOTE_URL's Redis (docs/mesh.md)")
    up.set_defaults(func=_up)
    demo = sub.add_parser("demo", help="up + one streamed chat answer")
    _add_suite_args(demo)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--exit-after-demo", action="store_true", help="stop the suite after the answer")
    demo.set_defaults(func=_demo)
    add_client_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvmesh`` console script."""
    ns = build_parser().parse_args(argv)
    level = ns.log_level.upper() if ns.command == "serve" else "WARNING"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result: int = ns.func(ns)
    return result


if __name__ == "__main__":
    sys.exit(main())
