//! Push-mode messages: decode → prefill control messages and registry requests (msgpack
//! maps with a `kind` tag), and the prefill → decode notification strings.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use serde::{Deserialize, Serialize};

use super::handshake::LayoutWire;
use super::{WireError, check_size};

/// Largest control message accepted (agent metadata of large registrations included).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;
/// Most pages one room may name.
pub const MAX_ROOM_PAGES: usize = 1 << 22;

/// An aux or state buffer: `items` items of `item_len` bytes from `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferWire {
    /// Base address.
    pub base: u64,
    /// Bytes per item.
    pub item_len: u64,
    /// Number of items.
    pub items: u32,
}

impl BufferWire {
    /// The address one past the last item, or `None` where a peer's numbers overflow.
    pub fn end(&self) -> Option<u64> {
        self.item_len
            .checked_mul(u64::from(self.items))
            .and_then(|len| self.base.checked_add(len))
    }

    /// Where item `i` starts, or `None` past the last item.
    pub fn item(&self, i: u32) -> Option<u64> {
        if i >= self.items {
            return None;
        }
        self.item_len
            .checked_mul(u64::from(i))
            .and_then(|off| self.base.checked_add(off))
    }
}

/// What a decode rank registers once with each prefill rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterArgs {
    /// Decode agent name.
    pub agent: String,
    /// Decode transport metadata.
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// Decode KV layout (all layers).
    pub layout: LayoutWire,
    /// Decode KV region bases.
    pub kv_bases: Vec<u64>,
    /// Decode aux buffers.
    pub aux: Vec<BufferWire>,
    /// Decode state buffers.
    pub state: Vec<BufferWire>,
    /// Decode TP size.
    pub tp_size: u32,
    /// Decode TP rank.
    pub tp_rank: u32,
    /// The decode registers again when a prefill answers a room with
    /// [`FromPrefill::Unregistered`], so the prefill may forget it while idle. Left out when
    /// false: older decodes do not send it and are forgotten only once their connection
    /// failed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reregisters: bool,
}

/// A room's destinations, sent by a decode rank to every prefill rank it needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomRequest {
    /// Room id.
    pub room: u64,
    /// Decode agent name (registered before).
    pub agent: String,
    /// Destination pages; empty for a dummy destination (no data, status only).
    pub pages: Vec<u32>,
    /// Destination aux index.
    pub aux_index: Option<u32>,
    /// Destination state indices.
    pub state_indices: Vec<u32>,
    /// The decode checks content digests: the writer's last KV note carries the fold of
    /// what it wrote (see [`crate::push::digests`]). Left out when false, so a decode that
    /// does not ask sends what older prefills read; an older prefill ignores it (and the
    /// decode then fails the room for the missing fold).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub digest: bool,
    /// Tokens of the prompt the decode holds already (its radix cache): `pages` are for the
    /// tokens after them, and the prefill engine sends only those (SGLang's
    /// `decode_prefix_len`). Left out when 0; an older prefill ignores it, and the page
    /// counts then differ (the room fails naming both).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prefix_tokens: u64,
    /// For a cache in KV cache groups (a hybrid model): how many of `pages` belong to each
    /// group, in group order (`pages` lists group 0's, then group 1's, ...); each group's
    /// pages are moved through that group's layers only. Left out (empty) for one group, so
    /// single-group rooms are what older peers send; an older prefill ignores it, and a
    /// hybrid decode registers groups such a prefill refuses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub group_pages: Vec<u32>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Decode → prefill rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum ToPrefill {
    /// Register buffers (once per prefill instance).
    Register(RegisterArgs),
    /// A room's destinations.
    Room(RoomRequest),
    /// The decode gave up on a room.
    Abort {
        /// Room id.
        room: u64,
        /// Decode agent.
        agent: String,
    },
    /// Liveness probe.
    Health,
}

/// One prefill rank as registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankInfo {
    /// Transport agent name (the `from` of its notifications).
    pub agent: String,
    /// TP size.
    pub tp_size: u32,
    /// TP rank.
    pub tp_rank: u32,
    /// PP size.
    pub pp_size: u32,
    /// PP rank.
    pub pp_rank: u32,
    /// DP size.
    pub dp_size: u32,
    /// DP rank.
    pub dp_rank: u32,
    /// Mailbox host.
    pub host: String,
    /// Mailbox port.
    pub port: u16,
    /// Tokens per page.
    pub page_size: u32,
    /// KV dtype name.
    pub dtype: String,
    /// First global layer of the rank's stage.
    pub first_layer: u32,
    /// Layers of the stage.
    pub num_layers: u32,
}

/// Longest agent name a rank may register.
pub const MAX_AGENT_NAME: usize = 256;

