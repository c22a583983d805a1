//! Which of pi0.5's weights `--weights int8|fp8` quantizes (issue 51), and the rewrite of the
//! programs that does it ([`petite_graph::quant::quantize_weights`]).
//!
//! The rule: the linear layers of the transformer blocks of Gemma (the VLM's language model)
//! and of the action expert — their `q/k/v/o_proj` and `gate/up/down_proj` weights, 2.3 of the
//! 3.35 B parameters. SigLIP, the embeddings (the token table the tied lm_head shares), the
//! norms, the projections in and out of the expert and everything computed in attention stay
//! in the activation dtype: that is where the public ports keep bf16 too, and where
//! quantization error would reach every token or the action output directly.

use petite_graph::quant::{Quant, Quantized, quantize_weights};

use crate::names::{EXPERT, LANGUAGE};
use crate::{Error, Programs, Result};

/// Whether the default rule quantizes checkpoint tensor `name` (canonical name).
pub fn quantized_by_default(name: &str) -> bool {
    let in_blocks = [LANGUAGE, EXPERT].iter().any(|stem| {
        name.strip_prefix(stem)
            .is_some_and(|rest| rest.starts_with("layers."))
    });
    in_blocks && name.ends_with("_proj.weight")
}

/// `pattern` (`*` matches any run of characters, everything else itself) matches all of `name`.
pub fn glob(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for p in middle {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// The prefix and step programs with the rule's weights quantized to `quant`, but for those
/// matching a `skip` pattern ([`glob`]). The timestep table (run once, at export) keeps its
/// weights. A skip pattern matching none of the rule's weights is an error naming it.
pub fn quantize(progs: &Programs, quant: Quant, skip: &[String]) -> Result<(Programs, Quantized)> {
    let mut used = vec![false; skip.len()];
    let mut select = |name: &str| {
        if !quantized_by_default(name) {
            return false;
        }
        let mut keep = false;
        for (i, p) in skip.iter().enumerate() {
            if glob(p, name) {
                used[i] = true;
                keep = true;
            }
        }
        !keep
    };
    let (prefix, a) = quantize_weights(&progs.prefix, quant, |w| select(&w.name))?;
    let (step, b) = quantize_weights(&progs.step, quant, |w| select(&w.name))?;
    if let Some(i) = used.iter().position(|u| !u) {
        return Err(Error::QuantizeSkip(skip[i].clone()));
    }
    let mut names = a.names;
    names.extend(b.names);
    Ok((
        Programs {
            timestep_table: progs.timestep_table.clone(),
            prefix,
            step,
        },
        Quantized {
            names,
            bytes_before: a.bytes_before + b.bytes_before,
            bytes_after: a.bytes_after + b.bytes_after,
        },
    ))
}

/// The layer group of a weight the rule quantizes: `vlm attention`, `vlm mlp`, `expert
/// attention`, `expert mlp` (`None` for any other weight).
pub fn group(name: &str) -> Option<&'static str> {
    if !quantized_by_default(name) {
        return None;
    }
    let expert = name.starts_with(EXPERT);
    let mlp = name.contains(".mlp.");
    Some(match (expert, mlp) {
        (false, false) => "vlm attention",
        (false, true) => "vlm mlp",
        (true, false) => "expert attention",
        (true, true) => "expert mlp",
    })
}

/// One scale a row (what the export does) or one for the whole tensor (the comparison that
/// shows why not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// A scale per output channel.
    PerRow,
    /// One scale for the tensor: its largest magnitude over the format's.
    PerTensor,
}

/// The quantization error of one layer group's weights against the checkpoint's values.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GroupError {
    /// [`group`]'s name.
    pub group: String,
    /// Tensors in the group.
    pub tensors: usize,
    /// Their elements.
    pub params: u64,
    /// ‖dequantized − original‖ / ‖original‖ over the group (large rows weigh most).
    pub rel_rms: f64,
    /// The root mean square over the group's rows of each row's ‖error‖ / ‖row‖ (rows of
    /// zeros left out): every output channel weighs the same, so a scale that fits a few
    /// large channels and crushes the rest shows here.
    pub row_rel_rms: f64,
    /// The largest |dequantized − original| of one element.
    pub max_abs: f64,
}

