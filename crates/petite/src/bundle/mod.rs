//! The bundle an export leaves, and running it: `policy.json` plus the export id that
//! `prefix.pte` and `step.pte` (or `pi05.onnx.json`) carry, which every reader checks so that
//! files of two exports are never run together ([`check_bundle`]); what a directory holds
//! ([`BundleKind`]); and [`BundleRunner`], the one way `petite verify` and `petite act` run one.
//!
//! One file a runtime's concern: `delegates` (the interpreter of an engine `.pte`'s delegate
//! chain, each delegate run by the runtime [`crate::runtimes`] registers for its backend id),
//! `driver` (the driver scripts run in ExecuTorch's or ONNX Runtime's Python child, and the
//! inputs file they read), `specs` (the interface checks of portable and ONNX exports),
//! `python` (finding those runtimes' Pythons).

mod delegates;
mod driver;
mod python;
mod specs;

use std::path::{Path, PathBuf};

use petite_pi05::Pi05Config;
use petite_pi05::policy::PolicySpec;
use petite_pte::PteFile;

use crate::{Error, Result};

pub use delegates::{ChunkFn, PteRun, host_gathered_tables, run_pte, with_resident};
pub use driver::{run_onnx, run_portable};
pub use python::{ORT_PYTHON_ENV, PYTHON_ENV, find_ort_python, find_python};
pub use specs::{check_onnx_spec, check_specs, is_onnx, is_portable};

pub use crate::layout::EXPORT_ID_KEY;

/// The export id of a `.pte` (`None`: written before export ids, or not by petite export).
pub fn pte_export_id(pte: &PteFile) -> Result<Option<String>> {
    let Some(seg) = pte.named_segment(EXPORT_ID_KEY) else {
        return Ok(None);
    };
    let (start, len) = pte.segment_range(seg)?;
    let mut buf = vec![0u8; len as usize];
    let f = std::fs::File::open(pte.path()).map_err(|e| Error::io(pte.path(), "open", e))?;
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, start)
        .map_err(|e| Error::io(pte.path(), "read export id", e))?;
    String::from_utf8(buf).map(Some).map_err(|_| Error::BadPte {
        path: pte.path().display().to_string(),
        reason: format!("named data `{EXPORT_ID_KEY}` is not UTF-8"),
    })
}

/// The export id of an ONNX export (`pi05.onnx.json`'s `export_id`).
pub fn onnx_export_id(dir: &Path) -> Result<Option<String>> {
    let spec = dir.join(crate::layout::ONNX_SPEC);
    let v = crate::report::read_json(&spec)?;
    Ok(v.get("export_id")
        .and_then(|x| x.as_str())
        .map(str::to_string))
}

/// Checks that the programs in `dir` and its `policy.json` (if any) come from one export:
/// the `.pte` pair's ids (or the ONNX spec's) and the policy's must be equal. Returns the
/// policy, if there is one.
pub fn check_bundle(dir: &Path) -> Result<Option<PolicySpec>> {
    let mut ids: Vec<(PathBuf, Option<String>)> = Vec::new();
    if is_onnx(dir) {
        ids.push((dir.join(crate::layout::ONNX_SPEC), onnx_export_id(dir)?));
    } else {
        for name in crate::layout::PTES {
            let p = dir.join(name);
            let pte = PteFile::open(&p)?;
            ids.push((p, pte_export_id(&pte)?));
        }
    }
    let policy_path = dir.join(crate::layout::POLICY);
    let spec = if policy_path.is_file() {
        let s = PolicySpec::read(&policy_path)?;
        ids.push((policy_path, Some(s.export_id.clone())));
        Some(s)
    } else {
        None
    };
    let first = &ids[0];
    for other in &ids[1..] {
        if other.1 != first.1 {
            let show = |x: &Option<String>| x.clone().unwrap_or_else(|| "none".into());
            return Err(Error::BadPte {
                path: other.0.display().to_string(),
                reason: format!(
                    "export id {} but {} has {}: the files come from different exports; export again into an empty directory",
                    show(&other.1),
                    first.0.display(),
                    show(&first.1)
                ),
            });
        }
    }
    Ok(spec)
}

/// Which programs an export directory holds, i.e. which runtime runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BundleKind {
    /// `prefix.pte` + `step.pte` of delegate calls: engines, run here by the runtimes
    /// [`crate::runtimes`] registers for their backend ids.
    Engines,
    /// `prefix.pte` + `step.pte` of portable kernel calls: run in ExecuTorch's runtime.
    Portable,
    /// `pi05.onnx`: run in ONNX Runtime.
    Onnx,
}

