//! The aarch64 tier: `petite` cross-built for `aarch64-unknown-linux-gnu` (the Jetson's
//! architecture; linker named in `.cargo/config.toml`) and run under `qemu-aarch64` (Debian
//! `qemu-user`, the cross sysroot `/usr/aarch64-linux-gnu`): the small-golden export and
//! `petite verify` of every small golden, with the `.pte` files' sha256 compared against the
//! x86-64 binary's output of the same command (they must be byte-identical); `petite doctor`'s
//! GEMM-order check on both (the timestep table in `step.pte` comes from that GEMM); then one
//! export under qemu with 64 KiB guest pages (`qemu-aarch64 -p 65536`; the binary asks the OS for
//! its page size), verified, its engines checked to hold the same tensors laid out for 64 KiB.
//!
//! CI installs what this needs itself: the rustup target, and (as root, or with passwordless
//! sudo) Debian's `gcc-aarch64-linux-gnu` and `qemu-user` through apt-get; when it cannot, it
//! stops with one line saying what to install.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use sha2::{Digest, Sha256};

use crate::util;

/// The Rust target.
pub const TARGET: &str = "aarch64-unknown-linux-gnu";
/// The cross linker `.cargo/config.toml` names.
pub const LINKER: &str = "aarch64-linux-gnu-gcc";
/// The Debian packages: the cross linker (with the arm64 libc it links against and qemu loads
/// from `SYSROOT`) and qemu's user-mode emulators.
const PACKAGES: &[&str] = &[
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "qemu-user",
];
/// Where Debian's cross libc lives (qemu's `-L`).
const SYSROOT: &str = "/usr/aarch64-linux-gnu";
const CASES: &[&str] = super::GOLDENS;
/// The files that must be byte-identical across architectures.
const OUTPUTS: &[&str] = &["prefix.pte", "step.pte"];

