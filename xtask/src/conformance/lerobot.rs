//! The lerobot tier: re-runs `conformance/lerobot/make_pi05_goldens.py` (lerobot 0.6.1's real
//! PI05 in PyTorch, small configs) in a venv under `target/` and checks that the committed goldens
//! under `testdata/pi05/` are exactly what it produces today. A stale or non-reproducible golden
//! would make every Rust parity test meaningless, so this fails loudly.
//!
//! Weights, inputs and configs must be byte-identical (they are seeded, not computed); expected
//! outputs are compared per value, because torch's CPU kernels may round the last bits
//! differently across CPUs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use crate::util;

/// Largest |Δ| allowed between a re-run and the golden for float32-mode outputs.
const F32_TOLERANCE: f32 = 1e-6;
/// Largest |Δ| allowed for bfloat16-mode outputs (names ending in `_bf16`): one last-bit
/// difference upstream can flip a bf16 rounding, which moves a value by ~1e-3 relative.
const BF16_TOLERANCE: f32 = 1e-3;

/// Where the script, its pinned requirements and the goldens live (relative to the root).
const SCRIPT: &str = "conformance/lerobot/make_pi05_goldens.py";
const REQUIREMENTS: &str = "conformance/lerobot/requirements.txt";
const GOLDENS: &str = "testdata/pi05";
/// The real pi0.5 state-dict listing (813 tensors), relative to the workspace's parent.
const LAYOUT_TSV: &str = "shared/reference/pi05-tensors.tsv";
/// Files every case directory holds.
const CASE_FILES: [&str; 4] = [
    "config.json",
    "model.safetensors",
    "inputs.safetensors",
    "expected.safetensors",
];

/// Re-runs the golden generator and compares (or, with `bless`, replaces) `testdata/pi05/`.
pub fn run(bless: bool) -> Result<()> {
    let root = util::root();
    let python = venv()?;
    let out = root
        .join("target")
        .join(format!("lerobot-goldens-{}", std::process::id()));
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    let started = std::time::Instant::now();
    let mut cmd = Command::new(&python);
    cmd.arg(root.join(SCRIPT))
        .arg("--out")
        .arg(&out)
        .current_dir(&root);
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
        "xtask: lerobot goldens generated in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let result = if bless {
        bless_into(&out, &root.join(GOLDENS))
    } else {
        compare_dirs(&out, &root.join(GOLDENS))
    };
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    result
}

/// Creates (or reuses) `target/venv-lerobot` from the pinned requirements file.
fn venv() -> Result<PathBuf> {
    let path = util::root().join(REQUIREMENTS);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let reqs = requirement_lines(&text);
    ensure!(!reqs.is_empty(), "{} lists no requirements", path.display());
    util::venv("lerobot", &reqs)
}

/// The requirement specifiers of a requirements file: comments and blank lines dropped.
fn requirement_lines(text: &str) -> Vec<&str> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .collect()
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

