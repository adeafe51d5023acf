//! A push-mode deployment in one process: a bootstrap registry, prefill ranks (TP × PP)
//! with identity-filled KV, aux and state buffers, and decode ranks receiving into guard-
//! filled buffers. Verification recomputes expected bytes from element identities.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::clock::Clock;
use kvxfer_core::connector::KvCache;
use kvxfer_core::push::messages::BufferWire;
use kvxfer_core::push::{
    BootstrapRegistry, PrefillDirectory, PushBuffers, PushDecode, PushDecodeConfig, PushPrefill,
    PushPrefillConfig, RoomStatus, Rooms, StateKind,
};
use kvxfer_core::{MemoryKind, Transport};
use kvxfer_layout::{PpSplit, Side, TpMapping};
use kvxfer_transport_loopback::LoopbackTransport;

use crate::conformance::TransportFactory;
use crate::loopback::Loopback;
use crate::pull_env::{GUARD, Model, RankCache};

/// Items per aux/state buffer and bytes per item.
pub const ITEMS: u32 = 8;
/// Bytes per aux/state item.
pub const ITEM_LEN: u64 = 24;

/// The byte at `i` of item `item` of buffer `buf` on the prefill side.
pub fn item_byte(buf: usize, item: u32, i: u64) -> u8 {
    ((buf as u64 * 131 + u64::from(item) * 17 + i * 7 + 3) % 251) as u8
}

/// Host buffers for aux or state.
pub struct Items {
    /// One allocation per buffer.
    pub mem: Vec<Vec<u8>>,
    addrs: Vec<u64>,
}

impl Items {
    fn new(buffers: usize, fill: bool) -> Self {
        let mut mem: Vec<Vec<u8>> = (0..buffers)
            .map(|b| {
                (0..u64::from(ITEMS) * ITEM_LEN)
                    .map(|i| {
                        if fill {
                            item_byte(b, (i / ITEM_LEN) as u32, i % ITEM_LEN)
                        } else {
                            GUARD
                        }
                    })
                    .collect()
            })
            .collect();
        let addrs = mem.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
        Items { mem, addrs }
    }

    fn wire(&self) -> Vec<BufferWire> {
        self.addrs
            .iter()
            .map(|&base| BufferWire {
                base,
                item_len: ITEM_LEN,
                items: ITEMS,
            })
            .collect()
    }

    /// Checks item `dst` of every buffer holds prefill item `src`.
    pub fn holds(&self, dst: u32, src: u32) -> bool {
        self.mem.iter().enumerate().all(|(b, m)| {
            (0..ITEM_LEN)
                .all(|i| m[(u64::from(dst) * ITEM_LEN + i) as usize] == item_byte(b, src, i))
        })
    }

    /// True when item `i` of every buffer is untouched.
    pub fn untouched(&self, i: u32) -> bool {
        self.mem.iter().all(|m| {
            m[(u64::from(i) * ITEM_LEN) as usize..((u64::from(i) + 1) * ITEM_LEN) as usize]
                .iter()
                .all(|&b| b == GUARD)
        })
    }
}

/// A rank's memory.
pub struct RankMem {
    /// KV cache.
    pub kv: RankCache,
    /// Aux buffers.
    pub aux: Items,
    /// State buffers.
    pub state: Items,
}

fn buffers(
    model: &Model,
    mem: &mut RankMem,
    state_kind: StateKind,
    kv: fn(&mut KvCache),
) -> PushBuffers {
    let mut b = PushBuffers {
        kv: KvCache {
            spec: mem.kv.spec,
            bases: mem.kv.bases(),
            memory: MemoryKind::Host,
            total_kv_heads: model.heads,
            total_layers: model.layers,
            first_layer: mem.kv.first_layer,
            layer_windows: None,
            groups: None,
        },
        aux: mem.aux.wire(),
        state: mem.state.wire(),
        state_kind,
    };
    kv(&mut b.kv);
    b
}

/// Deployment options.
#[derive(Clone)]
pub struct Setup {
    /// Model.
    pub model: Model,
    /// Prefill TP.
    pub p: u32,
    /// Prefill PP stage sizes.
    pub stages: Vec<u32>,
    /// Decode TP.
    pub d: u32,
    /// Aux buffers per rank.
    pub aux: usize,
    /// State buffers per rank.
    pub state: usize,
    /// State kind.
    pub state_kind: StateKind,
    /// Decode settings hook.
    pub decode_config: fn(&mut PushDecodeConfig),
    /// Prefill settings hook.
    pub prefill_config: fn(&mut PushPrefillConfig),
    /// Where decodes learn prefills' ranks (their bootstrap registries when `None`).
    pub directory: Option<Arc<dyn PrefillDirectory>>,
    /// Changes each prefill rank's cache description (KV cache groups) before it registers.
    pub prefill_kv: fn(&mut KvCache),
    /// The same for each decode rank (KV cache groups, regions overlaid).
    pub decode_kv: fn(&mut KvCache),
}

