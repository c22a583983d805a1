//! Passes over generated kernel bodies ([`super::ir`]): two groups' bodies as one kernel
//! ([`beside`], [`with_first`]) and loops unrolled ([`unrolled`], [`rows_unrolled`]). They
//! rename identifiers and reorder whole statements without changing what any statement
//! computes, so the bits stay.

#[cfg(doc)]
use super::Group;
use super::ir::{Decl, Expr, Grid, Head, Ident, Init, Local, Name, Side, Stmt, cat, map_ids};

/// `x` renamed to `name`, keeping its unrolled copy.
fn named(x: Ident, name: Name) -> Ident {
    Ident { name, ..x }
}

/// `x` with a kernel's operands `pN`, `po` and offsets `sN` renamed to the other side's
/// (`qN`, `qo`, `tN`).
fn other_side(x: Ident) -> Ident {
    match x.name {
        Name::Operand(Side::Own, o) => named(x, Name::Operand(Side::Other, o)),
        Name::Offset(Side::Own, j) => named(x, Name::Offset(Side::Other, j)),
        _ => x,
    }
}

/// `const dim3 a(x), b(y);`.
fn dim3s(names: &[(Grid, Expr)]) -> Stmt {
    Stmt::Decl(Decl {
        konst: true,
        ty: "dim3",
        names: names
            .iter()
            .map(|(g, e)| ((*g).into(), Init::Ctor(e.clone())))
            .collect(),
    })
}

/// One kernel running grid-stride body `own` on blocks `[0, gb)` and body `other` on the `ga`
/// blocks after them, each seeing only its own blocks (`blockIdx`, `gridDim`) and `other` its
/// own `n`, leaves and output renamed `qn`, `q0…`, `qo`. Why: a step's q and k RoPEs were two
/// launches of a few microseconds each, back to back with a GEMM between.
pub fn beside(own: &[Stmt], gb: u32, other: &[Stmt], ga: u32) -> Vec<Stmt> {
    let mut then = vec![dim3s(&[(Grid::OwnGrid, format!("{gb}u").into())])];
    let mut own = own.to_vec();
    map_ids(&mut own, |x| match x.name {
        Name::Grid(Grid::GridDim) => named(x, Name::Grid(Grid::OwnGrid)),
        _ => x,
    });
    then.extend(own);
    let mut els = vec![dim3s(&[
        (
            Grid::OtherBlock,
            cat![Grid::BlockIdx, format!(".x - {gb}u")],
        ),
        (Grid::OtherGrid, format!("{ga}u").into()),
    ])];
    let mut other = other.to_vec();
    map_ids(&mut other, |x| match x.name {
        Name::Grid(Grid::BlockIdx) => named(x, Name::Grid(Grid::OtherBlock)),
        Name::Grid(Grid::GridDim) => named(x, Name::Grid(Grid::OtherGrid)),
        Name::N(Side::Own) => named(x, Name::N(Side::Other)),
        _ => other_side(x),
    });
    els.extend(other);
    vec![Stmt::IfElse {
        cond: cat![Grid::BlockIdx, format!(".x < {gb}u")],
        then,
        els,
    }]
}

/// The declaration of a prologue norm's row statistics (`float nm, nr;`), which the
/// generator writes once a prologue kernel, before they are computed.
pub(super) fn stats_decl() -> Stmt {
    Stmt::Decl(Decl {
        konst: false,
        ty: "float",
        names: vec![
            (Local::Nm.into(), Init::None),
            (Local::Nr.into(), Init::None),
        ],
    })
}

/// A prologue kernel's `body` computing `first`'s elements of its row first (`first` a plain
/// group body, its leaves and output renamed `q0…`, `qo`), storing them, then a block barrier
/// so the norm's statistics read them. Why: each of a step's 36 residual sums was a launch of
/// its own just before the norm that reads it (one less launch a sum, the same bits). `None`
/// when `body` declares no statistics or `first` is not one grid-stride loop.
pub fn with_first(body: &[Stmt], first: &[Stmt]) -> Option<Vec<Stmt>> {
    let at = body.iter().position(|s| *s == stats_decl())?;
    let [Stmt::Loop(head, inner)] = first else {
        return None;
    };
    if *head != Head::grid_stride() {
        return None;
    }
    let mut row = vec![Stmt::decl(
        true,
        "i64",
        Local::I,
        cat![Local::Base, " + ", Local::Jj],
    )];
    let mut inner = inner.clone();
    map_ids(&mut inner, other_side);
    row.extend(inner);
    let mut out = body[..at].to_vec();
    out.push(Stmt::Loop(Head::row(), row));
    out.push(Stmt::Barrier);
    out.extend_from_slice(&body[at..]);
    Some(out)
}

/// Elements from which a fused kernel without a prologue is [`unrolled`] ([`UNROLL`] a trip):
/// the prefix's big passes (SigLIP's 3 × 256 × 1,152 residuals up to 968 × 16,384 GELU × up),
/// not the step's latency-bound ones (50 × 4,096 at most).
pub const UNROLL_FROM: usize = 1 << 19;

