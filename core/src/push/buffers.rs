//! What a push-mode rank registers: its KV cache, aux buffers and state buffers.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use super::messages::BufferWire;
use crate::connector::KvCache;
use crate::transport::{AddrRange, MemoryKind, Registration, Transport, TransportResult};

/// Kind of per-request state besides the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateKind {
    /// No state buffers.
    None,
    /// Mamba: exactly one state index per request.
    Mamba,
    /// Sliding-window / NSA: state indexed like pages.
    Window,
}

/// A push-mode rank's buffers.
#[derive(Debug, Clone)]
pub struct PushBuffers {
    /// KV cache (a prefill stage's layers, or all layers on decode).
    pub kv: KvCache,
    /// Aux buffers (host memory: output ids, logprobs, ...).
    pub aux: Vec<BufferWire>,
    /// State buffers.
    pub state: Vec<BufferWire>,
    /// Kind of state.
    pub state_kind: StateKind,
}

impl PushBuffers {
    /// Every (base, bytes) range to register: KV regions merged where adjacent (a region
    /// KV cache groups share, once), then aux and state buffers.
    pub(crate) fn ranges(&self) -> Vec<(MemoryKind, u64, u64)> {
        let mut bases = self.kv.bases.clone();
        bases.sort_unstable();
        // Regions that KV cache groups share are registered once.
        bases.dedup();
        let len = self.kv.spec.region_len();
        let mut out: Vec<(MemoryKind, u64, u64)> = Vec::new();
        for b in bases {
            match out.last_mut() {
                Some((_, a, l)) if a.checked_add(*l) == Some(b) => *l = l.saturating_add(len),
                _ => out.push((self.kv.memory, b, len)),
            }
        }
        // Aux data lives in host memory; state beside the KV cache.
        let extra = self
            .aux
            .iter()
            .map(|b| (MemoryKind::Host, b))
            .chain(self.state.iter().map(|b| (self.kv.memory, b)));
        for (kind, buf) in extra {
            let bytes = buf.item_len.saturating_mul(u64::from(buf.items));
            if bytes > 0 {
                out.push((kind, buf.base, bytes));
            }
        }
        out
    }

    /// Registers every range with `t`.
    pub(crate) fn register<T: Transport>(&self, t: &mut T) -> TransportResult<Vec<Registration>> {
        self.ranges()
            .into_iter()
            .map(|(kind, base, len)| t.register(kind, AddrRange::new(base, len)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_layout::{BlockOrder, CacheKind, CacheParams, CacheSpec, Dtype};

    /// Four regions (2 layers, K and V) at `bases`, on the GPU, with `aux` and `state`.
    fn bufs(bases: [u64; 4], aux: Vec<BufferWire>, state: Vec<BufferWire>) -> PushBuffers {
        let spec = CacheSpec::new(CacheParams {
            kind: CacheKind::SplitKv,
            order: BlockOrder::Hnd,
            dtype: Dtype::F16,
            num_layers: 2,
            kv_heads: 1,
            head_dim: 8,
            tokens_per_block: 4,
            num_blocks: 2,
        })
        .expect("spec");
        assert_eq!(spec.region_len(), 128);
        PushBuffers {
            kv: KvCache {
                spec,
                bases: bases.to_vec(),
                memory: MemoryKind::Gpu { device: 0 },
                total_kv_heads: 1,
                total_layers: 2,
                first_layer: 0,
                layer_windows: None,
                groups: None,
            },
            aux,
            state,
            state_kind: StateKind::None,
        }
    }

    fn buf(base: u64, item_len: u64, items: u32) -> BufferWire {
        BufferWire {
            base,
            item_len,
            items,
        }
    }

    /// Regions that touch, in any order, register as one range; a gap starts another.
    /// Aux buffers are host memory, state buffers live with the KV; empty ones are skipped.
    #[test]
    fn adjacent_regions_merge_and_every_nonempty_buffer_registers() {
        let gpu = MemoryKind::Gpu { device: 0 };
        let b = bufs(
            [0x1080, 0x1000, 0x2000, 0x1100],
            vec![buf(0x9000, 16, 4), buf(0x9100, 16, 0)],
            vec![buf(0xa000, 0, 3), buf(0xb000, 8, 2)],
        );
        assert_eq!(
            b.ranges(),
            vec![
                (gpu, 0x1000, 0x180),
                (gpu, 0x2000, 0x80),
                (MemoryKind::Host, 0x9000, 64),
                (gpu, 0xb000, 16),
            ]
        );
    }

    /// A hybrid model's layers of two KV cache groups overlay the same memory: each shared
    /// region registers once (a transport refuses overlapping registrations).
    #[test]
    fn regions_kv_cache_groups_share_register_once() {
        let gpu = MemoryKind::Gpu { device: 0 };
        let b = bufs([0x1000, 0x1080, 0x1000, 0x1080], Vec::new(), Vec::new());
        assert_eq!(b.ranges(), vec![(gpu, 0x1000, 0x100)]);
    }
}
