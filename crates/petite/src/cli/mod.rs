//! One module per subcommand, so subcommands can grow independently.
pub mod convert;
pub mod doctor;
pub mod export;
pub mod inspect;
pub mod lower;
pub mod pi05;
pub mod plan;
pub mod verify;
