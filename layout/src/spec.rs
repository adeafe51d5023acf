//! Cache specs: the shape of one rank's KV cache and the byte offsets inside it.
//!
//! A spec *describes* memory; it never allocates it. Regions are numbered the way vLLM's
//! NixlConnector numbers them: split K/V gives `[K0, V0, K1, V1, ...]`; joint K/V, packed
//! K/V, MLA and recurrent state give one region per layer; a cross-layer cache is one region.

use std::fmt;
use std::str::FromStr;

use crate::error::{add, in_range, mul, nonzero};
use crate::{Dtype, LayoutError, Result};

/// Bound on layers, heads, head dim, tokens per block and TP sizes: far above any real
/// model, low enough that products of a few of them never overflow before we check.
pub const MAX_DIM: u32 = 1 << 20;

/// Bound on a state page's elements ([`CacheKind::State`]'s `head_dim`): 1 Gi, far above a
/// real layer's state (Mamba2 2.7B: 2.6 MB in fp32).
pub const MAX_STATE_PAGE: u32 = 1 << 30;

/// How K and V are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheKind {
    /// Separate K and V regions per layer (2 regions per layer).
    SplitKv,
    /// One region per layer; each block holds its K half, then its V half (FlashInfer).
    JointKv,
    /// Multi-head latent attention: one region per layer, one latent vector per token.
    Mla,
    /// One region per layer; each block `[heads, tokens, 2 * head_dim]` (HND) or
    /// `[tokens, heads, 2 * head_dim]` (NHD), K and V moving together as one part
    /// ([`Part::PackedKv`]) whose head-token slot is `2 * head_dim` elements. vLLM 0.32's CPU
    /// cache has this shape (HND), but its attention kernel lays each head's block out itself
    /// (all the tokens' K rows, then their V rows): only whole head blocks are meaningful
    /// there, which is what plans between equal block sizes move; token ranges of a packed
    /// cache are refused ([`crate::whole_blocks_only`]).
    PackedKv,
    /// One region for every layer, block-outermost: each block holds every layer's page in
    /// turn (layer `l` at `l * page`), and each page is packed K/V as in [`PackedKv`]. vLLM's
    /// cross-layer layouts `BLHNC` (HND pages) and `BLNHC` (NHD pages), chosen with
    /// `VLLM_KV_CACHE_LAYOUT` or by a connector's required layout: a block of every layer is
    /// one contiguous run, so a request moves as one descriptor per run of blocks.
    ///
    /// [`PackedKv`]: CacheKind::PackedKv
    CrossLayer,
    /// Recurrent state (Mamba's convolution and SSM state, linear attention): one region per
    /// layer, each block one page of a request's state, `head_dim` elements that only the
    /// model's kernels interpret. No tokens (`tokens_per_block` 1) and no heads (`kv_heads`
    /// 1): a page moves whole, between ranks holding the same shard of the model, so between
    /// equal TP sizes only (the sharding is [`crate::HeadSharding::Split`] with one "head" per
    /// rank, which refuses any other pairing).
    State,
}

impl fmt::Display for CacheKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CacheKind::SplitKv => "split-kv",
            CacheKind::JointKv => "joint-kv",
            CacheKind::Mla => "mla",
            CacheKind::PackedKv => "packed-kv",
            CacheKind::CrossLayer => "cross-layer",
            CacheKind::State => "state",
        })
    }
}

impl FromStr for CacheKind {
    type Err = LayoutError;

    /// Parses the names [`CacheKind`]'s `Display` writes.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "split-kv" => Ok(CacheKind::SplitKv),
            "joint-kv" => Ok(CacheKind::JointKv),
            "mla" => Ok(CacheKind::Mla),
            "packed-kv" => Ok(CacheKind::PackedKv),
            "cross-layer" => Ok(CacheKind::CrossLayer),
            "state" => Ok(CacheKind::State),
            other => Err(LayoutError::Unsupported(format!(
                "unknown cache kind {other:?} (known: split-kv, joint-kv, mla, packed-kv, cross-layer, state)"
            ))),
        }
    }
}

/// Order of the dimensions inside one block of one part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockOrder {
    /// `[heads, tokens, head_dim]`: a head range of a block is contiguous.
    Hnd,
    /// `[tokens, heads, head_dim]`: a token's heads are contiguous.
    Nhd,
}

