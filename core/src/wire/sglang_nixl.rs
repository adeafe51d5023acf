//! SGLang's own nixl transfer backend's ZMQ messages (SGLang 0.5.23), for mixed fleets: a
//! stock SGLang decode registers its buffers with a prefill rank and names each room's pages
//! in multipart messages on the rank's PULL socket; the prefill answers each room with a
//! `KV_STATUS` message once its WRITEs completed (the backend sends no NIXL notifications),
//! and acknowledges a decode's `ABORT` with an `ABORT_ACK`.
//!
//! Frames are decimal ASCII numbers, native (little-endian) packed integers and SGLang's
//! "list of lists" (`pack_int_lists`: a `u32` count, a `u32` length per list, the lists).
//! Decoding is bounded and never panics; encoding writes exactly what SGLang's own decode
//! sends, so [`decode`] of [`encode_registration`] or [`encode_room`] gives the message back.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

/// First frame of a registration or a room (SGLang's `GUARD`).
pub const GUARD: &[u8] = b"NixlMsgGuard";
/// First frame of a decode's abort.
pub const ABORT: &[u8] = b"ABORT";
/// First frame of a prefill's status message.
pub const KV_STATUS: &[u8] = b"KV_STATUS";
/// First frame of a prefill's abort acknowledgement.
pub const ABORT_ACK: &[u8] = b"ABORT_ACK";
/// Frames of a registration as SGLang 0.5.23 sends it.
pub const REGISTRATION_FRAMES: usize = 25;
/// Frames of a room as SGLang 0.5.23 sends it.
pub const ROOM_FRAMES: usize = 11;
/// Most frames of any message.
pub const MAX_FRAMES: usize = 32;
/// Largest frame (agent metadata included).
pub const MAX_FRAME_BYTES: usize = 32 << 20;
/// Most KV or aux buffers, state lists or entries of one list.
pub const MAX_ENTRIES: usize = 1 << 16;
/// Most pages of one room.
pub const MAX_PAGES: usize = 1 << 22;
/// Longest text field (addresses, agent names).
pub const MAX_TEXT: usize = 256;

/// SGLang's room status values (`KVPoll`).
pub mod status {
    /// The room failed.
    pub const FAILED: u8 = 0;
    /// Every page and the aux row landed.
    pub const SUCCESS: u8 = 4;
}

/// A decode rank's buffers, sent once per prefill rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// Where the decode rank's PULL socket listens (statuses and acknowledgements go there).
    pub endpoint: (String, u16),
    /// Its NIXL agent's name.
    pub agent: String,
    /// Its NIXL agent's own metadata (`getLocalMD`).
    pub metadata: Vec<u8>,
    /// KV buffer bases: K of every layer, then V of every layer (one per layer for MLA).
    pub kv_ptrs: Vec<u64>,
    /// Aux buffer bases.
    pub aux_ptrs: Vec<u64>,
    /// State buffer bases, per state type.
    pub state_ptrs: Vec<Vec<u64>>,
    /// Its GPU.
    pub gpu_id: u32,
    /// Attention TP size and this rank's TP rank.
    pub tp: (u32, u32),
    /// Bytes of one page of each KV buffer.
    pub kv_item_lens: Vec<u64>,
    /// Bytes per state item, per state type.
    pub state_item_lens: Vec<Vec<u32>>,
    /// State dimension per tensor, per state type.
    pub state_dims: Vec<Vec<u32>>,
    /// Its staging buffer (base, bytes), when staging is on.
    pub staging: Option<(u64, u64)>,
    /// Pages of each KV buffer.
    pub num_slots: u64,
    /// Memory kind of each KV buffer (`VRAM` or `DRAM`).
    pub kv_mem_kinds: Vec<String>,
    /// State layer ids, per state type.
    pub state_layer_ids: Vec<Vec<u32>>,
    /// KV layer ids (empty for a plain pool).
    pub kv_layer_ids: Vec<u32>,
    /// Decode context parallelism (size, rank).
    pub dcp: (u32, u32),
    /// Bytes of each state buffer, per state type.
    pub state_data_lens: Vec<Vec<u64>>,
}

