//! What both connectors know of the engine's KV cache: its spec, where each region lies,
//! the model's size around this rank, and its KV cache groups.

use kvxfer_layout::{CacheKind, CacheSpec, HeadSharding, LayerGroups};

use crate::transport::MemoryKind;

/// The engine's KV cache: its spec, one base address per region, and where it lives.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// This rank's cache spec.
    pub spec: CacheSpec,
    /// Base address of each region.
    pub bases: Vec<u64>,
    /// Host or GPU memory.
    pub memory: MemoryKind,
    /// KV heads of the whole model.
    pub total_kv_heads: u32,
    /// Layers of the whole model.
    pub total_layers: u32,
    /// Global index of this rank's first layer.
    pub first_layer: u32,
    /// Optional attention window (in blocks) per global layer.
    pub layer_windows: Option<Vec<Option<u32>>>,
    /// The KV cache groups of a hybrid model (layers of each attention kind, with a block
    /// table each; a layer of each group may share its region with one of another group, as
    /// vLLM lays them out). `None`: one group of every layer.
    pub groups: Option<LayerGroups>,
}

impl KvCache {
    /// Number of KV cache groups (1 without `groups`).
    pub fn group_count(&self) -> usize {
        self.groups.as_ref().map_or(1, LayerGroups::len)
    }

    /// Checks the regions against the spec: disjoint, or aliased across KV cache groups
    /// only; groups need the whole model in one stage and no per-layer windows.
    pub fn check(&self) -> Result<(), kvxfer_layout::LayoutError> {
        use kvxfer_layout::{CacheSide, LayoutError};
        match &self.groups {
            None => CacheSide::new(&self.spec, &self.bases, self.first_layer).map(|_| ()),
            Some(g) => {
                if self.first_layer != 0 || self.total_layers != self.spec.num_layers() {
                    return Err(LayoutError::Unsupported(
                        "KV cache groups with pipeline stages (a hybrid model split across stages)"
                            .into(),
                    ));
                }
                if self.layer_windows.is_some() {
                    return Err(LayoutError::Unsupported(
                        "KV cache groups with per-layer windows (a sliding-window group holds only its window's blocks)".into(),
                    ));
                }
                g.check_regions(&self.spec, &self.bases)
            }
        }
    }
}

impl KvCache {
    /// How heads shard across TP for this cache.
    pub fn sharding(&self) -> HeadSharding {
        match self.spec.kind() {
            CacheKind::Mla => HeadSharding::Replicated,
            _ => HeadSharding::Split {
                total_kv_heads: self.total_kv_heads,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_layout::{BlockOrder, CacheParams, Dtype};

    fn cache(kind: CacheKind, kv_heads: u32) -> KvCache {
        let spec = CacheSpec::new(CacheParams {
            kind,
            order: BlockOrder::Hnd,
            dtype: Dtype::F16,
            num_layers: 2,
            kv_heads,
            head_dim: 8,
            tokens_per_block: 4,
            num_blocks: 4,
        })
        .expect("spec");
        KvCache {
            spec,
            bases: vec![0x1000; spec.num_regions() as usize],
            memory: MemoryKind::Host,
            total_kv_heads: 8,
            total_layers: 2,
            first_layer: 0,
            layer_windows: None,
            groups: None,
        }
    }

    /// MLA's latent is the same on every TP rank; other caches split the model's heads.
    #[test]
    fn mla_is_replicated_and_other_caches_split_the_models_heads() {
        assert_eq!(
            cache(CacheKind::Mla, 1).sharding(),
            HeadSharding::Replicated
        );
        for kind in [CacheKind::SplitKv, CacheKind::JointKv, CacheKind::PackedKv] {
            assert_eq!(
                cache(kind, 4).sharding(),
                HeadSharding::Split { total_kv_heads: 8 }
            );
        }
    }
}
