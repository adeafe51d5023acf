//! Checks every transport applies the same way before building a transfer.

use std::collections::HashMap;

use super::{AddrRange, DescListId, MemoryKind, PeerId, TransportError, TransportResult};

/// `TooLarge` when `count` exceeds `limit` (descriptors per list or transfer, notification
/// bytes, …).
pub fn within(what: &'static str, count: usize, limit: usize) -> TransportResult<()> {
    if count > limit {
        return Err(TransportError::TooLarge { what, count, limit });
    }
    Ok(())
}

/// Checks a range about to be registered: not empty, not wrapping around the address space,
/// not overlapping any of `registered`. `InvalidRegistration` names what is wrong.
pub fn new_region(
    range: AddrRange,
    registered: impl IntoIterator<Item = AddrRange>,
) -> TransportResult<()> {
    let end = range.end().ok_or_else(|| {
        TransportError::InvalidRegistration("range wraps around the address space".into())
    })?;
    if range.len == 0 {
        return Err(TransportError::InvalidRegistration("empty range".into()));
    }
    match registered
        .into_iter()
        .find(|r| range.addr < r.addr + r.len && r.addr < end)
    {
        Some(r) => Err(TransportError::InvalidRegistration(format!(
            "overlaps registered region {:#x}+{}",
            r.addr, r.len
        ))),
        None => Ok(()),
    }
}

/// An agent's prepared lists: what `prepare_*`, `release_list`, `post_indexed` and peer
/// removal share. Ids come from the transport (one counter for all its ids).
#[derive(Debug, Default)]
pub struct PreparedLists(HashMap<DescListId, PreparedList>);

impl PreparedLists {
    /// Stores a list already checked by the transport under `id`.
    pub fn insert(
        &mut self,
        id: DescListId,
        kind: MemoryKind,
        ranges: &[AddrRange],
        peer: Option<PeerId>,
    ) -> DescListId {
        let list = PreparedList {
            kind,
            ranges: ranges.to_vec(),
            peer,
        };
        self.0.insert(id, list);
        id
    }

    /// Releases a list, or `UnknownList`.
    pub fn release(&mut self, id: DescListId) -> TransportResult<()> {
        self.0
            .remove(&id)
            .map(|_| ())
            .ok_or(TransportError::UnknownList(id))
    }

    /// Drops every list prepared for `peer` (removed or replaced).
    pub fn forget_peer(&mut self, peer: PeerId) {
        self.0.retain(|_, l| l.peer != Some(peer));
    }

    /// Drops every list.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// [`resolve_indexed`] against these lists.
    pub fn resolve(
        &self,
        local: (DescListId, &[u32]),
        remote: (DescListId, &[u32]),
    ) -> TransportResult<Indexed> {
        resolve_indexed(|id| self.0.get(&id), local, remote)
    }
}

/// A prepared descriptor list as transports keep it: local (`peer == None`) or a peer's.
#[derive(Debug, Clone)]
pub struct PreparedList {
    /// Memory kind of every range.
    pub kind: MemoryKind,
    /// The ranges, indexed by posts.
    pub ranges: Vec<AddrRange>,
    /// The peer of a remote list.
    pub peer: Option<PeerId>,
}

/// An indexed post resolved to ranges.
#[derive(Debug, Clone)]
pub struct Indexed {
    /// The peer of the remote list.
    pub peer: PeerId,
    /// Memory kinds of the local and remote lists.
    pub kinds: (MemoryKind, MemoryKind),
    /// Local ranges, in post order.
    pub local: Vec<AddrRange>,
    /// Remote ranges, in post order.
    pub remote: Vec<AddrRange>,
}

/// Resolves `post_indexed`'s lists and indices: equal index counts, known lists of the right
/// side, indices in range, equal lengths pairwise.
pub fn resolve_indexed<'a>(
    lookup: impl Fn(DescListId) -> Option<&'a PreparedList>,
    (local, local_idx): (DescListId, &[u32]),
    (remote, remote_idx): (DescListId, &[u32]),
) -> TransportResult<Indexed> {
    if local_idx.len() != remote_idx.len() {
        return Err(TransportError::Mismatch(format!(
            "{} local indices, {} remote indices",
            local_idx.len(),
            remote_idx.len()
        )));
    }
    let l = lookup(local).ok_or(TransportError::UnknownList(local))?;
    let r = lookup(remote).ok_or(TransportError::UnknownList(remote))?;
    if l.peer.is_some() {
        return Err(TransportError::WrongList(local, "local"));
    }
    let Some(peer) = r.peer else {
        return Err(TransportError::WrongList(remote, "remote"));
    };
    let (local_ranges, remote_ranges) = (
        gather(&l.ranges, local_idx)?,
        gather(&r.ranges, remote_idx)?,
    );
    check_pairs(&local_ranges, &remote_ranges)?;
    Ok(Indexed {
        peer,
        kinds: (l.kind, r.kind),
        local: local_ranges,
        remote: remote_ranges,
    })
}

/// The ranges of a prepared list at `idx`, or `IndexOutOfRange`.
pub fn gather(ranges: &[AddrRange], idx: &[u32]) -> TransportResult<Vec<AddrRange>> {
    idx.iter()
        .map(|&i| {
            ranges
                .get(i as usize)
                .copied()
                .ok_or(TransportError::IndexOutOfRange {
                    index: i,
                    len: ranges.len(),
                })
        })
        .collect()
}

/// Local and remote sides pair one to one with equal lengths, or `Mismatch`.
pub fn check_pairs(local: &[AddrRange], remote: &[AddrRange]) -> TransportResult<()> {
    if local.len() != remote.len() {
        return Err(TransportError::Mismatch(format!(
            "{} local ranges, {} remote ranges",
            local.len(),
            remote.len()
        )));
    }
    match local.iter().zip(remote).position(|(l, r)| l.len != r.len) {
        Some(i) => Err(TransportError::Mismatch(format!(
            "descriptor {i}: local length {}, remote length {}",
            local[i].len, remote[i].len
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_and_pairs() {
        let r = [AddrRange::new(0, 4), AddrRange::new(8, 4)];
        assert_eq!(gather(&r, &[1, 0]).unwrap(), vec![r[1], r[0]]);
        assert!(matches!(
            gather(&r, &[2]),
            Err(TransportError::IndexOutOfRange { index: 2, len: 2 })
        ));
        assert!(check_pairs(&r, &r).is_ok());
        assert!(check_pairs(&r, &r[..1]).is_err());
        assert!(check_pairs(&r[..1], &[AddrRange::new(0, 5)]).is_err());
    }

    #[test]
    fn new_regions_are_checked() {
        let have = [AddrRange::new(0x1000, 0x100)];
        assert!(new_region(AddrRange::new(0x1100, 0x10), have).is_ok());
        assert!(new_region(AddrRange::new(0x10ff, 0x10), have).is_err());
        assert!(new_region(AddrRange::new(0x0f00, 0x101), have).is_err());
        assert!(new_region(AddrRange::new(0x2000, 0), have).is_err());
        assert!(new_region(AddrRange::new(u64::MAX, 2), have).is_err());
    }
}
