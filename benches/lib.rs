//! The home of petite's criterion benches (`plan`: the partitioner on pi0.5's programs;
//! `linear`: the reference GEMM and attention kernels; `layer`: one Gemma layer on the reference
//! executor). The library itself is empty: the benches are the package.
#![forbid(unsafe_code)]
