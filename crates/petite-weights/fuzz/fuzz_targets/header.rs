//! Fuzzes the safetensors header parser and the sharded-index parser with arbitrary bytes: they
//! must never panic, and whatever the header parser accepts must satisfy its documented
//! invariants (so a lying header can never yield an out-of-range view). The `safetensors` crate
//! is the header parser's differential oracle: both accept or both refuse, except for the
//! documented disagreements of `tests/oracle/mod.rs` (shared with the crate's tests).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/oracle/mod.rs"]
mod oracle;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = oracle::check(data) {
        panic!("{e}");
    }
    if let Ok(h) = petite_weights::parse_header("fuzz.safetensors", data) {
        assert!(h.data_start <= data.len());
        let data_len = data.len() - h.data_start;
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for e in &h.entries {
            assert!(e.begin <= e.end && e.end <= data_len, "{e:?}");
            let numel: usize = e.shape.iter().product();
            assert_eq!(numel * e.dtype.size(), e.end - e.begin, "{e:?}");
            if e.begin < e.end {
                spans.push((e.begin, e.end));
            }
        }
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlap {w:?}");
        }
        let covered = h.entries.iter().map(|e| e.end).max().unwrap_or(0);
        assert_eq!(covered, data_len, "data region not entirely indexed");
        let mut names: Vec<&str> = h.entries.iter().map(|e| e.name.as_str()).collect();
        names.sort();
        let n = names.len();
        names.dedup();
        assert_eq!(n, names.len(), "duplicate names accepted");
    }
    if let Ok(idx) = petite_weights::parse_index("fuzz.index.json", data) {
        for (_, shard) in &idx.weight_map {
            assert!(!shard.contains('/') && shard != ".." && !shard.is_empty());
        }
    }
});
