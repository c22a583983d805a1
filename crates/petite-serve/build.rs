//! The gRPC messages and service from `proto/petite/v1/policy.proto`, compiled by protox (pure
//! Rust: neither this machine nor CI has `protoc`) into tonic/prost code in `OUT_DIR`.

use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"))
        .join("../../proto");
    let file = root.join("petite/v1/policy.proto");
    println!("cargo::rerun-if-changed={}", file.display());
    let fds = match protox::compile([&file], [&root]) {
        Ok(f) => f,
        Err(e) => {
            println!("cargo::error={}: {e}", file.display());
            return;
        }
    };
    if let Err(e) = tonic_prost_build::configure().compile_fds(fds) {
        println!(
            "cargo::error=generating the gRPC code from {}: {e}",
            file.display()
        );
    }
}
