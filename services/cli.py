"""The ``kvmesh`` command line: ``serve`` one service; later issues add ``up``, ``generate``, ...

Service entry points are imported lazily so that ``kvmesh serve kv-cache-manager`` never imports
torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

SERVICES: dict[str, str] = {
    "kv-cache-manager": "services.kv_cache_manager.main",
    "model-runner": "services.model_runner.main",
    "scheduler": "services.scheduler.main",
    "offload-store": "services.offload_store.main",
}


def _serve(ns: argparse.Namespace) -> int:
    module = importlib.import_module(SERVICES[ns.service])
    entry: Callable[[], int] = module.main
    return entry()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommands register here)."""
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: a KV-cache-centric LLM server")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one service in the foreground")
    serve.add_argument("service", choices=sorted(SERVICES))
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvmesh`` console script."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result: int = ns.func(ns)
    return result


if __name__ == "__main__":
    sys.exit(main())
