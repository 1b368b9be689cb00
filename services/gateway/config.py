"""The gateway's frozen configuration (read from ``KVMESH_GATEWAY_*`` in main.py only)."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.config import DEFAULT_ADDRESS


@dataclass(frozen=True)
class GatewayConfig:
    """Where the scheduler is and how HTTP requests map onto it.

    Attributes:
        scheduler_address: ``host:port`` of the scheduler's public gRPC API.
        served_model_name: the name clients put in ``model``; empty means the scheduler's
            ``model_id``. Requests naming another model get 404 (one gateway fronts one model).
        request_timeout_seconds: gRPC deadline of one generation; 0 means none. Past it the
            scheduler frees the request's blocks and the client gets 504.
        retry_after_seconds: the ``Retry-After`` header sent with 429 (scheduler queue full).
        health_timeout_seconds: how long ``/health`` waits for the scheduler's health answer.
    """

    scheduler_address: str = DEFAULT_ADDRESS
    served_model_name: str = ""
    request_timeout_seconds: float = 0.0
    retry_after_seconds: int = 1
    health_timeout_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.request_timeout_seconds < 0:
            raise ValueError("request_timeout_seconds must be >= 0")
        if self.retry_after_seconds < 0:
            raise ValueError("retry_after_seconds must be >= 0")
