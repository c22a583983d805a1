//! `petite pi05 ...`
use clap::Subcommand;

/// pi0.5 subcommands.
#[derive(Subcommand)]
pub enum Pi05Cmd {
    /// Print the real pi0.5 config as JSON (the default for every command that takes --config).
    DefaultConfig,
}

/// Runs a `petite pi05` subcommand.
pub fn run(cmd: Pi05Cmd) -> anyhow::Result<()> {
    match cmd {
        Pi05Cmd::DefaultConfig => anyhow::bail!("not built yet"),
    }
}