impl fmt::Display for BlockOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BlockOrder::Hnd => "HND",
            BlockOrder::Nhd => "NHD",
        })
    }
}

impl FromStr for BlockOrder {
    type Err = LayoutError;

    /// Parses `HND` or `NHD` (any case).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_uppercase().as_str() {
            "HND" => Ok(BlockOrder::Hnd),
            "NHD" => Ok(BlockOrder::Nhd),
            _ => Err(LayoutError::Unsupported(format!(
                "unknown block order {s:?} (known: HND, NHD)"
            ))),
        }
    }
}

/// Which tensor of a layer: K, V, or the MLA latent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// Keys.
    Key,
    /// Values.
    Value,
    /// The MLA latent (the only part of an MLA layer).
    Latent,
    /// K and V of a packed cache, interleaved per head and token (the only part of a
    /// packed layer, and of a layer's page in a cross-layer cache).
    PackedKv,
    /// A recurrent state page (the only part of a state layer).
    State,
}

/// The parameters of a cache spec, all public so callers can build them literally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheParams {
    /// Storage kind.
    pub kind: CacheKind,
    /// In-block dimension order (ignored for MLA, which has no head dimension).
    pub order: BlockOrder,
    /// Element type.
    pub dtype: Dtype,
    /// Layers held by this rank.
    pub num_layers: u32,
    /// KV heads held by this rank (must be 1 for MLA).
    pub kv_heads: u32,
    /// Head dimension, or the latent dimension for MLA.
    pub head_dim: u32,
    /// Tokens per block (the page size).
    pub tokens_per_block: u32,
    /// Blocks per region.
    pub num_blocks: u32,
}

/// A validated cache spec with its derived sizes. All accessors are infallible because
/// [`CacheSpec::new`] proved every derived size fits in `u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheSpec {
    params: CacheParams,
    /// Bytes of one head of one token (K and V together in a packed cache).
    head_token_bytes: u64,
    /// Bytes of one part (K, V or latent) of one block (of one layer's page, cross-layer).
    part_block_len: u64,
    /// Bytes of one block of one region (every layer's page, cross-layer).
    block_len: u64,
    /// Bytes of one region.
    region_len: u64,
    /// Regions: `2 * num_layers` for split K/V, 1 cross-layer, `num_layers` otherwise.
    num_regions: u32,
    /// Bytes of one token slot of one block of one region.
    token_slot_bytes: u64,
    /// Bytes of all regions together.
    total_bytes: u64,
}

/// A byte range relative to some base.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ByteRange {
    /// Offset of the first byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// `count` runs of `len` bytes, `stride` apart, starting at `offset` inside `region`.
/// A token's bytes are one run in NHD and one run per head in HND.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StridedBytes {
    /// The region the bytes live in.
    pub region: u32,
    /// Offset of the first run from the region's base.
    pub offset: u64,
    /// Length of each run.
    pub len: u64,
    /// Number of runs.
    pub count: u32,
    /// Distance between the starts of consecutive runs.
    pub stride: u64,
}

/// Where a part of a layer lives: its region and the part's offset inside each block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PartLocation {
    /// Region index.
    pub region: u32,
    /// Offset of the part inside a block of that region (V of a joint block: half a block).
    pub offset_in_block: u64,
}

