"""KvxferStats, as vLLM handles it between the worker and the front end (no engine needed)."""

from kvxfer.vllm import KvxferConnector
from kvxfer.vllm_stats import COUNTERS, KvxferStats


def worker_metrics(**values: float) -> dict[str, float]:
    # What `PullWorker.take_metrics()` returns: every counter, plus ones vLLM does not see.
    return {**dict.fromkeys(COUNTERS, 0), "plan_time": 0.5, **values}


def test_an_idle_worker_reports_nothing() -> None:
    assert KvxferStats.from_worker(worker_metrics()).is_empty()
    assert not KvxferStats.from_worker(worker_metrics(failed_handshakes=1)).is_empty()


def test_steps_aggregate_and_reduce_to_the_logged_summary() -> None:
    a = KvxferStats.from_worker(
        worker_metrics(transfers=2, bytes=3_000_000, transfer_time=0.002, descriptors_posted=5)
    )
    b = KvxferStats.from_worker(
        worker_metrics(transfers=1, bytes=1_000_000, transfer_time=0.002, failed_transfers=1)
    )
    assert "plan_time" not in a.data
    # The front end rebuilds the stats from the data dict it was sent.
    total = KvxferConnector.build_kv_connector_stats(a.data).aggregate(
        KvxferConnector.build_kv_connector_stats(b.data)
    )
    assert total.data["transfers"] == 3 and total.data["bytes"] == 4_000_000
    assert total.reduce() == {
        "transfers": 3,
        "MB": 4.0,
        "avg_xfer_ms": 1.333,
        "throughput_MB_s": 1000.0,
        "avg_descriptors": 1.7,
        "handshakes": 0,
        "failed_handshakes": 0,
        "failed_setups": 0,
        "failed_transfers": 1,
        "failed_notifications": 0,
        "heartbeats": 0,
        "expired_leases": 0,
        "expired_reads": 0,
        "verified_references": 0,
        "stale_references": 0,
        "verified_digests": 0,
        "digest_mismatches": 0,
        "refused_loads": 0,
        "lost_connections": 0,
        "peer_restarts": 0,
        "refused_notes": 0,
    }
    assert KvxferConnector.build_kv_connector_stats(None).is_empty()
    assert KvxferStats().reduce()["avg_xfer_ms"] == 0.0
