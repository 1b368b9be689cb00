"""API keys file, key store reload and the per-tenant cache salt (shared/auth.py)."""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from pathlib import Path

import pytest

from services.scheduler.auth import bearer_key, key_store_for
from shared.auth import AuthConfig, KeyStore, Tenant, parse_keys, tenant_cache_salt

KEY = "sk-0123456789abcdef"


def test_parse_keys_plain_and_sha256_entries() -> None:
    digest = hashlib.sha256(b"sk-other-key-00000000").hexdigest()
    entries = parse_keys(f"# comment\n\n{KEY} team-a\nsha256:{digest} team-b -5  # trailing comment\n")
    assert entries == [(hashlib.sha256(KEY.encode()).digest(), Tenant("team-a")),
                       (bytes.fromhex(digest), Tenant("team-b", -5))]


@pytest.mark.parametrize(("text", "message"), [
    (f"{KEY}\n", "line 1: expected 'key tenant [min_priority]'"),
    ("short team-a\n", "line 1: a key must have at least 16 characters"),
    ("sha256:abc team-a\n", "line 1: sha256: needs 64 hex digits"),
    (f"{KEY} team/a\n", "line 1: tenant id 'team/a' must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"),
    (f"{KEY} team-a high\n", "line 1: min_priority must be an integer"),
    (f"{KEY} team-a\n{KEY} team-b\n", "line 2: duplicate key"),
])
def test_parse_keys_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_keys(text)
    assert str(err.value) == message


def test_key_store_reloads_on_change_and_keeps_the_last_good_table(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY} team-a\n")
    store = KeyStore(str(path), reload_seconds=0.0)
    assert store.authenticate(KEY) == Tenant("team-a")
    assert store.authenticate(KEY + "x") is None
    assert store.authenticate("") is None
    tmp = tmp_path / "keys.new"
    tmp.write_text(f"{KEY}-new team-b\n")
    os.replace(tmp, path)
    assert store.authenticate(KEY) is None
    assert store.authenticate(f"{KEY}-new") == Tenant("team-b")
    path.write_text("not a keys file\n")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert store.authenticate(f"{KEY}-new") == Tenant("team-b")  # the broken file was not taken


def test_key_store_checks_the_file_at_most_once_per_interval(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY} team-a\n")
    store = KeyStore(str(path), reload_seconds=3600.0)
    tmp = tmp_path / "keys.new"
    tmp.write_text(f"{KEY}-new team-b\n")
    os.replace(tmp, path)
    assert store.authenticate(KEY) == Tenant("team-a")  # not re-read yet
    store.reload_seconds = 0.0
    time.sleep(0.001)
    assert store.authenticate(KEY) is None


def test_tenant_cache_salt_separates_tenants_and_narrows_with_the_client_salt() -> None:
    a = tenant_cache_salt("deployment", "team-a")
    assert a == hmac.new(b"deployment", b"kvmesh/v1/tenant-cache-salt\x00team-a", hashlib.sha256).digest()
    assert len(a) == 32
    assert tenant_cache_salt("deployment", "team-b") != a
    assert tenant_cache_salt("other-deployment", "team-a") != a
    assert tenant_cache_salt("deployment", "team-a", b"narrow") == a + b"narrow"


@pytest.mark.parametrize(("metadata", "key"), [
    ((("authorization", f"Bearer {KEY}"),), KEY),
    ((("authorization", f"bearer   {KEY} "),), KEY),
    ((("x-other", "1"), ("authorization", f"Bearer {KEY}")), KEY),
    ((("authorization", KEY),), None),
    ((("authorization", "Basic abc"),), None),
    ((("authorization", "Bearer "),), None),
    ((), None),
    (None, None),
])
def test_bearer_key(metadata: object, key: str | None) -> None:
    assert bearer_key(metadata) == key


def test_auth_is_off_only_on_loopback_unless_keys_are_given(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        assert key_store_for(AuthConfig(), "127.0.0.1") is None
    assert "authentication is OFF (host 127.0.0.1): every caller is tenant 'default'" in caplog.text
    with pytest.raises(SystemExit) as err:
        key_store_for(AuthConfig(), "0.0.0.0")
    assert str(err.value).startswith("scheduler: binding 0.0.0.0 needs API keys")
    with pytest.raises(SystemExit):
        key_store_for(AuthConfig(mode="on"), "127.0.0.1")
    assert key_store_for(AuthConfig(mode="off"), "0.0.0.0") is None
    path = tmp_path / "keys"
    path.write_text(f"{KEY} team-a\n")
    store = key_store_for(AuthConfig(keys_file=str(path)), "0.0.0.0")
    assert store is not None and store.authenticate(KEY) == Tenant("team-a")
