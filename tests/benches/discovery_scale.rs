//! Discovery at fleet scale against a real etcd:
//! `cargo bench -p kvxfer-tests --features etcd --bench discovery_scale [-- RANKS [SECONDS]]`
//! (default 1,000 ranks, a 10 s steady-state window). Every rank registers as its own process
//! would (one registrar, one lease, TTL 10 s), in engines of TP 8. Prints the time to register
//! them, a peer's lookup of one engine and of the whole fleet, the latency from a registration
//! to a watcher's notification, and etcd's writes and lease renewals per second at steady state
//! (from its own metrics). Figures only: nothing is asserted on time.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_discovery::etcd::{EtcdClient, Registrar, Watcher};
use kvxfer_discovery::key::{engine_prefix, role_prefix};
use kvxfer_discovery::{Change, RankIndex, RankKey, RankRecord, Role, World};
use kvxfer_tests::etcd_server::EtcdServer;

const TP: u32 = 8;
const TTL: Duration = Duration::from_secs(10);

fn record(instance: u64, tp: u32, world: u32) -> RankRecord {
    RankRecord {
        instance,
        endpoint: format!("10.0.{}.{}:{}", instance / 250, instance % 250, 5600 + tp),
        layout: "sha256:0123456789abcdef".into(),
        world: World {
            dp: 1,
            pp: 1,
            tp: world,
        },
        push: None,
    }
}

fn key(engine: &str, tp: u32) -> RankKey {
    RankKey::new(
        "scale",
        Role::Prefill,
        engine,
        RankIndex { dp: 0, pp: 0, tp },
    )
    .unwrap()
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

/// etcd's counter `name` from its /metrics page.
fn metric(url: &str, name: &str) -> f64 {
    let addr = url.trim_start_matches("etcd://");
    let mut s = std::net::TcpStream::connect(addr).expect("etcd metrics");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn main() {
    let nums: Vec<u64> = std::env::args().filter_map(|a| a.parse().ok()).collect();
    let ranks = nums.first().copied().unwrap_or(1000).max(u64::from(TP)) as u32;
    let window = Duration::from_secs(nums.get(1).copied().unwrap_or(10));
    let etcd = match EtcdServer::start() {
        Ok(s) => s,
        Err(reason) => {
            println!("SKIP discovery_scale: {reason}");
            return;
        }
    };
    let client = Arc::new(EtcdClient::new(&etcd.url(), Duration::from_secs(5)).unwrap());
    let engines = ranks / TP;
    let ranks = engines * TP;
    println!(
        "discovery at scale: {ranks} ranks ({engines} engines of TP {TP}), one lease each, TTL {TTL:?}"
    );

    // Registration: each rank as its own process would.
    let start = Instant::now();
    let mut each = Vec::new();
    let mut registrars = Vec::new();
    for e in 0..engines {
        for tp in 0..TP {
            let t = Instant::now();
            let instance = u64::from(e * TP + tp);
            let r = Registrar::start(
                client.clone(),
                TTL,
                vec![(key(&format!("e{e}"), tp), record(instance, tp, TP))],
            )
            .expect("register");
            each.push(t.elapsed());
            registrars.push(r);
        }
    }
    let took = start.elapsed();
    println!(
        "  register        {ranks} ranks in {:.2} s ({:.0} ranks/s; one rank p50 {:.2} ms, p99 {:.2} ms)",
        took.as_secs_f64(),
        f64::from(ranks) / took.as_secs_f64(),
        pct(&mut each, 0.5),
        pct(&mut each, 0.99)
    );

    // Lookup: one engine (what a decode does for a new prefill), and the whole fleet (what a
    // watcher does at start and after every resync).
    let mut one = Vec::new();
    for i in 0..200 {
        let prefix = engine_prefix("scale", Role::Prefill, &format!("e{}", i % engines));
        let t = Instant::now();
        let (_, kvs) = client.range_prefix(prefix.as_bytes()).unwrap();
        one.push(t.elapsed());
        assert_eq!(kvs.len(), TP as usize);
    }
    let t = Instant::now();
    let (watcher, changes) =
        Watcher::start(client.clone(), role_prefix("scale", Role::Prefill)).unwrap();
    let fleet = t.elapsed();
    assert_eq!(watcher.engines().len(), engines as usize);
    println!(
        "  lookup          one engine p50 {:.2} ms, p99 {:.2} ms; all {engines} engines (watch start) {:.1} ms",
        pct(&mut one, 0.5),
        pct(&mut one, 0.99),
        fleet.as_secs_f64() * 1e3
    );
    while changes.try_recv().is_ok() {}

    // Notification: a new single-rank engine registers; time until the watcher says ready.
    let mut notify = Vec::new();
    let lease = client.grant(60).unwrap();
    for i in 0..100u64 {
        let k = RankKey::new(
            "scale",
            Role::Prefill,
            &format!("n{i}"),
            RankIndex {
                dp: 0,
                pp: 0,
                tp: 0,
            },
        )
        .unwrap();
        let t = Instant::now();
        client
            .put(
                k.to_key().as_bytes(),
                &record(1_000_000 + i, 0, 1).encode(),
                lease,
            )
            .unwrap();
        loop {
            match changes
                .recv_timeout(Duration::from_secs(30))
                .expect("a notification")
            {
                Change::Ready(v) if v.engine_id == format!("n{i}") => break,
                _ => {}
            }
        }
        notify.push(t.elapsed());
    }
    client.revoke(lease).unwrap();
    println!(
        "  notification    registration -> watcher ready p50 {:.2} ms, p99 {:.2} ms (put included)",
        pct(&mut notify, 0.5),
        pct(&mut notify, 0.99)
    );

    // Steady state: only lease renewals should reach etcd.
    std::thread::sleep(Duration::from_secs(1));
    let url = etcd.url();
    let names = [
        "etcd_mvcc_put_total",
        "etcd_debugging_lease_renewed_total",
        "etcd_server_proposals_committed_total",
    ];
    let before: Vec<f64> = names.iter().map(|n| metric(&url, n)).collect();
    let failures: u64 = registrars.iter().map(|r| r.status().failures).sum();
    std::thread::sleep(window);
    let after: Vec<f64> = names.iter().map(|n| metric(&url, n)).collect();
    let rate = |i: usize| (after[i] - before[i]) / window.as_secs_f64();
    let failed_now: u64 = registrars.iter().map(|r| r.status().failures).sum::<u64>() - failures;
    // Leases registered together renew together: a window shorter than a few renewal
    // intervals catches them in phase, so the expected rate is only meaningful over a longer one.
    let expected = if window >= TTL {
        format!(
            "expected {:.1}: {ranks} leases / {:.1} s",
            f64::from(ranks) / (TTL.as_secs_f64() / 3.0),
            TTL.as_secs_f64() / 3.0
        )
    } else {
        format!("a window under {TTL:?} sees renewals in phase")
    };
    println!(
        "  steady state    over {window:?}: {:.1} puts/s, {:.1} lease renewals/s ({expected}), {:.1} raft proposals/s; {failed_now} renewals failed",
        rate(0),
        rate(1),
        rate(2)
    );
    let t = Instant::now();
    drop(watcher);
    drop(registrars);
    println!(
        "  deregister      {ranks} ranks (leases revoked) in {:.2} s",
        t.elapsed().as_secs_f64()
    );
}
