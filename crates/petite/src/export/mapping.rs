//! The mapping file: the checkpoint's weights converted once into the dtypes (and, for the
//! portable backend, the layout) the programs read, kept under `OUT/cache/` and reused while the
//! checkpoint and the selection are unchanged.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use petite_engine::EngineBuilder;
use petite_graph::{Dtype, Program};
use petite_pi05::inputs::CanonicalCheckpoint;
use petite_weights::{
    ConvertOptions, MappedSafetensors, Role, Selection, TargetDtype, TensorInfo, TensorView,
    WeightSource,
};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// Metadata key of the mapping file that records the key it was written under.
pub(super) const KEY_META: &str = "petite.mapping_key";

/// The export's weights: the names the backend reads from the mapping file come from there, the
/// rest (read from the checkpoint, converted as the builder goes) from the checkpoint.
pub(super) struct ExportWeights<'c> {
    pub(super) mapping: Option<MappedSafetensors>,
    pub(super) from_mapping: BTreeSet<String>,
    pub(super) checkpoint: &'c CanonicalCheckpoint,
}

impl std::fmt::Debug for ExportWeights<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportWeights")
            .field("from_mapping", &self.from_mapping.len())
            .finish()
    }
}

impl ExportWeights<'_> {
    fn pick(&self, name: &str) -> &dyn WeightSource {
        match &self.mapping {
            Some(m) if self.from_mapping.contains(name) => m,
            _ => self.checkpoint,
        }
    }
}

impl WeightSource for ExportWeights<'_> {
    fn names(&self) -> Vec<String> {
        self.checkpoint.names()
    }
    fn info(&self, name: &str) -> petite_weights::Result<TensorInfo> {
        self.pick(name).info(name)
    }
    fn tensor(&self, name: &str) -> petite_weights::Result<TensorView<'_>> {
        self.pick(name).tensor(name)
    }
    fn release(&self, names: &[&str]) -> petite_weights::Result<()> {
        let (m, c): (Vec<&str>, Vec<&str>) = names
            .iter()
            .partition(|n| self.mapping.is_some() && self.from_mapping.contains(**n));
        if let Some(map) = &self.mapping
            && !m.is_empty()
        {
            map.release(&m)?;
        }
        // Scales a build computes from its weight's rows (no mapping file) have no pages of
        // their own in the checkpoint: their weight's release gives those back.
        let c: Vec<&str> = c
            .into_iter()
            .filter(|n| {
                petite_graph::quant::scaled_weight(n).is_none() || self.checkpoint.info(n).is_ok()
            })
            .collect();
        if !c.is_empty() {
            self.checkpoint.release(&c)?;
        }
        Ok(())
    }
    fn release_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.pick(name).release_range(name, start, end)
    }
    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.pick(name).prefetch_range(name, start, end)
    }
    fn files(&self) -> Vec<PathBuf> {
        let mut f = self.checkpoint.files();
        if let Some(m) = &self.mapping {
            f.push(m.path().to_path_buf());
        }
        f
    }
    fn check_unchanged(&self) -> petite_weights::Result<()> {
        self.checkpoint.check_unchanged()?;
        match &self.mapping {
            Some(m) => m.check_unchanged(),
            None => Ok(()),
        }
    }
}

/// The weights that go to the mapping file, each with its dtype there: a name goes when the
/// backend wants every read of it from the mapping file in one dtype; a name the backend reads
/// from the checkpoint anywhere stays there. A name wanted in two dtypes is an error naming it.
pub(super) fn selection(
    programs: &[&Program],
    builder: &dyn EngineBuilder,
) -> Result<Vec<(String, Dtype)>> {
    let mut wanted: BTreeMap<String, Dtype> = BTreeMap::new();
    let mut checkpoint_read = BTreeSet::new();
    for p in programs {
        let weights = p.weights();
        let codes: BTreeSet<&str> = weights
            .iter()
            .filter(|w| w.dtype.is_quant_code())
            .map(|w| w.name.as_str())
            .collect();
        for w in &weights {
            // Quantized weights are read from the mapping file whatever the builder: the
            // converter writes their codes and scales there (the checkpoint has neither).
            let quantized = codes.contains(w.name.as_str())
                || petite_graph::quant::scaled_weight(&w.name).is_some_and(|b| codes.contains(b));
            let to = if quantized {
                Some(w.dtype)
            } else {
                builder.mapping_dtype(w.dtype)
            };
            match to {
                None => {
                    checkpoint_read.insert(w.name.clone());
                }
                Some(d) => {
                    let slot = *wanted.entry(w.name.clone()).or_insert(d);
                    if slot != d {
                        return Err(Error::Internal(format!(
                            "weight `{}` is read as {} and as {}: the {} builder reads both \
                             from the mapping file, which holds one copy",
                            w.name,
                            slot.name(),
                            d.name(),
                            builder.backend_id()
                        )));
                    }
                }
            }
        }
    }
    Ok(wanted
        .into_iter()
        .filter(|(n, _)| !checkpoint_read.contains(n))
        .collect())
}

