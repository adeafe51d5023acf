//! KV cache groups: a hybrid model's layers split by attention kind (full, sliding window),
//! each group with its own block table.
//!
//! vLLM's hybrid KV cache manager lays one layer of each group over the same memory: layer
//! `a` of group 0 and layer `b` of group 1 share a region, and a block id belongs to one group
//! at a time, so block `n` of that region holds layer `a`'s page when group 0 owns `n` and
//! layer `b`'s when group 1 does. A cache is then described as it is: one region per layer as
//! usual (aliased regions repeat a base), and the partition of its layers into groups. A
//! transfer moves each group's blocks through that group's layers only, planned on the
//! group's own [`CacheSpec`] ([`LayerGroups::group_side`]).
//!
//! A group may hold recurrent state instead of attention KV (vLLM's Mamba layers beside
//! attention layers, Nemotron-H-, Jamba-style): its layers' blocks are the same size as the
//! attention layers' (vLLM pads the state page to the attention page), each one request's
//! state page, moved whole as a [`CacheKind::State`] side of page-sized blocks.

use crate::error::add;
use crate::{CacheKind, CacheSpec, LayoutError, Result};

/// Most groups a cache may declare (vLLM's hybrid models have two or three).
pub const MAX_GROUPS: usize = 64;

/// A partition of a cache's layers (indices into its spec, `0..num_layers`) into KV cache
/// groups, each in increasing layer order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerGroups {
    groups: Vec<Vec<u32>>,
    /// Per group: whether its blocks are state pages (see the module's documentation).
    state: Vec<bool>,
}

impl LayerGroups {
    /// Validates that `groups` (at most [`MAX_GROUPS`], none empty, each strictly
    /// increasing) name every layer of `0..num_layers` exactly once.
    pub fn new(groups: Vec<Vec<u32>>, num_layers: u32) -> Result<Self> {
        if groups.is_empty() {
            return Err(LayoutError::Zero {
                field: "KV cache groups",
            });
        }
        if groups.len() > MAX_GROUPS {
            return Err(LayoutError::TooLarge {
                what: "KV cache groups",
                value: groups.len() as u64,
                limit: MAX_GROUPS as u64,
            });
        }
        let mut seen = vec![false; num_layers as usize];
        for g in &groups {
            if g.is_empty() {
                return Err(LayoutError::Zero {
                    field: "layers in a KV cache group",
                });
            }
            if !g.windows(2).all(|w| w[0] < w[1]) {
                return Err(LayoutError::Unsupported(format!(
                    "KV cache group {g:?}: layers must be listed once each, in increasing order"
                )));
            }
            for &l in g {
                let slot = seen.get_mut(l as usize).ok_or(LayoutError::OutOfRange {
                    what: "layer of a KV cache group",
                    index: l.into(),
                    limit: num_layers.into(),
                })?;
                if *slot {
                    return Err(LayoutError::Unsupported(format!(
                        "layer {l} is in more than one KV cache group"
                    )));
                }
                *slot = true;
            }
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            return Err(LayoutError::Unsupported(format!(
                "layer {missing} is in no KV cache group"
            )));
        }
        let state = vec![false; groups.len()];
        Ok(LayerGroups { groups, state })
    }

    /// One group holding every layer (a model with one kind of attention).
    pub fn single(num_layers: u32) -> Self {
        LayerGroups {
            groups: vec![(0..num_layers).collect()],
            state: vec![false],
        }
    }

    /// Marks groups `state_groups` (indices, each once) as holding state pages; at least one
    /// group must stay attention (a cache of state alone is a [`CacheKind::State`] spec).
    pub fn with_state(mut self, state_groups: &[u32]) -> Result<Self> {
        let mut state = vec![false; self.groups.len()];
        for &g in state_groups {
            let slot = state.get_mut(g as usize).ok_or(LayoutError::OutOfRange {
                what: "state KV cache group",
                index: g.into(),
                limit: self.groups.len() as u64,
            })?;
            if *slot {
                return Err(LayoutError::Unsupported(format!(
                    "KV cache group {g} is named a state group twice"
                )));
            }
            *slot = true;
        }
        if state.iter().all(|&s| s) {
            return Err(LayoutError::Unsupported(
                "every KV cache group holds state: describe the cache as a state cache".into(),
            ));
        }
        self.state = state;
        Ok(self)
    }

