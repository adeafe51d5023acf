//! Turning `kvxfer-layout` plans into the local/remote range lists a transport posts.

use kvxfer_layout::Descriptor;

use crate::transport::{AddrRange, Op};

/// Splits plan descriptors (source → destination) into the `(local, remote)` lists of a
/// transfer posted by `op`: a READ's local side is the destination, a WRITE's the source.
pub fn split_for(
    op: Op,
    descs: impl IntoIterator<Item = Descriptor>,
    local: &mut Vec<AddrRange>,
    remote: &mut Vec<AddrRange>,
) {
    local.clear();
    remote.clear();
    append_for(op, descs, local, remote);
}

/// Like [`split_for`], appending to the lists (one transfer built from several plans).
pub fn append_for(
    op: Op,
    descs: impl IntoIterator<Item = Descriptor>,
    local: &mut Vec<AddrRange>,
    remote: &mut Vec<AddrRange>,
) {
    for d in descs {
        let (src, dst) = (AddrRange::new(d.src, d.len), AddrRange::new(d.dst, d.len));
        let (l, r) = match op {
            Op::Read => (dst, src),
            Op::Write => (src, dst),
        };
        local.push(l);
        remote.push(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_puts_destination_locally() {
        let d = [Descriptor {
            src: 10,
            dst: 20,
            len: 5,
        }];
        let (mut l, mut r) = (Vec::new(), Vec::new());
        split_for(Op::Read, d, &mut l, &mut r);
        assert_eq!((l[0].addr, r[0].addr), (20, 10));
        split_for(Op::Write, d, &mut l, &mut r);
        assert_eq!((l[0].addr, r[0].addr), (10, 20));
        append_for(Op::Read, d, &mut l, &mut r);
        assert_eq!(l.iter().map(|x| x.addr).collect::<Vec<_>>(), [10, 20]);
        split_for(Op::Read, d, &mut l, &mut r);
        assert_eq!(l.len(), 1);
    }
}
