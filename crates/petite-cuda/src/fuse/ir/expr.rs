//! Identifiers and expressions of the statement IR.
//!
//! An expression is C text with its identifiers kept apart as typed [`Ident`]s: the passes
//! rename a kernel's operands, offsets and grid (`p0 → q0`, `s1 → t1`, `gridDim → pg`) and
//! give an unrolled copy its own names (`v3 → v3_2`) by mapping identifiers, never by
//! matching words of text. What is not an identifier the passes act on — operators,
//! literals, the prelude's functions and macros (`ldf`, `DT_BF16`), member names (`.x`,
//! `.d`) — stays text, which no pass reads.

use std::fmt;

/// Whose operands a name refers to in a kernel running two groups' bodies: the kernel's own
/// group (`p0…`, `po`, `s0…`, `n`) or the other one, computed first or beside it (`q0…`,
/// `qo`, `t0…`, `qn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The kernel's own group.
    Own,
    /// The group computed first ([`crate::fuse::with_first`]) or beside
    /// ([`crate::fuse::beside`]).
    Other,
}

/// A kernel parameter holding an operand's pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operand {
    /// The `j`-th value read (`p{j}`, `q{j}`).
    Leaf(usize),
    /// The value written (`po`, `qo`).
    Out,
}

/// CUDA's built-in launch coordinates, and the local `dim3`s that stand for them where two
/// groups share one launch ([`crate::fuse::beside`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Grid {
    /// `blockIdx`.
    BlockIdx,
    /// `gridDim`.
    GridDim,
    /// `blockDim`.
    BlockDim,
    /// `threadIdx`.
    ThreadIdx,
    /// `pg`: the own group's grid (its blocks only).
    OwnGrid,
    /// `qb`: the other group's block index (counted from its first block).
    OtherBlock,
    /// `qg`: the other group's grid.
    OtherGrid,
}

/// A local the generator or a pass names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Local {
    /// `i`: the element's linear index.
    I,
    /// `r`: the part of `i` not yet split into coordinates.
    R,
    /// `jj`: the element's position in a prologue kernel's row.
    Jj,
    /// `nv`: the prologue norm's value at the element.
    Nv,
    /// `row`: a prologue kernel's row (its block).
    Row,
    /// `base`: the index of the row's first element.
    Base,
    /// `shd`: the statistics' shared scratch.
    Shd,
    /// `np`: the norm's parameter block.
    Np,
    /// `nx`: the norm's input.
    Nx,
    /// `nw`: the norm's weight.
    Nw,
    /// `nb`: the norm's bias.
    Nb,
    /// `nm`: the row's mean (layer norm).
    Nm,
    /// `nr`: the row's reciprocal deviation.
    Nr,
    /// `st`: an unrolled grid-stride loop's stride.
    St,
    /// `bd`: an unrolled row loop's stride.
    Bd,
}

/// What an identifier names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Name {
    /// An operand's pointer, of one side.
    Operand(Side, Operand),
    /// The `j`-th slice start passed as a parameter (`s{j}`, `t{j}`).
    Offset(Side, usize),
    /// The elements of a side's value (`n`, `qn`).
    N(Side),
    /// The generator's `k`-th register value (`v{k}`).
    Var(usize),
    /// The output's coordinate along dim `d` (`c{d}`).
    Coord(usize),
    /// A launch coordinate.
    Grid(Grid),
    /// Another local.
    Local(Local),
}

/// An identifier: a [`Name`], and for the copies of an unrolled loop's body, which copy
/// (rendered as the suffix `_k`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ident {
    /// What it names.
    pub name: Name,
    /// The unrolled copy it belongs to.
    pub copy: Option<usize>,
}

impl Ident {
    /// Names a value of a loop trip: each unrolled copy has its own (the element's index and
    /// coordinates, the registers, the norm's value), unlike the kernel's parameters and the
    /// row's statistics, which the copies share.
    pub fn per_element(self) -> bool {
        matches!(
            self.name,
            Name::Var(_)
                | Name::Coord(_)
                | Name::Local(Local::I | Local::R | Local::Jj | Local::Nv)
        )
    }
}

impl From<Name> for Ident {
    fn from(name: Name) -> Self {
        Ident { name, copy: None }
    }
}

