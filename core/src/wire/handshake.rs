//! kvxfer's handshake reply: an agent's metadata as a msgpack **map** with the key set and
//! types of vLLM 0.9.1's NixlConnector (`engine_id`, `agent_metadata`, `kv_caches_base_addr`,
//! `num_blocks`, `tp_size`, `block_len`, `attn_backend_name`; `../shared/reference`).
//! kvxfer's own fields are extra keys prefixed `kvxfer_`, optional on decode and ignored by
//! decoders that do not know them.
//!
//! `agent_metadata` carries the transport's own metadata, which for NIXL is kvxfer's
//! envelope (NIXL's blob plus the registered regions), so this handshake pairs kvxfer with
//! kvxfer. Stock vLLM 0.32.0 engines speak [`super::vllm`] instead, which kvxfer also speaks
//! (plain NIXL metadata, the regions in vLLM's own fields).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::{BlockOrder, CacheKind, CacheParams, CacheSpec, Dtype, LayerGroups};
use serde::{Deserialize, Serialize};

use super::{WireError, check_size};

/// The exact request bytes a reference client sends.
pub const GET_META_MSG: &[u8] = b"get_meta_msg";
/// kvxfer's handshake protocol version. 2: the decode names its agent in the metadata request
/// (`["get_meta_msg", rank, agent]`) and the prefill counts read notes only from agents that
/// did, so a version-1 decode's notes would be dropped (its blocks freed only by the lease).
pub const PROTOCOL_VERSION: u32 = 2;
/// Default bound on a handshake reply (agent metadata of large registrations included).
pub const MAX_HANDSHAKE_BYTES: usize = 32 << 20;
/// Most region base addresses a reply may carry.
pub const MAX_REGIONS: usize = 1 << 20;
const MAX_NAME: usize = 1024;

/// An agent's handshake metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakeMeta {
    /// The engine's id.
    pub engine_id: String,
    /// The transport's opaque metadata (msgpack bin).
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// Base address of every region, in region order.
    pub kv_caches_base_addr: Vec<u64>,
    /// Blocks per region.
    pub num_blocks: u64,
    /// TP size of the engine.
    pub tp_size: u64,
    /// Bytes of one block of one region.
    pub block_len: u64,
    /// Attention backend name (compared for compatibility).
    pub attn_backend_name: String,
    /// kvxfer protocol version (absent from reference peers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_protocol: Option<u32>,
    /// TP rank whose cache this describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_tp_rank: Option<u32>,
    /// The full layout spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_layout: Option<LayoutWire>,
    /// How long the prefill holds unread blocks without a heartbeat, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_lease_ms: Option<u64>,
    /// A random id drawn when the worker started: a new value under a known engine id and
    /// rank is a restarted engine, whose blocks and registrations are not the old ones'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_instance: Option<u64>,
    /// Where the rank's stamp table lies (`kvxfer_core::pull::stamps`): its references carry
    /// a generation whose slot a decode reads after the blocks. Absent: references are not
    /// stamped (older kvxfer, stock peers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_stamps: Option<u64>,
    /// Where the rank's digest table lies (`kvxfer_core::pull::digests`): one entry of a
    /// digest per KV head for each block id, written when a hold starts. Absent: the rank
    /// publishes no content digests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvxfer_digests: Option<u64>,
}

/// A cache spec on the wire, with the model-wide facts a compatibility check needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutWire {
    /// `split-kv`, `joint-kv`, `mla`, `packed-kv` or `cross-layer`.
    pub kind: String,
    /// `HND` or `NHD`.
    pub order: String,
    /// Element type name.
    pub dtype: String,
    /// Layers held by this rank.
    pub num_layers: u32,
    /// KV heads held by this rank.
    pub kv_heads: u32,
    /// Head (latent) dimension.
    pub head_dim: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Blocks per region.
    pub num_blocks: u32,
    /// KV heads of the whole model.
    pub total_kv_heads: u32,
    /// Layers of the whole model.
    pub total_layers: u32,
    /// Global index of this rank's first layer (pipeline stage).
    pub first_layer: u32,
    /// The layers of each KV cache group of a hybrid model (indices into this rank's
    /// layers); absent for one group, so single-group handshakes are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<Vec<Vec<u32>>>,
    /// The groups (indices into `groups`) whose blocks are state pages (Mamba layers beside
    /// attention layers); absent when none are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_groups: Option<Vec<u32>>,
}

