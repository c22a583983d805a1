//! `cargo xtask settings`: the environment is read in one place a crate, and every `PETITE_*`
//! name in library code is a registered one (issue 52).
//!
//! Why: sixteen `PETITE_CUDA_*` switches were once read inside library code, each parsed its own
//! way, and a stale one silently did nothing. Now each crate reads the environment only in its
//! `settings.rs` (and `petite`'s test hook in `guard.rs`), where the documented settings, the
//! removed names (a `REMOVED` list) and the internal ones are declared. This check reads
//! `crates/*/src/**/*.rs` as text (no build: milliseconds; examples, tests, benches and xtask
//! are out of scope) and fails on:
//!
//! 1. `env::var` / `env::var_os` / `env::vars` outside `settings.rs` and `guard.rs`;
//! 2. a `PETITE_[A-Z0-9_]+` name in code (comments are skipped) outside those files that no
//!    `settings.rs` or `guard.rs` declares, or that a `REMOVED` list holds.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::util;

/// Files that may read the environment and that declare names.
fn is_registry(path: &Path) -> bool {
    matches!(
        path.file_name().and_then(|n| n.to_str()),
        Some("settings.rs" | "guard.rs")
    )
}

/// Runs the check over the workspace's `crates/*/src`.
pub fn run() -> Result<()> {
    let root = util::root();
    let found = check(&root.join("crates"))?;
    if !found.is_empty() {
        bail!(
            "settings: the environment is read only in a crate's settings.rs, and every PETITE_ name is registered there:\n  {}",
            found.join("\n  ")
        );
    }
    println!("settings: every environment read is in a settings.rs, every PETITE_ name registered");
    Ok(())
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

/// A line's code: empty for a comment line, else the text before a `//` that is not inside a
/// string literal (a `'"'` char literal opens none).
fn code(line: &str) -> String {
    let t = line.trim_start();
    if t.starts_with("//") {
        return String::new();
    }
    let line = line.replace("'\\\"'", "'  '").replace("'\"'", "' '");
    let mut in_str = false;
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '"' if prev != '\\' => in_str = !in_str,
            '/' if !in_str && prev == '/' => return line[..i - 1].to_string(),
            _ => {}
        }
        prev = if prev == '\\' && c == '\\' { ' ' } else { c };
    }
    line
}

/// The `PETITE_…` names in `text`.
fn names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("PETITE_") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.push(tail[..end].trim_end_matches('_').to_string());
        }
        rest = &tail[end.max(1)..];
    }
    out
}

