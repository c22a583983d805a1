//! Code generation: one fused group's kernel body as statements ([`Gen`], [`super::ir`]),
//! each op computed with the shared prelude's device functions and rounded to its dtype, as
//! `pt_ew` computes it.

use std::collections::HashMap;

use petite_graph::{Dtype, NodeId, Op, Program};

use super::ir::{Arm, Decl, Expr, Grid, Head, Ident, Init, Local, Name, Operand, Side, Stmt, cat};
use super::regs::{
    as_f, as_i, broadcast, dt_macro, f32_lit, index_type, is_f, store_f, store_i, wrap,
};
use super::rewrite::stats_decl;
#[cfg(doc)]
use super::{Fusion, Group, Options, Role};
use super::{StridedView, read_from};
use crate::plan::contiguous_strides;
use crate::source::EwOp;
use crate::{Error, Result};

/// One group's generated kernel body and what its launch passes: the values it reads (in
/// parameter order), the prologue norm it computes (if any) and its slice starts.
#[derive(Clone)]
pub(super) struct Generated {
    pub(super) body: Vec<Stmt>,
    pub(super) leaves: Vec<NodeId>,
    pub(super) prologue: Option<NodeId>,
    pub(super) offsets: Vec<i64>,
}

pub(super) struct Gen<'a> {
    pub(super) program: &'a Program,
    pub(super) group: usize,
    pub(super) group_of: &'a [Option<usize>],
    /// The statements emitted so far in the current scope (the element loop's body, or a
    /// branch's).
    pub(super) body: Vec<Stmt>,
    /// The register holding a value at coordinates (as rendered) in the current scope.
    pub(super) memo: HashMap<(NodeId, Vec<String>), Expr>,
    pub(super) leaves: Vec<NodeId>,
    pub(super) vars: usize,
    /// The norm computed in the kernel's header ([`Role::Prologue`]), held in `nv`.
    pub(super) prologue: Option<NodeId>,
    /// The root's coordinates: where the prologue may be read.
    pub(super) root_coords: Vec<Expr>,
    /// Linears whose bias is added as they are loaded ([`Fusion::biases`]).
    pub(super) biases: &'a HashMap<NodeId, NodeId>,
    /// Non-zero slice starts read as parameters `s0…` ([`Group::offsets`]); one a value, so
    /// equal starts give equal expressions (and shared loads) as literals would.
    pub(super) offsets: Vec<i64>,
    /// Starts as parameters; else as literals (`offsets=literal`, and the check that
    /// both forms are the same code).
    pub(super) offset_params: bool,
    /// The prologue's statistics by `norm_stats4` ([`Options::unrolled_rows`]).
    pub(super) unrolled_rows: bool,
    /// Operands read in place ([`Fusion::views`]): where the prologue norm reads its input.
    pub(super) views: &'a HashMap<(NodeId, usize), StridedView>,
}

pub(super) fn gen_err(id: NodeId, p: &Program, msg: impl std::fmt::Display) -> Error {
    Error::Node {
        node: p.describe(id),
        message: format!("fusion: {msg}"),
    }
}

