//! Bad input gets a clear error, never a panic; failed writes leave nothing under the final name;
//! writes are deterministic.

use std::path::PathBuf;

use petite_pte::model::*;
use petite_pte::{
    Error, MethodBuilder, ProgramBuilder, PteFile, SegmentData, WriteOptions, read_bytes,
};

fn sample(name: &str) -> Vec<u8> {
    std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name),
    )
    .unwrap()
}

fn err_of(bytes: &[u8]) -> String {
    match read_bytes(bytes) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn truncated_files_are_refused_at_every_length() {
    for name in [
        "tiny_linear.pte",
        "tiny_linear_xnnpack.pte",
        "tiny_linear_extconst.pte",
    ] {
        let b = sample(name);
        for len in 0..b.len() {
            assert!(
                read_bytes(&b[..len]).is_err(),
                "{name} truncated to {len} was accepted"
            );
        }
        read_bytes(&b).unwrap();
    }
}

#[test]
fn wrong_identifier() {
    let mut b = sample("tiny_linear.pte");
    b[4..8].copy_from_slice(b"ET11");
    let e = err_of(&b);
    assert!(e.contains("ET11") && e.contains("ET12"), "{e}");
}

#[test]
fn corrupt_extended_header_magic_is_refused() {
    // ExecuTorch loads this and computes garbage (format doc §8.1); petite refuses.
    let mut b = sample("tiny_linear.pte");
    b[8..12].copy_from_slice(b"eh01");
    let e = err_of(&b);
    assert!(e.contains("eh00") && e.contains("segments[0]"), "{e}");
}

#[test]
fn corrupt_extended_header_fields_are_refused() {
    let base = sample("tiny_linear.pte");
    let cases: &[(usize, u64, &str)] = &[
        (16, 8, "program_size"),            // program_size smaller than the header
        (16, 1 << 40, "exceeds the file"),  // program_size past EOF
        (24, 100, "inside the flatbuffer"), // segment base before program end
        (24, 1 << 40, "segments end"),      // segment base past EOF
        (32, 1 << 20, "segments end"),      // segment_data_size past EOF
        (32, 10, "segment_data_size"),      // segment data smaller than segment 0
    ];
    for &(at, v, needle) in cases {
        let mut b = base.clone();
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        let e = err_of(&b);
        assert!(e.contains(needle), "field at {at} = {v}: {e}");
    }
    let mut b = base.clone();
    b[12..16].copy_from_slice(&8u32.to_le_bytes());
    assert!(err_of(&b).contains("header length"));
}

fn program_with(f: impl FnOnce(&mut Program)) -> Vec<u8> {
    let mut pb = ProgramBuilder::new();
    let c = pb.add_constant(&[0u8; 16]);
    let mut m = MethodBuilder::new("forward");
    let w = m.constant_tensor(ScalarType::FLOAT, &[4], c);
    let x = m.planned_tensor(ScalarType::FLOAT, &[4]).unwrap();
    let y = m.planned_tensor(ScalarType::FLOAT, &[4]).unwrap();
    let one = m.int(1);
    m.kernel_call("aten::add", "out", &[x, w, one, y, y]);
    m.inputs(&[x]);
    m.outputs(&[y]);
    pb.add_method(m).unwrap();
    let (mut p, segs) = pb.build().unwrap();
    // Bypass the writer's verification: lay out, encode, then break the program.
    p.segments = petite_pte::writer::layout_segments(&segs).unwrap();
    f(&mut p);
    let fb = petite_pte::encode::encode_program(&p);
    let data: u64 = segs.iter().map(|s| s.data.len()).sum();
    let base = (fb.len() as u64 + 32).div_ceil(128) * 128;
    let mut out = petite_pte::header::insert(&fb, base, data);
    out.resize(base as usize, 0);
    out.extend(std::iter::repeat_n(0u8, data as usize));
    out
}

#[test]
fn a_valid_hand_laid_file_reads() {
    read_bytes(&program_with(|_| {})).unwrap();
}

#[test]
fn out_of_range_indices_are_refused() {
    type Mutation = Box<dyn Fn(&mut Program)>;
    let cases: Vec<(Mutation, &str)> = vec![
        (
            Box::new(|p| p.execution_plan[0].inputs = vec![99]),
            "input value index 99",
        ),
        (
            Box::new(|p| p.execution_plan[0].outputs = vec![-1]),
            "output value index -1",
        ),
        (
            Box::new(|p| {
                p.execution_plan[0].chains[0].instructions[0] = Instruction::KernelCall {
                    op_index: 5,
                    args: vec![0],
                }
            }),
            "operator index 5",
        ),
        (
            Box::new(|p| {
                p.execution_plan[0].chains[0].instructions[0] = Instruction::KernelCall {
                    op_index: 0,
                    args: vec![0, 42],
                }
            }),
            "kernel argument value index 42",
        ),
        (
            Box::new(|p| {
                p.execution_plan[0].chains[0]
                    .instructions
                    .push(Instruction::DelegateCall {
                        delegate_index: 0,
                        args: vec![],
                    })
            }),
            "delegate index 0",
        ),
        (
            Box::new(|p| {
                p.execution_plan[0].delegates.push(BackendDelegate {
                    id: "X".into(),
                    processed: DataReference {
                        location: DataLocation::SEGMENT,
                        index: 7,
                    },
                    compile_specs: vec![],
                })
            }),
            "processed data index 7",
        ),
        (
            Box::new(|p| {
                p.named_data = Some(vec![NamedData {
                    key: "k".into(),
                    segment_index: 3,
                }])
            }),
            "segment_index 3",
        ),
        (
            Box::new(|p| p.constant_segment.as_mut().unwrap().segment_index = 9),
            "constant_segment.segment_index 9",
        ),
        (
            Box::new(|p| {
                let EValue::Tensor(t) = &mut p.execution_plan[0].values[0] else {
                    unreachable!()
                };
                t.data_buffer_idx = 4;
            }),
            "data_buffer_idx 4",
        ),
        (
            Box::new(|p| {
                let EValue::Tensor(t) = &mut p.execution_plan[0].values[1] else {
                    unreachable!()
                };
                t.allocation_info.as_mut().unwrap().memory_id = 0;
            }),
            "memory_id 0",
        ),
        (
            Box::new(|p| p.execution_plan[0].non_const_buffer_sizes = vec![0, 16]),
            "does not fit planned buffer",
        ),
        (
            Box::new(|p| p.execution_plan[0].values.push(EValue::IntList(vec![0]))),
            "IntList items are indices of Int values",
        ),
        (
            Box::new(|p| p.execution_plan[0].values.push(EValue::TensorList(vec![3]))),
            "expected a Tensor",
        ),
        (
            Box::new(|p| {
                let EValue::Tensor(t) = &mut p.execution_plan[0].values[0] else {
                    unreachable!()
                };
                t.dim_order = vec![1];
            }),
            "not a permutation",
        ),
        (
            Box::new(|p| p.execution_plan[0].chains.clear()),
            "chains is empty",
        ),
        (
            Box::new(|p| p.segments[0].size = 1 << 30),
            "segment_data_size",
        ),
    ];
    for (i, (f, needle)) in cases.into_iter().enumerate() {
        let e = err_of(&program_with(f));
        assert!(e.contains(needle), "case {i}: {e:?} lacks {needle:?}");
    }
}

#[test]
fn overlapping_segments_are_refused() {
    let b = program_with(|p| {
        p.segments.push(DataSegment { offset: 8, size: 4 });
    });
    let e = err_of(&b);
    assert!(e.contains("overlap"), "{e}");
}

#[test]
fn missing_delegates_is_refused() {
    // Hand-encode a plan without `delegates` via the generated builders.
    use flatbuffers::FlatBufferBuilder;
    use petite_pte::generated::executorch_flatbuffer as fb;
    let mut b = FlatBufferBuilder::new();
    let name = Some(b.create_string("forward"));
    let empty_i32 = Some(b.create_vector::<i32>(&[]));
    let ins = Some(b.create_vector::<flatbuffers::WIPOffset<fb::Instruction>>(&[]));
    let chain = fb::Chain::create(
        &mut b,
        &fb::ChainArgs {
            instructions: ins,
            ..Default::default()
        },
    );
    let chains = Some(b.create_vector(&[chain]));
    let values = Some(b.create_vector::<flatbuffers::WIPOffset<fb::EValue>>(&[]));
    let sizes = Some(b.create_vector(&[0i64]));
    let plan = fb::ExecutionPlan::create(
        &mut b,
        &fb::ExecutionPlanArgs {
            name,
            values,
            inputs: empty_i32,
            outputs: empty_i32,
            chains,
            non_const_buffer_sizes: sizes,
            ..Default::default()
        },
    );
    let plans = Some(b.create_vector(&[plan]));
    let root = fb::Program::create(
        &mut b,
        &fb::ProgramArgs {
            execution_plan: plans,
            ..Default::default()
        },
    );
    fb::finish_program_buffer(&mut b, root);
    let e = err_of(b.finished_data());
    assert!(e.contains("delegates"), "{e}");
}

fn small_builder(src: SegmentData) -> ProgramBuilder {
    let mut pb = ProgramBuilder::new();
    let seg = pb.add_named_data("engine", src, 16).unwrap();
    let mut m = MethodBuilder::new("forward");
    let x = m.planned_tensor(ScalarType::FLOAT, &[2]).unwrap();
    let y = m.planned_tensor(ScalarType::FLOAT, &[2]).unwrap();
    let d = m.delegate(petite_pte::DelegateSpec {
        id: "TensorRTBackend".into(),
        processed: petite_pte::Processed::Segment(seg),
        compile_specs: vec![],
    });
    m.delegate_call(d, &[x, y]);
    m.inputs(&[x]);
    m.outputs(&[y]);
    pb.add_method(m).unwrap();
    pb
}

fn dir_is_empty(d: &std::path::Path) -> bool {
    std::fs::read_dir(d).unwrap().next().is_none()
}

#[test]
fn unreadable_source_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let missing = SegmentData::file_region(dir.path().join("nope.engine"), 0, 100);
    let e = small_builder(missing)
        .write(out_dir.join("p.pte"), WriteOptions::default())
        .unwrap_err();
    assert!(matches!(e, Error::Source { .. }), "{e}");
    assert!(e.to_string().contains("nope.engine"), "{e}");
    assert!(dir_is_empty(&out_dir), "a failed write left files behind");
}

