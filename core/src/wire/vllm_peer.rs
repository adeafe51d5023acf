//! A stock vLLM 0.32 peer (NixlConnector, connector version 14) in kvxfer's terms, both
//! ways: the payload a kvxfer prefill rank serves stock decodes, and a stock prefill's
//! metadata as the geometry a kvxfer connection is built from (with its regions, layout
//! name, KV cache group marks and block expiry). Pure translation; the pull worker does the
//! I/O (`pull::worker::vllm`).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::{BlockOrder, CacheKind, CacheSpec};

use crate::connector::KvCache;
use crate::transport::{AddrRange, MemoryKind};
use crate::wire::handshake::HandshakeMeta;
use crate::wire::vllm::{AgentMetadata, CompatFactors, HandshakePayload};

/// What a worker needs to speak vLLM 0.32's NixlConnector handshake with stock vLLM peers:
/// its compatibility factors (inside vLLM, from the engine config) and its regions' names.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmCompat {
    /// This engine's factors; their hash is served to and expected from stock peers.
    pub factors: CompatFactors,
    /// Refuse stock peers whose hash differs (vLLM's `enforce_handshake_compat`).
    pub enforce_hash: bool,
    /// The layer name of each region, in region order (vLLM's `region_names`).
    pub region_names: Vec<String>,
    /// Whether stock vLLM decodes may pull from this rank. Off where they would misread
    /// this engine's hand-off (a hybrid prefill that stops before the last prompt token,
    /// which vLLM's decode does not expect); kvxfer decodes are unaffected.
    pub serve_decodes: bool,
}

#[derive(Debug, Clone, PartialEq)]
/// What a stock vLLM prefill rank advertised beyond the geometry.
pub struct StockMeta {
    /// The regions NIXL's blob covers, checked against before posting.
    pub regions: Vec<(MemoryKind, AddrRange)>,
    /// `LBHNC` or `LBNHC`.
    pub kv_cache_layout: String,
    /// Tokens per block.
    pub block_size: u32,
    /// The base of each region, as vLLM registers them (one per distinct memory).
    pub bases: Vec<u64>,
    /// vLLM's `region_group_ids`: each region's KV cache group, -1 where groups share it.
    pub region_group_ids: Option<Vec<i64>>,
    /// vLLM's `region_names`: each region's first layer.
    pub region_names: Option<Vec<String>>,
}

/// The payload vLLM's NixlConnector would serve for this cache of engine `engine_id`: one
/// region per distinct memory, blocks contiguous, NIXL's own agent metadata (`native`).
pub fn payload(compat: &VllmCompat, cache: &KvCache, engine_id: &str, native: Vec<u8>) -> Vec<u8> {
    let spec = &cache.spec;
    let regions = cache.bases.len();
    let (device_id, mem) = match cache.memory {
        MemoryKind::Host => (0, "DRAM"),
        MemoryKind::Gpu { device } => (device, "VRAM"),
    };
    let blocks = u64::from(spec.num_blocks());
    let stock = StockRegions::of(cache);
    let names = (compat.region_names.len() == regions).then(|| {
        stock
            .first
            .iter()
            .map(|&r| compat.region_names[r].clone())
            .collect()
    });
    let regions = stock.first.len();
    let meta = AgentMetadata {
        engine_id: engine_id.to_string(),
        agent_metadata: native,
        kv_caches_base_addr: stock.first.iter().map(|&r| cache.bases[r]).collect(),
        device_id,
        num_blocks: blocks,
        block_lens: vec![spec.block_len(); regions],
        block_strides: vec![spec.block_len(); regions],
        kv_cache_layout: layout_name(spec).into(),
        block_size: spec.tokens_per_block(),
        ssm_sizes: vec![0, 0],
        attn_backend_name: compat.factors.attn_backend_name.clone(),
        physical_blocks_per_logical_kv_block: 1,
        region_num_blocks: Some(vec![blocks; regions]),
        region_group_ids: Some(stock.group_ids),
        region_names: names,
        region_mem_types: Some(vec![mem.to_string(); regions]),
        dcp_size: 1,
        pcp_size: 1,
        ple_block_len: None,
        region_members: Vec::new(),
        packed_member_layouts: Default::default(),
    };
    HandshakePayload {
        compatibility_hash: compat.factors.hash(),
        agent_metadata_bytes: meta.encode(),
    }
    .encode()
}