impl Gen<'_> {
    fn var(&mut self) -> Ident {
        self.vars += 1;
        Name::Var(self.vars).into()
    }

    fn ctype(d: Dtype) -> &'static str {
        if is_f(d) { "float" } else { "i64" }
    }

    /// Slice start `s` (non-zero) as the kernel reads it: a parameter, or a literal.
    fn start(&mut self, s: i64) -> Expr {
        if !self.offset_params {
            return format!("{s}LL").into();
        }
        let j = match self.offsets.iter().position(|&o| o == s) {
            Some(j) => j,
            None => {
                self.offsets.push(s);
                self.offsets.len() - 1
            }
        };
        Name::Offset(Side::Own, j).into()
    }

    pub(super) fn kernel_body(&mut self, root: NodeId) -> Result<Vec<Stmt>> {
        let t = self
            .program
            .node(root)
            .tensor()
            .ok_or_else(|| gen_err(root, self.program, "tuple result"))?
            .clone();
        let r = t.shape.len();
        let mut coords = Vec::with_capacity(r);
        // The statements before the element loop, and the loop's header.
        let (mut top, head) = match self.prologue {
            Some(norm) => {
                // One block a row of the norm: its statistics, then each element normalized as
                // `pt_norm` stores it (rounded to the norm's dtype) and run through the group.
                let d = self
                    .program
                    .node(norm)
                    .tensor()
                    .ok_or_else(|| gen_err(norm, self.program, "tuple norm"))?
                    .dtype;
                // With unrolled rows, the statistics and the element formula for the operands'
                // dtypes (`np.dx`, `dw`, `db` at launch: each view's base where read in place)
                // and the norm's kind, known here.
                let node = self.program.node(norm);
                let mut dts = Vec::with_capacity(3);
                for j in 0..node.inputs.len() {
                    let v = read_from(self.program, self.views, norm, j);
                    let t = self
                        .program
                        .node(v)
                        .tensor()
                        .ok_or_else(|| gen_err(norm, self.program, "tuple norm operand"))?;
                    dts.push(t.dtype);
                }
                let kind = match node.op {
                    Op::LayerNorm { .. } => 0,
                    _ => 1,
                };
                let known = |k: usize| dts.get(k).map_or("-1", |&t| dt_macro(t));
                let floats = dts
                    .iter()
                    .all(|t| matches!(t, Dtype::F32 | Dtype::Bf16 | Dtype::F16));
                let (stats, elem) = if self.unrolled_rows && floats && !dts.is_empty() {
                    (
                        format!("norm_stats4<{}, {kind}>", known(0)),
                        format!(
                            "norm_elem4<{}, {kind}, {}, {}>",
                            known(0),
                            known(1),
                            known(2)
                        ),
                    )
                } else {
                    ("norm_stats".to_string(), "norm_elem".to_string())
                };
                use Local::{Base, Jj, Nb, Nm, Np, Nr, Nw, Nx, Row, Shd};
                let y = cat![
                    elem, "(", Np, ", ", Nx, ", ", Nw, ", ", Nb, ", ", Base, ", ", Jj
                ];
                let y = store_f(cat![y, ", ", Nm, ", ", Nr, ")"], d);
                self.body = vec![
                    Stmt::decl(true, "i64", Local::I, cat![Base, " + ", Jj]),
                    Stmt::decl(true, "float", Local::Nv, y),
                ];
                let top = vec![
                    Stmt::Shared {
                        ty: "double",
                        name: Shd.into(),
                        len: 32,
                    },
                    Stmt::decl(true, "i64", Row, cat![Grid::BlockIdx, ".x"]),
                    Stmt::ReturnIf(cat![Row, " >= ", Np, ".rows"]),
                    Stmt::decl(true, "i64", Base, cat![Row, " * ", Np, ".d"]),
                    stats_decl(),
                    Stmt::Eval(cat![
                        stats, "(", Np, ", ", Nx, ", ", Base, ", ", Shd, ", &", Nm, ", &", Nr, ")"
                    ]),
                ];
                (top, Head::row())
            }
            None => (Vec::new(), Head::grid_stride()),
        };
        // Coordinates by 32-bit division where the value has fewer than 2³¹ elements (a 64-bit
        // division by a constant takes several 64-bit multiplies); every later use widens them
        // to i64.
        let (ity, suf) = index_type(t.shape.iter().product());
        let rem = Local::R;
        let cast = cat![format!("({ity})"), Local::I];
        self.body.push(Stmt::decl(false, ity, rem, cast));
        for d in (0..r).rev() {
            let s = t.shape[d];
            if s == 1 {
                coords.push("0".into());
            } else {
                let coord = Name::Coord(d);
                self.body.push(Stmt::DivMod {
                    ty: ity,
                    coord: coord.into(),
                    rem: rem.into(),
                    by: format!("{s}{suf}").into(),
                });
                coords.push(coord.into());
            }
        }
        coords.reverse();
        self.root_coords = coords.clone();
        let v = self.value(root, &coords)?;
        let (ty, value) = match t.dtype {
            Dtype::F32 => ("float", v),
            Dtype::Bf16 => ("unsigned short", wrap("f2bf(", v, ")")),
            Dtype::F16 => ("unsigned short", wrap("f2h(", v, ")")),
            Dtype::I64 => ("i64", v),
            Dtype::I32 => ("int", wrap("(int)", v, "")),
            Dtype::U8 | Dtype::Bool => ("unsigned char", wrap("(unsigned char)", v, "")),
            Dtype::I8 | Dtype::F8E4M3 => unreachable!("{}", crate::plan::CODES_UNFUSED),
        };
        self.body.push(Stmt::Store {
            ptr: Name::Operand(Side::Own, Operand::Out).into(),
            ty,
            index: Local::I.into(),
            value,
        });
        top.push(Stmt::Loop(head, std::mem::take(&mut self.body)));
        Ok(top)
    }

    /// A register of C type `ty` declared with `expr`'s value.
    fn emit(&mut self, ty: &'static str, expr: Expr) -> Expr {
        let v = self.var();
        self.body.push(Stmt::decl(false, ty, v, expr));
        v.into()
    }

    /// The register holding `id`'s value at coordinates `c` (C expressions).
    fn value(&mut self, id: NodeId, c: &[Expr]) -> Result<Expr> {
        let key = (id, c.iter().map(Expr::to_string).collect());
        if let Some(v) = self.memo.get(&key) {
            return Ok(v.clone());
        }
        let p = self.program;
        let node = p.node(id);
        let t = node
            .tensor()
            .ok_or_else(|| gen_err(id, p, "tuple value"))?
            .clone();
        let dt = t.dtype;
        if Some(id) == self.prologue {
            return if c == self.root_coords.as_slice() {
                Ok(Local::Nv.into())
            } else {
                Err(gen_err(id, p, "a prologue norm read off its own element"))
            };
        }
        let v = if self.group_of[id.index()] != Some(self.group) {
            // A materialized value: load it (dense, row-major).
            let j = match self.leaves.iter().position(|&l| l == id) {
                Some(j) => j,
                None => {
                    self.leaves.push(id);
                    self.leaves.len() - 1
                }
            };
            let st = contiguous_strides(&t.shape);
            let mut idx = Expr::from("0");
            for (d, cd) in c.iter().enumerate() {
                if !cd.is_zero() && t.shape[d] != 1 {
                    idx.push(cat![" + ", cd, format!(" * {}LL", st[d])]);
                }
            }
            let load = if is_f(dt) { "ldf(" } else { "ldi(" };
            let leaf = Name::Operand(Side::Own, Operand::Leaf(j));
            let load = cat![load, leaf, ", ", idx, format!(", {})", dt_macro(dt))];
            let v = self.emit(Self::ctype(dt), load);
            match self.biases.get(&id) {
                // The linear's f32 product plus its bias, one f32 add as `pt_bias` does.
                Some(&b) => {
                    let bt = p
                        .node(b)
                        .tensor()
                        .ok_or_else(|| gen_err(b, p, "tuple bias"))?
                        .shape
                        .clone();
                    let bv = self.value(b, &broadcast(c, &bt))?;
                    self.emit("float", cat![v, " + ", bv])
                }
                None => v,
            }
        } else {
            self.op_value(id, c, dt)?
        };
        self.memo.insert(key, v.clone());
        Ok(v)
    }

    fn input(&mut self, id: NodeId, k: usize, c: &[Expr]) -> Result<(Expr, Dtype)> {
        let p = self.program;
        let x = p.node(id).inputs[k];
        let xt = p
            .node(x)
            .tensor()
            .ok_or_else(|| gen_err(id, p, "tuple input"))?
            .clone();
        let v = self.value(x, &broadcast(c, &xt.shape))?;
        Ok((v, xt.dtype))
    }

    fn op_value(&mut self, id: NodeId, c: &[Expr], dt: Dtype) -> Result<Expr> {
        let p = self.program;
        let node = p.node(id);
        let ty = Self::ctype(dt);
        // `name(code, x, y)`.
        let call = |name: &str, code: i32, x: Expr, y: Expr| {
            cat![format!("{name}({code}, "), x, ", ", y, ")"]
        };
        // `(r) ? 1LL : 0LL`: a condition as the integer a comparison stores.
        let flag = |r: Expr| wrap("(", r, ") ? 1LL : 0LL");
        match &node.op {
            Op::Binary { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let code = EwOp::Binary(*kind).code();
                let e = if is_f(da) {
                    store_f(call("ew_f", code, as_f(&a, da), as_f(&b, db)), dt)
                } else {
                    store_i(call("ew_i", code, as_i(&a, da), as_i(&b, db)), dt)
                };
                Ok(self.emit(ty, e))
            }
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            } => {
                let (a, da) = self.input(id, 0, c)?;
                let code = EwOp::Binary(*kind).code();
                let e = if is_f(da) {
                    let s = match da {
                        Dtype::Bf16 => petite_dtype::round_through_bf16(*scalar as f32),
                        Dtype::F16 => half::f16::from_f32(*scalar as f32).to_f32(),
                        _ => *scalar as f32,
                    };
                    let (x, y) = (as_f(&a, da), f32_lit(s).into());
                    let (x, y) = if *scalar_lhs { (y, x) } else { (x, y) };
                    store_f(call("ew_f", code, x, y), dt)
                } else {
                    let (x, y) = (as_i(&a, da), format!("((i64){}LL)", *scalar as i64).into());
                    let (x, y) = if *scalar_lhs { (y, x) } else { (x, y) };
                    store_i(call("ew_i", code, x, y), dt)
                };
                Ok(self.emit(ty, e))
            }
            Op::Compare { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let code = EwOp::Compare(*kind).code();
                let r = if is_f(da) {
                    call("ew_cmp<float>", code, as_f(&a, da), as_f(&b, db))
                } else {
                    call("ew_cmp<i64>", code, as_i(&a, da), as_i(&b, db))
                };
                Ok(self.emit(ty, store_i(flag(r), dt)))
            }
            Op::Logical { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let op = if EwOp::Logical(*kind).code() == 20 {
                    "&&"
                } else {
                    "||"
                };
                let r = cat![
                    "(",
                    as_i(&a, da),
                    format!(" != 0) {op} ("),
                    as_i(&b, db),
                    " != 0)"
                ];
                Ok(self.emit(ty, store_i(flag(r), dt)))
            }
            Op::Not => {
                let (a, da) = self.input(id, 0, c)?;
                let r = wrap("!(", as_i(&a, da), " != 0)");
                Ok(self.emit(ty, store_i(flag(r), dt)))
            }
            Op::Unary { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let code = EwOp::Unary(*kind).code();
                let e = if is_f(da) {
                    store_f(call("ew_f", code, as_f(&a, da), "0.0f".into()), dt)
                } else {
                    store_i(call("ew_i", code, as_i(&a, da), "0".into()), dt)
                };
                Ok(self.emit(ty, e))
            }
            Op::Cast { .. } | Op::Expand { .. } => {
                let (a, da) = self.input(id, 0, c)?;
                Ok(self.copy(&a, da, dt))
            }
            Op::Where => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let (e, de) = self.input(id, 2, c)?;
                let cnd = wrap("(", as_i(&a, da), " != 0)");
                let r = if is_f(db) {
                    store_f(cat![cnd, " ? ", as_f(&b, db), " : ", as_f(&e, de)], dt)
                } else {
                    store_i(cat![cnd, " ? ", as_i(&b, db), " : ", as_i(&e, de)], dt)
                };
                Ok(self.emit(ty, r))
            }
            Op::Slice {
                axis, start, step, ..
            } => {
                let mut ic = c.to_vec();
                let s = if *start == 0 {
                    "0LL".into()
                } else {
                    self.start(*start as i64)
                };
                let x = &c[*axis];
                ic[*axis] = match (*start, *step) {
                    (0, 1) => x.clone(),
                    _ if x.is_zero() => s,
                    (_, 1) => cat!["(", x, " + ", s, ")"],
                    (_, k) => cat!["(", s, " + ", x, format!(" * {k}LL)")],
                };
                let x = node.inputs[0];
                let dx = p.node(x).tensor().map(|t| t.dtype).unwrap_or(dt);
                let v = self.value(x, &ic)?;
                Ok(self.copy(&v, dx, dt))
            }
            Op::Permute { perm } => {
                let mut ic = vec![Expr::default(); perm.len()];
                for (i, &d) in perm.iter().enumerate() {
                    ic[d] = c[i].clone();
                }
                let x = node.inputs[0];
                let dx = p.node(x).tensor().map(|t| t.dtype).unwrap_or(dt);
                let v = self.value(x, &ic)?;
                Ok(self.copy(&v, dx, dt))
            }
            Op::Reshape { shape } => {
                let x = node.inputs[0];
                let xs = p
                    .node(x)
                    .tensor()
                    .ok_or_else(|| gen_err(id, p, "tuple input"))?
                    .shape
                    .clone();
                let ost = contiguous_strides(shape);
                let mut lin = Expr::from("0");
                for (d, cd) in c.iter().enumerate() {
                    if !cd.is_zero() && shape[d] != 1 {
                        lin.push(cat![" + ", cd, format!(" * {}LL", ost[d])]);
                    }
                }
                let (ity, suf) = index_type(shape.iter().product());
                let l = self.emit(ity, cat![format!("({ity})("), lin, ")"]);
                let ist = contiguous_strides(&xs);
                let ic: Vec<Expr> = xs
                    .iter()
                    .enumerate()
                    .map(|(j, &s)| {
                        if s == 1 {
                            "0".into()
                        } else if j == 0 {
                            cat!["(", &l, format!(" / {}{suf})", ist[j])]
                        } else {
                            cat!["((", &l, format!(" / {}{suf}) % {s}{suf})", ist[j])]
                        }
                    })
                    .collect();
                self.value(x, &ic)
            }
            Op::Concat { axis } => {
                let out = self.var();
                self.body.push(Stmt::Decl(Decl {
                    konst: false,
                    ty,
                    names: vec![(out, Init::None)],
                }));
                let mut arms = Vec::with_capacity(node.inputs.len());
                let mut start = 0usize;
                let k = node.inputs.len();
                for (j, &x) in node.inputs.iter().enumerate() {
                    let xt = p
                        .node(x)
                        .tensor()
                        .ok_or_else(|| gen_err(id, p, "tuple input"))?
                        .clone();
                    let len = xt.shape[*axis];
                    let end = start + len;
                    let below = cat![&c[*axis], format!(" < {end}LL")];
                    let arm = if k == 1 {
                        Arm::Block
                    } else if j + 1 == k {
                        Arm::Else
                    } else if j == 0 {
                        Arm::If(below)
                    } else {
                        Arm::ElseIf(below)
                    };
                    let mut ic = c.to_vec();
                    if start > 0 {
                        ic[*axis] = cat!["(", &c[*axis], format!(" - {start}LL)")];
                    }
                    // Values computed inside a branch are not visible after it.
                    let saved = self.memo.clone();
                    let outer = std::mem::take(&mut self.body);
                    let v = self.value(x, &ic)?;
                    let cv = self.copy(&v, xt.dtype, dt);
                    self.body.push(Stmt::Assign { to: out, value: cv });
                    arms.push((arm, std::mem::replace(&mut self.body, outer)));
                    self.memo = saved;
                    start = end;
                }
                self.body.push(Stmt::Arms(arms));
                Ok(out.into())
            }
            other => Err(gen_err(id, p, format!("{} is not fusible", other.name()))),
        }
    }

    /// `pt_ew`'s copy (op 0) of a register value of dtype `from` into dtype `to`.
    fn copy(&mut self, v: &Expr, from: Dtype, to: Dtype) -> Expr {
        if from == to {
            return v.clone();
        }
        let e = if is_f(from) {
            store_f(as_f(v, from), to)
        } else {
            store_i(as_i(v, from), to)
        };
        self.emit(Self::ctype(to), e)
    }
}
