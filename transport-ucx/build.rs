//! With the `regen-bindings` feature: finds the system UCX with pkg-config (one clear error
//! naming the package when it is missing) and generates bindings for the UCP calls the
//! transport uses, which `scripts/ucx-bindings.sh` commits as `src/ucp_bindings.rs`. The
//! `ucx` feature alone builds from that file.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/wrapper.h");
    for var in [
        "PKG_CONFIG_PATH",
        "PKG_CONFIG_LIBDIR",
        "PKG_CONFIG_SYSROOT_DIR",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    #[cfg(feature = "regen-bindings")]
    ucx::generate();
}

#[cfg(feature = "regen-bindings")]
mod ucx {
    use std::path::PathBuf;

    const MIN_VERSION: &str = "1.13";

    /// The UCP calls the transport makes — the only ones bound.
    const FUNCTIONS: &[&str] = &[
        "ucp_am_data_release",
        "ucp_am_send_nbx",
        "ucp_cleanup",
        "ucp_config_modify",
        "ucp_config_read",
        "ucp_config_release",
        "ucp_context_query",
        "ucp_ep_close_nbx",
        "ucp_ep_create",
        "ucp_ep_flush_nbx",
        "ucp_ep_rkey_unpack",
        "ucp_get_nbx",
        "ucp_init_version",
        "ucp_mem_map",
        "ucp_mem_unmap",
        "ucp_put_nbx",
        "ucp_request_check_status",
        "ucp_request_free",
        "ucp_rkey_buffer_release",
        "ucp_rkey_destroy",
        "ucp_rkey_pack",
        "ucp_worker_arm",
        "ucp_worker_create",
        "ucp_worker_destroy",
        "ucp_worker_flush_nbx",
        "ucp_worker_get_address",
        "ucp_worker_get_efd",
        "ucp_worker_progress",
        "ucp_worker_release_address",
        "ucp_worker_set_am_recv_handler",
        "ucs_status_string",
        "ucp_get_version_string",
    ];

    pub fn generate() {
        // Headers only: the library is opened at run time (see `src/sys.rs`), so nothing is
        // linked.
        let lib = match pkg_config::Config::new()
            .atleast_version(MIN_VERSION)
            .cargo_metadata(false)
            .probe("ucx")
        {
            Ok(lib) => lib,
            Err(e) => {
                eprintln!(
                    "\nerror: the `ucx` feature needs UCX >= {MIN_VERSION} with its pkg-config file.\n\
                     Install it with `apt-get install libucx-dev` (Debian/Ubuntu; `ucx-utils` adds \
                     ucx_perftest), or set PKG_CONFIG_PATH to the folder holding ucx.pc.\n\
                     pkg-config said: {e}\n"
                );
                std::process::exit(1);
            }
        };
        let mut builder = bindgen::Builder::default()
            .header("src/wrapper.h")
            .allowlist_function(FUNCTIONS.join("|"))
            .dynamic_library_name("UcpLibrary")
            .dynamic_link_require_all(true)
            .allowlist_type("ucp_.*")
            .allowlist_type("ucs_thread_mode_t")
            .allowlist_type("ucs_status_t")
            .allowlist_type("ucs_memory_type")
            .allowlist_var("UCP_API_.*")
            .newtype_enum("ucs_status_t")
            .derive_default(true)
            .layout_tests(false)
            .generate_comments(false);
        for dir in &lib.include_paths {
            builder = builder.clang_arg(format!("-I{}", dir.display()));
        }
        let bindings = builder.generate().unwrap_or_else(|e| {
            eprintln!("\nerror: bindgen could not read the UCX headers ({e}); it needs libclang (`apt-get install libclang-dev`)\n");
            std::process::exit(1);
        });
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
        bindings
            .write_to_file(out.join("ucp_bindings.rs"))
            .expect("write bindings");
    }
}
