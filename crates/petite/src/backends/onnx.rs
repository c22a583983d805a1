//! `--backend onnx`: no engines, the whole policy as one ONNX model ([`crate::export::onnx`]).

use super::{BackendSpec, Flag, Output};

pub(super) struct Onnx;

impl BackendSpec for Onnx {
    fn name(&self) -> &'static str {
        "onnx"
    }
    fn help(&self) -> &'static str {
        "no engines: the whole policy as one ONNX model (pi05.onnx + external data) for ONNX Runtime, TensorRT or any ONNX tool"
    }
    fn output(&self) -> Output {
        Output::Onnx
    }
    fn flags(&self) -> &'static [Flag] {
        &[Flag::Weights, Flag::QuantizeSkip]
    }
}