impl Setup {
    /// TP `p` → `d`, one stage, one aux buffer, no state.
    pub fn new(model: Model, p: u32, d: u32) -> Self {
        Setup {
            model,
            p,
            stages: vec![model.layers],
            d,
            aux: 1,
            state: 0,
            state_kind: StateKind::None,
            decode_config: |_| {},
            prefill_config: |_| {},
            directory: None,
            prefill_kv: |_| {},
            decode_kv: |_| {},
        }
    }
}

/// The prefill side: registry, ranks (tp-major within each stage), memory.
pub struct PrefillSide<T: Transport = LoopbackTransport> {
    /// Workers, index `pp * p + tp`.
    pub ranks: Vec<PushPrefill<T>>,
    /// Their memory.
    pub mem: Vec<RankMem>,
    /// The registry (dropped last of the workers' peers).
    pub registry: BootstrapRegistry,
}

impl<T: Transport> Drop for PrefillSide<T> {
    fn drop(&mut self) {
        self.ranks.clear();
    }
}

/// The decode side.
pub struct DecodeSide<T: Transport = LoopbackTransport> {
    /// Workers by TP rank.
    pub ranks: Vec<PushDecode<T>>,
    /// Their memory.
    pub mem: Vec<RankMem>,
}

impl<T: Transport> Drop for DecodeSide<T> {
    fn drop(&mut self) {
        self.ranks.clear();
    }
}

/// Starts a registry and the prefill ranks (all of them, or only `only` ranks) on the
/// loopback.
pub fn prefill(
    s: &Setup,
    name: &str,
    clock: Arc<dyn Clock>,
    registry: Option<BootstrapRegistry>,
    only: Option<usize>,
) -> PrefillSide {
    prefill_on(&Loopback, s, name, clock, registry, only)
}

/// Starts the decode ranks on the loopback.
pub fn decode(s: &Setup, name: &str, clock: Arc<dyn Clock>) -> DecodeSide {
    decode_on(&Loopback, s, name, clock)
}

/// Starts a registry and the prefill ranks (all of them, or only `only` ranks), one agent
/// of `f` each.
pub fn prefill_on<F: TransportFactory>(
    f: &F,
    s: &Setup,
    name: &str,
    clock: Arc<dyn Clock>,
    registry: Option<BootstrapRegistry>,
    only: Option<usize>,
) -> PrefillSide<F::T> {
    let registry =
        registry.unwrap_or_else(|| BootstrapRegistry::bind("127.0.0.1", 0).expect("registry"));
    let split = PpSplit::from_sizes(&s.stages).expect("stages");
    let mapping = TpMapping::new(s.p, s.p, s.model.sharding()).expect("tp");
    let mut mem = Vec::new();
    for stage in split.stages() {
        for tp in 0..s.p {
            let heads = mapping.heads_of(Side::Prefill, tp).expect("rank");
            mem.push(RankMem {
                kv: RankCache::in_memory(
                    s.model.stage_spec(heads.count, stage.count),
                    heads.first,
                    stage.first,
                    true,
                    s.model.shared,
                ),
                aux: Items::new(s.aux, true),
                state: Items::new(s.state, true),
            });
        }
    }
    let mut ranks = Vec::new();
    let count = only.unwrap_or(mem.len());
    for (i, m) in mem.iter_mut().enumerate().take(count) {
        let (pp, tp) = (i as u32 / s.p, i as u32 % s.p);
        let mut cfg = PushPrefillConfig {
            tp: (tp, s.p),
            pp: (pp, s.stages.len() as u32),
            host: "127.0.0.1".into(),
            port: 0,
            registry: ("127.0.0.1".into(), registry.port()),
            bootstrap_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(5),
            idle_decode_timeout: PushPrefillConfig::IDLE_DECODE_TIMEOUT,
        };
        (s.prefill_config)(&mut cfg);
        let t = f.create(&format!("{name}-p{pp}-{tp}"));
        ranks.push(
            PushPrefill::new(
                t,
                cfg,
                buffers(&s.model, m, s.state_kind, s.prefill_kv),
                Arc::clone(&clock),
            )
            .expect("prefill rank"),
        );
    }
    PrefillSide {
        ranks,
        mem,
        registry,
    }
}

/// Starts the decode ranks, one agent of `f` each.
pub fn decode_on<F: TransportFactory>(
    f: &F,
    s: &Setup,
    name: &str,
    clock: Arc<dyn Clock>,
) -> DecodeSide<F::T> {
    let mapping = TpMapping::new(s.d, s.d, s.model.sharding()).expect("tp");
    let mut mem: Vec<RankMem> = (0..s.d)
        .map(|tp| {
            let heads = mapping.heads_of(Side::Decode, tp).expect("rank");
            RankMem {
                kv: RankCache::in_memory(
                    s.model.spec(heads.count),
                    heads.first,
                    0,
                    false,
                    s.model.shared,
                ),
                aux: Items::new(s.aux, false),
                state: Items::new(s.state, false),
            }
        })
        .collect();
    let ranks = mem
        .iter_mut()
        .enumerate()
        .map(|(tp, m)| {
            let mut cfg = PushDecodeConfig::new(tp as u32, s.d);
            cfg.request_timeout = Duration::from_secs(5);
            if let Some(d) = &s.directory {
                cfg.directory = Arc::clone(d);
            }
            (s.decode_config)(&mut cfg);
            let t = f.create(&format!("{name}-d{tp}"));
            PushDecode::new(
                t,
                cfg,
                buffers(&s.model, m, s.state_kind, s.decode_kv),
                Arc::clone(&clock),
            )
            .expect("decode rank")
        })
        .collect();
    DecodeSide { ranks, mem }
}

