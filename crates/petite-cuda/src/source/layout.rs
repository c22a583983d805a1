//! Parameter block layouts checked where the kernels are compiled: each `#[repr(C)]` block of
//! [`crate::plan`] that a kernel takes by value is mirrored by a CUDA C struct written by hand
//! in this module's text, and the two must agree byte for byte (a launch copies the Rust
//! bytes; the kernel reads them through its struct). Each mirror is followed in the source by
//! `static_assert`s of its size and of every field's offset, the numbers taken from Rust's
//! `size_of` and `offset_of!` when the source is generated: NVRTC then refuses a source whose
//! struct drifted from its block, instead of a kernel reading a shifted field.
//!
//! NVRTC has no `<cstddef>` (no include path, so no `offsetof`), and NVRTC 12 no
//! `__builtin_offsetof` either (12.9 refuses it; 13.5 takes it): the prelude's `PT_OFFSETOF`
//! is the front end's `__INTADDR__` form before NVRTC 13.4, the builtin from then on.

/// A `#[repr(C)]` parameter block as Rust lays it out, under the names its CUDA C mirror gives
/// the fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    /// The struct's name, the same in Rust and in CUDA C.
    pub(crate) name: &'static str,
    /// `size_of` the Rust block.
    pub(crate) size: usize,
    /// Each CUDA C field, in declaration order, with its byte offset in the Rust block (a Rust
    /// array spelled as several C fields gives each element's).
    pub(crate) fields: Vec<(&'static str, usize)>,
}

impl Layout {
    /// The `static_assert`s of this layout, a line each: the size, then every field's offset.
    pub(crate) fn checks(&self) -> String {
        let n = self.name;
        let mut s = format!(
            "static_assert(sizeof({n}) == {}, \"{n}: size as Rust's plan::{n}\");\n",
            self.size
        );
        for (f, at) in &self.fields {
            s.push_str(&format!(
                "static_assert(PT_OFFSETOF({n}, {f}) == {at}, \"{n}.{f}: offset as in Rust\");\n"
            ));
        }
        s
    }
}

/// `pieces` one after the other, piece `k` (which ends with the definition of `layouts[k]`'s
/// struct) followed by that layout's [`Layout::checks`].
pub(super) fn with_checks(pieces: &[&str], layouts: &[Layout]) -> String {
    debug_assert_eq!(pieces.len(), layouts.len() + 1);
    let mut s = String::with_capacity(pieces.iter().map(|p| p.len() + 2048).sum());
    for (k, p) in pieces.iter().enumerate() {
        s.push_str(p);
        if let Some(l) = layouts.get(k) {
            s.push_str(&l.checks());
        }
    }
    s
}

/// Bytes of an element of the array a field accessor returns (`|p| &p.qs`).
pub(super) fn elem_size<T, E, const N: usize>(_: fn(&T) -> &[E; N]) -> usize {
    size_of::<E>()
}

/// The [`Layout`] of `crate::plan::$t`, its fields named as its CUDA C mirror names them, in
/// the mirror's order: `f` (the same name), or `f => [a, b, c]` (a Rust array spelled as C
/// fields `a`, `b`, `c`). Every Rust field must be listed: a field added to the block without
/// its check fails to compile.
macro_rules! layout {
    (@field $v:ident, $t:ident, $f:ident) => {
        $v.push((stringify!($f), std::mem::offset_of!($t, $f)));
    };
    (@field $v:ident, $t:ident, $f:ident => [$($c:ident),+]) => {{
        let at = std::mem::offset_of!($t, $f);
        let step = $crate::source::layout::elem_size(|p: &$t| &p.$f);
        for (k, c) in [$(stringify!($c)),+].into_iter().enumerate() {
            $v.push((c, at + k * step));
        }
    }};
    ($t:ident { $($f:ident $(=> [$($c:ident),+])?),+ $(,)? }) => {{
        use $crate::plan::$t;
        // Names every field (no `..`): the list is complete.
        let _every_field = |p: $t| {
            let $t { $($f: _),+ } = p;
        };
        let mut fields = Vec::new();
        $( $crate::source::layout::layout!(@field fields, $t, $f $(=> [$($c),+])?); )+
        $crate::source::layout::Layout {
            name: stringify!($t),
            size: size_of::<$t>(),
            fields,
        }
    }};
}
pub(super) use layout;
