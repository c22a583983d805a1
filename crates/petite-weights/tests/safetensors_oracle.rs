//! petite's strict header reader against the `safetensors` crate: a file one accepts and the
//! other refuses fails, unless the disagreement is one of `oracle::ALLOWED` (petite stricter on
//! purpose).

mod oracle;

use proptest::prelude::*;

/// A file: the little-endian header length `n`, the header text and `data` zero bytes.
fn file_with_len(n: u64, header: &[u8], data: usize) -> Vec<u8> {
    let mut v = n.to_le_bytes().to_vec();
    v.extend_from_slice(header);
    v.resize(v.len() + data, 0);
    v
}

fn file(header: &str, data: usize) -> Vec<u8> {
    file_with_len(header.len() as u64, header.as_bytes(), data)
}

const F32_4: &str = r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;

/// What a hand-made case must give: both accept, both refuse, or the named allowed disagreement.
#[derive(Debug, PartialEq)]
enum Want {
    BothAccept,
    BothRefuse,
    Allowed(&'static str),
}

fn verdict(bytes: &[u8]) -> Want {
    if let Err(e) = oracle::check(bytes) {
        panic!("{e}");
    }
    if let Some(needle) = oracle::allowed_disagreement(bytes) {
        return Want::Allowed(needle);
    }
    match petite_weights::parse_header("x", bytes) {
        Ok(_) => Want::BothAccept,
        Err(_) => Want::BothRefuse,
    }
}

#[test]
fn hand_made_edge_cases() {
    use Want::*;
    let mut non_utf8 = file(r#"{"\u00e9":1}"#, 0);
    let at = non_utf8.len() - 4;
    non_utf8[at] = 0xff;
    let cases: Vec<(&str, Vec<u8>, Want)> = vec![
        ("valid", file(F32_4, 16), BothAccept),
        ("empty header, no data", file("{}", 0), BothAccept),
        (
            "space-padded header",
            file(&format!("{F32_4}     "), 16),
            BothAccept,
        ),
        (
            "leading whitespace",
            file(&format!("  {F32_4}"), 16),
            BothAccept,
        ),
        (
            "metadata strings",
            file(
                r#"{"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[2,1],"data_offsets":[0,4]}}"#,
                4,
            ),
            BothAccept,
        ),
        (
            "zero-sized tensor at the end",
            file(
                r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"z":{"dtype":"F32","shape":[0],"data_offsets":[16,16]}}"#,
                16,
            ),
            BothAccept,
        ),
        (
            "offsets listed out of order",
            file(
                r#"{"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                4,
            ),
            BothAccept,
        ),
        ("shorter than the length prefix", vec![1, 2, 3], BothRefuse),
        ("prefix only", 0u64.to_le_bytes().to_vec(), BothRefuse),
        (
            "header length past the end",
            file_with_len(500, F32_4.as_bytes(), 16),
            BothRefuse,
        ),
        (
            "header length cuts the JSON",
            file_with_len(F32_4.len() as u64 - 3, F32_4.as_bytes(), 16),
            BothRefuse,
        ),
        (
            "huge header length",
            file_with_len(u64::MAX, b"{}", 0),
            BothRefuse,
        ),
        (
            "header length just over the limit",
            file_with_len(petite_weights::MAX_HEADER_LEN + 1, b"{}", 0),
            BothRefuse,
        ),
        ("data truncated", file(F32_4, 15), BothRefuse),
        ("trailing bytes after the data", file(F32_4, 17), BothRefuse),
        ("empty header with data", file("{}", 1), BothRefuse),
        (
            "gap between tensors",
            file(
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}"#,
                5,
            ),
            BothRefuse,
        ),
        (
            "first tensor not at 0",
            file(
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
                3,
            ),
            BothRefuse,
        ),
        (
            "overlapping tensors",
            file(
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#,
                4,
            ),
            BothRefuse,
        ),
        (
            "zero-sized tensor inside another",
            file(
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"z":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}}"#,
                4,
            ),
            BothRefuse,
        ),
        (
            "span too short for dtype",
            file(
                r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}}"#,
                12,
            ),
            BothRefuse,
        ),
        (
            "span too long for dtype",
            file(
                r#"{"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,16]}}"#,
                16,
            ),
            BothRefuse,
        ),
        (
            "end before begin",
            file(
                r#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#,
                4,
            ),
            BothRefuse,
        ),
        (
            "three offsets",
            file(
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}"#,
                1,
            ),
            BothRefuse,
        ),
        (
            "negative offset",
            file(
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}}"#,
                1,
            ),
            BothRefuse,
        ),
        (
            "float dimension",
            file(
                r#"{"w":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}"#,
                1,
            ),
            BothRefuse,
        ),
        (
            "shape overflows",
            file(
                r#"{"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#,
                0,
            ),
            BothRefuse,
        ),
        (
            "unknown dtype name",
            file(
                r#"{"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}}"#,
                4,
            ),
            BothRefuse,
        ),
        (
            "missing shape",
            file(r#"{"w":{"dtype":"U8","data_offsets":[0,1]}}"#, 1),
            BothRefuse,
        ),
        ("entry not an object", file(r#"{"w":3}"#, 0), BothRefuse),
        ("top level an array", file("[]", 0), BothRefuse),
        ("not JSON", file("{nope", 0), BothRefuse),
        (
            "junk after the JSON object",
            file(&format!("{F32_4}x"), 16),
            BothRefuse,
        ),
        ("non-UTF-8 header", non_utf8, BothRefuse),
        (
            "metadata value a number",
            file(r#"{"__metadata__":{"n":1}}"#, 0),
            BothRefuse,
        ),
        (
            "metadata a string",
            file(r#"{"__metadata__":"x"}"#, 0),
            BothRefuse,
        ),
        (
            "metadata value null",
            file(r#"{"__metadata__":{"n":null}}"#, 0),
            BothRefuse,
        ),
        // The allowed disagreements, each exercised.
        (
            "duplicate tensor names",
            file(
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                2,
            ),
            Allowed("more than once"),
        ),
        (
            "dtype petite does not read",
            file(
                r#"{"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#,
                8,
            ),
            Allowed("unsupported dtype"),
        ),
        (
            "sub-byte dtype",
            file(
                r#"{"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}"#,
                1,
            ),
            Allowed("unsupported dtype"),
        ),
        (
            "extra key in an entry",
            file(
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":0}}"#,
                1,
            ),
            Allowed("unknown field"),
        ),
        (
            "metadata null",
            file(r#"{"__metadata__":null}"#, 0),
            Allowed("`__metadata__` is not an object (found null)"),
        ),
    ];
    let mut failures = Vec::new();
    for (name, bytes, want) in cases {
        let got = std::panic::catch_unwind(|| verdict(&bytes));
        match got {
            Ok(got) if got == want => {}
            Ok(got) => failures.push(format!("{name}: wanted {want:?}, got {got:?}")),
            Err(p) => failures.push(format!(
                "{name}: {}",
                p.downcast_ref::<String>().map_or("panic", |s| s.as_str())
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_allowed_disagreement_is_documented() {
    for (needle, why) in oracle::ALLOWED {
        assert!(!needle.is_empty() && why.len() > 40, "{needle}: {why}");
    }
}

/// Bits per element for the dtype names the generator uses (unknown names get 32).
fn bits(dtype: &str) -> usize {
    match dtype {
        "F4" => 4,
        "BOOL" | "U8" | "I8" | "F8_E4M3" => 8,
        "BF16" | "F16" | "U16" => 16,
        "F64" | "I64" => 64,
        _ => 32,
    }
}

/// One header entry as JSON: name, dtype, shape, offset nudge, an extra key or not.
fn entry() -> impl Strategy<Value = (String, &'static str, Vec<usize>, i8, bool)> {
    (
        prop::sample::select(vec!["a", "b", "c", "__metadata__", ""]).prop_map(String::from),
        prop::sample::select(vec![
            "F32", "BF16", "F16", "I64", "I32", "U8", "BOOL", "F64", "U16", "F8_E4M3", "F4", "f32",
        ]),
        prop::collection::vec(0usize..4, 0..3),
        prop_oneof![6 => Just(0i8), 1 => -2i8..=2],
        prop::bool::weighted(0.05),
    )
}

/// A nearly valid file: entries laid out one after another, each possibly nudged, with optional
/// metadata of several shapes, padding, trailing bytes, a lying length or a cut.
fn nearly_valid() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec(entry(), 0..4),
        prop::sample::select(vec![
            "",
            r#""__metadata__":{"k":"v"},"#,
            r#""__metadata__":{"k":1},"#,
            r#""__metadata__":null,"#,
        ]),
        0usize..4,
        prop_oneof![8 => Just(0i64), 1 => -3i64..=3],
        prop_oneof![8 => Just(0usize), 1 => 1usize..3],
        prop_oneof![8 => Just(None), 1 => (0usize..200).prop_map(Some)],
    )
        .prop_map(|(entries, meta, pad, len_lie, trailing, cut)| {
            let mut off = 0usize;
            let mut parts = Vec::new();
            for (name, dtype, shape, nudge, extra) in &entries {
                let bytes = (shape.iter().product::<usize>() * bits(dtype)).div_ceil(8);
                let begin = off.saturating_add_signed(*nudge as isize);
                let end = begin + bytes;
                off = end;
                let extra = if *extra { r#","x":0"# } else { "" };
                parts.push(format!(
                    r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{begin},{end}]{extra}}}"#
                ));
            }
            let header = format!("{{{meta}{}}}{}", parts.join(","), " ".repeat(pad));
            let meta_only = parts.is_empty() && meta.ends_with(',');
            let header = if meta_only {
                format!("{{{}}}", meta.trim_end_matches(','))
            } else {
                header
            };
            let n = (header.len() as i64 + len_lie).max(0) as u64;
            let mut v = file_with_len(n, header.as_bytes(), off + trailing);
            if let Some(c) = cut {
                v.truncate(c);
            }
            v
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn structured_headers_agree(bytes in nearly_valid()) {
        if let Err(e) = oracle::check(&bytes) {
            prop_assert!(false, "{e}\n{}", String::from_utf8_lossy(&bytes));
        }
    }

    #[test]
    fn arbitrary_bytes_agree(
        header in prop::collection::vec(any::<u8>(), 0..64),
        data in 0usize..16,
        lie in -2i64..=2,
    ) {
        let n = (header.len() as i64 + lie).max(0) as u64;
        let bytes = file_with_len(n, &header, data);
        if let Err(e) = oracle::check(&bytes) {
            prop_assert!(false, "{e}");
        }
    }
}
