//! Text passes over generated kernel bodies: two groups' bodies as one kernel ([`beside`],
//! [`with_first`]) and loops unrolled ([`unrolled`], [`rows_unrolled`]). They rename and
//! reorder the generator's lines without changing what any line computes, so the bits stay.

use std::fmt::Write as _;

#[cfg(doc)]
use super::Group;

/// One kernel running grid-stride body `own` on blocks `[0, gb)` and body `other` on the `ga`
/// blocks after them, each seeing only its own blocks (`blockIdx`, `gridDim`) and `other` its
/// own `n`, leaves and output renamed `qn`, `q0…`, `qo`. Why: a step's q and k RoPEs were two
/// launches of a few microseconds each, back to back with a GEMM between.
pub fn beside(own: &str, gb: u32, other: &str, ga: u32) -> String {
    let mut out = String::with_capacity(own.len() + other.len() + 256);
    let _ = writeln!(out, "  if (blockIdx.x < {gb}u) {{\n  const dim3 pg({gb}u);");
    for l in own.lines() {
        out.push_str(&map_words(l, |w| {
            (w == "gridDim").then(|| "pg".to_string())
        }));
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "  }} else {{\n  const dim3 qb(blockIdx.x - {gb}u), qg({ga}u);"
    );
    for l in other.lines() {
        let l = map_words(l, |w| match w {
            "blockIdx" => Some("qb".to_string()),
            "gridDim" => Some("qg".to_string()),
            "n" => Some("qn".to_string()),
            _ => None,
        });
        out.push_str(&operands_renamed(&l));
        out.push('\n');
    }
    out.push_str("  }\n");
    out
}

/// A prologue kernel's `body` computing `first`'s elements of its row first (`first` a plain
/// group body, its leaves and output renamed `q0…`, `qo`), storing them, then a block barrier
/// so the norm's statistics read them. Why: each of a step's 36 residual sums was a launch of
/// its own just before the norm that reads it (one less launch a sum, the same bits).
pub fn with_first(body: &str, first: &str) -> Option<String> {
    let at = body.find("  float nm, nr;")?;
    let lines: Vec<&str> = first.lines().collect();
    let (head, rest) = lines.split_first()?;
    let (last, inner) = rest.split_last()?;
    if !head.trim_start().starts_with("for (i64 i = ") || last.trim() != "}" {
        return None;
    }
    let mut out = String::with_capacity(body.len() + first.len() + 128);
    out.push_str(&body[..at]);
    out.push_str("  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {\n    const i64 i = base + jj;\n");
    for l in inner {
        out.push_str(&operands_renamed(l));
        out.push('\n');
    }
    out.push_str("  }\n  __syncthreads();\n");
    out.push_str(&body[at..]);
    Some(out)
}

/// `line` with a kernel's operands `pN` and `po` renamed `qN` and `qo`, its offsets `sN`
/// renamed `tN`.
fn operands_renamed(line: &str) -> String {
    map_words(line, |w| {
        let numbered =
            |c: char| w.len() > 1 && w.starts_with(c) && w[1..].bytes().all(|b| b.is_ascii_digit());
        if w == "po" || numbered('p') {
            Some(format!("q{}", &w[1..]))
        } else if numbered('s') {
            Some(format!("t{}", &w[1..]))
        } else {
            None
        }
    })
}

/// `line` with each identifier-like word `w` replaced by `f(w)` where that is `Some`.
pub(super) fn map_words(line: &str, f: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(line.len() + 16);
    let b = line.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut j = 0;
    while j < b.len() {
        if !word(b[j]) {
            out.push(b[j] as char);
            j += 1;
            continue;
        }
        let start = j;
        while j < b.len() && word(b[j]) {
            j += 1;
        }
        let w = &line[start..j];
        match f(w) {
            Some(x) => out.push_str(&x),
            None => out.push_str(w),
        }
    }
    out
}

/// Elements from which a fused kernel without a prologue is [`unrolled`] ([`UNROLL`] a trip):
/// the prefix's big passes (SigLIP's 3 × 256 × 1,152 residuals up to 968 × 16,384 GELU × up),
/// not the step's latency-bound ones (50 × 4,096 at most).
pub const UNROLL_FROM: usize = 1 << 19;

/// Elements a thread of an [`unrolled`] kernel takes per trip.
pub const UNROLL: usize = 4;

