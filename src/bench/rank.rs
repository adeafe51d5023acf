//! One rank's KV cache for the bench: host memory laid out by its cache spec.

use kvxfer_core::MemoryKind;
use kvxfer_core::pull::KvCache;
use kvxfer_layout::CacheSpec;

use super::BenchError;
use crate::models::ModelShape;

pub(crate) struct Rank {
    pub(crate) mem: kvxfer_core::host_mem::HostMem,
    pub(crate) spec: CacheSpec,
    pub(crate) first_head: u32,
    pub(crate) first_layer: u32,
}

impl Rank {
    pub(crate) fn new(spec: CacheSpec, first_head: u32) -> Result<Self, BenchError> {
        let len = usize::try_from(spec.total_bytes())
            .map_err(|_| BenchError::Config("KV cache larger than the address space".into()))?;
        Ok(Rank {
            mem: kvxfer_core::host_mem::HostMem::try_new(len, 0x5a)?,
            spec,
            first_head,
            first_layer: 0,
        })
    }

    pub(crate) fn kv(&mut self, model: &ModelShape) -> KvCache {
        let base = self.mem.as_mut_ptr() as u64;
        KvCache {
            spec: self.spec,
            bases: (0..u64::from(self.spec.num_regions()))
                .map(|r| base + r * self.spec.region_len())
                .collect(),
            memory: MemoryKind::Host,
            total_kv_heads: model.kv_heads,
            total_layers: model.layers,
            first_layer: self.first_layer,
            layer_windows: None,
        }
    }
}