impl LayoutWire {
    /// The wire form of a spec.
    pub fn from_spec(
        spec: &CacheSpec,
        total_kv_heads: u32,
        total_layers: u32,
        first_layer: u32,
    ) -> Self {
        LayoutWire {
            kind: spec.kind().to_string(),
            order: spec.order().to_string(),
            dtype: spec.dtype().to_string(),
            num_layers: spec.num_layers(),
            kv_heads: spec.kv_heads(),
            head_dim: spec.head_dim(),
            tokens_per_block: spec.tokens_per_block(),
            num_blocks: spec.num_blocks(),
            total_kv_heads,
            total_layers,
            first_layer,
            groups: None,
            state_groups: None,
        }
    }

    /// This layout with a cache's KV cache groups (`None`: one group), state groups marked.
    pub fn with_groups(mut self, groups: Option<&LayerGroups>) -> Self {
        self.groups = groups.map(|g| g.as_slice().to_vec());
        self.state_groups = groups
            .filter(|g| g.has_state())
            .map(LayerGroups::state_groups);
        self
    }

    /// The validated spec.
    pub fn to_spec(&self) -> Result<CacheSpec, WireError> {
        let invalid = |reason: String| WireError::Invalid {
            what: "layout",
            reason,
        };
        let kind: CacheKind = self.kind.parse().map_err(|e| invalid(format!("{e}")))?;
        let order: BlockOrder = self.order.parse().map_err(|e| invalid(format!("{e}")))?;
        let dtype: Dtype = self.dtype.parse().map_err(|e| invalid(format!("{e}")))?;
        CacheSpec::new(CacheParams {
            kind,
            order,
            dtype,
            num_layers: self.num_layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            tokens_per_block: self.tokens_per_block,
            num_blocks: self.num_blocks,
        })
        .map_err(|e| invalid(e.to_string()))
    }

    /// The validated KV cache groups of a cache of `num_layers` layers, state groups marked;
    /// `None` for one group.
    pub fn to_groups(&self, num_layers: u32) -> Result<Option<LayerGroups>, WireError> {
        let invalid = |reason: String| WireError::Invalid {
            what: "KV cache groups",
            reason,
        };
        match (&self.groups, &self.state_groups) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(invalid("state groups named without KV cache groups".into())),
            (Some(g), state) => LayerGroups::new(g.clone(), num_layers)
                .and_then(|g| g.with_state(state.as_deref().unwrap_or(&[])))
                .map(Some)
                .map_err(|e| invalid(e.to_string())),
        }
    }
}

