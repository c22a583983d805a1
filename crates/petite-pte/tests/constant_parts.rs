//! A constant segment gathered from several sources: in-memory constants, file regions (copied
//! in-kernel) and deferred data written by a callback at write time — each tensor at its
//! 16-aligned offset, and a callback that writes the wrong byte count leaves no file behind.
use petite_pte::model::ScalarType;
use petite_pte::{MethodBuilder, ProgramBuilder, PteFile, SegmentData, WriteOptions};

fn program(file: &std::path::Path) -> (ProgramBuilder, Vec<u32>) {
    let mut pb = ProgramBuilder::new();
    let idx = vec![
        pb.add_constant(&[1, 2, 3]), // 3 bytes, then padding
        pb.add_constant_data(SegmentData::file_region(file, 5, 20)),
        pb.add_constant_data(SegmentData::Deferred { id: 7, len: 33 }),
        pb.add_constant(&[9; 4]),
    ];
    let mut m = MethodBuilder::new("forward");
    let outs: Vec<i32> = idx
        .iter()
        .map(|&i| m.constant_tensor(ScalarType::BYTE, &[1], i))
        .collect();
    m.outputs(&outs);
    pb.add_method(m).unwrap();
    (pb, idx)
}

#[test]
fn parts_land_at_their_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let bytes: Vec<u8> = (0..64u8).collect();
    std::fs::write(&src, &bytes).unwrap();
    let (pb, idx) = program(&src);
    let out = dir.path().join("p.pte");
    let mut calls = Vec::new();
    let sum = pb
        .write_streamed(&out, WriteOptions::default(), &mut |id, w| {
            calls.push(id);
            w.write_all(&[0xAB; 33])
        })
        .unwrap();
    assert_eq!(calls, [7]);
    assert_eq!(
        sum.bytes_copied_in_kernel + sum.bytes_copied_buffered,
        3 + 13 + 20 + 12 + 33 + 15 + 4
    );
    let f = PteFile::open(&out).unwrap();
    let cs = f.program().constant_segment.clone().unwrap();
    assert_eq!(cs.offsets, [0, 0, 16, 48, 96]);
    let read = |i: u32, n: usize| {
        let mut b = vec![0u8; n];
        f.read_segment_at(cs.segment_index as usize, cs.offsets[i as usize], &mut b)
            .unwrap();
        b
    };
    assert_eq!(read(idx[0], 3), [1, 2, 3]);
    assert_eq!(read(idx[1], 20), bytes[5..25]);
    assert_eq!(read(idx[2], 33), [0xAB; 33]);
    assert_eq!(read(idx[3], 4), [9; 4]);
}

#[test]
fn a_callback_writing_the_wrong_count_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    std::fs::write(&src, [0u8; 64]).unwrap();
    for n in [32usize, 34] {
        let (pb, _) = program(&src);
        let out = dir.path().join("p.pte");
        let err = pb
            .write_streamed(&out, WriteOptions::default(), &mut |_, w| {
                w.write_all(&vec![1; n])
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains("deferred data 7"), "{err}");
        assert!(!out.exists());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "temp left"
        );
    }
    // write() (no callback) refuses deferred data by name.
    let (pb, _) = program(&src);
    let out = dir.path().join("q.pte");
    let err = pb
        .write(&out, WriteOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("write_pte_streamed"), "{err}");
    assert!(!out.exists());
}

/// Deferred parts filled in place before the rest of the file, then finished by
/// `write_pte_resumable` (which writes the other parts and hands the deferred ones to
/// `Resume::fill_parts`): the same bytes as a streamed write.
#[test]
fn deferred_parts_filled_in_place_give_the_streamed_bytes() {
    use std::os::unix::fs::FileExt;
    struct InPlace(Vec<petite_pte::Placed>);
    impl petite_pte::Resume for InPlace {
        type Error = petite_pte::Error;
        fn done(&mut self, _: &std::fs::File, _: usize, _: u64, _: u64) -> bool {
            false
        }
        fn fill(&mut self, id: u64, _: &std::fs::File, _: u64, _: u64) -> petite_pte::Result<()> {
            panic!("whole-segment fill of {id}")
        }
        fn fill_parts(
            &mut self,
            _: &std::fs::File,
            parts: &[petite_pte::Placed],
        ) -> petite_pte::Result<()> {
            assert_eq!(parts, self.0.as_slice());
            Ok(())
        }
        fn ready(&mut self) -> petite_pte::Result<()> {
            Ok(())
        }
        fn finished(
            &mut self,
            _: &std::fs::File,
            _: usize,
            _: u64,
            _: u64,
        ) -> petite_pte::Result<()> {
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    std::fs::write(&src, (0..64u8).collect::<Vec<_>>()).unwrap();
    let streamed = dir.path().join("s.pte");
    program(&src)
        .0
        .write_streamed(&streamed, WriteOptions::default(), &mut |_, w| {
            w.write_all(&[0xAB; 33])
        })
        .unwrap();
    let (program, segments) = program(&src).0.build().unwrap();
    let places = petite_pte::deferred_places(&program, &segments).unwrap();
    assert_eq!(places.len(), 1);
    assert_eq!((places[0].id, places[0].len), (7, 33));
    let partial = dir.path().join("p.pte.partial");
    let f = std::fs::File::create_new(&partial).unwrap();
    f.write_all_at(&[0xAB; 33], places[0].offset).unwrap();
    let out = dir.path().join("p.pte");
    petite_pte::write_pte_resumable(
        &partial,
        &out,
        &program,
        &segments,
        WriteOptions::default(),
        &mut InPlace(places),
    )
    .unwrap();
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(&streamed).unwrap()
    );
    assert!(!partial.exists());
}
