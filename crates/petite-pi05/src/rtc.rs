//! Real-time chunking (RTC), lerobot 0.6.1's guided mode, as inputs of the step program.
//!
//! While a robot executes the previous chunk, the next is computed; RTC guides the new chunk's
//! first rows toward what is left of the previous one so the two blend. lerobot's
//! `RTCProcessor.denoise_step` does, at every Euler step at time `t` (1 → 0), after the
//! expert's velocity `v`:
//!
//! ```text
//! x1  = x_t − t·v
//! err = (prev − x1)·w          w: one weight per row, from the prefix-attention schedule
//! v  ← v − g·err               g = min(c·r, max_guidance_weight), τ = 1 − t,
//!                              c = (1 − τ)/τ, r = ((1 − τ)² + τ²)/(1 − τ)² (∞ → the max)
//! ```
//!
//! (its autograd "correction" is `err` itself: `v` is computed before `x_t` requires a
//! gradient, so `∂x1/∂x_t` is the identity). The step program takes `prev` (`rtc_prev`, the
//! leftover zero-padded to `[chunk, action_dim]` as lerobot pads it), `w` (`rtc_weights`,
//! `[chunk, 1]`) and `[t, g]` (`rtc_step`, per step) and folds the guidance into its Euler
//! update, so RTC is the same program on every backend and inside the CUDA step graph. Without
//! RTC all three are zeros: `g·err` is then ±0 and `v − 0 = v` exactly, so a plain chunk's bits
//! are the program's without the guidance.
//!
//! The schedule's weights and `g` are computed here in f32 as lerobot computes them
//! (`get_prefix_weights`, `torch.linspace`, `torch.expm1`, `nan_to_num`).

use crate::config::Pi05Config;
use crate::{Error, Result};

/// lerobot's `RTCAttentionSchedule`: how the guidance fades along the leftover.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "UPPERCASE")]
pub enum Schedule {
    /// Weight 1 on the first `inference_delay` rows, 0 after.
    Zeros,
    /// Weight 1 up to the execution horizon, 0 after.
    Ones,
    /// 1 on the delayed rows, then a linear ramp down to the horizon, 0 after (lerobot's
    /// default).
    #[default]
    Linear,
    /// As `Linear`, the ramp shaped by `w·expm1(w)/(e − 1)`.
    Exp,
}

impl Schedule {
    /// lerobot's name (`RTCAttentionSchedule`'s value).
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Zeros => "ZEROS",
            Schedule::Ones => "ONES",
            Schedule::Linear => "LINEAR",
            Schedule::Exp => "EXP",
        }
    }
}

impl std::str::FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_uppercase().as_str() {
            "ZEROS" => Ok(Schedule::Zeros),
            "ONES" => Ok(Schedule::Ones),
            "LINEAR" => Ok(Schedule::Linear),
            "EXP" => Ok(Schedule::Exp),
            _ => Err(format!(
                "expected one of ZEROS, ONES, LINEAR, EXP (lerobot's RTCAttentionSchedule), found `{s}`"
            )),
        }
    }
}

/// lerobot's `RTCConfig` defaults: `LINEAR`, `max_guidance_weight` 10, `execution_horizon` 10.
pub const DEFAULT_MAX_GUIDANCE_WEIGHT: f32 = 10.0;
/// lerobot's default execution horizon.
pub const DEFAULT_EXECUTION_HORIZON: usize = 10;

/// The RTC settings a call leaves out: the policy folder's `rtc_config` when it has one, else
/// lerobot's `RTCConfig` defaults. Carried in `policy.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RtcDefaults {
    /// `prefix_attention_schedule`.
    pub schedule: Schedule,
    /// `max_guidance_weight`.
    pub max_guidance_weight: f32,
    /// `execution_horizon`.
    pub execution_horizon: usize,
    /// Where they came from (`config.json`'s `rtc_config`, or lerobot's defaults).
    pub from: String,
}

impl Default for RtcDefaults {
    fn default() -> Self {
        RtcDefaults {
            schedule: Schedule::Linear,
            max_guidance_weight: DEFAULT_MAX_GUIDANCE_WEIGHT,
            execution_horizon: DEFAULT_EXECUTION_HORIZON,
            from: "lerobot 0.6.1's RTCConfig defaults".into(),
        }
    }
}

