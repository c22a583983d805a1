//! The `tensorrt` backend: per engine, an ONNX model (weights as external data pointing into
//! the mapping file, so nothing is loaded), built by `trtexec` in a child process (all builder
//! memory goes back to the OS when it exits), and the plan wrapped as the `TensorRTBackend` `TR01`
//! delegate blob, streamed file to file.
//!
//! Why `trtexec` and not a C-ABI shim: it needs no C++ toolchain or TensorRT headers at build
//! time, and a child process is the strongest guarantee that the builder's multi-GiB working
//! memory is returned after each engine. Its command line:
//! `trtexec --onnx=E.onnx --saveEngine=E.plan --stronglyTyped --skipInference
//!  --memPoolSize=workspace:<MiB>M --timingCacheFile=<dir>/timing.cache`.
//! No machine here has TensorRT: the child-process path is tested with a stand-in `trtexec`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use petite_weights::{MappedSafetensors, WeightSource};

use crate::onnx::{Flavor, WeightLocation, emit, locations, write_model};
use crate::{BuiltEngine, EngineBuilder, EngineJob, Error, FileRegion, IoBinding, Result};

/// Backend id Torch-TensorRT's ExecuTorch runtime registers.
pub const BACKEND_ID: &str = "TensorRTBackend";
/// Environment variable naming the `trtexec` binary.
pub const TRTEXEC_ENV: &str = "PETITE_TRTEXEC";

/// Makes the mapping file visible in `dir` under its own file name (a hard link: no copy, and
/// ONNX tools accept it where they reject absolute paths and symlinks escaping the model's
/// directory; a symlink where hard links cannot cross file systems). Returns the name.
pub fn link_weights(mapping: &Path, dir: &Path) -> Result<String> {
    let name = mapping
        .file_name()
        .ok_or_else(|| {
            Error::io(
                mapping,
                "name mapping file",
                std::io::ErrorKind::InvalidInput.into(),
            )
        })?
        .to_string_lossy()
        .into_owned();
    let target = dir.join(&name);
    if let (Ok(a), Ok(b)) = (std::fs::metadata(mapping), std::fs::metadata(&target)) {
        use std::os::unix::fs::MetadataExt;
        if a.ino() == b.ino() && a.dev() == b.dev() {
            return Ok(name);
        }
        return Err(Error::io(
            &target,
            "link mapping file",
            std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "another file of that name is in the engine directory",
            ),
        ));
    }
    if std::fs::hard_link(mapping, &target).is_err() {
        let abs = mapping
            .canonicalize()
            .map_err(|e| Error::io(mapping, "resolve mapping file", e))?;
        std::os::unix::fs::symlink(abs, &target)
            .map_err(|e| Error::io(&target, "link mapping file", e))?;
    }
    Ok(name)
}

/// Finds `trtexec`: `$PETITE_TRTEXEC`, else `trtexec` on `PATH`.
pub fn find_trtexec() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(TRTEXEC_ENV) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        return Err(missing(format!(
            "${TRTEXEC_ENV} = {} is not a file",
            p.display()
        )));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            let c = d.join("trtexec");
            if c.is_file() {
                return Ok(c);
            }
        }
    }
    Err(missing(format!(
        "no `trtexec` on PATH and ${TRTEXEC_ENV} is not set"
    )))
}

fn missing(what: String) -> Error {
    Error::TensorRtMissing {
        what,
        hint: format!(
            "Install TensorRT >= 10 (its bin/ has trtexec) and set {TRTEXEC_ENV}=/path/to/trtexec \
             or put it on PATH; the `reference` backend needs no TensorRT"
        ),
    }
}

/// Builds TensorRT engines with `trtexec`.
#[derive(Debug, Clone)]
pub struct TensorRtBuilder {
    mapping: PathBuf,
    locations: BTreeMap<String, WeightLocation>,
    /// The `trtexec` to run; `None` = [`find_trtexec`] at build time.
    pub trtexec: Option<PathBuf>,
    /// Builder workspace pool limit in MiB (`--memPoolSize=workspace:<n>M`).
    pub workspace_mib: u64,
    /// Timing cache shared by all builds (default `<engine dir>/timing.cache`).
    pub timing_cache: Option<PathBuf>,
    /// `device_id` written into the blob.
    pub device_id: u32,
    /// `target_platform` written into the blob.
    pub target_platform: String,
}

