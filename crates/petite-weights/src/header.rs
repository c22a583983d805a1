//! Strict parsing of safetensors headers and sharded-checkpoint indexes. Pure functions over bytes
//! (no I/O), so the fuzz target exercises exactly what `open` runs.

use std::collections::HashSet;
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::Value;

use crate::{Dtype, Error, Result};

/// Largest JSON header accepted (the same bound the reference safetensors implementation uses):
/// a lying length must not make us allocate or scan gigabytes.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor entry of a header, offsets relative to the start of the data region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// First byte, relative to the data region.
    pub begin: usize,
    /// One past the last byte, relative to the data region.
    pub end: usize,
}

/// A validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensor entries in the order the JSON lists them.
    pub entries: Vec<HeaderEntry>,
    /// The free-form `__metadata__` map, in file order.
    pub metadata: Vec<(String, String)>,
    /// Offset of the data region in the file (`8 + header length`).
    pub data_start: usize,
}

/// A validated `model.safetensors.index.json`: tensor name → shard file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    /// `(tensor, shard)` pairs in file order.
    pub weight_map: Vec<(String, String)>,
}

/// A JSON object's entries in order, rejecting duplicate keys (serde_json's maps silently keep
/// the last one, which would let a header hide a tensor).
struct Entries(Vec<(String, Value)>, Option<String>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut seen = HashSet::new();
                let mut out = Vec::new();
                let mut dup = None;
                while let Some((k, v)) = m.next_entry::<String, Value>()? {
                    if !seen.insert(k.clone()) && dup.is_none() {
                        dup = Some(k.clone());
                    }
                    out.push((k, v));
                }
                Ok(Entries(out, dup))
            }
        }
        d.deserialize_map(V)
    }
}

fn parse_object(json: &[u8]) -> std::result::Result<Entries, String> {
    let text = std::str::from_utf8(json).map_err(|e| format!("not UTF-8: {e}"))?;
    let mut de = serde_json::Deserializer::from_str(text);
    let entries =
        <Entries as serde::Deserialize>::deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end()
        .map_err(|e| format!("trailing data after the JSON object: {e}"))?;
    Ok(entries)
}

fn usize_array(v: &Value, what: &str) -> std::result::Result<Vec<usize>, String> {
    let arr = v
        .as_array()
        .ok_or_else(|| format!("`{what}` is not an array (found {v})"))?;
    arr.iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| format!("`{what}` holds {x}, not a non-negative integer"))
        })
        .collect()
}

