//! Compatibility of a local and a remote cache layout: every mismatch, not just the first.

use std::fmt;

use crate::{CacheKind, CacheSpec, HeadSharding, Side, TpMapping};

/// One side's cache and parallel layout, as exchanged in a handshake.
#[derive(Debug, Clone, Copy)]
pub struct SideLayout<'a> {
    /// This rank's cache spec.
    pub spec: &'a CacheSpec,
    /// TP size of the side.
    pub tp_size: u32,
    /// KV heads of the whole model (ignored for MLA).
    pub total_kv_heads: u32,
    /// Layers of the whole model (a pipeline stage's spec holds fewer).
    pub total_layers: u32,
}

/// A reason two layouts cannot exchange KV blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// A property both sides must share differs.
    Field {
        /// The property.
        field: &'static str,
        /// Local value.
        local: String,
        /// Remote value.
        remote: String,
    },
    /// One side is inconsistent with itself (e.g. heads per rank vs TP).
    Side {
        /// `"local"` or `"remote"`.
        side: &'static str,
        /// What is wrong.
        problem: String,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Field {
                field,
                local,
                remote,
            } => {
                write!(f, "{field}: local {local}, remote {remote}")
            }
            Mismatch::Side { side, problem } => write!(f, "{side} side: {problem}"),
        }
    }
}

fn field<T: PartialEq + ToString>(
    out: &mut Vec<Mismatch>,
    name: &'static str,
    local: T,
    remote: T,
) {
    if local != remote {
        out.push(Mismatch::Field {
            field: name,
            local: local.to_string(),
            remote: remote.to_string(),
        });
    }
}

fn sharding(side: &SideLayout<'_>) -> HeadSharding {
    if side.spec.kind() == CacheKind::Mla {
        HeadSharding::Replicated
    } else {
        HeadSharding::Split {
            total_kv_heads: side.total_kv_heads,
        }
    }
}

fn check_side(out: &mut Vec<Mismatch>, name: &'static str, side: &SideLayout<'_>) {
    let spec = side.spec;
    if spec.num_layers() > side.total_layers {
        out.push(Mismatch::Side {
            side: name,
            problem: format!(
                "holds {} layers of a {}-layer model",
                spec.num_layers(),
                side.total_layers
            ),
        });
    }
    // A TP of this size against itself validates divisibility and gives heads per rank.
    match TpMapping::new(side.tp_size, side.tp_size, sharding(side)) {
        Err(e) => out.push(Mismatch::Side {
            side: name,
            problem: e.to_string(),
        }),
        Ok(m) => {
            if let Ok(heads) = m.heads_of(Side::Prefill, 0) {
                if heads.count != spec.kv_heads() {
                    out.push(Mismatch::Side {
                        side: name,
                        problem: format!(
                            "{} KV heads per rank, but {} heads over TP {} give {}",
                            spec.kv_heads(),
                            side.total_kv_heads,
                            side.tp_size,
                            heads.count
                        ),
                    });
                }
            }
        }
    }
}

