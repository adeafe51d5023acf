//! The metadata a kvxfer NIXL agent hands its peers: an envelope around NIXL's own blob
//! (`getLocalMD`) with the agent's name and the regions it registered, so that remote ranges
//! can be checked before NIXL sees them. Decoding is bounded and never panics: it is fed
//! bytes from the network. Built without the `nixl` feature too (fuzzing, tests).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_core::{AddrRange, MemoryKind};

const MAGIC: &[u8; 4] = b"KVXN";
/// Longest agent name accepted.
pub const MAX_NAME: usize = 256;
/// Most regions one agent may advertise.
pub const MAX_REGIONS: usize = 1 << 16;

/// Decoded metadata of one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded<'a> {
    /// Agent name.
    pub name: String,
    /// Regions it registered.
    pub regions: Vec<(MemoryKind, AddrRange)>,
    /// NIXL's own metadata (non-empty).
    pub nixl: &'a [u8],
}

/// Encodes an agent's envelope.
pub fn encode(name: &str, regions: &[(MemoryKind, AddrRange)], nixl: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for (k, r) in regions {
        let (tag, device) = match k {
            MemoryKind::Host => (0u8, 0u32),
            MemoryKind::Gpu { device } => (1, *device),
        };
        out.push(tag);
        out.extend_from_slice(&device.to_le_bytes());
        out.extend_from_slice(&r.addr.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
    }
    out.extend_from_slice(nixl);
    out
}

/// Decodes an envelope; refuses a wrong magic, a name empty, too long or not UTF-8, too
/// many regions, an unknown memory kind, a host region naming a device, a region that
/// wraps, truncation, and an empty NIXL blob: what it accepts encodes back to itself.
pub fn decode(bytes: &[u8]) -> Result<Decoded<'_>, String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= bytes.len())
            .ok_or("truncated metadata")?;
        let s = &bytes[at..end];
        at = end;
        Ok(s)
    };
    if take(4)? != MAGIC {
        return Err("not kvxfer NIXL metadata".into());
    }
    let u32_at = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let name_len = u32_at(take(4)?) as usize;
    if name_len == 0 || name_len > MAX_NAME {
        return Err(format!("agent name length {name_len}"));
    }
    let name = std::str::from_utf8(take(name_len)?)
        .map_err(|_| "agent name is not UTF-8")?
        .to_string();
    let count = u32_at(take(4)?) as usize;
    if count > MAX_REGIONS {
        return Err(format!("{count} regions"));
    }
    // Each region takes 21 bytes: the input bounds what a claimed count may allocate.
    let mut regions = Vec::with_capacity(count.min(bytes.len() / 21));
    for _ in 0..count {
        let tag = take(1)?[0];
        let device = u32_at(take(4)?);
        let addr = u64::from_le_bytes(take(8)?.try_into().map_err(|_| "truncated")?);
        let len = u64::from_le_bytes(take(8)?.try_into().map_err(|_| "truncated")?);
        let kind = match tag {
            0 if device == 0 => MemoryKind::Host,
            0 => return Err(format!("host region names device {device}")),
            1 => MemoryKind::Gpu { device },
            t => return Err(format!("memory kind tag {t}")),
        };
        if addr.checked_add(len).is_none() {
            return Err("region wraps around".into());
        }
        regions.push((kind, AddrRange::new(addr, len)));
    }
    let nixl = &bytes[at..];
    if nixl.is_empty() {
        return Err("no NIXL metadata".into());
    }
    Ok(Decoded {
        name,
        regions,
        nixl,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_refusal() {
        let regions = [
            (MemoryKind::Host, AddrRange::new(0x1000, 64)),
            (
                MemoryKind::Gpu { device: 3 },
                AddrRange::new(u64::MAX - 8, 8),
            ),
        ];
        let bytes = encode("agent-0", &regions, b"nixl-md");
        let d = decode(&bytes).expect("round trip");
        assert_eq!((d.name.as_str(), d.nixl), ("agent-0", &b"nixl-md"[..]));
        assert_eq!(d.regions, regions);
        let refused = |b: &[u8]| decode(b).expect_err("accepted");
        assert!(refused(&bytes[..bytes.len() - 7]).contains("no NIXL metadata"));
        assert!(refused(&bytes[..20]).contains("truncated"));
        assert!(refused(b"KVXU").contains("not kvxfer"));
        assert!(refused(&encode("", &[], b"x")).contains("name length 0"));
        assert!(refused(&encode(&"n".repeat(MAX_NAME + 1), &[], b"x")).contains("name length"));
        let wraps = encode(
            "a",
            &[(MemoryKind::Host, AddrRange::new(u64::MAX, 2))],
            b"x",
        );
        assert!(refused(&wraps).contains("wraps"));
        let mut tag = encode("a", &regions[..1], b"x");
        tag[13] = 9; // the first region's kind
        assert!(refused(&tag).contains("memory kind tag 9"));
        tag[13] = 0;
        tag[14] = 1; // a device for a host region
        assert!(refused(&tag).contains("host region names device 1"));
        let mut many = encode("a", &[], b"x");
        many[9..13].copy_from_slice(&(MAX_REGIONS as u32 + 1).to_le_bytes());
        assert!(refused(&many).contains("regions"));
        let mut utf8 = encode("ab", &[], b"x");
        utf8[8] = 0xff;
        assert!(refused(&utf8).contains("UTF-8"));
    }

    #[test]
    fn the_bounds_themselves_are_accepted() {
        let name = "n".repeat(MAX_NAME);
        assert_eq!(
            decode(&encode(&name, &[], b"x"))
                .expect("longest name")
                .name,
            name
        );
        let regions = vec![(MemoryKind::Host, AddrRange::new(0, 1)); MAX_REGIONS];
        let bytes = encode("a", &regions, b"x");
        assert_eq!(
            decode(&bytes).expect("most regions").regions.len(),
            MAX_REGIONS
        );
    }
}