/// A room's destination on one decode rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Room {
    /// The room (SGLang's `bootstrap_room`).
    pub room: u64,
    /// The decode rank's PULL socket.
    pub endpoint: (String, u16),
    /// Its agent (registered before).
    pub agent: String,
    /// Destination pages, for the prompt tokens after `prefix_tokens`.
    pub pages: Vec<u32>,
    /// The decode's aux row (`None` where SGLang sent none).
    pub aux_index: Option<u32>,
    /// Destinations the prefill rank serves for this room.
    pub required: u32,
    /// State indices per state type.
    pub state: Vec<Vec<i32>>,
    /// Prompt tokens the decode holds already (its radix cache).
    pub prefix_tokens: u64,
    /// A destination that takes no data (a context-parallel replica).
    pub dummy: bool,
}

/// A decode's abort of a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abort {
    /// The room.
    pub room: u64,
    /// Where to acknowledge, with the decode's generation: present when it waits for one.
    pub ack: Option<((String, u16), u64)>,
}

/// A message from a stock SGLang decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FromDecode {
    /// Its buffers.
    Register(Box<Registration>),
    /// A room's destination.
    Room(Room),
    /// It gave up on a room.
    Abort(Abort),
}

/// A message from a stock SGLang prefill rank to a decode rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FromPrefill {
    /// A room's status (`KV_STATUS`): Success once its WRITEs completed, or Failed.
    Status {
        /// The room.
        room: u64,
        /// SGLang's `KVPoll` value.
        status: u8,
        /// The prefill rank (SGLang's unique rank).
        rank: u32,
        /// Why it failed (may be empty).
        reason: String,
    },
    /// No WRITE of the rank can land in the room's pages any more (`ABORT_ACK`).
    AbortAck {
        /// The room.
        room: u64,
        /// The prefill rank.
        rank: u32,
        /// The decode's generation it answers (`None`: an older prefill).
        generation: Option<u64>,
    },
}

/// Decodes one multipart message a prefill rank sent a decode rank.
pub fn decode_from_prefill(frames: &[&[u8]]) -> Result<FromPrefill, String> {
    check_frames(frames)?;
    match frames.first() {
        Some(&f) if f == KV_STATUS => {
            let reason = frames.get(4).copied().unwrap_or_default();
            if reason.len() > MAX_TEXT.saturating_mul(64) {
                return Err(format!("a reason of {} bytes", reason.len()));
            }
            Ok(FromPrefill::Status {
                room: number(frames, 1, "room")?,
                status: number(frames, 2, "status")?,
                rank: number(frames, 3, "prefill rank")?,
                reason: String::from_utf8_lossy(reason).into_owned(),
            })
        }
        Some(&f) if f == ABORT_ACK => Ok(FromPrefill::AbortAck {
            room: number(frames, 1, "room")?,
            rank: number(frames, 2, "prefill rank")?,
            generation: match frames.get(3) {
                Some(_) => Some(number(frames, 3, "generation")?),
                None => None,
            },
        }),
        Some(f) => Err(format!(
            "not an SGLang prefill's status (first frame {:?})",
            String::from_utf8_lossy(&f[..f.len().min(16)])
        )),
        None => Err("no frames".into()),
    }
}

/// The frames of a decode's `ABORT` of `room`, acknowledged to `reply` for `generation`.
pub fn abort(room: u64, reply: &(String, u16), generation: u64) -> Vec<Vec<u8>> {
    vec![
        ABORT.to_vec(),
        room.to_string().into_bytes(),
        reply.0.clone().into_bytes(),
        reply.1.to_string().into_bytes(),
        generation.to_string().into_bytes(),
    ]
}

/// Decodes one multipart message.
pub fn decode(frames: &[&[u8]]) -> Result<FromDecode, String> {
    check_frames(frames)?;
    match frames.first() {
        Some(&f) if f == ABORT => decode_abort(frames).map(FromDecode::Abort),
        Some(&f) if f == GUARD => match frames.get(1) {
            Some(&b"None") => {
                decode_registration(frames).map(|r| FromDecode::Register(Box::new(r)))
            }
            Some(_) => decode_room(frames).map(FromDecode::Room),
            None => Err("a guard frame alone".into()),
        },
        Some(f) => Err(format!(
            "not an SGLang nixl message (first frame {:?})",
            String::from_utf8_lossy(&f[..f.len().min(16)])
        )),
        None => Err("no frames".into()),
    }
}

