//! Checks every transport applies the same way before building a transfer.

use super::{AddrRange, TransportError, TransportResult};

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
}
