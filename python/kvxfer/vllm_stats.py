"""The connectors' statistics in vLLM's metrics: KvxferConnector's pull worker counters
travel from the worker to the front end as `KvxferStats`, KvxferPushConnector's as
`KvxferPushStats`; both are logged as vLLM's periodic `KV Transfer metrics` line and exported
as Prometheus counters (`vllm:kvxfer_*` and `vllm:kvxfer_push_*`, per engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The counters of `kvxfer.PullWorker.take_metrics()` that vLLM sees, with their help text;
# `*_time` values are seconds.
COUNTERS: dict[str, str] = {
    "transfers": "KV transfers completed or posted by the decode",
    "bytes": "Bytes requested by KV transfers",
    "descriptors_posted": "Descriptors posted after coalescing",
    "transfer_time": "Seconds from post to completion, summed over transfers",
    "post_time": "Seconds spent planning and posting transfers",
    "handshakes": "Handshakes with prefill ranks completed",
    "handshake_time": "Seconds spent in completed handshakes",
    "failed_handshakes": "Handshakes that failed (timeout, bad reply, incompatible layout)",
    "failed_setups": "Loads that failed while being planned or posted",
    "failed_transfers": "Transfers that failed",
    "failed_notifications": "Notifications to the prefill that could not be sent",
    "heartbeats": "Heartbeat notes sent to prefill ranks holding this decode's requests",
    "expired_leases": "Prefill requests freed because no decode read them in time",
    "expired_reads": "Loads declined: a stock prefill frees their blocks too soon to read",
    "verified_references": "Loads whose reference the prefill's stamp confirmed after the read",
    "stale_references": "Loads failed: the prefill's stamp refuted their reference (consumed, "
    "expired, reused, or another prompt's)",
    "verified_digests": "Loads whose received bytes digested as the prefill published (digest on)",
    "digest_mismatches": "Loads failed: a received block's digest differed from the prefill's",
    "digest_time": "Seconds the prefill spent digesting held blocks",
    "refused_loads": "Loads refused because one of the same request was in flight",
    "lost_connections": "Prefill connections dropped after a failure (the next load reconnects)",
    "peer_restarts": "Handshakes that found a prefill restarted under the same engine id",
    "closed_connections": "Prefill connections no request needed closed (dead, or idle)",
    "refused_notes": "Read notes dropped: sender unknown, repeated, or a contradicting count",
}


# KvxferPushConnector's counters: its prefill's and decode's `take_metrics()`, and its own.
PUSH_COUNTERS: dict[str, str] = {
    "transfers": "KV WRITEs posted by the prefill (per chunk, layer chunk and decode rank)",
    "bytes": "Bytes the prefill wrote into decodes",
    "descriptors_posted": "Descriptors posted after coalescing",
    "post_time": "Seconds the prefill spent planning and posting WRITEs",
    "layer_posts": "Layer chunks posted while the prefill's forward pass ran",
    "failed_rooms": "Rooms that failed on the prefill",
    "registrations": "Decode registrations the prefill received",
    "forgotten_decodes": "Decodes the prefill forgot (connection failed, or idle)",
    "verified_rooms": "Rooms whose bytes the decode verified against the prefill's digests",
    "digest_mismatches": "Rooms failed: bytes the decode received differed from the digests",
    "digest_time": "Seconds spent digesting pages (prefill and decode)",
}


@dataclass
class KvxferStats(KVConnectorStats):
    """Counters summed since the last report (what `take_metrics` returned, aggregated)."""

    counters: ClassVar[dict[str, str]] = COUNTERS

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(self.counters, 0)

    @classmethod
    def from_worker(cls, metrics: dict[str, Any]) -> KvxferStats:
        return cls(data={k: metrics.get(k, 0) for k in cls.counters})

    def aggregate(self, other: KVConnectorStats) -> KvxferStats:
        for k in self.counters:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in self.counters)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n, secs = d.get("transfers", 0), d.get("transfer_time", 0.0)
        mb = d.get("bytes", 0) / 1e6
        return {
            "transfers": n,
            "MB": round(mb, 3),
            "avg_xfer_ms": round(secs / n * 1e3, 3) if n else 0.0,
            "throughput_MB_s": round(mb / secs, 1) if secs else 0.0,
            "avg_descriptors": round(d.get("descriptors_posted", 0) / n, 1) if n else 0.0,
            "handshakes": d.get("handshakes", 0),
            "failed_handshakes": d.get("failed_handshakes", 0),
            "failed_setups": d.get("failed_setups", 0),
            "failed_transfers": d.get("failed_transfers", 0),
            "failed_notifications": d.get("failed_notifications", 0),
            "heartbeats": d.get("heartbeats", 0),
            "expired_leases": d.get("expired_leases", 0),
            "expired_reads": d.get("expired_reads", 0),
            "verified_references": d.get("verified_references", 0),
            "stale_references": d.get("stale_references", 0),
            "verified_digests": d.get("verified_digests", 0),
            "digest_mismatches": d.get("digest_mismatches", 0),
            "refused_loads": d.get("refused_loads", 0),
            "lost_connections": d.get("lost_connections", 0),
            "peer_restarts": d.get("peer_restarts", 0),
            "refused_notes": d.get("refused_notes", 0),
        }


@dataclass
class KvxferPushStats(KvxferStats):
    """KvxferPushConnector's counters summed since the last report."""

    counters: ClassVar[dict[str, str]] = PUSH_COUNTERS

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "writes": d.get("transfers", 0),
            "MB": round(d.get("bytes", 0) / 1e6, 3),
            "layer_posts": d.get("layer_posts", 0),
            "failed_rooms": d.get("failed_rooms", 0),
            "registrations": d.get("registrations", 0),
            "verified_rooms": d.get("verified_rooms", 0),
            "digest_mismatches": d.get("digest_mismatches", 0),
        }


class KvxferPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per kvxfer counter, labelled per engine like vLLM's own."""

    counters: ClassVar[dict[str, str]] = COUNTERS
    prefix: ClassVar[str] = "vllm:kvxfer_"

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            k: create_metric_per_engine(
                self._counter_cls(
                    name=f"{self.prefix}{_prom_name(k)}",
                    documentation=doc,
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for k, doc in self.counters.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, per_engine in self._counters.items():
            v = transfer_stats_data.get(k, 0)
            if v:
                per_engine[engine_idx].inc(v)


class KvxferPushPromMetrics(KvxferPromMetrics):
    """KvxferPushConnector's counters as Prometheus counters (`vllm:kvxfer_push_*`)."""

    counters: ClassVar[dict[str, str]] = PUSH_COUNTERS
    prefix: ClassVar[str] = "vllm:kvxfer_push_"


class StatsHooks:
    """vLLM's two class-level stats hooks of a connector, building the classes it names
    (a connector lists this before `KVConnectorBase_V1`, whose hooks build nothing)."""

    stats_class: ClassVar[type[KvxferStats]] = KvxferStats
    prom_class: ClassVar[type[KvxferPromMetrics]] = KvxferPromMetrics

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return cls.stats_class(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return cls.prom_class(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _prom_name(key: str) -> str:
    """`transfer_time` -> `transfer_seconds` (Prometheus names carry their unit)."""
    return key.removesuffix("_time") + "_seconds" if key.endswith("_time") else key
