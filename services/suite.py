"""``kvmesh up``: the whole suite as processes on loopback, started in dependency order.

kv-cache-manager and model-runner first (the runner loads the model and sizes the pool), then
the offload-store, then the scheduler, which sizes the kv-cache-manager from the runner's pool,
then (when asked) the HTTP gateway in front of the scheduler. A runner given fewer threads than
the machine has CPUs runs on CPUs of its own (``runner_placement``).
Each is a ``kvmesh serve <name>`` child; this process waits for each to answer health checks,
prints where it listens, and stops them in reverse order (SIGTERM, graceful drain) on exit.

While the suite runs it supervises its children: one that exits is restarted on the same port
with exponential backoff (the scheduler marks itself NOT_SERVING meanwhile and re-attaches to
the restarted service). See docs/lifecycle.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.model_runner.cpu_bind import AUTO, allowed_cpus, split_for_suite
from services.scheduler.config import DEFAULT_PORT
from shared.grpc_server import check_port_free
from shared.launcher import ServiceProcess, ServiceStartError

log = logging.getLogger(__name__)

METRICS_PORT_OFFSETS = {"scheduler": 0, "kv-cache-manager": 1, "model-runner": 2, "offload-store": 3}


@dataclass(frozen=True)
class SuiteConfig:
    """Ports and shared settings of a local suite (0 = any free port).

    Attributes:
        supervise: restart a child that exits, on its port, after ``restart_backoff_seconds``
            doubling per consecutive failure up to ``max_restart_backoff_seconds``; a child up
            for ``stable_seconds`` starts again from the first delay.
    """

    model_dir: str
    host: str = "127.0.0.1"
    scheduler_port: int = DEFAULT_PORT
    kvm_port: int = 0
    runner_port: int = 0
    offload_port: int = 0
    with_offload: bool = True
    gateway_port: int | None = None  # the OpenAI HTTP API; None = no gateway (``kvmesh up`` uses 8000)
    metrics_port: int = 0  # >0: scheduler's /metrics here, kv-cache-manager +1, model-runner +2, offload-store +3
    log_dir: str = ""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    supervise: bool = True
    restart_backoff_seconds: float = 0.5
    max_restart_backoff_seconds: float = 30.0
    stable_seconds: float = 60.0


def runner_placement(env: Mapping[str, str]) -> tuple[dict[str, str], tuple[int, ...]]:
    """The model-runner's CPUs in a suite on one machine (``cpu_bind.split_for_suite``): the
    runner's extra environment and the CPUs of the other services (empty: unplaced).

    A runner whose team is smaller than the machine (``KVMESH_RUNNER_NUM_THREADS``) under
    ``KVMESH_RUNNER_CPU_BIND=auto`` gets the last CPUs, and the scheduler, kv-cache-manager,
    offload-store and gateway the others, so none of them preempts a compute thread; this
    launcher starts the one runner, so it knows no other runner claims those CPUs."""
    split = split_for_suite(env.get("KVMESH_RUNNER_CPU_BIND", AUTO),
                            int(env.get("KVMESH_RUNNER_NUM_THREADS", "0") or 0), allowed_cpus())
    if split is None:
        return {}, ()
    runner_cpus, others = split
    return {"KVMESH_RUNNER_CPU_BIND": runner_cpus}, others


class Suite:
    """The running services; use as a context manager or call :meth:`stop`.

    Args:
        cancel: set from elsewhere (``kvmesh up``'s signal handler) to abandon the start-up or
            stop supervising; :meth:`stop` sets it too.

    Raises:
        PortInUseError: the scheduler's port is taken (checked before any child starts).
        ServiceStartError: a child failed to start, or ``cancel`` was set during start-up; the
            children already started are stopped first.
    """

    def __init__(self, config: SuiteConfig, startup_timeout: float = 300.0,
                 cancel: threading.Event | None = None, progress: Callable[[str], None] | None = None) -> None:
        """Args:
            progress: told one line as each service starts and once it answers its health checks
                (``kvmesh up`` prints them: the runner alone can take a minute to load a model).
        """
        self.config = config
        self._progress = progress
        self.services: dict[str, ServiceProcess] = {}
        self.restarts: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._stopping = cancel or threading.Event()
        self._timeout = startup_timeout
        self._monitor: threading.Thread | None = None
        if config.scheduler_port:
            check_port_free(config.host, config.scheduler_port)
        log_dir = config.log_dir or None
        base = {"KVMESH_MODEL_DIR": config.model_dir, **config.extra_env}
        runner_env, self._others_cpus = runner_placement({**os.environ, **base})
        try:
            self._start("kv-cache-manager", config.kvm_port, base, log_dir)
            self._start("model-runner", config.runner_port, {**base, **runner_env}, log_dir)
            if config.with_offload and os.path.exists(Path(__file__).parent / "offload_store" / "main.py"):
                data = Path(log_dir or self.services["model-runner"].log_path.parent) / "offload-data"
                env = {"KVMESH_OFFLOAD_DATA_DIR": str(data), **base}
                self._start("offload-store", config.offload_port, env, log_dir)
            sched_env = {
                **base,
                "KVMESH_SCHED_KVM_ADDRESS": self.services["kv-cache-manager"].address,
                "KVMESH_SCHED_RUNNER_ADDRESS": self.services["model-runner"].address,
            }
            if "offload-store" in self.services:
                sched_env["KVMESH_SCHED_OFFLOAD_ADDRESS"] = self.services["offload-store"].address
            self._start("scheduler", config.scheduler_port, sched_env, log_dir)
            if config.gateway_port is not None:
                gw_env = {**base, "KVMESH_GATEWAY_SCHEDULER_ADDRESS": self.services["scheduler"].address}
                self._start("gateway", config.gateway_port, gw_env, log_dir)
        except BaseException:
            self.stop()
            raise
        if config.supervise:
            self._monitor = threading.Thread(target=self._supervise, name="kvmesh-supervisor", daemon=True)
            self._monitor.start()

    def _start(self, name: str, port: int, env: Mapping[str, str], log_dir: str | None) -> None:
        # NOTE: one KVMESH_METRICS_PORT inherited by every child made all but the first crash
        # (address in use); each gets its own port, in compose's order (9091 scheduler ... 9094).
        offset = METRICS_PORT_OFFSETS.get(name)
        if offset is not None:
            metrics = str(self.config.metrics_port + offset) if self.config.metrics_port else "0"
            env = {"KVMESH_METRICS_PORT": metrics, **env}
        if self._progress is not None:
            self._progress(f"kvmesh: starting {name} ...")
        started = time.monotonic()
        self.services[name] = ServiceProcess(name, env=env, host=self.config.host, port=port,
                                             startup_timeout=self._timeout, log_dir=log_dir,
                                             cancel=self._stopping,
                                             cpus=() if name == "model-runner" else self._others_cpus)
        self.restarts.setdefault(name, 0)
        if self._progress is not None:
            self._progress(f"kvmesh: {name} up on {self.services[name].address} in "
                           f"{time.monotonic() - started:.1f}s")

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            for name, proc in list(self.services.items()):
                if proc.proc.poll() is not None and not self._stopping.is_set():
                    self._restart(name, proc)

    def _restart(self, name: str, dead: ServiceProcess) -> None:
        """Restarts ``name`` on the port it had, after a backoff; a failed try is retried later."""
        cfg = self.config
        if time.monotonic() - dead.started_at >= cfg.stable_seconds:
            self._failures[name] = 0
        n = self._failures.get(name, 0)
        delay = min(cfg.restart_backoff_seconds * 2 ** n, cfg.max_restart_backoff_seconds)
        self._failures[name] = n + 1
        dead.stop()
        log.warning("kvmesh: %s exited with %s; restarting on port %d in %.1fs",
                    name, dead.proc.returncode, dead.port, delay)
        if self._stopping.wait(delay):
            return
        try:
            proc = ServiceProcess(name, env=dead.env, host=dead.host, port=dead.port, startup_timeout=self._timeout,
                                  log_dir=str(dead.log_path.parent), cancel=self._stopping, cpus=dead.cpus)
        except (ServiceStartError, TimeoutError, OSError) as exc:
            log.warning("kvmesh: restarting %s failed: %s", name, str(exc).splitlines()[0])
            return  # the dead entry stays: the next round tries again, after a longer backoff
        self.services[name] = proc
        self.restarts[name] += 1
        log.warning("kvmesh: %s restarted on %s (restart %d)", name, proc.address, self.restarts[name])

    def restart(self, name: str, kill: bool = True, timeout: float = 120.0) -> ServiceProcess:
        """Stops one service (SIGKILL, or SIGTERM when not ``kill``) and has it started again on its
        port with the same configuration: the fault tests' and the soak's process restart. While
        supervising, the supervisor restarts it (as after a crash); otherwise this call does."""
        old = self.services[name]
        before = self.restarts.get(name, 0)
        if kill:
            old.proc.kill()
        else:
            old.proc.terminate()
        old.proc.wait(timeout)
        if self._monitor is not None:
            deadline = time.monotonic() + timeout
            while self.restarts.get(name, 0) == before:
                if time.monotonic() > deadline:
                    raise ServiceStartError(f"{name} was not restarted within {timeout}s")
                time.sleep(0.05)
            return self.services[name]
        old.stop()
        self._start(name, old.port, old.env, self.config.log_dir or None)
        self.restarts[name] = before + 1
        return self.services[name]

    @property
    def address(self) -> str:
        """The public API's ``host:port``."""
        return self.services["scheduler"].address

    def stop(self) -> None:
        """Stops every service, scheduler first (so in-flight requests drain before their backends go)."""
        self._stopping.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(30.0)
        for name in reversed(list(self.services)):
            self.services[name].stop()

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
