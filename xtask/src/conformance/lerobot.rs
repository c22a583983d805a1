//! The lerobot tier: re-runs `conformance/lerobot/make_pi05_goldens.py` (lerobot 0.6.1's real
//! PI05 in PyTorch, small configs) in a venv under `target/` and checks that the committed goldens
//! under `testdata/pi05/` are still what it produces. A stale golden would make every Rust parity
//! test meaningless, so this fails loudly; a CPU that rounds differently must not.
//!
//! Two kinds of content, two rules:
//! - **Exact** — what does not depend on the CPU: the sha256 of the generator script and its
//!   pinned requirements (`testdata/pi05/generator.sha256`, checked first, without Python, and by
//!   a unit test in `cargo test`), `config.json`, `model.safetensors` and `inputs.safetensors`
//!   (seeded numpy, byte for byte), and the names, dtypes and shapes of `expected.safetensors`.
//! - **Within measured cross-CPU noise** — the outputs PyTorch computes. Its CPU kernels are
//!   picked per ISA at run time (ATen's `ATEN_CPU_CAPABILITY` level, oneDNN's ISA for bf16
//!   matmuls), so another machine rounds differently: float32 outputs within
//!   [`F32_REL_BOUND`] × the tensor's max |golden|, bfloat16-mode actions within [`BF16_BOUND`].
//!
//! The generator runs under every setting of [`ISAS`] in each check (about 10 s each), so every
//! run exercises "another CPU" and prints the noise it saw per tensor class.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use petite_reference::compare::{max_abs, max_abs_diff};
use sha2::{Digest, Sha256};

use crate::util;

/// float32-mode outputs (`actions`, `prefix_k_*`, `prefix_v_*`, `v_t_*`, `adarms_cond_*`):
/// max |generated − committed| ≤ this × max |committed| of the same tensor. Measured worst
/// (lerobot 0.6.1, torch 2.11.0; testdata/pi05/README.md): 2.0e-6 vs the committed goldens
/// (prefix_v, oneDNN and ATen at AVX2 on an AVX-512 EPYC), 2.4e-6 between any two of six ISA
/// settings; the reporter's Sapphire Rapids (AVX-512 + AMX) K/V up to 4.05e-6 absolute at scale
/// ~4, ~1e-6. Bound: 8× the worst seen.
/// What a changed generator costs is far above it (a different weight seed: O(1)).
const F32_REL_BOUND: f32 = 2e-5;
/// bfloat16-mode outputs (names ending in `_bf16`): max |generated − committed| ≤ this. One
/// last-bit difference in an f32 sum can flip a bf16 rounding, and ten Euler steps carry the
/// flips to the actions. Measured worst: 2.58e-2 (ATen without vectors, oneDNN at SSE4.1: no
/// AVX-512-BF16 kernels; also the worst of any two settings), 7.3e-3 (AVX2), 1.2e-2 (reporter,
/// AMX); lerobot's own bf16-vs-f32 gap
/// is 8e-3 – 9.6e-3. Bound: the 5e-2 the portable tier already allows a bf16 export
/// (`portable.rs`), 1.9× the worst seen.
const BF16_BOUND: f32 = 5e-2;

/// Where the script, its pinned requirements and the goldens live (relative to the root).
const SCRIPT: &str = "conformance/lerobot/make_pi05_goldens.py";
const REQUIREMENTS: &str = "conformance/lerobot/requirements.txt";
const GOLDENS: &str = "testdata/pi05";
/// sha256 of [`SCRIPT`] and [`REQUIREMENTS`] when the goldens were blessed (`sha256sum` format).
const HASHES: &str = "testdata/pi05/generator.sha256";
/// The real pi0.5 state-dict listing (813 tensors), relative to the workspace's parent.
const LAYOUT_TSV: &str = "shared/reference/pi05-tensors.tsv";
/// Files every case directory holds.
const CASE_FILES: [&str; 4] = [
    "config.json",
    "model.safetensors",
    "inputs.safetensors",
    "expected.safetensors",
];
/// How to regenerate, in every failure message.
const BLESS: &str = "regenerate with `cargo xtask conformance --bless-lerobot` and review the diff";

