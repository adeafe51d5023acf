//! Stock SGLang decodes (SGLang's own nixl backend) beside kvxfer's, for fleets that mix
//! the two: their ZMQ messages ([`crate::wire::sglang_nixl`]) arrive through
//! [`PushPrefill::stock_message`], and what they are told leaves through
//! [`PushPrefill::take_stock_outbox`] for the engine's ZMQ sockets.
//!
//! A stock decode's registration is translated into the registration a kvxfer decode with
//! the same buffers would send, so its rooms are checked, planned and written by the same
//! code; its NIXL metadata is loaded as the library's own (`load_native_peer`). What differs
//! is the signalling: no NIXL notifications ride on its WRITEs (SGLang 0.5.23 reads none),
//! it is told `KV_STATUS` once a room's WRITEs completed or the room failed, and its
//! `ABORT` is acknowledged with an `ABORT_ACK` once the room's WRITEs were released.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::CacheKind;

use super::PushPrefill;
use crate::push::buffers::PushBuffers;
use crate::push::messages::{BufferWire, RegisterArgs, RoomRequest};
use crate::tally::Tally;
use crate::transport::{AddrRange, MemoryKind, Transport};
use crate::wire::handshake::LayoutWire;
use crate::wire::sglang_nixl::{self as sgl, FromDecode};

/// Refused registrations whose reasons are kept for their decodes' rooms.
const MAX_REFUSALS_KEPT: usize = 64;

/// A message for a stock decode's PULL socket (`tcp://host:port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockOutgoing {
    /// The decode rank's host.
    pub host: String,
    /// Its PULL socket's port.
    pub port: u16,
    /// The multipart message.
    pub frames: Vec<Vec<u8>>,
}

/// A stock decode's registration as a kvxfer decode's, and the regions its NIXL agent
/// registered as far as the message tells them (checked against every WRITE).
pub(super) struct Translated {
    pub args: RegisterArgs,
    pub regions: Vec<(MemoryKind, AddrRange)>,
}

