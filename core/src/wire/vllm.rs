//! vLLM 0.32.0's NixlConnector handshake (connector version 14), as observed on the wire:
//! what a stock vLLM decode asks a prefill and what it expects back, and what a stock vLLM
//! prefill answers. kvxfer speaks it to stock vLLM peers only; kvxfer peers keep
//! [`super::handshake`].
//!
//! - Request: one frame, msgpack `[bin "get_meta_msg", pp_rank, tp_rank]`.
//! - Reply: two frames, a [`HandshakePayload`] (a msgpack map) and the server's monotonic
//!   clock in seconds (a msgpack float), from which the client estimates the clock offset.
//! - The payload carries a compatibility hash ([`CompatFactors::hash`]) and
//!   [`AgentMetadata`] as msgpack bytes; the agent metadata carries NIXL's own serialized
//!   agent, untouched.
//!
//! A newer vLLM is recognised by its hash (its version is a factor): a stock peer of another
//! version never matches, and the refusal says which of our factors went into ours.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::handshake::{GET_META_MSG, MAX_REGIONS};
use super::{WireError, check_size};

/// The vLLM release whose protocol this module speaks.
pub const VLLM_VERSION: &str = "0.32.0";
/// `NIXL_CONNECTOR_VERSION` of that release.
pub const CONNECTOR_VERSION: u32 = 14;
/// Bound on a stock peer's reply frames. A real payload is about 1 KiB plus NIXL's agent
/// blob and one name per layer; decoding expands small elements (empty names and lists)
/// up to about 24 times, so the bound stays far below the kvxfer handshake's.
pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;
/// Longest name (engine id, layout, backend, region name) accepted from a peer.
const MAX_NAME: usize = 1024;

/// A metadata request: which pipeline stage and TP rank the client wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaRequest {
    /// Pipeline-parallel rank asked for.
    pub pp_rank: u32,
    /// Tensor-parallel rank asked for.
    pub tp_rank: u32,
}

impl MetaRequest {
    /// The request frame, byte for byte what vLLM's client sends.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec(&(
            serde_bytes::Bytes::new(GET_META_MSG),
            self.pp_rank,
            self.tp_rank,
        ))
        .unwrap_or_default()
    }

    /// Reads a request frame: exactly `[bin "get_meta_msg", uint, uint]`; anything else
    /// (kvxfer's `[.., rank, agent]` included) is `None`.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        // A three-element array whose tag is msgpack bin, as vLLM encodes bytes.
        if bytes.len() > 64 || bytes.get(..2) != Some(&[0x93, 0xc4]) {
            return None;
        }
        let (tag, pp_rank, tp_rank): (serde_bytes::ByteBuf, u32, u32) =
            rmp_serde::from_slice(bytes).ok()?;
        (tag.as_ref() == GET_META_MSG).then_some(MetaRequest { pp_rank, tp_rank })
    }
}

/// The first reply frame: vLLM's `NixlHandshakePayload`, a map by field name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakePayload {
    /// 64 lowercase hex digits: [`CompatFactors::hash`] of the sender.
    pub compatibility_hash: String,
    /// [`AgentMetadata`], msgpack-encoded.
    #[serde(with = "serde_bytes")]
    pub agent_metadata_bytes: Vec<u8>,
}

impl HandshakePayload {
    /// The msgpack map.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Decodes a peer's payload (size-bounded; the hash must look like a sha256 digest).
    pub fn decode(bytes: &[u8], limit: usize) -> Result<Self, WireError> {
        check_size(bytes, limit)?;
        let p: HandshakePayload =
            rmp_serde::from_slice(bytes).map_err(|e| malformed(e, "payload"))?;
        if p.compatibility_hash.len() != 64
            || !p.compatibility_hash.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Err(WireError::Invalid {
                what: "vLLM handshake payload",
                reason: "compatibility_hash is not 64 hex digits".into(),
            });
        }
        Ok(p)
    }
}