/// Quantizes each weight of `names` read from `src` as `quant` at `granularity`, dequantizes
/// it and measures the error against the stored values, summed by [`group`] (names outside
/// every group count under `other`). Reads each tensor row by row (one row widened at a time;
/// per tensor, a first pass finds its largest magnitude) and gives its pages back after it. A
/// non-finite value is an error naming the tensor.
pub fn weight_errors<S: petite_weights::WeightSource + ?Sized>(
    src: &S,
    names: &[String],
    quant: Quant,
    granularity: Granularity,
) -> Result<Vec<GroupError>> {
    /// One group's sums.
    #[derive(Default)]
    struct Sums {
        tensors: usize,
        params: u64,
        err2: f64,
        w2: f64,
        max_abs: f64,
        row_rel2: f64,
        rows: u64,
    }
    let mut acc: Vec<(&'static str, Sums)> = Vec::new();
    let (mut wide, mut codes) = (Vec::new(), Vec::new());
    for name in names {
        let view = src.tensor(name)?;
        if !view.dtype.is_float() {
            return Err(Error::Internal(format!(
                "`{name}`: {} is not a float dtype",
                view.dtype
            )));
        }
        let es = view.dtype.size();
        let row = view.shape.iter().skip(1).product::<usize>().max(1);
        let widen = |r: &[u8], out: &mut Vec<f32>| {
            out.clear();
            out.extend(
                r.chunks_exact(es)
                    .map(|c| petite_dtype::f32_from_le(view.dtype, c).unwrap_or(f32::NAN)),
            );
        };
        let bad = |e: petite_dtype::quant::NonFinite| {
            Error::Internal(format!("`{name}`: cannot quantize: {e}"))
        };
        let tensor_scale = match granularity {
            Granularity::PerRow => None,
            Granularity::PerTensor => {
                let mut amax = 0f32;
                for r in view.bytes.chunks(row * es) {
                    widen(r, &mut wide);
                    quant.row_scale(&wide).map_err(bad)?; // finite, or an error
                    amax = wide.iter().fold(amax, |m, x| m.max(x.abs()));
                }
                Some(quant.scale_for(amax))
            }
        };
        let g = group(name).unwrap_or("other");
        let i = match acc.iter().position(|a| a.0 == g) {
            Some(i) => i,
            None => {
                acc.push((g, Sums::default()));
                acc.len() - 1
            }
        };
        let a = &mut acc[i].1;
        a.tensors += 1;
        a.params += (view.bytes.len() / es) as u64;
        for r in view.bytes.chunks(row * es) {
            widen(r, &mut wide);
            codes.clear();
            let scale = match tensor_scale {
                Some(s) => {
                    codes.extend(wide.iter().map(|&x| quant.quantize(x, s)));
                    s
                }
                None => quant.quantize_row(&wide, &mut codes).map_err(bad)?,
            };
            let (mut re2, mut rw2) = (0f64, 0f64);
            for (&x, &c) in wide.iter().zip(&codes) {
                let e = (quant.dequantize(c, scale) - x) as f64;
                re2 += e * e;
                rw2 += (x as f64) * (x as f64);
                a.max_abs = a.max_abs.max(e.abs());
            }
            a.err2 += re2;
            a.w2 += rw2;
            if rw2 > 0.0 {
                a.row_rel2 += re2 / rw2;
                a.rows += 1;
            }
        }
        src.release(&[name.as_str()])?;
    }
    let root = |num: f64, den: f64| if den > 0.0 { (num / den).sqrt() } else { 0.0 };
    Ok(acc
        .into_iter()
        .map(|(group, a)| GroupError {
            group: group.to_string(),
            tensors: a.tensors,
            params: a.params,
            rel_rms: root(a.err2, a.w2),
            row_rel_rms: root(a.row_rel2, a.rows as f64),
            max_abs: a.max_abs,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Pi05Config, Precision, build_all};

    /// Trained LLM weights have a few channels far larger than the rest. With outlier rows
    /// planted (every 16th row `ratio`× the others), one scale a row keeps every row's
    /// relative error where it was. One scale for the tensor spends INT8's codes on the
    /// outliers (ratio 2000: the ordinary rows round to code 0); FP8, a float, holds a
    /// ratio of 2000 per tensor too and collapses only past its range (ratio 10⁶: the
    /// ordinary rows fall below its subnormals, 2⁻⁹ of the scale).
    #[test]
    fn per_row_scales_hold_on_outlier_channels_where_per_tensor_fail() {
        let (rows, row) = (64, 96);
        let name = format!("{EXPERT}layers.0.mlp.up_proj.weight");
        let measure = |ratio: f32, q: Quant, g: Granularity| -> f64 {
            let values: Vec<f32> = (0..rows * row)
                .map(|i| {
                    let x = ((i * 7919) % 1000) as f32 / 500.0 - 1.0;
                    if (i / row) % 16 == 3 {
                        x * 0.02 * ratio
                    } else {
                        x * 0.02
                    }
                })
                .collect();
            let mut m = petite_reference::MemoryWeights::new();
            m.insert_f32(&name, &[rows, row], &values).unwrap();
            let e = weight_errors(&m, std::slice::from_ref(&name), q, g).unwrap();
            assert_eq!(e.len(), 1);
            assert_eq!(e[0].group, "expert mlp");
            assert_eq!(e[0].params, (rows * row) as u64);
            e[0].row_rel_rms
        };
        for (q, collapse) in [(Quant::Int8, 2e3), (Quant::Fp8E4M3, 1e6)] {
            let plain = measure(1.0, q, Granularity::PerRow);
            for ratio in [2e3, 1e6] {
                let row = measure(ratio, q, Granularity::PerRow);
                let tensor = measure(ratio, q, Granularity::PerTensor);
                eprintln!(
                    "{q} ratio {ratio:e}: row-relative RMS error per row {plain:.2e} without \
                     outliers, {row:.2e} with; per tensor {tensor:.2e}"
                );
                // Per row: the outliers change no ordinary row's error.
                assert!(row <= plain * 1.01, "{q} {ratio}: {row} vs {plain}");
                if ratio >= collapse {
                    // Per tensor: the ordinary rows' error grows tenfold and more.
                    assert!(tensor > 10.0 * row, "{q} {ratio}: {tensor} vs {row}");
                } else {
                    assert!(tensor < 1.1 * row, "{q} {ratio}: {tensor} vs {row}");
                }
            }
        }
    }

    #[test]
    fn glob_matches_whole_names() {
        assert!(glob("a*c", "abc") && glob("a*c", "ac") && glob("*", "") && glob("x", "x"));
        assert!(!glob("a*c", "abcd") && !glob("x", "xy") && !glob("*b*b", "ab"));
        assert!(glob("*.layers.1.*", "m.layers.1.mlp.up_proj.weight"));
        assert!(!glob("*.layers.1.*", "m.layers.11.mlp.up_proj.weight"));
    }

    #[test]
    fn the_rule_quantizes_the_blocks_linears_of_both_gemmas_only() {
        let cfg = Pi05Config::small();
        let progs = build_all(&cfg, Precision::Bf16).unwrap();
        let (q, done) = quantize(&progs, Quant::Int8, &[]).unwrap();
        // Every block linear the programs read (the VLM's last layer gives the expert only its
        // keys and values: its q/o/MLP are read by no program), and nothing else.
        let mut want: Vec<String> = [&progs.prefix, &progs.step]
            .iter()
            .flat_map(|p| p.weights())
            .map(|w| w.name)
            .filter(|n| quantized_by_default(n))
            .collect();
        want.dedup();
        let per_layer = 7;
        let layers = cfg.language.depth + cfg.expert.depth;
        assert_eq!(want.len(), per_layer * layers - 5);
        assert_eq!(done.names, want);
        assert!(done.bytes_after * 2 < done.bytes_before + done.bytes_before / 10);
        for p in [&q.prefix, &q.step] {
            for w in p.weights() {
                let vision_or_embed = w.name.contains("vision_tower")
                    || w.name.contains("embed_tokens")
                    || w.name.contains("norm");
                if vision_or_embed {
                    assert!(w.dtype.is_float(), "{} stays float", w.name);
                }
            }
        }
        // Skipping a layer keeps its linears; a pattern matching nothing is refused by name.
        let skip = vec!["*.layers.0.*".to_string()];
        let (_, fewer) = quantize(&progs, Quant::Fp8E4M3, &skip).unwrap();
        assert_eq!(fewer.names.len(), want.len() - 2 * per_layer);
        let e = quantize(&progs, Quant::Int8, &["*vision_tower*".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`*vision_tower*` matches no weight"), "{e}");
    }
}