impl CacheSpec {
    /// Validates the parameters and computes derived sizes with checked arithmetic.
    pub fn new(params: CacheParams) -> Result<Self> {
        let dims = [
            (params.num_layers, "num_layers"),
            (params.kv_heads, "kv_heads"),
            (params.head_dim, "head_dim"),
            (params.tokens_per_block, "tokens_per_block"),
        ];
        for (value, field) in dims {
            nonzero(value.into(), field)?;
            // A state page is one "head" of a model's whole per-layer state.
            let limit = match (params.kind, field) {
                (CacheKind::State, "head_dim") => MAX_STATE_PAGE,
                _ => MAX_DIM,
            };
            if value > limit {
                return Err(LayoutError::TooLarge {
                    what: field,
                    value: value.into(),
                    limit: limit.into(),
                });
            }
        }
        nonzero(params.num_blocks.into(), "num_blocks")?;
        if params.kind == CacheKind::Mla && params.kv_heads != 1 {
            return Err(LayoutError::Unsupported(format!(
                "an MLA cache has one latent per token, so kv_heads must be 1 (got {})",
                params.kv_heads
            )));
        }
        if params.kind == CacheKind::State && (params.kv_heads, params.tokens_per_block) != (1, 1) {
            return Err(LayoutError::Unsupported(format!(
                "a state cache has one page per block, so kv_heads and tokens_per_block must be 1 (got {} and {})",
                params.kv_heads, params.tokens_per_block
            )));
        }
        let vectors_per_slot = match params.kind {
            CacheKind::PackedKv | CacheKind::CrossLayer => 2,
            CacheKind::SplitKv | CacheKind::JointKv | CacheKind::Mla | CacheKind::State => 1,
        };
        let head_elements = mul(params.head_dim.into(), vectors_per_slot, "head elements")?;
        let head_token_bytes = mul(head_elements, params.dtype.width(), "head bytes")?;
        let token_bytes = mul(head_token_bytes, params.kv_heads.into(), "token bytes")?;
        let part_block_len = mul(
            token_bytes,
            params.tokens_per_block.into(),
            "part block length",
        )?;
        let parts_per_block = if params.kind == CacheKind::JointKv {
            2
        } else {
            1
        };
        let pages_per_block = match params.kind {
            CacheKind::CrossLayer => params.num_layers.into(),
            _ => parts_per_block,
        };
        let block_len = mul(part_block_len, pages_per_block, "block length")?;
        let region_len = mul(block_len, params.num_blocks.into(), "region length")?;
        let num_regions = match params.kind {
            // num_layers <= MAX_DIM, so doubling cannot overflow.
            CacheKind::SplitKv => params.num_layers.saturating_mul(2),
            CacheKind::JointKv | CacheKind::Mla | CacheKind::PackedKv | CacheKind::State => {
                params.num_layers
            }
            CacheKind::CrossLayer => 1,
        };
        // The whole cache must be addressable too.
        let total_bytes = mul(region_len, num_regions.into(), "cache size")?;
        // block_len / tokens_per_block, exactly.
        let token_slot_bytes = mul(token_bytes, pages_per_block, "token slot bytes")?;
        Ok(CacheSpec {
            params,
            head_token_bytes,
            part_block_len,
            block_len,
            region_len,
            num_regions,
            token_slot_bytes,
            total_bytes,
        })
    }

    /// The parameters this spec was built from.
    pub fn params(&self) -> &CacheParams {
        &self.params
    }

    /// Storage kind.
    pub fn kind(&self) -> CacheKind {
        self.params.kind
    }

    /// In-block order (MLA reports its given order but has no head dimension).
    pub fn order(&self) -> BlockOrder {
        self.params.order
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.params.dtype
    }

    /// Layers held.
    pub fn num_layers(&self) -> u32 {
        self.params.num_layers
    }

    /// KV heads held (1 for MLA).
    pub fn kv_heads(&self) -> u32 {
        self.params.kv_heads
    }

    /// Head (or latent) dimension.
    pub fn head_dim(&self) -> u32 {
        self.params.head_dim
    }

    /// Tokens per block.
    pub fn tokens_per_block(&self) -> u32 {
        self.params.tokens_per_block
    }

    /// Blocks per region.
    pub fn num_blocks(&self) -> u32 {
        self.params.num_blocks
    }

    /// Number of regions: `2 * layers` for split K/V, 1 for a cross-layer cache, `layers`
    /// otherwise.
    pub fn num_regions(&self) -> u32 {
        self.num_regions
    }