/// vLLM's `NixlAgentMetadata`: one rank's cache as its NixlConnector advertises it. Field
/// order is the wire order (msgpack map, every field present).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    /// The engine's id.
    pub engine_id: String,
    /// NIXL's serialized agent (`getLocalMD`), loaded as is by the peer's NIXL.
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// Base address of each region (one per layer on vLLM's CPU cache).
    pub kv_caches_base_addr: Vec<u64>,
    /// Device of the regions (0 for host memory).
    pub device_id: u32,
    /// Blocks per region.
    pub num_blocks: u64,
    /// Bytes of one block, per region.
    pub block_lens: Vec<u64>,
    /// Bytes from one block to the next, per region.
    pub block_strides: Vec<u64>,
    /// `LBHNC` (heads before tokens in a block) or `LBNHC` (tokens before heads).
    pub kv_cache_layout: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Mamba state sizes (`[0, 0]` without Mamba).
    #[serde(default)]
    pub ssm_sizes: Vec<u64>,
    /// vLLM's attention backend name (`CPU_ATTN`, `FLASH_ATTN`, ...).
    pub attn_backend_name: String,
    /// Kernel blocks per logical block (1 unless they differ).
    #[serde(default = "one")]
    pub physical_blocks_per_logical_kv_block: u32,
    /// Blocks per region, where regions differ.
    #[serde(default)]
    pub region_num_blocks: Option<Vec<u64>>,
    /// KV cache group of each region (vLLM writes -1 for regions groups share).
    #[serde(default)]
    pub region_group_ids: Option<Vec<i64>>,
    /// Layer name of each region.
    #[serde(default)]
    pub region_names: Option<Vec<String>>,
    /// NIXL memory type of each region (`DRAM`, `VRAM`).
    #[serde(default)]
    pub region_mem_types: Option<Vec<String>>,
    /// Decode context parallelism.
    #[serde(default = "one")]
    pub dcp_size: u32,
    /// Prefill context parallelism.
    #[serde(default = "one")]
    pub pcp_size: u32,
    /// Per-layer-embedding block length, where the model has one.
    #[serde(default)]
    pub ple_block_len: Option<u64>,
    /// Packed region members (none for plain attention caches).
    #[serde(default)]
    pub region_members: Vec<Vec<String>>,
    /// Layouts of packed members (none for plain attention caches).
    #[serde(default)]
    pub packed_member_layouts: std::collections::BTreeMap<String, (u64, u64)>,
}

fn one() -> u32 {
    1
}

impl AgentMetadata {
    /// The msgpack map, in vLLM's field order.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Decodes a peer's metadata: size-bounded, typed errors, every list consistent with
    /// the region count and every region's extent free of overflow.
    pub fn decode(bytes: &[u8], limit: usize) -> Result<Self, WireError> {
        check_size(bytes, limit)?;
        let m: AgentMetadata = exact(bytes).map_err(|e| malformed(e, "agent metadata"))?;
        m.validate()?;
        Ok(m)
    }

