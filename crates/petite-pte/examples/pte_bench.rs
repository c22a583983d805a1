//! The process `cargo xtask bench pte` runs under memcap:
//!
//! * `pte_bench gen DIR N BYTES`: writes N generated engine files of BYTES each (deterministic
//!   pseudo-random content, not sparse, so a copy really moves every byte);
//! * `pte_bench write OUT.pte SRC...`: one program, two methods, each source stored once as named
//!   data and used by delegates in both methods; prints the write summary and this process's
//!   peak RSS;
//! * `pte_bench verify OUT.pte N BYTES`: reopens the file and compares every named segment with the
//!   regenerated content (streamed), checking that segments sit past 4 GiB (64-bit offsets).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use petite_pte::model::{CompileSpec, ScalarType};
use petite_pte::{DelegateSpec, MethodBuilder, Processed, ProgramBuilder, PteFile, SegmentData};

const CHUNK: usize = 1 << 20;

/// Fills `buf` with the content of engine `file` at byte `offset` (offset multiple of 8).
fn fill(file: u64, offset: u64, buf: &mut [u8]) {
    for (k, w) in buf.chunks_mut(8).enumerate() {
        let mut x = (offset / 8 + k as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(file.wrapping_mul(0xD1B5_4A32_D192_ED03));
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        let b = x.to_le_bytes();
        w.copy_from_slice(&b[..w.len()]);
    }
}

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn generate(dir: PathBuf, n: u64, bytes: u64) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(&dir)?;
    let mut buf = vec![0u8; CHUNK];
    for i in 0..n {
        let mut w =
            BufWriter::with_capacity(CHUNK, File::create(dir.join(format!("engine-{i}.plan")))?);
        let mut off = 0u64;
        while off < bytes {
            let k = ((bytes - off) as usize).min(CHUNK);
            fill(i, off, &mut buf[..k]);
            w.write_all(&buf[..k])?;
            off += k as u64;
        }
        w.flush()?;
    }
    Ok(())
}

fn write(out: PathBuf, srcs: Vec<PathBuf>) -> Result<(), Box<dyn std::error::Error>> {
    let mut pb = ProgramBuilder::new();
    let mut engines = Vec::new();
    for (i, s) in srcs.iter().enumerate() {
        let key = format!("engine-{i}");
        // Page-aligned, so the runtime can map an engine in place.
        pb.add_named_data(&key, SegmentData::file(s)?, 4096)?;
        // The delegate blob names its engine; the engine itself is stored once as named data.
        let blob = pb.add_segment(SegmentData::bytes(format!("TR03{key}").into_bytes()), 16)?;
        engines.push(blob);
    }
    for name in ["prefix", "step"] {
        let mut m = MethodBuilder::new(name);
        let x = m.planned_tensor(ScalarType::BFLOAT16, &[1, 1024])?;
        let mut prev = x;
        for blob in &engines {
            let y = m.planned_tensor(ScalarType::BFLOAT16, &[1, 1024])?;
            let d = m.delegate(DelegateSpec {
                id: "TensorRTBackend".into(),
                processed: Processed::Segment(*blob),
                compile_specs: vec![CompileSpec {
                    key: "device_id".into(),
                    value: vec![0],
                }],
            });
            m.delegate_call(d, &[prev, y]);
            prev = y;
        }
        m.inputs(&[x]);
        m.outputs(&[prev]);
        pb.add_method(m)?;
    }
    let t = std::time::Instant::now();
    let s = pb.write(&out, Default::default())?;
    println!(
        "{{\"file_len\":{},\"segment_data_size\":{},\"in_kernel\":{},\"buffered\":{},\"write_s\":{:.3},\"vm_hwm_kib\":{}}}",
        s.file_len,
        s.segment_data_size,
        s.bytes_copied_in_kernel,
        s.bytes_copied_buffered,
        t.elapsed().as_secs_f64(),
        vm_hwm_kib()
    );
    Ok(())
}

fn verify(path: PathBuf, n: u64, bytes: u64) -> Result<(), Box<dyn std::error::Error>> {
    let f = PteFile::open(&path)?;
    let mut got = vec![0u8; CHUNK];
    let mut want = vec![0u8; CHUNK];
    let mut max_end = 0u64;
    let file = File::open(&path)?;
    for i in 0..n {
        let seg = f
            .named_segment(&format!("engine-{i}"))
            .ok_or(format!("engine-{i} missing"))?;
        let (at, len) = f.segment_range(seg)?;
        if len != bytes {
            return Err(format!("engine-{i}: {len} bytes, expected {bytes}").into());
        }
        max_end = max_end.max(at + len);
        let mut off = 0u64;
        while off < len {
            let k = ((len - off) as usize).min(CHUNK);
            file.read_exact_at(&mut got[..k], at + off)?;
            fill(i, off, &mut want[..k]);
            if got[..k] != want[..k] {
                return Err(format!("engine-{i}: bytes differ near offset {off}").into());
            }
            off += k as u64;
        }
    }
    if n * bytes > 1 << 32 && max_end <= 1 << 32 {
        return Err(format!("segments end at {max_end}, not past 4 GiB").into());
    }
    println!(
        "{{\"verified_segments\":{n},\"max_segment_end\":{max_end},\"vm_hwm_kib\":{}}}",
        vm_hwm_kib()
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    match a.first().map(String::as_str) {
        Some("gen") if a.len() == 4 => generate(a[1].clone().into(), a[2].parse()?, a[3].parse()?),
        Some("write") if a.len() >= 3 => write(
            a[1].clone().into(),
            a[2..].iter().map(PathBuf::from).collect(),
        ),
        Some("verify") if a.len() == 4 => verify(a[1].clone().into(), a[2].parse()?, a[3].parse()?),
        _ => Err("usage: pte_bench gen DIR N BYTES | write OUT SRC... | verify OUT N BYTES".into()),
    }
}