/// One call's RTC request, in model space.
#[derive(Debug, Clone, PartialEq)]
pub struct Rtc {
    /// The previous chunk's actions not yet executed, f32 `[rows, cols]` row-major, normalized
    /// (what `predict_action_chunk` returned); `rows ≤ chunk`, `cols ≤` the model's action
    /// width. Zero-padded to `[chunk, action_dim]` as lerobot pads it.
    pub prev_chunk_left_over: Vec<f32>,
    /// Rows of the leftover.
    pub rows: usize,
    /// Columns of the leftover.
    pub cols: usize,
    /// Actions executed while this chunk is computed (lerobot's `inference_delay`).
    pub inference_delay: usize,
    /// Rows of the new chunk guided by the leftover (clamped to `rows`, as lerobot does).
    pub execution_horizon: usize,
    /// How the guidance fades.
    pub schedule: Schedule,
    /// The guidance's upper bound (> 0).
    pub max_guidance_weight: f32,
}

/// The step program's RTC inputs for one chunk: zeros when the chunk is plain.
#[derive(Debug, Clone, PartialEq)]
pub struct Guidance {
    /// f32 `[chunk, action_dim]`: the leftover, zero-padded (`rtc_prev`).
    pub prev: Vec<f32>,
    /// f32 `[chunk]`: the schedule's weight per row (`rtc_weights`, `[chunk, 1]` in the step).
    pub weights: Vec<f32>,
    /// f32 `[steps, 2]`: per Euler step, its time `t` and guidance weight `g` (`rtc_step`).
    pub steps: Vec<f32>,
}

fn bad(field: &str, expected: impl Into<String>, found: impl Into<String>) -> Error {
    Error::Rtc {
        field: field.to_string(),
        expected: expected.into(),
        found: found.into(),
    }
}

impl Guidance {
    /// No guidance: the plain chunk. The weights are zero (so `err` and the correction are ±0);
    /// the steps' `[t, g]` are lerobot's defaults', so a runtime that keeps them on the device
    /// need not upload them again when plain and guided chunks (of the default weight)
    /// alternate.
    pub fn none(cfg: &Pi05Config) -> Guidance {
        Guidance {
            prev: vec![0.0; cfg.chunk * cfg.action_dim],
            weights: vec![0.0; cfg.chunk],
            steps: step_rows(cfg, DEFAULT_MAX_GUIDANCE_WEIGHT),
        }
    }

    /// Whether this is the plain chunk (no row weighted, or no step guided).
    pub fn is_none(&self) -> bool {
        self.weights.iter().all(|&w| w == 0.0)
            || self.steps.iter().skip(1).step_by(2).all(|&g| g == 0.0)
    }

    /// The inputs for `rtc`, every field checked (one error naming it).
    pub fn new(cfg: &Pi05Config, rtc: &Rtc) -> Result<Guidance> {
        let (chunk, width) = (cfg.chunk, cfg.action_dim);
        if rtc.rows > chunk || rtc.cols > width {
            return Err(bad(
                "prev_chunk_left_over",
                format!("at most [{chunk}, {width}] (the chunk × the model's action width)"),
                format!("[{}, {}]", rtc.rows, rtc.cols),
            ));
        }
        if rtc.prev_chunk_left_over.len() != rtc.rows * rtc.cols {
            return Err(bad(
                "prev_chunk_left_over",
                format!(
                    "{} values for [{}, {}]",
                    rtc.rows * rtc.cols,
                    rtc.rows,
                    rtc.cols
                ),
                format!("{} values", rtc.prev_chunk_left_over.len()),
            ));
        }
        if let Some(i) = rtc.prev_chunk_left_over.iter().position(|v| !v.is_finite()) {
            return Err(bad(
                "prev_chunk_left_over",
                "finite values",
                format!("{} at index {i}", rtc.prev_chunk_left_over[i]),
            ));
        }
        let m = rtc.max_guidance_weight;
        if !(m.is_finite() && m > 0.0) {
            return Err(bad(
                "max_guidance_weight",
                "a finite number > 0",
                m.to_string(),
            ));
        }
        let mut prev = vec![0.0f32; chunk * width];
        for r in 0..rtc.rows {
            prev[r * width..r * width + rtc.cols]
                .copy_from_slice(&rtc.prev_chunk_left_over[r * rtc.cols..(r + 1) * rtc.cols]);
        }
        let horizon = rtc.execution_horizon.min(rtc.rows);
        let weights = prefix_weights(rtc.schedule, rtc.inference_delay, horizon, chunk);
        Ok(Guidance {
            prev,
            weights,
            steps: step_rows(cfg, m),
        })
    }
}

/// `[t, g]` of every Euler step: lerobot's `time = 1 + k·dt` (`dt = −1/steps`, in f64, as
/// Python computes it) as f32, and its guidance weight under `max`.
fn step_rows(cfg: &Pi05Config, max: f32) -> Vec<f32> {
    let dt = -1.0f64 / cfg.steps as f64;
    (0..cfg.steps)
        .flat_map(|k| {
            let time = 1.0 + k as f64 * dt;
            [time as f32, guidance_weight(time, max)]
        })
        .collect()
}

