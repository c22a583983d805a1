//! Serde helper: constant bytes as a lower-case hex string (compact, diffable JSON).

use serde::{Deserialize, Deserializer, Serializer};

/// Serialises bytes as hex.
pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&hex::encode(bytes))
}

/// Parses hex written by [`serialize`].
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    hex::decode(&s).map_err(|e| serde::de::Error::custom(format!("constant data is not hex: {e}")))
}