#[test]
fn source_shorter_than_promised_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("engine.bin");
    std::fs::write(&src, vec![7u8; 1000]).unwrap();
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let e = small_builder(SegmentData::file_region(&src, 500, 1000))
        .write(out_dir.join("p.pte"), WriteOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("outside the 1000-byte file"), "{e}");
    assert!(dir_is_empty(&out_dir));
}

#[test]
fn missing_destination_directory_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let e = small_builder(SegmentData::bytes(vec![1u8; 64]))
        .write(
            dir.path().join("no/such/dir/p.pte"),
            WriteOptions::default(),
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("no/such/dir/p.pte.petite-tmp: create: "),
        "{e}"
    );
}

#[test]
fn writes_are_deterministic_and_both_copy_paths_agree() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("engine.bin");
    let bytes: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    std::fs::write(&src, &bytes).unwrap();
    let a = dir.path().join("a.pte");
    let b = dir.path().join("b.pte");
    let c = dir.path().join("c.pte");
    let sa = small_builder(SegmentData::file(&src).unwrap())
        .write(&a, WriteOptions::default())
        .unwrap();
    small_builder(SegmentData::file(&src).unwrap())
        .write(&b, WriteOptions::default())
        .unwrap();
    let sc = small_builder(SegmentData::file(&src).unwrap())
        .write(
            &c,
            WriteOptions {
                force_buffered_copy: true,
            },
        )
        .unwrap();
    let (ba, bb, bc) = (
        std::fs::read(&a).unwrap(),
        std::fs::read(&b).unwrap(),
        std::fs::read(&c).unwrap(),
    );
    assert_eq!(ba, bb);
    assert_eq!(ba, bc);
    assert_eq!(sa.file_len, ba.len() as u64);
    assert_eq!(sc.bytes_copied_in_kernel, 0);
    assert_eq!(sc.bytes_copied_buffered, bytes.len() as u64);
    let f = PteFile::open(&a).unwrap();
    let seg = f.named_segment("engine").unwrap();
    let (at, len) = f.segment_range(seg).unwrap();
    assert_eq!(at % 128, 0);
    assert_eq!(&ba[at as usize..(at + len) as usize], &bytes[..]);
    // Only the final file remains (no temporaries).
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(names.iter().all(|n| !n.contains("petite-tmp")), "{names:?}");
}

