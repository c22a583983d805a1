//! petite-pi05 (skeleton; see docs/ARCHITECTURE.md).
#![deny(missing_docs)]
