//! `kvxfer serve` and `kvxfer bench` finding each other through a real etcd by engine id,
//! across processes over UCX: two prefills and two decodes; a prefill SIGKILLed (its keys
//! gone within the lease's TTL + 1 s, the decode told) and started again under the same
//! engine id on another port (the decode reads from the new instance).
#![cfg(feature = "etcd")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvxfer_discovery::etcd::EtcdClient;

mod common;
#[path = "../tests/src/etcd_server.rs"]
#[allow(dead_code)]
mod etcd_server;

use common::runnable;
use etcd_server::EtcdServer;

const SHAPE: &[&str] = &["--num-blocks", "8", "--tokens", "64"];
const LIMIT: Duration = Duration::from_secs(90);

fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

/// `kvxfer serve` registered as `engine`, returned once it says it is serving.
fn serve(etcd: &EtcdServer, engine: &str, ttl: &str) -> Reaped {
    serve_with(etcd, engine, ttl, &[])
}

/// [`serve`] with `extra` arguments.
fn serve_with(etcd: &EtcdServer, engine: &str, ttl: &str, extra: &[&str]) -> Reaped {
    let mut server = Command::new(env!("CARGO_BIN_EXE_kvxfer"))
        .args(["serve", "--transport", "ucx", "--port", &free_port()])
        .args(["--duration", "120", "--discovery", &etcd.url()])
        .args(["--cluster", "t", "--engine-id", engine, "--lease-ttl", ttl])
        .args(SHAPE)
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start serve");
    let mut out = BufReader::new(server.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("serving"), "{line}");
    Reaped(server)
}

/// `kvxfer bench` reading from `engine`, its log lines sent to the returned receiver.
fn bench(etcd: &EtcdServer, engine: &str, requests: &str) -> (Reaped, mpsc::Receiver<String>) {
    bench_with(etcd, engine, requests, &[])
}

/// [`bench`] with `extra` arguments.
fn bench_with(
    etcd: &EtcdServer,
    engine: &str,
    requests: &str,
    extra: &[&str],
) -> (Reaped, mpsc::Receiver<String>) {
    let mut b = Command::new(env!("CARGO_BIN_EXE_kvxfer"))
        .args(["bench", "--transport", "ucx", "--discovery", &etcd.url()])
        .args(["--cluster", "t", "--engine-id", engine])
        .args(["--requests", requests, "--warmup", "0", "--keep-going"])
        .args(["--transfer-timeout", "60", "--lease-ttl", "2"])
        .args(SHAPE)
        .args(extra)
        .env("RUST_LOG", "kvxfer_core=info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start bench");
    let (tx, rx) = mpsc::channel();
    for pipe in [
        Box::new(b.stderr.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(b.stdout.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(plain(&l));
            }
        });
    }
    (Reaped(b), rx)
}

/// A log line without its colour codes.
fn plain(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ ... m
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A child process killed when the test ends, passed or not.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for a log line containing `what`, keeping every line seen.
fn wait_for(lines: &mpsc::Receiver<String>, what: &str, seen: &mut Vec<String>) {
    let deadline = Instant::now() + LIMIT;
    loop {
        match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(l) => {
                let hit = l.contains(what);
                seen.push(l);
                if hit {
                    return;
                }
            }
            Err(_) => panic!("no {what:?} within {LIMIT:?}; seen:\n{}", seen.join("\n")),
        }
    }
}

fn finish(mut b: Reaped, lines: mpsc::Receiver<String>, mut seen: Vec<String>) -> String {
    let status = b.0.wait().expect("bench ends");
    std::thread::sleep(Duration::from_millis(100));
    seen.extend(lines.try_iter());
    let log = seen.join("\n");
    assert!(status.success(), "bench failed:\n{log}");
    log
}

fn keys(etcd: &EtcdServer, engine: &str) -> usize {
    let c = EtcdClient::new(&etcd.url(), Duration::from_secs(2)).unwrap();
    let prefix = format!("/kvxfer/v1/t/engines/prefill/{engine}/");
    c.range_prefix(prefix.as_bytes()).unwrap().1.len()
}

fn with_etcd_and_ucx(case: &str, f: impl FnOnce(&mut EtcdServer)) {
    if !runnable("ucx", case) {
        return;
    }
    match EtcdServer::start() {
        Ok(mut s) => f(&mut s),
        Err(reason) => println!("SKIP [etcd] {case}: {reason}"),
    }
}

