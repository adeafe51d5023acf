//! The `kvxfer` command.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use kvxfer::inspect::{InspectConfig, report};
use kvxfer::models::ModelShape;
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
}

#[derive(Clone, Copy, ValueEnum)]
enum Order {
    /// [heads, tokens, head_dim] inside a block (vLLM's layout for heterogeneous TP).
    Hnd,
    /// [tokens, heads, head_dim] inside a block (SGLang's layout).
    Nhd,
}

#[derive(Subcommand)]
enum Command {
    /// Print the cache spec, regions, TP mapping and a sample transfer plan of a configuration.
    Inspect {
        /// Model preset: llama-3-8b, llama-3-70b or deepseek-v3.
        #[arg(long, default_value = "llama-3-8b")]
        model: ModelShape,
        /// Tensor parallelism as PREFILL:DECODE, e.g. 2:4.
        #[arg(long, default_value = "1:1", value_parser = parse_tp)]
        tp: (u32, u32),
        /// Pipeline stages on the prefill side.
        #[arg(long, default_value_t = 1)]
        pp: u32,
        /// In-block order.
        #[arg(long, value_enum, default_value = "hnd")]
        order: Order,
        /// Tokens per block.
        #[arg(long, default_value_t = 16)]
        block_size: u32,
        /// Blocks per region.
        #[arg(long, default_value_t = 4096)]
        num_blocks: u32,
        /// Blocks in the sample request.
        #[arg(long, default_value_t = 128)]
        request_blocks: u32,
    },
}

fn parse_tp(s: &str) -> Result<(u32, u32), String> {
    let (p, d) = s
        .split_once(':')
        .ok_or_else(|| format!("expected PREFILL:DECODE, got {s:?}"))?;
    let parse = |v: &str| v.trim().parse::<u32>().map_err(|e| format!("{v:?}: {e}"));
    Ok((parse(p)?, parse(d)?))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Inspect {
            model,
            tp,
            pp,
            order,
            block_size,
            num_blocks,
            request_blocks,
        } => {
            let config = InspectConfig {
                model,
                order: match order {
                    Order::Hnd => BlockOrder::Hnd,
                    Order::Nhd => BlockOrder::Nhd,
                },
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
