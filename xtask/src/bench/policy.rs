//! `cargo xtask bench policy`: a resident `petite::policy::Policy` acting in a loop
//! (`petite act --repeat`), against the chunk alone.
//!
//! - `--small` (the default on the CPU): the golden `two_cams_mqa` as a lerobot folder (one real
//!   camera of 64×48 + one empty, state 5, action 4, chunk 6), exported in f32 with the reference
//!   backend; a word-level tokenizer written here.
//! - full size (the default with `--device cuda`): the synthetic full-size pi0.5 (written with
//!   `petite pi05 synth` if missing) as a lerobot folder of three 224×224 cameras, 200 tokens,
//!   chunk 50, exported in bf16 with the reference backend; then, in the same run,
//!   `petite pi05 run --device cuda --dtype bf16` on the same weights (the programs built from the
//!   checkpoint, `--f32-matmul exact` as the bundle runs its f32 products, and the default TF32),
//!   so the bundle's chunk is a ratio to petite-cuda's own on the same card.
//!
//! Prints each call's median and p99 (the whole call, the chunk alone, the overhead:
//! preprocessing, queue, postprocessing), the open and the first call.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::util;

/// Options of `bench policy`.
#[derive(clap::Args)]
pub struct Args {
    /// Where the policy runs (`cuda`: GPU 0).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The small golden policy even on a GPU (full size is the default there).
    #[arg(long)]
    pub small: bool,
    /// Calls timed after the first.
    #[arg(long, default_value_t = 50)]
    pub repeat: usize,
    /// Keep the files (export, observation, timings) in this folder.
    #[arg(long)]
    pub keep: Option<PathBuf>,
    /// Also act once on the CPU and fail unless the device's actions are within the export
    /// dtype's bound of them (1e-4 for f32, 5e-2 for bf16; NaN, length mismatch fail).
    #[arg(long)]
    pub check_cpu: bool,
    /// A Python that imports `petite` (the package: `pip install crates/petite-python`) and
    /// numpy: adds the rows of `petite.Policy` (in-process) and `petite.Client` against `petite
    /// serve` on loopback, each checked equal to the Rust row's actions. Without it those rows
    /// are not measured (said in the output).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// `petite export --engine-cap` of the bundle (default: the export's, 512 MiB): a cap
    /// above a program's weights makes each program one engine, to see what the engines'
    /// boundaries cost a chunk.
    #[arg(long, value_name = "SIZE")]
    pub engine_cap: Option<String>,
    /// `petite export --weights` of the full-size bundle: `int8` or `fp8` quantize Gemma's and
    /// the expert's linears (issue 51); the chunk, the device memory and `--check-cpu` then
    /// measure the quantized bundle (its CPU actions from the same quantized export).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "int8", "fp8"])]
    pub weights: String,
}

