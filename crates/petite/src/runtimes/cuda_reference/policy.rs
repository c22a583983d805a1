//! pi0.5 whole chunks on the GPU: the timestep table, prefix and step programs built from a
//! checkpoint, their weights uploaded once, then per chunk the prefix → its K/V kept on the
//! device → the Euler steps, each reading the K/V and its timestep row (uploaded once) in place.
//! Only the inputs go up and the actions come back. The prefix is captured once into a CUDA
//! graph reading fixed input buffers and copying its K/V into the step's inputs (its embedding
//! index check read back after the chunk): queued node by node, its ~1,000 launches leave the
//! GPU gaps wherever the host's own work falls behind (1.3–3.1 ms a chunk on the H200). The step is captured once into a CUDA graph reading fixed
//! buffers (x, the timestep row, the K/V) and writing x back, then replayed `steps` times a
//! chunk: no host work between steps. What `petite pi05 run --device cuda` and
//! `petite verify --device cuda`'s f32 reference run.

use std::collections::BTreeMap;
use std::time::Instant;

use std::cell::OnceCell;

use petite_cuda::{DevTensor, Device, DeviceProgram, F32Matmul, Graph};
use petite_pi05::Pi05Config;
use petite_pi05::inputs::Inputs;
use petite_pi05::programs::{Precision, build_all, io, time_row_len};
use petite_pi05::rtc::Guidance;
use petite_reference::Tensor;
use petite_weights::WeightSource;

use crate::{Error, Result};

fn cuda(e: petite_cuda::Error) -> Error {
    Error::cuda("petite-cuda")(e)
}

/// One chunk's device time (CUDA events) and wall time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkTimes {
    /// Inputs up + prefix, ms of device time.
    pub prefix_ms: f64,
    /// The Euler steps, ms of device time.
    pub steps_ms: f64,
    /// The whole chunk (inputs up to actions back), ms of device time.
    pub total_ms: f64,
    /// The whole chunk, ms of wall time on the host.
    pub wall_ms: f64,
}

/// A chunk's RTC guidance and its tensors on the device: `[rtc_prev, rtc_weights]` and each
/// step's `rtc_step`.
type OnDevice = (Guidance, [DevTensor; 2], Vec<DevTensor>);

/// pi0.5's programs resident on a device, ready to run chunks.
pub struct CudaPolicy<'d> {
    dev: &'d Device,
    cfg: Pi05Config,
    prefix: DeviceProgram<'d>,
    step: DeviceProgram<'d>,
    rows: Vec<DevTensor>,
    /// Seconds to build the programs and upload the weights.
    pub load_seconds: f64,
    /// Dense FLOPs of one prefix run and of one step ([`petite_cuda::plan::program_flops`]).
    pub flops: [f64; 2],
    /// The part of [`CudaPolicy::flops`] whose products read f32 (run at the f32 rate).
    pub flops_f32: [f64; 2],
    /// The step's fixed inputs: x, the timestep row and the prefix outputs, by input name.
    fixed: BTreeMap<String, DevTensor>,
    /// The step captured over `fixed` (at the first chunk), or `None` when not replaying.
    graph: OnceCell<Graph>,
    use_graph: bool,
    /// The prefix's fixed inputs (the images, their masks, the tokens and their mask).
    prefix_fixed: BTreeMap<String, DevTensor>,
    /// The prefix's embedding index flag (i64 `[1]`) and the zero it is reset from.
    flag: [DevTensor; 2],
    /// The prefix captured over `prefix_fixed` with its K/V copied into `fixed` (at the first
    /// chunk), when `prefix_graph` (graphs are off only while profiling).
    prefix_graph_cell: OnceCell<Graph>,
    prefix_graph: bool,
    /// The last chunk's RTC guidance and its tensors on the device (`rtc_prev`, `rtc_weights`,
    /// each step's `rtc_step`): uploaded again only when a chunk's guidance differs.
    guidance: std::cell::RefCell<Option<OnDevice>>,
}