/// Translates a stock decode's registration against this rank's buffers (`bufs`), refusing
/// what kvxfer does not move with the factor named. SGLang sends no aux lengths: an aux row
/// is bounded by NIXL's own check against the decode's registered memory instead.
pub(super) fn translate(bufs: &PushBuffers, r: &sgl::Registration) -> Result<Translated, String> {
    let refuse = |what: String| Err(format!("stock SGLang decode {}: {what}", r.agent));
    if let Some((_, bytes)) = r.staging {
        return refuse(format!(
            "it stages KV through a buffer of {bytes} bytes (SGLANG_DISAGG_STAGING_BUFFER), which kvxfer does not write"
        ));
    }
    if r.dcp.0 != 1 {
        return refuse(format!("decode context parallelism {}", r.dcp.0));
    }
    if !r.kv_layer_ids.is_empty() {
        return refuse("KV buffers named by layer id (pipeline stages or draft KV)".into());
    }
    if r.kv_mem_kinds.windows(2).any(|w| w[0] != w[1]) {
        return refuse(format!(
            "KV buffers of mixed memory kinds {:?}",
            r.kv_mem_kinds
        ));
    }
    let kv = &bufs.kv;
    let spec = &kv.spec;
    let layers = spec.num_layers() as usize;
    let (per_layer, kind) = match spec.kind() {
        CacheKind::SplitKv => (2, "K and V"),
        CacheKind::Mla => (1, "latent"),
        other => return refuse(format!("this prefill's {other} cache has no stock layout")),
    };
    if r.kv_ptrs.len() != layers.saturating_mul(per_layer) {
        return refuse(format!(
            "{} KV buffers; this prefill has {layers} layers of {kind} buffers",
            r.kv_ptrs.len()
        ));
    }
    let item = r.kv_item_lens.first().copied().unwrap_or(0);
    if r.kv_item_lens.iter().any(|&l| l != item) {
        return refuse("KV buffers of different page sizes (a hybrid pool)".into());
    }
    // Bytes of one head of one page: a decode's page holds a whole number of its heads.
    let head_page = spec
        .head_token_bytes()
        .saturating_mul(u64::from(spec.tokens_per_block()));
    let heads = match spec.kind() {
        CacheKind::Mla if item == spec.part_block_len() => 1,
        _ if spec.kind() != CacheKind::Mla && item.checked_rem(head_page) == Some(0) => item
            .checked_div(head_page)
            .and_then(|h| u32::try_from(h).ok())
            .unwrap_or(0),
        _ => 0,
    };
    if heads == 0 {
        return refuse(format!(
            "{item} bytes per KV page; this prefill's {} tokens per page of {} bytes per head and token do not make whole heads of it",
            spec.tokens_per_block(),
            spec.head_token_bytes()
        ));
    }
    let Ok(num_blocks) = u32::try_from(r.num_slots) else {
        return refuse(format!("{} pages per KV buffer", r.num_slots));
    };
    let mut layout =
        LayoutWire::from_spec(spec, kv.total_kv_heads, kv.total_layers, kv.first_layer);
    layout.kv_heads = heads;
    layout.num_blocks = num_blocks;
    // SGLang lists K of every layer, then V of every layer; kvxfer numbers K0, V0, K1, ...
    let kv_bases: Vec<u64> = if per_layer == 2 {
        (0..layers)
            .flat_map(|l| [r.kv_ptrs[l], r.kv_ptrs[l.saturating_add(layers)]])
            .collect()
    } else {
        r.kv_ptrs.clone()
    };
    if r.aux_ptrs.len() != bufs.aux.len() {
        return refuse(format!(
            "{} aux buffers, this prefill {}",
            r.aux_ptrs.len(),
            bufs.aux.len()
        ));
    }
    let aux: Vec<BufferWire> = r
        .aux_ptrs
        .iter()
        .zip(&bufs.aux)
        .map(|(&base, ours)| BufferWire {
            base,
            item_len: ours.item_len,
            // Not sent: any row, bounded by what the decode registered (NIXL checks).
            items: u32::MAX,
        })
        .collect();
    let state = match r.state_ptrs.as_slice() {
        [] => Vec::new(),
        [ptrs] => {
            let lens = r.state_data_lens.first().map_or(&[][..], Vec::as_slice);
            let items = r.state_item_lens.first().map_or(&[][..], Vec::as_slice);
            if lens.len() != ptrs.len() || items.len() != ptrs.len() {
                return refuse(format!(
                    "{} state buffers with {} lengths and {} item lengths",
                    ptrs.len(),
                    lens.len(),
                    items.len()
                ));
            }
            let mut out = Vec::with_capacity(ptrs.len());
            for ((&base, &len), &item_len) in ptrs.iter().zip(lens).zip(items) {
                let count = len.checked_div(u64::from(item_len)).unwrap_or(0);
                out.push(BufferWire {
                    base,
                    item_len: item_len.into(),
                    items: u32::try_from(count).unwrap_or(u32::MAX),
                });
            }
            out
        }
        more => return refuse(format!("{} state types", more.len())),
    };
    let args = RegisterArgs {
        agent: r.agent.clone(),
        agent_metadata: r.metadata.clone(),
        layout,
        kv_bases,
        aux,
        state,
        tp_size: r.tp.0,
        tp_rank: r.tp.1,
        reregisters: false,
    };
    let region = item.saturating_mul(r.num_slots);
    let mut regions: Vec<(MemoryKind, AddrRange)> = args
        .kv_bases
        .iter()
        .map(|&b| (kv.memory, AddrRange::new(b, region)))
        .collect();
    for b in &args.aux {
        let len = b.end().map_or(0, |e| e.saturating_sub(b.base));
        regions.push((MemoryKind::Host, AddrRange::new(b.base, len)));
    }
    for b in &args.state {
        let len = b.end().map_or(0, |e| e.saturating_sub(b.base));
        regions.push((kv.memory, AddrRange::new(b.base, len)));
    }
    Ok(Translated { args, regions })
}

/// A stock decode's room as a kvxfer decode's, or why it is refused.
fn room_request(m: &sgl::Room) -> Result<RoomRequest, String> {
    if m.dummy && !m.pages.is_empty() {
        return Err(format!(
            "a dummy destination naming {} pages",
            m.pages.len()
        ));
    }
    if !m.dummy && m.pages.is_empty() {
        return Err(
            "no pages to write (the decode holds the whole prompt): kvxfer writes a stock decode's aux row with its pages only"
                .into(),
        );
    }
    let mut named = m.state.iter().filter(|l| !l.is_empty());
    let state_indices = match (named.next(), named.next()) {
        (None, _) => Vec::new(),
        (Some(l), None) => l
            .iter()
            .map(|&i| u32::try_from(i).map_err(|_| format!("state index {i}")))
            .collect::<Result<_, _>>()?,
        (Some(_), Some(_)) => return Err("indices of more than one state type".into()),
    };
    Ok(RoomRequest {
        room: m.room,
        agent: m.agent.clone(),
        pages: m.pages.clone(),
        aux_index: m.aux_index,
        state_indices,
        digest: false,
        prefix_tokens: m.prefix_tokens,
        group_pages: Vec::new(),
    })
}