/// Checks that two layouts can exchange blocks: Ok, or every mismatch found.
pub fn check_compatible(
    local: &SideLayout<'_>,
    remote: &SideLayout<'_>,
) -> Result<(), Vec<Mismatch>> {
    let mut out = Vec::new();
    let (l, r) = (local.spec, remote.spec);
    field(&mut out, "cache kind", l.kind(), r.kind());
    if l.kind() != CacheKind::Mla || r.kind() != CacheKind::Mla {
        field(&mut out, "in-block order", l.order(), r.order());
        field(
            &mut out,
            "total KV heads",
            local.total_kv_heads,
            remote.total_kv_heads,
        );
    }
    field(&mut out, "dtype", l.dtype(), r.dtype());
    field(&mut out, "head dim", l.head_dim(), r.head_dim());
    // Blocks of different sizes pair when the smaller divides the larger (plans then map
    // token ranges: `plan_token_transfer`).
    if l.tokens_per_block() != r.tokens_per_block() {
        let why = if crate::shared_unit(l.tokens_per_block(), r.tokens_per_block()).is_err() {
            Some("the smaller must divide the larger")
        } else {
            crate::whole_blocks_only(l.kind()).or(crate::whole_blocks_only(r.kind()))
        };
        if let Some(why) = why {
            out.push(Mismatch::Field {
                field: "tokens per block",
                local: format!("{} ({why})", l.tokens_per_block()),
                remote: r.tokens_per_block().to_string(),
            });
        }
    }
    field(
        &mut out,
        "total layers",
        local.total_layers,
        remote.total_layers,
    );
    check_side(&mut out, "local", local);
    check_side(&mut out, "remote", remote);
    if out.is_empty() { Ok(()) } else { Err(out) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockOrder, CacheParams, Dtype};

    fn spec(heads: u32, dtype: Dtype, tokens: u32) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind: CacheKind::SplitKv,
            order: BlockOrder::Hnd,
            dtype,
            num_layers: 32,
            kv_heads: heads,
            head_dim: 128,
            tokens_per_block: tokens,
            num_blocks: 100,
        })
        .unwrap()
    }

    fn packed(tokens: u32) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind: CacheKind::PackedKv,
            order: BlockOrder::Hnd,
            dtype: Dtype::Bf16,
            num_layers: 32,
            kv_heads: 8,
            head_dim: 128,
            tokens_per_block: tokens,
            num_blocks: 100,
        })
        .unwrap()
    }

    #[test]
    fn compatible_hetero_tp() {
        let (a, b) = (spec(8, Dtype::Bf16, 16), spec(4, Dtype::Bf16, 16));
        let local = SideLayout {
            spec: &b,
            tp_size: 2,
            total_kv_heads: 8,
            total_layers: 32,
        };
        let remote = SideLayout {
            spec: &a,
            tp_size: 1,
            total_kv_heads: 8,
            total_layers: 32,
        };
        assert_eq!(check_compatible(&local, &remote), Ok(()));
    }

    #[test]
    fn block_sizes_pair_when_one_divides_the_other() {
        for (l, r, ok) in [
            (16, 32, true),
            (64, 16, true),
            (16, 16, true),
            (16, 24, false),
        ] {
            let (a, b) = (spec(8, Dtype::Bf16, l), spec(8, Dtype::Bf16, r));
            let side = |spec| SideLayout {
                spec,
                tp_size: 1,
                total_kv_heads: 8,
                total_layers: 32,
            };
            assert_eq!(
                check_compatible(&side(&a), &side(&b)).is_ok(),
                ok,
                "{l} and {r}"
            );
            // vLLM's CPU cache (packed K/V) moves whole blocks only.
            let (pa, pb) = (packed(l), packed(r));
            let packed_ok = check_compatible(&side(&pa), &side(&pb));
            assert_eq!(packed_ok.is_ok(), l == r, "packed {l} and {r}");
            if l != r && ok {
                let text = packed_ok.unwrap_err()[0].to_string();
                assert!(text.contains("not addressable by token"), "{text}");
            }
        }
    }

    /// MLA caches hold one latent per token whatever their order and head count: two of them
    /// pair across both; against another kind, the order and heads are compared too.
    #[test]
    fn mla_ignores_order_and_heads_only_against_mla() {
        let mla = |order| {
            CacheSpec::new(CacheParams {
                kind: CacheKind::Mla,
                order,
                dtype: Dtype::Bf16,
                num_layers: 32,
                kv_heads: 1,
                head_dim: 128,
                tokens_per_block: 16,
                num_blocks: 100,
            })
            .unwrap()
        };
        let side = |spec, heads| SideLayout {
            spec,
            tp_size: 1,
            total_kv_heads: heads,
            total_layers: 32,
        };
        let (a, b) = (mla(BlockOrder::Hnd), mla(BlockOrder::Nhd));
        assert_eq!(check_compatible(&side(&a, 1), &side(&b, 8)), Ok(()));
        let split = spec(1, Dtype::Bf16, 16);
        let text: Vec<String> = check_compatible(&side(&b, 1), &side(&split, 8))
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        for field in ["cache kind", "in-block order", "total KV heads"] {
            assert!(
                text.iter().any(|t| t.starts_with(field)),
                "{field}: {text:?}"
            );
        }
    }

    /// A state cache holds one page per rank (its "head" of `tp_size`): equal TP sizes pair,
    /// others are refused, since a rank's state is its shard of the model.
    #[test]
    fn state_caches_pair_only_at_equal_tp() {
        let state = CacheSpec::new(CacheParams {
            kind: CacheKind::State,
            order: BlockOrder::Hnd,
            dtype: Dtype::U8,
            num_layers: 2,
            kv_heads: 1,
            head_dim: 19840,
            tokens_per_block: 1,
            num_blocks: 100,
        })
        .unwrap();
        let side = |tp_size| SideLayout {
            spec: &state,
            tp_size,
            total_kv_heads: tp_size,
            total_layers: 2,
        };
        assert_eq!(check_compatible(&side(1), &side(1)), Ok(()));
        assert_eq!(check_compatible(&side(2), &side(2)), Ok(()));
        let text = check_compatible(&side(1), &side(2)).unwrap_err()[0].to_string();
        assert!(text.starts_with("total KV heads"), "{text}");
    }

    #[test]
    fn lists_every_mismatch() {
        let (a, b) = (spec(8, Dtype::Bf16, 16), spec(3, Dtype::F16, 24));
        let local = SideLayout {
            spec: &a,
            tp_size: 1,
            total_kv_heads: 8,
            total_layers: 32,
        };
        let remote = SideLayout {
            spec: &b,
            tp_size: 3,
            total_kv_heads: 8,
            total_layers: 40,
        };
        let errs = check_compatible(&local, &remote).unwrap_err();
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        assert!(
            text.iter()
                .any(|t| t.starts_with("dtype: local bf16, remote f16")),
            "{text:?}"
        );
        assert!(
            text.iter().any(|t| t.starts_with(
                "tokens per block: local 16 (the smaller must divide the larger), remote 24"
            )),
            "{text:?}"
        );
        assert!(
            text.iter().any(|t| t.starts_with("total layers")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("remote side") && t.contains("not divisible")),
            "{text:?}"
        );
        assert_eq!(errs.len(), 4, "{text:?}");
    }
}
