//! Helper process for cross-process tests: one UCX agent driven over stdin/stdout by
//! `kvxfer_tests::remote::RemoteAgent`.
//!
//! Usage: `kvxfer-test-agent ucx <UCX_TLS value> <agent name>`

use kvxfer_transport_ucx::{UcxConfig, UcxTransport};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [kind, tls, name] = args.as_slice() else {
        eprintln!("usage: kvxfer-test-agent ucx <UCX_TLS> <name>");
        std::process::exit(2);
    };
    if kind != "ucx" {
        eprintln!("kvxfer-test-agent: unknown transport {kind:?}");
        std::process::exit(2);
    }
    let config = UcxConfig {
        tls: Some(tls.clone()),
        keepalive_interval: std::time::Duration::from_millis(200),
        ..UcxConfig::default()
    };
    match UcxTransport::with_config(name, config) {
        Ok(t) => kvxfer_tests::remote::serve(t),
        Err(e) => {
            eprintln!("kvxfer-test-agent: {e}");
            std::process::exit(1);
        }
    }
}