    /// The parts of every layer: `[Key, Value]`, `[Latent]` for MLA, `[PackedKv]` for a
    /// packed or cross-layer cache, `[State]` for a state cache.
    pub fn parts(&self) -> &'static [Part] {
        match self.params.kind {
            CacheKind::Mla => &[Part::Latent],
            CacheKind::State => &[Part::State],
            CacheKind::PackedKv | CacheKind::CrossLayer => &[Part::PackedKv],
            CacheKind::SplitKv | CacheKind::JointKv => &[Part::Key, Part::Value],
        }
    }

    /// Bytes of one block of one region (`block_len` in the reference); in a cross-layer
    /// cache, the block of every layer.
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// Bytes of one part (K, V or latent) of one block; in a cross-layer cache, one layer's
    /// page of a block.
    pub fn part_block_len(&self) -> u64 {
        self.part_block_len
    }

    /// Bytes of one head of one token (its K and V together in a packed cache).
    pub fn head_token_bytes(&self) -> u64 {
        self.head_token_bytes
    }

    /// Bytes one token slot occupies in one block of one region (K and V together for joint).
    pub fn token_slot_bytes(&self) -> u64 {
        self.token_slot_bytes
    }

    /// Bytes of one region: `num_blocks * block_len`.
    pub fn region_len(&self) -> u64 {
        self.region_len
    }

    /// Bytes of all regions together.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Where `part` of `layer` lives.
    pub fn locate(&self, layer: u32, part: Part) -> Result<PartLocation> {
        in_range(layer.into(), self.params.num_layers.into(), "layer")?;
        // layer < num_layers <= MAX_DIM, so these region numbers fit.
        let split_k = layer.saturating_mul(2);
        let (region, offset_in_block) = match (self.params.kind, part) {
            (CacheKind::SplitKv, Part::Key) => (split_k, 0),
            (CacheKind::SplitKv, Part::Value) => (split_k.saturating_add(1), 0),
            (CacheKind::JointKv, Part::Key) => (layer, 0),
            (CacheKind::JointKv, Part::Value) => (layer, self.part_block_len),
            (CacheKind::Mla, Part::Latent) | (CacheKind::State, Part::State) => (layer, 0),
            (CacheKind::PackedKv, Part::PackedKv) => (layer, 0),
            // layer < num_layers, and num_layers pages make a block the spec checked.
            (CacheKind::CrossLayer, Part::PackedKv) => {
                (0, u64::from(layer).saturating_mul(self.part_block_len))
            }
            (kind, part) => {
                return Err(LayoutError::Unsupported(format!(
                    "a {kind} cache has no {part:?} part"
                )));
            }
        };
        Ok(PartLocation {
            region,
            offset_in_block,
        })
    }

    /// Byte range of `block` inside `region`, relative to the region's base.
    pub fn block_range(&self, region: u32, block: u32) -> Result<ByteRange> {
        in_range(region.into(), self.num_regions().into(), "region")?;
        in_range(block.into(), self.params.num_blocks.into(), "block")?;
        Ok(ByteRange {
            offset: mul(block.into(), self.block_len, "block offset")?,
            len: self.block_len,
        })
    }

    /// The bytes of one token of one part of one block: one run in NHD (and MLA), one run
    /// per head in HND.
    pub fn token_bytes(
        &self,
        layer: u32,
        part: Part,
        block: u32,
        token: u32,
    ) -> Result<StridedBytes> {
        let loc = self.locate(layer, part)?;
        in_range(block.into(), self.params.num_blocks.into(), "block")?;
        in_range(token.into(), self.params.tokens_per_block.into(), "token")?;
        let what = "token offset";
        let block_start = mul(block.into(), self.block_len, what)?;
        let part_base = add(block_start, loc.offset_in_block, what)?;
        let token = u64::from(token);
        let heads = self.params.kv_heads;
        let bytes = if self.is_head_major() {
            let head_stride = mul(
                self.head_token_bytes,
                self.params.tokens_per_block.into(),
                what,
            )?;
            StridedBytes {
                region: loc.region,
                offset: add(part_base, mul(token, self.head_token_bytes, what)?, what)?,
                len: self.head_token_bytes,
                count: heads,
                stride: head_stride,
            }
        } else {
            let len = mul(self.head_token_bytes, heads.into(), what)?;
            StridedBytes {
                region: loc.region,
                offset: add(part_base, mul(token, len, what)?, what)?,
                len,
                count: 1,
                stride: len,
            }
        };
        Ok(bytes)
    }

    /// Byte range of one head of one token, always contiguous.
    pub fn head_token_range(
        &self,
        layer: u32,
        part: Part,
        block: u32,
        token: u32,
        head: u32,
    ) -> Result<(u32, ByteRange)> {
        in_range(head.into(), self.params.kv_heads.into(), "head")?;
        let t = self.token_bytes(layer, part, block, token)?;
        let step = if self.is_head_major() {
            t.stride
        } else {
            self.head_token_bytes
        };
        let what = "head offset";
        let offset = add(t.offset, mul(head.into(), step, what)?, what)?;
        let range = ByteRange {
            offset,
            len: self.head_token_bytes,
        };
        Ok((t.region, range))
    }

    /// True when heads are the outer in-block dimension (HND with more than one head).
    /// MLA, state and single-head caches behave the same in both orders.
    pub(crate) fn is_head_major(&self) -> bool {
        self.params.order == BlockOrder::Hnd
            && !matches!(self.params.kind, CacheKind::Mla | CacheKind::State)
    }
}