/// How vLLM's NixlConnector registers a cache: one region per distinct memory, in layer
/// order, each named after its first layer and marked with its layers' KV cache group, or
/// -1 where layers of several groups share it (the hybrid manager's overlay). kvxfer keeps
/// one region per layer, an overlaid region's base repeated.
#[derive(Debug, PartialEq, Eq)]
pub struct StockRegions {
    /// Per stock region, the kvxfer region that introduced it.
    pub first: Vec<usize>,
    /// Per kvxfer region, its stock region.
    pub region_of: Vec<usize>,
    /// Per stock region, vLLM's `region_group_ids` entry.
    pub group_ids: Vec<i64>,
}

/// vLLM's mark of a region that layers of several KV cache groups share.
const SHARED_GROUP: i64 = -1;

impl StockRegions {
    /// The stock regions of `cache`.
    pub fn of(cache: &KvCache) -> Self {
        let per_layer = cache
            .spec
            .num_regions()
            .checked_div(cache.spec.num_layers())
            .unwrap_or(1)
            .max(1) as usize;
        let group_of = |r: usize| -> i64 {
            let layer = r.checked_div(per_layer).unwrap_or(0);
            cache.groups.as_ref().map_or(0, |g| {
                g.as_slice()
                    .iter()
                    .position(|ls| ls.iter().any(|&l| l as usize == layer))
                    .map_or(SHARED_GROUP, |i| i64::try_from(i).unwrap_or(SHARED_GROUP))
            })
        };
        let mut out = StockRegions {
            first: Vec::new(),
            region_of: Vec::with_capacity(cache.bases.len()),
            group_ids: Vec::new(),
        };
        for (r, &base) in cache.bases.iter().enumerate() {
            let group = group_of(r);
            match out.first.iter().position(|&f| cache.bases[f] == base) {
                Some(s) => {
                    if out.group_ids[s] != group {
                        out.group_ids[s] = SHARED_GROUP;
                    }
                    out.region_of.push(s);
                }
                None => {
                    out.region_of.push(out.first.len());
                    out.first.push(r);
                    out.group_ids.push(group);
                }
            }
        }
        out
    }

    /// A stock prefill's region bases as kvxfer's regions of this (the decode's) cache: its
    /// regions must be ours one for one (the same model on the same vLLM overlays the same
    /// layers), checked by count, by group marks and by layer names where both sides have
    /// them. `names` are this cache's layer names per kvxfer region.
    pub fn expand(&self, native: &StockMeta, names: &[String]) -> Result<Vec<u64>, String> {
        let theirs = &native.bases;
        if theirs.len() != self.first.len() {
            return Err(format!(
                "the prefill registers {} regions, this decode {} (its layers share memory \
                 otherwise: another model or another KV cache group layout)",
                theirs.len(),
                self.first.len()
            ));
        }
        if let Some(groups) = &native.region_group_ids
            && groups != &self.group_ids
        {
            return Err(format!(
                "KV cache groups of the regions (vLLM's region_group_ids): local {:?}, remote {:?}",
                first(&self.group_ids),
                first(groups)
            ));
        }
        if let Some(remote) = &native.region_names
            && names.len() == self.region_of.len()
        {
            let local: Vec<&String> = self.first.iter().map(|&r| &names[r]).collect();
            if let Some(s) = (0..local.len()).find(|&s| *local[s] != remote[s]) {
                return Err(format!(
                    "region {s} is layer {:?} on the prefill, {:?} here",
                    remote[s], local[s]
                ));
            }
        }
        Ok(self.region_of.iter().map(|&s| theirs[s]).collect())
    }
}

