//! The statement IR of a fused kernel's body: what the generator (`fuse::codegen`) emits,
//! what the passes ([`super::with_first`], [`super::unrolled`], [`super::rows_unrolled`],
//! [`super::beside`]) transform, and what [`render`] turns into CUDA C text, in one place.
//!
//! Why not text: the passes used to edit generated C by string matching (finding the line
//! `  float nm, nr;`, renaming `p0 → q0` by mapping words), so whitespace was part of their
//! correctness. Here a pass finds a statement by what it is (a declaration of the
//! statistics, a row loop), renames by mapping [`Ident`]s and interleaves whole statements.
//!
//! The IR is as small as the fused kernels need: declarations, a coordinate peeled off an
//! index, assignments, stores, calls, loops, blocks and branches. Expressions stay text
//! around typed identifiers ([`Expr`]): no pass looks inside an operator. The hand-written
//! kernel families of [`crate::source`] stay text.

mod expr;
mod render;

pub(crate) use expr::cat;
pub use expr::{Expr, Grid, Ident, Local, Name, Operand, Side};
pub use render::render;

/// How a declared name is initialized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Init {
    /// Not initialized (`float v3;`).
    None,
    /// `name = expr`.
    Eq(Expr),
    /// `name(expr)` (a `dim3`).
    Ctor(Expr),
}

/// A declaration of one or more names of one type (`const i64 i_0 = …, i_1 = …;`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decl {
    /// Declared `const`.
    pub konst: bool,
    /// The C type, as written (`float`, `i64`, `unsigned`, `dim3`): no pass changes one.
    pub ty: &'static str,
    /// The names, each with its initializer.
    pub names: Vec<(Ident, Init)>,
}

impl Decl {
    /// `[const] ty name = init`.
    pub fn one(konst: bool, ty: &'static str, name: impl Into<Ident>, init: Expr) -> Self {
        Decl {
            konst,
            ty,
            names: vec![(name.into(), Init::Eq(init))],
        }
    }
}

/// A `for` loop's header: `for (init; cond; var += step)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The loop variable's declaration; none where it is declared before the loop.
    pub init: Option<Decl>,
    /// The condition.
    pub cond: Expr,
    /// The variable stepped.
    pub var: Ident,
    /// What it is stepped by.
    pub step: Expr,
}

impl Head {
    /// A plain group's grid-stride loop over its `n` elements.
    pub fn grid_stride() -> Self {
        let (i, n) = (Local::I, Name::N(Side::Own));
        Head {
            init: Some(Decl::one(
                false,
                "i64",
                i,
                cat![
                    "(i64)",
                    Grid::BlockIdx,
                    ".x * ",
                    Grid::BlockDim,
                    ".x + ",
                    Grid::ThreadIdx,
                    ".x"
                ],
            )),
            cond: cat![i, " < ", n],
            var: i.into(),
            step: cat!["(i64)", Grid::GridDim, ".x * ", Grid::BlockDim, ".x"],
        }
    }

    /// A prologue kernel's loop over its row, a block's threads apart.
    pub fn row() -> Self {
        let jj = Local::Jj;
        Head {
            init: Some(Decl::one(false, "i64", jj, cat![Grid::ThreadIdx, ".x"])),
            cond: cat![jj, " < ", Local::Np, ".d"],
            var: jj.into(),
            step: cat![Grid::BlockDim, ".x"],
        }
    }
}

/// A branch of a chain of them (a concat picking its piece), each closed on its own line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arm {
    /// `{`: the only piece, unconditionally.
    Block,
    /// `if (cond) {`.
    If(Expr),
    /// `else if (cond) {`.
    ElseIf(Expr),
    /// `else {`.
    Else,
}

