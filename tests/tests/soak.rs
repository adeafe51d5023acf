//! The short soak of the test suite (the long one: `cargo bench -p kvxfer-tests --bench
//! soak`): thousands of random transfers, every one checked, no corruption, no failure, and
//! resident memory after warm-up flat within a bound that a per-transfer leak would break.

use kvxfer_tests::soak::{SoakConfig, run};
use kvxfer_transport_loopback::LoopbackTransport;

fn check(label: &str, r: &kvxfer_tests::soak::SoakReport, expected: usize) {
    println!(
        "soak [{label}]: {} transfers, {} descriptors, {:.1} MB, {} corrupt, {} failed, RSS {} -> {} KiB, {:?}",
        r.transfers,
        r.descriptors,
        r.bytes as f64 / 1e6,
        r.corrupt,
        r.failed,
        r.rss_kib.0,
        r.rss_kib.1,
        r.elapsed
    );
    assert_eq!(r.transfers, expected, "{label}: every transfer completed");
    assert_eq!(r.corrupt, 0, "{label}: corrupted transfers");
    assert_eq!(r.failed, 0, "{label}: failed transfers");
    // 4 MiB of growth over the measured part would be >100 bytes kept per transfer.
    let growth = r.rss_kib.1.saturating_sub(r.rss_kib.0);
    assert!(
        growth < 4096,
        "{label}: resident memory grew {growth} KiB after warm-up"
    );
}

/// A stray byte written outside every range a transfer names, past the guard byte that the
/// per-transfer check reads, on the transfer whose end runs the whole-buffer check: that
/// check alone finds it, and the transfer counts as corrupt.
#[test]
fn the_whole_buffer_check_catches_a_stray_write() {
    use kvxfer_tests::faulty::Faulty;
    let c = SoakConfig {
        transfers: 1_000,
        warmup: 100,
        max_len: 4 << 10,
        buffer: 1 << 20,
        ..SoakConfig::default()
    };
    let a = Faulty::new(LoopbackTransport::new("stray-a").unwrap());
    let b = LoopbackTransport::new("stray-b").unwrap();
    // Transfer 999 (the 1000th post) is the first after which the whole buffer is checked.
    a.faults().stray_write_after(999);
    let b = Faulty::new(b);
    let r = run(a, b, &c);
    assert_eq!((r.transfers, r.failed), (c.transfers, 0));
    assert_eq!(r.corrupt, 1, "the stray byte went unnoticed");
}

/// One test, so the two soaks do not share the process's resident memory at the same time.
#[test]
fn short_soaks() {
    let c = SoakConfig {
        transfers: 10_000,
        warmup: 1_000,
        max_len: 4 << 10,
        ..SoakConfig::default()
    };
    let a = LoopbackTransport::new("soak-a").unwrap();
    let b = LoopbackTransport::new("soak-b").unwrap();
    check("loopback", &run(a, b, &c), c.transfers);
    #[cfg(feature = "ucx")]
    {
        use kvxfer_transport_ucx::{UcxConfig, UcxTransport};
        let c = SoakConfig {
            transfers: 4_000,
            ..c
        };
        // UCX's own path, and the same-host copies (the soak's buffers are kvxfer shared
        // memory).
        let make = |name: &str, shared_memory: bool| {
            UcxTransport::with_config(
                name,
                UcxConfig {
                    tls: Some("sm,self".into()),
                    shared_memory,
                    ..UcxConfig::default()
                },
            )
            .unwrap()
        };
        check(
            "ucx/sm",
            &run(make("soak-ua", false), make("soak-ub", false), &c),
            c.transfers,
        );
        check(
            "ucx/sm+mapped",
            &run(make("soak-ma", true), make("soak-mb", true), &c),
            c.transfers,
        );
    }
}
