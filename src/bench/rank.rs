//! One rank's KV cache for the bench: host memory laid out by its cache spec.

use std::ops::{Deref, DerefMut};

use kvxfer_core::MemoryKind;
use kvxfer_core::connector::KvCache;
use kvxfer_host_mem::mem::HostMem;
use kvxfer_host_mem::shm::SharedHostMem;
use kvxfer_layout::CacheSpec;

use super::config::{BenchError, Memory};
use crate::models::ModelShape;

/// A rank's bytes: private, or in kvxfer shared memory (`--memory shared-host`).
pub(crate) enum RankMem {
    Private(HostMem),
    Shared(SharedHostMem),
}

// The bench fills a rank before any transfer and checks it after every transfer ended,
// and only its own agents map its shared memory: while a slice lives, nothing else
// writes the bytes.
impl Deref for RankMem {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            RankMem::Private(m) => m,
            // SAFETY: `len` bytes mapped for the life of `m`; see above for why no one
            // writes them meanwhile.
            RankMem::Shared(m) => unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) },
        }
    }
}

impl DerefMut for RankMem {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            RankMem::Private(m) => m,
            // SAFETY: as in `deref`, and `&mut self` is the only handle here.
            RankMem::Shared(m) => unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) },
        }
    }
}

pub(crate) struct Rank {
    pub(crate) mem: RankMem,
    pub(crate) spec: CacheSpec,
    pub(crate) first_head: u32,
    pub(crate) first_layer: u32,
}

impl Rank {
    pub(crate) fn new(
        spec: CacheSpec,
        first_head: u32,
        memory: Memory,
    ) -> Result<Self, BenchError> {
        let len = usize::try_from(spec.total_bytes())
            .map_err(|_| BenchError::Config("KV cache larger than the address space".into()))?;
        Ok(Rank {
            mem: match memory {
                Memory::SharedHost => RankMem::Shared(SharedHostMem::try_new(len, 0x5a)?),
                _ => RankMem::Private(HostMem::try_new(len, 0x5a)?),
            },
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
            groups: None,
        }
    }
}
