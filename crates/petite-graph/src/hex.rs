//! Serde helper: constant bytes as a lower-case hex string (compact, diffable JSON).

use serde::{Deserialize, Deserializer, Serializer};

/// Serialises bytes as hex.
pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> std::result::Result<S::Ok, S::Error> {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    s.serialize_str(&out)
}

/// Parses hex written by [`serialize`].
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    let digit = |c: u8| -> std::result::Result<u8, D::Error> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(serde::de::Error::custom(format!(
                "invalid hex digit {:?} in constant data",
                c as char
            ))),
        }
    };
    let b = s.as_bytes();
    if b.len() % 2 != 0 {
        return Err(serde::de::Error::custom(
            "constant data hex string has an odd length",
        ));
    }
    b.chunks_exact(2)
        .map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}
