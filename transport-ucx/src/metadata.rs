//! The metadata a UCX agent hands its peers: name, UCP worker address, and for every
//! registered region its kind, range and packed remote key. Decoding is bounded and never
//! panics: it is fed bytes from the network.
//!
//! An agent with regions in kvxfer shared memory ([`kvxfer_host_mem::shm`]) appends a section
//! after the regions: `SHM1`, the machine's boot id, and per such region its index and
//! [`Export`]. Agents without it encode exactly what earlier versions did (which refuse the
//! section: upgrade the reading side first).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_core::{AddrRange, MemoryKind};
use kvxfer_host_mem::shm::{Export, Token};

const MAGIC: &[u8; 4] = b"KVXU";
const SHARED_MAGIC: &[u8; 4] = b"SHM1";
/// Bytes of one shared-region entry: index, pid, fd, token, file length, offset.
const SHARED_ENTRY: usize = 4 + 4 + 4 + 16 + 8 + 8;
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
    /// Where a same-host peer can map it (host memory in kvxfer shared memory).
    pub shared: Option<Export>,
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
    /// The owner's boot id, sent when a region is shared: only a peer on the same machine
    /// maps.
    pub host: Option<Token>,
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
        let shared: Vec<(usize, &Export)> = self
            .regions
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.shared.as_ref().map(|e| (i, e)))
            .collect();
        if let (Some(host), false) = (self.host, shared.is_empty()) {
            out.extend_from_slice(SHARED_MAGIC);
            out.extend_from_slice(&host);
            out.extend_from_slice(&(shared.len() as u32).to_le_bytes());
            for (i, e) in shared {
                out.extend_from_slice(&(i as u32).to_le_bytes());
                out.extend_from_slice(&e.pid.to_le_bytes());
                out.extend_from_slice(&e.fd.to_le_bytes());
                out.extend_from_slice(&e.token);
                out.extend_from_slice(&e.file_len.to_le_bytes());
                out.extend_from_slice(&e.offset.to_le_bytes());
            }
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
                shared: None,
            });
        }
        let host = if r.remaining() == 0 {
            None
        } else {
            Some(decode_shared(&mut r, &mut regions)?)
        };
        if r.remaining() != 0 {
            return Err(format!("{} trailing bytes", r.remaining()));
        }
        Ok(AgentMeta {
            name,
            worker_address,
            regions,
            host,
        })
    }
}

/// The shared-memory section: fills `shared` of the regions it names (each once, in
/// order, host memory only, inside its memfd) and returns the boot id.
fn decode_shared(r: &mut Reader<'_>, regions: &mut [RegionMeta]) -> Result<Token, String> {
    if r.take(4)? != SHARED_MAGIC {
        return Err("unknown section after the regions".into());
    }
    let host = token(r.take(16)?);
    let count = r.u32()? as usize;
    if count == 0 || count > regions.len() || count > r.remaining() / SHARED_ENTRY {
        return Err(format!("{count} shared regions"));
    }
    let mut last: Option<usize> = None;
    for _ in 0..count {
        let i = r.u32()? as usize;
        if last.is_some_and(|l| i <= l) || i >= regions.len() {
            return Err(format!("shared region index {i}"));
        }
        last = Some(i);
        let pid = r.u32()?;
        let fd = r.u32()? as i32;
        let token = token(r.take(16)?);
        let file_len = r.u64()?;
        let offset = r.u64()?;
        let region = &mut regions[i];
        let fits = offset
            .checked_add(region.range.len)
            .is_some_and(|end| end <= file_len);
        if region.kind != MemoryKind::Host || !fits {
            return Err(format!(
                "shared region {i} is not host memory inside its file"
            ));
        }
        region.shared = Some(Export {
            pid,
            fd,
            token,
            file_len,
            offset,
        });
    }
    Ok(host)
}

