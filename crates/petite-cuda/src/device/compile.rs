//! CUDA C to machine code: NVRTC with the runtime's options, each source compiled once a
//! process (threads asking at once wait for one compilation) and kept in the disk cache.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{CompileOptions, Ptx};

use super::trace;
use crate::settings::Settings;
use crate::source::module_source;
use crate::{Error, Result};

/// The kernels module for compute capability `cc`, kept for the process: NVRTC runs once.
pub(super) fn ptx_for(cc: (i32, i32), settings: &Settings) -> Result<(Ptx, f64)> {
    compile_cached(cc, &module_source(), "petite_kernels.cu", settings)
}

/// A program's fused kernels compiled for `cc` (any thread: needs NVRTC, not the context).
pub(crate) fn compile_fused(
    cc: (i32, i32),
    source: &str,
    settings: &Settings,
) -> Result<(Ptx, f64)> {
    compile_cached(cc, source, "petite_fused.cu", settings)
}

/// Compiles `source` for the device of compute capability `cc` with petite's arithmetic
/// options, once per process per source (reference engines of one shape share their fused
/// kernels). Machine code (CUBIN for `sm_XY`) when NVRTC knows the architecture, so the driver
/// has nothing to JIT at load (a first-run cost of seconds for many fused modules); else PTX
/// for `compute_XY`, which the driver compiles. The disk cache and the trace are `settings`'.
fn compile_cached(
    cc: (i32, i32),
    source: &str,
    name: &str,
    settings: &Settings,
) -> Result<(Ptx, f64)> {
    compile_cached_in(
        cc,
        source,
        name,
        settings.kernel_cache.clone(),
        settings.trace,
    )
}

/// Compilations run in this process through [`compile_cached_in`] (its check).
#[cfg(test)]
pub(super) static COMPILED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// [`compile_cached`] with the disk cache in `disk` (`None`: none), tracing its use when
/// `traced`. One thread compiles a
/// source; any other asking for it meanwhile waits for that image instead of compiling it
/// again (`petite verify`'s two stages each open a device, and each needs the fixed module).
/// A failure is not kept: the next request tries again.
pub(super) fn compile_cached_in(
    cc: (i32, i32),
    source: &str,
    name: &str,
    disk: Option<std::path::PathBuf>,
    traced: bool,
) -> Result<(Ptx, f64)> {
    /// An image by (compute capability, source), or the compilation under way.
    type Cell = Arc<OnceLock<std::result::Result<(Ptx, f64), String>>>;
    type Cells = HashMap<((i32, i32), String), Cell>;
    static CACHE: OnceLock<Mutex<Cells>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (cc, source.to_string());
    let cell = cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(key.clone())
        .or_default()
        .clone();
    let mut here = false;
    let done = cell.get_or_init(|| {
        here = true;
        #[cfg(test)]
        COMPILED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        compile_uncached(cc, source, name, disk, traced).map_err(|e| e.to_string())
    });
    match done {
        // Seconds only for the request that compiled: the others found it compiled.
        Ok((image, secs)) => Ok((image.clone(), if here { *secs } else { 0.0 })),
        Err(e) => {
            let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
            if map.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                map.remove(&key);
            }
            Err(Error::Compile(e.clone()))
        }
    }
}

/// `source` from the disk cache in `disk` when it holds it, else compiled (and written there).
fn compile_uncached(
    cc: (i32, i32),
    source: &str,
    name: &str,
    disk: Option<std::path::PathBuf>,
    traced: bool,
) -> Result<(Ptx, f64)> {
    let t0 = std::time::Instant::now();
    let opts = cubin_options(cc);
    // Machine code from an earlier process, when the disk cache holds it ([`crate::kcache`]).
    let cached = nvrtc_version()
        .ok()
        .and_then(|v| Some(disk?.join(crate::kcache::file_name(&v, cc, &opts, source))));
    if let Some(code) = cached
        .as_deref()
        .and_then(|p| crate::kcache::read(p, source))
    {
        trace(
            traced,
            format_args!("{name}: machine code from the disk cache"),
        );
        return Ok((Ptx::from_binary(code), 0.0));
    }
    let image = match compile_cubin(cc, source, name) {
        Ok(bin) => {
            if let Some(p) = &cached
                && let Err(e) = crate::kcache::write(p, source, &bin)
            {
                trace(traced, format_args!("{}: not cached: {e}", p.display()));
            }
            Ptx::from_binary(bin)
        }
        Err(_) => {
            let arch: &'static str =
                Box::leak(format!("compute_{}{}", cc.0, cc.1).into_boxed_str());
            let opts = CompileOptions {
                // Exact f32 division and square root, no flush to zero, no contraction into
                // FMAs: the reference executor's arithmetic, op for op.
                ftz: Some(false),
                prec_div: Some(true),
                prec_sqrt: Some(true),
                fmad: Some(false),
                arch: Some(arch),
                name: Some(name.into()),
                ..Default::default()
            };
            cudarc::nvrtc::compile_ptx_with_opts(source, opts)
                .map_err(|e| Error::Compile(e.to_string()))?
        }
    };
    Ok((image, t0.elapsed().as_secs_f64()))
}

/// NVRTC's options for machine code for `sm_XY` (the same arithmetic as the PTX path).
fn cubin_options(cc: (i32, i32)) -> Vec<String> {
    vec![
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "--fmad=false".to_string(),
        format!("--gpu-architecture=sm_{}{}", cc.0, cc.1),
    ]
}

/// NVRTC's version, `major.minor` (part of the disk cache's key).
pub(super) fn nvrtc_version() -> Result<String> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: both are valid out pointers; fails cleanly where the library is missing.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map(|_| format!("{a}.{b}"))
        .map_err(|e| Error::Compile(format!("nvrtcVersion: {e}")))
}

/// `source` compiled by NVRTC to machine code for `sm_XY` with the runtime's options, as a
/// program's load does but past both caches (no device needed, only libnvrtc): what
/// `examples/nvrtc_bench.rs` times.
pub fn compile_machine_code(cc: (i32, i32), source: &str) -> Result<Vec<u8>> {
    compile_cubin(cc, source, "petite_bench.cu")
}

/// NVRTC straight to machine code for `sm_XY` (the same options as the PTX path).
pub(super) fn compile_cubin(cc: (i32, i32), source: &str, name: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(source).map_err(|e| Error::Compile(e.to_string()))?;
    let nm = std::ffi::CString::new(name).map_err(|e| Error::Compile(e.to_string()))?;
    let prog =
        result::create_program(&src, Some(&nm)).map_err(|e| Error::Compile(e.to_string()))?;
    let opts = cubin_options(cc);
    // SAFETY: `prog` is a live program created above and destroyed once below; the size
    // query precedes a buffer of that size.
    let out = unsafe {
        let r = result::compile_program(prog, &opts)
            .map_err(|e| Error::Compile(e.to_string()))
            .and_then(|()| {
                let mut n: usize = 0;
                sys::nvrtcGetCUBINSize(prog, &mut n)
                    .result()
                    .map_err(|e| Error::Compile(format!("CUBIN size: {e}")))?;
                let mut buf = vec![0u8; n];
                sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| Error::Compile(format!("CUBIN: {e}")))?;
                Ok(buf)
            });
        let _ = result::destroy_program(prog);
        r
    };
    match out {
        Ok(b) if !b.is_empty() => Ok(b),
        Ok(_) => Err(Error::Compile("empty CUBIN".into())),
        Err(e) => Err(e),
    }
}