/// What `cmd` held while it ran: the most memory GPU 0 had in use (MiB, as `nvidia-smi`
/// reports it: the context, libraries, weights and buffers, less what was in use before it
/// started; `None` where `nvidia-smi` does not answer), polled once a second — each poll starts
/// a process on the machine whose calls are being timed —, and the most host memory it held
/// (its VmHWM, KiB, read from `/proc` every 100 ms from 100 ms on; `None` for a process gone
/// by then: mapped weight pages count while resident, so a runtime that keeps the weights
/// both in the page cache and on the GPU shows them twice).
fn run_measuring_memory(cmd: &mut Command) -> Result<(Option<u64>, Option<u64>)> {
    let used = || -> Option<u64> {
        let out = Command::new("nvidia-smi")
            .args([
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-i",
                "0",
            ])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    let rss = |pid: u32| -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
        l.split_whitespace().nth(1)?.parse().ok()
    };
    let before = used();
    eprintln!("xtask: {cmd:?}");
    let mut child = cmd.spawn().with_context(|| format!("starting {cmd:?}"))?;
    let (mut most, mut host) = (before, None);
    let mut tick = 0u64;
    let status = loop {
        // After the first sleep: the child has run its own program by then (not the fork's).
        if tick > 0 {
            host = host.max(rss(child.id()));
        }
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if tick.is_multiple_of(10) {
            most = most.max(used());
        }
        tick += 1;
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    anyhow::ensure!(status.success(), "{cmd:?} failed ({status})");
    let gpu = match (before, most) {
        (Some(b), Some(m)) => Some(m.saturating_sub(b)),
        _ => None,
    };
    Ok((gpu, host))
}

/// Each timed call's chunk alone (ms), the first call left out, from `petite act --timing-json`.
fn chunk_ms(timing: &Path) -> Result<Vec<f64>> {
    let t: Value = serde_json::from_slice(&std::fs::read(timing)?)?;
    let calls = t["calls"].as_array().context("timing JSON has no calls")?;
    Ok(calls
        .iter()
        .skip(1)
        .filter_map(|c| c["chunk_s"].as_f64())
        .map(|s| s * 1e3)
        .collect())
}

/// The Python rows' script (`policy_faces.py` beside this file).
const FACES_PY: &str = include_str!("policy_faces.py");

fn actions(path: &Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    Ok(st
        .tensor("action")?
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A word-level `tokenizer.json` whose ids (< 64) fit any pi0.5's vocabulary: the prompt's
/// length in tokens is what matters to the chunk, not the words.
fn write_tokenizer(path: &Path) -> Result<()> {
    let mut vocab = serde_json::Map::new();
    for (i, w) in [
        "<pad>", "[UNK]", "Task", ":", "State", ",", ";", "Action", "pick", "up", "the", "cube",
    ]
    .iter()
    .enumerate()
    {
        vocab.insert(w.to_string(), json!(i));
    }
    for b in -1..=40 {
        vocab.insert(b.to_string(), json!(12 + b + 1));
    }
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(path, tok.to_string()).with_context(|| format!("writing {}", path.display()))
}

/// An observation file: each camera a u8 `[h, w, 3]` image, the state, the task in metadata.
fn write_observation(
    path: &Path,
    cameras: &[&str],
    h: usize,
    w: usize,
    state: usize,
    leftover: Option<[usize; 2]>,
) -> Result<()> {
    let img: Vec<u8> = (0..h * w * 3).map(|i| ((i * 7) % 251) as u8).collect();
    let st: Vec<u8> = (0..state)
        .flat_map(|i| (0.1 * i as f32 - 0.2).to_le_bytes())
        .collect();
    let mut views = Vec::new();
    for c in cameras {
        views.push((
            c.to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![h, w, 3], &img)?,
        ));
    }
    views.push((
        "observation.state".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![state], &st)?,
    ));
    let prev: Vec<u8> = leftover
        .map(|[r, c]| {
            (0..r * c)
                .flat_map(|i| (0.5 * (i as f32 * 0.37).sin()).to_le_bytes())
                .collect()
        })
        .unwrap_or_default();
    if let Some([r, c]) = leftover {
        views.push((
            "rtc.prev_chunk_left_over".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![r, c], &prev)?,
        ));
    }
    let meta = [("task".to_string(), "pick up the cube".to_string())].into();
    std::fs::write(path, safetensors::serialize(views, Some(meta))?)
        .with_context(|| format!("writing {}", path.display()))
}

/// What the Python rows run on.
struct PythonRun<'a> {
    petite: &'a Path,
    dir: &'a Path,
    export: &'a Path,
    device: &'a str,
    tokenizer: &'a Path,
    cameras: &'a [&'a str],
    hw: (usize, usize),
    state: usize,
    repeat: usize,
}

/// One Python face's calls.
struct Row {
    open_s: f64,
    first_call_s: f64,
    walls: Vec<f64>,
    insides: Vec<f64>,
    actions: Vec<f32>,
}

