//! Dumps every kernel source petite-cuda generates for pi0.5's full-size programs, so a change
//! that should not touch them (a refactor) can be checked byte for byte: run it before and
//! after into two folders and `diff -r` them, or compare the total digest it prints.
//!
//! Written: the fixed module (`module.cu`), the attention module (`attention_module.cu`), the
//! fused prelude (`fused_prelude.cu`), and for every precision (bf16, f32), program
//! (timestep table, prefix, step) and combination of the fusion planner's [`Options`]
//! (attention queries 64 as on sm_90, 0 as on sm_87, all; pairs on/off; slice starts as
//! parameters/literals; rows unrolled or not; and `-default`: what [`Options::new`] gives) the
//! fused source (`….cu`) and the plan that produced it (`….plan`: roles, groups, kernel names,
//! views, masks, attentions, biases),
//! plus each program's sibling linears (`….siblings`). Prints a sha256 a file and one over
//! them all.
//!
//! Usage: `cargo run -p petite-cuda --example kernel_sources -- OUT_DIR`.

use std::fmt::Debug;
use std::path::Path;

use petite_cuda::fuse::{self, Fusion, Options};
use petite_pi05::{Pi05Config, Precision};
use sha2::{Digest, Sha256};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// `map`'s entries as Debug lines, sorted (a `HashMap`'s order is not stable).
fn sorted<K: Debug, V: Debug>(map: &std::collections::HashMap<K, V>) -> String {
    let mut lines: Vec<String> = map
        .iter()
        .map(|(k, v)| format!("{k:?} => {v:?}\n"))
        .collect();
    lines.sort();
    lines.concat()
}

/// The plan of `f` as text, every field but the source.
fn plan_text(f: &Fusion) -> String {
    let mut s = String::new();
    s.push_str("# roles\n");
    for (i, r) in f.role.iter().enumerate() {
        s.push_str(&format!("{i} {r:?}\n"));
    }
    s.push_str("# groups\n");
    for (i, g) in f.groups.iter().enumerate() {
        s.push_str(&format!("{i} {g:?}\n"));
    }
    s.push_str("# kernels\n");
    for (i, k) in f.kernels.iter().enumerate() {
        s.push_str(&format!("{i} {k}\n"));
    }
    s.push_str(&format!("# attention_kernels\n{:?}\n", f.attention_kernels));
    s.push_str("# views\n");
    s.push_str(&sorted(&f.views));
    s.push_str("# masks\n");
    s.push_str(&sorted(&f.masks));
    s.push_str("# attentions\n");
    s.push_str(&sorted(&f.attentions));
    s.push_str("# biases\n");
    s.push_str(&sorted(&f.biases));
    s
}

fn main() -> Res<()> {
    let out = std::env::args()
        .nth(1)
        .ok_or("usage: kernel_sources OUT_DIR")?;
    let out = Path::new(&out);
    std::fs::create_dir_all(out)?;
    let mut files: Vec<(String, String)> = vec![
        ("module.cu".into(), petite_cuda::source::module_source()),
        (
            "attention_module.cu".into(),
            petite_cuda::source::attention_module_source(),
        ),
        (
            "fused_prelude.cu".into(),
            petite_cuda::source::fused_prelude(),
        ),
    ];
    // What the defaults fuse on each compute capability, and every attention fused.
    let queries = [
        ("sm90", fuse::fused_attention_queries((9, 0))),
        ("sm87", fuse::fused_attention_queries((8, 7))),
        ("all", usize::MAX),
    ];
    let cfg = Pi05Config::default();
    for prec in [Precision::Bf16, Precision::F32] {
        let progs = petite_pi05::build_all(&cfg, prec)?;
        for (name, p) in [
            ("timestep_table", &progs.timestep_table),
            ("prefix", &progs.prefix),
            ("step", &progs.step),
        ] {
            let base = format!("{prec:?}-{name}").to_lowercase();
            let live = vec![true; p.len()];
            let sib = fuse::siblings(p, &live);
            files.push((format!("{base}.siblings"), format!("{sib:#?}\n")));
            for (qname, q) in queries {
                // What `Options::new` plans (the defaults), beside every combination spelled out.
                let f = fuse::plan_program(p, Options::new(q))?;
                let set = format!("{base}-attn_{qname}-default");
                files.push((format!("{set}.plan"), plan_text(&f)));
                files.push((format!("{set}.cu"), f.source));
                for pairs in [true, false] {
                    for offset_params in [true, false] {
                        for unrolled_rows in [false, true] {
                            let o = Options {
                                attention_queries: q,
                                pairs,
                                offset_params,
                                unrolled_rows,
                                // No quantized weights in these programs: nothing to vary.
                                ..Options::new(q)
                            };
                            let f = fuse::plan_program(p, o)?;
                            let set = format!(
                                "{base}-attn_{qname}{}{}{}",
                                if pairs { "" } else { "-nopair" },
                                if offset_params { "" } else { "-nooffsets" },
                                if unrolled_rows { "-rows" } else { "" },
                            );
                            files.push((format!("{set}.plan"), plan_text(&f)));
                            files.push((format!("{set}.cu"), f.source));
                        }
                    }
                }
            }
        }
    }
    files.sort();
    let mut total = Sha256::new();
    for (name, text) in &files {
        std::fs::write(out.join(name), text)?;
        let h = Sha256::digest(text.as_bytes());
        let line = format!("{h:x}  {name}\n");
        print!("{line}");
        total.update(line.as_bytes());
    }
    println!("{} files, total {:x}", files.len(), total.finalize());
    Ok(())
}