/// `body` (a grid-stride loop over straight-line code, as the generator writes it without a
/// prologue) with each trip taking [`UNROLL`] elements a grid apart, the copies' lines
/// interleaved so that every copy's loads are issued before any copy's store. Why: one 2-byte
/// load in flight per thread left the prefix's big elementwise passes at ~40% of the H200's
/// bandwidth. Each element is computed by the same lines as before (the same bits). `None`
/// when the loop holds a branch (its lines cannot be interleaved).
pub fn unrolled(body: &str) -> Option<String> {
    let lines: Vec<&str> = body.lines().collect();
    let (first, rest) = lines.split_first()?;
    let (last, inner) = rest.split_last()?;
    if !first.trim_start().starts_with("for (i64 i = ")
        || last.trim() != "}"
        || inner.iter().any(|l| l.contains('{') || l.contains('}'))
    {
        return None;
    }
    let u = UNROLL;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  const i64 st = (i64)gridDim.x * blockDim.x;\n  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;\n  for (; i + {} * st < n; i += {u} * st) {{",
        u - 1
    );
    interleaved(
        &mut out,
        inner,
        ("i", "st"),
        renamed,
        "for (; i < n; i += st)",
    );
    Some(out)
}

/// The inside of an unrolled trip — `const i64 v_0 = v + 0 * step, …;`, then each of `inner`'s
/// lines [`UNROLL`] times, copy `k` through `rename(line, k)` — closing the trip's loop, and
/// the remainder loop `rest` over `inner` as it is.
fn interleaved(
    out: &mut String,
    inner: &[&str],
    (var, step): (&str, &str),
    rename: fn(&str, usize) -> String,
    rest: &str,
) {
    let decl: Vec<String> = (0..UNROLL)
        .map(|k| format!("{var}_{k} = {var} + {k} * {step}"))
        .collect();
    let _ = writeln!(out, "    const i64 {};", decl.join(", "));
    for l in inner {
        for k in 0..UNROLL {
            let _ = writeln!(out, "{}", rename(l, k));
        }
    }
    let _ = writeln!(out, "  }}\n  {rest} {{");
    for l in inner {
        let _ = writeln!(out, "{l}");
    }
    let _ = writeln!(out, "  }}");
}

/// The row loop of a prologue kernel ([`Group::prologue`]): its residual sum's
/// ([`with_first`]) and its elements'.
const ROW_LOOP: &str = "  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {";

/// A prologue kernel's `body` with each straight-line row loop taking [`UNROLL`] elements a
/// trip, `blockDim.x` apart, the copies' lines interleaved so that every copy's loads are
/// issued before any copy's store (the remainder in the loop as it was); the generator then has the
/// statistics computed by `norm_stats4` (four loads before their adds, for the input's dtype
/// and the norm's kind known here instead of switched on in the loop). Why:
/// the SASS of every norm kernel showed one load in flight — each load's use, or a store the
/// compiler cannot prove apart from the next load, waited a memory latency per element; a
/// step's row of 1,024 on 256 threads pays four of them a pass. Each element is computed by the
/// same lines as before and each thread adds in the same order: the same bits. Loops holding
/// a branch (a concat) are left as they are.
pub fn rows_unrolled(body: &str) -> String {
    let u = UNROLL;
    let lines: Vec<&str> = body.lines().collect();
    let mut out = String::with_capacity(body.len() * 5);
    let mut k = 0;
    while k < lines.len() {
        let line = lines[k];
        let end = (line == ROW_LOOP)
            .then(|| lines[k + 1..].iter().position(|l| *l == "  }"))
            .flatten()
            .map(|e| k + 1 + e);
        let Some(end) = end.filter(|&e| {
            lines[k + 1..e]
                .iter()
                .all(|l| !l.contains('{') && !l.contains('}'))
        }) else {
            out.push_str(line);
            out.push('\n');
            k += 1;
            continue;
        };
        let inner = &lines[k + 1..end];
        let _ = writeln!(
            out,
            "  {{\n  const i64 bd = blockDim.x;\n  i64 jj = threadIdx.x;\n  for (; jj + {} * bd < np.d; jj += {u} * bd) {{",
            u - 1
        );
        let rest = "for (; jj < np.d; jj += bd)";
        interleaved(&mut out, inner, ("jj", "bd"), row_renamed, rest);
        out.push_str("  }\n");
        k = end + 1;
    }
    out
}

/// `line` of a row loop with its own names (`jj`, `i`, `r`, `nv`, `cN`, `vN`) suffixed `_k`.
pub(super) fn row_renamed(line: &str, k: usize) -> String {
    map_words(line, |w| {
        let ours = matches!(w, "jj" | "i" | "r" | "nv")
            || (w.len() > 1
                && (w.starts_with('v') || w.starts_with('c'))
                && w[1..].bytes().all(|c| c.is_ascii_digit()));
        ours.then(|| format!("{w}_{k}"))
    })
}

/// `line` with the loop's own names (`i`, `r`, `cN`, `vN`) suffixed `_k`.
pub(super) fn renamed(line: &str, k: usize) -> String {
    map_words(line, |w| {
        let ours = w == "i"
            || w == "r"
            || (w.len() > 1
                && (w.starts_with('v') || w.starts_with('c'))
                && w[1..].bytes().all(|c| c.is_ascii_digit()));
        ours.then(|| format!("{w}_{k}"))
    })
}
