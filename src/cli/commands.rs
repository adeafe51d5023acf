//! What each `kvxfer` subcommand does (part of the binary): the configurations built from
//! the flags, `serve`, `bench` (one run or a sweep, with its table, JSON and chart) and
//! `inspect`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use kvxfer::bench::{BenchConfig, Mode};
use kvxfer::inspect::{InspectConfig, report};

use super::args::{Command, Shape, SweepParam, block_order, with_cache};

/// Runs one subcommand; the exit code says how it went (2: refused or failed).
pub(crate) fn run(command: Command) -> ExitCode {
    match command {
        Command::Serve {
            workload,
            role,
            host,
            port,
            duration,
            transport,
        } => {
            let config = match workload.config(transport) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            if role != "prefill" {
                eprintln!(
                    "error: only `--role prefill` serves; run the decode side with `kvxfer bench --connect HOST:PORT`"
                );
                return ExitCode::from(2);
            }
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let flag = std::sync::Arc::clone(&stop);
            let _ =
                ctrlc::set_handler(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
            if let Some(secs) = duration {
                let flag = std::sync::Arc::clone(&stop);
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_secs(secs));
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                });
            }
            match kvxfer::bench::serve(&config, &host, port, &stop) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Bench {
            workload,
            requests,
            concurrency,
            warmup,
            transport,
            json,
            sweep,
            chart,
            connect,
            transfer_timeout,
            raw_posts,
            keep_going,
            digest,
        } => {
            let base = match workload.config(transport) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            let config = BenchConfig {
                requests,
                concurrency,
                warmup,
                connect,
                transfer_timeout: std::time::Duration::from_secs(transfer_timeout),
                raw_posts,
                keep_going,
                digest,
                ..base
            };
            match sweep {
                None => bench(&config, json),
                Some((param, values)) => sweep_bench(&config, param, &values, json, &chart),
            }
        }
        Command::Inspect {
            shape:
                Shape {
                    model,
                    tp,
                    order,
                    cache,
                    block_size,
                },
            pp,
            num_blocks,
            request_blocks,
        } => {
            let model = match with_cache(model, cache) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            let config = InspectConfig {
                model,
                order: block_order(order),
                prefill_tp: tp.0,
                decode_tp: tp.1,
                prefill_pp: pp,
                tokens_per_block: block_size,
                num_blocks,
                request_blocks,
            };
            match report(&config) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

fn bench(config: &BenchConfig, json: Option<PathBuf>) -> ExitCode {
    let show = std::io::stderr().is_terminal();
    let mut progress = |done: u32, total: u32| {
        if show {
            let width = 30;
            let filled = (done as usize * width) / total.max(1) as usize;
            eprint!(
                "\r  [{}{}] {done}/{total} requests",
                "#".repeat(filled),
                " ".repeat(width - filled)
            );
            if done == total {
                eprintln!();
            }
        }
    };
    match kvxfer::bench::run(config, &mut progress) {
        Ok(report) => {
            print!("{}", report.table());
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report).unwrap_or_default();
                if let Err(e) = std::fs::write(&path, text) {
                    eprintln!("error: cannot write {}: {e}", path.display());
                    return ExitCode::from(2);
                }
            }
            ExitCode::SUCCESS
        }
        Err(e @ kvxfer::bench::BenchError::Verification(_)) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn sweep_bench(
    base: &BenchConfig,
    param: SweepParam,
    values: &[u32],
    json: Option<PathBuf>,
    chart: &std::path::Path,
) -> ExitCode {
    let mut reports = Vec::new();
    let label = match param {
        SweepParam::Tokens => "tokens per request",
        SweepParam::BlockSize => "tokens per block",
    };
    for &v in values {
        let mut c = base.clone();
        match param {
            SweepParam::Tokens => c.tokens_per_request = v,
            SweepParam::BlockSize => c.block_size = v,
        }
        println!("{label} = {v}");
        match kvxfer::bench::run(&c, &mut |_, _| {}) {
            Ok(r) => {
                print!("{}", r.table());
                reports.push((v, r));
            }
            Err(e) => {
                eprintln!("error at {label} = {v}: {e}");
                return ExitCode::from(
                    if matches!(e, kvxfer::bench::BenchError::Verification(_)) {
                        1
                    } else {
                        2
                    },
                );
            }
        }
    }
    let points: Vec<(f64, f64)> = reports
        .iter()
        .map(|(v, r)| (f64::from(*v), r.gb_per_s))
        .collect();
    let title = format!(
        "{} {} over {}: throughput vs {label}",
        base.model.name,
        if base.mode == Mode::Pull {
            "pull"
        } else {
            "push"
        },
        base.transport
    );
    if let Err(e) = std::fs::write(chart, kvxfer::bench::chart::svg(&title, label, &points)) {
        eprintln!("error: cannot write {}: {e}", chart.display());
        return ExitCode::from(2);
    }
    println!("chart written to {}", chart.display());
    if let Some(path) = json {
        let all: Vec<&kvxfer::bench::BenchReport> = reports.iter().map(|(_, r)| r).collect();
        if let Err(e) = std::fs::write(
            &path,
            serde_json::to_string_pretty(&all).unwrap_or_default(),
        ) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}
