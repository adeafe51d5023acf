//! Model presets: the KV-cache shapes of models users run (public configs).

use std::fmt;
use std::str::FromStr;

use kvxfer_layout::{BlockOrder, CacheKind, CacheParams, Dtype, HeadSharding};

/// A model's KV-cache geometry before parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Preset name.
    pub name: &'static str,
    /// Storage kind.
    pub kind: CacheKind,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads of the whole model (1 for MLA).
    pub kv_heads: u32,
    /// Head dimension (the latent dimension for MLA).
    pub head_dim: u32,
    /// Element type.
    pub dtype: Dtype,
}

/// Built-in presets.
pub const PRESETS: [ModelShape; 3] = [
    // Llama-3-8B: 32 layers, 8 KV heads (GQA), head dim 128.
    ModelShape {
        name: "llama-3-8b",
        kind: CacheKind::SplitKv,
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
    },
    // Llama-3-70B: 80 layers, 8 KV heads, head dim 128.
    ModelShape {
        name: "llama-3-70b",
        kind: CacheKind::SplitKv,
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
    },
    // DeepSeek-V3: 61 layers, MLA latent 512 + 64 rope dims.
    ModelShape {
        name: "deepseek-v3",
        kind: CacheKind::Mla,
        layers: 61,
        kv_heads: 1,
        head_dim: 576,
        dtype: Dtype::Bf16,
    },
];

/// Error for an unknown preset name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown model {0:?} (known: llama-3-8b, llama-3-70b, deepseek-v3)")]
pub struct UnknownModel(pub String);

impl FromStr for ModelShape {
    type Err = UnknownModel;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.to_ascii_lowercase().replace('_', "-");
        PRESETS
            .iter()
            .find(|m| m.name == wanted)
            .copied()
            .ok_or_else(|| UnknownModel(s.to_string()))
    }
}

impl fmt::Display for ModelShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl ModelShape {
    /// The same model with its cache stored as `kind`: attention models take any kind
    /// but MLA; an MLA model keeps its latent cache.
    pub fn with_kind(mut self, kind: CacheKind) -> Result<Self, kvxfer_layout::LayoutError> {
        if (self.kind == CacheKind::Mla) != (kind == CacheKind::Mla) {
            return Err(kvxfer_layout::LayoutError::Unsupported(format!(
                "{} has a {} cache; it cannot be stored as {kind}",
                self.name, self.kind
            )));
        }
        self.kind = kind;
        Ok(self)
    }

    /// How heads shard under TP.
    pub fn sharding(&self) -> HeadSharding {
        match self.kind {
            CacheKind::Mla => HeadSharding::Replicated,
            _ => HeadSharding::Split {
                total_kv_heads: self.kv_heads,
            },
        }
    }

    /// Cache parameters of one rank holding `heads` heads and `layers` layers.
    pub fn rank_params(
        &self,
        order: BlockOrder,
        heads: u32,
        layers: u32,
        tokens_per_block: u32,
        num_blocks: u32,
    ) -> CacheParams {
        CacheParams {
            kind: self.kind,
            order,
            dtype: self.dtype,
            num_layers: layers,
            kv_heads: heads,
            head_dim: self.head_dim,
            tokens_per_block,
            num_blocks,
        }
    }
}
