//! Cross builds: a linker configured for the target (`.cargo/config.toml` names
//! `aarch64-linux-gnu-gcc` for `aarch64-unknown-linux-gnu`) that is not installed fails here, in
//! one line saying what to install, instead of at the final link with only its name.

use std::path::Path;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PATH");
    let (Ok(target), Ok(host)) = (std::env::var("TARGET"), std::env::var("HOST")) else {
        return;
    };
    let Ok(linker) = std::env::var("RUSTC_LINKER") else {
        return;
    };
    if target == host || found(&linker) {
        return;
    }
    let package = match target.as_str() {
        "aarch64-unknown-linux-gnu" => "gcc-aarch64-linux-gnu libc6-dev-arm64-cross",
        _ => "the cross toolchain that provides it",
    };
    println!(
        "cargo::error=the cross linker `{linker}` for {target} is not installed: install it (Debian/Ubuntu: apt-get install {package}), or run `cargo xtask conformance --only aarch64`, which installs it"
    );
}

/// Whether `linker` names a file: a path as given, a bare name on `PATH`.
fn found(linker: &str) -> bool {
    let p = Path::new(linker);
    if p.components().count() > 1 {
        return p.is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(linker).is_file()))
}
