//! The one place the statement IR becomes CUDA C text.
//!
//! The layout is the generator's as it was written when it emitted text, so the text (and
//! the kernels' names and cache keys derived from it) did not change: a body's statements
//! two spaces in, a loop's body two more; blocks and branches do not indent theirs.

use std::fmt::Write as _;

use super::{Arm, Decl, Head, Init, Stmt};

/// `body` as CUDA C, a statement a line (a loop's and a branch's on several), each line
/// ending in a newline.
pub fn render(body: &[Stmt]) -> String {
    let mut out = String::new();
    lines(&mut out, body, 2);
    out
}

fn lines(out: &mut String, body: &[Stmt], indent: usize) {
    for s in body {
        stmt(out, s, indent);
    }
}

/// `[const] ty a = x, b(y), c` (no semicolon).
fn decl(d: &Decl) -> String {
    let mut s = String::new();
    if d.konst {
        s.push_str("const ");
    }
    s.push_str(d.ty);
    for (k, (name, init)) in d.names.iter().enumerate() {
        s.push_str(if k == 0 { " " } else { ", " });
        let _ = match init {
            Init::None => write!(s, "{name}"),
            Init::Eq(e) => write!(s, "{name} = {e}"),
            Init::Ctor(e) => write!(s, "{name}({e})"),
        };
    }
    s
}

fn head(h: &Head) -> String {
    let init = h.init.as_ref().map(decl).unwrap_or_default();
    format!("for ({init}; {}; {} += {})", h.cond, h.var, h.step)
}

fn stmt(out: &mut String, s: &Stmt, indent: usize) {
    let pad = " ".repeat(indent);
    let _ = match s {
        Stmt::Shared { ty, name, len } => writeln!(out, "{pad}__shared__ {ty} {name}[{len}];"),
        Stmt::Decl(d) => writeln!(out, "{pad}{};", decl(d)),
        Stmt::DivMod { ty, coord, rem, by } => {
            writeln!(out, "{pad}{ty} {coord} = {rem} % {by}; {rem} /= {by};")
        }
        Stmt::Assign { to, value } => writeln!(out, "{pad}{to} = {value};"),
        Stmt::Store {
            ptr,
            ty,
            index,
            value,
        } => writeln!(out, "{pad}(({ty}*){ptr})[{index}] = {value};"),
        Stmt::Eval(e) => writeln!(out, "{pad}{e};"),
        Stmt::ReturnIf(c) => writeln!(out, "{pad}if ({c}) return;"),
        Stmt::Barrier => writeln!(out, "{pad}__syncthreads();"),
        Stmt::Loop(h, body) => {
            let _ = writeln!(out, "{pad}{} {{", head(h));
            lines(out, body, indent + 2);
            writeln!(out, "{pad}}}")
        }
        Stmt::Block(body) => {
            let _ = writeln!(out, "{pad}{{");
            lines(out, body, indent);
            writeln!(out, "{pad}}}")
        }
        Stmt::Arms(arms) => {
            for (arm, body) in arms {
                let _ = match arm {
                    Arm::Block => writeln!(out, "{pad}{{"),
                    Arm::If(c) => writeln!(out, "{pad}if ({c}) {{"),
                    Arm::ElseIf(c) => writeln!(out, "{pad}else if ({c}) {{"),
                    Arm::Else => writeln!(out, "{pad}else {{"),
                };
                lines(out, body, indent);
                let _ = writeln!(out, "{pad}}}");
            }
            Ok(())
        }
        Stmt::IfElse { cond, then, els } => {
            let _ = writeln!(out, "{pad}if ({cond}) {{");
            lines(out, then, indent);
            let _ = writeln!(out, "{pad}}} else {{");
            lines(out, els, indent);
            writeln!(out, "{pad}}}")
        }
    };
}
