//! Pipeline-parallel stages: which layers each stage holds, and where a stage's regions
//! land on a side that holds every layer.

use crate::error::nonzero;
use crate::{CacheKind, LayoutError, MAX_DIM, Result};

/// A contiguous range of global layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerRange {
    /// First global layer.
    pub first: u32,
    /// Number of layers.
    pub count: u32,
}

impl LayerRange {
    /// One past the last layer (saturating at `u32::MAX`; the constructors of this crate
    /// never build a range that reaches it).
    pub fn end(&self) -> u32 {
        self.first.saturating_add(self.count)
    }

    /// True when `layer` is in the range.
    pub fn contains(&self, layer: u32) -> bool {
        layer >= self.first && layer < self.end()
    }
}

/// The split of a model's layers into pipeline stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PpSplit {
    total_layers: u32,
    stages: Vec<LayerRange>,
}

impl PpSplit {
    /// Splits `total_layers` into `num_stages` stages whose sizes differ by at most one; the
    /// later stages take the remainder (15 layers in 2 stages: 7 + 8).
    pub fn even(total_layers: u32, num_stages: u32) -> Result<Self> {
        nonzero(total_layers.into(), "total layers")?;
        nonzero(num_stages.into(), "pipeline stages")?;
        if total_layers > MAX_DIM {
            return Err(LayoutError::TooLarge {
                what: "total layers",
                value: total_layers.into(),
                limit: MAX_DIM.into(),
            });
        }
        if num_stages > total_layers {
            return Err(LayoutError::TooLarge {
                what: "pipeline stages",
                value: num_stages.into(),
                limit: total_layers.into(),
            });
        }
        let (Some(base), Some(extra)) = (
            total_layers.checked_div(num_stages),
            total_layers.checked_rem(num_stages),
        ) else {
            return Err(LayoutError::Zero {
                field: "pipeline stages",
            });
        };
        // The last `extra` stages take one layer more; `extra < num_stages` and
        // `base <= total_layers <= MAX_DIM` (`extra` is 0 when they are equal), so neither
        // saturates.
        let first_longer = num_stages.saturating_sub(extra);
        let sizes: Vec<u32> = (0..num_stages)
            .map(|s| base.saturating_add(u32::from(s >= first_longer)))
            .collect();
        Self::from_sizes(&sizes)
    }

    /// A split with explicit stage sizes, in stage order.
    pub fn from_sizes(sizes: &[u32]) -> Result<Self> {
        nonzero(sizes.len() as u64, "pipeline stages")?;
        let mut first = 0u32;
        let mut stages = Vec::with_capacity(sizes.len());
        for &count in sizes {
            nonzero(count.into(), "layers of a pipeline stage")?;
            stages.push(LayerRange { first, count });
            first = first
                .checked_add(count)
                .filter(|&t| t <= MAX_DIM)
                .ok_or_else(|| LayoutError::TooLarge {
                    what: "total layers",
                    value: sizes.iter().map(|&s| u64::from(s)).sum(),
                    limit: MAX_DIM.into(),
                })?;
        }
        Ok(PpSplit {
            total_layers: first,
            stages,
        })
    }

    /// Layers of the whole model.
    pub fn total_layers(&self) -> u32 {
        self.total_layers
    }

    /// The stages in order.
    pub fn stages(&self) -> &[LayerRange] {
        &self.stages
    }

    /// The layers of one stage.
    pub fn stage(&self, stage: u32) -> Result<LayerRange> {
        self.stages
            .get(stage as usize)
            .copied()
            .ok_or(LayoutError::OutOfRange {
                what: "pipeline stage",
                index: stage.into(),
                limit: self.stages.len() as u64,
            })
    }

    /// The stage holding a global layer.
    pub fn stage_of_layer(&self, layer: u32) -> Result<u32> {
        self.stages
            .iter()
            .position(|s| s.contains(layer))
            .map(|s| s as u32)
            .ok_or(LayoutError::OutOfRange {
                what: "layer",
                index: layer.into(),
                limit: self.total_layers.into(),
            })
    }