/// Elements a thread of an [`unrolled`] kernel takes per trip.
pub const UNROLL: usize = 4;

/// `body` (a grid-stride loop over straight-line code, as the generator writes it without a
/// prologue) with each trip taking [`UNROLL`] elements a grid apart, the copies' statements
/// interleaved so that every copy's loads are issued before any copy's store. Why: one 2-byte
/// load in flight per thread left the prefix's big elementwise passes at ~40% of the H200's
/// bandwidth. Each element is computed by the same statements as before (the same bits).
/// `None` when the loop holds a branch (its statements cannot be interleaved).
pub fn unrolled(body: &[Stmt]) -> Option<Vec<Stmt>> {
    let [Stmt::Loop(head, inner)] = body else {
        return None;
    };
    if *head != Head::grid_stride() || !inner.iter().all(Stmt::is_simple) {
        return None;
    }
    let (i, st, n) = (Local::I, Local::St, Name::N(Side::Own));
    let (bi, bd, gd, ti) = (
        Grid::BlockIdx,
        Grid::BlockDim,
        Grid::GridDim,
        Grid::ThreadIdx,
    );
    let mut out = vec![
        Stmt::decl(true, "i64", st, cat!["(i64)", gd, ".x * ", bd, ".x"]),
        Stmt::decl(
            false,
            "i64",
            i,
            cat!["(i64)", bi, ".x * ", bd, ".x + ", ti, ".x"],
        ),
    ];
    let trip = Head {
        init: None,
        cond: cat![i, format!(" + {} * ", UNROLL - 1), st, " < ", n],
        var: i.into(),
        step: cat![format!("{UNROLL} * "), st],
    };
    let rest = Head {
        init: None,
        cond: cat![i, " < ", n],
        var: i.into(),
        step: st.into(),
    };
    out.extend(interleaved(inner, (i, st), trip, rest));
    Some(out)
}

/// `s` as unrolled copy `k` computes it: its per-element names ([`Ident::per_element`])
/// suffixed `_k`.
pub(super) fn copy(s: &Stmt, k: usize) -> Stmt {
    let mut s = s.clone();
    s.map_ids(&|x: Ident| {
        if x.per_element() {
            Ident { copy: Some(k), ..x }
        } else {
            x
        }
    });
    s
}

/// An unrolled trip loop (`trip`) — `const i64 v_0 = v + 0 * step, …;`, then each of
/// `inner`'s statements [`UNROLL`] times, copy `k` by [`copy`] — and the remainder loop
/// (`rest`) over `inner` as it is.
fn interleaved(inner: &[Stmt], (var, step): (Local, Local), trip: Head, rest: Head) -> [Stmt; 2] {
    let names = (0..UNROLL)
        .map(|k| {
            let at = cat![var, format!(" + {k} * "), step];
            (
                Ident {
                    copy: Some(k),
                    ..var.into()
                },
                Init::Eq(at),
            )
        })
        .collect();
    let mut body = vec![Stmt::Decl(Decl {
        konst: true,
        ty: "i64",
        names,
    })];
    for s in inner {
        body.extend((0..UNROLL).map(|k| copy(s, k)));
    }
    [Stmt::Loop(trip, body), Stmt::Loop(rest, inner.to_vec())]
}

/// A prologue kernel's `body` with each straight-line row loop taking [`UNROLL`] elements a
/// trip, `blockDim.x` apart, the copies' statements interleaved so that every copy's loads
/// are issued before any copy's store (the remainder in the loop as it was); the generator
/// then has the statistics computed by `norm_stats4` (four loads before their adds, for the
/// input's dtype and the norm's kind known here instead of switched on in the loop). Why:
/// the SASS of every norm kernel showed one load in flight — each load's use, or a store the
/// compiler cannot prove apart from the next load, waited a memory latency per element; a
/// step's row of 1,024 on 256 threads pays four of them a pass. Each element is computed by
/// the same statements as before and each thread adds in the same order: the same bits.
/// Loops holding a branch (a concat) are left as they are.
pub fn rows_unrolled(body: &[Stmt]) -> Vec<Stmt> {
    let (jj, bd, np) = (Local::Jj, Local::Bd, Local::Np);
    body.iter()
        .map(|s| match s {
            Stmt::Loop(head, inner)
                if *head == Head::row() && inner.iter().all(Stmt::is_simple) =>
            {
                let mut b = vec![
                    Stmt::decl(true, "i64", bd, cat![Grid::BlockDim, ".x"]),
                    Stmt::decl(false, "i64", jj, cat![Grid::ThreadIdx, ".x"]),
                ];
                let trip = Head {
                    init: None,
                    cond: cat![jj, format!(" + {} * ", UNROLL - 1), bd, " < ", np, ".d"],
                    var: jj.into(),
                    step: cat![format!("{UNROLL} * "), bd],
                };
                let rest = Head {
                    init: None,
                    cond: cat![jj, " < ", np, ".d"],
                    var: jj.into(),
                    step: bd.into(),
                };
                b.extend(interleaved(inner, (jj, bd), trip, rest));
                Stmt::Block(b)
            }
            s => s.clone(),
        })
        .collect()
}
