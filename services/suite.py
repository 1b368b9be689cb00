"""``kvmesh up``: the whole suite as processes on loopback, started in dependency order.

kv-cache-manager and model-runner first (the runner loads the model and sizes the pool), then
the offload-store, then the scheduler, which sizes the kv-cache-manager from the runner's pool.
Each is a ``kvmesh serve <name>`` child; this process waits for each to answer health checks,
prints where it listens, and stops them in reverse order (SIGTERM, graceful drain) on exit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.launcher import ServiceProcess


@dataclass(frozen=True)
class SuiteConfig:
    """Ports and shared settings of a local suite (0 = any free port)."""

    model_dir: str
    host: str = "127.0.0.1"
    scheduler_port: int = 50051
    kvm_port: int = 0
    runner_port: int = 0
    offload_port: int = 0
    with_offload: bool = True
    log_dir: str = ""
    extra_env: Mapping[str, str] = field(default_factory=dict)


class Suite:
    """The running services; use as a context manager or call :meth:`stop`."""

    def __init__(self, config: SuiteConfig, startup_timeout: float = 300.0) -> None:
        self.config = config
        self.services: dict[str, ServiceProcess] = {}
        self._envs: dict[str, Mapping[str, str]] = {}
        log_dir = config.log_dir or None
        base = {"KVMESH_MODEL_DIR": config.model_dir, **config.extra_env}
        try:
            self._start("kv-cache-manager", config.kvm_port, base, log_dir, startup_timeout)
            self._start("model-runner", config.runner_port, base, log_dir, startup_timeout)
            if config.with_offload and os.path.exists(Path(__file__).parent / "offload_store" / "main.py"):
                data = Path(log_dir or self.services["model-runner"].log_path.parent) / "offload-data"
                env = {"KVMESH_OFFLOAD_DATA_DIR": str(data), **base}
                self._start("offload-store", config.offload_port, env, log_dir, startup_timeout)
            sched_env = {
                **base,
                "KVMESH_SCHED_KVM_ADDRESS": self.services["kv-cache-manager"].address,
                "KVMESH_SCHED_RUNNER_ADDRESS": self.services["model-runner"].address,
            }
            if "offload-store" in self.services:
                sched_env["KVMESH_SCHED_OFFLOAD_ADDRESS"] = self.services["offload-store"].address
            self._start("scheduler", config.scheduler_port, sched_env, log_dir, startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, port: int, env: Mapping[str, str], log_dir: str | None, timeout: float) -> None:
        self._envs[name] = env
        self.services[name] = ServiceProcess(name, env=env, host=self.config.host, port=port,
                                             startup_timeout=timeout, log_dir=log_dir)

    def restart(self, name: str, kill: bool = True, timeout: float = 120.0) -> ServiceProcess:
        """Stops one service (SIGKILL, or SIGTERM when not ``kill``) and starts it again on the same
        port with the same configuration: the fault tests' and the soak's process restart."""
        old = self.services[name]
        if kill:
            old.proc.kill()
            old.proc.wait()
        old.stop()
        self._start(name, old.port, self._envs[name], self.config.log_dir or None, timeout)
        return self.services[name]

    @property
    def address(self) -> str:
        """The public API's ``host:port``."""
        return self.services["scheduler"].address

    def stop(self) -> None:
        """Stops every service, scheduler first (so in-flight requests drain before their backends go)."""
        for name in reversed(list(self.services)):
            self.services[name].stop()

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