#[test]
fn builder_refuses_duplicate_keys_and_methods() {
    let mut pb = ProgramBuilder::new();
    pb.add_named_data("k", SegmentData::bytes(vec![1u8]), 1)
        .unwrap();
    assert!(
        pb.add_named_data("k", SegmentData::bytes(vec![2u8]), 1)
            .is_err()
    );
    assert!(pb.add_segment(SegmentData::bytes(vec![1u8]), 3).is_err());
    pb.add_method(MethodBuilder::new("m")).unwrap();
    assert!(pb.add_method(MethodBuilder::new("m")).is_err());
}

/// A write that runs out of space midway (here: the file-size limit `RLIMIT_FSIZE`, which fails
/// writes with EFBIG exactly like a full disk fails them with ENOSPC) returns an error and leaves
/// nothing behind. Runs in a child process so the limit does not touch other tests.
#[test]
fn write_failing_midway_leaves_nothing() {
    if std::env::var_os("PETITE_PTE_FSIZE_CHILD").is_some() {
        return full_disk_child();
    }
    let dir = tempfile::tempdir().unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "write_failing_midway_leaves_nothing",
            "--nocapture",
        ])
        .env("PETITE_PTE_FSIZE_CHILD", dir.path())
        .status()
        .unwrap();
    assert!(status.success(), "child failed: {status}");
    let left: Vec<_> = std::fs::read_dir(dir.path().join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

fn full_disk_child() {
    let dir = PathBuf::from(std::env::var_os("PETITE_PTE_FSIZE_CHILD").unwrap());
    let src = dir.join("engine.bin");
    std::fs::write(&src, vec![5u8; 3 << 20]).unwrap();
    let out_dir = dir.join("out");
    std::fs::create_dir(&out_dir).unwrap();
    // SAFETY: no pointers but `&lim`, a live local; SIG_IGN installs no handler. Both settings
    // are process-wide, which is why this runs in a single-purpose child process.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: 1 << 20,
            rlim_max: libc::RLIM_INFINITY,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    for force_buffered_copy in [false, true] {
        let e = small_builder(SegmentData::file(&src).unwrap())
            .write(
                out_dir.join("p.pte"),
                WriteOptions {
                    force_buffered_copy,
                },
            )
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("File too large") || msg.contains("EFBIG") || msg.contains("too large"),
            "{msg}"
        );
        assert!(
            dir_is_empty(&out_dir),
            "buffered={force_buffered_copy}: files left"
        );
    }
}