impl<T: Transport> PushPrefill<T> {
    /// Takes one message of a stock SGLang decode (its registration, a room, an abort).
    /// A message that does not decode, or a registration kvxfer cannot serve, is refused
    /// with the reason (the engine logs it; a refused decode's rooms then fail, told so);
    /// a room that cannot be served fails, and its decode is told why.
    pub fn stock_message(&mut self, frames: &[&[u8]]) -> Result<(), String> {
        let msg = sgl::decode(frames).inspect_err(|_| self.refused.tally(1))?;
        match msg {
            FromDecode::Register(r) => {
                self.metrics.registrations.tally(1);
                let endpoint = r.endpoint.clone();
                let agent = r.agent.clone();
                let registered = translate(&self.bufs, &r)
                    .and_then(|t| self.register_decode(t.args, Some((endpoint, t.regions))));
                if let Err(e) = &registered {
                    self.refused.tally(1);
                    if self.stock_refusals.len() >= MAX_REFUSALS_KEPT {
                        self.stock_refusals.clear();
                    }
                    self.stock_refusals.insert(agent, e.clone());
                }
                registered
            }
            FromDecode::Room(m) => {
                let problem = match self.decodes.get(&m.agent).map(|d| &d.stock) {
                    None => Some(match self.stock_refusals.get(&m.agent) {
                        Some(why) => format!("its registration was refused: {why}"),
                        None => format!(
                            "stock SGLang decode {} sent room {} unregistered",
                            m.agent, m.room
                        ),
                    }),
                    Some(None) => Some(format!("{} is a kvxfer decode", m.agent)),
                    Some(Some(s)) if s.endpoint != m.endpoint => Some(format!(
                        "room {} names {:?}, its decode registered {:?}",
                        m.room, m.endpoint, s.endpoint
                    )),
                    Some(Some(_)) => None,
                };
                if let Some(reason) = problem {
                    // Nothing of it is kept: tell the address it gave.
                    self.refused.tally(1);
                    self.stock_tell(&m.endpoint, m.room, sgl::status::FAILED, &reason);
                    return Err(reason);
                }
                let req = room_request(&m);
                let ours = self
                    .decodes
                    .get(&m.agent)
                    .and_then(|d| d.mapping.notifications_per_request(self.config.tp.0).ok());
                let problem = match (&req, ours) {
                    (Err(e), _) => Some(e.clone()),
                    (Ok(_), Some(n)) if n != m.required => Some(format!(
                        "the decode counts {} destinations per room for this prefill rank, kvxfer {n} (their TP sizes pair otherwise)",
                        m.required
                    )),
                    _ => None,
                };
                let req = req.unwrap_or_else(|_| room_request_stub(&m));
                self.on_room_with(req, problem);
                Ok(())
            }
            FromDecode::Abort(a) => {
                self.stock_abort(a);
                Ok(())
            }
        }
    }

    /// Messages for stock decodes since the last call, oldest first.
    pub fn take_stock_outbox(&mut self) -> Vec<StockOutgoing> {
        std::mem::take(&mut self.stock_outbox)
    }

    /// This rank as SGLang numbers its statuses (`prefill_unique_rank`, context parallelism
    /// of 1).
    fn unique_rank(&self) -> u32 {
        let (tp_rank, (pp_rank, pp_size)) = (self.config.tp.0, self.config.pp);
        tp_rank.saturating_mul(pp_size).saturating_add(pp_rank)
    }

    pub(super) fn stock_tell(&mut self, to: &(String, u16), room: u64, status: u8, reason: &str) {
        let frames = sgl::kv_status(room, status, self.unique_rank(), reason);
        self.stock_outbox.push(StockOutgoing {
            host: to.0.clone(),
            port: to.1,
            frames,
        });
    }

    /// A stock decode's abort: the room's WRITEs into that decode released (so it fails
    /// here), then acknowledged where the decode waits for it. Without a return address
    /// every stock destination of the room is aborted, as SGLang's prefill does.
    fn stock_abort(&mut self, a: sgl::Abort) {
        let agents: Vec<String> = self
            .decodes
            .iter()
            .filter(|(_, d)| {
                d.stock
                    .as_ref()
                    .is_some_and(|s| a.ack.as_ref().is_none_or(|(to, _)| *to == s.endpoint))
            })
            .map(|(agent, _)| agent.clone())
            .collect();
        if let Some(r) = self.rooms.get_mut(&a.room) {
            for agent in &agents {
                for x in r.abort_by(agent).into_iter().flatten() {
                    let _ = self.transport.release(x);
                }
            }
        }
        if let Some((to, generation)) = a.ack {
            let frames = sgl::abort_ack(a.room, self.unique_rank(), generation);
            self.stock_outbox.push(StockOutgoing {
                host: to.0,
                port: to.1,
                frames,
            });
        }
    }
}

/// The room's identity alone, for a destination refused before its pages were read.
fn room_request_stub(m: &sgl::Room) -> RoomRequest {
    RoomRequest {
        room: m.room,
        agent: m.agent.clone(),
        pages: Vec::new(),
        aux_index: None,
        state_indices: Vec::new(),
        digest: false,
        prefix_tokens: m.prefix_tokens,
        group_pages: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
