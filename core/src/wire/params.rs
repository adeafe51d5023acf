//! Transfer parameters handed from the prefill side to the decode side through the P/D
//! proxy, with vLLM 0.9.1's JSON keys (vLLM 0.32's nested `remote_block_ids` is not accepted).

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
    /// The prefill's block ids holding the request (full blocks only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<Vec<u32>>,
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
    /// Prefill block ids.
    pub block_ids: &'a [u32],
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
            (&[1u32, 2, 3][..], "prefill-0", 5600)
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
