//! Stock vLLM 0.32 peers (NixlConnector, connector version 14): serving them this rank's
//! payload, and the handshake a decode rank does with a stock prefill. Both end in the same
//! connection a kvxfer peer gets; only the metadata's form and the heartbeat differ. What
//! either side's metadata means in the other's terms is `wire::vllm_peer`.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::time::Duration;

use kvxfer_layout::TpMapping;

use super::{Fetched, PullWorker, prefill_ranks};
use crate::pull::config::VllmCompat;
use crate::sidechannel::fetch_vllm;
use crate::transport::Transport;
use crate::wire::vllm::{AgentMetadata, MAX_PAYLOAD_BYTES, MetaRequest};
use crate::wire::vllm_peer::{from_stock, payload};

impl<T: Transport> PullWorker<T> {
    /// Serves stock vLLM decodes from this rank's listener where the transport can hand
    /// them its native metadata (NIXL); otherwise their requests are refused.
    pub(super) fn serve_stock_decodes(&self) {
        let (Some(compat), Some(listener)) = (&self.config.vllm, &self.serving.listener) else {
            return;
        };
        if !compat.serve_decodes {
            tracing::info!(
                "stock vLLM decodes cannot pull from this rank: it stops before the last prompt \
                 token of a sliding-window model, which vLLM's decode does not expect (see \
                 `stop_short` in the connector's docs)"
            );
            return;
        }
        match self.transport.native_metadata() {
            Ok(native) => {
                let reply = payload(compat, &self.cache, &self.config.engine_id, native);
                listener.set_vllm_reply(0, self.config.tp_rank, reply);
            }
            Err(e) => tracing::info!(
                reason = %e,
                "stock vLLM decodes cannot pull from this rank (they need NIXL)"
            ),
        }
    }
}

/// A stock prefill's side channel and what this decode rank expects of it.
pub(super) struct StockPrefill<'a> {
    pub host: &'a str,
    pub port: u16,
    pub engine_id: &'a str,
    pub tp_size: u32,
    pub compat: Option<&'a VllmCompat>,
}

/// Fetches, from the stock prefill's one listener, every prefill rank this decode rank links
/// with; checks the compatibility hash before reading further, and the engine id. Runs on a
/// handshake thread.
pub(super) fn stock_handshake(
    at: &StockPrefill<'_>,
    mapping: &TpMapping,
    my_rank: u32,
    timeout: Duration,
    limit: usize,
) -> Result<Vec<(u32, Fetched)>, String> {
    let Some(compat) = at.compat else {
        return Err(format!(
            "{} is a stock vLLM prefill, and stock vLLM peers are disabled on this worker (no \
             vLLM compatibility factors to check its hash against: the worker's start-up log \
             says why, e.g. Mamba state; outside vLLM kvxfer pairs with kvxfer peers only)",
            at.engine_id
        ));
    };
    let ours = compat.factors.hash();
    let limit = limit.min(MAX_PAYLOAD_BYTES);
    let ranks = prefill_ranks(mapping, my_rank)?;
    let mut out = Vec::with_capacity(ranks.len());
    // The clock offset of the quickest round trip (the least uncertain), as vLLM keeps.
    let mut best: Option<(f64, f64)> = None;
    for tp_rank in ranks {
        let request = MetaRequest {
            pp_rank: 0,
            tp_rank,
        };
        let reply =
            fetch_vllm(at.host, at.port, request, timeout, limit).map_err(|e| e.to_string())?;
        tracing::debug!(
            engine = at.engine_id,
            tp_rank,
            round_trip_s = reply.round_trip,
            "stock prefill answered"
        );
        if reply.payload.compatibility_hash != ours {
            let why = compat
                .factors
                .explain_mismatch(&reply.payload.compatibility_hash);
            if compat.enforce_hash {
                return Err(format!(
                    "{why}; set enforce_handshake_compat to false to pair anyway"
                ));
            }
            tracing::warn!(engine = at.engine_id, %why, "compatibility hash differs (enforcement off)");
        }
        let meta = AgentMetadata::decode(&reply.payload.agent_metadata_bytes, limit)
            .map_err(|e| e.to_string())?;
        if meta.engine_id != at.engine_id {
            return Err(format!(
                "the prefill at {}:{} is engine {:?}, the request names {:?}",
                at.host, at.port, meta.engine_id, at.engine_id
            ));
        }
        let sample = (reply.round_trip, reply.remote_clock - reply.local_midpoint);
        if best.is_none_or(|(rtt, _)| sample.0 < rtt) {
            best = Some(sample);
        }
        let (meta, stock) = from_stock(meta, at.tp_size)?;
        out.push((
            tp_rank,
            Fetched {
                meta,
                native: Some(stock),
                clock_offset: None,
            },
        ));
    }
    for (_, f) in &mut out {
        f.clock_offset = best.map(|(_, offset)| offset);
    }
    Ok(out)
}