    /// Whether group `group` holds state pages (false past the last group).
    pub fn is_state(&self, group: usize) -> bool {
        self.state.get(group).copied().unwrap_or(false)
    }

    /// The indices of the groups that hold state pages, in increasing order.
    pub fn state_groups(&self) -> Vec<u32> {
        (0..self.groups.len() as u32)
            .filter(|&g| self.is_state(g as usize))
            .collect()
    }

    /// Whether any group holds state pages.
    pub fn has_state(&self) -> bool {
        self.state.contains(&true)
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Never true: a partition has at least one group.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The layers of each group.
    pub fn as_slice(&self) -> &[Vec<u32>] {
        &self.groups
    }

    /// Checks that the regions of a cache with these groups are each either disjoint from
    /// every other or the very same memory as regions of layers in *other* groups (vLLM's
    /// overlay), that the spec has per-layer regions, and that the spec's layer count
    /// matches. Partial overlaps and aliasing within one group are refused.
    pub fn check_regions(&self, spec: &CacheSpec, bases: &[u64]) -> Result<()> {
        let per_layer = regions_per_layer(spec)?;
        if bases.len() != spec.num_regions() as usize {
            return Err(LayoutError::LengthMismatch {
                what: "region base addresses vs regions",
                left: bases.len(),
                right: spec.num_regions() as usize,
            });
        }
        let mut group_of = vec![0usize; spec.num_layers() as usize];
        for (g, layers) in self.groups.iter().enumerate() {
            for &l in layers {
                // `new` checked every layer below its layer count; the spec's may differ.
                let slot = group_of.get_mut(l as usize).ok_or(LayoutError::Mismatch {
                    field: "layers",
                    source_value: spec.num_layers().to_string(),
                    dest_value: format!("KV cache groups naming layer {l}"),
                })?;
                *slot = g;
            }
        }
        let covered: usize = self.groups.iter().map(Vec::len).sum();
        if covered != spec.num_layers() as usize {
            return Err(LayoutError::Mismatch {
                field: "layers",
                source_value: spec.num_layers().to_string(),
                dest_value: format!("{covered} in KV cache groups"),
            });
        }
        let len = spec.region_len();
        for &base in bases {
            add(base, len, "region end address")?;
        }
        let group = |r: usize| r.checked_div(per_layer).and_then(|l| group_of.get(l));
        let mut order: Vec<usize> = (0..bases.len()).collect();
        order.sort_unstable_by_key(|&i| (bases[i], group(i)));
        // Runs of regions at one address: vLLM's overlay, one layer of each group at most.
        // Sorted by group within a run, a group that repeats repeats next to itself.
        for w in order.windows(2) {
            let (a, b) = (w[0], w[1]);
            if bases[a] == bases[b] {
                if group(a) == group(b) {
                    return Err(LayoutError::Overlap {
                        what: "regions of layers in one KV cache group",
                        first: a,
                        second: b,
                    });
                }
            } else if add(bases[a], len, "region end address")? > bases[b] {
                return Err(LayoutError::Overlap {
                    what: "registered regions",
                    first: a,
                    second: b,
                });
            }
        }
        Ok(())
    }

    /// The spec and region bases of group `group`'s layers alone (the spec's layer count is
    /// the group's; its region `i` is the cache's region of the group's `i`-th layer): a
    /// cache side the planner moves that group's blocks on. A state group's spec is a
    /// [`CacheKind::State`] one whose page is the cache's whole block: one page per layer and
    /// block, moved whole.
    pub fn group_side(
        &self,
        group: usize,
        spec: &CacheSpec,
        bases: &[u64],
    ) -> Result<(CacheSpec, Vec<u64>)> {
        let layers = self.groups.get(group).ok_or(LayoutError::OutOfRange {
            what: "KV cache group",
            index: group as u64,
            limit: self.groups.len() as u64,
        })?;
        let per_layer = regions_per_layer(spec)?;
        let mut params = *spec.params();
        params.num_layers = u32::try_from(layers.len()).map_err(|_| LayoutError::Overflow {
            what: "layers in a KV cache group",
        })?;
        if self.is_state(group) {
            if per_layer != 1 {
                return Err(LayoutError::Unsupported(format!(
                    "a state KV cache group beside a {} cache ({per_layer} regions per layer)",
                    spec.kind()
                )));
            }
            params.kind = CacheKind::State;
            params.order = crate::BlockOrder::Hnd;
            params.dtype = crate::Dtype::U8;
            params.kv_heads = 1;
            params.tokens_per_block = 1;
            params.head_dim =
                u32::try_from(spec.block_len()).map_err(|_| LayoutError::TooLarge {
                    what: "state page bytes",
                    value: spec.block_len(),
                    limit: crate::MAX_STATE_PAGE.into(),
                })?;
        }
        let sub = CacheSpec::new(params)?;
        let mut sub_bases = Vec::with_capacity(layers.len().saturating_mul(per_layer));
        for &l in layers {
            let first = (l as usize).saturating_mul(per_layer);
            let regions = bases.get(first..first.saturating_add(per_layer)).ok_or(
                LayoutError::OutOfRange {
                    what: "layer of a KV cache group",
                    index: l.into(),
                    limit: spec.num_layers().into(),
                },
            )?;
            sub_bases.extend_from_slice(regions);
        }
        Ok((sub, sub_bases))
    }
}

/// Regions each layer has: KV cache groups need per-layer regions (not a cross-layer cache).
fn regions_per_layer(spec: &CacheSpec) -> Result<usize> {
    if spec.kind() == CacheKind::CrossLayer {
        return Err(LayoutError::Unsupported(
            "KV cache groups over a cross-layer cache (one region for every layer)".into(),
        ));
    }
    // A spec has at least one layer and a whole number of regions per layer.
    Ok(spec
        .num_regions()
        .checked_div(spec.num_layers())
        .unwrap_or(1) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockOrder, CacheParams, Dtype};

    fn spec(kind: CacheKind, layers: u32) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind,
            order: BlockOrder::Hnd,
            dtype: Dtype::F16,
            num_layers: layers,
            kv_heads: 2,
            head_dim: 8,
            tokens_per_block: 4,
            num_blocks: 4,
        })
        .unwrap()
    }

    #[test]
    fn a_partition_names_every_layer_once() {
        assert!(LayerGroups::new(vec![vec![0, 2], vec![1, 3]], 4).is_ok());
        assert_eq!(LayerGroups::single(3).as_slice(), &[vec![0, 1, 2]]);
        for bad in [
            vec![],
            vec![vec![0, 1], vec![]],
            vec![vec![0, 2], vec![1]],
            vec![vec![0, 1], vec![1, 2, 3]],
            vec![vec![2, 0], vec![1, 3]],
            vec![vec![0, 0, 2], vec![1, 3]],
            vec![vec![0, 2], vec![1, 4]],
        ] {
            assert!(LayerGroups::new(bad.clone(), 4).is_err(), "{bad:?}");
        }
        let many = (0..65).map(|l| vec![l]).collect();
        assert!(matches!(
            LayerGroups::new(many, 65),
            Err(LayoutError::TooLarge { .. })
        ));
    }

    #[test]
    fn regions_alias_only_across_groups_and_never_partly() {
        let s = spec(CacheKind::PackedKv, 4);
        let len = s.region_len();
        let g = LayerGroups::new(vec![vec![0, 2], vec![1, 3]], 4).unwrap();
        // vLLM's overlay: layers 0 and 1 share one region, 2 and 3 another.
        g.check_regions(&s, &[0x1000, 0x1000, 0x1000 + len, 0x1000 + len])
            .unwrap();
        // Aliasing inside a group (0 and 2) is refused.
        assert!(matches!(
            g.check_regions(&s, &[0x1000, 0x1000 + len, 0x1000, 0x1000 + len]),
            Err(LayoutError::Overlap { .. })
        ));
        // A partial overlap is refused.
        assert!(matches!(
            g.check_regions(&s, &[0x1000, 0x1001, 0x1000 + 4 * len, 0x1000 + 6 * len]),
            Err(LayoutError::Overlap { .. })
        ));
        // Three layers at one address, two of them in one group: refused however ordered.
        let s3 = spec(CacheKind::PackedKv, 3);
        let g3 = LayerGroups::new(vec![vec![0, 2], vec![1]], 3).unwrap();
        assert!(g3.check_regions(&s3, &[0x1000, 0x1000, 0x1000]).is_err());
        // A region that would end past the address space is refused.
        assert!(
            g.check_regions(&s, &[0x1000, 0x1000, u64::MAX - 1, u64::MAX - 1])
                .is_err()
        );
        // Bases and layers must match the spec.
        assert!(g.check_regions(&s, &[0x1000; 3]).is_err());
        let three = LayerGroups::new(vec![vec![0, 2], vec![1]], 3).unwrap();
        assert!(
            three
                .check_regions(&s, &[0x1000, 0x1000, 0x9000, 0x9000])
                .is_err()
        );
        let five = LayerGroups::new(vec![vec![0, 2, 4], vec![1, 3]], 5).unwrap();
        assert!(
            five.check_regions(&s, &[0x1000, 0x1000, 0x9000, 0x9000])
                .is_err()
        );
    }

    #[test]
    fn a_group_side_has_the_groups_layers_and_regions() {
        let s = spec(CacheKind::SplitKv, 3);
        let bases: Vec<u64> = (0..6).map(|i| 0x10_0000 * (i + 1)).collect();
        let g = LayerGroups::new(vec![vec![0, 2], vec![1]], 3).unwrap();
        let (sub, b) = g.group_side(0, &s, &bases).unwrap();
        assert_eq!(sub.num_layers(), 2);
        // Split K/V: each layer's K and V regions, in the group's layer order.
        assert_eq!(b, vec![bases[0], bases[1], bases[4], bases[5]]);
        let (sub, b) = g.group_side(1, &s, &bases).unwrap();
        assert_eq!((sub.num_layers(), b), (1, vec![bases[2], bases[3]]));
        assert!(g.group_side(2, &s, &bases).is_err());
        let cross = spec(CacheKind::CrossLayer, 3);
        assert!(g.group_side(0, &cross, &[0x1000]).is_err());
        assert!(g.check_regions(&cross, &[0x1000]).is_err());
    }

    #[test]
    fn a_state_groups_side_moves_whole_blocks_as_state_pages() {
        // Mamba layers 0 and 2 beside attention layers 1 and 3, one region each (overlay).
        let s = spec(CacheKind::PackedKv, 4);
        let bases: Vec<u64> = (0..4).map(|i| 0x10_0000 * (i + 1)).collect();
        let g = LayerGroups::new(vec![vec![0, 2], vec![1, 3]], 4)
            .unwrap()
            .with_state(&[0])
            .unwrap();
        assert!(g.has_state() && g.is_state(0) && !g.is_state(1) && !g.is_state(2));
        assert_eq!(g.state_groups(), vec![0]);
        let second = LayerGroups::new(vec![vec![0, 2], vec![1, 3]], 4)
            .and_then(|g| g.with_state(&[1]))
            .unwrap();
        assert_eq!(second.state_groups(), vec![1]);
        let (st, b) = g.group_side(0, &s, &bases).unwrap();
        assert_eq!(st.kind(), CacheKind::State);
        assert_eq!((st.num_layers(), st.num_blocks()), (2, s.num_blocks()));
        assert_eq!(
            (st.block_len(), st.region_len()),
            (s.block_len(), s.region_len())
        );
        assert_eq!(b, vec![bases[0], bases[2]]);
        let (att, _) = g.group_side(1, &s, &bases).unwrap();
        assert_eq!(att.kind(), CacheKind::PackedKv);
        // The marks are part of the partition: a peer without them differs.
        assert_ne!(
            g,
            LayerGroups::new(vec![vec![0, 2], vec![1, 3]], 4).unwrap()
        );
        // A state group needs one region per layer; bad marks are refused.
        let split = spec(CacheKind::SplitKv, 4);
        let split_bases: Vec<u64> = (0..8).map(|i| 0x10_0000 * (i + 1)).collect();
        assert!(g.group_side(0, &split, &split_bases).is_err());
        let two = || LayerGroups::new(vec![vec![0, 2], vec![1, 3]], 4).unwrap();
        assert!(two().with_state(&[2]).is_err());
        assert!(two().with_state(&[0, 0]).is_err());
        assert!(two().with_state(&[0, 1]).is_err());
        assert!(!two().with_state(&[]).unwrap().has_state());
    }
}