fn token(b: &[u8]) -> Token {
    let mut t = [0u8; 16];
    t.copy_from_slice(b);
    t
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
                    shared: None,
                },
                RegionMeta {
                    kind: MemoryKind::Gpu { device: 3 },
                    range: AddrRange::new(0x7000_0000, 1 << 20),
                    rkey: vec![7; 12],
                    shared: None,
                },
                RegionMeta {
                    kind: MemoryKind::Host,
                    range: AddrRange::new(0x9000, 8192),
                    rkey: vec![5; 20],
                    shared: Some(Export {
                        pid: 77,
                        fd: 5,
                        token: [3; 16],
                        file_len: 16384,
                        offset: 8192,
                    }),
                },
            ],
            host: Some([8; 16]),
        }
    }

    /// Bytes with the shared section's entry for region 2 replaced by `edit`'s output.
    fn with_entry(edit: impl Fn(&mut [u8])) -> Result<AgentMeta, String> {
        let mut b = sample().encode();
        let at = b.len() - SHARED_ENTRY;
        edit(&mut b[at..]);
        AgentMeta::decode(&b)
    }

    #[test]
    fn without_shared_regions_the_encoding_is_the_first_version() {
        let mut m = sample();
        m.regions[2].shared = None;
        let b = m.encode();
        assert!(!b.windows(4).any(|w| w == SHARED_MAGIC));
        let back = AgentMeta::decode(&b).unwrap();
        assert_eq!(back.host, None, "no section, no host");
        m.host = None;
        assert_eq!(back, m);
        let mut m = sample();
        m.host = None;
        assert!(!m.encode().windows(4).any(|w| w == SHARED_MAGIC));
    }

    #[test]
    fn shared_entries_that_do_not_fit_their_region_are_refused() {
        assert!(with_entry(|_| {}).is_ok());
        // Region 0 is host memory too, 4096 bytes, and fits at offset 8192 of 16384.
        assert!(with_entry(|e| e[0] = 0).is_ok());
        let gpu = with_entry(|e| e[0] = 1).unwrap_err();
        assert!(gpu.contains("not host memory"), "{gpu}");
        assert!(with_entry(|e| e[0] = 3).unwrap_err().contains("index 3"));
        // file length 16384 - 1: the region's end passes it.
        let short = with_entry(|e| e[28..36].copy_from_slice(&16383u64.to_le_bytes()));
        assert!(short.unwrap_err().contains("inside its file"));
        let wraps = with_entry(|e| e[36..44].copy_from_slice(&u64::MAX.to_le_bytes()));
        assert!(wraps.unwrap_err().contains("inside its file"));
    }

    #[test]
    fn shared_sections_with_bad_counts_or_order_are_refused() {
        let mut m = sample();
        m.regions[0].shared = m.regions[2].shared;
        let b = m.encode();
        assert_eq!(AgentMeta::decode(&b).unwrap(), m);
        // Swap the two entries: indexes must rise.
        let mut swapped = b.clone();
        let at = b.len() - 2 * SHARED_ENTRY;
        swapped[at..at + SHARED_ENTRY].copy_from_slice(&b[at + SHARED_ENTRY..]);
        swapped[at + SHARED_ENTRY..].copy_from_slice(&b[at..at + SHARED_ENTRY]);
        assert!(AgentMeta::decode(&swapped).unwrap_err().contains("index 0"));
        let count_at = at - 4;
        for bad in [0u32, 3, u32::MAX] {
            let mut c = b.clone();
            c[count_at..at].copy_from_slice(&bad.to_le_bytes());
            assert!(
                AgentMeta::decode(&c)
                    .unwrap_err()
                    .contains("shared regions")
            );
        }
        let mut magic = b.clone();
        magic[count_at - 20] ^= 1;
        assert!(
            AgentMeta::decode(&magic)
                .unwrap_err()
                .contains("unknown section")
        );
    }

    #[test]
    fn round_trip() {
        let m = sample();
        assert_eq!(AgentMeta::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn every_truncation_and_bit_flip_is_refused_or_decodes_without_panic() {
        let bytes = sample().encode();
        // Cut just before the shared section, the rest is a whole message without one.
        let mut plain = sample();
        plain.regions[2].shared = None;
        let boundary = plain.encode().len();
        for n in 0..bytes.len() {
            assert_eq!(
                AgentMeta::decode(&bytes[..n]).is_ok(),
                n == boundary,
                "prefix {n}"
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
