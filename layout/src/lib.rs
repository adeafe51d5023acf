//! # kvxfer-layout
//!
//! Pure byte-offset math for moving KV-cache blocks between a prefill and a decode engine:
//! cache specs (split K/V, joint K/V, MLA; HND or NHD), descriptor ids as the reference
//! pull connector numbers them, per-layer windows, tensor-parallel mapping in both
//! directions (with replicated heads), pipeline-parallel stages, coalesced transfer plans
//! and compatibility checks.
//!
//! No I/O, no `unsafe`, no threads. Every constructor validates its input and every
//! computation on sizes or addresses is checked (clippy's `arithmetic_side_effects` is
//! denied; the two per-block loops that keep plain arithmetic say why it cannot overflow):
//! bad parameters are a [`LayoutError`], never a panic.
#![forbid(unsafe_code)]
// Peer-supplied geometry reaches every computation here: none may wrap or panic.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]
#![warn(missing_docs)]

mod coalesce;
mod compat;
mod dtype;
mod error;
mod groups;
mod ids;
mod plan;
mod pp;
mod spec;
mod token_plan;
mod tp;

pub use coalesce::{Descriptor, IndexRun, coalesce, group_contiguous, push_merging};
pub use compat::{Mismatch, SideLayout, check_compatible};
pub use dtype::Dtype;
pub use error::{LayoutError, Result};
pub use groups::{LayerGroups, MAX_GROUPS};
pub use ids::{descriptor_ids, descriptor_ids_windowed, layer_regions, windowed_blocks};
pub use plan::{
    BlockPairs, CacheSide, DEFAULT_MAX_DESCRIPTORS, PlanOptions, TransferPlan, plan_transfer,
    plan_transfer_into,
};
pub use pp::{LayerRange, PpSplit};
pub use spec::{
    BlockOrder, ByteRange, CacheKind, CacheParams, CacheSpec, MAX_DIM, MAX_STATE_PAGE, Part,
    PartLocation, StridedBytes,
};
pub use token_plan::{
    TokenPairs, plan_token_transfer, plan_token_transfer_into, shared_unit, whole_blocks_only,
};
pub use tp::{HeadRange, HeadSharding, HeadSlice, LinkKind, Side, TpLink, TpMapping};