/// Parses and validates the header of a whole safetensors file held in `bytes` (typically a
/// mapping). `file` names the file in errors. Checks: the length prefix and header fit in the
/// file; the header is UTF-8 JSON, an object without duplicate names; every entry has a known
/// dtype, a shape and `data_offsets` whose byte length equals `numel × dtype size`; in offset order
/// the tensors tile the data region exactly (no overlap, no hole, no trailing bytes), as the
/// safetensors format requires. The `safetensors` crate is this function's differential oracle
/// (`tests/safetensors_oracle.rs`, the fuzz target).
pub fn parse_header(file: &str, bytes: &[u8]) -> Result<Header> {
    let bad = |tensor: Option<&str>, reason: String| Error::InvalidHeader {
        file: file.to_string(),
        tensor: tensor.map(str::to_string),
        reason,
    };
    if bytes.len() < 8 {
        return Err(Error::Truncated {
            file: file.to_string(),
            reason: format!(
                "{} bytes, shorter than the 8-byte header length prefix",
                bytes.len()
            ),
        });
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER_LEN {
        return Err(bad(
            None,
            format!("header length {n} exceeds the {MAX_HEADER_LEN}-byte limit"),
        ));
    }
    let avail = (bytes.len() - 8) as u64;
    if n > avail {
        return Err(Error::Truncated {
            file: file.to_string(),
            reason: format!(
                "header length {n} runs past the end of the file ({} bytes after the prefix)",
                avail
            ),
        });
    }
    let n = n as usize;
    let data_start = 8 + n;
    let data_len = bytes.len() - data_start;
    let Entries(entries, dup) = parse_object(&bytes[8..data_start]).map_err(|r| bad(None, r))?;
    if let Some(d) = dup {
        return Err(bad(Some(&d), "name appears more than once".into()));
    }
    let mut header = Header {
        entries: Vec::with_capacity(entries.len()),
        metadata: Vec::new(),
        data_start,
    };
    for (name, v) in entries {
        if name == "__metadata__" {
            let obj = v
                .as_object()
                .ok_or_else(|| bad(None, format!("`__metadata__` is not an object (found {v})")))?;
            for (k, v) in obj {
                let s = v.as_str().ok_or_else(|| {
                    bad(
                        None,
                        format!("`__metadata__.{k}` is not a string (found {v})"),
                    )
                })?;
                header.metadata.push((k.clone(), s.to_string()));
            }
            continue;
        }
        let t = Some(name.as_str());
        let obj = v
            .as_object()
            .ok_or_else(|| bad(t, format!("entry is not an object (found {v})")))?;
        for k in obj.keys() {
            if !matches!(k.as_str(), "dtype" | "shape" | "data_offsets") {
                return Err(bad(t, format!("unknown field `{k}`")));
            }
        }
        let dtype_v = obj
            .get("dtype")
            .ok_or_else(|| bad(t, "no `dtype`".into()))?;
        let dtype_s = dtype_v
            .as_str()
            .ok_or_else(|| bad(t, format!("`dtype` is not a string (found {dtype_v})")))?;
        let dtype = Dtype::from_safetensors_name(dtype_s).ok_or_else(|| {
            bad(
                t,
                format!("unsupported dtype `{dtype_s}` (petite reads F32, BF16, F16, I64, I32, U8, BOOL)"),
            )
        })?;
        let shape = usize_array(
            obj.get("shape")
                .ok_or_else(|| bad(t, "no `shape`".into()))?,
            "shape",
        )
        .map_err(|r| bad(t, r))?;
        let offs = usize_array(
            obj.get("data_offsets")
                .ok_or_else(|| bad(t, "no `data_offsets`".into()))?,
            "data_offsets",
        )
        .map_err(|r| bad(t, r))?;
        let [begin, end] = offs[..] else {
            return Err(bad(
                t,
                format!("`data_offsets` has {} entries, expected 2", offs.len()),
            ));
        };
        if begin > end {
            return Err(bad(
                t,
                format!("data_offsets [{begin}, {end}] end before they begin"),
            ));
        }
        if end > data_len {
            return Err(bad(
                t,
                format!(
                    "data_offsets [{begin}, {end}] run past the data region ({data_len} bytes)"
                ),
            ));
        }
        let want = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(t, format!("shape {shape:?} overflows")))?;
        if want != end - begin {
            return Err(bad(
                t,
                format!(
                    "{dtype_s} {shape:?} needs {want} bytes but data_offsets [{begin}, {end}] span {}",
                    end - begin
                ),
            ));
        }
        header.entries.push(HeaderEntry {
            name,
            dtype,
            shape,
            begin,
            end,
        });
    }
    // The data region is entirely indexed (the safetensors rule that stops polyglot files): in
    // offset order every tensor starts where the previous one ends, from 0 to the region's end.
    let mut order: Vec<usize> = (0..header.entries.len()).collect();
    order.sort_by_key(|&i| (header.entries[i].begin, header.entries[i].end));
    let mut covered = 0usize;
    let mut prev: Option<&HeaderEntry> = None;
    for &i in &order {
        let e = &header.entries[i];
        if e.begin != covered {
            let after = match prev {
                Some(p) => format!("`{}` [{}, {}]", p.name, p.begin, p.end),
                None => "the start of the data region".into(),
            };
            let what = if e.begin < covered {
                "overlap"
            } else {
                "leave a hole after"
            };
            return Err(bad(
                Some(&e.name),
                format!("data_offsets [{}, {}] {what} {after}", e.begin, e.end),
            ));
        }
        covered = e.end;
        prev = Some(e);
    }
    if covered != data_len {
        return Err(bad(
            None,
            format!(
                "tensors cover {covered} of the {data_len} bytes of the data region (it must be \
                 entirely indexed: no trailing bytes)"
            ),
        ));
    }
    Ok(header)
}

/// Parses and validates a `model.safetensors.index.json`: an object whose `weight_map` maps each
/// tensor name (once) to a shard file name that is a plain file in the same directory (no path
/// separators, not `.`/`..`: an index must not point outside its checkpoint).
pub fn parse_index(file: &str, bytes: &[u8]) -> Result<Index> {
    let bad = |tensor: Option<&str>, reason: String| Error::InvalidIndex {
        file: file.to_string(),
        tensor: tensor.map(str::to_string),
        reason,
    };
    let Entries(top, dup) = parse_object(bytes).map_err(|r| bad(None, r))?;
    if let Some(d) = dup {
        return Err(bad(None, format!("key `{d}` appears more than once")));
    }
    let wm = top
        .into_iter()
        .find(|(k, _)| k == "weight_map")
        .ok_or_else(|| bad(None, "no `weight_map`".into()))?
        .1;
    let Entries(map, dup) = serde_json::from_value::<Entries>(wm)
        .map_err(|e| bad(None, format!("`weight_map`: {e}")))?;
    // from_value goes through serde_json's map, which already merged duplicates; they are caught
    // by the raw pass below.
    let _ = dup;
    let raw_dup = raw_weight_map_duplicate(bytes);
    if let Some(d) = raw_dup {
        return Err(bad(
            Some(&d),
            "tensor appears more than once in `weight_map`".into(),
        ));
    }
    let mut weight_map = Vec::with_capacity(map.len());
    for (name, v) in map {
        let shard = v
            .as_str()
            .ok_or_else(|| bad(Some(&name), format!("shard is not a string (found {v})")))?;
        if shard.is_empty()
            || shard == "."
            || shard == ".."
            || shard.contains('/')
            || shard.contains('\\')
            || shard.contains('\0')
        {
            return Err(bad(
                Some(&name),
                format!("shard `{shard}` is not a plain file name in the checkpoint directory"),
            ));
        }
        weight_map.push((name, shard.to_string()));
    }
    Ok(Index { weight_map })
}

