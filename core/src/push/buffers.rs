//! What a push-mode rank registers: its KV cache, aux buffers and state buffers.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use super::messages::BufferWire;
use crate::pull::KvCache;
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
    /// Every (base, bytes) range to register: KV regions merged where adjacent, then aux and
    /// state buffers.
    pub(crate) fn ranges(&self) -> Vec<(MemoryKind, u64, u64)> {
        let mut bases = self.kv.bases.clone();
        bases.sort_unstable();
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