/// vLLM's name of a cache's layout: layers outermost (`LB..`) or blocks outermost (`BL..`,
/// cross-layer), then heads before tokens (`HN`) or tokens before heads (`NH`).
pub fn layout_name(spec: &CacheSpec) -> &'static str {
    match (spec.kind(), spec.order()) {
        (CacheKind::CrossLayer, BlockOrder::Hnd) => "BLHNC",
        (CacheKind::CrossLayer, BlockOrder::Nhd) => "BLNHC",
        (_, BlockOrder::Hnd) => "LBHNC",
        (_, BlockOrder::Nhd) => "LBNHC",
    }
}

/// A stock rank's metadata in the form a connection is built from: the cache geometry as a
/// kvxfer peer's [`HandshakeMeta`] would give it (of a prefill of `tp_size` ranks), and what
/// its protocol says beyond it, the regions NIXL's blob covers among them.
pub fn from_stock(m: AgentMetadata, tp_size: u32) -> Result<(HandshakeMeta, StockMeta), String> {
    let block_len = m.block_lens[0];
    if m.block_lens.iter().any(|&l| l != block_len) || m.block_strides != m.block_lens {
        return Err(format!(
            "regions of uneven or strided blocks (lengths {:?}, strides {:?}) are not supported",
            first(&m.block_lens),
            first(&m.block_strides)
        ));
    }
    if (0..m.kv_caches_base_addr.len()).any(|r| m.region_blocks(r) != m.num_blocks) {
        return Err("regions with different block counts are not supported".into());
    }
    if m.dcp_size != 1 || m.pcp_size != 1 || m.physical_blocks_per_logical_kv_block != 1 {
        return Err(format!(
            "dcp_size {}, pcp_size {}, {} kernel blocks per block: kvxfer pulls plain blocks",
            m.dcp_size, m.pcp_size, m.physical_blocks_per_logical_kv_block
        ));
    }
    let mut regions = Vec::with_capacity(m.kv_caches_base_addr.len());
    for (r, &base) in m.kv_caches_base_addr.iter().enumerate() {
        let kind = match m.region_mem_types.as_ref().map(|t| t[r].as_str()) {
            None | Some("DRAM") => MemoryKind::Host,
            Some("VRAM") => MemoryKind::Gpu {
                device: m.device_id,
            },
            Some(other) => return Err(format!("region {r}: memory type {other:?}")),
        };
        let len = m
            .region_len(r)
            .ok_or_else(|| format!("region {r} has no extent"))?;
        regions.push((kind, AddrRange::new(base, len)));
    }
    let stock = StockMeta {
        regions,
        kv_cache_layout: m.kv_cache_layout,
        block_size: m.block_size,
        bases: m.kv_caches_base_addr.clone(),
        region_group_ids: m.region_group_ids,
        region_names: m.region_names,
    };
    let meta = HandshakeMeta {
        engine_id: m.engine_id,
        agent_metadata: m.agent_metadata,
        kv_caches_base_addr: m.kv_caches_base_addr,
        num_blocks: m.num_blocks,
        tp_size: u64::from(tp_size),
        block_len,
        attn_backend_name: m.attn_backend_name,
        kvxfer_protocol: None,
        kvxfer_tp_rank: None,
        kvxfer_layout: None,
        kvxfer_lease_ms: None,
        kvxfer_instance: None,
        kvxfer_stamps: None,
        kvxfer_digests: None,
    };
    Ok((meta, stock))
}

/// Seconds before a stock prefill's block expiry a read is declined, as vLLM's decode does:
/// room for the clock offset's error and the read itself.
pub const EXPIRY_MARGIN: f64 = 5.0;