/// One statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stmt {
    /// `__shared__ ty name[len];`.
    Shared {
        /// Element type.
        ty: &'static str,
        /// The array.
        name: Ident,
        /// Elements.
        len: usize,
    },
    /// A declaration.
    Decl(Decl),
    /// `ty coord = rem % by; rem /= by;`: one coordinate peeled off the rest of an index.
    /// One statement, as its halves are one step: an unrolled copy keeps them on one line.
    DivMod {
        /// The index type.
        ty: &'static str,
        /// The coordinate declared.
        coord: Ident,
        /// The rest of the index, divided in place.
        rem: Ident,
        /// The dim's size, a literal.
        by: Expr,
    },
    /// `to = value;`.
    Assign {
        /// The variable assigned.
        to: Ident,
        /// Its value.
        value: Expr,
    },
    /// `((ty*)ptr)[index] = value;`: an element written to an operand.
    Store {
        /// The pointer.
        ptr: Ident,
        /// The element type it is cast to.
        ty: &'static str,
        /// The element's index.
        index: Expr,
        /// What is stored.
        value: Expr,
    },
    /// An expression evaluated for its effect (a call): `expr;`.
    Eval(Expr),
    /// `if (cond) return;`.
    ReturnIf(Expr),
    /// `__syncthreads();`: the block's threads wait for each other.
    Barrier,
    /// A `for` loop: its body is indented.
    Loop(Head, Vec<Stmt>),
    /// `{ … }`: a scope for names (its body is not indented).
    Block(Vec<Stmt>),
    /// A chain of branches ([`Arm`]), their bodies not indented.
    Arms(Vec<(Arm, Vec<Stmt>)>),
    /// `if (cond) { … } else { … }` with `} else {` on one line, the bodies not indented.
    IfElse {
        /// The condition.
        cond: Expr,
        /// Run where it holds.
        then: Vec<Stmt>,
        /// Run where it does not.
        els: Vec<Stmt>,
    },
}

impl Stmt {
    /// `[const] ty name = init;`.
    pub fn decl(konst: bool, ty: &'static str, name: impl Into<Ident>, init: Expr) -> Self {
        Stmt::Decl(Decl::one(konst, ty, name, init))
    }

    /// Holds no other statement: a loop of such statements is straight-line code, whose
    /// statements an unrolled loop can interleave.
    pub fn is_simple(&self) -> bool {
        !matches!(
            self,
            Stmt::Loop(..) | Stmt::Block(_) | Stmt::Arms(_) | Stmt::IfElse { .. }
        )
    }

    /// This statement with each identifier `x` (in it and in the statements it holds)
    /// replaced by `f(x)`.
    pub fn map_ids(&mut self, f: &impl Fn(Ident) -> Ident) {
        let body = |b: &mut Vec<Stmt>| b.iter_mut().for_each(|s| s.map_ids(f));
        match self {
            Stmt::Shared { name, .. } => *name = f(*name),
            Stmt::Decl(d) => decl_map(d, f),
            Stmt::DivMod { coord, rem, by, .. } => {
                *coord = f(*coord);
                *rem = f(*rem);
                by.map_ids(f);
            }
            Stmt::Assign { to, value } => {
                *to = f(*to);
                value.map_ids(f);
            }
            Stmt::Store {
                ptr, index, value, ..
            } => {
                *ptr = f(*ptr);
                index.map_ids(f);
                value.map_ids(f);
            }
            Stmt::Eval(e) | Stmt::ReturnIf(e) => e.map_ids(f),
            Stmt::Barrier => {}
            Stmt::Loop(h, b) => {
                if let Some(d) = &mut h.init {
                    decl_map(d, f);
                }
                h.cond.map_ids(f);
                h.var = f(h.var);
                h.step.map_ids(f);
                body(b);
            }
            Stmt::Block(b) => body(b),
            Stmt::Arms(arms) => {
                for (arm, b) in arms {
                    if let Arm::If(c) | Arm::ElseIf(c) = arm {
                        c.map_ids(f);
                    }
                    body(b);
                }
            }
            Stmt::IfElse { cond, then, els } => {
                cond.map_ids(f);
                body(then);
                body(els);
            }
        }
    }
}

fn decl_map(d: &mut Decl, f: &impl Fn(Ident) -> Ident) {
    for (name, init) in &mut d.names {
        *name = f(*name);
        if let Init::Eq(e) | Init::Ctor(e) = init {
            e.map_ids(f);
        }
    }
}

/// `body` with each identifier `x` replaced by `f(x)`.
pub fn map_ids(body: &mut [Stmt], f: impl Fn(Ident) -> Ident) {
    body.iter_mut().for_each(|s| s.map_ids(&f));
}
