//! Transfer parameters handed from the prefill side to the decode side through the P/D
//! proxy, with vLLM's JSON keys. Block ids are read flat (vLLM 0.9.1: one group) or per KV
//! cache group (vLLM 0.32: `[[..], ..]`, one list per group of a hybrid model) and written
//! per group, so a stock vLLM 0.32 decode reads what a kvxfer prefill hands out. `kvxfer_protocol` tells a kvxfer decode that the
//! prefill is kvxfer; params with vLLM 0.32's `transfer_mode` and without it come from a
//! stock vLLM NixlConnector.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use serde::{Deserialize, Serialize};

use super::{WireError, check_size};

/// Largest parameter object accepted (block id lists of long prompts included).
pub const MAX_PARAMS_BYTES: usize = 4 << 20;

/// `kv_transfer_params` of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// Decode side: the KV cache must be pulled from a remote prefill.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// Prefill side: a remote decode will pull this request's KV cache.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// The prefill's block ids holding the request, per KV cache group.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "block_ids::read",
        serialize_with = "block_ids::write"
    )]
    pub remote_block_ids: Option<Vec<Vec<u32>>>,
    /// The prefill engine's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// Host of the prefill's side channel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    /// Base port of the prefill's side channel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    /// The request's id on the prefill engine, when it differs from the decode's (an engine
    /// gives the two halves of a request different ids): read-done notes and heartbeats
    /// name it. Absent: the decode's id is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    /// The prefill's TP size (vLLM 0.32; a kvxfer decode asks a kvxfer prefill's rank 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// The prefill's decode-context-parallel size (vLLM 0.32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcp_size: Option<u32>,
    /// The prefill's pipeline-parallel size (vLLM 0.32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<u32>,
    /// `pull` or `push` (vLLM 0.32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_mode: Option<String>,
    /// When the prefill frees the blocks, in seconds of its monotonic clock (vLLM 0.32 sets it
    /// for blocks a decode node exports; a decode converts it with the clock offset of the
    /// handshake and declines a read that could not finish in time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_blocks_expiry_time: Option<serde_json::Number>,
    /// kvxfer's handshake version, which kvxfer prefills set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_protocol: Option<u32>,
    /// The generation of the prefill's hold, from a kvxfer prefill that stamps its references
    /// (its handshake names its stamp table): the decode checks the table's slot for it
    /// after reading (see `kvxfer_core::pull::stamps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_stamp: Option<u64>,
}

/// Which handshake a decode speaks to the prefill named in its params.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum PeerProtocol {
    /// kvxfer's (also vLLM 0.9.1-shaped reference peers).
    #[default]
    Kvxfer,
    /// vLLM 0.32.0's NixlConnector (connector version 14).
    Vllm032,
}

mod block_ids {
    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Ids {
        Flat(Vec<u32>),
        Groups(Vec<Vec<u32>>),
    }

    /// Flat ids (one group), or ids per KV cache group (at most
    /// [`kvxfer_layout::MAX_GROUPS`] groups).
    pub fn read<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Vec<u32>>>, D::Error> {
        match Option::<Ids>::deserialize(d)? {
            None => Ok(None),
            Some(Ids::Flat(v)) => Ok(Some(vec![v])),
            Some(Ids::Groups(g)) if g.len() > kvxfer_layout::MAX_GROUPS => {
                Err(serde::de::Error::custom(format!(
                    "{} KV cache groups of block ids: at most {} are accepted",
                    g.len(),
                    kvxfer_layout::MAX_GROUPS
                )))
            }
            Some(Ids::Groups(g)) => Ok(Some(g)),
        }
    }

    /// Per group, as vLLM 0.32 writes them.
    pub fn write<S: Serializer>(v: &Option<Vec<Vec<u32>>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(ids) => s.collect_seq(ids),
            None => s.serialize_none(),
        }
    }
}

impl KvTransferParams {
    /// Parses the JSON a proxy passed through; unknown keys are ignored.
    pub fn from_json(bytes: &[u8]) -> Result<Self, WireError> {
        check_size(bytes, MAX_PARAMS_BYTES)?;
        let malformed = |reason: String| WireError::Malformed {
            what: "kv_transfer_params",
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| malformed(e.to_string()))?;
        if !value.is_object() {
            return Err(malformed("expected a JSON object".into()));
        }
        serde_json::from_value(value).map_err(|e| malformed(e.to_string()))
    }

