//! The loopback's metadata bytes: identity and advertised regions, decoded with bounds.

use kvxfer_core::{AddrRange, MemoryKind, TransportError, TransportResult};

const MAGIC: &[u8; 4] = b"KVXL";
const VERSION: u16 = 1;
/// Longest agent name accepted.
pub const MAX_NAME_LEN: usize = 256;
/// Most regions one agent may advertise.
pub const MAX_REGIONS: usize = 1 << 16;
const REGION_BYTES: usize = 1 + 4 + 8 + 8;

/// Decoded metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentMetadata {
    /// Agent name.
    pub name: String,
    /// Unique id of the agent instance (a restarted agent has a new one).
    pub uid: u64,
    /// Registered regions.
    pub regions: Vec<(MemoryKind, AddrRange)>,
}

impl AgentMetadata {
    /// Encodes to bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(20 + self.name.len() + self.regions.len() * REGION_BYTES);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for (kind, range) in &self.regions {
            let (tag, device) = match kind {
                MemoryKind::Host => (0u8, 0u32),
                MemoryKind::Gpu { device } => (1, *device),
            };
            out.push(tag);
            out.extend_from_slice(&device.to_le_bytes());
            out.extend_from_slice(&range.addr.to_le_bytes());
            out.extend_from_slice(&range.len.to_le_bytes());
        }
        out
    }

    /// Decodes bytes from a peer; any malformation is `InvalidMetadata`.
    pub fn decode(bytes: &[u8]) -> TransportResult<Self> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(invalid("not loopback metadata (bad magic)"));
        }
        let version = u16::from_le_bytes(r.array()?);
        if version != VERSION {
            return Err(invalid(format!("unsupported version {version}")));
        }
        let name_len = u16::from_le_bytes(r.array()?) as usize;
        if name_len == 0 || name_len > MAX_NAME_LEN {
            return Err(invalid(format!(
                "name length {name_len} outside 1..={MAX_NAME_LEN}"
            )));
        }
        let name = std::str::from_utf8(r.take(name_len)?)
            .map_err(|_| invalid("name is not UTF-8"))?
            .to_string();
        let uid = u64::from_le_bytes(r.array()?);
        let count = u32::from_le_bytes(r.array()?) as usize;
        if count > MAX_REGIONS {
            return Err(invalid(format!(
                "{count} regions exceed the limit of {MAX_REGIONS}"
            )));
        }
        // Check the length before allocating: a count field cannot make us allocate more
        // than the bytes actually present justify.
        if r.remaining() != count * REGION_BYTES {
            return Err(invalid(format!(
                "{} bytes of regions for a count of {count}",
                r.remaining()
            )));
        }
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            let tag = r.take(1)?[0];
            let device = u32::from_le_bytes(r.array()?);
            let addr = u64::from_le_bytes(r.array()?);
            let len = u64::from_le_bytes(r.array()?);
            let kind = match tag {
                0 => MemoryKind::Host,
                1 => MemoryKind::Gpu { device },
                t => return Err(invalid(format!("unknown memory kind tag {t}"))),
            };
            let range = AddrRange::new(addr, len);
            if range.end().is_none() {
                return Err(invalid(format!("region {addr:#x}+{len} wraps around")));
            }
            regions.push((kind, range));
        }
        Ok(AgentMetadata { name, uid, regions })
    }
}

fn invalid(msg: impl Into<String>) -> TransportError {
    TransportError::InvalidMetadata(msg.into())
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> TransportResult<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| invalid(format!("truncated at byte {}", self.at)))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> TransportResult<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "prefill-0".into(),
            uid: 42,
            regions: vec![
                (MemoryKind::Host, AddrRange::new(0x1000, 4096)),
                (MemoryKind::Gpu { device: 3 }, AddrRange::new(0x9000, 1)),
            ],
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        assert_eq!(AgentMetadata::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            assert!(
                AgentMetadata::decode(&bytes[..n]).is_err(),
                "truncated to {n}"
            );
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(AgentMetadata::decode(&extra).is_err());
        let mut huge = bytes.clone();
        // Region count field claims u32::MAX regions.
        let at = 4 + 2 + 2 + 9 + 8;
        huge[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(AgentMetadata::decode(&huge).is_err());
        let mut tag = bytes;
        tag[at + 4] = 7;
        assert!(AgentMetadata::decode(&tag).is_err());
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut state = 0x9e3779b97f4a7c15u64;
        for len in 0..512 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            let _ = AgentMetadata::decode(&bytes);
            let mut with_magic = MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = AgentMetadata::decode(&with_magic);
        }
    }
}
