//! The `kvxfer` command line (part of the binary, not the library): clap's definitions of
//! the subcommands and their flags, and the parsers of flag values.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvxfer::bench::{BenchConfig, Memory, Mode};
use kvxfer::models::ModelShape;
use kvxfer::transports::TransportKind;
use kvxfer_layout::{BlockOrder, CacheKind};

#[derive(Parser)]
#[command(
    name = "kvxfer",
    version,
    about = "Moves KV-cache blocks between prefill and decode engines"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Read settings from a TOML file: keys are the long flag names (`tokens = 2048`,
    /// `tp = "1:2"`), in a `[bench]`/`[serve]`/`[inspect]` table or at the top level; flags on
    /// the command line win. See kvxfer.example.toml.
    #[arg(long, global = true, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// The NIXL runtime (`libnixl_capi.so`) the `nixl` transport opens. Without it:
    /// `KVXFER_NIXL_LIBRARY`, else the NIXL wheel of the active Python environment
    /// (`VIRTUAL_ENV`), else the loader's path.
    #[arg(long, global = true, value_name = "FILE")]
    pub(crate) nixl_library: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Order {
    /// [heads, tokens, head_dim] inside a block (vLLM's layout for heterogeneous TP).
    Hnd,
    /// [tokens, heads, head_dim] inside a block (SGLang's layout).
    Nhd,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum CacheArg {
    /// The model's own: split K/V regions per layer, or MLA's latent.
    Model,
    /// One region per layer, K and V packed per head and token (vLLM 0.32's default).
    PackedKv,
    /// One region for all layers, each block holding every layer's packed page (vLLM's
    /// BLHNC with `--order hnd`, BLNHC with `--order nhd`).
    CrossLayer,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum MemoryArg {
    /// Host (CPU) memory.
    Host,
    /// Host memory in kvxfer shared memory: a same-host UCX peer maps it and copies.
    SharedHost,
    /// GPU memory: not supported by `bench` yet (refused with a message).
    Gpu,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ModeArg {
    /// Decode READs from prefill (vLLM's NIXL connector style).
    Pull,
    /// Prefill WRITEs into decode (SGLang's style).
    Push,
}

impl From<MemoryArg> for Memory {
    fn from(m: MemoryArg) -> Memory {
        match m {
            MemoryArg::Host => Memory::Host,
            MemoryArg::SharedHost => Memory::SharedHost,
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

/// Fleet discovery through etcd (`bench` finds its prefill, `serve` registers it).
#[derive(Args)]
pub(crate) struct DiscoveryArgs {
    /// Find (bench) or register (serve) the prefill through etcd at
    /// etcd://HOST:PORT[,HOST:PORT...] (kvxfer built with `--features etcd`; in push mode the
    /// decode's rooms learn the prefill's ranks and liveness from etcd).
    #[arg(long)]
    pub(crate) discovery: Option<String>,
    /// With --discovery: the prefill engine's id (serve: its own; bench: the one to read).
    #[arg(long)]
    pub(crate) engine_id: Option<String>,
    /// With --discovery: the fleet's name; engines only see their own cluster.
    #[arg(long, default_value = "default")]
    pub(crate) cluster: String,
    /// With --discovery: seconds a registration outlives a process that died (serve).
    #[arg(long, default_value_t = 10)]
    pub(crate) lease_ttl: u64,
}

impl DiscoveryArgs {
    /// The bench's discovery settings, if asked for.
    pub(crate) fn config(self) -> Option<kvxfer::bench::DiscoveryConfig> {
        let url = self.discovery?;
        Some(kvxfer::bench::DiscoveryConfig {
            url,
            cluster: self.cluster,
            engine_id: self.engine_id.unwrap_or_default(),
            ttl: std::time::Duration::from_secs(self.lease_ttl),
        })
    }
}

/// The cache shape every subcommand takes.
#[derive(Args)]
pub(crate) struct Shape {
    /// Model preset: llama-3-8b, llama-3-70b or deepseek-v3.
    #[arg(long, default_value = "llama-3-8b")]
    pub(crate) model: ModelShape,
    /// Tensor parallelism as PREFILL:DECODE, e.g. 2:4.
    #[arg(long, default_value = "1:1", value_parser = parse_tp)]
    pub(crate) tp: (u32, u32),
    /// In-block order of the caches.
    #[arg(long, value_enum, default_value = "hnd")]
    pub(crate) order: Order,
    /// How the cache stores K and V: the model's own (split K/V, or MLA), or one of vLLM's
    /// layouts for attention models.
    #[arg(long, value_enum, default_value = "model")]
    pub(crate) cache: CacheArg,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_size: u32,
}

/// What `bench` and `serve` both take: the engines' caches and the requests moved between
/// them. A `serve` in push mode writes what its decode asks for, so its tokens, seed and
/// `--contiguous` must be the decode's.
#[derive(Args)]
pub(crate) struct Workload {
    #[command(flatten)]
    pub(crate) shape: Shape,
    /// Pipeline stages on the prefill side (push mode), layers split as evenly as possible.
    #[arg(long, default_value_t = 1)]
    pub(crate) pp: u32,
    /// Blocks per region (raised to fit the requests in flight).
    #[arg(long, default_value_t = 256)]
    pub(crate) num_blocks: u32,
    /// Tokens per request.
    #[arg(long, default_value_t = 2048)]
    pub(crate) tokens: u32,
    /// Use consecutive block ids instead of scattered ones.
    #[arg(long)]
    pub(crate) contiguous: bool,
    /// Memory the caches live in (shared-host: for same-host UCX peers).
    #[arg(long, value_enum, default_value = "host")]
    pub(crate) memory: MemoryArg,
    /// Transfer style: pull (the decode READs) or push (the prefill WRITEs each room a
    /// decode asks for).
    #[arg(long, value_enum, default_value = "pull")]
    pub(crate) mode: ModeArg,
    /// Seed of the block choice.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    #[command(flatten)]
    pub(crate) discovery: DiscoveryArgs,
}

impl Workload {
    /// The bench these flags describe over `transport`, one request at a time with nothing
    /// before it (what `serve` runs; `bench` sizes its own run on it): the one place a
    /// `BenchConfig` is built from flags.
    pub(crate) fn config(self, transport: TransportKind) -> Result<BenchConfig, String> {
        let Shape {
            model,
            tp,
            order,
            cache,
            block_size,
        } = self.shape;
        Ok(BenchConfig {
            model: with_cache(model, cache)?,
            order: block_order(order),
            prefill_tp: tp.0,
            decode_tp: tp.1,
            prefill_pp: self.pp,
            block_size,
            num_blocks: self.num_blocks,
            requests: 1,
            tokens_per_request: self.tokens,
            concurrency: 1,
            warmup: 0,
            fragmented: !self.contiguous,
            transport,
            memory: self.memory.into(),
            mode: self.mode.into(),
            seed: self.seed,
            connect: None,
            transfer_timeout: std::time::Duration::from_secs(30),
            raw_posts: false,
            keep_going: false,
            digest: false,
            discovery: self.discovery.config(),
        })
    }
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run a prefill and a decode engine in one process, move a batch of requests, verify
    /// every byte, and print throughput, latency and the ratios to memcpy of the same bytes and
    /// to the machine's copy ceiling.
    #[command(args_override_self = true)]
    Bench {
        #[command(flatten)]
        workload: Workload,
        /// Measured requests.
        #[arg(long, default_value_t = 16)]
        requests: u32,
        /// Requests in flight at once.
        #[arg(long, default_value_t = 1)]
        concurrency: u32,
        /// Unmeasured requests first (the first includes the handshake).
        #[arg(long, default_value_t = 2)]
        warmup: u32,
        /// Transport: loopback, ucx or nixl (only those compiled in).
        #[arg(long, default_value = "loopback")]
        transport: TransportKind,
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
        /// Content digests on (pull: the prefill digests each held block; push: each chunk
        /// before its WRITE; the decode checks what it received), run after the same bench
        /// with them off: both throughputs, their ratio, and one thread's digest rate over the
        /// same bytes.
        #[arg(long)]
        digest: bool,
    },
    /// Serve a prefill engine for `kvxfer bench --connect` in another process or host: fills
    /// its caches and serves them until Ctrl-C (or `--duration`): answers reads in pull mode,
    /// writes every room a decode asks for in push mode.
    #[command(args_override_self = true)]
    Serve {
        #[command(flatten)]
        workload: Workload,
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
        /// Transport (one that crosses processes: ucx or nixl).
        #[arg(long, default_value = "nixl")]
        transport: TransportKind,
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
pub(crate) enum SweepParam {
    Tokens,
    BlockSize,
}

pub(crate) fn parse_sweep(s: &str) -> Result<(SweepParam, Vec<u32>), String> {
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

pub(crate) fn parse_addr(s: &str) -> Result<(String, u16), String> {
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

pub(crate) fn parse_tp(s: &str) -> Result<(u32, u32), String> {
    let (p, d) = s
        .split_once(':')
        .ok_or_else(|| format!("expected PREFILL:DECODE, got {s:?}"))?;
    let parse = |v: &str| v.trim().parse::<u32>().map_err(|e| format!("{v:?}: {e}"));
    Ok((parse(p)?, parse(d)?))
}

/// The model with the cache kind asked for, or why that kind does not fit it.
pub(crate) fn with_cache(model: ModelShape, cache: CacheArg) -> Result<ModelShape, String> {
    let kind = match cache {
        CacheArg::Model => return Ok(model),
        CacheArg::PackedKv => CacheKind::PackedKv,
        CacheArg::CrossLayer => CacheKind::CrossLayer,
    };
    model.with_kind(kind).map_err(|e| e.to_string())
}

pub(crate) fn block_order(o: Order) -> BlockOrder {
    match o {
        Order::Hnd => BlockOrder::Hnd,
        Order::Nhd => BlockOrder::Nhd,
    }
}
