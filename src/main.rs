//! The `kvxfer` command.

mod config_file;

use std::process::ExitCode;

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use kvxfer::bench::{BenchConfig, Memory, Mode};
use kvxfer::inspect::{InspectConfig, report};
use kvxfer::models::ModelShape;
use kvxfer::transports::TransportKind;
use kvxfer_layout::BlockOrder;

#[derive(Parser)]
#[command(
    name = "kvxfer",
    version,
    about = "Moves KV-cache blocks between prefill and decode engines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Read settings from a TOML file: keys are the long flag names (`tokens = 2048`,
    /// `tp = "1:2"`), in a `[bench]`/`[serve]`/`[inspect]` table or at the top level; flags on
    /// the command line win. See kvxfer.example.toml.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Order {
    /// [heads, tokens, head_dim] inside a block (vLLM's layout for heterogeneous TP).
    Hnd,
    /// [tokens, heads, head_dim] inside a block (SGLang's layout).
    Nhd,
}

#[derive(Clone, Copy, ValueEnum)]
enum MemoryArg {
    /// Host (CPU) memory.
    Host,
    /// GPU memory: not supported by `bench` yet (refused with a message).
    Gpu,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    /// Decode READs from prefill (vLLM's NIXL connector style).
    Pull,
    /// Prefill WRITEs into decode (SGLang's style).
    Push,
}

impl From<MemoryArg> for Memory {
    fn from(m: MemoryArg) -> Memory {
        match m {
            MemoryArg::Host => Memory::Host,
            MemoryArg::Gpu => Memory::Gpu,
        }
    }
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Pull => Mode::Pull,
            ModeArg::Push => Mode::Push,
        }
    }
}

/// The cache shape every subcommand takes.
#[derive(Args)]
struct Shape {
    /// Model preset: llama-3-8b, llama-3-70b or deepseek-v3.
    #[arg(long, default_value = "llama-3-8b")]
    model: ModelShape,
    /// Tensor parallelism as PREFILL:DECODE, e.g. 2:4.
    #[arg(long, default_value = "1:1", value_parser = parse_tp)]
    tp: (u32, u32),
    /// In-block order of the caches.
    #[arg(long, value_enum, default_value = "hnd")]
    order: Order,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
}

