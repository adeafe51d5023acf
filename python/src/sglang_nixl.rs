//! SGLang 0.5.23's nixl backend's ZMQ messages, for the SGLang backend's mixed fleets: what
//! a kvxfer decode sends a stock SGLang prefill rank (its registration, a room, an abort),
//! built by `kvxfer_core::wire::sglang_nixl` so they are SGLang's bytes exactly, and what
//! such a rank answers, decoded with its bounds.

use kvxfer_core::wire::sglang_nixl as wire;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::InvalidArgumentError;

fn as_bytes<'py>(py: Python<'py>, frames: Vec<Vec<u8>>) -> Vec<Bound<'py, PyBytes>> {
    frames.iter().map(|f| PyBytes::new(py, f)).collect()
}

/// The registration a decode rank sends each stock prefill rank once: its PULL socket
/// `endpoint`, NIXL agent `agent` and its NIXL `metadata`, KV buffers in SGLang's order (K of
/// every layer, then V; one per layer for MLA) with their page sizes and pages, memory kind
/// `kv_mem_kind` (`DRAM` or `VRAM`), aux buffers, one state type's buffers (bases, item and
/// data lengths), its GPU and its (TP size, TP rank).
#[pyfunction]
#[pyo3(signature = (
    endpoint, agent, metadata, kv_ptrs, kv_item_lens, num_slots, kv_mem_kind, aux_ptrs, *,
    gpu_id, tp, state_ptrs = Vec::new(), state_item_lens = Vec::new(),
    state_data_lens = Vec::new()
))]
#[allow(clippy::too_many_arguments)]
pub fn sglang_nixl_registration<'py>(
    py: Python<'py>,
    endpoint: (String, u16),
    agent: String,
    metadata: Vec<u8>,
    kv_ptrs: Vec<u64>,
    kv_item_lens: Vec<u64>,
    num_slots: u64,
    kv_mem_kind: String,
    aux_ptrs: Vec<u64>,
    gpu_id: u32,
    tp: (u32, u32),
    state_ptrs: Vec<u64>,
    state_item_lens: Vec<u32>,
    state_data_lens: Vec<u64>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if kv_item_lens.len() != kv_ptrs.len() {
        return Err(InvalidArgumentError::new_err(format!(
            "{} KV item lengths for {} KV buffers",
            kv_item_lens.len(),
            kv_ptrs.len()
        )));
    }
    let one = |v: Vec<u64>| if v.is_empty() { Vec::new() } else { vec![v] };
    let r = wire::Registration {
        endpoint,
        agent,
        metadata,
        kv_mem_kinds: vec![kv_mem_kind; kv_ptrs.len()],
        kv_ptrs,
        aux_ptrs,
        state_ptrs: one(state_ptrs),
        gpu_id,
        tp,
        kv_item_lens,
        state_item_lens: if state_item_lens.is_empty() {
            Vec::new()
        } else {
            vec![state_item_lens]
        },
        state_dims: Vec::new(),
        staging: None,
        num_slots,
        state_layer_ids: Vec::new(),
        kv_layer_ids: Vec::new(),
        dcp: (1, 0),
        state_data_lens: one(state_data_lens),
    };
    Ok(as_bytes(py, wire::encode_registration(&r)))
}

/// A room's destination on this decode rank, for one stock prefill rank: its `pages` (for
/// the prompt tokens after `prefix_tokens`), aux row, the destinations that prefill rank
/// serves per room (`required`), one state type's indices.
#[pyfunction]
#[pyo3(signature = (room, endpoint, agent, pages, aux_index, required, state = Vec::new(), prefix_tokens = 0))]
#[allow(clippy::too_many_arguments)]
pub fn sglang_nixl_room<'py>(
    py: Python<'py>,
    room: u64,
    endpoint: (String, u16),
    agent: String,
    pages: Vec<u32>,
    aux_index: Option<u32>,
    required: u32,
    state: Vec<i32>,
    prefix_tokens: u64,
) -> Vec<Bound<'py, PyBytes>> {
    let r = wire::Room {
        room,
        endpoint,
        agent,
        pages,
        aux_index,
        required,
        // SGLang lists one entry per state type, empty where a type has none.
        state: if state.is_empty() {
            Vec::new()
        } else {
            vec![state]
        },
        prefix_tokens,
        dummy: false,
    };
    as_bytes(py, wire::encode_room(&r))
}

/// The decode's `ABORT` of `room`, to be acknowledged at `endpoint` for `generation`.
#[pyfunction]
pub fn sglang_nixl_abort<'py>(
    py: Python<'py>,
    room: u64,
    endpoint: (String, u16),
    generation: u64,
) -> Vec<Bound<'py, PyBytes>> {
    as_bytes(py, wire::abort(room, &endpoint, generation))
}

/// A stock prefill rank's message to this decode rank: `("status", room, status, rank,
/// reason)` (`KV_STATUS`) or `("ack", room, rank, generation)` (`ABORT_ACK`, generation
/// `None` from older prefills). Raises `InvalidArgumentError` naming what is wrong.
#[pyfunction]
pub fn sglang_nixl_from_prefill(py: Python<'_>, frames: Vec<Vec<u8>>) -> PyResult<Py<PyAny>> {
    let parts: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    match wire::decode_from_prefill(&parts).map_err(InvalidArgumentError::new_err)? {
        wire::FromPrefill::Status {
            room,
            status,
            rank,
            reason,
        } => Ok(("status", room, status, rank, reason)
            .into_pyobject(py)?
            .into_any()
            .unbind()),
        wire::FromPrefill::AbortAck {
            room,
            rank,
            generation,
        } => Ok(("ack", room, rank, generation)
            .into_pyobject(py)?
            .into_any()
            .unbind()),
    }
}