impl RankInfo {
    /// Refuses a rank outside its own declared sizes (sizes of 0 included), without an
    /// agent name, or whose stage's layer range overflows.
    pub fn check(&self) -> Result<(), String> {
        // A size of 0 holds no rank.
        let within = |rank: u32, size: u32| rank < size;
        if !(within(self.tp_rank, self.tp_size)
            && within(self.pp_rank, self.pp_size)
            && within(self.dp_rank, self.dp_size))
        {
            return Err(format!(
                "rank outside its declared sizes: tp {}/{}, pp {}/{}, dp {}/{}",
                self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, self.dp_rank, self.dp_size
            ));
        }
        if self.agent.is_empty() || self.agent.len() > MAX_AGENT_NAME {
            return Err(format!("agent name of {} bytes", self.agent.len()));
        }
        if self.page_size == 0 || self.first_layer.checked_add(self.num_layers).is_none() {
            return Err(format!(
                "page size {} or layers {}+{} out of range",
                self.page_size, self.first_layer, self.num_layers
            ));
        }
        Ok(())
    }

    fn shape(&self) -> (u32, u32, u32, u32, &str) {
        (
            self.tp_size,
            self.pp_size,
            self.dp_size,
            self.page_size,
            &self.dtype,
        )
    }
}

/// Checks a registry's complete layout as a decode receives it: every rank valid, all
/// agreeing on sizes, page size and dtype, each (dp, pp, tp) once, and exactly
/// `tp × pp × dp` of them.
pub fn check_layout(ranks: &[RankInfo]) -> Result<(), String> {
    let first = ranks.first().ok_or("the prefill registered no ranks")?;
    let mut seen = std::collections::HashSet::new();
    for r in ranks {
        r.check()?;
        if r.shape() != first.shape() {
            return Err("ranks disagree on sizes, page size or dtype".into());
        }
        if !seen.insert((r.dp_rank, r.pp_rank, r.tp_rank)) {
            return Err(format!(
                "rank dp {} pp {} tp {} listed twice",
                r.dp_rank, r.pp_rank, r.tp_rank
            ));
        }
    }
    let expected = u64::from(first.tp_size)
        .checked_mul(u64::from(first.pp_size))
        .and_then(|n| n.checked_mul(u64::from(first.dp_size)))
        .ok_or("tp x pp x dp overflows")?;
    if ranks.len() as u64 != expected {
        return Err(format!(
            "{} ranks listed, {expected} expected from their sizes",
            ranks.len()
        ));
    }
    Ok(())
}

/// Requests to the bootstrap registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum ToRegistry {
    /// A prefill rank registers.
    Register(RankInfo),
    /// A decode asks for the prefill's layout.
    Query,
    /// Liveness probe.
    Health,
}

/// Registry replies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum FromRegistry {
    /// Accepted.
    Ok,
    /// Not every rank registered yet.
    NotReady {
        /// Ranks registered.
        registered: u32,
        /// Ranks expected.
        expected: u32,
    },
    /// The complete prefill layout.
    Layout {
        /// Identity of this prefill instance (changes when it restarts).
        instance: u64,
        /// Every rank.
        ranks: Vec<RankInfo>,
    },
    /// Refused.
    Error {
        /// Why.
        reason: String,
    },
}

/// Replies of a prefill rank's mailbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum FromPrefill {
    /// Accepted.
    Ok,
    /// A room from a decode this rank does not know (never registered, or forgotten):
    /// register again, then send the room again.
    Unregistered,
    /// Refused.
    Error {
        /// Why.
        reason: String,
    },
}

/// Encodes a message as a msgpack map.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(msg).unwrap_or_default()
}

/// Decodes an untrusted message: size-limited, typed errors.
pub fn decode<T: for<'de> Deserialize<'de>>(
    bytes: &[u8],
    what: &'static str,
) -> Result<T, WireError> {
    check_size(bytes, MAX_MESSAGE_BYTES)?;
    rmp_serde::from_slice(bytes).map_err(|e| WireError::Malformed {
        what,
        reason: e.to_string(),
    })
}

/// Prefill → decode notification of a KV chunk.
pub fn kv_note(room: u64, chunk: u32, is_last: bool, pp_rank: u32) -> Vec<u8> {
    format!("{room}_kv_{chunk}_{}_{pp_rank}", u8::from(is_last)).into_bytes()
}

/// Prefill → decode notification of a room's last KV chunk, with the fold of the content
/// digests of everything this writer wrote into that decode rank (16 hex digits): sent only
/// to a decode that asked for digests.
pub fn last_kv_note_with_digest(room: u64, chunk: u32, pp_rank: u32, digest: u64) -> Vec<u8> {
    format!("{room}_kv_{chunk}_1_{pp_rank}_{digest:016x}").into_bytes()
}