#[derive(Subcommand)]
enum Command {
    /// Run a prefill and a decode engine in one process, move a batch of requests, verify
    /// every byte, and print throughput, latency and the ratio to memcpy of the same bytes.
    #[command(args_override_self = true)]
    Bench {
        #[command(flatten)]
        shape: Shape,
        /// Pipeline stages on the prefill side (push mode), layers split as evenly as possible.
        #[arg(long, default_value_t = 1)]
        pp: u32,
        /// Blocks per region (raised to fit the requests in flight).
        #[arg(long, default_value_t = 256)]
        num_blocks: u32,
        /// Measured requests.
        #[arg(long, default_value_t = 16)]
        requests: u32,
        /// Tokens per request.
        #[arg(long, default_value_t = 2048)]
        tokens: u32,
        /// Requests in flight at once.
        #[arg(long, default_value_t = 1)]
        concurrency: u32,
        /// Unmeasured requests first (the first includes the handshake).
        #[arg(long, default_value_t = 2)]
        warmup: u32,
        /// Use consecutive block ids instead of scattered ones.
        #[arg(long)]
        contiguous: bool,
        /// Transport: loopback, ucx or nixl (only those compiled in).
        #[arg(long, default_value = "loopback")]
        transport: TransportKind,
        /// Memory the caches live in.
        #[arg(long, value_enum, default_value = "host")]
        memory: MemoryArg,
        /// Transfer style.
        #[arg(long, value_enum, default_value = "pull")]
        mode: ModeArg,
        /// Seed of the block choice.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Also write the results as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Run once per value of a parameter, e.g. `tokens=512,2048,8192` or
        /// `block-size=16,32,64`, and write a chart of throughput against it.
        #[arg(long, value_parser = parse_sweep)]
        sweep: Option<(SweepParam, Vec<u32>)>,
        /// Where `--sweep` writes its chart (SVG).
        #[arg(long, default_value = "kvxfer-sweep.svg")]
        chart: PathBuf,
        /// Decode only: use a prefill run by `kvxfer serve` at HOST:PORT (same model, TP,
        /// block size and blocks on both sides, and for push the same mode, tokens, seed and
        /// --contiguous; a transport that crosses processes).
        #[arg(long, value_parser = parse_addr)]
        connect: Option<(String, u16)>,
        /// Pull: seconds a READ may stay pending before it is cancelled and its request fails
        /// (a cut link can leave transfers pending for as long as TCP retries).
        #[arg(long, default_value_t = 30)]
        transfer_timeout: u64,
        /// Pull: post every request as a coalesced plan of raw descriptors, even on a
        /// transport that prefers per-block prepared lists (NIXL), to compare the two.
        #[arg(long)]
        raw_posts: bool,
        /// Pull: count a failed request and go on (for a prefill that restarts during the
        /// run); without it the first failure ends the run. Successes are still verified.
        #[arg(long)]
        keep_going: bool,
    },
    /// Serve a prefill engine for `kvxfer bench --connect` in another process or host: fills
    /// its caches and serves them until Ctrl-C (or `--duration`): answers reads in pull mode,
    /// writes every room a decode asks for in push mode.
    #[command(args_override_self = true)]
    Serve {
        #[command(flatten)]
        shape: Shape,
        /// Role of this process (only `prefill` serves).
        #[arg(long, default_value = "prefill")]
        role: String,
        /// Address the side channel binds (loopback by default; e.g. 0.0.0.0 to serve other
        /// hosts, an explicit choice).
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Side-channel base port (pull: rank r listens on PORT + r; push: the bootstrap
        /// registry listens on PORT, the ranks' mailboxes on ephemeral ports).
        #[arg(long, default_value_t = 5600)]
        port: u16,
        /// Stop after this many seconds (default: until Ctrl-C).
        #[arg(long)]
        duration: Option<u64>,
        /// Blocks per region.
        #[arg(long, default_value_t = 256)]
        num_blocks: u32,
        /// Transport (one that crosses processes: ucx or nixl).
        #[arg(long, default_value = "nixl")]
        transport: TransportKind,
        /// Transfer style the decode side will use (`bench --mode`): pull serves READs,
        /// push WRITEs each room a decode asks for.
        #[arg(long, value_enum, default_value = "pull")]
        mode: ModeArg,
        /// Push: tokens per request (as the decode's `--tokens`).
        #[arg(long, default_value_t = 2048)]
        tokens: u32,
        /// Push: pipeline stages of the prefill.
        #[arg(long, default_value_t = 1)]
        pp: u32,
        /// Push: consecutive source blocks (as the decode's `--contiguous`).
        #[arg(long)]
        contiguous: bool,
        /// Push: seed of the source block choice (as the decode's `--seed`).
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Print the cache spec, regions, TP mapping and a sample transfer plan of a configuration.
    #[command(args_override_self = true)]
    Inspect {
        #[command(flatten)]
        shape: Shape,
        /// Pipeline stages on the prefill side.
        #[arg(long, default_value_t = 1)]
        pp: u32,
        /// Blocks per region.
        #[arg(long, default_value_t = 4096)]
        num_blocks: u32,
        /// Blocks in the sample request.
        #[arg(long, default_value_t = 128)]
        request_blocks: u32,
    },
}

/// A parameter `--sweep` varies.
#[derive(Clone, Copy, Debug)]
enum SweepParam {
    Tokens,
    BlockSize,
}

fn parse_sweep(s: &str) -> Result<(SweepParam, Vec<u32>), String> {
    let (name, values) = s
        .split_once('=')
        .ok_or_else(|| format!("expected PARAM=V1,V2,..., got {s:?}"))?;
    let param = match name {
        "tokens" => SweepParam::Tokens,
        "block-size" => SweepParam::BlockSize,
        other => {
            return Err(format!(
                "unknown sweep parameter {other:?} (tokens, block-size)"
            ));
        }
    };
    let values: Vec<u32> = values
        .split(',')
        .map(|v| v.trim().parse::<u32>().map_err(|e| format!("{v:?}: {e}")))
        .collect::<Result<_, _>>()?;
    if values.is_empty() || values.len() > 64 {
        return Err("a sweep takes 1 to 64 values".into());
    }
    Ok((param, values))
}

fn parse_addr(s: &str) -> Result<(String, u16), String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("expected HOST:PORT, got {s:?}"))?;
    let port = port
        .parse::<u16>()
        .map_err(|e| format!("port {port:?}: {e}"))?;
    if host.is_empty() {
        return Err("empty host".into());
    }
    Ok((
        host.trim_matches(|c| c == '[' || c == ']').to_string(),
        port,
    ))
}