/// Why a read of blocks the prefill frees at `expiry` (its clock) must not start now, where
/// `offset` is its clock minus ours: it could finish after they were freed and reused.
pub fn expired(expiry: f64, offset: f64, now: f64) -> Option<String> {
    let deadline = expiry - offset;
    (now + EXPIRY_MARGIN >= deadline).then(|| {
        format!(
            "the prefill frees these blocks in {:.1} s (its clock, offset {offset:+.3} s): too late to read them safely",
            deadline - now
        )
    })
}

fn first<T>(v: &[T]) -> &[T] {
    &v[..v.len().min(4)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_layout::{CacheKind, CacheParams, CacheSpec, Dtype};

    fn cache(order: BlockOrder) -> KvCache {
        let spec = CacheSpec::new(CacheParams {
            kind: CacheKind::PackedKv,
            order,
            dtype: Dtype::F32,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 64,
            tokens_per_block: 32,
            num_blocks: 100,
        })
        .unwrap();
        KvCache {
            spec,
            bases: vec![0x10_0000, 0x90_0000],
            memory: MemoryKind::Host,
            total_kv_heads: 2,
            total_layers: 2,
            first_layer: 0,
            layer_windows: None,
            groups: None,
        }
    }

    fn compat(names: usize) -> VllmCompat {
        VllmCompat {
            factors: crate::wire::vllm::tests::factors(),
            enforce_hash: true,
            region_names: (0..names)
                .map(|i| format!("model.layers.{i}.self_attn.attn"))
                .collect(),
            serve_decodes: true,
        }
    }

    /// What we serve is what a vLLM prefill of the same cache serves, and what we read back
    /// from it is the same cache.
    #[test]
    fn the_served_payload_describes_the_cache_as_vllm_does_and_reads_back() {
        let (c, v) = (cache(BlockOrder::Hnd), compat(2));
        let bytes = payload(&v, &c, "prefill-7", b"nixl-blob".to_vec());
        let p = HandshakePayload::decode(&bytes, 1 << 20).unwrap();
        assert_eq!(p.compatibility_hash, v.factors.hash());
        let m = AgentMetadata::decode(&p.agent_metadata_bytes, 1 << 20).unwrap();
        assert_eq!(m.engine_id, "prefill-7");
        assert_eq!(m.agent_metadata, b"nixl-blob");
        assert_eq!(m.kv_caches_base_addr, c.bases);
        assert_eq!((m.num_blocks, m.block_size, m.device_id), (100, 32, 0));
        assert_eq!(m.block_lens, vec![32 * 1024; 2]);
        assert_eq!(m.block_strides, m.block_lens);
        assert_eq!(m.kv_cache_layout, "LBHNC");
        assert_eq!(m.attn_backend_name, "CPU_ATTN");
        assert_eq!(
            m.region_names.as_ref().unwrap()[1],
            "model.layers.1.self_attn.attn"
        );
        assert_eq!(m.region_mem_types, Some(vec!["DRAM".to_string(); 2]));
        let (meta, n) = from_stock(m, 1).unwrap();
        assert_eq!(meta.block_len, c.spec.block_len());
        assert_eq!(meta.kv_caches_base_addr, c.bases);
        assert_eq!(
            n.regions,
            vec![
                (MemoryKind::Host, AddrRange::new(0x10_0000, 100 * 32 * 1024)),
                (MemoryKind::Host, AddrRange::new(0x90_0000, 100 * 32 * 1024)),
            ]
        );
        assert_eq!((n.kv_cache_layout.as_str(), n.block_size), ("LBHNC", 32));
        // Names that do not match the regions are left out rather than misattributed; NHD
        // blocks are named as vLLM names them.
        let bytes = payload(&compat(1), &cache(BlockOrder::Nhd), "prefill-7", vec![1]);
        let p = HandshakePayload::decode(&bytes, 1 << 20).unwrap();
        let m = AgentMetadata::decode(&p.agent_metadata_bytes, 1 << 20).unwrap();
        assert_eq!(
            (m.region_names, m.kv_cache_layout.as_str()),
            (None, "LBNHC")
        );
    }

    /// A hybrid cache: four layers, full attention (0, 2) and sliding window (1, 3), layer 1
    /// over layer 0's memory and layer 3 over layer 2's, as vLLM's hybrid manager lays them.
    fn hybrid() -> KvCache {
        let mut c = cache(BlockOrder::Hnd);
        c.spec = CacheSpec::new(CacheParams {
            num_layers: 4,
            ..*c.spec.params()
        })
        .unwrap();
        c.bases = vec![0x10_0000, 0x10_0000, 0x90_0000, 0x90_0000];
        c.total_layers = 4;
        c.groups = Some(kvxfer_layout::LayerGroups::new(vec![vec![0, 2], vec![1, 3]], 4).unwrap());
        c.check().unwrap();
        c
    }

    /// vLLM registers overlaid memory once, marked -1 and named after its first layer; a
    /// cache of one group keeps a region per kvxfer region, each in group 0.
    #[test]
    fn overlaid_regions_are_registered_once_as_vllm_does() {
        let plain = StockRegions::of(&cache(BlockOrder::Hnd));
        assert_eq!(
            plain,
            StockRegions {
                first: vec![0, 1],
                region_of: vec![0, 1],
                group_ids: vec![0, 0],
            }
        );
        let h = hybrid();
        let stock = StockRegions::of(&h);
        assert_eq!(
            stock,
            StockRegions {
                first: vec![0, 2],
                region_of: vec![0, 0, 1, 1],
                group_ids: vec![-1, -1],
            }
        );
        // Layers of one group each in a region of its own keep their group.
        let mut apart = hybrid();
        apart.bases = vec![0x10_0000, 0x90_0000, 0x110_0000, 0x190_0000];
        assert_eq!(StockRegions::of(&apart).group_ids, vec![0, 1, 0, 1]);
        // The payload served: two regions, the names of their first layers.
        let bytes = payload(&compat(4), &h, "p", vec![1]);
        let p = HandshakePayload::decode(&bytes, 1 << 20).unwrap();
        let m = AgentMetadata::decode(&p.agent_metadata_bytes, 1 << 20).unwrap();
        assert_eq!(m.kv_caches_base_addr, vec![0x10_0000, 0x90_0000]);
        assert_eq!(m.region_group_ids, Some(vec![-1, -1]));
        assert_eq!(
            m.region_names.clone().unwrap(),
            vec![
                "model.layers.0.self_attn.attn".to_string(),
                "model.layers.2.self_attn.attn".to_string()
            ]
        );
        assert_eq!(m.block_lens.len(), 2);
        // Read back by a decode of the same model: one base per layer again.
        let names = compat(4).region_names;
        let (_, n) = from_stock(m, 1).unwrap();
        assert_eq!(stock.expand(&n, &names).unwrap(), h.bases);
    }

    /// A stock prefill whose regions are not this decode's, one for one, is refused naming
    /// what differs.
    #[test]
    fn a_stock_prefill_whose_regions_differ_is_refused_by_name() {
        let h = hybrid();
        let names = compat(4).region_names;
        let native =
            |bases: Vec<u64>, groups: Option<Vec<i64>>, names: Option<Vec<String>>| StockMeta {
                regions: Vec::new(),
                kv_cache_layout: "LBHNC".into(),
                block_size: 32,
                bases,
                region_group_ids: groups,
                region_names: names,
            };
        let stock = StockRegions::of(&h);
        let err = stock
            .expand(&native(vec![1, 2, 3, 4], None, None), &names)
            .unwrap_err();
        assert!(err.contains("registers 4 regions, this decode 2"), "{err}");
        let err = stock
            .expand(&native(vec![1, 2], Some(vec![0, 1]), None), &names)
            .unwrap_err();
        assert!(err.contains("local [-1, -1], remote [0, 1]"), "{err}");
        let swapped = vec![names[2].clone(), names[0].clone()];
        let err = stock
            .expand(
                &native(vec![1, 2], Some(vec![-1, -1]), Some(swapped)),
                &names,
            )
            .unwrap_err();
        assert!(err.contains("region 0 is layer \"model.layers.2"), "{err}");
        // Without group marks or names, the count decides; names are not compared where this
        // decode has none.
        assert_eq!(
            stock
                .expand(&native(vec![1, 2], None, None), &names)
                .unwrap(),
            vec![1, 1, 2, 2]
        );
        assert_eq!(
            stock
                .expand(
                    &native(vec![1, 2], None, Some(vec!["x".into(), "y".into()])),
                    &[]
                )
                .unwrap(),
            vec![1, 1, 2, 2]
        );
    }

    /// vLLM's names of its layouts: layers outermost for per-layer caches, blocks outermost
    /// for cross-layer ones.
    #[test]
    fn layouts_are_named_as_vllm_names_them() {
        let spec = |kind, order| {
            CacheSpec::new(CacheParams {
                kind,
                order,
                dtype: Dtype::F32,
                num_layers: 2,
                kv_heads: 2,
                head_dim: 8,
                tokens_per_block: 4,
                num_blocks: 3,
            })
            .unwrap()
        };
        for (kind, order, name) in [
            (CacheKind::PackedKv, BlockOrder::Hnd, "LBHNC"),
            (CacheKind::PackedKv, BlockOrder::Nhd, "LBNHC"),
            (CacheKind::SplitKv, BlockOrder::Hnd, "LBHNC"),
            (CacheKind::CrossLayer, BlockOrder::Hnd, "BLHNC"),
            (CacheKind::CrossLayer, BlockOrder::Nhd, "BLNHC"),
        ] {
            assert_eq!(layout_name(&spec(kind, order)), name, "{kind} {order}");
        }
    }

    /// vLLM's rule: a read is declined when the deadline, on our clock, is within the margin.
    #[test]
    fn reads_too_close_to_the_prefills_expiry_are_declined() {
        // Their clock runs 100 s ahead of ours: expiry 200 there is 100 here.
        assert!(expired(200.0, 100.0, 94.0).is_none());
        assert!(
            expired(200.0, 100.0, 95.0).is_some(),
            "exactly at the margin"
        );
        assert!(expired(200.0, 100.0, 99.0).unwrap().contains("1.0 s"));
        assert!(
            expired(200.0, -100.0, 250.0).is_none(),
            "their clock behind ours"
        );
    }

    #[test]
    fn stock_geometry_kvxfer_cannot_read_as_is_is_refused() {
        let base = || {
            let bytes = payload(&compat(2), &cache(BlockOrder::Hnd), "p", vec![1]);
            let p = HandshakePayload::decode(&bytes, 1 << 20).unwrap();
            AgentMetadata::decode(&p.agent_metadata_bytes, 1 << 20).unwrap()
        };
        type Change = fn(&mut AgentMetadata);
        let cases: [(&str, Change); 6] = [
            ("uneven", |m| m.block_lens[1] = 16),
            ("strided", |m| m.block_strides = vec![65536; 2]),
            ("counts", |m| m.region_num_blocks = Some(vec![100, 50])),
            ("dcp", |m| m.dcp_size = 2),
            ("kernel blocks", |m| {
                m.physical_blocks_per_logical_kv_block = 2
            }),
            ("memory", |m| {
                m.region_mem_types = Some(vec!["DRAM".into(), "FILE".into()])
            }),
        ];
        for (what, change) in cases {
            let mut m = base();
            change(&mut m);
            assert!(from_stock(m, 1).is_err(), "{what}");
        }
        let mut m = base();
        m.region_mem_types = Some(vec!["VRAM".into(); 2]);
        m.device_id = 3;
        let (meta, n) = from_stock(m, 2).unwrap();
        assert_eq!(meta.tp_size, 2);
        assert_eq!(n.regions[0].0, MemoryKind::Gpu { device: 3 });
    }
}