/// Prefill → decode notification of aux data.
pub fn aux_note(room: u64) -> Vec<u8> {
    format!("{room}_aux").into_bytes()
}

/// Prefill → decode notification of state data.
pub fn state_note(room: u64, pp_rank: u32) -> Vec<u8> {
    format!("{room}_state_{pp_rank}").into_bytes()
}

/// Prefill → decode: the prefill aborted the room.
pub fn abort_note(room: u64) -> Vec<u8> {
    format!("{room}_abort").into_bytes()
}

/// A parsed prefill → decode notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushNote {
    /// A KV chunk arrived.
    Kv {
        /// Room.
        room: u64,
        /// Chunk id.
        chunk: u32,
        /// Last chunk of this writer.
        is_last: bool,
        /// Writer's PP rank.
        pp_rank: u32,
        /// The fold of the writer's content digests (its last chunk, for a decode that
        /// asked for them).
        digest: Option<u64>,
    },
    /// Aux data arrived.
    Aux {
        /// Room.
        room: u64,
    },
    /// State data of a PP stage arrived.
    State {
        /// Room.
        room: u64,
        /// Writer's PP rank.
        pp_rank: u32,
    },
    /// The prefill aborted.
    Abort {
        /// Room.
        room: u64,
    },
}

/// Parses a notification; anything else is `None`.
pub fn parse_note(message: &[u8]) -> Option<PushNote> {
    let text = std::str::from_utf8(message).ok()?;
    let mut parts = text.split('_');
    let room: u64 = parts.next()?.parse().ok()?;
    let note = match (parts.next()?, parts.next(), parts.next(), parts.next()) {
        ("kv", Some(c), Some(l), Some(p)) => {
            let is_last = match l {
                "0" => false,
                "1" => true,
                _ => return None,
            };
            // A fold is 16 hex digits (no sign), on a last chunk only.
            let hex = |d: &str| d.len() == 16 && d.bytes().all(|b| b.is_ascii_hexdigit());
            let digest = match parts.next() {
                None => None,
                Some(d) if is_last && hex(d) => Some(u64::from_str_radix(d, 16).ok()?),
                Some(_) => return None,
            };
            PushNote::Kv {
                room,
                chunk: c.parse().ok()?,
                is_last,
                pp_rank: p.parse().ok()?,
                digest,
            }
        }
        ("aux", None, None, None) => PushNote::Aux { room },
        ("state", Some(p), None, None) => PushNote::State {
            room,
            pp_rank: p.parse().ok()?,
        },
        ("abort", None, None, None) => PushNote::Abort { room },
        _ => return None,
    };
    parts.next().is_none().then_some(note)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(tp_rank: u32, pp_rank: u32) -> RankInfo {
        RankInfo {
            agent: format!("p{pp_rank}-{tp_rank}"),
            tp_size: 2,
            tp_rank,
            pp_size: 2,
            pp_rank,
            dp_size: 1,
            dp_rank: 0,
            host: "127.0.0.1".into(),
            port: 1,
            page_size: 16,
            dtype: "bf16".into(),
            first_layer: 0,
            num_layers: 4,
        }
    }

    #[test]
    fn layouts_are_checked_before_use() {
        let good: Vec<RankInfo> = (0..2)
            .flat_map(|pp| (0..2).map(move |tp| rank(tp, pp)))
            .collect();
        assert_eq!(check_layout(&good), Ok(()));
        let broken = |f: &dyn Fn(&mut Vec<RankInfo>)| {
            let mut l = good.clone();
            f(&mut l);
            check_layout(&l).expect_err("accepted")
        };
        assert!(broken(&|l| l.clear()).contains("no ranks"));
        assert!(broken(&|l| l[1].pp_size = 0).contains("declared sizes"));
        assert!(broken(&|l| l[1].tp_rank = 2).contains("declared sizes"));
        assert!(broken(&|l| l[1].agent.clear()).contains("agent name"));
        let long = |n: usize| {
            let mut l = good.clone();
            l[1].agent = "a".repeat(n);
            check_layout(&l)
        };
        assert_eq!(long(MAX_AGENT_NAME), Ok(()));
        assert!(long(MAX_AGENT_NAME + 1).is_err());
        assert!(broken(&|l| l[1].page_size = 0).contains("page size"));
        assert!(broken(&|l| l[1].first_layer = u32::MAX).contains("layers"));
        assert!(broken(&|l| l[1].dtype = "f32".into()).contains("disagree"));
        assert!(broken(&|l| l[1] = l[0].clone()).contains("twice"));
        assert!(
            broken(&|l| {
                l.pop();
            })
            .contains("expected")
        );
    }

    #[test]
    fn buffer_items_never_wrap() {
        let b = BufferWire {
            base: u64::MAX - 100,
            item_len: 10,
            items: 20,
        };
        assert_eq!(b.end(), None);
        assert_eq!(b.item(0), Some(u64::MAX - 100));
        assert_eq!(b.item(11), None, "past the address space");
        assert_eq!(b.item(20), None, "past the last item");
        let ok = BufferWire {
            base: 0x1000,
            item_len: 8,
            items: 4,
        };
        assert_eq!(
            (ok.end(), ok.item(3), ok.item(4)),
            (Some(0x1020), Some(0x1018), None)
        );
    }

    #[test]
    fn notes_round_trip_and_junk_is_none() {
        assert_eq!(
            parse_note(&kv_note(7, 2, true, 1)),
            Some(PushNote::Kv {
                room: 7,
                chunk: 2,
                is_last: true,
                pp_rank: 1,
                digest: None,
            })
        );
        assert_eq!(
            parse_note(&last_kv_note_with_digest(7, 2, 1, 0xfedc_ba98_7654_3210)),
            Some(PushNote::Kv {
                room: 7,
                chunk: 2,
                is_last: true,
                pp_rank: 1,
                digest: Some(0xfedc_ba98_7654_3210),
            })
        );
        assert_eq!(
            parse_note(&last_kv_note_with_digest(7, 2, 1, 5)),
            Some(PushNote::Kv {
                room: 7,
                chunk: 2,
                is_last: true,
                pp_rank: 1,
                digest: Some(5),
            }),
            "leading zeros kept"
        );
        assert_eq!(
            parse_note(&kv_note(7, 0, false, 0)),
            Some(PushNote::Kv {
                room: 7,
                chunk: 0,
                is_last: false,
                pp_rank: 0,
                digest: None,
            })
        );
        assert_eq!(parse_note(&aux_note(7)), Some(PushNote::Aux { room: 7 }));
        assert_eq!(
            parse_note(&state_note(7, 3)),
            Some(PushNote::State {
                room: 7,
                pp_rank: 3
            })
        );
        assert_eq!(
            parse_note(&abort_note(9)),
            Some(PushNote::Abort { room: 9 })
        );
        for junk in [
            &b""[..],
            b"7",
            b"7_kv",
            b"7_kv_1_2_0",
            b"x_aux",
            b"7_aux_1",
            b"7_kv_1_1_0_9",
            b"7_kv_1_0_0_00000000000000ff",
            b"7_kv_1_1_0_0000000000000x00",
            b"7_kv_1_1_0_+00000000000000f",
            b"7_kv_1_1_0_00000000000000ff_1",
            b"\xff",
        ] {
            assert_eq!(parse_note(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn messages_round_trip_and_garbage_is_an_error() {
        let m = ToPrefill::Room(RoomRequest {
            room: 5,
            agent: "d0".into(),
            pages: vec![1, 2],
            aux_index: Some(0),
            state_indices: vec![],
            digest: false,
            prefix_tokens: 0,
            group_pages: Vec::new(),
        });
        assert_eq!(decode::<ToPrefill>(&encode(&m), "msg").unwrap(), m);
        // Without digests or groups, the bytes an older prefill reads; with them, extra
        // fields.
        let plain = String::from_utf8_lossy(&encode(&m)).into_owned();
        assert!(!plain.contains("digest") && !plain.contains("group_pages"));
        let ToPrefill::Room(mut grouped) = m.clone() else {
            unreachable!()
        };
        grouped.group_pages = vec![1, 1];
        let grouped = ToPrefill::Room(grouped);
        assert_eq!(
            decode::<ToPrefill>(&encode(&grouped), "msg").unwrap(),
            grouped
        );
        let ToPrefill::Room(mut asking) = m.clone() else {
            unreachable!()
        };
        asking.digest = true;
        let asking = ToPrefill::Room(asking);
        assert_eq!(
            decode::<ToPrefill>(&encode(&asking), "msg").unwrap(),
            asking
        );
        assert_eq!(
            decode::<ToPrefill>(&encode(&ToPrefill::Health), "msg").unwrap(),
            ToPrefill::Health
        );
        for bad in [
            &b""[..],
            b"\x81\xa4kind\xa4Nope",
            b"\xc1",
            &[0xdd, 0xff, 0xff, 0xff, 0xff],
        ] {
            assert!(decode::<ToPrefill>(bad, "msg").is_err());
        }
        let r = FromRegistry::NotReady {
            registered: 1,
            expected: 2,
        };
        assert_eq!(decode::<FromRegistry>(&encode(&r), "reply").unwrap(), r);
    }
}