/// Finds a duplicate key inside `weight_map` by deserializing it with the duplicate-aware visitor
/// directly from the text (a `Value` has already lost duplicates).
fn raw_weight_map_duplicate(bytes: &[u8]) -> Option<String> {
    struct Top(Option<String>);
    impl<'de> serde::Deserialize<'de> for Top {
        fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Top;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(
                    self,
                    mut m: A,
                ) -> std::result::Result<Top, A::Error> {
                    let mut dup = None;
                    while let Some(k) = m.next_key::<String>()? {
                        if k == "weight_map" {
                            let Entries(_, d) = m.next_value::<Entries>()?;
                            if dup.is_none() {
                                dup = d;
                            }
                        } else {
                            m.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                    Ok(Top(dup))
                }
            }
            d.deserialize_map(V)
        }
    }
    serde_json::from_slice::<Top>(bytes).ok().and_then(|t| t.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str, data: usize) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.resize(v.len() + data, 0);
        v
    }

    #[test]
    fn accepts_a_valid_header() {
        let f = file(
            r#"{"__metadata__":{"a":"b"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"s":{"dtype":"BF16","shape":[],"data_offsets":[16,18]}}"#,
            18,
        );
        let h = parse_header("x.safetensors", &f).unwrap();
        assert_eq!(h.entries.len(), 2);
        assert_eq!(h.entries[1].shape, Vec::<usize>::new());
        assert_eq!(h.metadata, vec![("a".into(), "b".into())]);
    }

    fn err(json: &str, data: usize) -> String {
        parse_header("x.safetensors", &file(json, data))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn rejects_lies() {
        let e = err(
            r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#,
            16,
        );
        assert!(
            e.contains("x.safetensors") && e.contains("`w`") && e.contains("16 bytes"),
            "{e}"
        );
        let e = err(
            r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            8,
        );
        assert!(e.contains("run past the data region"), "{e}");
        let e = err(
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            16,
        );
        assert!(e.contains("overlap"), "{e}");
        let e = err(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
            12,
        );
        assert!(e.contains("`b`") && e.contains("hole after `a`"), "{e}");
        let e = err(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            5,
        );
        assert!(e.contains("cover 4 of the 5 bytes"), "{e}");
        let e = err(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"z":{"dtype":"F32","shape":[0],"data_offsets":[2,2]}}"#,
            4,
        );
        assert!(e.contains("`z`") && e.contains("overlap `a`"), "{e}");
        let e = err(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
        );
        assert!(e.contains("`a`") && e.contains("more than once"), "{e}");
        let e = err(
            r#"{"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#,
            8,
        );
        assert!(e.contains("unsupported dtype"), "{e}");
        let e = err(
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
            8,
        );
        assert!(e.contains("end before"), "{e}");
        let e = err(
            r#"{"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#,
            8,
        );
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn rejects_bad_framing() {
        let e = parse_header("x", &[1, 2, 3]).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        let mut f = file("{}", 0);
        f[0] = 200;
        let e = parse_header("x", &f).unwrap_err().to_string();
        assert!(e.contains("runs past the end"), "{e}");
        let mut f = file("{\"\u{e9}\":1}", 0);
        f[9] = 0xff;
        let e = parse_header("x", &f).unwrap_err().to_string();
        assert!(e.contains("UTF-8"), "{e}");
        let e = parse_header("x", &file("[]", 0)).unwrap_err().to_string();
        assert!(e.contains("invalid safetensors header"), "{e}");
    }

    #[test]
    fn index_rules() {
        let ok = parse_index(
            "i.json",
            br#"{"metadata":{"total_size":8},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(ok.weight_map.len(), 2);
        let e = parse_index("i.json", br#"{"weight_map":{"a":"../etc/passwd"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`a`") && e.contains("plain file name"), "{e}");
        let e = parse_index("i.json", br#"{"weight_map":{"a":"x","a":"y"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than once"), "{e}");
        let e = parse_index("i.json", br#"{"metadata":{}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no `weight_map`"), "{e}");
    }
}
