//! Helpers the CLI tests share: running `kvxfer`, probing a transport, starting `serve`.
#![allow(dead_code)]

use std::process::Command;

pub fn kvxfer(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer"))
        .args(args)
        .output()
        .expect("run kvxfer");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether this build and machine can run `transport` (an argument check is reached);
/// otherwise prints the skip for `what` and returns false.
pub fn runnable(transport: &str, what: &str) -> bool {
    let (_, _, probe) = kvxfer(&["bench", "--transport", transport, "--requests", "0"]);
    let ok = probe.contains("must be positive");
    if !ok {
        println!("SKIP [{transport}] {what}: {}", probe.trim());
    }
    ok
}

/// `kvxfer serve` over `transport` on a free port, returned once it says it is serving.
pub fn spawn_serve(
    transport: &str,
    args: &[&str],
    key: Option<&str>,
) -> (std::process::Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    (serve_on(transport, &port, args, key), port)
}

/// `kvxfer serve` over `transport` on `port`, returned once it says it is serving.
pub fn serve_on(
    transport: &str,
    port: &str,
    args: &[&str],
    key: Option<&str>,
) -> std::process::Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvxfer"));
    cmd.args(["serve", "--transport", transport, "--port", port])
        .args(["--duration", "120"])
        .args(args)
        .stdout(std::process::Stdio::piped());
    if let Some(k) = key {
        cmd.env("KVXFER_SIDE_CHANNEL_KEY", k);
    }
    let mut server = cmd.spawn().expect("start serve");
    let mut out = std::io::BufReader::new(server.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert!(line.contains("serving"), "{line}");
    server
}