    /// Maps index `j` of a stage's pointer list onto the pointer list of a side holding all
    /// layers, in the push connector's ordering: `[K_0..K_{n-1}, V_0..V_{n-1}]` for split K/V
    /// caches (`dst[s + j]` for K, `dst[T + s + j - n]` for V), one pointer per layer for
    /// joint, packed and MLA caches.
    pub fn kv_pointer_index(&self, stage: u32, kind: CacheKind, j: u32) -> Result<u32> {
        let range = self.stage(stage)?;
        let overflow = || LayoutError::Overflow {
            what: "stage pointer index",
        };
        let per_stage = match kind {
            CacheKind::SplitKv => range.count.checked_mul(2).ok_or_else(overflow)?,
            CacheKind::JointKv | CacheKind::Mla | CacheKind::PackedKv | CacheKind::State => {
                range.count
            }
            CacheKind::CrossLayer => {
                return Err(LayoutError::Unsupported(
                    "a cross-layer cache has one pointer for all its layers, not one per layer"
                        .into(),
                ));
            }
        };
        if j >= per_stage {
            return Err(LayoutError::OutOfRange {
                what: "stage pointer index",
                index: j.into(),
                limit: per_stage.into(),
            });
        }
        let index = match j.checked_sub(range.count) {
            None => range.first.checked_add(j),
            Some(v) => self
                .total_layers
                .checked_add(range.first)
                .and_then(|t| t.checked_add(v)),
        };
        index.ok_or_else(overflow)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_split_15_is_7_plus_8() {
        let s = PpSplit::even(15, 2).unwrap();
        assert_eq!(s.total_layers(), 15);
        assert_eq!(PpSplit::from_sizes(&[7, 8, 2]).unwrap().total_layers(), 17);
        assert_eq!(
            s.stages(),
            &[
                LayerRange { first: 0, count: 7 },
                LayerRange { first: 7, count: 8 }
            ]
        );
        assert_eq!(s.stage_of_layer(6).unwrap(), 0);
        assert_eq!(s.stage_of_layer(7).unwrap(), 1);
        assert!(s.stage_of_layer(15).is_err());
    }

    #[test]
    fn pointer_mapping_matches_push_reference() {
        let s = PpSplit::from_sizes(&[7, 8]).unwrap();
        // Stage 1 holds layers 7..15: K pointers go to 7..15, V pointers to 15+7..15+15.
        assert_eq!(s.kv_pointer_index(1, CacheKind::SplitKv, 0).unwrap(), 7);
        assert_eq!(s.kv_pointer_index(1, CacheKind::SplitKv, 7).unwrap(), 14);
        assert_eq!(s.kv_pointer_index(1, CacheKind::SplitKv, 8).unwrap(), 22);
        assert_eq!(s.kv_pointer_index(1, CacheKind::SplitKv, 15).unwrap(), 29);
        assert!(s.kv_pointer_index(1, CacheKind::SplitKv, 16).is_err());
        assert_eq!(s.kv_pointer_index(0, CacheKind::Mla, 6).unwrap(), 6);
        assert!(s.kv_pointer_index(0, CacheKind::Mla, 7).is_err());
    }

    #[test]
    fn bad_splits_are_errors() {
        assert!(PpSplit::even(2, 3).is_err());
        assert!(PpSplit::even(0, 1).is_err());
        assert!(PpSplit::from_sizes(&[]).is_err());
        assert!(PpSplit::from_sizes(&[3, 0]).is_err());
        assert!(PpSplit::from_sizes(&[u32::MAX, 1]).is_err());
        // One layer per stage is the most stages a split may have.
        assert_eq!(PpSplit::even(3, 3).unwrap().stages().len(), 3);
        // The layer bound is inclusive.
        assert!(PpSplit::even(crate::MAX_DIM, 1).is_ok());
        assert!(matches!(
            PpSplit::even(crate::MAX_DIM + 1, 1),
            Err(LayoutError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_range_built_by_hand_saturates_its_end() {
        let r = LayerRange {
            first: u32::MAX - 1,
            count: 5,
        };
        assert_eq!(r.end(), u32::MAX);
        assert!(r.contains(u32::MAX - 1));
        assert_eq!(LayerRange { first: 3, count: 4 }.end(), 7);
    }
}
