//! Row-range weights: JSON stays as before for whole weights, validation of ranges, and the
//! shape of `Builder::embedding_sharded`.

use petite_graph::{Builder, Dtype, Error, Op, Program};

fn table_program(rows: Option<[usize; 2]>) -> Program {
    let mut b = Builder::new();
    let ids = b.input("ids", Dtype::I64, &[3]).unwrap();
    let w = match rows {
        None => b.weight("t", Dtype::F32, &[10, 4]).unwrap(),
        Some(r) => b.weight_rows("t", Dtype::F32, &[10, 4], r).unwrap(),
    };
    let y = b.embedding(w, ids).unwrap();
    b.output("y", y).unwrap();
    b.finish().unwrap()
}

#[test]
fn whole_weights_serialise_without_rows_and_ranges_round_trip() {
    let whole = table_program(None);
    let json = whole.to_json().unwrap();
    assert!(!json.contains("rows"), "{json}");
    let ranged = table_program(Some([2, 7]));
    let json = ranged.to_json().unwrap();
    assert!(json.contains("\"rows\": [\n"), "{json}");
    let back = Program::from_json(&json).unwrap();
    back.validate().unwrap();
    assert_eq!(back, ranged);
    let w = &back.weights()[0];
    assert_eq!(
        (w.rows, w.shape.clone(), w.bytes),
        (Some([2, 7]), vec![5, 4], 5 * 4 * 4)
    );
    // Rows of a row-major tensor are one byte range, in the stored dtype's element size.
    assert_eq!(w.stored_range(2), Some(2 * 4 * 2..7 * 4 * 2));
    assert_eq!(w.display_name(), "t[2..7]");
    assert!(back.to_string().contains("weight \"t\"[2..7]"));
}

fn set_rows(p: &mut Program, rows: Option<[usize; 2]>) {
    for n in &mut p.nodes {
        if let Op::Weight { rows: r, .. } = &mut n.op {
            *r = rows;
        }
    }
}

#[test]
fn bad_row_ranges_are_named() {
    // Empty or reversed range.
    let mut p = table_program(Some([2, 7]));
    set_rows(&mut p, Some([7, 7]));
    let e = p.validate().unwrap_err().to_string();
    assert!(
        e.contains("empty or reversed") && e.contains("weight"),
        "{e}"
    );
    // Declared rows disagree with the range.
    let mut p = table_program(Some([2, 7]));
    set_rows(&mut p, Some([2, 8]));
    let e = p.validate().unwrap_err().to_string();
    assert!(e.contains("expected 6 rows on axis 0"), "{e}");
    // Builder: out of the tensor, empty.
    let mut b = Builder::new();
    let e = b
        .weight_rows("t", Dtype::F32, &[10, 4], [8, 11])
        .unwrap_err();
    assert!(e.to_string().contains("within the 10 rows"), "{e}");
    let e = b
        .weight_rows("t", Dtype::F32, &[10, 4], [3, 3])
        .unwrap_err();
    assert!(e.to_string().contains("non-empty"), "{e}");
}

fn two_ranges(a: [usize; 2], b2: Option<[usize; 2]>) -> Result<Program, Error> {
    let mut b = Builder::new();
    let ids = b.input("ids", Dtype::I64, &[3]).unwrap();
    let w0 = b.weight_rows("t", Dtype::F32, &[10, 4], a).unwrap();
    let w1 = match b2 {
        Some(r) => b.weight_rows("t", Dtype::F32, &[10, 4], r).unwrap(),
        None => b.weight("t", Dtype::F32, &[10, 4]).unwrap(),
    };
    let y0 = b.embedding(w0, ids).unwrap();
    let y1 = b.embedding(w1, ids).unwrap();
    b.output("y0", y0).unwrap();
    b.output("y1", y1).unwrap();
    b.finish()
}

#[test]
fn ranges_of_one_weight_must_be_disjoint() {
    two_ranges([0, 5], Some([5, 10])).unwrap();
    let e = two_ranges([0, 5], Some([4, 10])).unwrap_err().to_string();
    assert!(
        e.contains("overlapping rows") && e.contains("t[0..5]") && e.contains("t[4..10]"),
        "{e}"
    );
    // The whole tensor overlaps every range of it.
    let e = two_ranges([0, 5], None).unwrap_err().to_string();
    assert!(e.contains("overlapping rows"), "{e}");
    // The builder returns the same node for the same range.
    let mut b = Builder::new();
    let x = b.weight_rows("t", Dtype::F32, &[10, 4], [1, 3]).unwrap();
    assert_eq!(b.weight_rows("t", Dtype::F32, &[10, 4], [1, 3]).unwrap(), x);
    // A hand-made duplicate is a duplicate name.
    let mut p = two_ranges([0, 5], Some([5, 10])).unwrap();
    set_rows(&mut p, Some([0, 5]));
    let e = p.validate().unwrap_err().to_string();
    assert!(e.contains("weight") && e.contains("\"t\""), "{e}");
}

#[test]
fn embedding_sharded_is_plain_when_the_table_fits_and_shards_otherwise() {
    let build = |max: usize| {
        let mut b = Builder::new();
        let ids = b.input("ids", Dtype::I64, &[5]).unwrap();
        let y = b
            .embedding_sharded("t", Dtype::Bf16, &[1000, 8], ids, max)
            .unwrap();
        b.output("y", y).unwrap();
        b.finish().unwrap()
    };
    // 1000 × 8 × 2 = 16000 bytes: fits → exactly what `embedding` makes.
    let mut b = Builder::new();
    let ids = b.input("ids", Dtype::I64, &[5]).unwrap();
    let w = b.weight("t", Dtype::Bf16, &[1000, 8]).unwrap();
    let y = b.embedding(w, ids).unwrap();
    b.output("y", y).unwrap();
    let plain = b.finish().unwrap();
    assert_eq!(build(16000), plain);
    assert_eq!(build(16000).to_json().unwrap(), plain.to_json().unwrap());
    // 4000 bytes = 250 rows per shard at most → 4 shards of 250.
    let p = build(4000);
    let ranges: Vec<_> = p.weights().iter().map(|w| w.rows.unwrap()).collect();
    assert_eq!(ranges, vec![[0, 250], [250, 500], [500, 750], [750, 1000]]);
    assert!(p.weights().iter().all(|w| w.bytes <= 4000));
    // 3000 bytes = 187 rows at most → 6 shards as equal as possible (167, ..., 165).
    let p = build(3000);
    let ranges: Vec<_> = p.weights().iter().map(|w| w.rows.unwrap()).collect();
    assert_eq!(ranges.len(), 6);
    assert_eq!((ranges[0], ranges[5]), ([0, 167], [835, 1000]));
    assert!(ranges.windows(2).all(|w| w[0][1] == w[1][0]));
    assert_eq!(
        p.node(p.outputs[0].value).tensor().unwrap().shape,
        vec![5, 8]
    );
    // One row larger than a shard: a clear error.
    let mut b = Builder::new();
    let ids = b.input("ids", Dtype::I64, &[5]).unwrap();
    let e = b
        .embedding_sharded("t", Dtype::Bf16, &[1000, 8], ids, 15)
        .unwrap_err();
    assert!(e.to_string().contains("one row is 16 bytes"), "{e}");
}
