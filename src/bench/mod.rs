//! `kvxfer bench`: a prefill engine and a decode engine in one process, moving batches of
//! requests over a transport and verifying every byte, measured in the same run against
//! single-thread memcpy of the same bytes and the machine's copy ceiling (all cores,
//! streaming stores) for the same piece size.

mod blocks;
pub mod chart;
mod config;
mod discovery;
mod fill;
mod pull;
mod push;
mod rank;
mod report;
mod timing;

use crate::transports::TransportKind;
pub use config::{BenchConfig, BenchError, Memory, Mode};
pub use discovery::DiscoveryConfig;
pub use report::BenchReport;

/// Runs the bench. `progress(done, total)` is called as requests finish.
pub fn run(c: &BenchConfig, progress: &mut dyn FnMut(u32, u32)) -> Result<BenchReport, BenchError> {
    crate::transports::availability(c.transport)?;
    if c.memory == Memory::Gpu {
        return Err(BenchError::Config(
            "GPU memory in `bench` is not supported yet; use --memory host (the loopback's GPU path is compiled with `--features cuda` but has not run on a GPU yet)".into(),
        ));
    }
    if c.requests == 0 || c.concurrency == 0 || c.tokens_per_request == 0 || c.block_size == 0 {
        return Err(BenchError::Config(
            "requests, concurrency, tokens per request and block size must be positive".into(),
        ));
    }
    if let Some(d) = &c.discovery {
        discovery::check(d, c.connect.is_some())?;
    }
    if c.connect.is_some() || c.discovery.is_some() {
        in_process_only(c)?;
    }
    if c.digest {
        return with_and_without_digests(c, progress);
    }
    run_mode(c, progress)
}

/// One run of the bench in its mode.
fn run_mode(
    c: &BenchConfig,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<BenchReport, BenchError> {
    match c.mode {
        Mode::Push => push::run(c, progress),
        Mode::Pull => pull::run(c, progress),
    }
}

/// `--digest`: the same bench without content digests, then with them; the report is the
/// second run's, with the first's throughput and their ratio.
fn with_and_without_digests(
    c: &BenchConfig,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<BenchReport, BenchError> {
    if c.mode == Mode::Pull && (c.connect.is_some() || c.discovery.is_some()) {
        return Err(BenchError::Config(
            "--digest in pull mode runs both engines here (a served prefill holds no request to digest)".into(),
        ));
    }
    let off = run_mode(
        &BenchConfig {
            digest: false,
            ..c.clone()
        },
        progress,
    )?;
    let mut on = run_mode(c, progress)?;
    on.digest_off_gb_per_s = off.gb_per_s;
    on.digest_on_to_off = on.gb_per_s / off.gb_per_s.max(1e-9);
    Ok(on)
}

/// `kvxfer serve --role prefill`: fills a prefill engine's caches, listens on `port` (rank r
/// on `port + r`) and answers reads until `stop` is set. Decode processes run
/// `kvxfer bench --connect HOST:PORT` with the same model, TP, block size and blocks.
pub fn serve(
    c: &BenchConfig,
    host: &str,
    port: u16,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), BenchError> {
    crate::transports::availability(c.transport)?;
    in_process_only(c)?;
    if let Some(d) = &c.discovery {
        discovery::check(d, false)?;
        discovery::check_registered_host(host)?;
    }
    if c.mode == Mode::Push {
        return push::serve(c, host, port, stop);
    }
    pull::serve(c, host, port, stop)
}

/// The loopback's agents live in one process: refuse it for runs that span processes.
fn in_process_only(c: &BenchConfig) -> Result<(), BenchError> {
    if c.transport == TransportKind::Loopback {
        return Err(BenchError::Config(
            "the loopback transport cannot cross processes; use --transport ucx or nixl".into(),
        ));
    }
    Ok(())
}