/// Checks that `golden` holds exactly the cases of `fresh`, each matching; lists every mismatch.
fn compare_dirs(fresh: &Path, golden: &Path) -> Result<()> {
    let fresh_cases = cases(fresh)?;
    let golden_cases = cases(golden)?;
    ensure!(!fresh_cases.is_empty(), "the generator wrote no case");
    let mut problems = Vec::new();
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
            if let Err(e) = compare_file(&fresh_dir.join(file), &golden_dir.join(file)) {
                problems.push(format!("{name}/{file}: {e:#}"));
            }
        }
    }
    if !problems.is_empty() {
        bail!(
            "lerobot goldens in {GOLDENS} are stale or not reproducible \
             (regenerate with `cargo xtask conformance --bless-lerobot`):\n  {}",
            problems.join("\n  ")
        );
    }
    eprintln!(
        "xtask: lerobot goldens: {} cases reproduce ({})",
        fresh_cases.len(),
        fresh_cases.keys().cloned().collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

/// Compares one file: `expected.safetensors` by value, everything else byte for byte.
fn compare_file(fresh: &Path, golden: &Path) -> Result<()> {
    let a = std::fs::read(fresh).with_context(|| format!("reading {}", fresh.display()))?;
    let b = std::fs::read(golden).with_context(|| format!("reading {}", golden.display()))?;
    if fresh.file_name().and_then(|n| n.to_str()) == Some("expected.safetensors") {
        compare_expected(&a, &b)
    } else if a != b {
        bail!(
            "differs ({} bytes generated vs {} committed{})",
            a.len(),
            b.len(),
            first_difference(&a, &b)
                .map(|i| format!(", first difference at byte {i}"))
                .unwrap_or_default()
        )
    } else {
        Ok(())
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Same tensor names, dtypes and shapes; F32 values within the tolerance, others byte-equal.
fn compare_expected(fresh: &[u8], golden: &[u8]) -> Result<()> {
    let fresh = Safetensors::parse(fresh).context("generated file")?;
    let golden = Safetensors::parse(golden).context("committed file")?;
    let names_f: Vec<_> = fresh.tensors.keys().collect();
    let names_g: Vec<_> = golden.tensors.keys().collect();
    ensure!(
        names_f == names_g,
        "tensor names differ: generated {names_f:?}, committed {names_g:?}"
    );
    let mut problems = Vec::new();
    for (name, f) in &fresh.tensors {
        let g = &golden.tensors[name];
        if f.dtype != g.dtype || f.shape != g.shape {
            problems.push(format!(
                "{name}: generated {} {:?}, committed {} {:?}",
                f.dtype, f.shape, g.dtype, g.shape
            ));
            continue;
        }
        if f.dtype == "F32" {
            let tol = if name.ends_with("_bf16") {
                BF16_TOLERANCE
            } else {
                F32_TOLERANCE
            };
            let worst = max_abs_diff(f.data, g.data);
            if worst.is_nan() || worst > tol {
                problems.push(format!("{name}: max |Δ| {worst:e} > {tol:e}"));
            }
        } else if f.data != g.data {
            problems.push(format!("{name}: {} data differs", f.dtype));
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("; "));
    Ok(())
}

/// Largest absolute difference of two little-endian f32 buffers of equal length; NaN anywhere
/// (or a NaN/finite mismatch) gives NaN so that the caller's `<=` check fails.
fn max_abs_diff(a: &[u8], b: &[u8]) -> f32 {
    let mut worst = 0f32;
    for (x, y) in a.chunks_exact(4).zip(b.chunks_exact(4)) {
        let x = f32::from_le_bytes(x.try_into().expect("chunks of 4"));
        let y = f32::from_le_bytes(y.try_into().expect("chunks of 4"));
        let d = (x - y).abs();
        if d.is_nan() {
            return f32::NAN;
        }
        worst = worst.max(d);
    }
    worst
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

    /// A safetensors file with one F32 tensor `name` holding `values`.
    fn file(name: &str, values: &[f32]) -> Vec<u8> {
        let header = format!(
            r#"{{"{name}":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{}]}}}}"#,
            values.len(),
            values.len() * 4
        );
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        for v in values {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    #[test]
    fn expected_within_tolerance_passes_and_beyond_fails() {
        let a = file("actions", &[1.0, -2.0, 0.5]);
        assert!(compare_expected(&a, &file("actions", &[1.0, -2.0 + 5e-7, 0.5])).is_ok());
        let err = compare_expected(&a, &file("actions", &[1.0, -2.0, 0.5 + 1e-4])).unwrap_err();
        assert!(err.to_string().contains("actions"), "{err}");
        assert!(compare_expected(&a, &file("actions", &[1.0, f32::NAN, 0.5])).is_err());
    }

    #[test]
    fn bf16_outputs_get_the_looser_bound() {
        let a = file("actions_bf16", &[1.0]);
        assert!(compare_expected(&a, &file("actions_bf16", &[1.0 + 1e-4])).is_ok());
        assert!(compare_expected(&a, &file("actions_bf16", &[1.01])).is_err());
    }

    #[test]
    fn renamed_or_reshaped_tensors_fail() {
        let a = file("actions", &[1.0, 2.0]);
        assert!(compare_expected(&a, &file("v_t_0", &[1.0, 2.0])).is_err());
        assert!(compare_expected(&a, &file("actions", &[1.0, 2.0, 3.0])).is_err());
    }

    #[test]
    fn truncated_files_are_errors_not_panics() {
        let a = file("actions", &[1.0, 2.0]);
        assert!(Safetensors::parse(&a[..5]).is_err());
        assert!(Safetensors::parse(&a[..a.len() - 2]).is_err());
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
        let tmp = util::root()
            .join("target")
            .join(format!("lerobot-test-{}", std::process::id()));
        let (fresh, golden) = (tmp.join("fresh"), tmp.join("golden"));
        write_case(&fresh.join("a"), b"weights", 1.0);
        write_case(&golden.join("a"), b"weights", 1.0 + 1e-7);
        assert!(compare_dirs(&fresh, &golden).is_ok());

        write_case(&golden.join("a"), b"weightZ", 1.0);
        let err = compare_dirs(&fresh, &golden).unwrap_err().to_string();
        assert!(err.contains("a/model.safetensors"), "{err}");

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
        std::fs::remove_dir_all(&tmp).unwrap();
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