impl TensorRtBuilder {
    /// A builder whose ONNX models reference weights in `mapping` (the bf16 mapping file; its
    /// header is read, its tensors are not).
    pub fn new(mapping: impl AsRef<Path>) -> Result<Self> {
        let mapping = mapping.as_ref().to_path_buf();
        let m = MappedSafetensors::open(&mapping)?;
        Ok(TensorRtBuilder {
            locations: locations(m.header()),
            mapping,
            trtexec: None,
            workspace_mib: 1024,
            timing_cache: None,
            device_id: 0,
            target_platform: format!("linux_{}", std::env::consts::ARCH),
        })
    }

    fn build_inner(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        dir: &Path,
    ) -> Result<BuiltEngine> {
        for w in job.program.weights() {
            crate::reference::check_weight(weights, &w)?;
        }
        let loc = link_weights(&self.mapping, dir)?;
        let onnx = dir.join(format!("{}.onnx", job.name));
        write_model(
            &onnx,
            &emit(job.program, &self.locations, &loc, Flavor::TensorRt)?,
        )?;
        let trtexec = match &self.trtexec {
            Some(p) => p.clone(),
            None => find_trtexec()?,
        };
        let plan = dir.join(format!("{}.plan", job.name));
        let plan_tmp = dir.join(format!("{}.plan.petite-tmp", job.name));
        let log = dir.join(format!("{}.trtexec.log", job.name));
        let cache = self
            .timing_cache
            .clone()
            .unwrap_or_else(|| dir.join("timing.cache"));
        let logf = File::create(&log).map_err(|e| Error::io(&log, "create", e))?;
        let logf2 = logf.try_clone().map_err(|e| Error::io(&log, "dup", e))?;
        let status = Command::new(&trtexec)
            .arg(format!("--onnx={}", onnx.display()))
            .arg(format!("--saveEngine={}", plan_tmp.display()))
            .arg("--stronglyTyped")
            .arg("--skipInference")
            .arg(format!("--memPoolSize=workspace:{}M", self.workspace_mib))
            .arg(format!("--timingCacheFile={}", cache.display()))
            .current_dir(dir)
            .stdout(logf)
            .stderr(logf2)
            .status()
            .map_err(|e| Error::io(&trtexec, "run trtexec", e))?;
        let fail = |status: String| {
            let _ = std::fs::remove_file(&plan_tmp);
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
            Error::TensorRtBuild {
                status,
                log_tail: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            }
        };
        if !status.success() {
            use std::os::unix::process::ExitStatusExt;
            let s = match (status.code(), status.signal()) {
                (Some(c), _) => format!("trtexec exited with status {c}"),
                (None, Some(sig)) => format!("trtexec was killed by signal {sig}"),
                _ => "trtexec failed".to_string(),
            };
            return Err(fail(s));
        }
        match std::fs::metadata(&plan_tmp) {
            Ok(m) if m.len() > 0 => {}
            _ => {
                return Err(fail(format!(
                    "trtexec succeeded but wrote no plan to {}",
                    plan_tmp.display()
                )));
            }
        }
        std::fs::rename(&plan_tmp, &plan).map_err(|e| Error::io(&plan, "rename", e))?;
        let (inputs, outputs) = crate::bindings(job.program);
        let blob_path = dir.join(format!("{}.tr01", job.name));
        let meta = blob::metadata_json(&inputs, &outputs, self.device_id, &self.target_platform);
        let res = blob::write(&blob_path, &meta, &plan);
        // The blob holds the plan; keep one copy on disk.
        let _ = std::fs::remove_file(&plan);
        let header = res?;
        Ok(BuiltEngine {
            index: job.index,
            name: job.name.to_string(),
            backend_id: BACKEND_ID.to_string(),
            file: blob_path.clone(),
            file_bytes: header.total_len,
            inputs,
            outputs,
            payload: FileRegion {
                path: blob_path,
                offset: 0,
                len: header.total_len,
            },
            input_values: job.input_values.to_vec(),
            output_values: job.output_values.to_vec(),
        })
    }
}

