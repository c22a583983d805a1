//! petite: orchestration of the export pipeline (skeleton; see docs/ARCHITECTURE.md).
#![deny(missing_docs)]