/// What the convert stage produced: the file, whether an earlier run's was reused, and what a
/// conversion cost (`None` when reused).
pub(super) struct Converted {
    pub(super) file: MappedSafetensors,
    pub(super) reused: bool,
    pub(super) seconds: Option<f64>,
}

/// The engine backends' mapping file for `selection` of `ck`: reused when a file for the same
/// source identity and selection exists and opens, else converted (temporary name, renamed).
pub(super) fn engine_mapping(
    ck: &CanonicalCheckpoint,
    identity: &super::Identity,
    selection: &[(String, Dtype)],
    cache: &Path,
    progress: bool,
) -> Result<Converted> {
    engine_mapping_at(ck, identity, selection, cache, None, progress)
}

/// The sidecar of a mapping file at `path` holding its resume key: the key of the source's
/// identity with modification times, which decides reuse (a checkpoint rewritten in place is
/// converted again) but stays out of the file's own bytes, whose header records only the
/// content key — `--backend onnx` publishes the file as `pi05.onnx.data`, which must not change
/// with a checkpoint's modification time.
pub(super) fn resume_sidecar(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".resume");
    PathBuf::from(s)
}

/// The key a mapping file of `selection` from the source `identity` is written under.
fn engine_key(identity: &str, selection: &[(String, Dtype)]) -> String {
    let mut h = Sha256::new();
    h.update(identity.as_bytes());
    h.update(b"|bf16|");
    for (n, d) in selection {
        h.update(n.as_bytes());
        // bf16 entries hash as before per-tensor dtypes existed (same key, same file name).
        if *d != Dtype::Bf16 {
            h.update([1]);
            h.update(d.name().as_bytes());
        }
        h.update([0]);
    }
    hex::encode(h.finalize())
}

/// [`engine_mapping`], also reusing the file at `also` (an earlier export's published copy of
/// its mapping file, e.g. `--backend onnx`'s `pi05.onnx.data`) when it was written under the
/// same keys; a new file is still converted into `cache`. The file's header records the key of
/// the source's content identity; its [`resume_sidecar`] the key with modification times.
pub(super) fn engine_mapping_at(
    ck: &CanonicalCheckpoint,
    identity: &super::Identity,
    selection: &[(String, Dtype)],
    cache: &Path,
    also: Option<&Path>,
    progress: bool,
) -> Result<Converted> {
    let key = engine_key(&identity.content, selection);
    let resume = engine_key(&identity.resume, selection);
    let path = path(cache, &key);
    for p in std::iter::once(path.as_path()).chain(also) {
        if let Some(file) = current(p, &key, &resume, selection.iter().map(|(n, _)| n.as_str())) {
            return Ok(Converted {
                file,
                reused: true,
                seconds: None,
            });
        }
    }
    // Every file of another key goes, and this path's sidecar until the new file is whole.
    clear_stale(cache, &path)?;
    let _ = std::fs::remove_file(resume_sidecar(&path));
    let pb = super::bar(progress, 0, "convert");
    let opts = ConvertOptions {
        progress: Some(petite_weights::Progress::new({
            let pb = pb.clone();
            move |done, total| {
                pb.set_length(total);
                pb.set_position(done);
            }
        })),
        ..convert_options(key, selection)
    };
    let rep = petite_weights::convert(ck, &path, &opts);
    pb.finish_and_clear();
    let rep = rep?;
    // Written (atomically) once the file is whole: a run killed before has no sidecar, so the
    // file is converted again.
    petite_fs::write(resume_sidecar(&path), resume.as_bytes())?;
    Ok(Converted {
        file: MappedSafetensors::open_as(&path, Role::MappingFile)?,
        reused: false,
        seconds: Some(rep.seconds),
    })
}

