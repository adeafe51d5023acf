//! Runs `kvxfer inspect` as a user would and checks what it prints.

mod common;

use common::kvxfer;

#[test]
fn inspect_default_prints_spec_mapping_and_plan() {
    let (code, out, _) = kvxfer(&["inspect"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("model llama-3-8b: 32 layers, 8 KV heads"),
        "{out}"
    );
    assert!(out.contains("regions 64, block_len 32768 B"), "{out}");
    assert!(out.contains("P0 -> D0: heads 0..8 into 0..8"), "{out}");
    assert!(out.contains("8192 raw descriptors"), "{out}");
}

#[test]
fn inspect_mla_with_hetero_tp_and_pp() {
    let (code, out, _) = kvxfer(&[
        "inspect",
        "--model",
        "deepseek-v3",
        "--tp",
        "4:2",
        "--pp",
        "2",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("stage 1: layers 30..61"), "{out}");
    assert!(out.contains("P1 -> D0: notify only"), "{out}");
}

#[test]
fn inspect_bad_arguments_are_clear_errors() {
    let (code, _, err) = kvxfer(&["inspect", "--tp", "3:4"]);
    assert_eq!(code, 2);
    assert!(err.contains("8 is not divisible by 3"), "{err}");
    let (code, _, err) = kvxfer(&["inspect", "--tp", "x"]);
    assert_eq!(code, 2);
    assert!(err.contains("expected PREFILL:DECODE"), "{err}");
    let (code, _, err) = kvxfer(&["inspect", "--model", "gpt-9"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown model"), "{err}");
}
