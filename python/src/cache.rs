//! An engine's KV cache as Python describes it: the layout's parameters, one base address
//! per region and where the memory lives, checked before any transport sees it.

use kvxfer_core::MemoryKind;
use kvxfer_core::connector::KvCache;
use kvxfer_layout::{CacheParams, CacheSpec};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::agent::memory_kind;
use crate::errors::{InvalidArgumentError, LayoutError};
use crate::memory::{Kept, base_of, check_host_mapped};

/// The cache's description, field for field as the `layout` dict names it.
struct CacheArgs<'a, 'py> {
    pub kind: &'a str,
    pub order: &'a str,
    pub dtype: &'a str,
    pub num_layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub tokens_per_block: u32,
    pub num_blocks: u32,
    /// Addresses, or objects holding the regions (kept alive).
    pub bases: Vec<Bound<'py, PyAny>>,
    pub total_kv_heads: u32,
    pub total_layers: u32,
    pub first_layer: u32,
    pub memory: &'a str,
}

/// The checked cache: a valid spec, one base per region, host regions mapped read-write;
/// objects given as bases are added to `keep`.
fn build(a: CacheArgs<'_, '_>, keep: &mut Kept) -> PyResult<KvCache> {
    let layout = |e: kvxfer_layout::LayoutError| LayoutError::new_err(e.to_string());
    let spec = CacheSpec::new(CacheParams {
        kind: a.kind.parse().map_err(layout)?,
        order: a.order.parse().map_err(layout)?,
        dtype: a.dtype.parse().map_err(layout)?,
        num_layers: a.num_layers,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        tokens_per_block: a.tokens_per_block,
        num_blocks: a.num_blocks,
    })
    .map_err(layout)?;
    if a.bases.len() != spec.num_regions() as usize {
        return Err(LayoutError::new_err(format!(
            "{} region bases given, the layout has {} regions",
            a.bases.len(),
            spec.num_regions()
        )));
    }
    let memory = memory_kind(a.memory)?;
    let bases = a
        .bases
        .iter()
        .map(|b| base_of(b, spec.region_len(), keep))
        .collect::<PyResult<Vec<u64>>>()?;
    if memory == MemoryKind::Host {
        for &b in &bases {
            check_host_mapped(kvxfer_core::AddrRange::new(b, spec.region_len()))?;
        }
    }
    Ok(KvCache {
        spec,
        bases,
        memory,
        total_kv_heads: a.total_kv_heads,
        total_layers: a.total_layers,
        first_layer: a.first_layer,
        layer_windows: None,
        groups: None,
    })
}

const KEYS: [&str; 15] = [
    "kind",
    "order",
    "dtype",
    "num_layers",
    "kv_heads",
    "head_dim",
    "tokens_per_block",
    "num_blocks",
    "bases",
    "total_kv_heads",
    "total_layers",
    "first_layer",
    "memory",
    "groups",
    "state_groups",
];

/// [`build`] from a dict with the same keys (`first_layer` and `memory` optional); an
/// unknown key is refused, so a misspelt one cannot silently take a default.
pub fn from_dict(d: &Bound<'_, PyDict>, keep: &mut Kept) -> PyResult<KvCache> {
    for k in d.keys() {
        let k: String = k.extract()?;
        if !KEYS.contains(&k.as_str()) {
            return Err(InvalidArgumentError::new_err(format!(
                "layout: unknown key {k:?}"
            )));
        }
    }
    fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<T> {
        d.get_item(k)?
            .ok_or_else(|| InvalidArgumentError::new_err(format!("layout: missing {k:?}")))?
            .extract::<T>()
            .map_err(|e| {
                let e: PyErr = e.into();
                InvalidArgumentError::new_err(format!("layout: {k:?}: {e}"))
            })
    }
    let kind: String = get(d, "kind")?;
    let order: String = get(d, "order")?;
    let dtype: String = get(d, "dtype")?;
    let memory: String = if d.contains("memory")? {
        get(d, "memory")?
    } else {
        "host".into()
    };
    let first_layer = if d.contains("first_layer")? {
        get(d, "first_layer")?
    } else {
        0
    };
    let optional = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(d.get_item(k)?.filter(|v| !v.is_none()))
    };
    let groups = optional("groups")?.map(|_| get(d, "groups")).transpose()?;
    let state_groups = optional("state_groups")?
        .map(|_| get(d, "state_groups"))
        .transpose()?;
    let mut cache = build(
        CacheArgs {
            kind: &kind,
            order: &order,
            dtype: &dtype,
            num_layers: get(d, "num_layers")?,
            kv_heads: get(d, "kv_heads")?,
            head_dim: get(d, "head_dim")?,
            tokens_per_block: get(d, "tokens_per_block")?,
            num_blocks: get(d, "num_blocks")?,
            bases: get(d, "bases")?,
            total_kv_heads: get(d, "total_kv_heads")?,
            total_layers: get(d, "total_layers")?,
            first_layer,
            memory: &memory,
        },
        keep,
    )?;
    set_groups(&mut cache, groups, state_groups)?;
    Ok(cache)
}

/// Partitions the cache's layers into KV cache `groups` (a hybrid model; `None`: one
/// group), `state_groups` of them holding state pages; checked against the layer count.
fn set_groups(
    cache: &mut KvCache,
    groups: Option<Vec<Vec<u32>>>,
    state_groups: Option<Vec<u32>>,
) -> PyResult<()> {
    if state_groups.is_some() && groups.is_none() {
        return Err(LayoutError::new_err(
            "state_groups names KV cache groups, but no groups were given",
        ));
    }
    let layers = cache.spec.num_layers();
    cache.groups = groups
        .map(|g| {
            kvxfer_layout::LayerGroups::new(g, layers)
                .and_then(|g| g.with_state(state_groups.as_deref().unwrap_or(&[])))
        })
        .transpose()
        .map_err(|e| LayoutError::new_err(format!("KV cache groups: {e}")))?;
    Ok(())
}