/// One ISA setting of PyTorch's CPU kernels the generator runs under.
pub struct Isa {
    /// Short name for messages.
    pub name: &'static str,
    /// Environment variables set for the run ([`ISA_VARS`] not named here are removed).
    pub env: &'static [(&'static str, &'static str)],
}

/// The variables that pick PyTorch's CPU kernels: ATen's vector level and oneDNN's ISA cap.
const ISA_VARS: [&str; 2] = ["ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"];

/// The settings each check runs: the machine's own kernels (what `--bless-lerobot` writes), AVX2
/// (what an AVX2-only x86-64 picks), and no vector kernels at all (ATen's scalar `default`,
/// oneDNN at SSE4.1: the largest bf16 noise measured).
pub const ISAS: [Isa; 3] = [
    Isa {
        name: "native",
        env: &[],
    },
    Isa {
        name: "avx2",
        env: &[
            ("ATEN_CPU_CAPABILITY", "avx2"),
            ("ONEDNN_MAX_CPU_ISA", "AVX2"),
        ],
    },
    Isa {
        name: "no-avx",
        env: &[
            ("ATEN_CPU_CAPABILITY", "default"),
            ("ONEDNN_MAX_CPU_ISA", "SSE41"),
        ],
    },
];

/// Re-runs the golden generator and compares (or, with `bless`, replaces) `testdata/pi05/`.
/// `generator`: run this script instead of the committed one (to check that the drift check
/// catches a changed generator; the hash check is then skipped, the value checks are not).
pub fn run(bless: bool, generator: Option<&Path>) -> Result<()> {
    let root = util::root();
    ensure!(
        !(bless && generator.is_some()),
        "--bless-lerobot writes the committed generator's output; it takes no other generator"
    );
    match generator {
        None if !bless => check_hashes(&root)?,
        None => {}
        Some(g) => eprintln!(
            "xtask: running {} instead of {SCRIPT}: the generator hash is not checked",
            g.display()
        ),
    }
    let python = super::Venv::Lerobot.python()?;
    let script = generator.map_or_else(|| root.join(SCRIPT), Path::to_path_buf);
    let golden = root.join(GOLDENS);
    if bless {
        let out = generate(&python, &script, &ISAS[0])?;
        let result = bless_into(&out, &golden).and_then(|()| write_hashes(&root));
        remove(&out)?;
        return result;
    }
    let mut problems = Vec::new();
    let mut seen = Vec::new();
    for isa in &ISAS {
        let out = generate(&python, &script, isa)?;
        match compare_dirs(&out, &golden) {
            Ok(noise) => seen.push((isa.name, noise)),
            Err(e) => problems.push(format!("under ISA setting `{}`: {e:#}", isa.name)),
        }
        remove(&out)?;
        if seen.is_empty() {
            // The machine's own kernels already disagree: the other settings would only
            // repeat it.
            break;
        }
    }
    for (isa, noise) in &seen {
        print_noise(isa, noise);
    }
    if !problems.is_empty() {
        bail!(
            "lerobot goldens in {GOLDENS} are stale ({BLESS}):\n  {}",
            problems.join("\n  ")
        );
    }
    eprintln!(
        "xtask: lerobot goldens reproduce under {} ISA settings ({})",
        ISAS.len(),
        ISAS.map(|i| i.name).join(", ")
    );
    Ok(())
}

/// Runs the generator under `isa` into a fresh directory under `target/`; returns it.
fn generate(python: &Path, script: &Path, isa: &Isa) -> Result<PathBuf> {
    let root = util::root();
    let out = root.join("target").join(format!(
        "lerobot-goldens-{}-{}",
        std::process::id(),
        isa.name
    ));
    remove(&out)?;
    let started = std::time::Instant::now();
    let mut cmd = Command::new(python);
    cmd.arg(script).arg("--out").arg(&out).current_dir(&root);
    for v in ISA_VARS {
        cmd.env_remove(v);
    }
    for (k, v) in isa.env {
        cmd.env(k, v);
    }
    // The real checkpoint's tensor list lives in shared/ beside the clone (developers and CI
    // have it); with it the script also asserts the goldens use exactly the real name patterns.
    let layout = root.join("..").join(LAYOUT_TSV);
    if layout.exists() {
        cmd.arg("--layout-tsv").arg(&layout);
    } else {
        eprintln!(
            "xtask: {} not found: the goldens' tensor-name layout is not checked against it",
            layout.display()
        );
    }
    util::run(&mut cmd)?;
    eprintln!(
        "xtask: lerobot goldens generated under ISA setting `{}` in {:.1} s",
        isa.name,
        started.elapsed().as_secs_f64()
    );
    Ok(out)
}

