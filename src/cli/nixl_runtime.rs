//! Which NIXL runtime the command's `nixl` transport opens, chosen once at start-up (before
//! any thread exists, so the environment it sets is read by everything after): `--nixl-library`,
//! else `KVXFER_NIXL_LIBRARY`, else the NIXL wheel of the active Python environment
//! (`VIRTUAL_ENV`; `nixl-cu13` before `nixl-cu12`, as `kvxfer.nixl` looks), else
//! `libnixl_capi.so` on the loader's path.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The wheels looked in, preferred first.
const PACKAGES: [&str; 2] = ["nixl_cu13", "nixl_cu12"];
const CAPI: &str = "libnixl_capi.so";
const VARIABLE: &str = "KVXFER_NIXL_LIBRARY";

/// The runtime to open and where it came from, or `None`: the loader's path decides.
/// `variable` is `KVXFER_NIXL_LIBRARY`'s value (empty counts as unset), `venv` `VIRTUAL_ENV`'s.
pub(crate) fn find(
    flag: Option<&Path>,
    variable: Option<OsString>,
    venv: Option<&Path>,
) -> Option<(PathBuf, String)> {
    if let Some(p) = flag {
        return Some((p.to_path_buf(), "--nixl-library".into()));
    }
    if let Some(p) = variable.filter(|p| !p.is_empty()) {
        return Some((PathBuf::from(p), VARIABLE.into()));
    }
    let venv = venv?;
    let sites = std::fs::read_dir(venv.join("lib")).ok()?;
    let mut sites: Vec<PathBuf> = sites
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages"))
        .collect();
    sites.sort();
    for package in PACKAGES {
        for site in &sites {
            for libs in [
                format!(".{package}.mesonpy.libs"),
                format!("{package}.libs"),
            ] {
                let capi = site.join(&libs).join(CAPI);
                if capi.is_file() {
                    return Some((capi, format!("the {package} wheel of {}", venv.display())));
                }
            }
        }
    }
    None
}

/// Chooses the runtime (see [`find`]) and points the transport at it: `KVXFER_NIXL_LIBRARY`,
/// `NIXL_PLUGIN_DIR` (its `plugins` folder, unless set) and, on a machine without RDMA
/// devices, `UCX_MODULES=^ib*` unless set (a wheel's bundled UCX loads its own InfiniBand
/// modules, which beside the system's rdma-core crash the process at exit).
///
/// # Safety
/// Sets environment variables: call it while the process has one thread.
pub(crate) unsafe fn select(flag: Option<&Path>) {
    let venv = std::env::var_os("VIRTUAL_ENV").map(PathBuf::from);
    let Some((path, source)) = find(flag, std::env::var_os(VARIABLE), venv.as_deref()) else {
        return;
    };
    tracing::info!("NIXL runtime: {} ({source})", path.display());
    let plugins = path.parent().map(|d| d.join("plugins"));
    let no_rdma =
        std::fs::read_dir("/sys/class/infiniband").map_or(true, |mut d| d.next().is_none());
    // SAFETY: the caller vouches that no other thread reads or writes the environment.
    unsafe {
        std::env::set_var(VARIABLE, &path);
        if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
            if let Some(p) = plugins.filter(|p| p.is_dir()) {
                std::env::set_var("NIXL_PLUGIN_DIR", p);
            }
        }
        if no_rdma && std::env::var_os("UCX_MODULES").is_none() {
            std::env::set_var("UCX_MODULES", "^ib*");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wheel(venv: &Path, python: &str, folder: &str) -> PathBuf {
        let libs = venv
            .join("lib")
            .join(python)
            .join("site-packages")
            .join(folder);
        std::fs::create_dir_all(&libs).expect("mkdir");
        std::fs::write(libs.join(CAPI), b"").expect("write");
        libs.join(CAPI)
    }

    #[test]
    fn the_flag_wins_then_the_variable_then_the_active_venvs_wheel_cu13_first() {
        let dir = std::env::temp_dir().join(format!("kvxfer-nixl-find-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let flag = Path::new("/opt/nixl/libnixl_capi.so");
        let var = || Some(OsString::from("/var/nixl/libnixl_capi.so"));
        assert_eq!(
            find(Some(flag), var(), Some(&dir)).map(|f| f.0),
            Some(flag.to_path_buf())
        );
        assert_eq!(
            find(None, var(), Some(&dir)),
            Some(("/var/nixl/libnixl_capi.so".into(), VARIABLE.into()))
        );
        assert_eq!(find(None, None, Some(&dir)), None, "no venv folder");
        assert_eq!(find(None, None, None), None);
        let cu12 = wheel(&dir, "python3.11", ".nixl_cu12.mesonpy.libs");
        assert_eq!(
            find(None, None, Some(&dir)).map(|f| f.0),
            Some(cu12.clone())
        );
        // An empty variable counts as unset.
        let empty = Some(OsString::new());
        assert_eq!(find(None, empty, Some(&dir)).map(|f| f.0), Some(cu12));
        let cu13 = wheel(&dir, "python3.12", "nixl_cu13.libs");
        let (path, source) = find(None, None, Some(&dir)).expect("found");
        assert_eq!(path, cu13);
        assert!(source.starts_with("the nixl_cu13 wheel of "), "{source}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
