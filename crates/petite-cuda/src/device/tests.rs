//! The NVRTC tests: one compilation for concurrent requests, and every generated source
//! compiled for sm_90 and sm_87 (need libnvrtc; `cargo xtask conformance --only nvrtc`).

use super::compile::{COMPILED, compile_cached_in, compile_cubin};
use super::*;
use crate::source::module_source;

/// The NVRTC tests fail, never skip, where libnvrtc cannot be loaded.
fn assert_nvrtc_loads() {
    // SAFETY: only asks whether the dynamic library can be loaded.
    assert!(
        unsafe { cudarc::nvrtc::sys::is_culib_present() },
        "libnvrtc not found on the library path"
    );
}

/// Threads asking for one source at once (as `petite verify`'s two stages ask for the fixed
/// module) get one compilation: one of them compiles and reports its seconds, the others
/// wait for that image. Needs libnvrtc (the nvrtc tier runs it); no disk cache.
#[test]
#[ignore = "needs libnvrtc: cargo xtask conformance --only nvrtc"]
fn concurrent_requests_for_one_source_compile_it_once() {
    assert_nvrtc_loads();
    use std::sync::atomic::Ordering;
    // A source no cache of this process holds: the fused prelude and a kernel of its own.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let src = format!(
        "{}extern \"C\" __global__ void pt_once_{nanos}(float* p) {{ PT_PDL(); p[threadIdx.x] = bf2f(f2bf(p[threadIdx.x])); }}\n",
        crate::source::fused_prelude()
    );
    let before = COMPILED.load(Ordering::SeqCst);
    let threads = 4;
    let start = std::sync::Barrier::new(threads);
    let seconds: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    compile_cached_in((9, 0), &src, "petite_test.cu", None, false)
                        .expect("compiles")
                        .1
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert_eq!(COMPILED.load(Ordering::SeqCst) - before, 1, "{seconds:?}");
    assert_eq!(
        seconds.iter().filter(|&&s| s > 0.0).count(),
        1,
        "{seconds:?}"
    );
    // Asked again: the image kept, no compilation.
    let (_, again) = compile_cached_in((9, 0), &src, "petite_test.cu", None, false).unwrap();
    assert_eq!((again, COMPILED.load(Ordering::SeqCst) - before), (0.0, 1));
    // A source NVRTC refuses is an error each time it is asked for, never kept.
    let bad = format!("{src}this is not CUDA {nanos}\n");
    for _ in 0..2 {
        let e = compile_cached_in((9, 0), &bad, "petite_test.cu", None, false).unwrap_err();
        assert!(matches!(e, Error::Compile(_)), "{e}");
    }
    assert_eq!(COMPILED.load(Ordering::SeqCst) - before, 3);
}

/// NVRTC — nobody here wrote it; no GPU needed — compiles the fixed module, the attention module and every fused
/// kernel source that `fuse::plan` generates for pi0.5's full-size bf16 and f32 programs,
/// to machine code for the H200 (`sm_90`) and Jetson Orin (`sm_87`), with the options the
/// runtime uses. Needs libnvrtc on the library path: `cargo xtask conformance --only nvrtc`
/// installs it (pip) and runs this; without it the test fails, it never skips.
#[test]
#[ignore = "needs libnvrtc: cargo xtask conformance --only nvrtc"]
fn nvrtc_compiles_every_generated_source_for_sm90_and_sm87() {
    assert_nvrtc_loads();
    let mut sources = vec![
        ("module".to_string(), module_source()),
        (
            "attention module".to_string(),
            crate::source::attention_module_source(),
        ),
    ];
    for (name, p) in &crate::pi05_programs() {
        // As run by default (unrolled rows), with every bf16 attention fused, and with rolled
        // rows (the default before issue 49).
        for (queries, rows) in [(0, true), (usize::MAX, true), (0, false)] {
            let o = crate::fuse::Options {
                unrolled_rows: rows,
                ..crate::fuse::Options::new(queries)
            };
            let f = crate::fuse::plan_program(p, o).unwrap();
            let at = f.attention_kernels.map_or(f.kernels.len(), |[a, ..]| a);
            assert!(
                f.kernels[..at]
                    .iter()
                    .all(|k| f.source.contains(k.as_str()))
            );
            assert!(!f.source.contains("pt_attn_"));
            if queries > 0 && f.attentions.is_empty() {
                continue;
            }
            sources.push((
                format!(
                    "{name} ({} kernels, attention up to {queries} queries{})",
                    f.kernels.len(),
                    if rows { ", unrolled rows" } else { "" }
                ),
                f.source,
            ));
        }
    }
    for cc in [(9, 0), (8, 7)] {
        for (what, src) in &sources {
            let image = compile_cubin(cc, src, "petite_test.cu")
                .unwrap_or_else(|e| panic!("sm_{}{} {what}: {e}", cc.0, cc.1));
            eprintln!("sm_{}{} {what}: {} bytes of CUBIN", cc.0, cc.1, image.len());
            // Compile time follows code size: an unrolled loop over the dtype switches
            // once made the fixed module 1 MB and 16 s to compile (229 KB, ~1.6 s now).
            if what == "module" {
                assert!(
                    image.len() < 512 << 10,
                    "sm_{}{}: the fixed module grew to {} bytes of CUBIN",
                    cc.0,
                    cc.1,
                    image.len()
                );
            }
        }
    }
}