fn remove(dir: &Path) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(())
}

/// The pinned requirement specifiers of `target/venv-lerobot`.
pub(super) fn requirements() -> Result<Vec<String>> {
    let path = util::root().join(REQUIREMENTS);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let reqs = requirement_lines(&text);
    ensure!(!reqs.is_empty(), "{} lists no requirements", path.display());
    Ok(reqs.into_iter().map(str::to_string).collect())
}

/// The requirement specifiers of a requirements file: comments and blank lines dropped.
fn requirement_lines(text: &str) -> Vec<&str> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The content of [`HASHES`] for the generator files under `root`, `sha256sum` format.
fn hashes(root: &Path) -> Result<String> {
    let mut out = String::new();
    for f in [SCRIPT, REQUIREMENTS] {
        let p = root.join(f);
        let bytes = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
        out.push_str(&format!("{:x}  {f}\n", Sha256::digest(&bytes)));
    }
    Ok(out)
}

/// Fails unless [`HASHES`] under `root` records the generator files as they are now: an edited
/// script or a changed pin without a re-bless fails here, in a second, without Python.
fn check_hashes(root: &Path) -> Result<()> {
    let path = root.join(HASHES);
    let recorded = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (the generator's hashes at the last bless; {BLESS})",
            path.display()
        )
    })?;
    let now = hashes(root)?;
    let mut changed = Vec::new();
    for line in now.lines() {
        if !recorded.lines().any(|l| l.trim() == line) {
            let file = line.split_whitespace().nth(1).unwrap_or(line);
            let was = recorded
                .lines()
                .find(|l| l.split_whitespace().nth(1) == Some(file))
                .and_then(|l| l.split_whitespace().next())
                .unwrap_or("nothing");
            let is = line.split_whitespace().next().unwrap_or("");
            changed.push(format!("{file}: sha256 {is}, {HASHES} records {was}"));
        }
    }
    ensure!(
        changed.is_empty() && recorded.lines().filter(|l| !l.trim().is_empty()).count() == 2,
        "the lerobot golden generator or its pins changed since testdata/pi05 was blessed \
         ({BLESS}):\n  {}",
        if changed.is_empty() {
            format!("{HASHES} does not hold exactly the two generator files")
        } else {
            changed.join("\n  ")
        }
    );
    Ok(())
}

fn write_hashes(root: &Path) -> Result<()> {
    let path = root.join(HASHES);
    std::fs::write(&path, hashes(root)?).with_context(|| format!("writing {}", path.display()))
}

/// The case directories under `dir` (sub-directories holding a `config.json`), by name.
fn cases(dir: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let mut found = BTreeMap::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        if path.is_dir() && path.join("config.json").exists() {
            found.insert(entry.file_name().to_string_lossy().into_owned(), path);
        }
    }
    Ok(found)
}

/// How one tensor of a re-run differed from its golden.
#[derive(Debug, Clone)]
struct Noise {
    /// `case/tensor`.
    tensor: String,
    /// The tensor's class: its name without a trailing `_<index>`.
    class: String,
    /// max |generated − committed|.
    max_abs: f32,
    /// max |committed|.
    scale: f32,
}