    fn validate(&self) -> Result<(), WireError> {
        let invalid = |reason: String| WireError::Invalid {
            what: "vLLM agent metadata",
            reason,
        };
        for (what, s) in [
            ("engine_id", &self.engine_id),
            ("kv_cache_layout", &self.kv_cache_layout),
            ("attn_backend_name", &self.attn_backend_name),
        ] {
            if s.is_empty() || s.len() > MAX_NAME {
                return Err(invalid(format!(
                    "{what} length {} outside 1..={MAX_NAME}",
                    s.len()
                )));
            }
        }
        if self.agent_metadata.is_empty() {
            return Err(invalid("agent_metadata is empty".into()));
        }
        let regions = self.kv_caches_base_addr.len();
        if regions == 0 || regions > MAX_REGIONS {
            return Err(invalid(format!(
                "{regions} regions outside 1..={MAX_REGIONS}"
            )));
        }
        if self.block_lens.len() != regions || self.block_strides.len() != regions {
            return Err(invalid(format!(
                "{regions} regions but {} block lengths and {} strides",
                self.block_lens.len(),
                self.block_strides.len()
            )));
        }
        let lists = [
            (
                "region_num_blocks",
                self.region_num_blocks.as_ref().map(Vec::len),
            ),
            (
                "region_group_ids",
                self.region_group_ids.as_ref().map(Vec::len),
            ),
            ("region_names", self.region_names.as_ref().map(Vec::len)),
            (
                "region_mem_types",
                self.region_mem_types.as_ref().map(Vec::len),
            ),
        ];
        for (what, len) in lists {
            if len.is_some_and(|n| n != regions) {
                return Err(invalid(format!("{what} does not have {regions} entries")));
            }
        }
        if self.num_blocks == 0 || self.block_size == 0 {
            return Err(invalid("num_blocks or block_size is zero".into()));
        }
        for r in 0..regions {
            let (base, len, stride) = (
                self.kv_caches_base_addr[r],
                self.block_lens[r],
                self.block_strides[r],
            );
            if len == 0 || stride < len {
                return Err(invalid(format!(
                    "region {r}: block length {len}, stride {stride}"
                )));
            }
            let blocks = self.region_blocks(r);
            let end = stride
                .checked_mul(blocks.saturating_sub(1))
                .and_then(|x| x.checked_add(len))
                .and_then(|x| x.checked_add(base));
            if blocks == 0 || end.is_none() {
                return Err(invalid(format!("region {r} wraps around or is empty")));
            }
        }
        Ok(())
    }

    /// Blocks of region `r` (its own count where the peer sent one).
    pub fn region_blocks(&self, r: usize) -> u64 {
        self.region_num_blocks
            .as_ref()
            .and_then(|v| v.get(r).copied())
            .unwrap_or(self.num_blocks)
    }

    /// Bytes region `r` spans: from its base to the end of its last block.
    pub fn region_len(&self, r: usize) -> Option<u64> {
        let blocks = self.region_blocks(r);
        self.block_strides
            .get(r)?
            .checked_mul(blocks.checked_sub(1)?)?
            .checked_add(*self.block_lens.get(r)?)
    }
}

/// The second reply frame: the server's clock (`time.perf_counter()` in vLLM).
pub fn encode_clock(seconds: f64) -> Vec<u8> {
    rmp_serde::to_vec(&seconds).unwrap_or_default()
}

/// Reads the second reply frame: a finite float (an integer is accepted, as Python's
/// msgpack decoder would).
pub fn decode_clock(bytes: &[u8]) -> Result<f64, WireError> {
    check_size(bytes, 16)?;
    let v: f64 = exact(bytes).map_err(|e| malformed(e, "clock"))?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(WireError::Invalid {
            what: "vLLM clock",
            reason: format!("{v} is not finite"),
        })
    }
}

/// What vLLM's compatibility hash covers (`compute_nixl_compatibility_hash`). Inside vLLM
/// each comes from the engine config: `vllm.__version__`, `NIXL_CONNECTOR_VERSION`,
/// `model_config.model` (the string as given), `str(model_config.dtype)`,
/// `get_total_num_kv_heads()`, `get_head_size()`, `get_total_num_hidden_layers()`, the
/// attention backend's name, `str(cache_config.cache_dtype)`, `not
/// scheduler_config.disable_hybrid_kv_cache_manager`, the speculative config's
/// compatibility factors (null without one) and the transfer mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompatFactors {
    /// vLLM's version string.
    pub vllm_version: String,
    /// The NIXL connector's protocol version.
    pub nixl_connector_version: u32,
    /// The model as given to vLLM (path or hub id).
    pub model: String,
    /// `torch.float32`, `torch.bfloat16`, ...
    pub dtype: String,
    /// KV heads of the whole model.
    pub num_kv_heads: u32,
    /// Head size.
    pub head_size: u32,
    /// Layers of the whole model.
    pub num_hidden_layers: u32,
    /// The attention backend's name.
    pub attn_backend_name: String,
    /// The KV cache dtype setting (`auto`, `fp8`, ...).
    pub cache_dtype: String,
    /// Whether the hybrid KV cache manager is on.
    pub is_hma_enabled: bool,
    /// The speculative config's factors (JSON), null without one.
    pub speculative_config: serde_json::Value,
    /// `pull` or `push`.
    pub transfer_mode: String,
}

