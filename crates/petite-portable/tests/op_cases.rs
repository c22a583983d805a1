//! One tiny program per op (and per interesting dtype/attribute): lowered, planned and written as
//! a portable `.pte`, with inputs and the reference executor's outputs as `.npy` files and a
//! manifest, under `$PETITE_PORTABLE_CASES` (default `target/portable-conformance/ops`).
//! `cargo xtask conformance` runs every case in ExecuTorch's runtime
//! (`conformance/executorch/run_portable_ops.py`) and compares. Here, without Python: every case
//! lowers, only registered operators are emitted, plans are overlap-free, files read back.

use std::path::{Path, PathBuf};

use petite_graph::{Builder, Dtype};
use petite_portable::{OPERATORS, export_portable, lower, plan};
use petite_reference::{Executor, MemoryWeights, Tensor};

#[path = "common/cases.rs"]
mod cases;
use cases::cases;

fn npy_descr(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "<f4",
        Dtype::Bf16 => "<u2", // the numpy runtime passes bf16 as uint16 bits
        Dtype::F16 => "<f2",
        Dtype::I64 => "<i8",
        Dtype::I32 => "<i4",
        Dtype::U8 => "|u1",
        Dtype::Bool => "|b1",
        Dtype::I8 => "|i1",
        Dtype::F8E4M3 => "|u1", // FP8 bits, as bf16's
    }
}

/// Writes a `.npy` (format 1.0).
fn write_npy(path: &Path, t: &Tensor) {
    let shape = t.shape();
    let shp = match shape.len() {
        0 => "()".to_string(),
        1 => format!("({},)", shape[0]),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut h = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shp}, }}",
        npy_descr(t.dtype())
    );
    let total = 10 + h.len() + 1;
    h.push_str(&" ".repeat(total.div_ceil(64) * 64 - total));
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&t.to_bytes());
    std::fs::write(path, out).expect("write npy");
}

fn out_dir() -> PathBuf {
    match std::env::var_os("PETITE_PORTABLE_CASES") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/portable-conformance/ops"),
    }
}

#[test]
fn every_case_lowers_plans_and_writes() {
    let dir = out_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let mut manifest = Vec::new();
    let mut seen_ops = std::collections::BTreeSet::new();
    for (name, prog, weights, ins) in cases() {
        let l = lower(&prog).unwrap_or_else(|e| panic!("{name}: {e}"));
        for op in l.operators() {
            assert!(
                OPERATORS.contains(&op.as_str()),
                "{name}: emits {op}, which is not in OPERATORS"
            );
            seen_ops.insert(op);
        }
        let p = plan(&l);
        petite_portable::plan::check(&l, &p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(p.stats.planned_bytes >= p.stats.max_live_bytes, "{name}");
        assert!(p.stats.planned_bytes <= p.stats.sum_bytes, "{name}");

        let expected = Executor::new(&prog, &weights)
            .unwrap()
            .run(ins.clone())
            .unwrap_or_else(|e| panic!("{name}: reference: {e}"));
        let pte = dir.join(format!("{name}.pte"));
        let rep = export_portable(&prog, &weights, &pte).unwrap_or_else(|e| panic!("{name}: {e}"));
        // The file reads back and verifies with petite-pte.
        petite_pte::PteFile::open(&pte).unwrap_or_else(|e| panic!("{name}: read back: {e}"));
        let mut inputs = Vec::new();
        for spec in &rep.inputs {
            let f = format!("{name}.in.{}.npy", spec.name);
            write_npy(&dir.join(&f), &ins[&spec.name]);
            inputs.push(serde_json::json!({"name": spec.name, "file": f, "dtype": spec.dtype}));
        }
        let mut outputs = Vec::new();
        for spec in &rep.outputs {
            let f = format!("{name}.out.{}.npy", spec.name);
            let t = &expected[&spec.name];
            assert_eq!(t.shape(), spec.shape.as_slice(), "{name}: {}", spec.name);
            write_npy(&dir.join(&f), t);
            outputs.push(serde_json::json!({"name": spec.name, "file": f, "dtype": spec.dtype}));
        }
        // Portable mm/addmm on bf16 round in bf16 inside the kernel (the reference rounds once
        // from f32), so bf16 linear gets an absolute bound instead of one ulp.
        let bf16_abs_tol = if name == "linear_bf16" { 0.01 } else { 0.0 };
        manifest.push(serde_json::json!({
            "name": name, "pte": format!("{name}.pte"), "inputs": inputs, "outputs": outputs,
            "operators": rep.operators, "bf16_abs_tol": bf16_abs_tol,
        }));
    }
    // Every operator the lowering can emit is exercised by some case.
    for op in OPERATORS {
        assert!(seen_ops.contains(*op), "no case emits {op}");
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest).unwrap(),
    )
    .unwrap();
}

