//! With the `ucx` feature, generates UCX bindings from the installed `ucp/api/ucp.h` (UCX 1.13 or newer, found
//! with pkg-config).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "ucx")]
    ucx::generate();
}

#[cfg(feature = "ucx")]
mod ucx {
    use std::path::PathBuf;

    pub fn generate() {
        let lib = pkg_config::Config::new().atleast_version("1.13").probe("ucx").unwrap_or_else(|e| {
            panic!("feature `ucx`: pkg-config cannot find UCX 1.13 or newer (install libucx-dev): {e}")
        });
        let mut b = bindgen::Builder::default()
            .header_contents("ucx_wrapper.h", "#include <ucp/api/ucp.h>\n")
            .allowlist_function("ucp_.*|ucs_status_string")
            .allowlist_type("ucp_.*|ucs_status_t|ucs_status_ptr_t|ucs_thread_mode_t")
            .allowlist_var("UCP_.*|UCS_.*")
            .newtype_enum("ucs_status_t")
            .derive_default(true)
            .layout_tests(false)
            .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
        for p in &lib.include_paths {
            b = b.clang_arg(format!("-I{}", p.display()));
        }
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("ucx_bindings.rs");
        b.generate()
            .unwrap_or_else(|e| panic!("feature `ucx`: bindgen failed on ucp/api/ucp.h (needs libclang-dev): {e}"))
            .write_to_file(&out)
            .unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
    }
}
