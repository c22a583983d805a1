//! `petite inspect FILE.pte [--json]`: verify a `.pte` and list its methods (inputs/outputs with
//! dtype and shape, instruction counts, operators), delegates (backend, size, where the data
//! lives), named data and segments. Only the flatbuffer is read; segments stay on disk.
use std::path::PathBuf;

use anyhow::Context;
use petite::layout;
use petite_pte::summary::{Summary, TensorInfo, summarize};
use serde_json::{Value, json};

/// Arguments of `petite inspect`.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// The `.pte` file.
    pub file: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs `petite inspect`.
pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let f = petite_pte::PteFile::open(&a.file)
        .with_context(|| format!("inspecting {}", a.file.display()))?;
    let s = summarize(f.program(), f.layout());
    // A file of an export's pair: the pair and its policy.json must come from one export.
    let name = a.file.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let dir = a.file.parent().unwrap_or(std::path::Path::new("."));
    let dir = if dir.as_os_str().is_empty() {
        std::path::Path::new(".")
    } else {
        dir
    };
    if layout::PTES.contains(&name) && layout::PTES.iter().all(|p| dir.join(p).is_file()) {
        let policy = petite::bundle::check_bundle(dir)
            .with_context(|| format!("inspecting {}", a.file.display()))?;
        if let (Some(p), false) = (policy, a.json) {
            println!("bundle: {} (export id {})", p.summary(), p.export_id);
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&s))?);
    } else {
        print!("{}", s.to_text());
    }
    Ok(())
}

fn tensor_json(t: &TensorInfo) -> Value {
    json!({"index": t.index, "kind": t.kind, "dtype": t.dtype, "shape": t.shape})
}

/// The summary as JSON (field names are the output format; keep them stable).
pub fn to_json(s: &Summary) -> Value {
    json!({
        "file_len": s.file_len,
        "extended_header": s.extended_header,
        "program_size": s.program_size,
        "segment_base_offset": s.segment_base_offset,
        "methods": s.methods.iter().map(|m| json!({
            "name": m.name,
            "inputs": m.inputs.iter().map(tensor_json).collect::<Vec<_>>(),
            "outputs": m.outputs.iter().map(tensor_json).collect::<Vec<_>>(),
            "values": m.values,
            "instructions": m.instructions.iter()
                .map(|(k, n)| json!({"kind": k, "count": n})).collect::<Vec<_>>(),
            "operators": m.operators,
            "delegates": m.delegates.iter().map(|d| json!({
                "backend": d.backend, "size": d.size, "location": d.location,
                "compile_specs": d.compile_specs,
            })).collect::<Vec<_>>(),
            "planned_buffers": m.planned_buffers,
            "buffer_devices": m.buffer_devices,
        })).collect::<Vec<_>>(),
        "named_data": s.named_data.iter()
            .map(|(k, seg, size)| json!({"key": k, "segment": seg, "size": size}))
            .collect::<Vec<_>>(),
        "segments": s.segments.iter().map(|g| json!({
            "file_offset": g.file_offset, "size": g.size, "used_by": g.used_by,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summarises_the_xnnpack_sample() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../petite-pte/tests/data/tiny_linear_xnnpack.pte");
        let f = petite_pte::PteFile::open(&path).unwrap();
        let j = to_json(&summarize(f.program(), f.layout()));
        assert_eq!(j["file_len"], 2224);
        assert_eq!(j["segment_base_offset"], 1280);
        let m = &j["methods"][0];
        assert_eq!(m["name"], "forward");
        assert_eq!(m["inputs"][0]["dtype"], "FLOAT");
        assert_eq!(m["inputs"][0]["shape"], json!([2, 3]));
        assert_eq!(m["outputs"][0]["shape"], json!([2, 4]));
        assert_eq!(m["delegates"][0]["backend"], "XnnpackBackend");
        assert_eq!(m["delegates"][0]["size"], 752);
        assert_eq!(m["delegates"][0]["location"], "segment 1");
        assert_eq!(j["named_data"][0]["size"], 48);
        assert_eq!(j["segments"].as_array().unwrap().len(), 3);
        let text = summarize(f.program(), f.layout()).to_text();
        assert!(
            text.contains("delegate XnnpackBackend: 752 bytes in segment 1"),
            "{text}"
        );
    }
}
