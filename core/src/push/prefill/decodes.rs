//! A push prefill's decodes: checking and keeping their registrations, and checking every
//! index a room's destinations name against what that decode registered.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_layout::{CacheSide, CacheSpec, SideLayout, TpMapping, check_compatible};

use super::{Decode, PushPrefill, StockPeer, lock};
use crate::transport::AddrRange;

/// A stock SGLang decode's PULL socket and the regions its registration names.
pub(super) type StockRegions = ((String, u16), Vec<(MemoryKind, AddrRange)>);
use crate::push::buffers::{PushBuffers, StateKind};
use crate::push::messages::{self, BufferWire, RegisterArgs, RoomRequest};
use crate::tally::Tally;
use crate::transport::{MemoryKind, Transport};

/// Checks a decode's registration against this rank's buffers (`bufs`, of a prefill of
/// `tp_size` ranks) without touching either: the cache it names must pair with ours, its
/// regions and buffers be addressable. Returns its cache and the TP mapping to it. Pure, so
/// that the mailbox refuses a registration in its reply, before the decode sends a room.
pub(super) fn check_registration(
    bufs: &PushBuffers,
    tp_size: u32,
    args: &RegisterArgs,
) -> Result<(CacheSpec, TpMapping), String> {
    let spec = args.layout.to_spec().map_err(|e| e.to_string())?;
    let mine = &bufs.kv.spec;
    if spec.tokens_per_block() != mine.tokens_per_block() || spec.dtype() != mine.dtype() {
        return Err(format!(
            "page size or dtype differ: decode {} tokens {}, prefill {} tokens {}",
            spec.tokens_per_block(),
            spec.dtype(),
            mine.tokens_per_block(),
            mine.dtype()
        ));
    }
    // A hybrid model's groups: the same partition of layers on both sides (each group's
    // pages move through its own layers), whose regions may overlay across groups only.
    let groups = args
        .layout
        .to_groups(spec.num_layers())
        .map_err(|e| e.to_string())?;
    if groups != bufs.kv.groups {
        let name = |g: &Option<kvxfer_layout::LayerGroups>| {
            g.as_ref()
                .map_or_else(|| "one".to_string(), |g| format!("{:?}", g.as_slice()))
        };
        return Err(format!(
            "KV cache groups differ: decode {}, prefill {}",
            name(&groups),
            name(&bufs.kv.groups)
        ));
    }
    if groups.as_ref().is_some_and(|g| g.has_state()) && args.tp_size != tp_size {
        return Err(format!(
            "state KV cache groups (Mamba) move between equal TP sizes only: decode {}, prefill {tp_size}",
            args.tp_size
        ));
    }
    match &groups {
        Some(g) => g.check_regions(&spec, &args.kv_bases),
        None => CacheSide::new(&spec, &args.kv_bases, 0).map(|_| ()),
    }
    .map_err(|e| e.to_string())?;
    // The model's heads and layers as each side counts them: a decode that splits heads
    // otherwise would expect writers this rank's plan never names, and wait them out.
    let kv = &bufs.kv;
    let ours = SideLayout {
        spec: mine,
        tp_size,
        total_kv_heads: kv.total_kv_heads,
        total_layers: kv.total_layers,
    };
    let theirs = SideLayout {
        spec: &spec,
        tp_size: args.tp_size,
        total_kv_heads: args.layout.total_kv_heads,
        total_layers: args.layout.total_layers,
    };
    check_compatible(&ours, &theirs).map_err(|m| {
            let all: Vec<String> = m.iter().map(ToString::to_string).collect();
            format!(
                "the decode's cache does not pair with this prefill rank's (local: prefill, remote: decode): {}",
                all.join("; ")
            )
        })?;
    if !same_items(&args.aux, &bufs.aux) {
        return Err("aux buffers differ in count or item length".into());
    }
    if !same_items(&args.state, &bufs.state) {
        return Err("state buffers differ in count or item length".into());
    }
    // Item addresses are computed from these numbers for every WRITE: none may wrap.
    if let Some(b) = args
        .aux
        .iter()
        .chain(&args.state)
        .find(|b| b.end().is_none())
    {
        return Err(format!(
            "buffer of {} items of {} bytes at {:#x} overflows the address space",
            b.items, b.item_len, b.base
        ));
    }
    let mapping =
        TpMapping::new(tp_size, args.tp_size, kv.sharding()).map_err(|e| e.to_string())?;
    Ok((spec, mapping))
}