/// Polls both sides until `done` or 60 s (a hang guard).
pub fn poll_until<T: Transport>(
    pre: &mut PrefillSide<T>,
    dec: &mut DecodeSide<T>,
    mut done: impl FnMut(&PrefillSide<T>, &DecodeSide<T>) -> bool,
) {
    let start = Instant::now();
    loop {
        // Through the room API both sides share, as the Python binding drives them.
        for r in &mut pre.ranks {
            Rooms::poll(r);
        }
        for r in &mut dec.ranks {
            Rooms::poll(r);
        }
        if done(pre, dec) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "push scenario did not settle within 60 s"
        );
        std::thread::sleep(Duration::from_micros(300));
    }
}

/// Whether every prefill and decode rank holds `room` in a final status.
pub fn settled<T: Transport>(pre: &PrefillSide<T>, dec: &DecodeSide<T>, room: u64) -> bool {
    fn all_final<R: Rooms>(ranks: &[R], room: u64) -> bool {
        ranks
            .iter()
            .all(|r| r.status(room).is_some_and(|s| s.is_final()))
    }
    all_final(&pre.ranks, room) && all_final(&dec.ranks, room)
}

/// Runs one room: decode ranks ask for `dst` pages (aux `aux`, state `state.1`), prefill
/// ranks send `src` pages in chunks of `chunk`, aux `aux.0`, state `state.0`.
#[allow(clippy::too_many_arguments)]
pub fn run_room<T: Transport>(
    pre: &mut PrefillSide<T>,
    dec: &mut DecodeSide<T>,
    room: u64,
    src: &[u32],
    dst: &[u32],
    chunk: usize,
    aux: Option<(u32, u32)>,
    state: (Vec<u32>, Vec<u32>),
) -> Vec<RoomStatus> {
    let mut whole = |p: &mut PushPrefill<T>, room: u64, src: &[u32]| {
        src.chunks(chunk.max(1))
            .all(|part| p.send(room, part).is_ok())
    };
    run_room_sending(pre, dec, room, src, dst, &mut whole, aux, state)
}

/// How a prefill rank sends a room's pages: (rank, room, pages) → false if it stopped on
/// an error.
pub type SendPages<'a, T> = dyn FnMut(&mut PushPrefill<T>, u64, &[u32]) -> bool + 'a;

/// [`run_room`], each prefill rank sending its `src` pages with `send`.
#[allow(clippy::too_many_arguments)]
pub fn run_room_sending<T: Transport>(
    pre: &mut PrefillSide<T>,
    dec: &mut DecodeSide<T>,
    room: u64,
    src: &[u32],
    dst: &[u32],
    send: &mut SendPages<'_, T>,
    aux: Option<(u32, u32)>,
    state: (Vec<u32>, Vec<u32>),
) -> Vec<RoomStatus> {
    let port = pre.registry.port();
    for d in &mut dec.ranks {
        d.add_room(
            room,
            ("127.0.0.1", port),
            dst.to_vec(),
            aux.map(|a| a.1),
            state.1.clone(),
        );
    }
    for p in &mut pre.ranks {
        p.add_room(room, src.len(), aux.map(|a| a.0), state.0.clone());
    }
    poll_until(pre, dec, |pre, _| {
        pre.ranks.iter().all(|p| {
            p.status(room)
                .is_some_and(|s| s >= RoomStatus::WaitingForInput || s == RoomStatus::Failed)
        })
    });
    for p in &mut pre.ranks {
        if p.status(room) == Some(RoomStatus::Failed) {
            continue;
        }
        send(p, room, src);
    }
    poll_until(pre, dec, |pre, dec| settled(pre, dec, room));
    dec.ranks
        .iter()
        .map(|d| d.status(room).unwrap_or(RoomStatus::Failed))
        .collect()
}

/// A registry that lists `rank` as a ready prefill of one rank (instance 1) and accepts
/// anything else: for tests that play the prefill's mailbox themselves.
pub fn fake_registry(
    rank: kvxfer_core::push::messages::RankInfo,
) -> kvxfer_core::sidechannel::MessageServer {
    use kvxfer_core::push::messages::{self, FromPrefill, FromRegistry, ToRegistry, encode};
    kvxfer_core::sidechannel::MessageServer::bind(
        "127.0.0.1",
        0,
        1 << 20,
        kvxfer_core::sidechannel::auth::Destination::registry,
        Box::new(
            move |bytes: &[u8]| match messages::decode::<ToRegistry>(bytes, "request") {
                Ok(ToRegistry::Query) => encode(&FromRegistry::Layout {
                    instance: 1,
                    ranks: vec![rank.clone()],
                }),
                _ => encode(&FromPrefill::Ok),
            },
        ),
    )
    .expect("registry")
}