#[test]
fn a_file_cut_after_its_flatbuffer_is_a_truncated_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("engine.bin");
    std::fs::write(&src, vec![7u8; 1000]).unwrap();
    let out = dir.path().join("p.pte");
    small_builder(SegmentData::file(&src).unwrap())
        .write(&out, WriteOptions::default())
        .unwrap();
    let b = std::fs::read(&out).unwrap();
    let (_, layout) = read_bytes(&b).unwrap();
    for len in layout.program_size as usize..b.len() {
        match read_bytes(&b[..len]) {
            Err(Error::Truncated { len: l, need, .. }) => {
                assert_eq!((l, need), (len as u64, b.len() as u64), "cut at {len}");
            }
            other => panic!("cut at {len}: expected Error::Truncated, got {other:?}"),
        }
    }
}

/// A method planned as ExecuTorch plans device delegates: host buffer 1, CUDA buffer 2, copies
/// at the edges. Returns the file's bytes, `f` applied to the program before encoding.
fn device_program_with(f: impl FnOnce(&mut Program)) -> Vec<u8> {
    let mut pb = ProgramBuilder::new();
    let mut m = MethodBuilder::new("forward");
    m.place_buffer(2, DeviceType::CUDA, 0);
    let x = m.planned_tensor_in(1, ScalarType::FLOAT, &[4]).unwrap();
    let xd = m.planned_tensor_in(2, ScalarType::FLOAT, &[4]).unwrap();
    let yd = m.planned_tensor_in(2, ScalarType::FLOAT, &[4]).unwrap();
    let y = m.planned_tensor_in(1, ScalarType::FLOAT, &[4]).unwrap();
    m.kernel_call("et_copy::_h2d_copy", "out", &[x, xd, xd]);
    m.kernel_call("et_copy::_d2h_copy", "out", &[yd, y, y]);
    m.inputs(&[x]);
    m.outputs(&[y]);
    pb.add_method(m).unwrap();
    let (mut p, segs) = pb.build().unwrap();
    p.segments = petite_pte::writer::layout_segments(&segs).unwrap();
    f(&mut p);
    let fb = petite_pte::encode::encode_program(&p);
    let base = (fb.len() as u64 + 32).div_ceil(128) * 128;
    let mut out = petite_pte::header::insert(&fb, base, 0);
    out.resize(base as usize, 0);
    out
}