/// Whether two lists of buffers hold as many buffers, each with items of the same length:
/// a WRITE copies one item of ours into one of theirs.
fn same_items(theirs: &[BufferWire], ours: &[BufferWire]) -> bool {
    theirs.len() == ours.len()
        && theirs
            .iter()
            .zip(ours)
            .all(|(a, b)| a.item_len == b.item_len)
}

impl<T: Transport> PushPrefill<T> {
    /// Registers a decode; `stock` holds a stock SGLang decode's PULL socket and the regions
    /// its registration names (its NIXL metadata is then the library's own).
    pub(super) fn register_decode(
        &mut self,
        args: RegisterArgs,
        stock: Option<StockRegions>,
    ) -> Result<(), String> {
        let (spec, mapping) = check_registration(&self.bufs, self.config.tp.1, &args)?;
        let now = self.clock.now();
        if let Some(d) = self.decodes.get_mut(&args.agent).filter(|d| d.args == args) {
            // The same decode registering again (once per bootstrap): keep the loaded peer,
            // whose connection transfers in flight are using.
            d.used = now;
            return Ok(());
        }
        let peer = match &stock {
            None => self.transport.load_peer(&args.agent_metadata),
            Some((_, regions)) => self
                .transport
                .load_native_peer(&args.agent_metadata, regions),
        }
        .map_err(|e| e.to_string())?;
        // A decode known under this name with other metadata (restarted) was replaced by
        // the transport's `load_peer`, its connection with it.
        self.decodes.insert(
            args.agent.clone(),
            Decode {
                peer,
                args,
                spec,
                mapping,
                used: now,
                stock: stock.map(|(endpoint, _)| StockPeer { endpoint }),
            },
        );
        Ok(())
    }

    /// Forgets the decodes no room needs whose connection failed, or that re-register on
    /// demand and were idle past `idle_decode_timeout`. Runs at the end of `poll`, after
    /// failed rooms told their decodes.
    pub(super) fn forget_unneeded(&mut self, now: std::time::Duration) {
        let idle = self.config.idle_decode_timeout;
        let needed = |agent: &str| self.rooms.values().any(|r| r.needs(agent));
        let candidates: Vec<(String, &'static str)> = self
            .decodes
            .iter()
            .filter_map(|(agent, d)| {
                if self.transport.peer_failed(d.peer) {
                    Some((agent.clone(), "its connection failed"))
                } else if d.args.reregisters && now.saturating_sub(d.used) >= idle {
                    Some((agent.clone(), "idle"))
                } else {
                    None
                }
            })
            .filter(|(agent, _)| !needed(agent))
            .collect();
        if candidates.is_empty() {
            return;
        }
        let mut known = lock(&self.known);
        // A message queued meanwhile may be a room of one of them: forget nobody until it
        // was handled (the next poll).
        if !self.inbox.is_empty() {
            return;
        }
        for (agent, why) in candidates {
            known.remove(&agent);
            if let Some(d) = self.decodes.remove(&agent) {
                let _ = self.transport.remove_peer(d.peer);
            }
            self.metrics.forgotten_decodes.tally(1);
            tracing::info!(decode = %agent, reason = why, "forgot a decode no room needs: its next room registers it again");
        }
    }

    /// Checks every index a decode sent against what that decode registered.
    pub(super) fn validate(&self, d: &Decode, req: &RoomRequest) -> Option<String> {
        if req.pages.len() > messages::MAX_ROOM_PAGES {
            return Some(format!("{} pages exceed the limit", req.pages.len()));
        }
        if let Some(&p) = req.pages.iter().find(|&&p| p >= d.spec.num_blocks()) {
            return Some(format!(
                "destination page {p} is out of range (decode has {} pages)",
                d.spec.num_blocks()
            ));
        }
        let mut sorted = req.pages.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Some("destination pages repeat".into());
        }
        if let Some(i) = req.aux_index {
            if d.args.aux.iter().any(|b| i >= b.items) {
                return Some(format!("aux index {i} is out of range"));
            }
        }
        if let Some(&i) = req
            .state_indices
            .iter()
            .find(|&&i| d.args.state.iter().any(|b| i >= b.items))
        {
            return Some(format!("state index {i} is out of range"));
        }
        if self.bufs.state_kind == StateKind::Mamba
            && !req.pages.is_empty()
            && req.state_indices.len() > 1
        {
            return Some("Mamba state takes exactly one index".into());
        }
        groups_refusal(req, self.bufs.kv.groups.as_ref())
            .or_else(|| digest_refusal(req, self.bufs.kv.memory))
    }
}

