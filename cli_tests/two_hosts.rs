//! Two hosts on one machine: network namespaces joined by a veth pair, `kvxfer serve` in
//! one and `kvxfer bench --connect` in the other, over UCX on TCP (`UCX_TLS=tcp,self`, so
//! nothing takes a shared-memory shortcut between the namespaces). Every byte is verified.
//! Skipped, with the reason printed, where namespaces cannot be made (not root, no `ip`) or
//! the build lacks the UCX transport.

use std::process::{Command, Stdio};

fn kvxfer() -> &'static str {
    env!("CARGO_BIN_EXE_kvxfer")
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces and a veth pair between them, removed on drop.
struct Hosts {
    names: [String; 2],
    addrs: [String; 2],
    devs: [String; 2],
}

impl Hosts {
    /// Two hosts; `tag` (one letter) keeps tests of one process apart.
    fn new(tag: char) -> Result<Hosts, String> {
        let id = std::process::id();
        let names = [format!("kvxa{tag}{id}"), format!("kvxb{tag}{id}")];
        // A /30 from 10.200.0.0/16 chosen by the pid and tag, so parallel runs do not collide.
        let net = ((id * 4 + tag as u32 % 4) % 16000) * 4;
        let addrs = [
            format!("10.200.{}.{}", net / 256, net % 256 + 1),
            format!("10.200.{}.{}", net / 256, net % 256 + 2),
        ];
        let (va, vb) = (format!("va{tag}{id}"), format!("vb{tag}{id}"));
        let hosts = Hosts {
            names,
            addrs,
            devs: [va.clone(), vb.clone()],
        };
        let (a, b) = (&hosts.names[0], &hosts.names[1]);
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", a])?;
        ip(&["link", "set", &vb, "netns", b])?;
        for (ns, dev, addr) in [(a, &va, &hosts.addrs[0]), (b, &vb, &hosts.addrs[1])] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// `kvxfer args…` inside host `i`.
    fn kvxfer(&self, i: usize, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[i], kvxfer()])
            .args(args)
            .env("UCX_TLS", "tcp,self");
        c
    }
}

impl Hosts {
    /// `kvxfer serve` over UCX in host 0 on `port`, returned once it says it is serving.
    fn serve(&self, port: &str, shape: &[&str]) -> std::process::Child {
        let mut server = self
            .kvxfer(
                0,
                &["serve", "--transport", "ucx", "--host", &self.addrs[0]],
            )
            .args(["--port", port, "--duration", "300"])
            .args(shape)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start serve");
        let mut out = std::io::BufReader::new(server.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(line.contains("serving"), "{line}");
        server
    }
}

/// Two hosts for a UCX test, or `None` (the reason printed) when this build lacks UCX or
/// namespaces cannot be made here.
fn ucx_hosts(tag: char) -> Option<Hosts> {
    let probe = Command::new(kvxfer())
        .args(["bench", "--transport", "ucx", "--requests", "0"])
        .output()
        .expect("run kvxfer");
    let probe = String::from_utf8_lossy(&probe.stderr).into_owned();
    if !probe.contains("must be positive") {
        println!("SKIP [two hosts] UCX transport: {}", probe.trim());
        return None;
    }
    Hosts::new(tag)
        .map_err(|e| println!("SKIP [two hosts] cannot create network namespaces: {e}"))
        .ok()
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

#[test]
fn pull_and_push_between_two_hosts_over_ucx_tcp() {
    let Some(hosts) = ucx_hosts('p') else {
        return;
    };
    for (mode, port) in [("pull", "5600"), ("push", "5601")] {
        // Push: both sides derive the source blocks from tokens and seed.
        let shape = [
            "--num-blocks",
            "8",
            "--tp",
            "1:2",
            "--mode",
            mode,
            "--tokens",
            "64",
        ];
        let mut server = hosts.serve(port, &shape);
        let connect = format!("{}:{port}", hosts.addrs[0]);
        let bench = hosts
            .kvxfer(1, &["bench", "--transport", "ucx", "--connect", &connect])
            .args(["--requests", "3", "--warmup", "1"])
            .args(shape)
            .output()
            .expect("run bench");
        let _ = server.kill();
        let _ = server.wait();
        let text = String::from_utf8_lossy(&bench.stdout);
        assert!(
            bench.status.success() && text.contains("all correct"),
            "{mode}: {text}\n{}",
            String::from_utf8_lossy(&bench.stderr)
        );
        println!("{text}");
    }
}

/// The link between the hosts is cut in the middle of a long run: TCP keeps retrying and UCX
/// does not notice, so the decode's transfer timeout (5 s here) cancels the pending READ and
/// fails its request — the run exits with that error instead of hanging; the server
/// survives, and once the link is back a new run is served with every byte right.
#[test]
fn link_cut_fails_requests_then_service_recovers() {
    let Some(hosts) = ucx_hosts('c') else {
        return;
    };
    let port = "5610";
    let shape = ["--num-blocks", "64", "--tokens", "512"];
    let mut server = hosts.serve(port, &shape);
    let connect = format!("{}:{port}", hosts.addrs[0]);
    let mut long = hosts
        .kvxfer(1, &["bench", "--transport", "ucx", "--connect", &connect])
        .args([
            "--requests",
            "1000000",
            "--warmup",
            "1",
            "--transfer-timeout",
            "5",
        ])
        .args(shape)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the long run");
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(
        long.try_wait().unwrap().is_none(),
        "the long run ended before the cut"
    );
    let cut = std::time::Instant::now();
    ip(&["-n", &hosts.names[1], "link", "set", &hosts.devs[1], "down"]).unwrap();
    let status = loop {
        if let Some(s) = long.try_wait().unwrap() {
            break s;
        }
        assert!(
            cut.elapsed() < std::time::Duration::from_secs(120),
            "the decode still runs 120 s after the link was cut"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut long.stderr.take().unwrap(), &mut err).unwrap();
    println!(
        "after the cut: exit {status:?} in {:?}: {}",
        cut.elapsed(),
        err.trim()
    );
    assert!(
        !status.success(),
        "a run whose link was cut reported success"
    );
    ip(&["-n", &hosts.names[1], "link", "set", &hosts.devs[1], "up"]).unwrap();
    let again = hosts
        .kvxfer(1, &["bench", "--transport", "ucx", "--connect", &connect])
        .args(["--requests", "3", "--warmup", "1"])
        .args(shape)
        .output()
        .expect("run again");
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&again.stdout);
    assert!(
        again.status.success() && text.contains("all correct"),
        "after the link came back: {text}\n{}",
        String::from_utf8_lossy(&again.stderr)
    );
}