impl EngineBuilder for TensorRtBuilder {
    fn backend_id(&self) -> &str {
        BACKEND_ID
    }

    fn build(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        dir: &Path,
    ) -> Result<BuiltEngine> {
        self.build_inner(job, weights, dir)
            .map_err(|e| e.in_engine(job.index, job.name))
    }
}

/// The `TR01` delegate blob (Torch-TensorRT's `executorch/serialization.py` layout).
///
/// ```text
/// 0   4  magic "TR01"
/// 4   4  metadata_offset u32 = 32
/// 8   4  metadata_size   u32
/// 12  4  engine_offset   u32 = align16(32 + metadata_size)
/// 16  8  engine_size     u64
/// 24  8  reserved        01 00 00 00 00 00 00 00
/// 32  M  metadata JSON (compact; keys io_bindings, hardware_compatible, device_id,
///        serialized_metadata, target_platform — in that order, the C++ parser scans for them)
/// ..     zero padding to engine_offset
/// E   N  the TensorRT plan
/// ```
pub mod blob {
    use super::*;

    /// Header size.
    pub const HEADER_LEN: u32 = 32;
    /// Magic of blobs without aliased I/O.
    pub const MAGIC: &[u8; 4] = b"TR01";

    /// The parsed header of a blob.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Header {
        /// Offset of the JSON.
        pub metadata_offset: u32,
        /// Length of the JSON.
        pub metadata_size: u32,
        /// Offset of the plan (multiple of 16).
        pub engine_offset: u32,
        /// Length of the plan.
        pub engine_size: u64,
        /// The 8 reserved bytes.
        pub reserved: [u8; 8],
        /// Length of the whole blob.
        pub total_len: u64,
    }

    /// The metadata JSON, compact, keys in the order Torch-TensorRT writes and its C++ runtime
    /// parses. dtype/shape are empty, as Torch-TensorRT emits them (the runtime reads them from
    /// the engine); `serialized_metadata` is empty (petite has no pickled Torch-TRT metadata).
    pub fn metadata_json(
        inputs: &[IoBinding],
        outputs: &[IoBinding],
        device_id: u32,
        target_platform: &str,
    ) -> String {
        let q = |s: &str| serde_json::to_string(s).expect("strings serialize");
        let b: Vec<String> = inputs
            .iter()
            .chain(outputs)
            .map(|b| {
                format!(
                    "{{\"name\":{},\"dtype\":\"\",\"shape\":[],\"is_input\":{}}}",
                    q(&b.name),
                    b.is_input
                )
            })
            .collect();
        format!(
            "{{\"io_bindings\":[{}],\"hardware_compatible\":false,\"device_id\":{device_id},\"serialized_metadata\":\"\",\"target_platform\":{}}}",
            b.join(","),
            q(target_platform)
        )
    }

    /// Writes `out` = header + `metadata` + padding + the plan file's bytes (copied file to file,
    /// never held), through a temporary name.
    pub fn write(out: &Path, metadata: &str, plan: &Path) -> Result<Header> {
        let bad = |reason: String| Error::Blob {
            path: out.display().to_string(),
            reason,
        };
        let mut pf = File::open(plan).map_err(|e| Error::io(plan, "open plan", e))?;
        let engine_size = pf.metadata().map_err(|e| Error::io(plan, "stat", e))?.len();
        let msize = u32::try_from(metadata.len())
            .map_err(|_| bad(format!("metadata of {} bytes exceeds u32", metadata.len())))?;
        let eoff = (HEADER_LEN as u64 + msize as u64).div_ceil(16) * 16;
        let eoff = u32::try_from(eoff).map_err(|_| bad("engine offset exceeds u32".into()))?;
        let mut head = Vec::with_capacity(eoff as usize);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&HEADER_LEN.to_le_bytes());
        head.extend_from_slice(&msize.to_le_bytes());
        head.extend_from_slice(&eoff.to_le_bytes());
        head.extend_from_slice(&engine_size.to_le_bytes());
        head.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        head.extend_from_slice(metadata.as_bytes());
        head.resize(eoff as usize, 0);
        let mut tmp = out.as_os_str().to_os_string();
        tmp.push(".petite-tmp");
        let tmp = PathBuf::from(tmp);
        let res = (|| -> Result<()> {
            let mut f = File::create(&tmp).map_err(|e| Error::io(&tmp, "create", e))?;
            f.write_all(&head)
                .map_err(|e| Error::io(&tmp, "write", e))?;
            // std::io::copy between files uses copy_file_range on Linux (no user-space buffer).
            let n = std::io::copy(&mut pf, &mut f).map_err(|e| Error::io(&tmp, "copy plan", e))?;
            if n != engine_size {
                return Err(bad(format!(
                    "copied {n} plan bytes, expected {engine_size}"
                )));
            }
            f.sync_all().map_err(|e| Error::io(&tmp, "fsync", e))?;
            std::fs::rename(&tmp, out).map_err(|e| Error::io(out, "rename", e))
        })();
        if res.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        res?;
        Ok(Header {
            metadata_offset: HEADER_LEN,
            metadata_size: msize,
            engine_offset: eoff,
            engine_size,
            reserved: [1, 0, 0, 0, 0, 0, 0, 0],
            total_len: eoff as u64 + engine_size,
        })
    }

    /// Reads and checks a blob's header and metadata the way the C++ parser does
    /// (`metadata_offset >= 32`, `metadata_offset + size <= engine_offset`, `engine_offset % 16
    /// == 0`, `engine_offset + engine_size <= len`). Returns the header and the JSON text.
    pub fn read(path: &Path) -> Result<(Header, String)> {
        let bad = |reason: String| Error::Blob {
            path: path.display().to_string(),
            reason,
        };
        let mut f = File::open(path).map_err(|e| Error::io(path, "open", e))?;
        let total_len = f.metadata().map_err(|e| Error::io(path, "stat", e))?.len();
        let mut h = [0u8; 32];
        f.read_exact(&mut h).map_err(|_| {
            bad(format!(
                "{total_len} bytes, shorter than the 32-byte header"
            ))
        })?;
        if &h[0..4] != MAGIC {
            return Err(bad(format!("magic {:?}, expected \"TR01\"", &h[0..4])));
        }
        let u32at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let header = Header {
            metadata_offset: u32at(4),
            metadata_size: u32at(8),
            engine_offset: u32at(12),
            engine_size: u64::from_le_bytes(h[16..24].try_into().expect("8 bytes")),
            reserved: h[24..32].try_into().expect("8 bytes"),
            total_len,
        };
        if header.metadata_offset < HEADER_LEN {
            return Err(bad(format!(
                "metadata_offset {} < 32",
                header.metadata_offset
            )));
        }
        if header.metadata_offset as u64 + header.metadata_size as u64 > header.engine_offset as u64
        {
            return Err(bad("metadata runs into the engine".into()));
        }
        if !header.engine_offset.is_multiple_of(16) {
            return Err(bad(format!(
                "engine_offset {} is not 16-aligned",
                header.engine_offset
            )));
        }
        if header.engine_offset as u64 + header.engine_size > total_len {
            return Err(bad(format!(
                "engine {}+{} runs past the blob's {total_len} bytes",
                header.engine_offset, header.engine_size
            )));
        }
        f.seek(SeekFrom::Start(header.metadata_offset as u64))
            .map_err(|e| Error::io(path, "seek", e))?;
        let mut m = vec![0u8; header.metadata_size as usize];
        f.read_exact(&mut m)
            .map_err(|e| Error::io(path, "read metadata", e))?;
        let json = String::from_utf8(m).map_err(|_| bad("metadata is not UTF-8".into()))?;
        Ok((header, json))
    }
}
