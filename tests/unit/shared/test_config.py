"""Reading frozen config dataclasses from the environment."""

from __future__ import annotations

import dataclasses

import pytest

from shared.config import CacheConfig, ServerConfig, from_env


def test_defaults_and_overrides() -> None:
    cfg = from_env(CacheConfig, "KVMESH_KVM_", env={"KVMESH_KVM_BLOCK_SIZE": "32", "OTHER": "x"})
    assert cfg.block_size == 32
    assert cfg.num_blocks == CacheConfig().num_blocks
    cfg2 = from_env(CacheConfig, "KVMESH_KVM_", env={"KVMESH_KVM_BLOCK_SIZE": "32"}, block_size=8)
    assert cfg2.block_size == 8


def test_frozen() -> None:
    cfg = ServerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match="KVMESH_KVM_NUM_BLOCKS"):
        from_env(CacheConfig, "KVMESH_KVM_", env={"KVMESH_KVM_NUM_BLOCKS": "many"})
    with pytest.raises(ValueError, match="num_blocks"):
        from_env(CacheConfig, "KVMESH_KVM_", env={"KVMESH_KVM_NUM_BLOCKS": "1"})


def test_types() -> None:
    cfg = from_env(ServerConfig, "X_", env={"X_GRACE_SECONDS": "0.5", "X_HOST": "0.0.0.0"})
    assert cfg.grace_seconds == 0.5 and cfg.host == "0.0.0.0"
