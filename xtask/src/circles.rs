//! `cargo xtask circles`: no import circles between a crate's top-level modules.
//!
//! Two modules that import each other cannot be read (or moved into crates of their own) one
//! at a time: the shared piece belongs to one side. This check reads each crate's sources as
//! text (no compile: it runs in milliseconds), takes the top-level modules its `lib.rs` or
//! `main.rs` declares (a module's files are `src/m.rs` and everything under `src/m/`), and
//! counts an edge `a → b` for each path into module `b` written in `a`'s code: `crate::b`,
//! the members of a `crate::{…}` group, and `super::b` where `super` is the crate root.
//! Comments (doc links too) are not imports and are skipped; tests are code and count. Every
//! strongly connected set of two or more modules is a circle, reported with one place of each
//! edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::util;

/// One edge: where `from` names `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edge {
    /// The module that imports.
    pub from: String,
    /// The module imported.
    pub to: String,
    /// `path:line` of the first place.
    pub at: String,
}

/// Runs the check over every crate of the workspace (`crates/*` and `xtask`).
pub fn run() -> Result<()> {
    let root = util::root();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .context("reading crates/")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("src").is_dir())
        .collect();
    dirs.sort();
    dirs.push(root.join("xtask"));
    let mut found = Vec::new();
    let mut modules = 0;
    for d in &dirs {
        let src = d.join("src");
        let (n, circles) = check_crate(&src)?;
        modules += n;
        for c in circles {
            found.push(format!(
                "{}: {}",
                d.strip_prefix(&root).unwrap_or(d).display(),
                describe(&c)
            ));
        }
    }
    if !found.is_empty() {
        bail!(
            "import circles between top-level modules (move the shared piece to the side that owns it):\n  {}",
            found.join("\n  ")
        );
    }
    println!(
        "circles: none among {modules} top-level modules of {} crates",
        dirs.len()
    );
    Ok(())
}

fn describe(edges: &[Edge]) -> String {
    edges
        .iter()
        .map(|e| format!("{} → {} ({})", e.from, e.to, e.at))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The crate at `src` (its `lib.rs` or `main.rs`): the number of top-level modules and each
/// circle as the edges inside it.
pub fn check_crate(src: &Path) -> Result<(usize, Vec<Vec<Edge>>)> {
    let root_file = ["lib.rs", "main.rs"]
        .iter()
        .map(|f| src.join(f))
        .find(|p| p.is_file())
        .with_context(|| format!("{}: no lib.rs or main.rs", src.display()))?;
    let root_text = std::fs::read_to_string(&root_file)
        .with_context(|| format!("reading {}", root_file.display()))?;
    let modules = declared_modules(&strip_comments(&root_text));
    let mut edges: BTreeMap<(String, String), String> = BTreeMap::new();
    for m in &modules {
        for (file, supers) in module_files(src, m) {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let code = strip_comments(&text);
            for (line, to) in references(&code, supers) {
                if &to != m && modules.contains(&to) {
                    let rel = file.strip_prefix(src).unwrap_or(&file);
                    edges
                        .entry((m.clone(), to))
                        .or_insert_with(|| format!("src/{}:{line}", rel.display()));
                }
            }
        }
    }
    Ok((modules.len(), circles(&modules, &edges)))
}

/// `mod m;` / `pub mod m;` / `pub(crate) mod m;` declared in a crate root (inline modules with
/// a body are the root's own code, not files).
fn declared_modules(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let t = line.trim();
        let rest = t
            .strip_prefix("pub(crate) mod ")
            .or_else(|| t.strip_prefix("pub mod "))
            .or_else(|| t.strip_prefix("mod "));
        if let Some(r) = rest
            && let Some(name) = r.strip_suffix(';')
        {
            out.insert(name.trim().to_string());
        }
    }
    out
}

/// The files of top-level module `m`, each with how many `super::` reach the crate root from
/// it (`src/m.rs`, `src/m/mod.rs`: 1; `src/m/x.rs`, `src/m/x/mod.rs`: 2; …).
fn module_files(src: &Path, m: &str) -> Vec<(PathBuf, usize)> {
    let mut out = Vec::new();
    let file = src.join(format!("{m}.rs"));
    if file.is_file() {
        out.push((file, 1));
    }
    let dir = src.join(m);
    if dir.is_dir() {
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
            entries.sort();
            for p in entries {
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|e| e == "rs") {
                    // Folders below src/ (m/ is one); a mod.rs is its folder's module.
                    let rel = p.strip_prefix(src).unwrap_or(&p);
                    let folders = rel.components().count() - 1;
                    let is_mod = p.file_name().is_some_and(|n| n == "mod.rs");
                    out.push((p, if is_mod { folders } else { folders + 1 }));
                }
            }
        }
    }
    out
}

/// The text with `//` comments (doc comments included), `/* */` comments and the insides of
/// string literals blanked, line breaks kept (a `crate::x` in a string or a comment is no
/// import; a `//` inside a string is no comment).
pub fn strip_comments(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let mut depth = 0usize;
    while i < b.len() {
        let c = b[i];
        if depth > 0 {
            if c == b'*' && b.get(i + 1) == Some(&b'/') {
                depth -= 1;
                i += 2;
            } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
                depth += 1;
                i += 2;
            } else {
                if c == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            continue;
        }
        match c {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                depth = 1;
                i += 2;
            }
            b'"' => {
                let start = i;
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i = (i + 1).min(b.len());
                out.extend(
                    text[start..i]
                        .chars()
                        .map(|c| if c == '\n' { '\n' } else { ' ' }),
                );
            }
            _ => {
                let ch = text[i..].chars().next().expect("in bounds");
                out.push(ch);
                i += ch.len_utf8();
            }
        }
    }
    out
}