    /// The JSON form.
    pub fn to_json(&self) -> String {
        // Serializing plain fields cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The handshake the prefill that produced these params speaks: vLLM 0.32's where the
    /// params have its `transfer_mode` and no kvxfer version.
    pub fn peer_protocol(&self) -> PeerProtocol {
        if self.kvxfer_protocol.is_none() && self.transfer_mode.is_some() {
            PeerProtocol::Vllm032
        } else {
            PeerProtocol::Kvxfer
        }
    }

    /// For a decode-side request: the fields a remote prefill load needs, or what is missing.
    pub fn remote_source(&self) -> Result<RemoteSource<'_>, WireError> {
        let missing = |field: &str| WireError::Invalid {
            what: "kv_transfer_params",
            reason: format!("do_remote_prefill is set but {field} is missing"),
        };
        Ok(RemoteSource {
            block_ids: self
                .remote_block_ids
                .as_deref()
                .ok_or_else(|| missing("remote_block_ids"))?,
            engine_id: self
                .remote_engine_id
                .as_deref()
                .ok_or_else(|| missing("remote_engine_id"))?,
            host: self
                .remote_host
                .as_deref()
                .ok_or_else(|| missing("remote_host"))?,
            port: self.remote_port.ok_or_else(|| missing("remote_port"))?,
        })
    }
}

/// The remote prefill a decode request pulls from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSource<'a> {
    /// Prefill block ids, per KV cache group.
    pub block_ids: &'a [Vec<u32>],
    /// Prefill engine id.
    pub engine_id: &'a str,
    /// Side-channel host.
    pub host: &'a str,
    /// Side-channel base port.
    pub port: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_json_round_trips() {
        let json = br#"{"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [1, 2, 3], "remote_engine_id": "prefill-0",
            "remote_host": "10.0.0.1", "remote_port": 5600, "extra_proxy_field": 7}"#;
        let p = KvTransferParams::from_json(json).unwrap();
        assert!(p.do_remote_prefill);
        let src = p.remote_source().unwrap();
        assert_eq!(
            (src.block_ids, src.engine_id, src.port),
            (&[vec![1u32, 2, 3]][..], "prefill-0", 5600)
        );
        let again = KvTransferParams::from_json(p.to_json().as_bytes()).unwrap();
        assert_eq!(again, p);
        let text = p.to_json();
        for key in [
            "do_remote_prefill",
            "do_remote_decode",
            "remote_block_ids",
            "remote_engine_id",
            "remote_host",
            "remote_port",
        ] {
            assert!(text.contains(&format!("\"{key}\"")), "{text}");
        }
    }

    /// A hybrid model's params carry one list per KV cache group, read and written as such;
    /// flat ids (vLLM 0.9.1) are one group.
    #[test]
    fn block_ids_travel_per_kv_cache_group() {
        let p = KvTransferParams::from_json(br#"{"remote_block_ids": [[1, 2], [], [7]]}"#).unwrap();
        assert_eq!(p.remote_block_ids, Some(vec![vec![1, 2], vec![], vec![7]]));
        assert!(p.to_json().contains(r#""remote_block_ids":[[1,2],[],[7]]"#));
        let flat = KvTransferParams::from_json(br#"{"remote_block_ids": [4, 5]}"#).unwrap();
        assert_eq!(flat.remote_block_ids, Some(vec![vec![4, 5]]));
        assert!(flat.to_json().contains(r#""remote_block_ids":[[4,5]]"#));
        let too_many = format!(r#"{{"remote_block_ids": {:?}}}"#, vec![vec![1u32]; 65]);
        assert!(KvTransferParams::from_json(too_many.as_bytes()).is_err());
    }

    #[test]
    fn bad_params_are_errors() {
        for bad in [
            &b"{"[..],
            b"[]",
            br#"{"remote_port": -1}"#,
            br#"{"remote_block_ids": ["a"]}"#,
        ] {
            assert!(
                KvTransferParams::from_json(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let p = KvTransferParams::from_json(br#"{"do_remote_prefill": true}"#).unwrap();
        assert!(p.remote_source().is_err());
        let huge = vec![b' '; MAX_PARAMS_BYTES + 1];
        assert!(matches!(
            KvTransferParams::from_json(&huge),
            Err(WireError::TooLarge { .. })
        ));
    }
}