impl Guidance {
    /// The step program's three RTC inputs for Euler step `k` (by input name).
    pub fn step_tensors(
        &self,
        cfg: &Pi05Config,
        k: usize,
    ) -> Result<[(&'static str, petite_reference::Tensor); 3]> {
        let step = (
            crate::programs::io::RTC_STEP,
            vec![2],
            &self.steps[2 * k..2 * k + 2],
        );
        self.tensors(cfg, step)
    }

    /// The whole-policy program's three RTC inputs ([`crate::build_policy`]), by input name.
    pub fn policy_tensors(
        &self,
        cfg: &Pi05Config,
    ) -> Result<[(&'static str, petite_reference::Tensor); 3]> {
        let steps = (
            crate::programs::io::RTC_STEPS,
            vec![cfg.steps, 2],
            &self.steps[..],
        );
        self.tensors(cfg, steps)
    }

    /// The leftover and its weights, and `steps` (name, shape, values): the step's `[t, g]` or
    /// the whole policy's table of them.
    fn tensors(
        &self,
        cfg: &Pi05Config,
        (name, shape, steps): (&'static str, Vec<usize>, &[f32]),
    ) -> Result<[(&'static str, petite_reference::Tensor); 3]> {
        use crate::programs::io;
        use petite_reference::Tensor;
        Ok([
            (
                io::RTC_PREV,
                Tensor::f32(&[cfg.chunk, cfg.action_dim], self.prev.clone())?,
            ),
            (
                io::RTC_WEIGHTS,
                Tensor::f32(&[cfg.chunk, 1], self.weights.clone())?,
            ),
            (name, Tensor::f32(&shape, steps.to_vec())?),
        ])
    }
}

/// lerobot's `get_prefix_weights(start, end, total)` under `schedule`, in f32.
pub fn prefix_weights(schedule: Schedule, start: usize, end: usize, total: usize) -> Vec<f32> {
    let start = start.min(end);
    match schedule {
        Schedule::Zeros => (0..total)
            .map(|i| if i < start { 1.0 } else { 0.0 })
            .collect(),
        Schedule::Ones => (0..total)
            .map(|i| if i < end { 1.0 } else { 0.0 })
            .collect(),
        Schedule::Linear | Schedule::Exp => {
            let mut lin = lin_weights(start, end, total);
            if schedule == Schedule::Exp {
                let e1 = (std::f64::consts::E - 1.0) as f32;
                for w in &mut lin {
                    *w *= w.exp_m1() / e1;
                }
            }
            let mut w = vec![1.0f32; start.min(total)];
            w.extend(lin);
            w.extend(std::iter::repeat_n(0.0, total.saturating_sub(end)));
            w
        }
    }
}

/// `torch.linspace(1, 0, n + 2)[1:-1]` for the rows between `start` and `min(end, total)`.
fn lin_weights(start: usize, end: usize, total: usize) -> Vec<f32> {
    let skip = total.saturating_sub(end);
    let n = total as isize - skip as isize - start as isize;
    if end <= start || n <= 0 {
        return Vec::new();
    }
    linspace_1_to_0(n as usize + 2)[1..n as usize + 1].to_vec()
}

/// `torch.linspace(1, 0, steps)` in f32 as PyTorch's CPU kernel computes it: the first half
/// from the start, the second from the end.
fn linspace_1_to_0(steps: usize) -> Vec<f32> {
    let step = (0.0f32 - 1.0) / (steps - 1) as f32;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            if i < half {
                1.0 + step * i as f32
            } else {
                0.0 - step * (steps - i - 1) as f32
            }
        })
        .collect()
}

/// lerobot's guidance weight at the Euler step of time `time` (1 at the first step), in f32:
/// `min(nan_to_num(c·r, posinf=max), max)` with `τ = 1 − time`, `c = nan_to_num((1 − τ)/τ,
/// posinf=max)`, `r = ((1 − τ)² + τ²)/(1 − τ)²`.
pub fn guidance_weight(time: f64, max: f32) -> f32 {
    let tau = (1.0 - time) as f32;
    let sq = (1.0 - tau) * (1.0 - tau);
    let inv_r2 = (sq + tau * tau) / sq;
    let finite = |x: f32| {
        if x == f32::INFINITY {
            max
        } else if x.is_nan() {
            0.0
        } else {
            x
        }
    };
    let c = finite((1.0 - tau) / tau);
    finite(c * inv_r2).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_match_lerobots_get_prefix_weights() {
        // Values from lerobot 0.6.1's RTCProcessor.get_prefix_weights (torch 2.x, CPU).
        assert_eq!(
            prefix_weights(Schedule::Zeros, 3, 10, 12),
            [1., 1., 1., 0., 0., 0., 0., 0., 0., 0., 0., 0.]
        );
        assert_eq!(
            prefix_weights(Schedule::Ones, 3, 5, 8),
            [1., 1., 1., 1., 1., 0., 0., 0.]
        );
        let lin = prefix_weights(Schedule::Linear, 2, 6, 8);
        let want = [1., 1., 0.8, 0.6, 0.4, 0.2, 0., 0.];
        assert_eq!(lin.len(), 8);
        for (a, b) in lin.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{lin:?}");
        }
        // A delay past the horizon: start clamps to the horizon, no ramp.
        assert_eq!(
            prefix_weights(Schedule::Linear, 7, 4, 6),
            [1., 1., 1., 1., 0., 0.]
        );
        // A horizon past the chunk: the ramp runs to the end.
        let w = prefix_weights(Schedule::Linear, 0, 20, 4);
        assert_eq!(w.len(), 4);
        for (a, b) in w.iter().zip([0.8, 0.6, 0.4, 0.2]) {
            assert!((a - b).abs() < 1e-6, "{w:?}");
        }
        let e = prefix_weights(Schedule::Exp, 1, 3, 4);
        let ramp = |x: f32| x * x.exp_m1() / (std::f32::consts::E - 1.0);
        assert_eq!(e[0], 1.0);
        assert!((e[1] - ramp(2.0 / 3.0)).abs() < 1e-6 && (e[2] - ramp(1.0 / 3.0)).abs() < 1e-6);
        assert_eq!(e[3], 0.0);
    }

    #[test]
    fn guidance_weight_is_capped_and_infinite_at_the_start() {
        assert_eq!(guidance_weight(1.0, 10.0), 10.0);
        // τ = 0.5: c = 1, r = (0.25 + 0.25) / 0.25 = 2.
        assert!((guidance_weight(0.5, 10.0) - 2.0).abs() < 1e-6);
        assert!((guidance_weight(0.5, 1.5) - 1.5).abs() < 1e-6);
        // τ = 0.9: c = 1/9, r = (0.01 + 0.81)/0.01 = 82 → 9.11.
        assert!((guidance_weight(0.1, 10.0) - 82.0 / 9.0).abs() < 1e-4);
    }

    #[test]
    fn a_request_is_checked_and_padded() {
        let cfg = Pi05Config::small();
        let (chunk, width) = (cfg.chunk, cfg.action_dim);
        let rtc = Rtc {
            prev_chunk_left_over: (0..6).map(|i| i as f32).collect(),
            rows: 3,
            cols: 2,
            inference_delay: 1,
            execution_horizon: 10,
            schedule: Schedule::Linear,
            max_guidance_weight: 10.0,
        };
        let g = Guidance::new(&cfg, &rtc).unwrap();
        assert_eq!(g.prev.len(), chunk * width);
        assert_eq!(&g.prev[..2], &[0.0, 1.0]);
        assert_eq!(&g.prev[width..width + 2], &[2.0, 3.0]);
        assert!(g.prev[2..width].iter().all(|&v| v == 0.0));
        assert!(g.prev[3 * width..].iter().all(|&v| v == 0.0));
        // The horizon clamps to the leftover's 3 rows: 1 delayed, a ramp to the horizon, zeros
        // (lerobot: get_prefix_weights(1, 3, 5) = [1, 0.6667, 0.3333, 0, 0]).
        assert_eq!(g.weights.len(), chunk);
        assert_eq!(g.weights[0], 1.0);
        assert!((g.weights[1] - 2.0 / 3.0).abs() < 1e-6 && (g.weights[2] - 1.0 / 3.0).abs() < 1e-6);
        assert!(g.weights[3..].iter().all(|&w| w == 0.0));
        assert_eq!(g.steps.len(), 2 * cfg.steps);
        assert_eq!(g.steps[..2], [1.0, 10.0]);
        assert!(!g.is_none() && Guidance::none(&cfg).is_none());

        let err = |r: Rtc| Guidance::new(&cfg, &r).unwrap_err().to_string();
        let wide = Rtc {
            cols: width + 1,
            prev_chunk_left_over: vec![0.0; 3 * (width + 1)],
            ..rtc.clone()
        };
        assert!(err(wide).contains("prev_chunk_left_over"));
        let mut nan = rtc.clone();
        nan.prev_chunk_left_over[4] = f32::NAN;
        assert!(err(nan).contains("NaN at index 4"));
        let short = Rtc {
            prev_chunk_left_over: vec![0.0; 5],
            ..rtc.clone()
        };
        assert!(err(short).contains("6 values"));
        let zero = Rtc {
            max_guidance_weight: 0.0,
            ..rtc
        };
        assert!(err(zero).contains("max_guidance_weight"));
    }
}