/// Checks that `golden` holds exactly the cases of `fresh`, each matching; lists every mismatch.
/// Returns the differences seen in the computed tensors.
fn compare_dirs(fresh: &Path, golden: &Path) -> Result<Vec<Noise>> {
    let fresh_cases = cases(fresh)?;
    let golden_cases = cases(golden)?;
    ensure!(!fresh_cases.is_empty(), "the generator wrote no case");
    let mut problems = Vec::new();
    let mut noise = Vec::new();
    for name in golden_cases.keys() {
        if !fresh_cases.contains_key(name) {
            problems.push(format!("{name}: committed but no longer generated"));
        }
    }
    for (name, fresh_dir) in &fresh_cases {
        let Some(golden_dir) = golden_cases.get(name) else {
            problems.push(format!("{name}: generated but not committed"));
            continue;
        };
        for file in CASE_FILES {
            let (f, g) = (fresh_dir.join(file), golden_dir.join(file));
            let result = if file == "expected.safetensors" {
                read_both(&f, &g).and_then(|(a, b)| compare_expected(&a, &b))
            } else {
                compare_exact(&f, &g).map(|()| Vec::new())
            };
            match result {
                Ok(n) => noise.extend(n.into_iter().map(|mut n| {
                    n.tensor = format!("{name}/{}", n.tensor);
                    n
                })),
                Err(e) => problems.push(format!("{name}/{file}: {e:#}")),
            }
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n  "));
    Ok(noise)
}

fn read_both(fresh: &Path, golden: &Path) -> Result<(Vec<u8>, Vec<u8>)> {
    let a = std::fs::read(fresh).with_context(|| format!("reading {}", fresh.display()))?;
    let b = std::fs::read(golden).with_context(|| format!("reading {}", golden.display()))?;
    Ok((a, b))
}

/// A seeded file (config, weights, inputs): byte for byte, on every CPU.
fn compare_exact(fresh: &Path, golden: &Path) -> Result<()> {
    let (a, b) = read_both(fresh, golden)?;
    ensure!(
        a == b,
        "differs ({} bytes generated vs {} committed{}); it is seeded, not computed, so it must \
         be byte-identical on every CPU: the generator changed",
        a.len(),
        b.len(),
        a.iter()
            .zip(&b)
            .position(|(x, y)| x != y)
            .map(|i| format!(", first difference at byte {i}"))
            .unwrap_or_default()
    );
    Ok(())
}

/// The rule a tensor of `expected.safetensors` is held to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Rule {
    /// Byte for byte (non-float tensors).
    Exact,
    /// max |Δ| ≤ factor × max |committed|.
    Relative(f32),
    /// max |Δ| ≤ bound.
    Absolute(f32),
}

fn rule(name: &str, dtype: &str) -> Rule {
    if dtype != "F32" {
        Rule::Exact
    } else if name.ends_with("_bf16") {
        Rule::Absolute(BF16_BOUND)
    } else {
        Rule::Relative(F32_REL_BOUND)
    }
}

/// `prefix_k_2` → `prefix_k`; `actions_bf16` stays.
fn class(name: &str) -> String {
    match name.rsplit_once('_') {
        Some((head, idx)) if !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) => {
            head.to_string()
        }
        _ => name.to_string(),
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Same tensor names, dtypes and shapes (exact); values by [`rule`]. Returns what it measured.
fn compare_expected(fresh: &[u8], golden: &[u8]) -> Result<Vec<Noise>> {
    let fresh = Safetensors::parse(fresh).context("generated file")?;
    let golden = Safetensors::parse(golden).context("committed file")?;
    let names_f: Vec<_> = fresh.tensors.keys().collect();
    let names_g: Vec<_> = golden.tensors.keys().collect();
    ensure!(
        names_f == names_g,
        "tensor names differ: generated {names_f:?}, committed {names_g:?}"
    );
    let mut problems = Vec::new();
    let mut noise = Vec::new();
    for (name, f) in &fresh.tensors {
        let g = &golden.tensors[name];
        if f.dtype != g.dtype || f.shape != g.shape || f.data.len() != g.data.len() {
            problems.push(format!(
                "{name}: generated {} {:?} ({} bytes), committed {} {:?} ({} bytes)",
                f.dtype,
                f.shape,
                f.data.len(),
                g.dtype,
                g.shape,
                g.data.len()
            ));
            continue;
        }
        let (bound, how) = match rule(name, &f.dtype) {
            Rule::Exact => {
                if f.data != g.data {
                    problems.push(format!("{name}: {} data differs", f.dtype));
                }
                continue;
            }
            Rule::Absolute(b) => (Ok(b), format!("bf16-mode bound {b:e}")),
            Rule::Relative(k) => {
                let scale = max_abs(&f32s(g.data));
                (
                    scale.map(|s| k * s),
                    format!(
                        "{k:e} × max |committed| {}",
                        scale.map_or("?".into(), |s| format!("{s:.4}"))
                    ),
                )
            }
        };
        let (fv, gv) = (f32s(f.data), f32s(g.data));
        let measured = max_abs_diff(&fv, &gv).and_then(|d| Ok((d, max_abs(&gv)?, bound?)));
        match measured {
            Err(e) => problems.push(format!(
                "{name}: {e} (actual = generated, expected = committed)"
            )),
            Ok((d, scale, bound)) => {
                if d > bound {
                    problems.push(format!(
                        "{name}: max |Δ| {d:.3e} > bound {bound:.2e} ({how})"
                    ));
                }
                noise.push(Noise {
                    tensor: name.clone(),
                    class: class(name),
                    max_abs: d,
                    scale,
                });
            }
        }
    }
    const SHOWN: usize = 4;
    let more = problems.len().saturating_sub(SHOWN);
    ensure!(
        problems.is_empty(),
        "{}{}",
        problems[..problems.len().min(SHOWN)].join("; "),
        if more > 0 {
            format!("; and {more} more tensors")
        } else {
            String::new()
        }
    );
    Ok(noise)
}

/// Prints the worst difference per tensor class seen under one ISA setting.
fn print_noise(isa: &str, noise: &[Noise]) {
    let mut worst: BTreeMap<&str, (f32, f32, &str)> = BTreeMap::new();
    for n in noise {
        let w = worst.entry(&n.class).or_insert((0.0, 0.0, ""));
        if n.max_abs > w.0 {
            (w.0, w.2) = (n.max_abs, &n.tensor);
        }
        if n.scale > 0.0 {
            w.1 = w.1.max(n.max_abs / n.scale);
        }
    }
    eprintln!(
        "xtask: lerobot goldens, ISA setting `{isa}`: worst |generated − committed| per class"
    );
    for (class, (abs, rel, at)) in worst {
        let bound = match rule(class, "F32") {
            Rule::Relative(k) => format!("bound {k:e} × scale"),
            Rule::Absolute(b) => format!("bound {b:e}"),
            Rule::Exact => "exact".into(),
        };
        eprintln!("  {class:<13} max |Δ| {abs:<10.3e} max |Δ|/scale {rel:<10.3e} {bound:<22} {at}");
    }
}

/// Replaces the case directories of `golden` with those of `fresh` (other files, such as the
/// README, are kept; cases no longer generated are removed).
fn bless_into(fresh: &Path, golden: &Path) -> Result<()> {
    std::fs::create_dir_all(golden).with_context(|| format!("creating {}", golden.display()))?;
    let fresh_cases = cases(fresh)?;
    ensure!(!fresh_cases.is_empty(), "the generator wrote no case");
    for (name, dir) in cases(golden)? {
        if !fresh_cases.contains_key(&name) {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
    }
    for (name, src) in &fresh_cases {
        let dst = golden.join(name);
        if dst.exists() {
            std::fs::remove_dir_all(&dst).with_context(|| format!("removing {}", dst.display()))?;
        }
        // Same filesystem (both under the workspace), so a rename is atomic per case.
        std::fs::rename(src, &dst)
            .with_context(|| format!("moving {} to {}", src.display(), dst.display()))?;
    }
    eprintln!(
        "xtask: blessed {} lerobot golden cases into {}",
        fresh_cases.len(),
        golden.display()
    );
    Ok(())
}

/// One tensor of a safetensors file: dtype name, shape, raw little-endian bytes.
struct TensorView<'a> {
    dtype: String,
    shape: Vec<u64>,
    data: &'a [u8],
}

/// Just enough of the safetensors format to compare files: an 8-byte little-endian header
/// length, a JSON header of `{name: {dtype, shape, data_offsets}}`, then the data.
struct Safetensors<'a> {
    tensors: BTreeMap<String, TensorView<'a>>,
}

impl<'a> Safetensors<'a> {
    fn parse(bytes: &'a [u8]) -> Result<Self> {
        ensure!(
            bytes.len() >= 8,
            "{} bytes: too short for safetensors",
            bytes.len()
        );
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        ensure!(
            8 + n <= bytes.len(),
            "header length {n} exceeds file size {}",
            bytes.len()
        );
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&bytes[8..8 + n]).context("parsing the JSON header")?;
        let data = &bytes[8 + n..];
        let mut tensors = BTreeMap::new();
        for (name, info) in header {
            if name == "__metadata__" {
                continue;
            }
            let dtype = info["dtype"]
                .as_str()
                .with_context(|| format!("{name}: no dtype"))?
                .to_string();
            let shape = info["shape"]
                .as_array()
                .with_context(|| format!("{name}: no shape"))?
                .iter()
                .map(|d| d.as_u64().with_context(|| format!("{name}: bad shape")))
                .collect::<Result<Vec<_>>>()?;
            let offsets = info["data_offsets"]
                .as_array()
                .filter(|o| o.len() == 2)
                .with_context(|| format!("{name}: no data_offsets"))?;
            let (start, end) = (
                offsets[0].as_u64().unwrap_or(u64::MAX) as usize,
                offsets[1].as_u64().unwrap_or(u64::MAX) as usize,
            );
            ensure!(
                start <= end && end <= data.len(),
                "{name}: data_offsets [{start}, {end}] outside {} data bytes",
                data.len()
            );
            ensure!(
                dtype != "F32" || (end - start) % 4 == 0,
                "{name}: F32 data of {} bytes",
                end - start
            );
            tensors.insert(
                name,
                TensorView {
                    dtype,
                    shape,
                    data: &data[start..end],
                },
            );
        }
        Ok(Self { tensors })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of F32 tensors `(name, shape, values)`.
    fn file_of(tensors: &[(&str, &[usize], &[f32])]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, shape, values) in tensors {
            let start = data.len();
            for v in *values {
                data.extend_from_slice(&v.to_le_bytes());
            }
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
            );
        }
        let header = serde_json::Value::Object(header).to_string();
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(&data);
        out
    }

    /// A safetensors file with one F32 tensor `name` holding `values` (shape `[len]`).
    fn file(name: &str, values: &[f32]) -> Vec<u8> {
        file_of(&[(name, &[values.len()], values)])
    }

    #[test]
    fn f32_outputs_within_the_relative_bound_pass_and_beyond_fail() {
        // Scale 4 (max |golden|): the bound is 4 × F32_REL_BOUND = 8e-5.
        let g = file("prefix_k_2", &[1.0, -4.0, 0.5]);
        let noise = compare_expected(&file("prefix_k_2", &[1.0 + 4e-6, -4.0, 0.5]), &g).unwrap();
        assert_eq!(noise.len(), 1);
        assert_eq!(noise[0].class, "prefix_k");
        assert_eq!(noise[0].scale, 4.0);
        assert!(compare_expected(&file("prefix_k_2", &[1.0, -4.0 + 7e-5, 0.5]), &g).is_ok());
        let err = compare_expected(&file("prefix_k_2", &[1.0, -4.0, 0.5 + 1e-4]), &g)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prefix_k_2: max |Δ| 1") && err.contains("> bound 8.00e-5"),
            "{err}"
        );
        // The bound scales with the tensor: the same 1e-4 passes at scale 10.
        let big = file("v_t_0", &[10.0, 0.5]);
        assert!(compare_expected(&file("v_t_0", &[10.0, 0.5 + 1e-4]), &big).is_ok());
    }

    #[test]
    fn bf16_outputs_get_the_bf16_bound() {
        let g = file("actions_bf16", &[1.0, -3.0]);
        // The worst cross-ISA difference measured (2.58e-2) passes, a clear change does not.
        assert!(compare_expected(&file("actions_bf16", &[1.0 + 2.6e-2, -3.0]), &g).is_ok());
        let err = compare_expected(&file("actions_bf16", &[1.0, -3.06]), &g)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("actions_bf16") && err.contains("> bound 5.00e-2 (bf16-mode bound 5e-2)"),
            "{err}"
        );
        // The same difference in a float32 output is far beyond its bound.
        assert!(
            compare_expected(
                &file("actions", &[1.0 + 2.6e-2, -3.0]),
                &file("actions", &[1.0, -3.0])
            )
            .is_err()
        );
    }

    #[test]
    fn nan_or_inf_fails_wherever_it_is() {
        let clean = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for i in [0, 2, 4] {
                let mut dirty = clean;
                dirty[i] = bad;
                for name in ["actions", "actions_bf16"] {
                    let err = compare_expected(&file(name, &dirty), &file(name, &clean))
                        .unwrap_err()
                        .to_string();
                    assert!(
                        err.contains(name) && err.contains(&format!("index {i}")),
                        "{err}"
                    );
                    // A non-finite committed value is refused too.
                    assert!(compare_expected(&file(name, &clean), &file(name, &dirty)).is_err());
                }
            }
        }
        let err = compare_expected(&file("actions", &[f32::NAN]), &file("actions", &[0.0]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("NaN"), "{err}");
    }

    #[test]
    fn renamed_reshaped_or_resized_tensors_fail() {
        let a = file("actions", &[1.0, 2.0]);
        assert!(compare_expected(&a, &file("v_t_0", &[1.0, 2.0])).is_err());
        let err = compare_expected(&a, &file("actions", &[1.0, 2.0, 3.0]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("[2]") && err.contains("[3]"), "{err}");
        // Same values, other shape.
        let err = compare_expected(
            &file_of(&[("actions", &[2, 1], &[1.0, 2.0])]),
            &file_of(&[("actions", &[1, 2], &[1.0, 2.0])]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("[2, 1]") && err.contains("[1, 2]"), "{err}");
        // An extra tensor.
        assert!(
            compare_expected(
                &file_of(&[("actions", &[1], &[1.0]), ("v_t_0", &[1], &[1.0])]),
                &file("actions", &[1.0])
            )
            .is_err()
        );
    }

    #[test]
    fn classes_drop_the_index() {
        assert_eq!(class("prefix_k_12"), "prefix_k");
        assert_eq!(class("adarms_cond_0"), "adarms_cond");
        assert_eq!(class("actions_bf16"), "actions_bf16");
        assert_eq!(class("actions"), "actions");
        assert_eq!(rule("actions_bf16", "F32"), Rule::Absolute(BF16_BOUND));
        assert_eq!(rule("v_t_3", "F32"), Rule::Relative(F32_REL_BOUND));
        assert_eq!(rule("tokens", "I64"), Rule::Exact);
    }

    #[test]
    fn truncated_files_are_errors_not_panics() {
        let a = file("actions", &[1.0, 2.0]);
        assert!(Safetensors::parse(&a[..5]).is_err());
        assert!(Safetensors::parse(&a[..a.len() - 2]).is_err());
    }

    /// A scratch directory under target/, removed when dropped.
    fn scratch(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("lerobot-test-{tag}-"))
            .tempdir_in(util::root().join("target"))
            .unwrap()
    }

    /// Writes one case directory with the four files; `model` is the weights file's content.
    fn write_case(dir: &Path, model: &[u8], actions: f32) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), b"{}").unwrap();
        std::fs::write(dir.join("model.safetensors"), model).unwrap();
        std::fs::write(dir.join("inputs.safetensors"), file("noise", &[0.5])).unwrap();
        std::fs::write(
            dir.join("expected.safetensors"),
            file("actions", &[actions]),
        )
        .unwrap();
    }

    #[test]
    fn stale_golden_dirs_are_reported_and_bless_replaces_them() {
        let tmp = scratch("dirs");
        let (fresh, golden) = (tmp.path().join("fresh"), tmp.path().join("golden"));
        write_case(&fresh.join("a"), b"weights", 1.0);
        write_case(&golden.join("a"), b"weights", 1.0 + 1e-6);
        let noise = compare_dirs(&fresh, &golden).unwrap();
        assert_eq!(noise.len(), 1);
        assert_eq!(noise[0].tensor, "a/actions");

        // Weights are seeded: one byte off fails, however small the numeric change.
        write_case(&golden.join("a"), b"weightZ", 1.0);
        let err = compare_dirs(&fresh, &golden).unwrap_err().to_string();
        assert!(
            err.contains("a/model.safetensors") && err.contains("byte 6"),
            "{err}"
        );

        // The message names the case, the file, the tensor, the difference and the bound.
        write_case(&golden.join("a"), b"weights", 1.5);
        let err = compare_dirs(&fresh, &golden).unwrap_err().to_string();
        assert!(
            err.contains("a/expected.safetensors: actions: max |Δ| 5.000e-1 > bound 3.00e-5"),
            "{err}"
        );

        write_case(&golden.join("a"), b"weights", 1.0);
        write_case(&golden.join("old"), b"weights", 1.0);
        let err = compare_dirs(&fresh, &golden).unwrap_err().to_string();
        assert!(
            err.contains("old: committed but no longer generated"),
            "{err}"
        );

        std::fs::write(golden.join("README.md"), b"kept").unwrap();
        write_case(&golden.join("a"), b"weightZ", 2.0);
        bless_into(&fresh, &golden).unwrap();
        assert!(!golden.join("old").exists());
        assert_eq!(std::fs::read(golden.join("README.md")).unwrap(), b"kept");
        assert_eq!(
            std::fs::read(golden.join("a/model.safetensors")).unwrap(),
            b"weights"
        );
    }

    /// A root with the two generator files and the hash file as bless writes it.
    fn hashed_root(tag: &str) -> tempfile::TempDir {
        let s = scratch(tag);
        for (f, text) in [
            (SCRIPT, "print('goldens')\n"),
            (REQUIREMENTS, "torch==2.11.0\n"),
        ] {
            let p = s.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        std::fs::create_dir_all(s.path().join(GOLDENS)).unwrap();
        write_hashes(s.path()).unwrap();
        s
    }

    #[test]
    fn a_changed_generator_or_pin_fails_the_hash_check_and_says_to_bless() {
        let s = hashed_root("hash");
        check_hashes(s.path()).unwrap();
        let text = std::fs::read_to_string(s.path().join(HASHES)).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert!(text.contains(&format!("  {SCRIPT}\n")), "{text}");

        // One character of the script.
        std::fs::write(s.path().join(SCRIPT), "print('goldenz')\n").unwrap();
        let err = check_hashes(s.path()).unwrap_err().to_string();
        assert!(
            err.contains(SCRIPT) && err.contains("--bless-lerobot") && !err.contains(REQUIREMENTS),
            "{err}"
        );
        // Blessing records the new state.
        write_hashes(s.path()).unwrap();
        check_hashes(s.path()).unwrap();

        // A pin.
        std::fs::write(s.path().join(REQUIREMENTS), "torch==2.12.0\n").unwrap();
        let err = check_hashes(s.path()).unwrap_err().to_string();
        assert!(err.contains(REQUIREMENTS), "{err}");

        // A hash file that lost a line, or is missing.
        write_hashes(s.path()).unwrap();
        let first = std::fs::read_to_string(s.path().join(HASHES)).unwrap();
        let first = first.lines().next().unwrap().to_string();
        std::fs::write(s.path().join(HASHES), format!("{first}\n")).unwrap();
        assert!(check_hashes(s.path()).is_err());
        std::fs::remove_file(s.path().join(HASHES)).unwrap();
        let err = check_hashes(s.path()).unwrap_err().to_string();
        assert!(err.contains("--bless-lerobot"), "{err}");
    }

    /// The fast check on the real files: editing the generator or a pin without re-blessing the
    /// goldens fails `cargo test`, no Python needed.
    #[test]
    fn committed_goldens_were_blessed_from_the_committed_generator() {
        check_hashes(&util::root()).unwrap();
    }

    #[test]
    fn isa_settings_start_with_the_native_one_and_only_set_the_isa_variables() {
        assert!(ISAS[0].env.is_empty(), "bless writes the native run");
        for isa in &ISAS {
            for (k, _) in isa.env {
                assert!(ISA_VARS.contains(k), "{}: {k}", isa.name);
            }
        }
    }

    #[test]
    fn requirement_lines_skip_comments_and_blanks() {
        let text = "# pins\nlerobot[pi]==0.6.1  # the model\n\n torch==2.11.0\n";
        assert_eq!(
            requirement_lines(text),
            ["lerobot[pi]==0.6.1", "torch==2.11.0"]
        );
    }
}
