//! petite-weights (skeleton; see docs/ARCHITECTURE.md).
#![deny(missing_docs)]