fn parse_tp(s: &str) -> Result<(u32, u32), String> {
    let (p, d) = s
        .split_once(':')
        .ok_or_else(|| format!("expected PREFILL:DECODE, got {s:?}"))?;
    let parse = |v: &str| v.trim().parse::<u32>().map_err(|e| format!("{v:?}: {e}"));
    Ok((parse(p)?, parse(d)?))
}

fn main() -> ExitCode {
    let args = match config_file::expand(std::env::args_os().collect(), &Cli::command()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let cli = Cli::parse_from(args);
    // Logs go to stderr, filtered by RUST_LOG (warnings by default).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    match cli.command {
        Command::Serve {
            shape:
                Shape {
                    model,
                    tp,
                    order,
                    block_size,
                },
            role,
            host,
            port,
            duration,
            num_blocks,
            transport,
            mode,
            tokens,
            pp,
            contiguous,
            seed,
        } => {
            if role != "prefill" {
                eprintln!(
                    "error: only `--role prefill` serves; run the decode side with `kvxfer bench --connect HOST:PORT`"
                );
                return ExitCode::from(2);
            }
            let config = BenchConfig {
                model,
                order: block_order(order),
                prefill_tp: tp.0,
                decode_tp: tp.1,
                prefill_pp: pp,
                block_size,
                num_blocks,
                requests: 1,
                tokens_per_request: tokens,
                concurrency: 1,
                warmup: 0,
                fragmented: !contiguous,
                transport,
                memory: Memory::Host,
                mode: mode.into(),
                seed,
                connect: None,
                transfer_timeout: std::time::Duration::from_secs(30),
                raw_posts: false,
                keep_going: false,
            };
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
            shape:
                Shape {
                    model,
                    tp,
                    order,
                    block_size,
                },
            pp,
            num_blocks,
            requests,
            tokens,
            concurrency,
            warmup,
            contiguous,
            transport,
            memory,
            mode,
            seed,
            json,
            sweep,
            chart,
            connect,
            transfer_timeout,
            raw_posts,
            keep_going,
        } => {
            let config = BenchConfig {
                model,
                order: block_order(order),
                prefill_tp: tp.0,
                decode_tp: tp.1,
                prefill_pp: pp,
                block_size,
                num_blocks,
                requests,
                tokens_per_request: tokens,
                concurrency,
                warmup,
                fragmented: !contiguous,
                transport,
                memory: memory.into(),
                mode: mode.into(),
                seed,
                connect,
                transfer_timeout: std::time::Duration::from_secs(transfer_timeout),
                raw_posts,
                keep_going,
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
                    block_size,
                },
            pp,
            num_blocks,
            request_blocks,
        } => {
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

fn block_order(o: Order) -> BlockOrder {
    match o {
        Order::Hnd => BlockOrder::Hnd,
        Order::Nhd => BlockOrder::Nhd,
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
