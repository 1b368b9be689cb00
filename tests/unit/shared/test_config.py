"""Reading frozen config dataclasses from the environment."""

from __future__ import annotations

import dataclasses

import pytest

from services.kv_cache_manager.config import CacheConfig
from shared.config import ServerConfig, from_env


def test_defaults_and_overrides() -> None:
    cfg = from_env(ServerConfig, "KVMESH_", env={"KVMESH_PORT": "32", "OTHER": "x"})
    assert cfg.port == 32
    assert cfg.max_workers == ServerConfig().max_workers
    cfg2 = from_env(ServerConfig, "KVMESH_", env={"KVMESH_PORT": "32"}, port=8)
    assert cfg2.port == 8


def test_frozen() -> None:
    cfg = ServerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match="KVMESH_MAX_WORKERS"):
        from_env(ServerConfig, "KVMESH_", env={"KVMESH_MAX_WORKERS": "many"})


def test_cache_config_has_no_serving_defaults() -> None:
    """The pool size always comes from the scheduler (Initialize), never a default; no seed at all."""
    with pytest.raises(TypeError):
        CacheConfig()  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig(num_blocks=1)
    with pytest.raises(TypeError):
        CacheConfig(num_blocks=8, hash_seed=bytes(32))  # type: ignore[call-arg]


def test_types() -> None:
    cfg = from_env(ServerConfig, "X_", env={"X_GRACE_SECONDS": "0.5", "X_HOST": "0.0.0.0"})
    assert cfg.grace_seconds == 0.5 and cfg.host == "0.0.0.0"