/// The problems in the crates under `crates` (each `crates/*/src`), as `path:line: what`.
pub fn check(crates: &Path) -> Result<Vec<String>> {
    let mut files = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(crates)
        .with_context(|| format!("reading {}", crates.display()))?
        .filter_map(|e| e.ok().map(|e| e.path().join("src")))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for d in &dirs {
        rust_files(d, &mut files)?;
    }
    // What the registries declare: every name in their code, the removed ones apart.
    let (mut registered, mut removed) = (BTreeSet::new(), BTreeSet::new());
    for f in files.iter().filter(|f| is_registry(f)) {
        let text = std::fs::read_to_string(f)?;
        let mut in_removed = false;
        for line in text.lines() {
            let c = code(line);
            if c.contains("const REMOVED") {
                in_removed = true;
            }
            for n in names(&c) {
                if in_removed {
                    removed.insert(n);
                } else {
                    registered.insert(n);
                }
            }
            if in_removed && c.trim() == "];" {
                in_removed = false;
            }
        }
    }
    let mut found = Vec::new();
    for f in files.iter().filter(|f| !is_registry(f)) {
        let text = std::fs::read_to_string(f)?;
        let rel = f
            .strip_prefix(crates.parent().unwrap_or(crates))
            .unwrap_or(f);
        for (i, line) in text.lines().enumerate() {
            let c = code(line);
            let at = format!("{}:{}", rel.display(), i + 1);
            if c.contains("env::var") {
                found.push(format!(
                    "{at}: reads the environment outside settings.rs: {}",
                    line.trim()
                ));
            }
            for n in names(&c) {
                if removed.contains(&n) {
                    found.push(format!(
                        "{at}: {n} is removed (its REMOVED entry says what decided it)"
                    ));
                } else if !registered.contains(&n) {
                    found.push(format!(
                        "{at}: {n} is no setting a settings.rs declares (a documented one, or INTERNAL)"
                    ));
                }
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        for (p, text) in files {
            let p = t.path().join("crates").join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        t
    }

    const SETTINGS: &str = r#"
pub const SETTINGS: &[Setting] = &[Setting { name: "PETITE_A_CACHE" }];
pub const INTERNAL: &[&str] = &["PETITE_TEST_HOOK"];
pub const REMOVED: &[Removed] = &[
    Removed { name: "PETITE_A_NO_PDL", why: "session 15" },
];
fn env(n: &str) -> Option<OsString> { std::env::var_os(n) }
"#;

    #[test]
    fn a_clean_tree_passes() {
        let t = tree(&[
            ("a/src/settings.rs", SETTINGS),
            (
                "a/src/lib.rs",
                "// std::env::var(\"PETITE_A_NO_PDL\") in a comment is fine\n\
                 /// `PETITE_OLD=1` in docs too\n\
                 const X: &str = \"PETITE_A_CACHE\"; // PETITE_GONE here is a comment\n\
                 let url = \"http://x\"; let h = \"PETITE_TEST_HOOK\";\n",
            ),
            (
                "b/src/guard.rs",
                "let v = std::env::var_os(\"PETITE_TEST_HOOK\");\n",
            ),
            ("b/src/deep/mod.rs", "fn f() {}\n"),
        ]);
        assert_eq!(
            check(&t.path().join("crates")).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn env_reads_and_unregistered_or_removed_names_are_found() {
        let t = tree(&[
            ("a/src/settings.rs", SETTINGS),
            (
                "a/src/fuse/options.rs",
                "let on = std::env::var_os(\"PETITE_A_CACHE\").is_some();\n",
            ),
            (
                "b/src/lib.rs",
                "use std::env;\nlet p = env::var(\"HOME\");\n",
            ),
            (
                "b/src/x.rs",
                "let a = \"PETITE_A_NO_PDL=1\";\nlet b = format!(\"{}\", \"PETITE_NEW_ONE\");\n",
            ),
        ]);
        let found = check(&t.path().join("crates")).unwrap();
        assert_eq!(found.len(), 4, "{found:#?}");
        assert!(found[0].starts_with("crates/a/src/fuse/options.rs:1: reads the environment"));
        assert!(found[1].starts_with("crates/b/src/lib.rs:2: reads the environment"));
        assert!(
            found[2].contains("x.rs:1: PETITE_A_NO_PDL is removed"),
            "{}",
            found[2]
        );
        assert!(
            found[3].contains("x.rs:2: PETITE_NEW_ONE is no setting"),
            "{}",
            found[3]
        );
    }

    #[test]
    fn comments_are_cut_outside_strings_only() {
        assert_eq!(code("  // all comment"), "");
        assert_eq!(code("let a = 1; // PETITE_X"), "let a = 1; ");
        assert_eq!(
            code("let u = \"a//b PETITE_Y\";"),
            "let u = \"a//b PETITE_Y\";"
        );
        assert_eq!(code("if c == '\"' { x } // y"), "if c == ' ' { x } ");
        assert_eq!(
            names("\"PETITE_A_B=1\" XPETITE_C PETITE_D_"),
            ["PETITE_A_B", "PETITE_D"]
        );
    }

    /// The workspace itself passes (what `cargo xtask ci` runs).
    #[test]
    fn the_workspace_passes() {
        let found = check(&util::root().join("crates")).unwrap();
        assert!(found.is_empty(), "{found:#?}");
    }
}
