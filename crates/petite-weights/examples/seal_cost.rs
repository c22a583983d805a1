//! What a seal costs on a large file against hashing the whole file:
//! `cargo run --release -p petite-weights --example seal_cost -- FILE` (e.g. a full-size
//! mapping file). Writes FILE's seal (the same bytes as the one petite wrote, if any), checks
//! it, then SHA-256s every byte, twice (the first pass from wherever the pages are, the second
//! from the page cache if the file fits).
use std::io::Read;
use std::time::Instant;

use sha2::{Digest, Sha256};

fn main() {
    let path = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: seal_cost FILE"));
    let len = std::fs::metadata(&path).unwrap().len();
    let t = Instant::now();
    petite_weights::seal::write(&path).unwrap();
    let write_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    petite_weights::seal::check(&path).unwrap();
    let check_s = t.elapsed().as_secs_f64();
    println!(
        "{}: {len} bytes; seal write {write_s:.3} s, seal check {check_s:.3} s",
        path.display()
    );
    for pass in 1..=2 {
        let t = Instant::now();
        let mut f = std::fs::File::open(&path).unwrap();
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 8 << 20];
        loop {
            let n = f.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let _ = h.finalize();
        let s = t.elapsed().as_secs_f64();
        println!(
            "full SHA-256 pass {pass}: {s:.2} s ({:.2} GB/s)",
            len as f64 / s / 1e9
        );
    }
}
