//! The `safetensors` crate as the differential oracle of [`petite_weights::parse_header`]: for any
//! bytes, both accept or both refuse, except for the disagreements listed in [`ALLOWED`]. Shared by
//! `tests/safetensors_oracle.rs` and the fuzz target (`fuzz/fuzz_targets/header.rs`).

use safetensors::SafeTensors;

/// The disagreements petite makes on purpose, each a case where petite refuses what the
/// `safetensors` crate (0.8) accepts, recognised by petite's error reason. A disagreement that
/// is not here (and every case of safetensors refusing what petite accepts) is a failure.
pub const ALLOWED: &[(&str, &str)] = &[
    (
        "more than once",
        "duplicate tensor names: safetensors deserializes into a HashMap that silently keeps the \
         last entry, so a header could hide a tensor behind another of the same name",
    ),
    (
        "unsupported dtype",
        "dtypes safetensors knows but petite does not read (F64, I16, U16, U32, U64, C64, F8_E5M2 \
         and the other F8_* but F8_E4M3, F6_*, F4; I8 and F8_E4M3 are read, as quantized \
         weights' codes): refused when the header is read rather than when a tensor is used",
    ),
    (
        "unknown field",
        "an entry with a key besides dtype/shape/data_offsets: safetensors' TensorInfo ignores \
         unknown keys, petite refuses a header it does not fully understand",
    ),
    (
        "`__metadata__` is not an object (found null)",
        "`\"__metadata__\": null`: safetensors' Option<HashMap> reads null as no metadata; petite \
         requires the object the format describes",
    ),
];

/// `Ok` if petite and safetensors agree on `bytes` (or disagree as [`ALLOWED`] permits), else why
/// not.
pub fn check(bytes: &[u8]) -> Result<(), String> {
    let petite = petite_weights::parse_header("oracle.safetensors", bytes);
    let oracle = SafeTensors::deserialize(bytes);
    match (&petite, &oracle) {
        (Ok(_), Ok(_)) | (Err(_), Err(_)) => Ok(()),
        (Ok(h), Err(e)) => Err(format!(
            "petite accepts ({} tensors) what safetensors refuses ({e:?})",
            h.entries.len()
        )),
        (Err(e), Ok(_)) => {
            let reason = e.to_string();
            if ALLOWED.iter().any(|(needle, _)| reason.contains(needle)) {
                Ok(())
            } else {
                Err(format!(
                    "petite refuses ({reason}) what safetensors accepts, not an allowed disagreement"
                ))
            }
        }
    }
}

/// Whether `bytes` hit an allowed disagreement (so a test can show each entry is exercised).
#[allow(dead_code)]
pub fn allowed_disagreement(bytes: &[u8]) -> Option<&'static str> {
    let petite = petite_weights::parse_header("oracle.safetensors", bytes).err()?;
    SafeTensors::deserialize(bytes).ok()?;
    let reason = petite.to_string();
    ALLOWED
        .iter()
        .find(|(needle, _)| reason.contains(needle))
        .map(|(needle, _)| *needle)
}