/// Runs the tier.
pub fn run() -> Result<()> {
    let t0 = Instant::now();
    ensure_tools()?;
    let qemu = qemu().context("qemu-aarch64 still missing after the install")?;
    let t_tools = t0.elapsed().as_secs_f64();

    let t = Instant::now();
    util::cargo(&["build", "--release", "-p", "petite", "--target", TARGET])?;
    let arm = util::target_dir()
        .join(TARGET)
        .join("release")
        .join("petite");
    let t_build = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let x86 = util::conformance_petite()?;
    let t_x86_build = t.elapsed().as_secs_f64();
    // The one GEMM summation order, bit for bit, on aarch64's NEON kernels too (the reason
    // step.pte's timestep table is the same on both): `petite doctor` checks it where it runs.
    let t = Instant::now();
    for (what, out) in [
        ("x86-64", Command::new(&x86).arg("doctor").output()?),
        (
            "aarch64 (qemu)",
            under_qemu(&qemu, &arm, None).arg("doctor").output()?,
        ),
    ] {
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().find(|l| l.starts_with("gemm: ")).unwrap_or("");
        ensure!(
            line.starts_with("gemm: the documented summation order"),
            "{what}: `petite doctor` says `{line}`"
        );
        eprintln!("xtask: aarch64: {what}: {line}");
    }
    let t_gemm = t.elapsed().as_secs_f64();

    let root = util::root();
    let out = util::target_dir().join("aarch64-conformance");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    let arch = system_under(&qemu, &arm, None)?;
    ensure!(
        arch.starts_with("linux aarch64, page size: 4096 bytes"),
        "`petite doctor` under qemu says `{arch}`"
    );
    let (mut t_native, mut t_emulated) = (0.0, 0.0);
    for case in CASES {
        let case_dir = root.join("testdata").join("pi05").join(case);
        let native = out.join(case).join("x86_64");
        let emulated = out.join(case).join("aarch64");
        let t = Instant::now();
        util::run(export(&mut Command::new(&x86), &case_dir, &native))?;
        t_native += t.elapsed().as_secs_f64();
        let t = Instant::now();
        util::run(export(
            &mut under_qemu(&qemu, &arm, None),
            &case_dir,
            &emulated,
        ))?;
        util::run(verify(
            &mut under_qemu(&qemu, &arm, None),
            &case_dir,
            &emulated,
        ))?;
        t_emulated += t.elapsed().as_secs_f64();
        for f in OUTPUTS {
            let (a, b) = (sha256(&native.join(f))?, sha256(&emulated.join(f))?);
            ensure!(
                a == b,
                "{case}: {f}: aarch64 (qemu) sha256 {b} differs from x86-64's {a} for the same export"
            );
            eprintln!(
                "xtask: aarch64: {case}: {f} sha256 {a}: identical on x86-64 and aarch64 (qemu)"
            );
        }
    }
    let case_dir = root.join("testdata").join("pi05").join(CASES[0]);
    let native = out.join(CASES[0]).join("x86_64");
    let big_pages = out.join(CASES[0]).join("aarch64-64k");

    // 64 KiB guest pages: the binary's page size is the OS's (sysconf), so releases and the
    // page-aligned layouts of the mapping and reference-engine files follow it.
    let t = Instant::now();
    let system = system_under(&qemu, &arm, Some(65536))?;
    ensure!(
        system.ends_with("page size: 65536 bytes"),
        "qemu-aarch64 -p 65536: `petite doctor` says `{system}`"
    );
    util::run(export(
        &mut under_qemu(&qemu, &arm, Some(65536)),
        &case_dir,
        &big_pages,
    ))?;
    util::run(verify(
        &mut under_qemu(&qemu, &arm, Some(65536)),
        &case_dir,
        &big_pages,
    ))?;
    let t_big = t.elapsed().as_secs_f64();
    let same: Vec<bool> = OUTPUTS
        .iter()
        .map(|f| Ok(sha256(&native.join(f))? == sha256(&big_pages.join(f))?))
        .collect::<Result<_>>()?;
    let n = same_engines_laid_out_for(&native, &big_pages, 65536)?;
    let verdict: Vec<String> = OUTPUTS
        .iter()
        .zip(&same)
        .map(|(f, s)| format!("{f} {}", if *s { "identical" } else { "differs" }))
        .collect();
    eprintln!(
        "xtask: aarch64: 64 KiB pages: exported and verified; {} ({n} engines: the same tensors and metadata as on x86-64, laid out for 64 KiB pages)",
        verdict.join(", ")
    );
    std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    eprintln!(
        "xtask: aarch64: {:.1} s in all (tools {t_tools:.1} s, cross build {t_build:.1} s, x86-64 build {t_x86_build:.1} s, GEMM order checks {t_gemm:.1} s, x86-64 exports {t_native:.1} s, qemu exports + verifies {t_emulated:.1} s, 64 KiB pages {t_big:.1} s)",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Each reference engine of the export in `big` (kept under `engines/`) holds exactly the
/// tensors and metadata of the same engine in `native`, with its data region and every
/// page-multiple tensor on a `page` boundary: the `.pte` bytes then differ by layout only.
/// Returns the number of engines compared.
fn same_engines_laid_out_for(native: &Path, big: &Path, page: usize) -> Result<usize> {
    use petite_weights::{MappedSafetensors, WeightSource};
    let mut n = 0;
    for entry in std::fs::read_dir(native.join("engines"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".ref.safetensors") {
            continue;
        }
        let a = MappedSafetensors::open(native.join("engines").join(&name))?;
        let b = MappedSafetensors::open(big.join("engines").join(&name))
            .with_context(|| format!("{name}: not built with 64 KiB pages"))?;
        ensure!(a.names() == b.names(), "{name}: other tensors");
        ensure!(
            a.header().metadata == b.header().metadata,
            "{name}: other metadata"
        );
        ensure!(
            b.header().data_start.is_multiple_of(page),
            "{name}: data region at {}",
            b.header().data_start
        );
        for t in a.names() {
            let (x, y) = (a.tensor(&t)?, b.tensor(&t)?);
            ensure!(x.bytes == y.bytes, "{name}: tensor {t} differs");
            let r = b.file_range(&t)?;
            ensure!(
                r.is_empty() || !r.len().is_multiple_of(page) || r.start.is_multiple_of(page),
                "{name}: page-multiple tensor {t} at {}",
                r.start
            );
        }
        n += 1;
    }
    ensure!(
        n > 0,
        "no reference engines kept under {}",
        native.display()
    );
    Ok(n)
}

/// `petite export --keep-engines` of the golden case into `dir` (reference backend, bf16: the
/// default); the engines are kept for [`same_engines_laid_out_for`].
fn export<'a>(cmd: &'a mut Command, case_dir: &Path, dir: &Path) -> &'a mut Command {
    cmd.arg("export")
        .arg("--keep-engines")
        .arg("--config")
        .arg(case_dir.join("config.json"))
        .arg("--checkpoint")
        .arg(case_dir.join("model.safetensors"))
        .arg("--out")
        .arg(dir)
}

/// `petite verify` of the export in `dir` against the golden's inputs.
fn verify<'a>(cmd: &'a mut Command, case_dir: &Path, dir: &Path) -> &'a mut Command {
    cmd.arg("verify")
        .arg("--dir")
        .arg(dir)
        .arg("--config")
        .arg(case_dir.join("config.json"))
        .arg("--checkpoint")
        .arg(case_dir.join("model.safetensors"))
        .arg("--inputs")
        .arg(case_dir.join("inputs.safetensors"))
}

/// `qemu-aarch64 -L SYSROOT [-p PAGE] BINARY`.
fn under_qemu(qemu: &Path, binary: &Path, page: Option<u32>) -> Command {
    let mut c = Command::new(qemu);
    c.args(["-L", SYSROOT]);
    if let Some(p) = page {
        c.args(["-p", &p.to_string()]);
    }
    c.arg(binary);
    c
}

