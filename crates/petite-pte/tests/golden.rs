//! Golden tests against the EXIR-written samples in `tests/data/` (copied from
//! `executorch-samples/`, executorch 1.5.1): the reader decodes them, programs rebuilt with the
//! builder from the samples' documented facts decode to the same program field by field, and the
//! writer round-trips each sample.

use std::path::PathBuf;

use petite_pte::model::*;
use petite_pte::{
    DelegateSpec, MethodBuilder, Processed, ProgramBuilder, PteFile, SegmentData, WriteOptions,
    write_pte,
};

mod common;
use common::*;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

#[test]
fn reads_tiny_linear_facts() {
    let f = PteFile::open(data("tiny_linear.pte")).unwrap();
    let l = f.layout();
    let h = l.header.unwrap();
    assert_eq!(h.program_size, 1296);
    assert_eq!(h.segment_base_offset, 1408);
    assert_eq!(h.segment_data_size, Some(64));
    let p = f.program();
    assert_eq!(
        p.segments,
        vec![DataSegment {
            offset: 0,
            size: 64
        }]
    );
    assert_eq!(p.constant_segment.as_ref().unwrap().offsets, vec![0, 0, 48]);
    let plan = &p.execution_plan[0];
    assert_eq!(plan.non_const_buffer_sizes, vec![0, 64]);
    assert_eq!(
        plan.chains[0].instructions,
        vec![
            Instruction::KernelCall {
                op_index: 0,
                args: vec![2, 0, 3, 3]
            },
            Instruction::KernelCall {
                op_index: 1,
                args: vec![3, 1, 5, 4, 4]
            },
        ]
    );
    let mut b = [0u8; 16];
    f.read_segment_at(0, 48, &mut b).unwrap();
    assert_eq!(b.to_vec(), weights().1);
}

#[test]
fn rebuilt_tiny_linear_decodes_like_the_sample() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny_linear.pte");
    rebuild_tiny_linear()
        .write(&out, WriteOptions::default())
        .unwrap();
    let ours = PteFile::open(&out).unwrap();
    let theirs = PteFile::open(data("tiny_linear.pte")).unwrap();
    assert_eq!(ours.program(), theirs.program());
    // Same layout decisions as EXIR: 128-aligned base right after the program, 64 data bytes.
    let (o, t) = (
        ours.layout().header.unwrap(),
        theirs.layout().header.unwrap(),
    );
    assert_eq!(o.segment_data_size, t.segment_data_size);
    assert_eq!(o.segment_base_offset % 128, 0);
    let seg = |f: &PteFile| {
        let mut v = Vec::new();
        f.copy_segment(0, &mut v).unwrap();
        v
    };
    assert_eq!(seg(&ours), seg(&theirs));
}

#[test]
fn rebuilt_xnnpack_sample_decodes_like_the_sample() {
    let sample = PteFile::open(data("tiny_linear_xnnpack.pte")).unwrap();
    let (blob_at, blob_len) = sample.segment_range(1).unwrap();
    let (_, b) = weights();
    let (w, _) = weights();
    let key = "3d172884c0f67c5c57842735bbb4f97a6d240220e9646d2b469145af1ad93f17";
    let mut pb = ProgramBuilder::new();
    let bi = pb.add_constant(&b);
    // The XNNPACK blob is taken from the sample as a file region (streamed, not loaded).
    let blob = pb
        .add_segment(
            SegmentData::file_region(data("tiny_linear_xnnpack.pte"), blob_at, blob_len),
            1,
        )
        .unwrap();
    pb.add_named_data(key, SegmentData::bytes(w), 16).unwrap();
    let mut m = MethodBuilder::new("forward");
    m.container_meta(INP_SPEC, OUT_SPEC);
    let mut bt = tensor(&[4], true);
    bt.data_buffer_idx = bi;
    let b = m.tensor(bt);
    let x = m.tensor(planned(&[2, 3], false, 32));
    let out = m.tensor(planned(&[2, 4], true, 0));
    let d = m.delegate(DelegateSpec {
        id: "XnnpackBackend".into(),
        processed: Processed::Segment(blob),
        compile_specs: vec![],
    });
    m.delegate_call(d, &[x, b, out]);
    m.inputs(&[x]);
    m.outputs(&[out]);
    m.set_planned_buffers(&[128]);
    pb.add_method(m).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.pte");
    pb.write(&path, WriteOptions::default()).unwrap();
    let ours = PteFile::open(&path).unwrap();
    assert_eq!(ours.program(), sample.program());
    for i in 0..3 {
        let (mut a, mut z) = (Vec::new(), Vec::new());
        ours.copy_segment(i, &mut a).unwrap();
        sample.copy_segment(i, &mut z).unwrap();
        assert_eq!(a, z, "segment {i}");
    }
    assert_eq!(ours.named_segment(key), Some(2));
}

/// Reading a sample and writing it back (segments streamed from the sample's own regions) gives
/// the same program and the same segment bytes.
#[test]
fn round_trips_every_sample() {
    for name in [
        "tiny_linear.pte",
        "tiny_linear_xnnpack.pte",
        "tiny_linear_extconst.pte",
    ] {
        let src = PteFile::open(data(name)).unwrap();
        let p = src.program();
        let segments: Vec<_> = (0..p.segments.len())
            .map(|i| {
                let (at, len) = src.segment_range(i).unwrap();
                petite_pte::Segment {
                    data: SegmentData::file_region(data(name), at, len),
                    alignment: 1,
                }
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join(name);
        write_pte(&out, p, &segments, WriteOptions::default()).unwrap();
        let back = PteFile::open(&out).unwrap();
        assert_eq!(back.program(), p, "{name}");
        assert_eq!(
            back.layout().header.is_some(),
            src.layout().header.is_some(),
            "{name}: header presence"
        );
        for i in 0..p.segments.len() {
            let (mut a, mut z) = (Vec::new(), Vec::new());
            back.copy_segment(i, &mut a).unwrap();
            src.copy_segment(i, &mut z).unwrap();
            assert_eq!(a, z, "{name} segment {i}");
        }
    }
}

#[test]
fn extconst_has_no_header_but_reads() {
    let f = PteFile::open(data("tiny_linear_extconst.pte")).unwrap();
    assert!(f.layout().header.is_none());
    let EValue::Tensor(w) = &f.program().execution_plan[0].values[0] else {
        panic!("value 0 is not a tensor")
    };
    let e = w.extra_tensor_info.as_ref().unwrap();
    assert_eq!(e.fully_qualified_name.as_deref(), Some("w"));
    assert_eq!(e.location, TensorDataLocation::EXTERNAL);
}
