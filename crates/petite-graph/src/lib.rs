//! petite-graph (skeleton; see docs/ARCHITECTURE.md).
#![deny(missing_docs)]