/// `policy_faces.py` under `python`: the rows of `petite.Policy` and of `petite.Client` over
/// `petite serve`.
fn python_rows(python: &Path, r: &PythonRun<'_>) -> Result<Vec<(&'static str, Row)>> {
    let script = r.dir.join("policy_faces.py");
    std::fs::write(&script, FACES_PY)?;
    let json = r.dir.join("faces.json");
    util::run(
        Command::new(python)
            .arg(&script)
            .arg("--export")
            .arg(r.export)
            .args(["--device", r.device, "--tokenizer"])
            .arg(r.tokenizer)
            .arg("--petite")
            .arg(r.petite)
            .args(["--cameras", &r.cameras.join(",")])
            .args(["--hw", &format!("{},{}", r.hw.0, r.hw.1)])
            .args(["--state", &r.state.to_string()])
            .args(["--repeat", &r.repeat.to_string()])
            .arg("--json")
            .arg(&json),
    )?;
    let v: Value = serde_json::from_slice(&std::fs::read(&json)?)?;
    let floats = |x: &Value| -> Vec<f64> {
        x.as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default()
    };
    let mut rows = Vec::new();
    for face in ["python", "serve"] {
        let f = &v[face];
        let row = Row {
            open_s: f["open_s"].as_f64().unwrap_or(f64::NAN),
            first_call_s: f["first_call_s"].as_f64().unwrap_or(f64::NAN),
            walls: floats(&f["walls"]),
            insides: floats(&f["insides"]),
            actions: floats(&f["actions"])
                .into_iter()
                .map(|x| x as f32)
                .collect(),
        };
        anyhow::ensure!(
            row.walls.len() == r.repeat && row.insides.len() == r.repeat,
            "{face}: {} calls timed, expected {}",
            row.walls.len(),
            r.repeat
        );
        rows.push((face, row));
    }
    Ok(rows)
}

