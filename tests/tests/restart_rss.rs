//! A long-lived engine whose peers restart 100 times keeps its endpoints, shared-memory
//! mappings and resident memory flat, on UCX with same-host mappings (where a kept peer
//! would keep its whole mapped cache): a pull decode reading from 100 prefills in turn, and
//! a push prefill writing into 100 decodes in turn, each peer gone after one transfer of its
//! whole cache. One test in its own binary, so no other test shares the resident memory.
#![cfg(feature = "ucx")]

use std::sync::Arc;
use std::time::Duration;

use kvxfer_core::clock::{Clock, ManualClock};
use kvxfer_core::push::RoomStatus;
use kvxfer_layout::BlockOrder;
use kvxfer_tests::conformance::TransportFactory;
use kvxfer_tests::pull_env::{Model, engine, poll_until};
use kvxfer_tests::push_env::{Setup, decode_on, prefill_on, run_room};
use kvxfer_tests::soak::rss_kib;
use kvxfer_transport_ucx::{UcxConfig, UcxTransport};

/// Agents whose transfers between test buffers (kvxfer shared memory) are copies through
/// the peer's mapped memory.
struct Mapped;

impl TransportFactory for Mapped {
    type T = UcxTransport;

    fn label(&self) -> String {
        "ucx/sm,self+mapped".into()
    }

    fn create(&self, name: &str) -> UcxTransport {
        UcxTransport::with_config(
            name,
            UcxConfig {
                tls: Some("sm,self".into()),
                shared_memory: true,
                ..UcxConfig::default()
            },
        )
        .expect("UCX agent")
    }
}

/// 64 blocks of 4 tokens, 4 heads of 64 f16 values, 2 layers: 512 KiB of KV per rank,
/// all of it moved each time, so a peer kept with its mappings keeps 512 KiB resident.
fn model() -> Model {
    Model {
        head_dim: 64,
        blocks: 64,
        shared: true,
        ..Model::small(BlockOrder::Hnd, 4)
    }
}

const RESTARTS: usize = 100;
const WARMUP: usize = 10;
/// A leak of one peer's cache per restart would be 45 MiB over the measured part.
const MAX_GROWTH_KIB: u64 = 12 << 10;

#[test]
fn peers_restarted_100_times_leave_endpoints_mappings_and_resident_memory_flat() {
    let manual = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(manual.clone());
    let idle = Duration::from_secs(60);
    let blocks: Vec<u32> = (0..model().blocks).collect();
    let pairs: Vec<(u32, u32)> = blocks.iter().map(|&b| (b, b)).collect();
    let make = |name: &str| Mapped.create(name);

    // Pull: one decode, a new prefill each time, closed once idle after it is gone (UCX's
    // shared-memory transports need not report a dead peer).
    let tune = |cfg: &mut kvxfer_core::pull::PullConfig| {
        cfg.heartbeat_interval = Duration::from_secs(5);
        cfg.idle_engine_timeout = idle;
    };
    let mut dec = engine("rss-D", &model(), 1, false, Arc::clone(&c), &make, &tune);
    let mut baseline = 0;
    for i in 0..RESTARTS {
        let mut pre = engine(
            &format!("rss-P{i}"),
            &model(),
            1,
            true,
            Arc::clone(&c),
            &make,
            &tune,
        );
        let id = format!("r{i}");
        let params = pre.finish_prefill(&id, &blocks);
        dec.start_load(&id, &params, &blocks, blocks.len() * 4);
        poll_until(&mut [&mut dec, &mut pre], |i, f| {
            i == 1 || {
                assert!(f[0].failed.is_empty(), "{:?}", f[0].failed);
                !f[0].recving.is_empty()
            }
        });
        dec.caches[0].verify(&pairs).expect("bytes");
        let t = dec.workers[0].transport();
        assert!(
            t.peer_count() == 1 && t.shared_memory_mappings() > 0,
            "mapped"
        );
        drop(pre);
        manual.advance(idle);
        dec.poll();
        let t = dec.workers[0].transport();
        assert_eq!(
            (t.peer_count(), t.shared_memory_mappings()),
            (0, 0),
            "pull restart {i}"
        );
        if i + 1 == WARMUP {
            baseline = rss_kib();
        }
    }
    let pull = rss_kib().saturating_sub(baseline);
    drop(dec);

    // Push: one prefill, a new decode each time, forgotten once idle after it is gone.
    let mut s = Setup::new(model(), 1, 1);
    s.prefill_config = |cfg| cfg.idle_decode_timeout = Duration::from_secs(60);
    let mut pre = prefill_on(&Mapped, &s, "rss-push", Arc::clone(&c), None, None);
    for i in 0..RESTARTS {
        let mut dec = decode_on(&Mapped, &s, &format!("rss-push{i}"), Arc::clone(&c));
        assert_eq!(
            run_room(
                &mut pre,
                &mut dec,
                i as u64,
                &blocks,
                &blocks,
                16,
                None,
                (vec![], vec![])
            ),
            vec![RoomStatus::Success]
        );
        dec.mem[0].kv.verify(&pairs).expect("bytes");
        let t = pre.ranks[0].transport();
        assert!(
            t.peer_count() == 1 && t.shared_memory_mappings() > 0,
            "mapped"
        );
        drop(dec);
        manual.advance(idle);
        pre.ranks[0].poll();
        let t = pre.ranks[0].transport();
        assert_eq!(
            (t.peer_count(), t.shared_memory_mappings()),
            (0, 0),
            "push restart {i}"
        );
        if i + 1 == WARMUP {
            baseline = rss_kib();
        }
    }
    let push = rss_kib().saturating_sub(baseline);
    println!(
        "resident memory over {} restarts after {WARMUP}: pull decode +{pull} KiB, push prefill +{push} KiB",
        RESTARTS - WARMUP
    );
    assert!(
        pull < MAX_GROWTH_KIB && push < MAX_GROWTH_KIB,
        "resident memory grew: pull +{pull} KiB, push +{push} KiB"
    );
}
