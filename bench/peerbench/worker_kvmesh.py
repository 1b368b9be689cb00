"""Runs in kvmesh's venv: the gRPC suite started as ``kvmesh up`` would, or the in-process engine.

Settings (``job["settings"]``): ``mode`` (``suite`` or ``inprocess``), ``dtype`` and
``attention_backend`` (``auto``: whatever kvmesh picks on this machine; the exact native mode is
``float32`` + ``cpu``), ``kv_cache_memory_bytes``. The thread count is the runner's
``num_threads``. What the engine resolved comes from ``GetModelInfo`` (suite) or the runner's
``model_info()`` (in-process), so every row says what it really ran.

Both modes are driven by ``bench.serve``'s driver (every prompt offered at once, greedy,
``ignore_eos``, ``max_tokens`` = the output length); the suite through the public gRPC API.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # NOTE: run as a script; the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

from bench.peerbench import wire  # noqa: E402

STARTUP_TIMEOUT_S = 600.0  # a loaded 2-core machine can take minutes to load and warm the runner


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class SuiteProcess:
    """``kvmesh up --no-offload`` as a child process, with the runner's settings in its env; the HTTP
    gateway on ``http_port`` (``-1``: none)."""

    def __init__(self, model_dir: str, env: dict[str, str], log_path: Path, http_port: int = -1) -> None:
        from services.scheduler.client import KVMeshClient

        self.port = free_port()
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "services.cli", "up", "--model", model_dir, "--port", str(self.port),
               "--http-port", str(http_port), "--no-offload"]
        child_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=self.log, stderr=subprocess.STDOUT)
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvmesh up exited with {self.proc.returncode}; see {log_path}")
            try:
                with KVMeshClient(self.address) as client:
                    self.info = client.model_info()
                break
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"kvmesh up did not answer within {STARTUP_TIMEOUT_S:.0f} s") from None
                time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def drive_tokens(system: Any, prompts: Sequence[Sequence[int]], output_len: int) -> list[list[int]]:
    """Every prompt offered at once through a ``DrivenSystem``'s driver; each prompt's tokens, in prompt order."""
    from bench.serve.systems import conversations

    run = system.drive(conversations(prompts, output_len))
    failed = [r for r in run.records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    by_id = {r.conversation_id: list(r.output_token_ids) for r in run.records}
    return [by_id[i] for i in range(len(prompts))]


def runner_env(settings: dict[str, Any], threads: int) -> dict[str, str]:
    """The model-runner's settings for ``kvmesh up``, as environment variables."""
    return {"KVMESH_RUNNER_DTYPE": settings["dtype"], "KVMESH_RUNNER_ATTENTION_BACKEND": settings["attention_backend"],
            "KVMESH_RUNNER_NUM_THREADS": str(threads),
            "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(settings["kv_cache_memory_bytes"]),
            "KVMESH_RUNNER_QUANTIZATION": settings.get("quantization", "auto")}


class DrivenEngine:
    """A worker's engine that the serve driver drives: ``system`` and ``_resolved`` set by ``__init__``."""

    system: Any  # bench.serve.systems.DrivenSystem
    _resolved: dict[str, str]

    def generate(self, prompts: Sequence[Sequence[int]], output_len: int) -> list[list[int]]:
        """Every prompt offered at once; tokens in prompt order."""
        return drive_tokens(self.system, prompts, output_len)

    def resolved(self) -> dict[str, str]:
        """What the server or runner reports it chose."""
        return self._resolved

    def close(self) -> None:
        """Stops what ``__init__`` started."""
        self.system.close()


class KvmeshEngine(DrivenEngine):
    """The suite (over gRPC) or the in-process engine, driven by the serve driver."""

    def __init__(self, job: dict[str, Any]) -> None:
        from bench.serve.systems import DrivenSystem
        from bench.serve.transports import GrpcTransport, InProcessTransport

        s = job["settings"]
        self.mode = s["mode"]
        threads = int(job["threads"])
        if self.mode == "suite":
            log = Path(job["log_dir"]) / f"{job['engine']}-suite.log"
            self.up = SuiteProcess(job["model_dir"], runner_env(s, threads), log)
            info = self.up.info
            self._resolved = {"dtype": info.dtype, "backend": info.attention_backend,
                              "dtype_reason": info.dtype_reason, "backend_reason": info.attention_backend_reason}
            transport = GrpcTransport(self.up.address)

            def close() -> None:
                transport.close()
                self.up.stop()

            self.system = DrivenSystem(transport, False, close)
            return
        from services.model_runner.config import RunnerConfig
        from services.scheduler.config import SchedulerConfig
        from services.scheduler.inprocess import build_inprocess

        engine = build_inprocess(
            RunnerConfig(model_dir=job["model_dir"], dtype=s["dtype"], attention_backend=s["attention_backend"],
                         num_threads=threads, kv_cache_memory_bytes=int(s["kv_cache_memory_bytes"]),
                         quantization=s.get("quantization", "auto")),
            SchedulerConfig(), with_tokenizer=False)
        mi = engine.runner.model_info()
        self._resolved = {"dtype": mi.dtype, "backend": mi.attention_backend, "kv_cache_dtype": mi.kv_cache_dtype,
                          "dtype_reason": mi.dtype_reason, "backend_reason": mi.attention_backend_reason}
        self.system = DrivenSystem(InProcessTransport(engine), False, engine.close, inprocess=engine)



def _versions() -> dict[str, str]:
    import torch

    return {"torch": str(torch.__version__)}


if __name__ == "__main__":
    sys.exit(wire.main(sys.argv, KvmeshEngine, _versions))