/// The frames of a `KV_STATUS` message from prefill rank `rank` (SGLang's unique rank).
pub fn kv_status(room: u64, status: u8, rank: u32, reason: &str) -> Vec<Vec<u8>> {
    vec![
        KV_STATUS.to_vec(),
        room.to_string().into_bytes(),
        status.to_string().into_bytes(),
        rank.to_string().into_bytes(),
        reason.as_bytes().to_vec(),
    ]
}

/// The frames of an `ABORT_ACK` from prefill rank `rank` for the decode's `generation`.
pub fn abort_ack(room: u64, rank: u32, generation: u64) -> Vec<Vec<u8>> {
    vec![
        ABORT_ACK.to_vec(),
        room.to_string().into_bytes(),
        rank.to_string().into_bytes(),
        generation.to_string().into_bytes(),
    ]
}

/// A registration's frames, as SGLang's decode builds them.
pub fn encode_registration(r: &Registration) -> Vec<Vec<u8>> {
    let text = |v: &dyn ToString| v.to_string().into_bytes();
    let (staging_base, staging_len) = match r.staging {
        Some((b, n)) => (b.to_le_bytes().to_vec(), text(&n)),
        None => (Vec::new(), Vec::new()),
    };
    vec![
        GUARD.to_vec(),
        b"None".to_vec(),
        r.endpoint.0.clone().into_bytes(),
        text(&r.endpoint.1),
        r.agent.clone().into_bytes(),
        r.metadata.clone(),
        pack_u64(&r.kv_ptrs),
        pack_u64(&r.aux_ptrs),
        pack_lists(&r.state_ptrs, |v: &u64| v.to_le_bytes().to_vec()),
        text(&r.gpu_id),
        text(&r.tp.0),
        text(&r.tp.1),
        text(&r.kv_item_lens.first().copied().unwrap_or(0)),
        pack_lists(&r.state_item_lens, |v: &u32| v.to_le_bytes().to_vec()),
        pack_lists(&r.state_dims, |v: &u32| v.to_le_bytes().to_vec()),
        staging_base,
        staging_len,
        text(&r.num_slots),
        r.kv_mem_kinds.join(",").into_bytes(),
        pack_u64(&r.kv_item_lens),
        pack_lists(&r.state_layer_ids, |v: &u32| v.to_le_bytes().to_vec()),
        r.kv_layer_ids
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        text(&r.dcp.0),
        text(&r.dcp.1),
        pack_lists(&r.state_data_lens, |v: &u64| v.to_le_bytes().to_vec()),
    ]
}

/// A room's frames, as SGLang's decode builds them.
pub fn encode_room(r: &Room) -> Vec<Vec<u8>> {
    let text = |v: &dyn ToString| v.to_string().into_bytes();
    // SGLang sends no state for a dummy destination: leave `state` empty there.
    let state = pack_lists(&r.state, |v: &i32| v.to_le_bytes().to_vec());
    vec![
        GUARD.to_vec(),
        text(&r.room),
        r.endpoint.0.clone().into_bytes(),
        text(&r.endpoint.1),
        r.agent.clone().into_bytes(),
        r.pages.iter().flat_map(|p| p.to_le_bytes()).collect(),
        r.aux_index.map_or_else(|| b"None".to_vec(), |i| text(&i)),
        text(&r.required),
        state,
        text(&r.prefix_tokens),
        text(&u8::from(r.dummy)),
    ]
}

/// At most MAX_FRAMES frames of at most MAX_FRAME_BYTES each.
fn check_frames(frames: &[&[u8]]) -> Result<(), String> {
    if frames.len() > MAX_FRAMES {
        return Err(format!("{} frames", frames.len()));
    }
    match frames.iter().find(|f| f.len() > MAX_FRAME_BYTES) {
        Some(f) => Err(format!("a frame of {} bytes", f.len())),
        None => Ok(()),
    }
}

fn decode_abort(f: &[&[u8]]) -> Result<Abort, String> {
    let room = number(f, 1, "room")?;
    let ack = if f.len() >= 5 {
        Some((address(f, 2)?, number(f, 4, "generation")?))
    } else {
        None
    };
    Ok(Abort { room, ack })
}