/// Whether `selection` holds quantized weights (codes): the mapping file must then be
/// written, whatever the builder, since only it holds their codes and scales.
pub(super) fn has_quantized(selection: &[(String, Dtype)]) -> bool {
    selection.iter().any(|(_, d)| d.is_quant_code())
}

/// How the engine backends' mapping file of `selection`, written under `key`, is converted: a
/// quantized weight's scales are not selected from the source, the converter computes them
/// beside its codes.
fn convert_options(key: String, selection: &[(String, Dtype)]) -> ConvertOptions {
    let codes: BTreeSet<&str> = selection
        .iter()
        .filter(|(_, d)| d.is_quant_code())
        .map(|(n, _)| n.as_str())
        .collect();
    let derived =
        |n: &str| petite_graph::quant::scaled_weight(n).is_some_and(|b| codes.contains(b));
    ConvertOptions {
        dtype: TargetDtype::Bf16,
        selection: Selection::Keep(
            selection
                .iter()
                .filter(|(n, _)| !derived(n))
                .map(|(n, _)| n.clone())
                .collect(),
        ),
        threads: 2,
        metadata: vec![(KEY_META.to_string(), key)],
        dtypes: selection
            .iter()
            .filter(|(n, d)| *d != Dtype::Bf16 && !derived(n))
            .map(|(n, d)| (n.clone(), *d))
            .collect(),
        seal: true,
        ..ConvertOptions::default()
    }
}

/// The seal [`engine_mapping`] would give its file under `identity`, computed without writing
/// it (the weights' fingerprint in the export id): a few MiB read from `src` — the checkpoint
/// where the backend reads it directly, else the mapping file just written (the same converted
/// bytes, keyed for reuse by another identity).
pub(super) fn engine_seal<S: petite_weights::WeightSource>(
    src: &S,
    identity: &str,
    selection: &[(String, Dtype)],
    cache: &Path,
) -> Result<String> {
    let key = engine_key(identity, selection);
    let opts = convert_options(key.clone(), selection);
    Ok(petite_weights::seal_of(src, &path(cache, &key), &opts)?)
}

/// Where the mapping file for `key` lives under `cache`.
pub(super) fn path(cache: &Path, key: &str) -> PathBuf {
    cache.join(format!("mapping-{}.safetensors", &key[..16]))
}

/// The mapping file at `path` if an earlier run wrote it under `key` (which covers the source
/// files' content, dtype and selection) and its [`resume_sidecar`] holds `resume` (the same
/// with the files' modification times), its seal matches (else: a notice, and it is rebuilt)
/// and it holds every tensor in `names`; anything else is rewritten.
pub(super) fn current<'a>(
    path: &Path,
    key: &str,
    resume: &str,
    mut names: impl Iterator<Item = &'a str>,
) -> Option<MappedSafetensors> {
    if std::fs::read(resume_sidecar(path)).ok()? != resume.as_bytes() {
        return None;
    }
    if !crate::guard::reusable(path, "mapping file") {
        return None;
    }
    let m = MappedSafetensors::open_as(path, Role::MappingFile).ok()?;
    let meta_ok = m
        .header()
        .metadata
        .iter()
        .any(|(k, v)| k == KEY_META && v == key);
    (meta_ok && names.all(|n| m.info(n).is_ok())).then_some(m)
}

/// Creates `cache` and removes its mapping files other than `keep`: they belong to another
/// source (or dtype), and one output directory holds one mapping file.
pub(super) fn clear_stale(cache: &Path, keep: &Path) -> Result<()> {
    std::fs::create_dir_all(cache).map_err(|e| Error::io(cache, "create cache directory", e))?;
    if let Ok(rd) = std::fs::read_dir(cache) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("mapping-") && e.path() != keep {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}
