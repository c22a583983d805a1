//! A toy exporter outside the petite workspace, for a made-up backend `OutsideBackend`:
//!
//! 1. a sharded f32 checkpoint (written here, as a trainer would) is mapped (`petite-weights`);
//! 2. the model is built as a `petite-graph` program (names and shapes, no bytes);
//! 3. the checkpoint is converted to a bf16 mapping file in bounded memory;
//! 4. the program is planned into engines under a cap with a bf16 cost model
//!    (`petite-partition`);
//! 5. each engine is "built" into a file of its own (its subprogram as JSON + its bf16 weights),
//!    and each weight's pages are released once its last engine is built;
//! 6. a `.pte` is written with one delegate per engine, every blob and weight table streamed
//!    from the engine files (`petite-pte`), then read back and checked;
//! 7. the same program is also written as a portable `.pte` (`petite-portable`);
//! 8. a truncated `.pte` is refused with a typed error.
//!
//! Run: `cargo run --manifest-path examples/outside-exporter/Cargo.toml`.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use petite_graph::{Builder, Dtype, NodeId, Program, ValueId};
use petite_partition::{CostModel, PartitionOptions, plan};
use petite_pte::model::CompileSpec;
use petite_pte::{
    DelegateSpec, MethodBuilder, Processed, ProgramBuilder, PteFile, SegmentData, WriteOptions,
};
use petite_weights::{
    Checkpoint, ConvertOptions, MappedSafetensors, SafetensorsWriter, TargetDtype, TensorSpec,
    WeightSource,
};

type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

const LAYERS: usize = 4;
const WIDTH: usize = 128;
const TOKENS: usize = 8;
/// Engine cap in bytes of bf16 weights: two layers (2 × 32.25 KiB) fit, three do not.
const ENGINE_CAP: u64 = 80 << 10;
/// Magic at the start of every engine file this toy backend writes.
const ENGINE_MAGIC: &[u8; 8] = b"OUTSIDE1";
const PAGE: u64 = 4096;