fn decode_registration(f: &[&[u8]]) -> Result<Registration, String> {
    if f.len() != REGISTRATION_FRAMES {
        return Err(format!(
            "a registration of {} frames: SGLang 0.5.23's nixl backend sends {REGISTRATION_FRAMES}",
            f.len()
        ));
    }
    let kv_ptrs = unpack::<8>(f[6], "KV bases")?;
    let kv_item_lens = unpack::<8>(f[19], "KV item lengths")?;
    if kv_item_lens.len() != kv_ptrs.len() {
        return Err(format!(
            "{} KV item lengths for {} KV buffers",
            kv_item_lens.len(),
            kv_ptrs.len()
        ));
    }
    let first: u64 = number(f, 12, "KV item length")?;
    if kv_item_lens.first().is_some_and(|&l| l != first) {
        return Err(format!(
            "KV item length {first} but the first buffer's is {}",
            kv_item_lens[0]
        ));
    }
    let kv_mem_kinds: Vec<String> = if f[18].is_empty() {
        Vec::new()
    } else {
        text(f, 18, "memory kinds")?
            .split(',')
            .map(str::to_string)
            .collect()
    };
    if kv_mem_kinds.len() != kv_ptrs.len() {
        return Err(format!(
            "{} memory kinds for {} KV buffers",
            kv_mem_kinds.len(),
            kv_ptrs.len()
        ));
    }
    let staging = match (f[15].is_empty(), f[16].is_empty()) {
        (true, true) => None,
        (false, false) => Some((
            unpack::<8>(f[15], "staging base")?
                .first()
                .copied()
                .ok_or("staging base")?,
            number(f, 16, "staging size")?,
        )),
        _ => return Err("a staging base without a size, or the reverse".into()),
    };
    let metadata = f[5].to_vec();
    if metadata.is_empty() {
        return Err("empty NIXL metadata".into());
    }
    Ok(Registration {
        endpoint: address(f, 2)?,
        agent: name(f, 4)?,
        metadata,
        kv_ptrs,
        aux_ptrs: unpack::<8>(f[7], "aux bases")?,
        state_ptrs: unpack_lists::<8>(f[8], "state bases")?,
        gpu_id: number(f, 9, "GPU id")?,
        tp: (number(f, 10, "TP size")?, number(f, 11, "TP rank")?),
        kv_item_lens,
        state_item_lens: narrow(unpack_lists::<4>(f[13], "state item lengths")?),
        state_dims: narrow(unpack_lists::<4>(f[14], "state dimensions")?),
        staging,
        num_slots: number(f, 17, "KV slots")?,
        kv_mem_kinds,
        state_layer_ids: narrow(unpack_lists::<4>(f[20], "state layer ids")?),
        kv_layer_ids: unpack::<4>(f[21], "KV layer ids")?
            .into_iter()
            .map(|v| v as u32)
            .collect(),
        dcp: (number(f, 22, "DCP size")?, number(f, 23, "DCP rank")?),
        state_data_lens: unpack_lists::<8>(f[24], "state lengths")?,
    })
}

fn decode_room(f: &[&[u8]]) -> Result<Room, String> {
    if f.len() != ROOM_FRAMES {
        return Err(format!(
            "a room of {} frames: SGLang 0.5.23's nixl backend sends {ROOM_FRAMES}",
            f.len()
        ));
    }
    // At most MAX_PAGES (`unpack`'s bound).
    let signed = unpack::<4>(f[5], "pages")?;
    let pages = signed
        .into_iter()
        .map(|v| {
            // int32 on the wire: a negative page is refused, not wrapped.
            u32::try_from(v)
                .ok()
                .filter(|&p| i32::try_from(p).is_ok())
                .ok_or_else(|| format!("page {}", v as u32 as i32))
        })
        .collect::<Result<Vec<u32>, String>>()?;
    let aux_index = match f[6] {
        b"None" => None,
        _ => Some(number(f, 6, "aux index")?),
    };
    let state = unpack_lists::<4>(f[8], "state indices")?
        .into_iter()
        .map(|l| l.into_iter().map(|v| v as u32 as i32).collect())
        .collect();
    let dummy = match f[10] {
        b"0" => false,
        b"1" => true,
        other => {
            return Err(format!(
                "dummy flag {:?}",
                String::from_utf8_lossy(&other[..other.len().min(8)])
            ));
        }
    };
    Ok(Room {
        room: number(f, 1, "room")?,
        endpoint: address(f, 2)?,
        agent: name(f, 4)?,
        pages,
        aux_index,
        required: number(f, 7, "destination count")?,
        state,
        prefix_tokens: number(f, 9, "decode prefix")?,
        dummy,
    })
}