fn median_p99(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let n = v.len();
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    let k = ((0.99 * n as f64).ceil() as usize).clamp(1, n);
    (med, v[k - 1])
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    let petite = crate::conformance::petite_bin()?;
    let cuda = a.device == "cuda";
    let small = a.small || !cuda;
    let tmp = tempfile::tempdir()?;
    let dir = match &a.keep {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
            d.clone()
        }
        None => tmp.path().to_path_buf(),
    };
    let folder = dir.join("policy");
    std::fs::create_dir_all(&folder)?;
    let (cameras, h, w, state, dtype): (Vec<&str>, usize, usize, usize, &str) = if small {
        (vec!["observation.images.front"], 48, 64, 5, "f32")
    } else {
        (
            vec![
                "observation.images.base_0_rgb",
                "observation.images.left_wrist_0_rgb",
                "observation.images.right_wrist_0_rgb",
            ],
            224,
            224,
            8,
            "bf16",
        )
    };
    let mut features = serde_json::Map::new();
    for c in &cameras {
        features.insert(c.to_string(), json!({"type": "VISUAL", "shape": [3, h, w]}));
    }
    features.insert(
        "observation.state".into(),
        json!({"type": "STATE", "shape": [state]}),
    );
    let ck;
    let mut export = Command::new(&petite);
    export
        .args(["export", "--dtype", dtype, "--checkpoint"])
        .arg(&folder);
    let config = if small {
        let golden = util::root().join("testdata/pi05/two_cams_mqa");
        std::fs::copy(
            golden.join("model.safetensors"),
            folder.join("model.safetensors"),
        )?;
        export.arg("--config").arg(golden.join("config.json"));
        ck = None;
        json!({
            "type": "pi05", "n_obs_steps": 1, "input_features": features,
            "output_features": {"action": {"type": "ACTION", "shape": [4]}},
            "chunk_size": 6, "n_action_steps": 3, "max_action_dim": 8, "max_state_dim": 8,
            "num_inference_steps": 10, "image_resolution": [32, 32], "empty_cameras": 1,
            "tokenizer_max_length": 12,
            "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "IDENTITY", "ACTION": "IDENTITY"}
        })
    } else {
        let full = util::full_checkpoint(&petite)?;
        let link = folder.join("model.safetensors");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&full, &link)?;
        ck = Some(full);
        json!({
            "type": "pi05", "n_obs_steps": 1, "input_features": features,
            "output_features": {"action": {"type": "ACTION", "shape": [7]}},
            "chunk_size": 50, "n_action_steps": 50, "max_action_dim": 32, "max_state_dim": 32,
            "num_inference_steps": 10, "image_resolution": [224, 224], "empty_cameras": 0,
            "tokenizer_max_length": 200,
            "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "IDENTITY", "ACTION": "IDENTITY"}
        })
    };
    std::fs::write(folder.join("config.json"), config.to_string())?;
    let out = dir.join("export");
    export.arg("--out").arg(&out);
    if let Some(cap) = &a.engine_cap {
        export.args(["--engine-cap", cap]);
    }
    anyhow::ensure!(
        a.weights == "bf16" || !small,
        "--weights {} needs the full-size bundle (the small golden is an f32 export)",
        a.weights
    );
    if a.weights != "bf16" {
        export.args(["--weights", &a.weights]);
    }
    util::run(&mut export)?;
    let tok = dir.join("tokenizer.json");
    write_tokenizer(&tok)?;
    let obs = dir.join("observation.safetensors");
    write_observation(&obs, &cameras, h, w, state, None)?;
    let timing = dir.join("act-timing.json");
    // `petite act` on the GPU (or CPU) bench's export, `--repeat` timed calls recorded in
    // `timing`: the plain row, the host-gather A/B and the RTC row differ only in `obs`/`extra`.
    let timed_act = |obs: &Path, extra: &[&str], timing: &Path, acted: &Path| -> Command {
        let mut c = Command::new(&petite);
        c.args(["act", "--seed", "0", "--device", &a.device, "--dir"])
            .arg(&out)
            .arg("--observation")
            .arg(obs)
            .arg("--tokenizer")
            .arg(&tok)
            .args(extra)
            .args(["--repeat", &a.repeat.to_string()])
            .arg("--timing-json")
            .arg(timing)
            .arg("--out")
            .arg(acted);
        c
    };
    let (gpu_mib, host_kib) = run_measuring_memory(&mut timed_act(
        &obs,
        &[],
        &timing,
        &dir.join("actions.safetensors"),
    ))?;
    if a.check_cpu && cuda {
        let cpu_out = dir.join("actions-cpu.safetensors");
        util::run(
            Command::new(&petite)
                .args(["act", "--seed", "0", "--device", "cpu", "--dir"])
                .arg(&out)
                .arg("--observation")
                .arg(&obs)
                .arg("--tokenizer")
                .arg(&tok)
                .arg("--out")
                .arg(&cpu_out),
        )?;
        let (gpu, cpu) = (
            actions(&dir.join("actions.safetensors"))?,
            actions(&cpu_out)?,
        );
        let err = crate::conformance::gpu::max_err(&gpu, &cpu)?;
        let bound = if dtype == "f32" { 1e-4 } else { 5e-2 };
        println!(
            "policy bench: {} actions on the GPU within {err:.3e} of the CPU's (bound {bound:e})",
            gpu.len()
        );
        anyhow::ensure!(
            err <= bound,
            "the GPU's actions are {err:e} from the CPU's, past {bound:e}"
        );
    }
    let t: Value = serde_json::from_slice(&std::fs::read(&timing)?)?;
    let calls = t["calls"].as_array().context("timing JSON has no calls")?;
    let pick = |k: &str| -> Vec<f64> {
        calls[1..]
            .iter()
            .filter_map(|c| c[k].as_f64())
            .map(|s| s * 1e3)
            .collect()
    };
    let (mut total, mut chunk) = (pick("total_s"), pick("chunk_s"));
    let mut over: Vec<f64> = total.iter().zip(&chunk).map(|(a, b)| a - b).collect();
    let (tm, tp) = median_p99(&mut total);
    let (cm, cp) = median_p99(&mut chunk);
    let (om, op) = median_p99(&mut over);
    let (pre, _) = median_p99(&mut pick("preprocess_s"));
    let (queued, _) = median_p99(&mut pick("queued_s"));
    let (post, _) = median_p99(&mut pick("postprocess_s"));
    let rows = match &a.python {
        Some(py) => Some(python_rows(
            py,
            &PythonRun {
                petite: &petite,
                dir: &dir,
                export: &out,
                device: &a.device,
                tokenizer: &tok,
                cameras: &cameras,
                hw: (h, w),
                state,
                repeat: a.repeat,
            },
        )?),
        None => None,
    };
    println!(
        "policy bench ({}, {}, {} calls): a call {tm:.3} ms (p99 {tp:.3}); the chunk alone {cm:.3} ms (p99 {cp:.3}); overhead {om:.3} ms (p99 {op:.3}); open {:.3} s, first call {:.1} ms; runtime {}",
        a.device,
        if small {
            "small golden, f32".to_string()
        } else {
            format!("full size, bf16, {} weights", a.weights)
        },
        total.len(),
        t["open_s"].as_f64().unwrap_or(f64::NAN),
        t["first_call_s"].as_f64().unwrap_or(f64::NAN) * 1e3,
        t["runtime"].as_str().unwrap_or("?"),
    );
    let policy: Value = serde_json::from_slice(&std::fs::read(out.join("policy.json"))?)?;
    println!(
        "policy bench: weights in the bundle {:.3} GiB (policy.json weight_bytes); GPU memory in use while acting: {}; the act process's host memory (peak VmHWM): {}",
        policy["weight_bytes"].as_f64().unwrap_or(f64::NAN) / (1u64 << 30) as f64,
        match gpu_mib {
            Some(m) => format!(
                "{:.3} GiB at most (nvidia-smi, polled once a second, less what was in use before)",
                m as f64 / 1024.0
            ),
            None => "not measured (no nvidia-smi)".to_string(),
        },
        match host_kib {
            Some(k) => format!("{:.1} MiB", k as f64 / 1024.0),
            None => "not measured (the process ended within 100 ms)".to_string(),
        }
    );
    println!(
        "policy bench: the overhead's medians: preprocessing {pre:.3} ms, the owner thread's queue {queued:.3} ms, postprocessing {post:.3} ms"
    );
    if cuda && !small {
        // The same calls with the token embedding uploaded whole (petite-cuda's host gathers
        // off): what gathering its rows on the host saves in GPU memory, and costs a chunk.
        let off_timing = dir.join("act-timing-gather-off.json");
        let off_out = dir.join("actions-gather-off.safetensors");
        let (off_mib, off_kib) = run_measuring_memory(&mut timed_act(
            &obs,
            &["--tune", "host_gather=off"],
            &off_timing,
            &off_out,
        ))?;
        let (om, _) = median_p99(&mut chunk_ms(&off_timing)?);
        let same = actions(&off_out)? == actions(&dir.join("actions.safetensors"))?;
        println!(
            "policy bench: host gathers A/B (the same export and calls; token embedding rows gathered on the host, the default, against the table on the device): GPU memory {} against {}; the chunk {cm:.3} against {om:.3} ms ({:.3}×); host VmHWM {} against {}; actions {}",
            gpu_mib.map_or("?".into(), |m| format!("{:.3} GiB", m as f64 / 1024.0)),
            off_mib.map_or("?".into(), |m| format!("{:.3} GiB", m as f64 / 1024.0)),
            cm / om,
            host_kib.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
            off_kib.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
            if same { "the same bits" } else { "DIFFER" }
        );
        anyhow::ensure!(same, "host-gathered rows changed the actions");
    }
    // Real-time chunking: the same calls guided by a leftover of chunk − 1 rows (delay 3).
    let (chunk_len, action_dim) = if small { (6, 4) } else { (50, 7) };
    let rtc_obs = dir.join("observation-rtc.safetensors");
    write_observation(
        &rtc_obs,
        &cameras,
        h,
        w,
        state,
        Some([chunk_len - 1, action_dim]),
    )?;
    let rtc_timing = dir.join("act-rtc-timing.json");
    util::run(&mut timed_act(
        &rtc_obs,
        &["--inference-delay", "3"],
        &rtc_timing,
        &dir.join("actions-rtc.safetensors"),
    ))?;
    let (rm, rp) = median_p99(&mut chunk_ms(&rtc_timing)?);
    let guided = actions(&dir.join("actions-rtc.safetensors"))?;
    let plain = actions(&dir.join("actions.safetensors"))?;
    let moved = crate::conformance::gpu::max_err(&guided, &plain).unwrap_or(f32::NAN);
    println!(
        "policy bench: with real-time chunking (leftover [{}, {action_dim}], delay 3): the chunk alone {rm:.3} ms (p99 {rp:.3}), {:.3}× the plain chunk's {cm:.3} ms; the guided actions moved {moved:.3} from the plain ones",
        chunk_len - 1,
        rm / cm
    );
    anyhow::ensure!(
        moved > 1e-3,
        "the guided chunk is the plain one (moved {moved:e}): RTC did nothing"
    );
    let rust_actions = actions(&dir.join("actions.safetensors"))?;
    match rows {
        None => println!(
            "policy bench: the Python and serve rows were not measured (give --python: a Python with the petite package and numpy)"
        ),
        Some(rows) => {
            for (face, r) in rows {
                let same = r.actions == rust_actions;
                let err = crate::conformance::gpu::max_err(&r.actions, &rust_actions)?;
                anyhow::ensure!(
                    same || (cuda && err <= 5e-2),
                    "{face}: the actions are {err:e} from the Rust row's (same seed, same export)"
                );
                let mut walls: Vec<f64> = r.walls.iter().map(|s| s * 1e3).collect();
                let mut own: Vec<f64> = r
                    .walls
                    .iter()
                    .zip(&r.insides)
                    .map(|(w, i)| (w - i) * 1e3)
                    .collect();
                let mut vs_chunk: Vec<f64> = walls.iter().map(|w| w - cm).collect();
                let (wm, wp) = median_p99(&mut walls);
                let (xm, xp) = median_p99(&mut own);
                let (vm, vp) = median_p99(&mut vs_chunk);
                println!(
                    "policy bench: {face} ({} calls): a call {wm:.3} ms (p99 {wp:.3}); over the chunk alone ({cm:.3} ms) {vm:.3} ms (p99 {vp:.3}); of which {} {xm:.3} ms (p99 {xp:.3}); open {:.3} s, first call {:.1} ms; actions {}",
                    walls.len(),
                    if face == "python" {
                        "Python's (the call less Policy::act)"
                    } else {
                        "the transport's (the round trip less the server's time)"
                    },
                    r.open_s,
                    r.first_call_s * 1e3,
                    if same {
                        "equal to the Rust row's".to_string()
                    } else {
                        format!("within {err:.2e} of the Rust row's")
                    }
                );
            }
        }
    }
    if cuda && a.weights != "bf16" {
        println!(
            "policy bench: pi05 run not timed beside a {} bundle (it builds bf16 programs from the checkpoint): compare with a bf16 run of this bench in the same call",
            a.weights
        );
    } else if let (true, Some(ck)) = (cuda, ck) {
        let inputs = dir.join("inputs.safetensors");
        super::pi05_run::write_inputs(&inputs)?;
        for f32_matmul in ["exact", "tf32"] {
            let json = dir.join(format!("pi05-run-{f32_matmul}.json"));
            util::run(
                Command::new(&petite)
                    .args(["pi05", "run", "--device", "cuda", "--dtype", "bf16"])
                    .args(["--f32-matmul", f32_matmul])
                    .arg("--checkpoint")
                    .arg(&ck)
                    .arg("--inputs")
                    .arg(&inputs)
                    .arg("--out")
                    .arg(dir.join(format!("pi05-run-{f32_matmul}.safetensors")))
                    .args(["--repeat", &a.repeat.min(20).to_string(), "--warmup", "3"])
                    .arg("--timing-json")
                    .arg(&json),
            )?;
            let v: Value = serde_json::from_slice(&std::fs::read(&json)?)?;
            let run_ms = v["median_chunk_ms"]
                .as_f64()
                .context("no median_chunk_ms")?;
            println!(
                "policy bench: pi05 run --f32-matmul {f32_matmul} (programs from the checkpoint): {run_ms:.3} ms a chunk (device time); the bundle's chunk (wall, on the owner thread) is {:.3}× it",
                cm / run_ms
            );
        }
    }
    Ok(())
}
