"""The backend's discovery settings, checked without starting an engine."""

import pytest

from kvxfer.sglang.conn import _discovery, _engine_id, _lease_ttl


def test_the_lease_ttl_is_checked_and_named_when_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVXFER_LEASE_TTL", raising=False)
    assert _lease_ttl() == 10.0
    monkeypatch.setenv("KVXFER_LEASE_TTL", "2.5")
    assert _lease_ttl() == 2.5
    for bad in ("ten", "1", "nan", "4000", ""):
        monkeypatch.setenv("KVXFER_LEASE_TTL", bad)
        with pytest.raises(ValueError, match="KVXFER_LEASE_TTL"):
            _lease_ttl()


def test_discovery_is_off_unless_named_and_engine_ids_fit_etcd_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVXFER_DISCOVERY", raising=False)
    assert _discovery() is None
    monkeypatch.setenv("KVXFER_DISCOVERY", "etcd://127.0.0.1:2379")
    monkeypatch.delenv("KVXFER_CLUSTER", raising=False)
    monkeypatch.delenv("KVXFER_ENGINE_ID", raising=False)
    assert _discovery() == ("etcd://127.0.0.1:2379", "default", None)
    assert _engine_id(("fe80::1%eth0", 8998)) == "sglang-fe80--1-eth0-8998"
    assert _engine_id(("10.0.0.7", 41000)) == "sglang-10.0.0.7-41000"