/// The architecture and page size the aarch64 binary sees under qemu: `petite doctor`'s
/// `system:` line (`linux aarch64, page size: 4096 bytes`).
fn system_under(qemu: &Path, binary: &Path, page: Option<u32>) -> Result<String> {
    let o = under_qemu(qemu, binary, page).arg("doctor").output()?;
    let text = String::from_utf8_lossy(&o.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("system: "))
        .map(str::to_string)
        .with_context(|| format!("`petite doctor` under qemu printed no system line:\n{text}"))
}

fn sha256(p: &Path) -> Result<String> {
    let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}

/// `name` on `PATH`, if there.
fn on_path(name: &str, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    std::env::split_paths(path?)
        .map(|d| d.join(name))
        .find(|c| c.is_file())
}

fn qemu() -> Option<PathBuf> {
    let path = std::env::var_os("PATH");
    on_path("qemu-aarch64", path.as_deref())
        .or_else(|| on_path("qemu-aarch64-static", path.as_deref()))
}

/// What is missing, as the one line the tier stops with when it cannot install it.
fn missing_line(linker: bool, qemu: bool, sysroot: bool) -> Option<String> {
    let mut what = Vec::new();
    if !linker {
        what.push(format!("the cross linker {LINKER}"));
    }
    if !sysroot {
        what.push(format!("the arm64 libc in {SYSROOT}"));
    }
    if !qemu {
        what.push("qemu-aarch64".to_string());
    }
    (!what.is_empty()).then(|| {
        format!(
            "aarch64 tier: {} not found: install them (Debian/Ubuntu, as root: apt-get install {}), or leave the tier out (cargo xtask conformance --only with the other tiers)",
            what.join(", "),
            PACKAGES.join(" ")
        )
    })
}

/// Installs what is missing: the rustup target, then the Debian packages (as root or with
/// passwordless sudo). Fails with one line saying what to install when it cannot.
fn ensure_tools() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .current_dir(util::root())
        .output()
        .context("running rustup (the aarch64 tier needs rustup to add its target)")?;
    if !String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|l| l.trim() == TARGET)
    {
        util::run(
            Command::new("rustup")
                .args(["target", "add", TARGET])
                .current_dir(util::root()),
        )
        .with_context(|| format!("aarch64 tier: `rustup target add {TARGET}` failed"))?;
    }
    let path = std::env::var_os("PATH");
    let have = || {
        (
            on_path(LINKER, path.as_deref()).is_some(),
            qemu().is_some(),
            Path::new(SYSROOT)
                .join("lib")
                .join("ld-linux-aarch64.so.1")
                .exists(),
        )
    };
    let (l, q, s) = have();
    let Some(line) = missing_line(l, q, s) else {
        return Ok(());
    };
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    let sudo = !root
        && Command::new("sudo")
            .args(["-n", "true"])
            .output()
            .is_ok_and(|o| o.status.success());
    if !root && !sudo {
        bail!("{line}");
    }
    eprintln!("xtask: aarch64: installing {}", PACKAGES.join(" "));
    let apt = |args: &[&str]| -> Result<()> {
        let mut c = if root {
            Command::new("apt-get")
        } else {
            let mut c = Command::new("sudo");
            c.args(["-n", "apt-get"]);
            c
        };
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        util::run(&mut c)
    };
    let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
    install.extend_from_slice(PACKAGES);
    // Fresh CI images often have no package lists yet: update, then install.
    apt(&["update", "-qq"])
        .and_then(|()| apt(&install))
        .with_context(|| line.clone())?;
    let (l, q, s) = have();
    if let Some(line) = missing_line(l, q, s) {
        bail!("after apt-get install: {line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_tools_make_one_line_saying_what_to_install() {
        assert_eq!(missing_line(true, true, true), None);
        let l = missing_line(false, true, true).unwrap();
        assert!(!l.contains('\n'));
        assert!(
            l.contains("the cross linker aarch64-linux-gnu-gcc not found"),
            "{l}"
        );
        assert!(
            l.contains("apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"),
            "{l}"
        );
        let l = missing_line(true, false, false).unwrap();
        assert!(
            l.contains("arm64 libc") && l.contains("qemu-aarch64"),
            "{l}"
        );
    }

    #[test]
    fn the_cargo_config_names_the_cross_linker_and_runner() {
        let text =
            std::fs::read_to_string(util::root().join(".cargo").join("config.toml")).unwrap();
        let at = text
            .find(&format!("[target.{TARGET}]"))
            .expect("a section for the target");
        let section = &text[at..];
        assert!(
            section.contains(&format!("linker = \"{LINKER}\"")),
            "{section}"
        );
        assert!(section.contains(&format!("-L {SYSROOT}")), "{section}");
    }

    #[test]
    fn path_lookup_finds_only_files_on_path() {
        let dir = std::env::temp_dir();
        assert_eq!(on_path("no-such-linker-here", Some(dir.as_os_str())), None);
        assert_eq!(on_path(LINKER, None), None);
    }
}