#[test]
fn device_placement_round_trips_and_a_lying_device_tag_is_refused() {
    let f = read_bytes(&device_program_with(|_| {})).unwrap();
    let plan = &f.0.execution_plan[0];
    assert_eq!(plan.non_const_buffer_sizes, vec![0, 32, 32]);
    let devs = plan.non_const_buffer_device.as_ref().unwrap();
    assert_eq!(devs.len(), 1);
    assert_eq!(
        (
            devs[0].buffer_idx,
            devs[0].device_type,
            devs[0].device_index
        ),
        (2, DeviceType::CUDA, 0)
    );
    let tags: Vec<Option<DeviceType>> = plan
        .values
        .iter()
        .map(|v| match v {
            EValue::Tensor(t) => t.extra_tensor_info.as_ref().map(|e| e.device_type),
            _ => None,
        })
        .collect();
    assert_eq!(
        tags,
        vec![None, Some(DeviceType::CUDA), Some(DeviceType::CUDA), None]
    );
    // A device tensor whose tag was dropped, and a host tensor tagged CUDA: both refused.
    for (value, tag) in [(1usize, None), (0, Some(DeviceType::CUDA))] {
        let e = err_of(&device_program_with(|p| {
            let EValue::Tensor(t) = &mut p.execution_plan[0].values[value] else {
                unreachable!()
            };
            t.extra_tensor_info = tag.map(|device_type| ExtraTensorInfo {
                mutable_data_segments_idx: 0,
                fully_qualified_name: None,
                location: TensorDataLocation::SEGMENT,
                device_type,
                device_index: 0,
            });
        }));
        assert!(e.contains("tagged") && e.contains("planned buffer"), "{e}");
    }
}

/// `reuse_buffer`: tensors of one buffer share bytes only when their lifetimes (first to last
/// instruction naming them) are disjoint; the buffer shrinks to what is live at once.
#[test]
fn reuse_buffer_plans_by_lifetime() {
    let mut m = MethodBuilder::new("forward");
    m.place_buffer(2, DeviceType::CUDA, 0);
    let x = m.planned_tensor_in(1, ScalarType::FLOAT, &[4]).unwrap();
    let y = m.planned_tensor_in(1, ScalarType::FLOAT, &[4]).unwrap();
    // a -> b -> c on the device, each 40 bytes (rounded to 48 by the 16-byte alignment).
    let dev: Vec<i32> = (0..3)
        .map(|_| m.planned_tensor_in(2, ScalarType::FLOAT, &[10]).unwrap())
        .collect();
    let (a, b, c) = (dev[0], dev[1], dev[2]);
    m.kernel_call("et_copy::_h2d_copy", "out", &[x, a, a]);
    m.kernel_call("aten::relu", "out", &[a, b, b]);
    m.kernel_call("aten::relu", "out", &[b, c, c]);
    m.kernel_call("et_copy::_d2h_copy", "out", &[c, y, y]);
    m.inputs(&[x]);
    m.outputs(&[y]);
    m.reuse_buffer(2).unwrap();
    let plan = m.plan_mut().clone();
    let off = |v: i32| match &plan.values[v as usize] {
        EValue::Tensor(t) => t.allocation_info.unwrap().memory_offset,
        _ => unreachable!(),
    };
    // a and b are live together at instruction 2, b and c at 3; a is dead before c.
    assert_eq!((off(a), off(b), off(c)), (0, 48, 0));
    assert_eq!(plan.non_const_buffer_sizes[2], 88);
    // The host buffer is left alone.
    assert_eq!((off(x), off(y)), (0, 16));
    // Still a valid program (every tensor inside its buffer, tags match).
    let mut pb = ProgramBuilder::new();
    let mut m2 = MethodBuilder::new("forward");
    *m2.plan_mut() = plan;
    pb.add_method(m2).unwrap();
    pb.build().unwrap();
}