impl<'d> CudaPolicy<'d> {
    /// Builds the programs at `precision`, uploads their weights from `weights` (declared
    /// dtypes), runs the timestep table (exact f32) and keeps its rows on the device; the prefix
    /// and the step run their f32 products as `f32_matmul` says.
    pub fn load(
        dev: &'d Device,
        cfg: &Pi05Config,
        weights: &dyn WeightSource,
        precision: Precision,
        f32_matmul: F32Matmul,
    ) -> Result<Self> {
        let t0 = Instant::now();
        let progs = build_all(cfg, precision)?;
        let table =
            DeviceProgram::load(dev, &progs.timestep_table, weights, false).map_err(cuda)?;
        let t = table.run(BTreeMap::new()).map_err(cuda)?;
        let t = t
            .get(io::TIMESTEP_TABLE)
            .and_then(|t| t.as_f32())
            .ok_or_else(|| Error::Internal("timestep table is not f32".into()))?
            .to_vec();
        let r = time_row_len(cfg);
        let mut rows = Vec::with_capacity(cfg.steps);
        for k in 0..cfg.steps {
            let row = t
                .get(k * r..(k + 1) * r)
                .ok_or_else(|| Error::Internal("timestep table too short".into()))?;
            rows.push(
                dev.upload(&Tensor::f32(&[r], row.to_vec())?)
                    .map_err(cuda)?,
            );
        }
        // The step's weights are read every step: the host copy is not needed once uploaded.
        let mut prefix = DeviceProgram::load(dev, &progs.prefix, weights, false).map_err(cuda)?;
        let mut step = DeviceProgram::load(dev, &progs.step, weights, false).map_err(cuda)?;
        prefix.set_f32_matmul(f32_matmul);
        step.set_f32_matmul(f32_matmul);
        let [[p16, p32], [s16, s32]] =
            [&progs.prefix, &progs.step].map(petite_cuda::plan::program_flops_by_dtype);
        let (flops, flops_f32) = ([p16 + p32, s16 + s32], [p32, s32]);
        let fixed_inputs = |p: &petite_graph::Program| -> Result<BTreeMap<String, DevTensor>> {
            let mut fixed = BTreeMap::new();
            for &id in &p.inputs {
                let name = p.input_name(id).unwrap_or_default().to_string();
                let t = p
                    .node(id)
                    .tensor()
                    .ok_or_else(|| Error::Internal(format!("input {name} is a tuple")))?;
                fixed.insert(name, dev.zeros(t.dtype, &t.shape).map_err(cuda)?);
            }
            Ok(fixed)
        };
        let fixed = fixed_inputs(&progs.step)?;
        let prefix_fixed = fixed_inputs(&progs.prefix)?;
        let zero = || dev.zeros(petite_graph::Dtype::I64, &[1]).map_err(cuda);
        let flag = [zero()?, zero()?];
        // Replayed as CUDA graphs (the bf16 chunk 174.9 → 106.3 ms on the H200, c2228b2; the
        // prefix's too: 30.03 → 26.91 ms, session 20), except while profiling: events cannot be
        // read back inside a graph.
        let use_graph = dev.settings().profile == petite_cuda::Profile::Off;
        Ok(CudaPolicy {
            prefix_fixed,
            flag,
            prefix_graph_cell: OnceCell::new(),
            prefix_graph: use_graph,
            guidance: Default::default(),
            flops,
            flops_f32,
            fixed,
            graph: OnceCell::new(),
            use_graph,
            dev,
            cfg: cfg.clone(),
            prefix,
            step,
            rows,
            load_seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Bytes of weights on the device (prefix + step).
    pub fn weight_bytes(&self) -> u64 {
        self.prefix.weight_bytes() + self.step.weight_bytes()
    }

    /// Bytes of the prefix's and the step's weights.
    pub fn program_weight_bytes(&self) -> [u64; 2] {
        [self.prefix.weight_bytes(), self.step.weight_bytes()]
    }

    /// One chunk: the actions (f32 `[chunk, action_dim]`) and its times.
    pub fn chunk(&self, inputs: &Inputs) -> Result<(Vec<f32>, ChunkTimes)> {
        let cfg = &self.cfg;
        let dev = self.dev;
        let wall = Instant::now();
        let m0 = dev.mark().map_err(cuda)?;
        let s = cfg.vision.image_size;
        let up = |t: Tensor| dev.upload(&t).map_err(cuda);
        let mut pin = BTreeMap::new();
        pin.insert(
            io::IMAGES.to_string(),
            up(Tensor::f32(&[cfg.cameras, 3, s, s], inputs.images.clone())?)?,
        );
        pin.insert(
            io::IMAGE_MASKS.to_string(),
            up(Tensor::u8(&[cfg.cameras], inputs.image_masks.clone())?)?,
        );
        pin.insert(
            io::TOKENS.to_string(),
            up(Tensor::i64(&[cfg.tokens], inputs.tokens.clone())?)?,
        );
        pin.insert(
            io::TOKEN_MASK.to_string(),
            up(Tensor::u8(&[cfg.tokens], inputs.token_mask.clone())?)?,
        );
        let fixed = |n: &str| {
            self.fixed
                .get(n)
                .ok_or_else(|| petite_cuda::Error::Plan(format!("the step has no input {n}")))
        };
        // The prefix: replayed as one graph from fixed buffers (its K/V copied into the step's
        // inputs inside it), or queued node by node.
        let kv = if self.prefix_graph {
            for (name, t) in &pin {
                let dst = self
                    .prefix_fixed
                    .get(name)
                    .ok_or_else(|| Error::Internal(format!("the prefix has no input {name}")))?;
                dev.copy(t, dst).map_err(cuda)?;
            }
            if self.prefix_graph_cell.get().is_none() {
                let [flag, zero] = &self.flag;
                let ((), g) = dev
                    .capture(|| {
                        dev.copy(zero, flag)?;
                        let kv = self
                            .prefix
                            .run_device_flagged(self.prefix_fixed.clone(), Some(flag))?;
                        for (name, t) in &kv {
                            dev.copy(t, fixed(name)?)?;
                        }
                        Ok(())
                    })
                    .map_err(cuda)?;
                let _ = self.prefix_graph_cell.set(g);
            }
            self.prefix_graph_cell
                .get()
                .ok_or_else(|| Error::Internal("no prefix graph".into()))?
                .launch()
                .map_err(cuda)?;
            None
        } else {
            Some(self.prefix.run_device(pin).map_err(cuda)?)
        };
        let m1 = dev.mark().map_err(cuda)?;
        let noise = up(Tensor::f32(
            &[cfg.chunk, cfg.action_dim],
            inputs.noise.clone(),
        )?)?;
        let mut cached = self.guidance.borrow_mut();
        if cached.as_ref().is_none_or(|c| c.0 != inputs.guidance) {
            let g = &inputs.guidance;
            let prev = up(Tensor::f32(&[cfg.chunk, cfg.action_dim], g.prev.clone())?)?;
            let weights = up(Tensor::f32(&[cfg.chunk, 1], g.weights.clone())?)?;
            if self.use_graph {
                dev.copy(&prev, fixed(io::RTC_PREV).map_err(cuda)?)
                    .map_err(cuda)?;
                dev.copy(&weights, fixed(io::RTC_WEIGHTS).map_err(cuda)?)
                    .map_err(cuda)?;
            }
            let rows = g
                .steps
                .chunks_exact(2)
                .map(|r| up(Tensor::f32(&[2], r.to_vec())?))
                .collect::<Result<Vec<_>>>()?;
            *cached = Some((g.clone(), [prev, weights], rows));
        }
        let Some((_, [prev, weights], rtc_rows)) = cached.as_ref() else {
            return Err(Error::Internal("no RTC guidance on the device".into()));
        };
        let x = if self.use_graph {
            if let Some(kv) = &kv {
                for (name, t) in kv {
                    dev.copy(t, fixed(name).map_err(cuda)?).map_err(cuda)?;
                }
            }
            let xb = fixed(io::X_T).map_err(cuda)?;
            dev.copy(&noise, xb).map_err(cuda)?;
            if self.graph.get().is_none() {
                let ((), g) = dev
                    .capture(|| {
                        let mut out = self.step.run_device(self.fixed.clone())?;
                        let xn = out.remove(io::X_NEXT).ok_or_else(|| {
                            petite_cuda::Error::Plan("step program has no x_next".into())
                        })?;
                        dev.copy(&xn, xb)
                    })
                    .map_err(cuda)?;
                let _ = self.graph.set(g);
            }
            let g = self
                .graph
                .get()
                .ok_or_else(|| Error::Internal("no step graph".into()))?;
            let rb = fixed(io::TIME_ROW).map_err(cuda)?;
            let sb = fixed(io::RTC_STEP).map_err(cuda)?;
            for (row, rtc_step) in self.rows.iter().zip(rtc_rows) {
                dev.copy(row, rb).map_err(cuda)?;
                dev.copy(rtc_step, sb).map_err(cuda)?;
                g.launch().map_err(cuda)?;
            }
            xb.clone()
        } else {
            let kv = kv.ok_or_else(|| Error::Internal("the prefix ran as a graph".into()))?;
            let mut x = noise;
            for (row, rtc_step) in self.rows.iter().zip(rtc_rows) {
                let mut sin = kv.clone();
                sin.insert(io::X_T.to_string(), x);
                sin.insert(io::TIME_ROW.to_string(), row.clone());
                sin.insert(io::RTC_PREV.to_string(), prev.clone());
                sin.insert(io::RTC_WEIGHTS.to_string(), weights.clone());
                sin.insert(io::RTC_STEP.to_string(), rtc_step.clone());
                let mut out = self.step.run_device(sin).map_err(cuda)?;
                x = out
                    .remove(io::X_NEXT)
                    .ok_or_else(|| Error::Internal("step program has no x_next".into()))?;
            }
            x
        };
        let m2 = dev.mark().map_err(cuda)?;
        let actions = dev
            .download(&x)
            .map_err(cuda)?
            .into_float_values()
            .map_err(|t| Error::Internal(format!("x_next is {}, not float", t.dtype())))?;
        let m3 = dev.mark().map_err(cuda)?;
        dev.synchronize().map_err(cuda)?;
        if self.prefix_graph {
            // The prefix's embedding indices, checked once the chunk has run.
            self.prefix.check_indices(&self.flag[0]).map_err(cuda)?;
        }
        let times = ChunkTimes {
            prefix_ms: m0.ms_to(&m1).map_err(cuda)?,
            steps_ms: m1.ms_to(&m2).map_err(cuda)?,
            total_ms: m0.ms_to(&m3).map_err(cuda)?,
            wall_ms: wall.elapsed().as_secs_f64() * 1e3,
        };
        Ok((actions, times))
    }
}
