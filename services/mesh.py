"""``kvmesh up --replicas N``: N whole suites on loopback behind one router (docs/mesh.md).

Each replica is a :class:`~services.suite.Suite` on ephemeral ports (its scheduler too); the
router listens on the public port, so clients dial the same address as with one suite. Stopped
router first (no new requests), then the replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.suite import Suite, SuiteConfig
from shared.launcher import ServiceProcess


@dataclass(frozen=True)
class MeshConfig:
    """A local mesh: how many replicas, where the router listens, what they share."""

    model_dir: str
    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 50051  # the router's (public) port; 0 = any free port
    policy: str = "kv_aware"
    with_offload: bool = True
    log_dir: str = ""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    roles: tuple[str, ...] = ()  # one per replica (KVMESH_SCHED_ROLE and the router's list); () = all mixed

    def __post_init__(self) -> None:
        if self.roles and len(self.roles) != self.replicas:
            raise ValueError(f"{len(self.roles)} roles for {self.replicas} replicas")

    def role(self, i: int) -> str:
        """Replica i's role."""
        return self.roles[i] if self.roles else "mixed"


def _replica_entry(i: int, suite: Suite, role: str) -> str:
    """The router's list entry of replica ``i``: scheduler/kv-cache-manager/role[/offload-store]."""
    entry = f"r{i}={suite.address}/{suite.services['kv-cache-manager'].address}/{role}"
    if "offload-store" in suite.services:  # its tiers count in the router's score
        entry += f"/{suite.services['offload-store'].address}"
    return entry


class Mesh:
    """The running replicas and router; use as a context manager or call :meth:`stop`."""

    def __init__(self, config: MeshConfig, startup_timeout: float = 300.0) -> None:
        if config.replicas < 1:
            raise ValueError("a mesh needs at least one replica")
        self.config = config
        self.suites: list[Suite] = []
        self.router: ServiceProcess | None = None
        try:
            for i in range(config.replicas):
                log_dir = str(Path(config.log_dir) / f"r{i}") if config.log_dir else ""
                self.suites.append(Suite(SuiteConfig(
                    model_dir=config.model_dir, host=config.host, scheduler_port=0,
                    with_offload=config.with_offload, log_dir=log_dir,
                    extra_env={**config.extra_env, "KVMESH_SCHED_ROLE": config.role(i)}),
                    startup_timeout))
            replicas = ",".join(_replica_entry(i, s, config.role(i)) for i, s in enumerate(self.suites))
            env = {**config.extra_env, "KVMESH_MODEL_DIR": config.model_dir, "KVMESH_ROUTER_REPLICAS": replicas,
                   "KVMESH_ROUTER_POLICY": config.policy}
            self.router = ServiceProcess("router", env=env, host=config.host, port=config.port,
                                         startup_timeout=startup_timeout,
                                         log_dir=str(Path(config.log_dir) / "router") if config.log_dir else None)
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        """The public API's ``host:port`` (the router)."""
        assert self.router is not None
        return self.router.address

    @property
    def services(self) -> dict[str, ServiceProcess]:
        """Every process by name (``router``, ``r0/scheduler``, ...), for listing."""
        out = {"router": self.router} if self.router is not None else {}
        for i, suite in enumerate(self.suites):
            out.update({f"r{i}/{name}": proc for name, proc in suite.services.items()})
        return out

    def stop(self) -> None:
        """Stops the router, then every replica."""
        if self.router is not None:
            self.router.stop()
        for suite in reversed(self.suites):
            suite.stop()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
