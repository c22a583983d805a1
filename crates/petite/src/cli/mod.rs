//! One module per subcommand, so subcommands can grow independently.
pub mod pi05;