/// Removes the work directory however `main` ends.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn main() -> Result<()> {
    let work =
        WorkDir(std::env::temp_dir().join(format!("outside-exporter-{}", std::process::id())));
    std::fs::create_dir_all(&work.0)?;
    let dir = work.0.as_path();

    let checkpoint = write_checkpoint(dir)?;
    let ckpt = Checkpoint::open(&checkpoint)?;
    println!(
        "checkpoint: {} tensors in {} shards",
        ckpt.names().len(),
        ckpt.shards().len()
    );

    let program = model()?;
    println!(
        "program: {} nodes, {} weight bytes (f32)",
        program.len(),
        program.weight_bytes()
    );

    let mapping_path = dir.join("mapping.bf16.safetensors");
    let opts = ConvertOptions {
        dtype: TargetDtype::Bf16,
        chunk_bytes: 16 << 10,
        threads: 1,
        progress: false,
        ..ConvertOptions::default()
    };
    let report = petite_weights::convert(&ckpt, &mapping_path, &opts)?;
    println!(
        "convert: {} tensors, {} → {} bytes",
        report.tensors, report.bytes_read, report.bytes_written
    );
    let mapping = MappedSafetensors::open(&mapping_path)?;

    let plan = plan(
        &program,
        &PartitionOptions::new(ENGINE_CAP).with_cost(StoredBf16),
    )?;
    assert_eq!(plan.engines.len(), LAYERS / 2, "two layers per engine");
    assert!(
        plan.engines
            .iter()
            .all(|e| e.weight_bytes <= ENGINE_CAP && !e.over_cap)
    );

    // Build the engines one at a time, releasing each weight after its last engine.
    let mut engines = Vec::new();
    for e in &plan.engines {
        let ep = plan.engine_program(&program, e.index)?;
        let built = build_engine(dir, e.index, &ep.program, &mapping)?;
        let done: Vec<&str> = plan
            .weights
            .iter()
            .filter(|w| w.last_engine == Some(e.index))
            .map(|w| w.name.as_str())
            .collect();
        mapping.release(&done)?;
        println!(
            "engine {}: {} nodes, {} weight bytes, {} weights released",
            e.index,
            e.nodes.len(),
            e.weight_bytes,
            done.len()
        );
        engines.push((ep, built));
    }

    // The .pte: one delegate call per engine, chained through planned tensors.
    let pte_path = dir.join("model.pte");
    let mut pb = ProgramBuilder::new();
    let mut m = MethodBuilder::new("forward");
    let mut slot: HashMap<ValueId, i32> = HashMap::new();
    let mut inputs = Vec::new();
    for &v in &program.inputs {
        let t = planned(&mut m, &program, v)?;
        slot.insert(v, t);
        inputs.push(t);
    }
    for (i, (ep, built)) in engines.iter().enumerate() {
        let blob = pb.add_segment(SegmentData::file_region(&built.path, 0, built.blob_len), 16)?;
        let key = format!("engine{i}.weights");
        pb.add_named_data(
            &key,
            SegmentData::file_region(&built.path, built.weights_at, built.weights_len),
            PAGE,
        )?;
        let d = m.delegate(DelegateSpec {
            id: "OutsideBackend".into(),
            processed: Processed::Segment(blob),
            compile_specs: vec![CompileSpec {
                key: "weights".into(),
                value: key.into_bytes(),
            }],
        });
        let mut args: Vec<i32> = ep.input_values.iter().map(|v| slot[v]).collect();
        for &v in &ep.output_values {
            let t = planned(&mut m, &program, v)?;
            slot.insert(v, t);
            args.push(t);
        }
        m.delegate_call(d, &args);
    }
    let outputs: Vec<i32> = program.outputs.iter().map(|o| slot[&o.value]).collect();
    m.inputs(&inputs);
    m.outputs(&outputs);
    pb.add_method(m)?;
    let summary = pb.write(&pte_path, WriteOptions::default())?;
    println!(
        "model.pte: {} bytes ({} copied in-kernel, {} buffered)",
        summary.file_len, summary.bytes_copied_in_kernel, summary.bytes_copied_buffered
    );

    // Read it back and check every blob and weight table against the engine files.
    let pte = PteFile::open(&pte_path)?;
    let method = &pte.program().execution_plan[0];
    assert_eq!(method.name, "forward");
    assert_eq!(method.delegates.len(), engines.len());
    for (i, (d, (_, built))) in method.delegates.iter().zip(&engines).enumerate() {
        assert_eq!(d.id, "OutsideBackend");
        let mut magic = [0u8; 8];
        pte.read_segment_at(d.processed.index as usize, 0, &mut magic)?;
        assert_eq!(&magic, ENGINE_MAGIC);
        let seg = pte
            .named_segment(&format!("engine{i}.weights"))
            .expect("named data");
        let (offset, size) = pte.segment_range(seg)?;
        assert_eq!((offset % PAGE, size), (0, built.weights_len));
        let mut first = vec![0u8; 64];
        pte.read_segment_at(seg, 0, &mut first)?;
        assert_eq!(first, read_at(&built.path, built.weights_at, 64)?);
    }

    // The same model for ExecuTorch's portable kernels, weights straight from the checkpoint.
    let portable_path = dir.join("model.portable.pte");
    let portable = petite_portable::export_portable(&program, &ckpt, &portable_path)?;
    let pte = PteFile::open(&portable_path)?;
    assert!(pte.program().execution_plan[0].delegates.is_empty());
    println!(
        "model.portable.pte: {} bytes, {} operators, planned buffer {} bytes",
        portable.file_bytes,
        portable.operators.len(),
        portable.plan.planned_bytes
    );

    // Bad input is a typed error.
    let bytes = std::fs::read(&pte_path)?;
    let cut = dir.join("cut.pte");
    std::fs::write(&cut, &bytes[..bytes.len() / 2])?;
    match PteFile::open(&cut) {
        Err(petite_pte::Error::InFile { cause, .. })
            if matches!(*cause, petite_pte::Error::Truncated { .. }) =>
        {
            println!("truncated .pte refused: {cause}");
        }
        other => return Err(format!("expected a truncation error, got {other:?}").into()),
    }

    println!("outside-exporter: ok");
    Ok(())
}