impl fmt::Display for CacheSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.params;
        write!(
            f,
            "{} {} {} layers={} kv_heads={} head_dim={} tokens/block={} blocks={}",
            p.kind,
            p.order,
            p.dtype,
            p.num_layers,
            p.kv_heads,
            p.head_dim,
            p.tokens_per_block,
            p.num_blocks
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn llama8b(kind: CacheKind, order: BlockOrder) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind,
            order,
            dtype: Dtype::Bf16,
            num_layers: 32,
            kv_heads: 8,
            head_dim: 128,
            tokens_per_block: 16,
            num_blocks: 256,
        })
        .unwrap()
    }

    #[test]
    fn a_state_cache_is_one_page_per_block_and_layer() {
        let p = CacheParams {
            kind: CacheKind::State,
            order: BlockOrder::Hnd,
            dtype: Dtype::U8,
            num_layers: 2,
            kv_heads: 1,
            head_dim: 19840,
            tokens_per_block: 1,
            num_blocks: 8,
        };
        let s = CacheSpec::new(p).unwrap();
        assert_eq!((s.block_len(), s.num_regions()), (19840, 2));
        assert_eq!(s.parts(), &[Part::State]);
        assert_eq!(s.locate(1, Part::State).unwrap().region, 1);
        assert!(s.locate(0, Part::Latent).is_err());
        for bad in [
            CacheParams { kv_heads: 2, ..p },
            CacheParams {
                tokens_per_block: 16,
                ..p
            },
            CacheParams {
                head_dim: MAX_STATE_PAGE + 1,
                ..p
            },
        ] {
            assert!(CacheSpec::new(bad).is_err(), "{bad:?}");
        }
        // A page may hold more elements than any head (MAX_DIM), as a layer's state does.
        let big = CacheParams {
            head_dim: 3 << 20,
            ..p
        };
        assert!(CacheSpec::new(big).is_ok());
        let mla = CacheParams {
            kind: CacheKind::Mla,
            ..big
        };
        assert!(CacheSpec::new(mla).is_err());
        assert_eq!("state".parse::<CacheKind>().unwrap(), CacheKind::State);
        assert_eq!(CacheKind::State.to_string(), "state");
    }

    #[test]
    fn a_spec_displays_every_parameter() {
        let shown = llama8b(CacheKind::SplitKv, BlockOrder::Hnd).to_string();
        let tail = "layers=32 kv_heads=8 head_dim=128 tokens/block=16 blocks=256";
        assert!(shown.ends_with(tail), "{shown}");
    }

    #[test]
    fn llama_8b_sizes_match_reference() {
        let s = llama8b(CacheKind::SplitKv, BlockOrder::Hnd);
        assert_eq!(s.num_regions(), 64);
        assert_eq!(s.block_len(), 16 * 8 * 128 * 2); // 32 KiB, the peer script's block_len
        assert_eq!(s.region_len(), 256 * 32768);
        assert_eq!(s.token_slot_bytes(), 2048);
        assert_eq!(s.head_dim(), 128);
        assert_eq!(s.total_bytes(), 64 * 256 * 32768);
        assert_eq!(
            s.block_range(5, 3).unwrap(),
            ByteRange {
                offset: 3 * 32768,
                len: 32768
            }
        );
        assert!(s.block_range(64, 0).is_err());
        assert!(s.block_range(0, 256).is_err());
        let j = llama8b(CacheKind::JointKv, BlockOrder::Nhd);
        assert_eq!(j.num_regions(), 32);
        assert_eq!(j.block_len(), 2 * 32768);
        assert_eq!(j.locate(3, Part::Value).unwrap().offset_in_block, 32768);
    }

    #[test]
    fn mla_shape() {
        let s = CacheSpec::new(CacheParams {
            kind: CacheKind::Mla,
            order: BlockOrder::Nhd,
            dtype: Dtype::Bf16,
            num_layers: 61,
            kv_heads: 1,
            head_dim: 576,
            tokens_per_block: 64,
            num_blocks: 10,
        })
        .unwrap();
        assert_eq!(s.num_regions(), 61);
        assert_eq!(s.block_len(), 64 * 576 * 2);
        assert!(s.locate(0, Part::Key).is_err());
        let mut p = *s.params();
        p.kv_heads = 2;
        assert!(matches!(
            CacheSpec::new(p),
            Err(LayoutError::Unsupported(_))
        ));
    }

    /// vLLM 0.32's CPU cache: per layer `[blocks, heads, tokens, 2 * head_dim]`, contiguous.
    fn vllm_cpu(heads: u32, head_dim: u32, dtype: Dtype) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind: CacheKind::PackedKv,
            order: BlockOrder::Hnd,
            dtype,
            num_layers: 2,
            kv_heads: heads,
            head_dim,
            tokens_per_block: 32,
            num_blocks: 16,
        })
        .unwrap()
    }

    #[test]
    fn packed_kv_matches_vllm_cpu_tensor_strides() {
        // The tiny fp32 model of ../shared/realvllm: 32 KiB per block per layer.
        let s = vllm_cpu(2, 64, Dtype::F32);
        assert_eq!(s.num_regions(), 2);
        assert_eq!(s.parts(), &[Part::PackedKv]);
        assert_eq!(s.block_len(), 2 * 32 * 2 * 64 * 4);
        assert_eq!(s.block_len(), 32 << 10);
        assert_eq!(s.head_token_bytes(), 2 * 64 * 4);
        // Llama-3-8B's geometry in bf16: 128 KiB per block per layer.
        assert_eq!(vllm_cpu(8, 128, Dtype::Bf16).block_len(), 128 << 10);
        // Element [b, h, t, c] sits at ((b * H + h) * T + t) * 2D + c; c < D is K, else V.
        let (h_n, t_n, d, w) = (2u64, 32u64, 64u64, 4u64);
        for (b, h, t) in [(0u32, 0u32, 0u32), (3, 1, 31), (15, 0, 7)] {
            let (region, r) = s.head_token_range(1, Part::PackedKv, b, t, h).unwrap();
            let at = ((u64::from(b) * h_n + u64::from(h)) * t_n + u64::from(t)) * 2 * d * w;
            assert_eq!((region, r.offset, r.len), (1, at, 2 * d * w));
            let tok = s.token_bytes(1, Part::PackedKv, b, t).unwrap();
            assert_eq!(
                (tok.count, tok.len, tok.stride),
                (2, 2 * d * w, t_n * 2 * d * w)
            );
        }
        assert_eq!(s.locate(1, Part::PackedKv).unwrap().region, 1);
        for part in [Part::Key, Part::Value, Part::Latent] {
            assert!(s.locate(0, part).is_err());
        }
        // Split K/V has no packed part.
        let split = llama8b(CacheKind::SplitKv, BlockOrder::Hnd);
        assert!(split.locate(0, Part::PackedKv).is_err());
        // A head dim whose doubled slot overflows is a typed error.
        let mut p = *s.params();
        p.head_dim = MAX_DIM;
        p.kv_heads = MAX_DIM;
        p.tokens_per_block = MAX_DIM;
        p.num_blocks = u32::MAX;
        assert!(matches!(
            CacheSpec::new(p),
            Err(LayoutError::Overflow { .. })
        ));
    }

    /// vLLM's BLHNC tensor: `[blocks, layers, heads, tokens, 2 * head_dim]`, strides in
    /// elements `(L*H*N*C, H*N*C, N*C, C, 1)` with `C = 2 * head_dim`.
    #[test]
    fn cross_layer_matches_vllm_blhnc_strides() {
        let (l, h, n, d, blocks) = (3u32, 2u32, 4u32, 8u32, 5u32);
        let s = CacheSpec::new(CacheParams {
            kind: CacheKind::CrossLayer,
            order: BlockOrder::Hnd,
            dtype: Dtype::F16,
            num_layers: l,
            kv_heads: h,
            head_dim: d,
            tokens_per_block: n,
            num_blocks: blocks,
        })
        .unwrap();
        let c = u64::from(2 * d);
        let (l, h, n) = (u64::from(l), u64::from(h), u64::from(n));
        let elt = 2;
        assert_eq!(s.num_regions(), 1);
        assert_eq!(s.parts(), &[Part::PackedKv]);
        assert_eq!(s.part_block_len(), h * n * c * elt);
        assert_eq!(s.block_len(), l * h * n * c * elt);
        assert_eq!(s.region_len(), s.block_len() * u64::from(blocks));
        assert_eq!(s.total_bytes(), s.region_len());
        assert_eq!(s.token_slot_bytes() * n, s.block_len());
        for (b, layer, head, t) in [(0u32, 0u32, 0u32, 0u32), (4, 2, 1, 3), (2, 1, 0, 2)] {
            let (region, r) = s
                .head_token_range(layer, Part::PackedKv, b, t, head)
                .unwrap();
            let want = u64::from(b) * l * h * n * c
                + u64::from(layer) * h * n * c
                + u64::from(head) * n * c
                + u64::from(t) * c;
            assert_eq!((region, r.offset, r.len), (0, want * elt, c * elt));
        }
        assert_eq!(
            s.locate(2, Part::PackedKv).unwrap(),
            PartLocation {
                region: 0,
                offset_in_block: 2 * s.part_block_len()
            }
        );
        assert!(s.locate(3, Part::PackedKv).is_err());
        assert!(s.locate(0, Part::Key).is_err());
    }

    #[test]
    fn kinds_and_orders_parse_what_they_print() {
        for k in [
            CacheKind::SplitKv,
            CacheKind::JointKv,
            CacheKind::Mla,
            CacheKind::PackedKv,
            CacheKind::CrossLayer,
        ] {
            assert_eq!(k.to_string().parse::<CacheKind>().unwrap(), k);
        }
        for o in [BlockOrder::Hnd, BlockOrder::Nhd] {
            assert_eq!(o.to_string().parse::<BlockOrder>().unwrap(), o);
        }
        assert_eq!("nhd".parse::<BlockOrder>().unwrap(), BlockOrder::Nhd);
        assert!("packed".parse::<CacheKind>().is_err());
        assert!("HDN".parse::<BlockOrder>().is_err());
    }

    #[test]
    fn token_bytes_hnd_vs_nhd() {
        let h = llama8b(CacheKind::SplitKv, BlockOrder::Hnd);
        let t = h.token_bytes(1, Part::Value, 2, 3).unwrap();
        assert_eq!(t.region, 3);
        assert_eq!(
            (t.offset, t.len, t.count, t.stride),
            (2 * 32768 + 3 * 256, 256, 8, 16 * 256)
        );
        let n = llama8b(CacheKind::SplitKv, BlockOrder::Nhd);
        let t = n.token_bytes(1, Part::Value, 2, 3).unwrap();
        assert_eq!((t.offset, t.len, t.count), (2 * 32768 + 3 * 2048, 2048, 1));
        let (_, r) = n.head_token_range(1, Part::Key, 0, 1, 7).unwrap();
        assert_eq!(
            r,
            ByteRange {
                offset: 2048 + 7 * 256,
                len: 256
            }
        );
        assert!(n.token_bytes(32, Part::Key, 0, 0).is_err());
        assert!(n.token_bytes(0, Part::Key, 256, 0).is_err());
        assert!(n.token_bytes(0, Part::Key, 0, 16).is_err());
        assert!(n.head_token_range(0, Part::Key, 0, 0, 8).is_err());
    }

    #[test]
    fn bad_params_are_typed_errors() {
        let mut p = *llama8b(CacheKind::SplitKv, BlockOrder::Hnd).params();
        p.num_blocks = 0;
        assert_eq!(
            CacheSpec::new(p),
            Err(LayoutError::Zero {
                field: "num_blocks"
            })
        );
        p.num_blocks = u32::MAX;
        p.head_dim = MAX_DIM;
        p.kv_heads = MAX_DIM;
        p.dtype = Dtype::F32;
        assert!(matches!(
            CacheSpec::new(p),
            Err(LayoutError::Overflow { .. })
        ));
        p.kv_heads = MAX_DIM + 1;
        assert!(matches!(
            CacheSpec::new(p),
            Err(LayoutError::TooLarge { .. })
        ));
    }
}
