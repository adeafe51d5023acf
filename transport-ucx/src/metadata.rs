//! The metadata a UCX agent hands its peers: name, UCP worker address, and for every
//! registered region its kind, range and packed remote key. Decoding is bounded and never
//! panics: it is fed bytes from the network.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_core::{AddrRange, MemoryKind};

const MAGIC: &[u8; 4] = b"KVXU";
const VERSION: u8 = 1;
/// Longest agent name accepted.
pub const MAX_NAME: usize = 256;
/// Most regions one agent may advertise.
pub const MAX_REGIONS: usize = 1 << 16;
/// Largest worker address or packed key accepted (UCX's are well under 4 KiB).
pub const MAX_BLOB: usize = 64 << 10;

/// One advertised region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionMeta {
    /// Memory kind.
    pub kind: MemoryKind,
    /// Address range in the owner's address space.
    pub range: AddrRange,
    /// `ucp_rkey_pack` output.
    pub rkey: Vec<u8>,
}

/// Decoded metadata of one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentMeta {
    /// Agent name.
    pub name: String,
    /// `ucp_worker_get_address` output.
    pub worker_address: Vec<u8>,
    /// Registered regions.
    pub regions: Vec<RegionMeta>,
}

fn put_blob(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

impl AgentMeta {
    /// Encodes to bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.push(VERSION);
        put_blob(&mut out, self.name.as_bytes());
        put_blob(&mut out, &self.worker_address);
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            let (tag, device) = match r.kind {
                MemoryKind::Host => (0u8, 0u32),
                MemoryKind::Gpu { device } => (1, device),
            };
            out.push(tag);
            out.extend_from_slice(&device.to_le_bytes());
            out.extend_from_slice(&r.range.addr.to_le_bytes());
            out.extend_from_slice(&r.range.len.to_le_bytes());
            put_blob(&mut out, &r.rkey);
        }
        out
    }

    /// Decodes bytes from a peer; every length is checked against the input and the limits.
    pub fn decode(bytes: &[u8]) -> Result<AgentMeta, String> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != MAGIC {
            return Err("not kvxfer UCX metadata".into());
        }
        let version = r.take(1)?[0];
        if version != VERSION {
            return Err(format!("metadata version {version}, expected {VERSION}"));
        }
        let name = r.blob(MAX_NAME, "agent name")?;
        if name.is_empty() {
            return Err("empty agent name".into());
        }
        let name = std::str::from_utf8(name)
            .map_err(|_| "agent name is not UTF-8")?
            .to_string();
        let worker_address = r.blob(MAX_BLOB, "worker address")?.to_vec();
        if worker_address.is_empty() {
            return Err("empty worker address".into());
        }
        let count = r.u32()? as usize;
        if count > MAX_REGIONS {
            return Err(format!("{count} regions (limit {MAX_REGIONS})"));
        }
        // Each region takes at least 25 bytes: refuse counts the input cannot hold before
        // allocating for them.
        if count > r.remaining() / 25 {
            return Err("truncated metadata".into());
        }
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            let tag = r.take(1)?[0];
            let device = r.u32()?;
            let addr = r.u64()?;
            let len = r.u64()?;
            let kind = match tag {
                0 => MemoryKind::Host,
                1 => MemoryKind::Gpu { device },
                t => return Err(format!("memory kind tag {t}")),
            };
            if addr.checked_add(len).is_none() || len == 0 {
                return Err(format!("region {addr:#x}+{len} is empty or wraps around"));
            }
            let rkey = r.blob(MAX_BLOB, "remote key")?.to_vec();
            if rkey.is_empty() {
                return Err("empty remote key".into());
            }
            regions.push(RegionMeta {
                kind,
                range: AddrRange::new(addr, len),
                rkey,
            });
        }
        if r.remaining() != 0 {
            return Err(format!("{} trailing bytes", r.remaining()));
        }
        Ok(AgentMeta {
            name,
            worker_address,
            regions,
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.at)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or("truncated metadata")?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let s = self.take(8)?;
        let mut b = [0u8; 8];
        b.copy_from_slice(s);
        Ok(u64::from_le_bytes(b))
    }

    fn blob(&mut self, limit: usize, what: &str) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        if n > limit {
            return Err(format!("{what} of {n} bytes (limit {limit})"));
        }
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMeta {
        AgentMeta {
            name: "prefill-0".into(),
            worker_address: vec![1, 2, 3, 4, 5],
            regions: vec![
                RegionMeta {
                    kind: MemoryKind::Host,
                    range: AddrRange::new(0x1000, 4096),
                    rkey: vec![9; 40],
                },
                RegionMeta {
                    kind: MemoryKind::Gpu { device: 3 },
                    range: AddrRange::new(0x7000_0000, 1 << 20),
                    rkey: vec![7; 12],
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        assert_eq!(AgentMeta::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn every_truncation_and_bit_flip_is_refused_or_decodes_without_panic() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            assert!(
                AgentMeta::decode(&bytes[..n]).is_err(),
                "prefix {n} accepted"
            );
        }
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                let _ = AgentMeta::decode(&b);
            }
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(AgentMeta::decode(&extra).is_err());
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let mut b = MAGIC.to_vec();
        b.push(VERSION);
        put_blob(&mut b, b"x");
        put_blob(&mut b, b"addr");
        b.extend_from_slice(&(MAX_REGIONS as u32).to_le_bytes());
        assert!(AgentMeta::decode(&b).unwrap_err().contains("truncated"));
        let mut b = MAGIC.to_vec();
        b.push(VERSION);
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(AgentMeta::decode(&b).unwrap_err().contains("limit"));
    }
}