/// Writes a sharded f32 checkpoint (two shards + index) and returns its directory.
fn write_checkpoint(dir: &Path) -> Result<PathBuf> {
    let ckpt = dir.join("checkpoint");
    std::fs::create_dir_all(&ckpt)?;
    let mut index = Vec::new();
    for shard in 0..2 {
        let file = format!("model-0000{}-of-00002.safetensors", shard + 1);
        let layers = shard * LAYERS / 2..(shard + 1) * LAYERS / 2;
        let mut table = Vec::new();
        for l in layers.clone() {
            table.push(TensorSpec::new(
                format!("layers.{l}.weight"),
                petite_weights::Dtype::F32,
                &[WIDTH, WIDTH],
            ));
            table.push(TensorSpec::new(
                format!("layers.{l}.bias"),
                petite_weights::Dtype::F32,
                &[WIDTH],
            ));
        }
        let w = SafetensorsWriter::create(ckpt.join(&file), &table, &[])?;
        for t in &table {
            let n: usize = t.shape.iter().product();
            let bytes: Vec<u8> = (0..n)
                .flat_map(|i| (((i * 7 + t.name.len()) % 97) as f32 / 97.0 - 0.5).to_le_bytes())
                .collect();
            w.write_at(&t.name, 0, &bytes)?;
            index.push(format!("\"{}\": \"{file}\"", t.name));
        }
        w.finish()?;
    }
    std::fs::write(
        ckpt.join("model.safetensors.index.json"),
        format!(
            "{{\"metadata\": {{}}, \"weight_map\": {{{}}}}}",
            index.join(", ")
        ),
    )?;
    Ok(ckpt)
}

/// The model: `LAYERS` × (linear + SiLU), f32 activations.
fn model() -> petite_graph::Result<Program> {
    let mut b = Builder::new();
    let mut x = b.input("x", Dtype::F32, &[TOKENS, WIDTH])?;
    for l in 0..LAYERS {
        x = b.scoped(format!("layers.{l}"), |b| {
            let w = b.weight(&format!("layers.{l}.weight"), Dtype::F32, &[WIDTH, WIDTH])?;
            let bias = b.weight(&format!("layers.{l}.bias"), Dtype::F32, &[WIDTH])?;
            let h = b.linear(x, w, Some(bias))?;
            b.silu(h)
        })?;
    }
    b.output("y", x)?;
    b.finish()
}

/// The backend stores every weight in bf16: 2 bytes per element, whatever the program declares.
struct StoredBf16;

impl CostModel for StoredBf16 {
    fn weight_bytes(&self, program: &Program, weight: NodeId) -> u64 {
        let numel: usize = program
            .node(weight)
            .tensor()
            .map_or(0, |t| t.shape.iter().product());
        numel as u64 * 2
    }
}

/// Where one engine file keeps its blob (magic + subprogram JSON) and its weight table.
struct BuiltEngine {
    path: PathBuf,
    blob_len: u64,
    weights_at: u64,
    weights_len: u64,
}

/// "Builds" an engine: its subprogram as JSON, then its bf16 weights from the mapping file on a
/// page boundary (one weight in memory at a time, a view of the mapping).
fn build_engine(
    dir: &Path,
    index: usize,
    program: &Program,
    mapping: &MappedSafetensors,
) -> Result<BuiltEngine> {
    let path = dir.join(format!("engine{index}.bin"));
    let mut f = File::create(&path)?;
    let json = program.to_json()?;
    f.write_all(ENGINE_MAGIC)?;
    f.write_all(&(json.len() as u64).to_le_bytes())?;
    f.write_all(json.as_bytes())?;
    let blob_len = (ENGINE_MAGIC.len() + 8 + json.len()) as u64;
    let weights_at = blob_len.next_multiple_of(PAGE);
    f.write_all(&vec![0u8; (weights_at - blob_len) as usize])?;
    let mut weights_len = 0u64;
    for w in program.weights() {
        let view = mapping.tensor(&w.name)?;
        f.write_all(view.bytes)?;
        weights_len += view.bytes.len() as u64;
    }
    f.sync_all()?;
    Ok(BuiltEngine {
        path,
        blob_len,
        weights_at,
        weights_len,
    })
}

/// A planned tensor for value `v` of `program`.
fn planned(m: &mut MethodBuilder, program: &Program, v: ValueId) -> Result<i32> {
    let t = program.node(v).tensor().ok_or("engine edges are tensors")?;
    let sizes: Vec<i32> = t.shape.iter().map(|&d| d as i32).collect();
    Ok(m.planned_tensor(petite_portable::scalar_type(t.dtype), &sizes)?)
}

fn read_at(path: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len];
    File::open(path)?.read_exact_at(&mut buf, offset)?;
    Ok(buf)
}