/// Why a room's pages do not split into this cache's KV cache groups: counts named for a
/// cache of one group, or not one count per group, or counts that do not add up to the
/// pages. A room without pages names none.
fn groups_refusal(
    req: &RoomRequest,
    groups: Option<&kvxfer_layout::LayerGroups>,
) -> Option<String> {
    let counts = &req.group_pages;
    match groups {
        None if !counts.is_empty() => Some(format!(
            "pages of {} KV cache groups for a cache of one group",
            counts.len()
        )),
        Some(g) if !req.pages.is_empty() => {
            let sum: u64 = counts.iter().map(|&n| u64::from(n)).sum();
            if counts.len() != g.len() {
                Some(format!(
                    "page counts of {} KV cache groups for a cache of {}",
                    counts.len(),
                    g.len()
                ))
            } else if sum != req.pages.len() as u64 {
                Some(format!(
                    "the KV cache groups' page counts add up to {sum}, the room names {} pages",
                    req.pages.len()
                ))
            } else if req.digest {
                Some(
                    "content digests of a cache in KV cache groups are not supported in push mode"
                        .into(),
                )
            } else {
                None
            }
        }
        _ => None,
    }
}

/// Why a room that asks for content digests cannot have them here: KV in GPU memory (no
/// device kernel yet). A room without pages has nothing to digest.
fn digest_refusal(req: &RoomRequest, memory: MemoryKind) -> Option<String> {
    (req.digest && !req.pages.is_empty() && memory != MemoryKind::Host).then(|| {
        format!(
            "decode {} checks content digests, which this prefill cannot compute: its KV cache is in GPU memory (no device kernel yet)",
            req.agent
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connector::KvCache;
    use crate::wire::handshake::LayoutWire;
    use kvxfer_layout::{BlockOrder, CacheKind, CacheParams, Dtype};

    /// A split-K/V cache of `kv_heads` heads per rank and 2 layers, pages of `tokens` tokens.
    fn spec(kv_heads: u32, tokens: u32, dtype: Dtype) -> CacheSpec {
        CacheSpec::new(CacheParams {
            kind: CacheKind::SplitKv,
            order: BlockOrder::Hnd,
            dtype,
            num_layers: 2,
            kv_heads,
            head_dim: 8,
            tokens_per_block: tokens,
            num_blocks: 4,
        })
        .expect("spec")
    }

    fn buf(base: u64, item_len: u64, items: u32) -> BufferWire {
        BufferWire {
            base,
            item_len,
            items,
        }
    }

    /// A prefill rank of a TP 2 prefill: 2 of the model's 4 KV heads, 2 layers, pages of 16
    /// tokens, one aux buffer of 32-byte items and one state buffer of 64-byte items.
    fn prefill_bufs() -> PushBuffers {
        let spec = spec(2, 16, Dtype::F16);
        PushBuffers {
            kv: KvCache {
                spec,
                bases: (1..=u64::from(spec.num_regions()))
                    .map(|r| r << 32)
                    .collect(),
                memory: MemoryKind::Host,
                total_kv_heads: 4,
                total_layers: 2,
                first_layer: 0,
                layer_windows: None,
                groups: None,
            },
            aux: vec![buf(0x1000, 32, 8)],
            state: vec![buf(0x2000, 64, 8)],
            state_kind: StateKind::None,
        }
    }

    /// A TP 1 decode whose cache pairs with `prefill_bufs`: all 4 heads, the same pages.
    fn decode_args() -> RegisterArgs {
        let spec = spec(4, 16, Dtype::F16);
        RegisterArgs {
            agent: "d0".into(),
            agent_metadata: Vec::new(),
            layout: LayoutWire::from_spec(&spec, 4, 2, 0),
            kv_bases: (1..=u64::from(spec.num_regions()))
                .map(|r| r << 36)
                .collect(),
            aux: vec![buf(0x8000, 32, 4)],
            state: vec![buf(0x9000, 64, 4)],
            tp_size: 1,
            tp_rank: 0,
            reregisters: false,
        }
    }

    fn refusal(args: &RegisterArgs) -> String {
        match check_registration(&prefill_bufs(), 2, args) {
            Ok(_) => panic!("accepted: {args:?}"),
            Err(e) => e,
        }
    }

    /// A decode whose cache pairs with this rank's is accepted, with its cache and the TP
    /// mapping from this prefill's 2 ranks to its 1.
    #[test]
    fn a_decode_that_pairs_is_accepted_with_its_cache_and_mapping() {
        let args = decode_args();
        let (spec, mapping) = check_registration(&prefill_bufs(), 2, &args).expect("pairs");
        assert_eq!(spec, args.layout.to_spec().expect("spec"));
        assert_eq!(
            mapping,
            TpMapping::new(2, 1, prefill_bufs().kv.sharding()).expect("mapping")
        );
    }

    /// Every way a registration can fail to pair is refused, each naming why.
    #[test]
    fn a_registration_that_does_not_pair_is_refused_naming_why() {
        let with = |f: &dyn Fn(&mut RegisterArgs)| {
            let mut a = decode_args();
            f(&mut a);
            a
        };
        let page = with(&|a| a.layout = LayoutWire::from_spec(&spec(4, 32, Dtype::F16), 4, 2, 0));
        assert!(refusal(&page).contains("page size or dtype differ"));
        let dtype = with(&|a| a.layout = LayoutWire::from_spec(&spec(4, 16, Dtype::Bf16), 4, 2, 0));
        assert!(refusal(&dtype).contains("page size or dtype differ"));
        let bases = with(&|a| {
            a.kv_bases.pop();
        });
        assert!(refusal(&bases).contains("region base addresses"));
        let heads = with(&|a| a.layout = LayoutWire::from_spec(&spec(4, 16, Dtype::F16), 8, 2, 0));
        assert!(refusal(&heads).contains("does not pair"));
        let layers = with(&|a| a.layout = LayoutWire::from_spec(&spec(4, 16, Dtype::F16), 4, 3, 0));
        assert!(refusal(&layers).contains("does not pair"));
        for (f, what) in [
            (
                &(|a: &mut RegisterArgs| a.aux.clear()) as &dyn Fn(&mut RegisterArgs),
                "aux",
            ),
            (&|a: &mut RegisterArgs| a.aux[0].item_len = 16, "aux"),
            (
                &|a: &mut RegisterArgs| a.state.push(buf(0xa000, 64, 1)),
                "state",
            ),
            (&|a: &mut RegisterArgs| a.state[0].item_len = 65, "state"),
        ] {
            let e = refusal(&with(f));
            assert!(
                e.starts_with(what) && e.contains("count or item length"),
                "{e}"
            );
        }
        for f in [
            &(|a: &mut RegisterArgs| a.aux[0].base = u64::MAX - 64) as &dyn Fn(&mut RegisterArgs),
            &|a: &mut RegisterArgs| a.state[0].base = u64::MAX - 64,
        ] {
            assert!(refusal(&with(f)).contains("overflows the address space"));
        }
        // Heads that do not split between 2 prefill ranks and 3 decode ranks.
        let tp = with(&|a| {
            a.layout = LayoutWire::from_spec(&spec(4, 16, Dtype::F16), 4, 2, 0);
            a.tp_size = 3;
        });
        refusal(&tp);
    }

    /// A hybrid model's decode registers its KV cache groups: the same partition as this
    /// rank's pairs, with layers overlaying one region across groups; another partition, or
    /// none beside ours, is refused naming both; an overlay within a group is refused.
    #[test]
    fn kv_cache_groups_must_be_the_prefills_and_may_overlay_only_across_groups() {
        let groups = kvxfer_layout::LayerGroups::new(vec![vec![0], vec![1]], 2).expect("groups");
        let mut bufs = prefill_bufs();
        bufs.kv.groups = Some(groups.clone());
        let mut args = decode_args();
        args.layout = args.layout.with_groups(Some(&groups));
        // Split K/V regions [K0, V0, K1, V1]: layer 1 over layer 0's memory.
        let b = args.kv_bases.clone();
        args.kv_bases = vec![b[0], b[1], b[0], b[1]];
        check_registration(&bufs, 2, &args).expect("overlaid across groups");
        let plain = check_registration(&prefill_bufs(), 2, &args).expect_err("groups");
        assert!(
            plain.contains("KV cache groups differ: decode [[0], [1]], prefill one"),
            "{plain}"
        );
        let mut one = args.clone();
        one.layout.groups = Some(vec![vec![0, 1]]);
        let e = check_registration(&bufs, 2, &one).expect_err("another partition");
        assert!(e.contains("decode [[0, 1]], prefill [[0], [1]]"), "{e}");
        let mut mixed = args.clone();
        mixed.layout = mixed.layout.with_groups(None);
        let e = check_registration(&bufs, 2, &mixed).expect_err("no groups");
        assert!(e.contains("decode one, prefill [[0], [1]]"), "{e}");
        // One group of both layers may not overlay them.
        let single = kvxfer_layout::LayerGroups::new(vec![vec![0, 1]], 2).expect("group");
        bufs.kv.groups = Some(single.clone());
        one.layout = one.layout.with_groups(Some(&single));
        let e = check_registration(&bufs, 2, &one).expect_err("overlay within a group");
        assert!(e.contains("overlap"), "{e}");
    }

    /// A room's pages split into the cache's KV cache groups: one count per group, adding up
    /// to its pages; counts for a cache of one group, and digests of groups, are refused.
    #[test]
    fn a_rooms_group_counts_must_split_its_pages_into_the_caches_groups() {
        let groups = kvxfer_layout::LayerGroups::new(vec![vec![0], vec![1]], 2).expect("groups");
        let room = |pages: Vec<u32>, counts: Vec<u32>| RoomRequest {
            room: 1,
            agent: "d0".into(),
            pages,
            aux_index: None,
            state_indices: Vec::new(),
            digest: false,
            prefix_tokens: 0,
            group_pages: counts,
        };
        assert_eq!(
            groups_refusal(&room(vec![1, 2, 3], vec![2, 1]), Some(&groups)),
            None
        );
        assert_eq!(groups_refusal(&room(vec![], vec![]), Some(&groups)), None);
        assert_eq!(groups_refusal(&room(vec![1], vec![]), None), None);
        let refused = |r: &RoomRequest, g: Option<&kvxfer_layout::LayerGroups>| {
            groups_refusal(r, g).expect("refused")
        };
        assert!(
            refused(&room(vec![1, 2], vec![1, 1]), None)
                .contains("pages of 2 KV cache groups for a cache of one group")
        );
        assert!(
            refused(&room(vec![1, 2], vec![2]), Some(&groups))
                .contains("page counts of 1 KV cache groups for a cache of 2")
        );
        assert!(
            refused(&room(vec![1, 2], vec![2, 1]), Some(&groups))
                .contains("add up to 3, the room names 2 pages")
        );
        let mut digest = room(vec![1, 2], vec![1, 1]);
        digest.digest = true;
        assert!(refused(&digest, Some(&groups)).contains("content digests"));
    }

    #[test]
    fn only_a_room_with_pages_asking_digests_of_gpu_memory_is_refused() {
        let gpu = MemoryKind::Gpu { device: 0 };
        let room = |digest: bool, pages: Vec<u32>| RoomRequest {
            room: 1,
            agent: "d0".into(),
            pages,
            aux_index: None,
            state_indices: Vec::new(),
            digest,
            prefix_tokens: 0,
            group_pages: Vec::new(),
        };
        let refused = digest_refusal(&room(true, vec![1]), gpu).expect("refused");
        assert!(
            refused.contains("decode d0") && refused.contains("GPU"),
            "{refused}"
        );
        assert_eq!(digest_refusal(&room(true, vec![1]), MemoryKind::Host), None);
        assert_eq!(digest_refusal(&room(false, vec![1]), gpu), None);
        assert_eq!(digest_refusal(&room(true, Vec::new()), gpu), None);
    }
}
