//! `--config FILE`: a subcommand's settings from a TOML file.
//!
//! Keys are the subcommand's long flag names (`tokens = 2048`, `tp = "1:2"`,
//! `contiguous = true`). Top-level keys apply to every subcommand that has that flag; keys in
//! a `[bench]`, `[serve]` or `[inspect]` table apply to that subcommand only. Flags given on
//! the command line override the file. `kvxfer.example.toml` lists every key.
//!
//! The file becomes flags placed before the command line's own, so it gets exactly the same
//! parsing, validation and error messages as flags.

use std::ffi::OsString;

use clap::Command;

/// Largest config file read.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Expands `--config FILE` in `args` (`args[0]` is the program) into flags for the
/// subcommand `args[1]`. Without `--config`, returns `args` unchanged.
pub fn expand(args: Vec<OsString>, cli: &Command) -> Result<Vec<OsString>, String> {
    let mut rest = Vec::with_capacity(args.len());
    let mut path = None;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "--config" {
            path = Some(it.next().ok_or("--config needs a file")?);
        } else if let Some(p) = a.to_str().and_then(|s| s.strip_prefix("--config=")) {
            path = Some(OsString::from(p));
        } else {
            rest.push(a);
        }
    }
    let Some(path) = path else {
        return Ok(rest);
    };
    let Some(sub_name) = rest.get(1).and_then(|s| s.to_str()).map(str::to_string) else {
        return Err("--config needs a subcommand (bench, serve, inspect)".into());
    };
    let sub = cli
        .find_subcommand(&sub_name)
        .ok_or_else(|| format!("unknown subcommand {sub_name:?}"))?;
    let text = read_bounded(&path)?;
    let flags = flags_for(&text, &path.to_string_lossy(), cli, sub)?;
    let mut out: Vec<OsString> = rest[..2].to_vec();
    out.extend(flags.into_iter().map(OsString::from));
    out.extend(rest.into_iter().skip(2));
    Ok(out)
}

fn read_bounded(path: &OsString) -> Result<String, String> {
    use std::io::Read;
    let shown = path.to_string_lossy();
    let file = std::fs::File::open(path).map_err(|e| format!("config file {shown}: {e}"))?;
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("config file {shown}: {e}"))?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(format!(
            "config file {shown} is larger than {MAX_CONFIG_BYTES} bytes"
        ));
    }
    Ok(text)
}

fn longs(cmd: &Command) -> Vec<String> {
    cmd.get_arguments()
        .filter_map(|a| a.get_long())
        .filter(|l| *l != "config" && *l != "help" && *l != "version")
        .map(str::to_string)
        .collect()
}

/// The flags a config file's text means for subcommand `sub`.
pub fn flags_for(
    text: &str,
    shown: &str,
    cli: &Command,
    sub: &Command,
) -> Result<Vec<String>, String> {
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("config file {shown}: {e}"))?;
    let name = sub.get_name();
    let known = longs(sub);
    let anywhere: Vec<String> = cli.get_subcommands().flat_map(longs).collect();
    let subcommands: Vec<&str> = cli.get_subcommands().map(Command::get_name).collect();
    let mut flags = Vec::new();
    let mut add = |key: &str, value: &toml::Value, strict: bool| -> Result<(), String> {
        if !known.iter().any(|k| k == key) {
            if strict || !anywhere.iter().any(|k| k == key) {
                return Err(format!(
                    "config file {shown}: unknown key {key:?} for `kvxfer {name}` (known: {})",
                    known.join(", ")
                ));
            }
            return Ok(()); // another subcommand's key
        }
        match value {
            toml::Value::Boolean(true) => flags.push(format!("--{key}")),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => flags.extend([format!("--{key}"), s.clone()]),
            toml::Value::Integer(i) => flags.extend([format!("--{key}"), i.to_string()]),
            toml::Value::Float(f) => flags.extend([format!("--{key}"), f.to_string()]),
            other => {
                return Err(format!(
                    "config file {shown}: key {key:?} must be a string, number or boolean, not {}",
                    other.type_str()
                ));
            }
        }
        Ok(())
    };
    for (key, value) in &table {
        match value {
            toml::Value::Table(t) if subcommands.contains(&key.as_str()) => {
                if key == name {
                    for (k, v) in t {
                        add(k, v, true)?;
                    }
                }
            }
            toml::Value::Table(_) => {
                return Err(format!(
                    "config file {shown}: unknown table [{key}] (tables: {})",
                    subcommands.join(", ")
                ));
            }
            v => add(key, v, false)?,
        }
    }
    Ok(flags)
}
