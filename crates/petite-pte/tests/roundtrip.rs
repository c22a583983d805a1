//! Property: any program the builder accepts encodes and decodes to itself, and the writer's
//! bytes equal `to_bytes`'s (so streaming and in-memory serialisation agree).

use petite_pte::model::*;
use petite_pte::{MethodBuilder, ProgramBuilder, SegmentData, WriteOptions, read_bytes, to_bytes};
use proptest::prelude::*;

fn arb_program() -> impl Strategy<Value = ProgramBuilder> {
    (
        proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..4),
        proptest::collection::vec(
            (proptest::collection::vec(any::<u8>(), 1..300), 0u32..9),
            0..4,
        ),
        proptest::collection::vec(proptest::collection::vec(1i32..5, 0..4), 1..5),
        proptest::collection::vec(any::<i64>(), 0..4),
        any::<f64>().prop_filter("not NaN", |d| !d.is_nan()),
    )
        .prop_map(|(consts, segs, shapes, ints, dbl)| {
            let mut pb = ProgramBuilder::new();
            let cidx: Vec<u32> = consts.iter().map(|c| pb.add_constant(c)).collect();
            let mut sids = Vec::new();
            for (i, (bytes, align_pow)) in segs.into_iter().enumerate() {
                sids.push(
                    pb.add_named_data(
                        &format!("key{i}"),
                        SegmentData::bytes(bytes),
                        1 << align_pow,
                    )
                    .unwrap(),
                );
            }
            let mut m = MethodBuilder::new("forward");
            let mut tensors = Vec::new();
            for s in &shapes {
                tensors.push(m.planned_tensor(ScalarType::FLOAT, s).unwrap());
            }
            for (k, c) in cidx.iter().zip(&consts) {
                tensors.push(m.constant_tensor(ScalarType::BYTE, &[c.len() as i32], *k));
            }
            let il = m.int_list(&ints);
            let d = m.double(dbl);
            let b = m.bool(true);
            let n = m.null();
            let tl = m.tensor_list(&tensors);
            m.kernel_call("aten::foo", "out", &[il, d, b, n, tl]);
            for (i, sid) in sids.iter().enumerate() {
                let di = m.delegate(petite_pte::DelegateSpec {
                    id: format!("Backend{i}"),
                    processed: petite_pte::Processed::Segment(*sid),
                    compile_specs: vec![CompileSpec {
                        key: "k".into(),
                        value: vec![i as u8],
                    }],
                });
                m.delegate_call(di, &[tensors[0]]);
            }
            // A small blob stored inline (backend_delegate_data).
            let inline = pb.add_inline_delegate_data(ints.iter().map(|&x| x as u8).collect());
            let di = m.delegate(petite_pte::DelegateSpec {
                id: "InlineBackend".into(),
                processed: petite_pte::Processed::Inline(inline),
                compile_specs: vec![],
            });
            m.delegate_call(di, &[tensors[0]]);
            m.inputs(&tensors[..1]);
            m.outputs(&tensors[..1]);
            pb.add_method(m).unwrap();
            pb.add_method(MethodBuilder::new("empty")).unwrap();
            pb
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn encode_decode_round_trip(pb in arb_program()) {
        let (program, segments) = pb.build().unwrap();
        let bytes = to_bytes(&program, &segments).unwrap();
        let (back, layout) = read_bytes(&bytes).unwrap();
        let mut expect = program.clone();
        expect.segments = petite_pte::writer::layout_segments(&segments).unwrap();
        prop_assert_eq!(&back, &expect);
        prop_assert_eq!(layout.segment_base_offset % 128, 0);
        for (s, seg) in back.segments.iter().zip(&segments) {
            let at = (layout.segment_base_offset + s.offset) as usize;
            let SegmentData::Bytes(b) = &seg.data else { unreachable!() };
            prop_assert_eq!(&bytes[at..at + s.size as usize], &b[..]);
            prop_assert_eq!((layout.segment_base_offset + s.offset) % seg.alignment.max(128), 0);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.pte");
        petite_pte::write_pte(&path, &program, &segments, WriteOptions::default()).unwrap();
        prop_assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }
}

/// An engine used by delegates in several methods is one segment, stored once; its bytes are
/// streamed from the file region given, and every delegate reads the same segment.
#[test]
fn engine_shared_by_delegates_is_stored_once() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("engine.plan");
    // The engine is a region in the middle of a larger file.
    let mut bytes = vec![0xAAu8; 1000];
    bytes.extend((0..200_000u32).map(|i| (i % 251) as u8));
    bytes.extend(vec![0xBBu8; 1000]);
    std::fs::write(&src, &bytes).unwrap();
    let mut pb = ProgramBuilder::new();
    let eng = pb
        .add_named_data(
            "engine-0",
            SegmentData::file_region(&src, 1000, 200_000),
            4096,
        )
        .unwrap();
    for name in ["prefix", "step", "step2"] {
        let mut m = MethodBuilder::new(name);
        let x = m.planned_tensor(ScalarType::FLOAT, &[2]).unwrap();
        let y = m.planned_tensor(ScalarType::FLOAT, &[2]).unwrap();
        for _ in 0..2 {
            let d = m.delegate(petite_pte::DelegateSpec {
                id: "TensorRTBackend".into(),
                processed: petite_pte::Processed::Segment(eng),
                compile_specs: vec![],
            });
            m.delegate_call(d, &[x, y]);
        }
        m.inputs(&[x]);
        m.outputs(&[y]);
        pb.add_method(m).unwrap();
    }
    let out = dir.path().join("p.pte");
    let s = pb.write(&out, WriteOptions::default()).unwrap();
    assert!(
        s.file_len < 200_000 + 16_384,
        "file is {} bytes",
        s.file_len
    );
    let f = petite_pte::PteFile::open(&out).unwrap();
    assert_eq!(f.program().segments.len(), 1);
    for plan in &f.program().execution_plan {
        for d in &plan.delegates {
            assert_eq!(d.processed.index, 0);
            assert_eq!(d.processed.location, DataLocation::SEGMENT);
        }
    }
    let (at, len) = f.segment_range(0).unwrap();
    assert_eq!(at % 4096, 0);
    let mut got = Vec::new();
    f.copy_segment(0, &mut got).unwrap();
    assert_eq!(len, 200_000);
    assert_eq!(got, bytes[1000..201_000]);
}
