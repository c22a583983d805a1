//! `PetiteReference` engines on the CPU: mapped in place from the `.pte`, run by
//! petite-reference. Also the host CPU as a device: it runs everywhere, its f32 reference is the
//! reference executor's, and `petite pi05 run` on it is petite-pi05's run.

use std::path::Path;

use petite_engine::EngineRuntime;
use petite_engine::reference::ReferenceEngine;
use petite_pi05::Pi05Config;
use petite_pi05::inputs::Inputs;
use petite_weights::WeightSource;

use super::{Device, DeviceSpec, ModelRun, Runtime, tunable_names};
use crate::{Error, Result};

/// The host CPU.
pub(super) const CPU: Device = Device(&Cpu);

pub(super) fn make() -> Result<Box<dyn Runtime>> {
    Ok(Box::new(CpuReference))
}

/// The host CPU as a device.
struct Cpu;

impl DeviceSpec for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn help(&self) -> &'static str {
        "The reference executor on the CPU (runs everywhere)"
    }
    fn is_host(&self) -> bool {
        true
    }
    fn check(&self) -> Result<()> {
        Ok(())
    }
    fn f32_reference(
        &self,
        cfg: &Pi05Config,
        weights: &dyn WeightSource,
        inputs: &Inputs,
    ) -> Result<Vec<f32>> {
        let r = petite_pi05::run::run_model(cfg, weights, inputs, petite_pi05::Precision::F32)?;
        Ok(r.actions)
    }
    fn run_model(&self, a: &ModelRun<'_>, say: &mut dyn FnMut(String)) -> Result<()> {
        if a.repeat > 0 || a.timing_json.is_some() || a.f32_matmul.is_some() || a.tuned {
            return Err(Error::Usage(format!(
                "--repeat, --timing-json, --f32-matmul and --tune are for the GPU path: add --device {}",
                tunable_names()
            )));
        }
        let files = petite_pi05::run::RunFiles {
            checkpoint: a.checkpoint,
            config: a.config,
            inputs: a.inputs,
            out: a.out,
        };
        let r = petite_pi05::run::run_files(&files, a.precision)?;
        let [table, prefix, steps] = r.seconds;
        say(format!(
            "pi05 run: wrote {} ({} steps); timestep table {table:.3} s, prefix {prefix:.3} s, steps {steps:.3} s, total {:.3} s",
            a.out.display(),
            r.trajectory.len(),
            table + prefix + steps
        ));
        Ok(())
    }
    fn doctor(&self) -> Vec<String> {
        let mut lines = Vec::new();
        // The reference executor's GEMM (and so step.pte's timestep table) in its one summation
        // order on this CPU: what makes exports byte-identical across x86-64 and aarch64.
        lines.push(match petite_reference::kernels::summation_order_check() {
            Ok(n) => format!("gemm: the documented summation order, bit for bit ({n} shapes)"),
            Err(e) => format!("gemm: NOT the documented summation order: {e}"),
        });
        // bf16 programs' linears on the CPU (verify, act, pi05 run --dtype bf16): the tile unit
        // where there is one; the timestep table never uses it.
        lines.push(match petite_reference::kernels::cpu_bf16_unit() {
            Some(unit) => format!(
                "bf16 linears: {unit} (sums in the unit's order; PETITE_CPU_AMX=off / PETITE_CPU_DPBF16=off for the exact path)"
            ),
            None => "bf16 linears: the exact f32 path (no AMX-BF16 here, no AVX512-BF16 on an AMD CPU, or turned off)".to_string(),
        });
        lines
    }
}

/// Reference engines on the CPU: mapped in place from the `.pte`, run by petite-reference.
struct CpuReference;

impl Runtime for CpuReference {
    fn device(&self) -> Device {
        CPU
    }
    fn describe(&self) -> String {
        "petite reference engines".into()
    }
    fn open<'s>(
        &'s self,
        path: &Path,
        offset: u64,
        len: u64,
        release: bool,
    ) -> Result<Box<dyn EngineRuntime + 's>> {
        let e = ReferenceEngine::open_region(path, offset, len)?;
        Ok(Box::new(e.releasing_weights(release)))
    }
}