impl BundleKind {
    /// What `dir` holds.
    pub fn of(dir: &Path) -> Result<Self> {
        if is_onnx(dir) {
            return Ok(BundleKind::Onnx);
        }
        let pte = PteFile::open(dir.join(crate::layout::PREFIX_PTE))?;
        Ok(if is_portable(&pte) {
            BundleKind::Portable
        } else {
            BundleKind::Engines
        })
    }

    /// The name `report.json` gives it.
    pub fn name(self) -> &'static str {
        match self {
            BundleKind::Engines => "engines",
            BundleKind::Portable => "portable",
            BundleKind::Onnx => "onnx",
        }
    }
}

/// An export directory checked and ready to run, the one way `petite verify` and `petite act`
/// run a bundle: what it holds, and the Python of the runtime it runs in, when not here.
#[derive(Debug, Clone)]
pub struct BundleRunner {
    dir: PathBuf,
    kind: BundleKind,
    python: Option<PathBuf>,
    device: crate::runtimes::Device,
}

impl BundleRunner {
    /// Every check before a run, each refusal one line: a bundle that cannot run on `device`
    /// (portable and ONNX bundles run on the CPU only), a `python` given for an engine bundle
    /// (it does not apply: the flag rule of `petite export`), an interface that does not fit `cfg`
    /// (the `.pte.json`/`pi05.onnx.json` descriptions), and a runtime Python that is missing
    /// (`python`, else the runtime's environment variable, else the workspace venv).
    pub fn prepare(
        dir: &Path,
        cfg: &Pi05Config,
        python: Option<&Path>,
        device: crate::runtimes::Device,
    ) -> Result<Self> {
        let kind = BundleKind::of(dir)?;
        if !device.is_host() && kind != BundleKind::Engines {
            return Err(Error::Usage(format!(
                "--device {} runs petite's engine bundles only; this is a{} bundle (run it with --device {})",
                device.name(),
                if kind == BundleKind::Onnx {
                    "n ONNX"
                } else {
                    " portable"
                },
                crate::runtimes::Device::default().name()
            )));
        }
        let python = match kind {
            BundleKind::Engines if python.is_some() => {
                return Err(Error::Usage(
                    "--python does not apply to an engine bundle (its engines run here, in no Python): drop --python (it applies to portable and ONNX bundles only)"
                        .into(),
                ));
            }
            BundleKind::Engines => None,
            BundleKind::Portable => {
                check_specs(dir, cfg)?;
                Some(find_python(python)?)
            }
            BundleKind::Onnx => {
                check_onnx_spec(dir, cfg)?;
                Some(find_ort_python(python)?)
            }
        };
        Ok(BundleRunner {
            dir: dir.to_path_buf(),
            kind,
            python,
            device,
        })
    }

    /// What the directory holds.
    pub fn kind(&self) -> BundleKind {
        self.kind
    }

    /// Runs the bundle on `inputs` (`inputs_file`: the same inputs as a file, when there is
    /// one, for the drivers); returns the actions and what ran them, as `report.json` records
    /// it (`runtime`, and the driver's line or the device).
    pub fn run(
        &self,
        cfg: &Pi05Config,
        inputs: &petite_pi05::inputs::Inputs,
        inputs_file: Option<&Path>,
    ) -> Result<(Vec<f32>, serde_json::Value)> {
        use serde_json::json;
        let dir = &self.dir;
        Ok(match (self.kind, &self.python) {
            (BundleKind::Onnx, Some(py)) => {
                let (a, j) = run_onnx(dir, cfg, inputs, inputs_file, py)?;
                (
                    a,
                    json!({"runtime": "onnxruntime (separate process)", "driver": j}),
                )
            }
            (BundleKind::Portable, Some(py)) => {
                let (a, j) = run_portable(dir, cfg, inputs, inputs_file, py)?;
                (
                    a,
                    json!({"runtime": "executorch-numpy-runtime (separate process)", "driver": j}),
                )
            }
            _ => {
                let r = run_pte(dir, cfg, inputs, self.device)?;
                (
                    r.actions,
                    json!({"runtime": r.runtimes.join(", "), "device": self.device.name()}),
                )
            }
        })
    }
}

/// A `.pte` (or a driver's output about one) that is not what an export writes.
pub(crate) fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::BadPte {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}