impl HandshakeMeta {
    /// Encodes as a msgpack map.
    pub fn encode(&self) -> Vec<u8> {
        // Plain owned fields always serialize.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Decodes a reply from a peer: size-limited, typed errors, consistency checked.
    pub fn decode(bytes: &[u8], limit: usize) -> Result<Self, WireError> {
        check_size(bytes, limit)?;
        let meta: HandshakeMeta =
            rmp_serde::from_slice(bytes).map_err(|e| WireError::Malformed {
                what: "handshake metadata",
                reason: e.to_string(),
            })?;
        meta.validate()?;
        Ok(meta)
    }

    fn validate(&self) -> Result<(), WireError> {
        let invalid = |reason: String| WireError::Invalid {
            what: "handshake metadata",
            reason,
        };
        if self.engine_id.is_empty() || self.engine_id.len() > MAX_NAME {
            return Err(invalid(format!(
                "engine_id length {} outside 1..={MAX_NAME}",
                self.engine_id.len()
            )));
        }
        if self.kv_caches_base_addr.len() > MAX_REGIONS {
            return Err(invalid(format!(
                "{} regions exceed {MAX_REGIONS}",
                self.kv_caches_base_addr.len()
            )));
        }
        for (name, v) in [
            ("num_blocks", self.num_blocks),
            ("tp_size", self.tp_size),
            ("block_len", self.block_len),
        ] {
            if v == 0 {
                return Err(invalid(format!("{name} is zero")));
            }
        }
        if let Some(rank) = self.kvxfer_tp_rank {
            if u64::from(rank) >= self.tp_size {
                return Err(invalid(format!(
                    "tp_rank {rank} not below tp_size {}",
                    self.tp_size
                )));
            }
        }
        if let Some(layout) = &self.kvxfer_layout {
            let spec = layout.to_spec()?;
            if spec.num_regions() as usize != self.kv_caches_base_addr.len() {
                return Err(invalid(format!(
                    "layout has {} regions but {} base addresses were sent",
                    spec.num_regions(),
                    self.kv_caches_base_addr.len()
                )));
            }
            if spec.block_len() != self.block_len || u64::from(spec.num_blocks()) != self.num_blocks
            {
                return Err(invalid(
                    "block_len or num_blocks disagree with the layout".into(),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind: CacheKind::SplitKv,
            order: BlockOrder::Hnd,
            dtype: Dtype::Bf16,
            num_layers: 2,
            kv_heads: 8,
            head_dim: 128,
            tokens_per_block: 16,
            num_blocks: 10,
        })
        .unwrap()
    }

    pub(crate) fn sample() -> HandshakeMeta {
        let s = spec();
        let layout = LayoutWire::from_spec(&s, 8, 2, 0);
        HandshakeMeta {
            engine_id: "prefill-0".into(),
            agent_metadata: vec![1, 2, 3, 255],
            kv_caches_base_addr: vec![0x1000, 0x2000_0000, 0x3000_0000, 0x4000_0000],
            num_blocks: 10,
            tp_size: 1,
            block_len: s.block_len(),
            attn_backend_name: "FLASH_ATTN".into(),
            kvxfer_protocol: Some(PROTOCOL_VERSION),
            kvxfer_tp_rank: Some(0),
            kvxfer_layout: Some(layout),
            kvxfer_lease_ms: Some(30_000),
            kvxfer_instance: Some(7),
            kvxfer_stamps: Some(4096),
            kvxfer_digests: None,
        }
    }

    /// Exactly the reference's struct: what a reference client decodes.
    #[derive(Debug, Deserialize, Serialize, PartialEq)]
    struct Reference {
        engine_id: String,
        #[serde(with = "serde_bytes")]
        agent_metadata: Vec<u8>,
        kv_caches_base_addr: Vec<u64>,
        num_blocks: u64,
        tp_size: u64,
        block_len: u64,
        attn_backend_name: String,
    }

    #[test]
    fn round_trip_and_reference_interop() {
        let m = sample();
        let bytes = m.encode();
        assert_eq!(
            HandshakeMeta::decode(&bytes, MAX_HANDSHAKE_BYTES).unwrap(),
            m
        );
        // First byte is a msgpack map header, and the metadata is a bin (0xc4 prefix).
        assert_eq!(bytes[0] & 0xf0, 0x80, "a map, not an array");
        // A reference decoder ignores our extra keys.
        let r: Reference = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(r.engine_id, "prefill-0");
        assert_eq!(r.agent_metadata, vec![1, 2, 3, 255]);
        // A reference listener's reply (no extras) decodes with extras absent.
        let theirs = rmp_serde::to_vec_named(&r).unwrap();
        let ours = HandshakeMeta::decode(&theirs, MAX_HANDSHAKE_BYTES).unwrap();
        assert_eq!(ours.kvxfer_layout, None);
        assert_eq!(ours.kv_caches_base_addr, m.kv_caches_base_addr);
    }

    /// One KV cache group sends no `groups` key, so single-group handshakes are byte for
    /// byte what peers of the previous version send; a hybrid cache's groups round-trip.
    #[test]
    fn groups_are_sent_only_for_hybrid_caches() {
        let plain = sample().encode();
        assert!(!plain.windows(6).any(|w| w == b"groups"));
        let mut m = sample();
        if let Some(l) = m.kvxfer_layout.as_mut() {
            l.groups = Some(vec![vec![0], vec![1]]);
        }
        let back = HandshakeMeta::decode(&m.encode(), MAX_HANDSHAKE_BYTES).unwrap();
        assert_eq!(
            back.kvxfer_layout.unwrap().groups,
            Some(vec![vec![0], vec![1]])
        );
    }

    /// State groups are marked only with groups, at valid indices; absent, none are.
    #[test]
    fn state_groups_mark_groups_a_peer_named() {
        let mut l = sample().kvxfer_layout.unwrap();
        assert_eq!(l.to_groups(2).unwrap(), None);
        l.state_groups = Some(vec![0]);
        assert!(l.to_groups(2).is_err(), "state groups without groups");
        l.groups = Some(vec![vec![0], vec![1]]);
        let g = l.to_groups(2).unwrap().unwrap();
        assert!(g.is_state(0) && !g.is_state(1));
        l.state_groups = None;
        assert!(!l.to_groups(2).unwrap().unwrap().has_state());
        for bad in [vec![2], vec![0, 1], vec![1, 1]] {
            l.state_groups = Some(bad.clone());
            assert!(l.to_groups(2).is_err(), "{bad:?}");
        }
        assert!(l.to_groups(3).is_err(), "groups naming 2 of 3 layers");
    }

    #[test]
    fn malformed_payloads_are_errors() {
        let bytes = sample().encode();
        for n in [0, 1, bytes.len() / 3, bytes.len() - 1] {
            assert!(
                HandshakeMeta::decode(&bytes[..n], MAX_HANDSHAKE_BYTES).is_err(),
                "truncated {n}"
            );
        }
        // Wrong types: num_blocks as a string.
        #[derive(Serialize)]
        struct WrongType<'a> {
            engine_id: &'a str,
            #[serde(with = "serde_bytes")]
            agent_metadata: &'a [u8],
            kv_caches_base_addr: Vec<u64>,
            num_blocks: &'a str,
            tp_size: u64,
            block_len: u64,
            attn_backend_name: &'a str,
        }
        let wrong = rmp_serde::to_vec_named(&WrongType {
            engine_id: "x",
            agent_metadata: b"m",
            kv_caches_base_addr: vec![1],
            num_blocks: "ten",
            tp_size: 1,
            block_len: 1,
            attn_backend_name: "b",
        })
        .unwrap();
        assert!(matches!(
            HandshakeMeta::decode(&wrong, MAX_HANDSHAKE_BYTES),
            Err(WireError::Malformed { .. })
        ));
        // Huge declared lengths: a map of one key whose array claims 2^32-1 elements, and a
        // bin claiming 4 GiB, in a few bytes. Must fail without allocating that much.
        let mut huge_array = vec![0x81, 0xb3];
        huge_array.extend_from_slice(b"kv_caches_base_addr");
        huge_array.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]);
        assert!(HandshakeMeta::decode(&huge_array, MAX_HANDSHAKE_BYTES).is_err());
        let mut huge_bin = vec![0x81, 0xae];
        huge_bin.extend_from_slice(b"agent_metadata");
        huge_bin.extend_from_slice(&[0xc6, 0xff, 0xff, 0xff, 0xff, 0x00]);
        assert!(HandshakeMeta::decode(&huge_bin, MAX_HANDSHAKE_BYTES).is_err());
        // Over the size limit: refused before decoding.
        assert!(matches!(
            HandshakeMeta::decode(&bytes, 8),
            Err(WireError::TooLarge { .. })
        ));
        // Inconsistent content.
        let mut m = sample();
        m.kv_caches_base_addr.pop();
        assert!(matches!(
            HandshakeMeta::decode(&m.encode(), MAX_HANDSHAKE_BYTES),
            Err(WireError::Invalid { .. })
        ));
        let mut m = sample();
        m.tp_size = 0;
        assert!(HandshakeMeta::decode(&m.encode(), MAX_HANDSHAKE_BYTES).is_err());
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut state = 0x1234_5678_9abc_def1u64;
        let base = sample().encode();
        for i in 0..2000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut b = base.clone();
            // Flip a few bytes of a valid message, or use pure noise.
            if i % 2 == 0 {
                for k in 0..4 {
                    let at = ((state >> (k * 16)) as usize) % b.len();
                    b[at] ^= (state >> (k * 8)) as u8;
                }
            } else {
                b = (0..(state % 200) as usize)
                    .map(|k| (state >> (k % 57)) as u8)
                    .collect();
            }
            let _ = HandshakeMeta::decode(&b, MAX_HANDSHAKE_BYTES);
        }
    }
}
