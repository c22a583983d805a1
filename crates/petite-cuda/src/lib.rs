//! petite-cuda: runs petite-graph programs — the programs petite's reference engines hold — on
//! an NVIDIA GPU.
//!
//! CUDA is loaded at run time (cudarc's dynamic loading of the driver, cuBLAS and NVRTC), so
//! the crate builds, and everything that uses it runs, where there is no CUDA: asking for the
//! GPU there is an [`Error::Unavailable`] naming what is missing, before any work.
//!
//! - [`Device`]: device 0 — context, stream, cuBLAS handle, and the kernels, compiled by NVRTC
//!   from [`source::module_source`] at first use and kept for the process; opened with
//!   [`Settings`] (the documented `PETITE_CUDA_*` variables, the only environment the crate
//!   reads, and the A/B [`Tuning`]).
//! - [`DeviceProgram`]: one program with its weights uploaded once in their declared dtype (the
//!   host pages given back); runs node by node on the stream, values freed after their last
//!   reader. GEMMs (linear, matmul, the patch convolution, attention's two products) go to
//!   cuBLAS with f32 accumulation (bf16 inputs as bf16; f32 as exact f32 unless the caller asks
//!   for TF32, [`F32Matmul`]); every
//!   other op is one of the module's kernels, computing in f32 and rounding once, as the
//!   reference executor does.
//! - [`DevTensor`]: a value on the device, so a caller can keep a program's outputs resident
//!   (pi0.5's prefix K/V across the Euler steps).
//!
//! It knows nothing of TensorRT, the `.pte` layout or pi0.5.
#![deny(missing_docs)]

mod device;
pub mod fuse;
pub mod host_gather;
mod kcache;
pub mod plan;
mod program;
pub mod settings;
pub mod source;
mod upload;

pub use device::{
    DevTensor, Device, DeviceInfo, F32Matmul, Graph, Mark, Probe, compile_machine_code, probe,
};
pub use kcache::{KernelCache, kernel_cache};
pub use program::DeviceProgram;
pub use settings::{HostGather, Profile, Settings, Tuning};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// CUDA cannot run here: no driver library, no device, no cuBLAS or NVRTC library. Says
    /// which.
    #[error("CUDA is not available here: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {what}: {source}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {what}: {source}")]
    Blas {
        /// What was being done.
        what: String,
        /// cuBLAS's status.
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    /// NVRTC could not compile the kernels (the log follows).
    #[error("NVRTC: {0}")]
    Compile(String),
    /// A launch could not be planned (shapes the kernels cannot index).
    #[error("plan: {0}")]
    Plan(String),
    /// A node failed; names the node.
    #[error("{node}: {message}")]
    Node {
        /// The node (id, op, label).
        node: petite_graph::NodeDesc,
        /// What went wrong.
        message: String,
    },
    /// A program input is missing, unknown, or of the wrong dtype or shape.
    #[error("input {name:?}: {message}")]
    Input {
        /// The input name.
        name: String,
        /// Expected vs found.
        message: String,
    },
    /// The program is invalid.
    #[error(transparent)]
    Graph(#[from] petite_graph::Error),
    /// Reading a weight failed.
    #[error(transparent)]
    Weights(#[from] petite_weights::Error),
    /// A host tensor could not be built.
    #[error(transparent)]
    Tensor(#[from] petite_reference::Error),
    /// A `PETITE_CUDA_*` variable holds a value it does not take ([`settings`]).
    #[error(transparent)]
    Setting(#[from] settings::Invalid),
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn driver(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    let what = what.into();
    move |source| Error::Driver { what, source }
}

pub(crate) fn blas(
    what: impl Into<String>,
) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error {
    let what = what.into();
    move |source| Error::Blas { what, source }
}

/// pi0.5's full-size programs, bf16 then f32, named `"{precision:?} {program}"`: what the
/// tests that check every generated kernel walk.
#[cfg(test)]
pub(crate) fn pi05_programs() -> Vec<(String, petite_graph::Program)> {
    let cfg = petite_pi05::Pi05Config::default();
    let mut out = Vec::new();
    for prec in [petite_pi05::Precision::Bf16, petite_pi05::Precision::F32] {
        let progs = petite_pi05::build_all(&cfg, prec).expect("pi0.5's programs");
        for (name, p) in [
            ("timestep_table", progs.timestep_table),
            ("prefix", progs.prefix),
            ("step", progs.step),
        ] {
            out.push((format!("{prec:?} {name}"), p));
        }
    }
    out
}