impl From<Local> for Ident {
    fn from(l: Local) -> Self {
        Name::Local(l).into()
    }
}

impl From<Grid> for Ident {
    fn from(g: Grid) -> Self {
        Name::Grid(g).into()
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |s: &Side, own: &str, other: &str| match s {
            Side::Own => own.to_string(),
            Side::Other => other.to_string(),
        };
        let base = match &self.name {
            Name::Operand(s, Operand::Leaf(j)) => side(s, "p", "q") + &j.to_string(),
            Name::Operand(s, Operand::Out) => side(s, "po", "qo"),
            Name::Offset(s, j) => side(s, "s", "t") + &j.to_string(),
            Name::N(s) => side(s, "n", "qn"),
            Name::Var(k) => format!("v{k}"),
            Name::Coord(d) => format!("c{d}"),
            Name::Grid(g) => match g {
                Grid::BlockIdx => "blockIdx",
                Grid::GridDim => "gridDim",
                Grid::BlockDim => "blockDim",
                Grid::ThreadIdx => "threadIdx",
                Grid::OwnGrid => "pg",
                Grid::OtherBlock => "qb",
                Grid::OtherGrid => "qg",
            }
            .to_string(),
            Name::Local(l) => match l {
                Local::I => "i",
                Local::R => "r",
                Local::Jj => "jj",
                Local::Nv => "nv",
                Local::Row => "row",
                Local::Base => "base",
                Local::Shd => "shd",
                Local::Np => "np",
                Local::Nx => "nx",
                Local::Nw => "nw",
                Local::Nb => "nb",
                Local::Nm => "nm",
                Local::Nr => "nr",
                Local::St => "st",
                Local::Bd => "bd",
            }
            .to_string(),
        };
        match self.copy {
            Some(k) => write!(f, "{base}_{k}"),
            None => f.write_str(&base),
        }
    }
}

/// One piece of an expression.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Piece {
    /// Operators, literals, functions and members: never renamed.
    Text(String),
    /// An identifier.
    Id(Ident),
}

/// A C expression: text with its identifiers kept apart. Adjacent text is merged, so two
/// expressions are equal when they render equal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Expr(Vec<Piece>);

impl Expr {
    /// `x` appended.
    pub fn push(&mut self, x: impl Into<Expr>) {
        for p in x.into().0 {
            match (self.0.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, Piece::Text(b)) if b.is_empty() => {}
                (_, p) => self.0.push(p),
            }
        }
    }

    /// This expression with each identifier `x` replaced by `f(x)`.
    pub fn map_ids(&mut self, f: &impl Fn(Ident) -> Ident) {
        for p in &mut self.0 {
            if let Piece::Id(x) = p {
                *x = f(*x);
            }
        }
    }

    /// The literal `0` (a coordinate along a unit dim, or a start of 0).
    pub fn is_zero(&self) -> bool {
        matches!(self.0.as_slice(), [Piece::Text(t)] if t == "0")
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for p in &self.0 {
            match p {
                Piece::Text(t) => f.write_str(t)?,
                Piece::Id(x) => write!(f, "{x}")?,
            }
        }
        Ok(())
    }
}

impl From<&str> for Expr {
    fn from(t: &str) -> Self {
        Expr(vec![Piece::Text(t.to_string())])
    }
}

impl From<String> for Expr {
    fn from(t: String) -> Self {
        Expr(vec![Piece::Text(t)])
    }
}

impl From<&Expr> for Expr {
    fn from(e: &Expr) -> Self {
        e.clone()
    }
}

/// Identifiers, and what names one, as expressions.
macro_rules! ident_exprs {
    ($($t:ty),*) => {$(
        impl From<$t> for Expr {
            fn from(x: $t) -> Self {
                Expr(vec![Piece::Id(x.into())])
            }
        }
    )*};
}
ident_exprs!(Ident, Name, Local, Grid);

/// An [`Expr`] of its arguments (text, identifiers, expressions) one after the other.
macro_rules! cat {
    ($($e:expr),* $(,)?) => {{
        #[allow(unused_mut)]
        let mut x = $crate::fuse::ir::Expr::default();
        $( x.push($e); )*
        x
    }};
}
pub(crate) use cat;
