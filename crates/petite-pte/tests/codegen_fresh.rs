//! The committed generated code must come from the vendored schema: its header records the
//! sha256 of each schema file, written by `cargo xtask codegen`. Editing the schema without
//! regenerating fails here; `cargo xtask codegen --check` (run by the conformance tier, which has
//! flatc) additionally regenerates and compares every byte.

use sha2::{Digest, Sha256};

#[test]
fn generated_code_matches_the_vendored_schema() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let generated =
        std::fs::read_to_string(dir.join("src/generated/program_generated.rs")).unwrap();
    for schema in ["program.fbs", "scalar_type.fbs"] {
        let bytes = std::fs::read(dir.join("schema").join(schema)).unwrap();
        let hex: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let line = format!("// schema-sha256 {schema} {hex}\n");
        assert!(
            generated.contains(&line),
            "src/generated/program_generated.rs is stale for schema/{schema} (sha256 {hex}): run `cargo xtask codegen`"
        );
    }
    assert!(generated.contains("Copyright (c) Meta Platforms, Inc. and affiliates."));
}
