//! `--backend tensorrt`: one ONNX model per engine, built by trtexec or TensorRT-RTX in a child
//! process, wrapped as Torch-TensorRT's `TensorRTBackend` delegate.

use petite_engine::EngineBuilder;
use petite_engine::tensorrt::{self, TensorRtBuilder, Tool, ToolKind, ToolSearch};
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
    fn builder(&self, o: &BackendOptions) -> Result<Box<dyn EngineBuilder>> {
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