fn text<'a>(f: &[&'a [u8]], i: usize, what: &str) -> Result<&'a str, String> {
    // Bounded by MAX_FRAME_BYTES (`check_frames`).
    let b = f.get(i).ok_or_else(|| format!("no {what} frame"))?;
    std::str::from_utf8(b)
        .ok()
        .filter(|s| s.is_ascii())
        .ok_or_else(|| format!("{what} is not ASCII"))
}

fn number<N: std::str::FromStr>(f: &[&[u8]], i: usize, what: &str) -> Result<N, String> {
    let s = text(f, i, what)?;
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|c| c.is_ascii_digit()) {
        return Err(format!("{what} {:?} is not a decimal number", clip(s)));
    }
    s.parse().map_err(|_| format!("{what} {s} is out of range"))
}

fn name(f: &[&[u8]], i: usize) -> Result<String, String> {
    let s = text(f, i, "agent name")?;
    if s.is_empty() || s.len() > MAX_TEXT {
        return Err(format!("agent name of {} bytes", s.len()));
    }
    Ok(s.to_string())
}

fn address(f: &[&[u8]], i: usize) -> Result<(String, u16), String> {
    let host = text(f, i, "host")?;
    if host.is_empty() || host.len() > MAX_TEXT {
        return Err(format!("host of {} bytes", host.len()));
    }
    let port: u16 = number(f, i.saturating_add(1), "port")?;
    Ok((host.to_string(), port))
}

fn clip(s: &str) -> &str {
    &s[..s.len().min(24)]
}

/// Packed little-endian integers of `W` bytes (4 or 8).
fn unpack<const W: usize>(b: &[u8], what: &str) -> Result<Vec<u64>, String> {
    let entries = b.len().checked_div(W).unwrap_or(0);
    if b.len().checked_rem(W) != Some(0) {
        return Err(format!(
            "{what}: {} bytes are not {W}-byte integers",
            b.len()
        ));
    }
    if entries > MAX_PAGES {
        return Err(format!("{what}: {entries} entries"));
    }
    Ok(b.chunks_exact(W)
        .map(|c| {
            let mut v = [0u8; 8];
            v[..W].copy_from_slice(c);
            u64::from_le_bytes(v)
        })
        .collect())
}

/// SGLang's `unpack_int_lists`: a count, a byte length per list, the lists.
fn unpack_lists<const W: usize>(b: &[u8], what: &str) -> Result<Vec<Vec<u64>>, String> {
    if b.is_empty() {
        return Ok(Vec::new());
    }
    let word = |at: usize| -> Result<usize, String> {
        let end = at.checked_add(4).filter(|&e| e <= b.len());
        let s = end.map(|e| &b[at..e]).ok_or(format!("{what}: truncated"))?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize)
    };
    let n = word(0)?;
    if n > MAX_ENTRIES {
        return Err(format!("{what}: {n} lists"));
    }
    let mut lens = Vec::with_capacity(n.min(b.len() / 4));
    for k in 0..n {
        lens.push(word(k.saturating_add(1).saturating_mul(4))?);
    }
    let mut at = n.saturating_add(1).saturating_mul(4);
    let mut out = Vec::with_capacity(lens.len());
    for len in lens {
        let end = at
            .checked_add(len)
            .filter(|&e| e <= b.len())
            .ok_or(format!("{what}: truncated"))?;
        out.push(unpack::<W>(&b[at..end], what)?);
        at = end;
    }
    if at != b.len() {
        return Err(format!(
            "{what}: {} bytes left over",
            b.len().saturating_sub(at)
        ));
    }
    Ok(out)
}

fn narrow(lists: Vec<Vec<u64>>) -> Vec<Vec<u32>> {
    // Read as 4-byte integers: every value fits.
    lists
        .into_iter()
        .map(|l| l.into_iter().map(|v| v as u32).collect())
        .collect()
}

fn pack_u64(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn pack_lists<T>(lists: &[Vec<T>], bytes: impl Fn(&T) -> Vec<u8>) -> Vec<u8> {
    if lists.is_empty() {
        return Vec::new();
    }
    let bodies: Vec<Vec<u8>> = lists
        .iter()
        .map(|l| l.iter().flat_map(&bytes).collect())
        .collect();
    let mut out = (lists.len() as u32).to_le_bytes().to_vec();
    for b in &bodies {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    }
    for b in bodies {
        out.extend(b);
    }
    out
}

#[cfg(test)]
mod tests;