#[test]
fn unsupported_dtype_is_refused_before_writing() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 3, 4, 4]).unwrap();
    let w = b
        .weight("vision.patch.weight", Dtype::Bf16, &[2, 3, 2, 2])
        .unwrap();
    let y = b.conv2d(x, w, None, [2, 2], [0, 0]).unwrap();
    b.output("y", y).unwrap();
    let prog = b.finish().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.pte");
    let err = export_portable(&prog, &MemoryWeights::new(), &out).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("conv2d") && msg.contains("bf16") && msg.contains("node %"),
        "{msg}"
    );
    assert!(!out.exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn wrong_weight_shape_is_refused_before_writing() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2, 5]).unwrap();
    let w = b.weight("w", Dtype::F32, &[4, 5]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    b.output("y", y).unwrap();
    let prog = b.finish().unwrap();
    let mut ws = MemoryWeights::new();
    ws.insert_f32("w", &[5, 4], &[0.0; 20]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.pte");
    let msg = export_portable(&prog, &ws, &out).unwrap_err().to_string();
    assert!(
        msg.contains("`w`") && msg.contains("[4, 5]") && msg.contains("[5, 4]"),
        "{msg}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn kernel_call_arguments_follow_the_schema() {
    // aten::native_layer_norm.out: 5 schema args + 3 outs + one TensorList return.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2, 4]).unwrap();
    let w = b.weight("w", Dtype::F32, &[4]).unwrap();
    let bb = b.weight("b", Dtype::F32, &[4]).unwrap();
    let y = b.layer_norm(x, w, bb, 1e-5).unwrap();
    b.output("y", y).unwrap();
    let prog = b.finish().unwrap();
    let mut ws = MemoryWeights::new();
    ws.insert_f32("w", &[4], &[1.0; 4]).unwrap();
    ws.insert_f32("b", &[4], &[0.0; 4]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ln.pte");
    export_portable(&prog, &ws, &out).unwrap();
    let f = petite_pte::PteFile::open(&out).unwrap();
    let plan = &f.program().execution_plan[0];
    let op = plan
        .operators
        .iter()
        .position(|o| o.name == "aten::native_layer_norm")
        .unwrap() as i32;
    let call = plan.chains[0]
        .instructions
        .iter()
        .find_map(|i| match i {
            petite_pte::model::Instruction::KernelCall { op_index, args } if *op_index == op => {
                Some(args.clone())
            }
            _ => None,
        })
        .unwrap();
    use petite_pte::model::EValue;
    assert_eq!(call.len(), 9);
    match &plan.values[call[1] as usize] {
        EValue::IntList(items) => {
            assert_eq!(items.len(), 1);
            assert_eq!(plan.values[items[0] as usize], EValue::Int(4));
        }
        other => panic!("normalized_shape is {other:?}"),
    }
    assert_eq!(plan.values[call[4] as usize], EValue::Double(1e-5));
    assert_eq!(
        plan.values[call[8] as usize],
        EValue::TensorList(vec![call[5], call[6], call[7]])
    );
}

/// A row-range weight goes into a mapping file (the `petite export --backend portable` path)
/// as just its rows, converted, under its own key; rows outside the tensor are refused.
#[test]
fn row_range_weights_map_as_just_their_rows() {
    let mut b = Builder::new();
    let ids = b.input("i", Dtype::I64, &[3]).unwrap();
    let y = b
        .embedding_sharded("table", Dtype::Bf16, &[10, 4], ids, 3 * 4 * 2)
        .unwrap();
    b.output("y", y).unwrap();
    let prog = b.finish().unwrap();
    let vals: Vec<f32> = (0..40).map(|i| i as f32 * 0.37 - 7.0).collect();
    let mut ws = MemoryWeights::new();
    ws.insert_f32("table", &[10, 4], &vals).unwrap();
    let l = lower(&prog).unwrap();
    let table = petite_portable::stored_weights(&[&l]);
    assert_eq!(table.len(), 4);
    let src = petite_portable::row_source(&[&prog], &ws).unwrap();
    petite_portable::check_weights(&table, &src).unwrap();
    // Without the row source the row names are unknown: a clear error naming the weight.
    let e = petite_portable::check_weights(&table, &ws)
        .unwrap_err()
        .to_string();
    assert!(e.contains("table[0..3]"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    petite_portable::write_mapping(&table, &src, &path, &[], &mut |_, _| {}).unwrap();
    let m = petite_weights::MappedSafetensors::open(&path).unwrap();
    for w in &table {
        let v = petite_weights::WeightSource::tensor(&m, &w.key).unwrap();
        let name = w.name.strip_prefix("table[").unwrap().trim_end_matches(']');
        let (a, z) = name.split_once("..").unwrap();
        let (a, z): (usize, usize) = (a.parse().unwrap(), z.parse().unwrap());
        assert_eq!(v.shape, &[z - a, 4]);
        let want: Vec<u16> = vals[a * 4..z * 4]
            .iter()
            .map(|x| petite_dtype::to_bf16(*x).to_bits())
            .collect();
        let got: Vec<u16> = v
            .bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(got, want, "{}", w.key);
    }
}
