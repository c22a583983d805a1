//! One module per subcommand, so subcommands can grow independently.
pub mod act;
pub mod convert;
pub mod doctor;
pub mod export;
pub mod inspect;
pub mod lower;
pub mod pi05;
pub mod plan;
#[cfg(feature = "serve")]
pub mod serve;
pub mod verify;

/// The numeric mode of the pi0.5 programs, as every command spells it (`--dtype`); `convert`
/// has its own set (storage dtypes bf16/f16, not program modes). The one rule for its default,
/// stated in each command's `--help`: commands that make what is deployed (`export`, `plan`)
/// default to bf16, lerobot's deployed mode; commands that compute or check against the
/// reference (`pi05 run`, `lower`) default to f32, the parity mode.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrecisionArg {
    /// lerobot's bfloat16 mode (bf16 weights and matmuls; what lerobot keeps f32 stays f32).
    Bf16,
    /// Everything f32 (the parity mode).
    F32,
}

impl PrecisionArg {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            PrecisionArg::Bf16 => "bf16",
            PrecisionArg::F32 => "f32",
        }
    }
}

impl From<PrecisionArg> for petite_pi05::Precision {
    fn from(d: PrecisionArg) -> Self {
        match d {
            PrecisionArg::Bf16 => petite_pi05::Precision::Bf16,
            PrecisionArg::F32 => petite_pi05::Precision::F32,
        }
    }
}
