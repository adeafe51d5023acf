//! A prefill restarted under a running decode, across processes over UCX: `kvxfer serve` is
//! killed (SIGKILL) and started again under the same engine id on the same port while
//! `kvxfer bench --connect --keep-going` runs. The decode must notice, reconnect to the new
//! instance and finish its run with every later request verified.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use common::{runnable, serve_on, spawn_serve};

const SHAPE: &[&str] = &["--num-blocks", "8", "--tokens", "64"];

/// Waits for a line of the bench's log containing `what`, returning every line seen.
fn wait_for(lines: &mpsc::Receiver<String>, what: &str, seen: &mut Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) => {
                let hit = l.contains(what);
                seen.push(l);
                if hit {
                    return;
                }
            }
            Err(_) => panic!(
                "no {what:?} within 60 s; the bench said:\n{}",
                seen.join("\n")
            ),
        }
    }
}

#[test]
fn a_prefill_restarted_under_a_running_bench_is_reconnected() {
    if !runnable("ucx", "prefill restart under a running bench") {
        return;
    }
    let (mut first, port) = spawn_serve("ucx", SHAPE, None);
    let json = std::env::temp_dir().join(format!("kvxfer-restart-{port}.json"));
    let connect = format!("127.0.0.1:{port}");
    let mut bench = Command::new(env!("CARGO_BIN_EXE_kvxfer"))
        .args(["bench", "--transport", "ucx", "--connect", &connect])
        .args(["--requests", "200", "--warmup", "0", "--keep-going"])
        .args(["--transfer-timeout", "10"])
        .arg("--json")
        .arg(&json)
        .args(SHAPE)
        .env("RUST_LOG", "kvxfer_core=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start bench");
    let stderr = bench.stderr.take().expect("bench stderr");
    let (tx, lines) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut seen = Vec::new();
    wait_for(&lines, "connected to prefill engine", &mut seen);
    // The first instance dies with the decode connected to it, then a new one takes its
    // place: same engine id, same port, new UCX worker and memory.
    first.kill().expect("kill serve");
    first.wait().expect("serve ended");
    let mut second = serve_on("ucx", &port, SHAPE, None);
    let status = bench.wait().expect("bench ends");
    let _ = second.kill();
    let _ = second.wait();
    reader.join().expect("reader");
    seen.extend(lines.try_iter());
    let log = seen.join("\n");
    assert!(status.success(), "bench failed after the restart:\n{log}");
    assert!(
        log.contains("prefill engine restarted"),
        "the new instance was not recognised:\n{log}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("JSON written")).expect("JSON");
    let _ = std::fs::remove_file(&json);
    let num = |k: &str| {
        report[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {report}"))
    };
    assert!(num("peer_restarts") >= 1, "{report}");
    assert!(num("lost_connections") >= 1, "{report}");
    // Every request ended (none hung); those that succeeded were verified byte by byte.
    assert_eq!(num("requests") + num("failed_requests"), 200, "{report}");
    assert!(num("requests") > 0 && num("verified_bytes") > 0, "{report}");
    println!(
        "restart under a running bench: {} requests verified, {} failed, {} reconnects",
        num("requests"),
        num("failed_requests"),
        num("lost_connections")
    );
}
