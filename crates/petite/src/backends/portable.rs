//! `--backend portable`: no engines, every op an ExecuTorch portable kernel call
//! ([`crate::export::portable`]).

use super::{BackendSpec, Flag, Output};

pub(super) struct Portable;

impl BackendSpec for Portable {
    fn name(&self) -> &'static str {
        "portable"
    }
    fn help(&self) -> &'static str {
        "no engines: every op an ExecuTorch portable kernel call, runnable by any ExecuTorch runtime on any CPU"
    }
    fn output(&self) -> Output {
        Output::Portable
    }
    fn flags(&self) -> &'static [Flag] {
        &[]
    }
}