impl CompatFactors {
    /// The hash vLLM computes: sha256 of `json.dumps(factors, sort_keys=True)`, hex.
    pub fn hash(&self) -> String {
        let value = serde_json::to_value(self).unwrap_or_default();
        let mut text = String::new();
        python_json(&value, &mut text);
        Sha256::digest(text.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Why a peer's `hash` differs from ours, as far as it can be told: a peer that
    /// differs in one factor vLLM versions commonly disagree on is named; otherwise our
    /// factors are listed, since the peer sends only its hash.
    pub fn explain_mismatch(&self, theirs: &str) -> String {
        let mut tries: Vec<(String, CompatFactors)> = Vec::new();
        let mut alt = self.clone();
        alt.transfer_mode = if self.transfer_mode == "pull" {
            "push"
        } else {
            "pull"
        }
        .into();
        tries.push((
            format!("the peer's transfer_mode is {:?}", alt.transfer_mode),
            alt,
        ));
        let mut alt = self.clone();
        alt.is_hma_enabled = !self.is_hma_enabled;
        tries.push((
            format!("the peer's is_hma_enabled is {}", alt.is_hma_enabled),
            alt,
        ));
        for v in (CONNECTOR_VERSION.saturating_sub(4))..=(CONNECTOR_VERSION.saturating_add(4)) {
            let mut alt = self.clone();
            alt.nixl_connector_version = v;
            tries.push((format!("the peer speaks NIXL connector version {v}"), alt));
        }
        if let Some((why, _)) = tries.iter().find(|(_, f)| f.hash() == theirs) {
            return format!("compatibility hash differs: {why}, ours {}", self.summary());
        }
        format!(
            "compatibility hash differs (peer {theirs}, ours {}): the peer differs in one of our factors {}; \
             a stock vLLM other than {VLLM_VERSION} always does",
            self.hash(),
            self.summary()
        )
    }

    fn summary(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Writes `v` as Python's `json.dumps(v, sort_keys=True)` does (`", "` and `": "`
/// separators, ASCII only).
fn python_json(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) => out.push_str(&python_float(f)),
            _ => out.push_str(&n.to_string()),
        },
        Value::String(s) => python_str(s, out),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_json(x, out);
            }
            out.push(']');
        }
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_str(k, out);
                out.push_str(": ");
                python_json(&o[k], out);
            }
            out.push('}');
        }
    }
}

/// `repr(float)`: integral values keep a `.0`.
fn python_float(f: f64) -> String {
    if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

fn python_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One msgpack value filling `bytes` exactly: trailing bytes are refused.
fn exact<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let mut de = rmp_serde::Deserializer::new(bytes);
    let v = T::deserialize(&mut de).map_err(|e| e.to_string())?;
    match de.into_inner().len() {
        0 => Ok(v),
        n => Err(format!("{n} bytes after the value")),
    }
}

fn malformed(e: impl std::fmt::Display, what: &'static str) -> WireError {
    WireError::Malformed {
        what: match what {
            "payload" => "vLLM handshake payload",
            "agent metadata" => "vLLM agent metadata",
            _ => "vLLM clock frame",
        },
        reason: e.to_string(),
    }
}

#[cfg(test)]
pub(crate) mod tests;
