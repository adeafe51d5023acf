//! The long soak: `cargo bench -p kvxfer-tests --bench soak [-- TRANSFERS]` (default
//! 100,000) on the loopback, and on UCX shared memory with `--features ucx`. Prints transfers,
//! descriptors, bytes, corrupt and failed counts, resident memory after warm-up and at the
//! end; exits non-zero on any corruption or failure.

use kvxfer_tests::soak::{SoakConfig, SoakReport, run};
use kvxfer_transport_loopback::LoopbackTransport;

fn print(label: &str, r: &SoakReport) -> bool {
    println!(
        "{label:>10}: {} transfers, {} descriptors, {:.0} MB, corrupt {}, failed {}, RSS after warm-up {} KiB, at end {} KiB (+{} KiB), {:.1} s, {:.0} transfers/s",
        r.transfers,
        r.descriptors,
        r.bytes as f64 / 1e6,
        r.corrupt,
        r.failed,
        r.rss_kib.0,
        r.rss_kib.1,
        r.rss_kib.1 as i64 - r.rss_kib.0 as i64,
        r.elapsed.as_secs_f64(),
        r.transfers as f64 / r.elapsed.as_secs_f64()
    );
    r.corrupt == 0 && r.failed == 0
}

fn main() {
    let transfers = std::env::args()
        .filter_map(|a| a.parse().ok())
        .next()
        .unwrap_or(100_000);
    let c = SoakConfig {
        transfers,
        warmup: (transfers / 10).max(1),
        ..SoakConfig::default()
    };
    let ok = print(
        "loopback",
        &run(
            LoopbackTransport::new("soak-a").unwrap(),
            LoopbackTransport::new("soak-b").unwrap(),
            &c,
        ),
    );
    #[cfg(feature = "ucx")]
    {
        use kvxfer_transport_ucx::{UcxConfig, UcxTransport};
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
        let mapped = run(make("soak-ma", true), make("soak-mb", true), &c);
        if !print("ucx/sm+mapped", &mapped) {
            std::process::exit(1);
        }
        if !print(
            "ucx/sm",
            &run(make("soak-ua", false), make("soak-ub", false), &c),
        ) {
            std::process::exit(1);
        }
    }
    if !ok {
        std::process::exit(1);
    }
}
