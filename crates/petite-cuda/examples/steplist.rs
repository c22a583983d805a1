fn main() {
    let cfg = petite_pi05::Pi05Config::default();
    let progs = petite_pi05::build_all(&cfg, petite_pi05::Precision::Bf16).unwrap();
    let p = &progs.step;
    let roots: Vec<_> = p.outputs.iter().map(|o| o.value).collect();
    let live = p.ancestors(&roots);
    let mut out = vec![false; p.len()];
    for o in &p.outputs {
        out[o.value.index()] = true;
    }
    let f = petite_cuda::fuse::plan(p, &live, &out).unwrap();
    for id in p.ids() {
        let i = id.index();
        if !live[i] {
            continue;
        }
        let d = p.describe(id);
        let role = &f.role[i];
        let s = format!("{:?}", role);
        if s == "Inlined" || s == "View" {
            continue;
        }
        println!(
            "{i:5} {:<14} {} {:?}",
            s,
            d,
            p.node(id)
                .tensor()
                .map(|t| format!("{:?}{:?}", t.dtype, t.shape))
                .unwrap_or_default()
        );
    }
}
