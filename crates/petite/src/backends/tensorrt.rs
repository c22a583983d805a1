//! `--backend tensorrt`: one ONNX model per engine, built by trtexec or TensorRT-RTX in a child
//! process, wrapped as Torch-TensorRT's `TensorRTBackend` delegate.

use petite_engine::EngineBuilder;
use petite_engine::tensorrt::{self, TensorRtBuilder, Tool, ToolKind, ToolSearch};
use petite_graph::quant::Quant;
use petite_pi05::Precision;

use super::{BackendOptions, BackendSpec, Flag, Output};
use crate::memory::human;
use crate::{Error, Result};

pub(super) struct TensorRt;

impl BackendSpec for TensorRt {
    fn name(&self) -> &'static str {
        "tensorrt"
    }
    fn help(&self) -> &'static str {
        "TensorRT engines: ONNX per engine, built by trtexec or TensorRT-RTX in a child process"
    }
    fn output(&self) -> Output {
        Output::Engines
    }
    fn precisions(&self) -> (&'static [Precision], &'static str) {
        (&[Precision::Bf16], " (lerobot's bf16 mode)")
    }
    fn flags(&self) -> &'static [Flag] {
        &[
            Flag::EngineCap,
            Flag::Jobs,
            Flag::KeepEngines,
            Flag::Placement,
            Flag::Trtexec,
            Flag::TrtPython,
            Flag::TrtTarget,
            Flag::WeightStreamingBudget,
            Flag::Weights,
            Flag::QuantizeSkip,
        ]
    }
    /// On an integrated GPU (Jetson) the export shares the device's one memory pool: the
    /// budget is what is available now (said on stderr).
    fn default_memory_budget(&self) -> Option<u64> {
        let gpu = petite_engine::gpu::probe();
        let b = petite_engine::gpu::default_memory_budget(gpu.as_ref())?;
        eprintln!(
            "petite: integrated GPU ({}): memory budget {} (MemAvailable); pass --memory-budget or --engine-cap to choose",
            gpu.map(|g| g.name).unwrap_or_default(),
            human(b)
        );
        Some(b)
    }
    fn builder(
        &self,
        o: &BackendOptions,
        weights: Option<Quant>,
    ) -> Result<Box<dyn EngineBuilder>> {
        let tool = Tool::find(&ToolSearch {
            trtexec: o.trtexec.clone(),
            trt_python: o.trt_python.clone(),
            default_python: crate::venv::default_trt_python(),
        })?;
        let target = match (&o.trt_target, tool.kind) {
            (Some(t), ToolKind::Trtexec) => {
                return Err(Error::Usage(format!(
                    "--trt-target {t}: {} builds for the GPU it runs on; --trt-target is for TensorRT-RTX",
                    tool.info
                )));
            }
            (Some(t), ToolKind::Rtx) => {
                tool.check_target(t)?;
                Some(t.clone())
            }
            (None, ToolKind::Rtx) => Some(petite_engine::gpu::default_rtx_target(&tool)),
            (None, ToolKind::Trtexec) => None,
        };
        if weights == Some(Quant::Fp8E4M3) {
            // FP8 codes need FP8 hardware (sm89 on: Ada, Hopper, Thor); TensorRT-RTX's refusal
            // comes from deep in its compiler after the first engine's parse.
            let (what, cc) = match &target {
                Some(t) => (format!("--trt-target {t}"), target_cc(t)),
                None => match petite_engine::gpu::probe() {
                    Some(g) => (
                        format!("the GPU trtexec builds for ({}, {})", g.name, g.target()),
                        u32::try_from(g.compute_capability.0 * 10 + g.compute_capability.1).ok(),
                    ),
                    None => (String::new(), None),
                },
            };
            if let Some(cc) = cc.filter(|&cc| cc < 89) {
                return Err(Error::Usage(format!(
                    "--weights fp8: {what} (compute capability {}.{}) has no FP8; TensorRT builds FP8 weights for sm89 and later (Ada, Hopper, Thor). Use --weights int8 there",
                    cc / 10,
                    cc % 10
                )));
            }
        }
        let mut b = TensorRtBuilder::new(tool);
        if let Some(t) = target {
            b.target = t;
        }
        if let Some(budget) = o.weight_streaming_budget {
            tensorrt::weight_streaming_spec(budget)?;
            b.weight_streaming = true;
            b.weight_streaming_budget = Some(budget);
        }
        Ok(Box::new(b))
    }
    fn delegate_id(&self) -> Option<&'static str> {
        Some(tensorrt::BACKEND_ID)
    }
}

/// The compute capability of a TensorRT-RTX target name (`sm89` → 89), when it is one.
fn target_cc(target: &str) -> Option<u32> {
    target.strip_prefix("sm")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::target_cc;

    #[test]
    fn target_names_give_compute_capabilities() {
        assert_eq!(target_cc("sm89"), Some(89));
        assert_eq!(target_cc("sm120"), Some(120));
        assert_eq!(target_cc("gfx90"), None);
    }
}
