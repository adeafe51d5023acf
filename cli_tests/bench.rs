//! Runs `kvxfer bench` as a user would, on small shapes, and checks what it prints and writes.

use std::process::Command;

mod common;

use common::{kvxfer, runnable, spawn_serve};

const SMALL: &[&str] = &[
    "bench",
    "--num-blocks",
    "8",
    "--tokens",
    "64",
    "--requests",
    "3",
    "--warmup",
    "1",
];

#[test]
fn bench_prints_the_table_and_writes_json() {
    let dir = std::env::temp_dir().join(format!("kvxfer-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let mut args = SMALL.to_vec();
    let path = json.to_str().unwrap().to_string();
    args.extend(["--json", &path]);
    let (code, out, err) = kvxfer(&args);
    assert_eq!(code, 0, "{err}");
    for field in [
        "throughput",
        "requests/s",
        "latency p50 / p99",
        "descriptors raw -> posted",
        "handshake",
        "first transfer",
        "ratio to memcpy / ceiling",
        "copy ceiling, same pieces",
        "all correct",
    ] {
        assert!(out.contains(field), "missing {field}: {out}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in [
        "gb_per_s",
        "requests_per_s",
        "latency_p50_ms",
        "latency_p99_ms",
        "descriptors_raw",
        "descriptors_posted",
        "handshake_ms",
        "first_transfer_ms",
        "memcpy_gb_per_s",
        "ratio_to_memcpy",
        "ceiling_gb_per_s",
        "ceiling_threads",
        "ceiling_streaming",
        "ratio_to_ceiling",
        "verified_bytes",
    ] {
        assert!(v.get(key).is_some(), "JSON lacks {key}: {v}");
    }
    // The ceiling ran on every core, and the ratio is the one the figures give.
    let cores = std::thread::available_parallelism().unwrap().get() as u64;
    assert_eq!(v["ceiling_threads"].as_u64(), Some(cores));
    let (gb, ceiling) = (
        v["gb_per_s"].as_f64().unwrap(),
        v["ceiling_gb_per_s"].as_f64().unwrap(),
    );
    assert!(ceiling > 0.0, "{v}");
    let ratio = v["ratio_to_ceiling"].as_f64().unwrap();
    assert!((ratio - gb / ceiling).abs() < 1e-9 * ratio.max(1.0), "{v}");
    assert_eq!(v["requests"], 3);
    assert!(v["verified_bytes"].as_u64().unwrap() > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_hetero_tp_and_mla() {
    let mut args = SMALL.to_vec();
    args.extend(["--tp", "2:4", "--order", "nhd"]);
    let (code, out, err) = kvxfer(&args);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("TP 2:4") && out.contains("all correct"),
        "{out}"
    );
    let mut args = SMALL.to_vec();
    args.extend([
        "--model",
        "deepseek-v3",
        "--tp",
        "2:1",
        "--concurrency",
        "2",
    ]);
    let (code, out, err) = kvxfer(&args);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("deepseek-v3"), "{out}");
}

/// `--cache cross-layer`: every byte verified, in both modes and with head slices, and a
/// request posts at most one descriptor per block (all 32 layers of a block are one run),
/// where the model's split K/V cache posts 64 per block before coalescing.
#[test]
fn bench_cross_layer_cache() {
    let dir = std::env::temp_dir().join(format!("kvxfer-cli-cross-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let path = json.to_str().unwrap().to_string();
    for extra in [
        &["--mode", "pull"][..],
        &["--mode", "push"],
        &["--tp", "2:1"],
    ] {
        let mut args = SMALL.to_vec();
        args.extend(["--cache", "cross-layer", "--json", &path]);
        args.extend(extra);
        let (code, out, err) = kvxfer(&args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert!(out.contains("all correct"), "{out}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let (raw, posted) = (
            v["descriptors_raw"].as_u64().unwrap(),
            v["descriptors_posted"].as_u64().unwrap(),
        );
        // 3 requests of 64 tokens: 4 blocks each; 32 layers per block before coalescing.
        let blocks = 3 * 4;
        if extra == ["--tp", "2:1"] {
            // Two prefill ranks each hold half the heads of every layer's page: one piece per
            // layer, block and prefill rank.
            assert_eq!(raw, blocks * 32 * 2, "{v}");
        } else {
            assert_eq!(raw, blocks * 32, "{v}");
            assert!(posted <= blocks, "{extra:?}: {raw} -> {posted}");
        }
    }
    let mut args = SMALL.to_vec();
    args.extend(["--cache", "cross-layer", "--model", "deepseek-v3"]);
    let (code, _, err) = kvxfer(&args);
    assert_eq!(code, 2);
    assert!(err.contains("cannot be stored as cross-layer"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_push_mode() {
    let mut args = SMALL.to_vec();
    args.extend(["--mode", "push", "--tp", "1:2", "--order", "nhd"]);
    let (code, out, err) = kvxfer(&args);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("push mode") && out.contains("all correct"),
        "{out}"
    );
}

#[test]
fn bench_with_digests_reports_both_runs_in_each_mode() {
    for mode in ["pull", "push"] {
        let mut args = SMALL.to_vec();
        args.extend(["--mode", mode, "--tp", "2:1", "--digest"]);
        let (code, out, err) = kvxfer(&args);
        assert_eq!(code, 0, "{mode}: {err}");
        assert!(
            out.contains("digests on / off") && out.contains("all correct"),
            "{mode}: {out}"
        );
    }
}

#[test]
fn bench_errors_are_clear() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "--transport", "tcp"], "unknown transport"),
        (&["bench", "--memory", "gpu"], "GPU memory"),
        (&["bench", "--tp", "3:1"], "not divisible"),
        (&["bench", "--requests", "0"], "must be positive"),
        // Caches larger than the machine: refused before anything is mapped.
        (&["bench", "--num-blocks", "4000000000"], "available"),
        (
            &["bench", "--mode", "push", "--num-blocks", "4000000000"],
            "available",
        ),
    ];
    for (args, needle) in cases {
        let (code, _, err) = kvxfer(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // Transports not in this build name their feature, compiled-in ones without their
    // runtime or implementation say so; available ones reach the argument check. Nothing runs.
    for t in ["ucx", "nixl"] {
        let (code, _, err) = kvxfer(&["bench", "--transport", t, "--requests", "0"]);
        assert_eq!(code, 2, "{t}: {err}");
        let known = [
            format!("--features {t}"),
            "runtime".into(),
            "must be positive".into(),
        ];
        assert!(known.iter().any(|k| err.contains(k.as_str())), "{t}: {err}");
    }
}

/// Pull and push end to end over `transport` (host memory), bytes verified, when this build
/// has the transport and its runtime; otherwise the skip is printed.
fn bench_pull_and_push_over(transport: &str) {
    if !runnable(transport, "bench scenarios") {
        return;
    }
    for (mode, tp, order) in [
        ("pull", "1:2", "hnd"),
        ("pull", "2:1", "nhd"),
        ("push", "1:2", "nhd"),
        ("push", "2:1", "hnd"),
    ] {
        let mut args = SMALL.to_vec();
        args.extend([
            "--transport",
            transport,
            "--mode",
            mode,
            "--tp",
            tp,
            "--order",
            order,
        ]);
        let (code, out, err) = kvxfer(&args);
        assert_eq!(code, 0, "{mode} {tp} over {transport}: {err}");
        assert!(
            out.contains(&format!("over {transport}")) && out.contains("all correct"),
            "{out}"
        );
    }
    let mut args = SMALL.to_vec();
    args.extend([
        "--transport",
        transport,
        "--model",
        "deepseek-v3",
        "--tp",
        "2:1",
    ]);
    let (code, out, err) = kvxfer(&args);
    assert_eq!(code, 0, "MLA over {transport}: {err}");
    assert!(out.contains("all correct"), "{out}");
}

#[test]
fn bench_over_nixl_pull_and_push() {
    bench_pull_and_push_over("nixl");
}

#[test]
fn bench_over_ucx_pull_and_push() {
    bench_pull_and_push_over("ucx");
}

#[test]
fn bench_sweep_writes_a_chart() {
    let dir = std::env::temp_dir().join(format!("kvxfer-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let chart = dir.join("sweep.svg");
    let path = chart.to_str().unwrap().to_string();
    let mut args = SMALL.to_vec();
    args.extend(["--sweep", "tokens=32,64", "--chart", &path]);
    let (code, out, err) = kvxfer(&args);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("tokens per request = 32") && out.contains("tokens per request = 64"),
        "{out}"
    );
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline") && svg.matches("<circle").count() == 2,
        "{svg}"
    );
    let (code, _, err) = kvxfer(&["bench", "--sweep", "colour=1"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown sweep parameter"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn serve_refuses_the_loopback() {
    let (code, _, err) = kvxfer(&["serve", "--transport", "loopback", "--duration", "1"]);
    assert_eq!(code, 2);
    assert!(err.contains("cannot cross processes"), "{err}");
}

#[test]
fn serve_and_bench_in_two_processes_over_nixl() {
    serve_and_bench_in_two_processes("nixl");
}

#[test]
fn serve_and_bench_in_two_processes_over_ucx() {
    serve_and_bench_in_two_processes("ucx");
}

/// `kvxfer serve` in one process, `kvxfer bench --connect` in another, over `transport`;
/// Ctrl-C (SIGINT) ends the server cleanly. Over UCX also with both caches in kvxfer shared
/// memory (same-host copies instead of UCX requests). Skipped with a printed reason where
/// the build or machine lacks the transport.
fn serve_and_bench_in_two_processes(transport: &str) {
    let memories: &[&str] = if transport == "ucx" {
        &["host", "shared-host"]
    } else {
        &["host"]
    };
    for memory in memories {
        for mode in ["pull", "push"] {
            serve_and_bench(transport, mode, memory);
        }
    }
}

fn serve_and_bench(transport: &str, mode: &str, memory: &str) {
    if !runnable(transport, "two-process run") {
        return;
    }
    // Push: both sides derive the source blocks from tokens and seed, so they take the same.
    let shape = [
        "--num-blocks",
        "8",
        "--tp",
        "1:2",
        "--mode",
        mode,
        "--tokens",
        "64",
        "--memory",
        memory,
    ];
    let (mut server, port) = spawn_serve(transport, &shape, None);
    let connect = format!("127.0.0.1:{port}");
    let mut args = vec![
        "bench",
        "--transport",
        transport,
        "--connect",
        &connect,
        "--requests",
        "3",
        "--warmup",
        "1",
        "--concurrency",
        "2",
    ];
    args.extend(shape);
    let (code, out_text, err) = kvxfer(&args);
    let pid = server.id().to_string();
    let _ = Command::new("kill").args(["-INT", &pid]).status();
    let status = server.wait().expect("serve exits");
    assert_eq!(code, 0, "{mode} over {transport}, {memory} memory: {err}");
    assert!(
        out_text.contains(&format!("{mode} mode over {transport}"))
            && out_text.contains("all correct"),
        "{out_text}"
    );
    assert!(
        status.success(),
        "serve did not end cleanly on SIGINT: {status:?}"
    );
}

/// A served prefill and decodes of other concurrencies agree on every block, in both modes:
/// the source blocks depend on the prefill's block count, not on the decode's concurrency
/// (a push decode at `--concurrency 4` used to derive other sources than `serve`).
#[test]
fn served_prefill_and_decodes_agree_across_concurrency_blocks_and_tokens() {
    if !runnable("ucx", "serve/bench matrix") {
        return;
    }
    for mode in ["pull", "push"] {
        for (blocks, tokens) in [("8", "64"), ("64", "100")] {
            let shape = ["--mode", mode, "--num-blocks", blocks, "--tokens", tokens];
            let (mut server, port) = spawn_serve("ucx", &shape, None);
            let connect = format!("127.0.0.1:{port}");
            for concurrency in ["1", "4"] {
                let mut args = vec![
                    "bench",
                    "--transport",
                    "ucx",
                    "--connect",
                    &connect,
                    "--requests",
                    "4",
                    "--warmup",
                    "0",
                    "--concurrency",
                    concurrency,
                ];
                args.extend(shape);
                let (code, out, err) = kvxfer(&args);
                assert!(
                    code == 0 && out.contains("all correct"),
                    "{mode}, {blocks} blocks, {tokens} tokens, concurrency {concurrency}: \
                     {err}{out}"
                );
            }
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}

/// `--config FILE`: the documented example is accepted, its keys reach the run, flags on the
/// command line win, and bad files give clear errors before anything runs.
#[test]
fn config_file_sets_and_flags_override() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/kvxfer.example.toml");
    // The example's values are used (`--requests 0` from the command line wins and stops the
    // run at the argument check, so nothing heavy runs).
    let (code, _, err) = kvxfer(&["bench", "--config", example, "--requests", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("must be positive"), "{err}");
    let dir = std::env::temp_dir().join(format!("kvxfer-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    // A small run configured by the file alone, with a table and a top-level key.
    let small = write(
        "small.toml",
        "num-blocks = 8\n[bench]\ntokens = 64\nrequests = 2\nwarmup = 1\n[serve]\nport = 1\n",
    );
    let (code, out, err) = kvxfer(&["bench", "--config", &small]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("2 x 64 tokens") && out.contains("all correct"),
        "{out}"
    );
    let (code, out, _) = kvxfer(&["bench", "--config", &small, "--tokens", "32"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("2 x 32 tokens"),
        "flag did not override the file: {out}"
    );
    let cases = [
        ("unknown.toml", "colour = 1\n", "unknown key \"colour\""),
        (
            "wrong-table.toml",
            "[bench]\nrole = \"prefill\"\n",
            "unknown key \"role\"",
        ),
        ("table.toml", "[decode]\nx = 1\n", "unknown table [decode]"),
        (
            "array.toml",
            "tokens = [1, 2]\n",
            "must be a string, number or boolean",
        ),
        ("syntax.toml", "tokens = \n", "config file"),
        ("value.toml", "tokens = \"many\"\n", "--tokens"),
    ];
    for (name, text, needle) in cases {
        let path = write(name, text);
        let (code, _, err) = kvxfer(&["bench", "--config", &path]);
        assert_eq!(code, 2, "{name}: {err}");
        assert!(err.contains(needle), "{name}: {err}");
    }
    let huge = write("huge.toml", &"# padding\n".repeat(200_000));
    let (code, _, err) = kvxfer(&["bench", "--config", &huge]);
    assert_eq!(code, 2);
    assert!(err.contains("larger than"), "{err}");
    let (code, _, err) = kvxfer(&["bench", "--config", "/nonexistent/kvxfer.toml"]);
    assert_eq!(code, 2);
    assert!(err.contains("No such file"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Side-channel keys from the environment: a decode with the server's key runs; one with a
/// different key or none is refused with a clear error (pull over UCX; skipped without it).
#[test]
fn side_channel_key_gates_the_two_process_run() {
    if !runnable("ucx", "keyed two-process run") {
        return;
    }
    let shape = ["--num-blocks", "8", "--tokens", "64"];
    let key = "a secret shared by this cluster";
    let (mut server, port) = spawn_serve("ucx", &shape, Some(key));
    let connect = format!("127.0.0.1:{port}");
    let run = |with: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvxfer"));
        c.args(["bench", "--transport", "ucx", "--connect", &connect])
            .args(["--requests", "1", "--warmup", "0"])
            .args(shape)
            .env_remove("KVXFER_SIDE_CHANNEL_KEY");
        if let Some(k) = with {
            c.env("KVXFER_SIDE_CHANNEL_KEY", k);
        }
        let o = c.output().expect("run bench");
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, out_text, err) = run(Some(key));
    let wrong = run(Some("not the secret of this cluster"));
    let none = run(None);
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(code, 0, "{err}");
    assert!(out_text.contains("all correct"), "{out_text}");
    assert_ne!(wrong.0, 0, "a wrong key was let in: {}", wrong.1);
    assert!(wrong.2.contains("authentication"), "{}", wrong.2);
    assert_ne!(none.0, 0, "no key was let in: {}", none.1);
    assert!(none.2.contains("authentication"), "{}", none.2);
}

/// `--nixl-library` names the runtime (a file that is none is refused, naming it); without
/// it or `KVXFER_NIXL_LIBRARY`, the active venv's NIXL wheel is found with nothing on the
/// loader's path (`.venv-nixl`, which the test command sets up, standing for an engine's).
#[test]
fn the_nixl_runtime_comes_from_the_flag_or_the_active_venvs_wheel() {
    let bogus = "/nonexistent/libnixl_capi.so";
    let (code, _, err) = kvxfer(&[
        "--nixl-library",
        bogus,
        "bench",
        "--transport",
        "nixl",
        "--requests",
        "1",
    ]);
    assert_eq!(code, 2, "{err}");
    if err.contains("built without the `nixl` feature") {
        println!("SKIP nixl runtime choice: {}", err.trim());
        return;
    }
    assert!(err.contains(&format!("{bogus} cannot be loaded")), "{err}");
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-nixl");
    if !venv.is_dir() {
        println!("SKIP nixl runtime from a venv: no .venv-nixl (scripts/nixl-venv.sh)");
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvxfer"))
        .args(SMALL)
        .args(["--transport", "nixl"])
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("NIXL_PLUGIN_DIR")
        .env_remove("KVXFER_NIXL_LIBRARY")
        .env("VIRTUAL_ENV", &venv)
        .env("RUST_LOG", "info")
        .output()
        .expect("run kvxfer");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stdout.contains("all correct"), "{stdout}");
    assert!(
        stderr.contains("NIXL runtime: ") && stderr.contains("(the nixl_cu12 wheel of "),
        "{stderr}"
    );
}