#[test]
fn two_prefills_and_two_decodes_find_each_other_by_engine_id() {
    with_etcd_and_ucx("two prefills, two decodes", |etcd| {
        let pa = serve(etcd, "pa", "10");
        let mut pb = serve(etcd, "pb", "10");
        assert_eq!((keys(etcd, "pa"), keys(etcd, "pb")), (1, 1));
        let (ba, la) = bench(etcd, "pa", "4");
        let (bb, lb) = bench(etcd, "pb", "4");
        let (log_a, log_b) = (finish(ba, la, Vec::new()), finish(bb, lb, Vec::new()));
        for (log, engine) in [(&log_a, "pa"), (&log_b, "pb")] {
            assert!(log.contains(&format!("engine={engine}")), "{log}");
            assert!(log.contains("all correct"), "{log}");
        }
        // A clean stop revokes the lease: the keys go at once, not after the TTL.
        drop(pa);
        let _ = Command::new("kill")
            .args(["-INT", &pb.0.id().to_string()])
            .status();
        let t0 = Instant::now();
        while keys(etcd, "pb") != 0 {
            assert!(t0.elapsed() < Duration::from_secs(5), "pb still registered");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(pb.0.wait().unwrap().success());
    });
}

/// Push mode: a served TP 2 push prefill registers each rank with its push fields, and a push
/// decode finds it by engine id and runs its rooms (bytes verified), readiness and liveness
/// from etcd.
#[test]
fn a_push_prefill_and_decode_find_each_other_by_engine_id() {
    with_etcd_and_ucx("push prefill and decode", |etcd| {
        let push = ["--mode", "push", "--tp", "2:1"];
        let _p = serve_with(etcd, "pp", "10", &push);
        assert_eq!(keys(etcd, "pp"), 2, "one key per rank");
        let c = EtcdClient::new(&etcd.url(), Duration::from_secs(2)).unwrap();
        let (_, kvs) = c.range_prefix(b"/kvxfer/v1/t/engines/prefill/pp/").unwrap();
        let record = String::from_utf8_lossy(&kvs[0].value).into_owned();
        assert!(
            record.contains(r#""push":{"bootstrap":"127.0.0.1:"#),
            "{record}"
        );
        let (b, lines) = bench_with(etcd, "pp", "4", &push);
        let log = finish(b, lines, Vec::new());
        assert!(log.contains("all correct"), "{log}");
    });
}

#[test]
fn a_killed_prefill_is_dropped_within_its_ttl_and_its_restart_elsewhere_is_read() {
    with_etcd_and_ucx("prefill killed and restarted", |etcd| {
        let first = serve(etcd, "p", "2");
        let (b, lines) = bench(etcd, "p", "300");
        let mut seen = Vec::new();
        wait_for(&lines, "connected to prefill engine", &mut seen);
        drop(first);
        let killed = Instant::now();
        while keys(etcd, "p") != 0 {
            assert!(killed.elapsed() < LIMIT, "the keys never went");
            std::thread::sleep(Duration::from_millis(20));
        }
        let gone_after = killed.elapsed();
        // TTL 2 s, etcd checks expiry every 500 ms.
        assert!(
            gone_after < Duration::from_secs(3),
            "keys gone after {gone_after:?}"
        );
        wait_for(&lines, "discovery: prefill engine p lost", &mut seen);
        // The same engine id, another port: only discovery can lead the decode there.
        let _second = serve(etcd, "p", "2");
        let log = finish(b, lines, seen);
        assert!(
            log.contains("deregistered") || log.contains("restarted"),
            "{log}"
        );
        let connected = log.matches("connected to prefill engine").count();
        assert!(connected >= 2, "no reconnection:\n{log}");
        println!("keys of the killed prefill gone after {gone_after:?}");
        for l in log
            .lines()
            .filter(|l| l.contains("lost") || l.contains("failed"))
        {
            println!("{l}");
        }
    });
}

#[test]
fn an_unreachable_etcd_is_a_clear_error_for_serve_and_bench() {
    if !runnable("ucx", "etcd unreachable") {
        return;
    }
    let dead = format!("etcd://127.0.0.1:{}", free_port());
    // `args` with discovery at `dead`: exit code and standard error.
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvxfer"))
            .args(args)
            .args([
                "--transport",
                "ucx",
                "--discovery",
                &dead,
                "--engine-id",
                "p",
            ])
            .args(SHAPE)
            .output()
            .expect("run kvxfer");
        (
            out.status.code(),
            plain(&String::from_utf8_lossy(&out.stderr)),
        )
    };
    for args in [
        vec!["serve", "--port", &free_port(), "--duration", "5"],
        vec!["bench", "--requests", "1"],
    ] {
        let (code, err) = run(&args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(
            err.contains("etcd unreachable at 127.0.0.1:"),
            "{args:?}: {err}"
        );
    }
    // An address peers cannot reach is refused before etcd is asked.
    for host in ["0.0.0.0", "::", "[::]"] {
        let (code, err) = run(&[
            "serve",
            "--host",
            host,
            "--port",
            &free_port(),
            "--duration",
            "5",
        ]);
        assert_eq!(code, Some(2), "{host}: {err}");
        assert!(err.contains("--host is registered"), "{host}: {err}");
    }
}

#[test]
fn etcd_stopped_mid_run_stops_no_transfer_and_the_registration_recovers() {
    with_etcd_and_ucx("etcd stopped mid-run", |etcd| {
        let _p = serve(etcd, "p", "3");
        let (b, lines) = bench(etcd, "p", "300");
        let mut seen = Vec::new();
        wait_for(&lines, "connected to prefill engine", &mut seen);
        etcd.kill();
        let log = finish(b, lines, seen);
        assert!(
            !log.contains("failed on decode rank"),
            "a request failed:\n{log}"
        );
        assert!(log.contains("all correct"), "{log}");
        // etcd back with its data: the serve's lease is renewed, its key still there.
        etcd.restart(true);
        std::thread::sleep(Duration::from_secs(4));
        assert_eq!(keys(etcd, "p"), 1);
    });
}