/// Each `(line, module)` that `code` reaches through `crate::`, a `crate::{…}` group, or
/// `super::` repeated `supers` times (the crate root from that file).
fn references(code: &str, supers: usize) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let line_of = |pos: usize| code[..pos].matches('\n').count() + 1;
    let root_by_super = "super::".repeat(supers);
    for prefix in ["crate::", root_by_super.as_str()] {
        let mut from = 0;
        while let Some(k) = code[from..].find(prefix) {
            let at = from + k;
            from = at + prefix.len();
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let rest = &code[from..];
            if rest.starts_with("super::") {
                continue;
            }
            if let Some(group) = rest.strip_prefix('{') {
                for name in group_heads(group) {
                    out.push((line_of(at), name));
                }
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push((line_of(at), name));
                }
            }
        }
    }
    out
}

/// The first path segment of each member of a `{…}` group (its text after the brace), at the
/// group's own depth: `a::X, b, c::{d, e}}` → a, b, c.
fn group_heads(group: &str) -> Vec<String> {
    let mut members = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                members.push(&group[start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                members.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    members
        .into_iter()
        .map(|m| {
            m.trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|h| !h.is_empty())
        .collect()
}

/// The strongly connected sets of two or more modules, each as its edges (Tarjan, iterative
/// enough for a crate's handful of modules: recursion depth is the module count).
fn circles(
    modules: &BTreeSet<String>,
    edges: &BTreeMap<(String, String), String>,
) -> Vec<Vec<Edge>> {
    let names: Vec<&String> = modules.iter().collect();
    let index: BTreeMap<&String, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut adj = vec![Vec::new(); names.len()];
    for (a, b) in edges.keys() {
        adj[index[a]].push(index[b]);
    }
    struct T {
        idx: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        sccs: Vec<Vec<usize>>,
    }
    fn visit(v: usize, adj: &[Vec<usize>], t: &mut T) {
        t.idx[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for &w in &adj[v] {
            match t.idx[w] {
                None => {
                    visit(w, adj, t);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(t.low[v]) == t.idx[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                scc.push(w);
                if w == v {
                    break;
                }
            }
            t.sccs.push(scc);
        }
    }
    let n = names.len();
    let mut t = T {
        idx: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: Vec::new(),
        next: 0,
        sccs: Vec::new(),
    };
    for v in 0..n {
        if t.idx[v].is_none() {
            visit(v, &adj, &mut t);
        }
    }
    let mut out: Vec<Vec<Edge>> = t
        .sccs
        .into_iter()
        .filter(|s| s.len() > 1)
        .map(|s| {
            let set: BTreeSet<usize> = s.into_iter().collect();
            edges
                .iter()
                .filter(|((a, b), _)| set.contains(&index[a]) && set.contains(&index[b]))
                .map(|((a, b), at)| Edge {
                    from: a.clone(),
                    to: b.clone(),
                    at: at.clone(),
                })
                .collect()
        })
        .collect();
    out.sort_by(|a, b| a[0].from.cmp(&b[0].from));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (name, text) in files {
            let p = dir.join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
    }

    #[test]
    fn a_circle_through_a_group_and_super_is_found_and_comments_are_not_imports() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            &[
                ("lib.rs", "pub mod a;\nmod b;\npub(crate) mod c;\n"),
                // a → b through a group; a doc link to c is no import.
                ("a.rs", "//! See [`crate::c`].\nuse crate::{Error, b::X};\n"),
                // b/inner.rs: super is b, super::super the root → c (first at line 2).
                ("b/mod.rs", "mod inner;\n"),
                (
                    "b/inner.rs",
                    "fn f() { super::x(); }\nfn g() { super::super::c::g(); crate::c::h(); }\n",
                ),
                // c → a through super (c.rs's super is the root); a string is no import.
                ("c.rs", "fn g() { let _ = \"crate::b\"; super::a::k(); }\n"),
            ],
        );
        let (n, circles) = check_crate(d.path()).unwrap();
        assert_eq!(n, 3);
        assert_eq!(circles.len(), 1, "{circles:?}");
        let pairs: Vec<(&str, &str)> = circles[0]
            .iter()
            .map(|e| (e.from.as_str(), e.to.as_str()))
            .collect();
        assert_eq!(pairs, [("a", "b"), ("b", "c"), ("c", "a")]);
        assert_eq!(circles[0][1].at, "src/b/inner.rs:2");
    }

    #[test]
    fn one_way_imports_are_no_circle() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            &[
                ("main.rs", "mod a;\nmod b;\n"),
                ("a.rs", "use crate::b::Y;\n/* crate::a::Z in b */\n"),
                ("b.rs", "/* use crate::a; */ fn f() {}\n// crate::a::Z\n"),
            ],
        );
        let (n, circles) = check_crate(d.path()).unwrap();
        assert_eq!((n, circles.len()), (2, 0));
    }

    #[test]
    fn group_heads_take_each_members_first_segment() {
        assert_eq!(
            group_heads("a::X, b, c::{d, e}, Error} rest"),
            ["a", "b", "c", "Error"]
        );
    }
}
