//! Tests of launch planning: strides, parameter blocks, GEMM shapes, attention launches.

use super::{EwOp, dtype_code};
use petite_graph::Dtype;

#[test]
fn pointer_arrays_step_runs_then_batches_as_the_strided_form_does() {
    // SigLIP's logits GEMM: 16 heads a batch, 3 cameras as runs.
    let g = Gemm::linear(256, 72, 256)
        .unwrap()
        .batched(16, 72, 72, 256 * 256)
        .unwrap();
    let p = PtrParams::new(
        &g,
        [1000, 2000, 3000],
        [4, 4, 4],
        3,
        [884_736, 884_736, 16 * 65_536],
    );
    assert_eq!((p.batch, p.n), (16, 48));
    for run in 0..3i64 {
        for h in 0..16i64 {
            let want = [
                1000 + 4 * (run * 884_736 + h * 72),
                2000 + 4 * (run * 884_736 + h * 72),
                3000 + 4 * (run * 16 * 65_536 + h * 65_536),
            ]
            .map(|x| x as u64);
            assert_eq!(p.at(run * 16 + h), want, "run {run}, head {h}");
        }
    }
    // bf16 operands, f32 result: byte steps follow each operand's element size.
    let q = PtrParams::new(&g, [0, 0, 0], [2, 2, 4], 2, [10, 20, 30]);
    assert_eq!(q.at(17), [20 + 2 * 72, 40 + 2 * 72, 120 + 4 * 65_536]);
}

use super::*;

#[test]
fn broadcast_strides_follow_numpy() {
    assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
    assert_eq!(
        broadcast_strides(&[3, 1], &[2, 3, 4]).unwrap(),
        vec![0, 1, 0]
    );
    assert_eq!(broadcast_strides(&[], &[2, 2]).unwrap(), vec![0, 0]);
    assert_eq!(broadcast_strides(&[1, 4], &[1, 4]).unwrap(), vec![0, 1]);
    assert!(broadcast_strides(&[3], &[4]).is_err());
    assert!(broadcast_strides(&[1, 2, 3], &[2, 3]).is_err());
}

#[test]
fn ew_params_are_contiguous_only_without_broadcast_or_offset() {
    let d = [2, 3];
    let same = Operand::broadcast(Dtype::F32, &d, &d).unwrap();
    let row = Operand::broadcast(Dtype::F32, &[3], &d).unwrap();
    let out = Operand::broadcast(Dtype::Bf16, &d, &d).unwrap();
    let p = EwParams::new(
        EwOp::Binary(petite_graph::BinaryOp::Add),
        &d,
        &[same.clone(), same.clone()],
        &out,
    )
    .unwrap();
    assert_eq!((p.contig, p.n, p.rank, p.dout), (1, 6, 2, 1));
    let p = EwParams::new(
        EwOp::Binary(petite_graph::BinaryOp::Add),
        &d,
        &[same, row],
        &out,
    )
    .unwrap();
    assert_eq!((p.contig, p.sb[0], p.sb[1]), (0, 0, 1));
    let p = EwParams::new(EwOp::Copy, &[2; 9], std::slice::from_ref(&out), &out);
    assert!(p.is_err(), "rank 9 is refused, not truncated");
}

#[test]
fn scalars_are_rounded_to_the_operand_dtype_first() {
    let d = [1];
    let o = Operand::broadcast(Dtype::Bf16, &d, &d).unwrap();
    let p = EwParams::new(
        EwOp::Binary(petite_graph::BinaryOp::Mul),
        &d,
        std::slice::from_ref(&o),
        &o,
    )
    .unwrap()
    .with_scalar(2048f64.sqrt(), false, Dtype::Bf16);
    assert_eq!(p.fs, 45.25, "lerobot's bf16 embed_scale");
    assert_eq!(p.scalar, 1);
}

#[test]
fn param_blocks_have_the_c_layout() {
    // i64 n; 4 ints; 4 ints; 2 ints + float; (pad) i64; 5 arrays of 8 i64; 4 i64.
    assert_eq!(
        std::mem::size_of::<EwParams>(),
        8 + 16 + 16 + 12 + 4 + 8 + 5 * 64 + 32
    );
    assert_eq!(std::mem::offset_of!(EwParams, is), 56);
    assert_eq!(std::mem::offset_of!(EwParams, dims), 64);
    assert_eq!(std::mem::size_of::<NormParams>(), 56);
    assert_eq!(std::mem::offset_of!(SoftmaxParams, h), 40);
    assert_eq!(std::mem::size_of::<RopeParams>(), 24 + 3 * 64);
    // 6 i64; 4 ints, a float, 3 ints; 20 i64.
    assert_eq!(std::mem::offset_of!(AttnParams, qsb), 80);
    assert_eq!(std::mem::size_of::<AttnParams>(), 80 + 20 * 8);
}

#[test]
fn fused_attention_groups_heads_sharing_kv_and_tiles_rows_and_keys() {
    // pi0.5's step: 8 query heads over one KV head (head stride 0), 50 queries, 1,018 keys.
    let (q, qs) = ([1, 8, 50, 256], [102_400, 256, 2_048, 1]);
    let (k, ks) = ([1, 8, 256, 1_018], [260_608, 0, 1, 256]);
    let (v, vs) = ([1, 8, 1_018, 256], [260_608, 0, 256, 1]);
    fn shape_of<'a>(
        (q, qs): (&'a [usize], &'a [i64]),
        k: &'a [usize],
        v: &'a [usize],
        ks: &'a [i64],
        vs: &'a [i64],
    ) -> AttnShape<'a> {
        AttnShape {
            q: (q, qs),
            k: (k, ks),
            v: (v, vs),
            mask: [8, 50, 0, 0, 1_018, 1],
            scale: Some((0.0625, Dtype::Bf16)),
            out: [102_400, 256, 2_048],
            n0: None,
        }
    }
    let shape = |ks, vs| shape_of((&q, &qs), &k, &v, ks, vs);
    let l = attention_launch(shape(&ks, &vs), (9, 0)).unwrap();
    let p = l.params;
    // One group of 400 rows: 25 tiles of 16; 32 splits of 32 keys; 8 blocks of 128.
    assert_eq!((p.shared, p.rpg, p.tiles, p.splits), (1, 400, 25, 32));
    assert_eq!((p.splits2, p.dv, l.tiles), (8, 256, 25));
    assert_eq!(
        (l.logits.grid_dim, l.pv.grid_dim),
        ((25, 32, 1), (25, 8, 1))
    );
    assert_eq!(
        (l.logits.block_dim.0, l.pv.block_dim.0, l.rows),
        (128, 256, 400)
    );
    assert_eq!((p.ksk, p.vsk, p.n0, p.nk), (256, 256, 1_018, 1_018));
    assert_eq!(
        (p.osh, p.osq, p.dscale),
        (256, 2_048, dtype_code(Dtype::Bf16))
    );
    // On sm_90 also as one launch: clusters of 8 blocks of 128 keys, 13 tiles of 32 rows,
    // 162,304 bytes of shared memory a block (under the H200's 227 KiB).
    let c = l.cluster.expect("one launch on sm_90");
    assert_eq!((c.grid_dim, c.block_dim.0), ((8, 13, 1), 512));
    assert_eq!(attention_cluster_keys(1_018), 128);
    assert_eq!(c.shared_mem_bytes, 162_304);
    assert!(c.shared_mem_bytes <= 227 << 10);
    assert_eq!(attention_cluster(1_024, 256, (9, 0)), Some(162_304));
    // Not before sm_90, past 1,024 keys, or with v's head dim not a multiple of 128.
    assert!(
        attention_launch(shape(&ks, &vs), (8, 7))
            .unwrap()
            .cluster
            .is_none()
    );
    assert_eq!(attention_cluster(1_025, 256, (9, 0)), None);
    assert_eq!(attention_cluster(1_018, 64, (9, 0)), None);
    // Few keys: 64 a block (the blocks past them hold none), and the partial products'
    // 32 rows of dv + 8 floats outgrow K's rows.
    assert_eq!(attention_cluster_keys(1), 64);
    assert_eq!(
        attention_cluster(1, 256, (9, 0)),
        Some(32 * 528 + 32 * 264 * 4 + 64 * 528 + 64 * 72 + 1_536)
    );
    // The step's K/V as the prefix's 968 keys and its own 50, read in place.
    let l = attention_launch(
        AttnShape {
            n0: Some(968),
            ..shape(&ks, &vs)
        },
        (9, 0),
    )
    .unwrap();
    assert_eq!(
        (l.params.n0, l.params.ksb, l.params.k1sb),
        (968, 247_808, 12_800)
    );
    assert_eq!(
        (l.params.ksh, l.params.vsk, l.params.v1sb),
        (0, 256, 12_800)
    );
    // Own KV heads: a group a head (8 groups of 50 rows: 4 tiles each).
    let l = attention_launch(
        shape(&[2_084_864, 260_608, 1, 256], &[2_084_864, 260_608, 256, 1]),
        (8, 7),
    )
    .unwrap();
    assert_eq!((l.params.shared, l.params.rpg, l.params.tiles), (0, 50, 4));
    assert_eq!(l.logits.grid_dim, (32, 32, 1));
    // No bf16 mma before sm_80; rows not 16 bytes apart and unpadded dims refused.
    assert!(attention_launch(shape(&ks, &vs), (7, 5)).is_err());
    assert!(attention_launch(shape(&[260_608, 0, 1, 260], &vs), (9, 0)).is_err());
    assert!(attention_launch(shape(&ks, &[260_608, 0, 252, 1]), (9, 0)).is_err());
    let q2 = [1, 8, 50, 24];
    let s = AttnShape {
        q: (&q2, &qs),
        ..shape(&ks, &vs)
    };
    assert!(attention_launch(s, (9, 0)).is_err());
}

#[test]
fn linear_maps_row_major_to_cublas_column_major() {
    // y[5, 3] = x[5, 4] · w[3, 4]ᵀ → C[3×5] = wᵀ… with lda = ldb = 4, ldc = 3.
    let g = Gemm::linear(5, 4, 3).unwrap();
    assert_eq!(
        (g.trans_a, g.trans_b, g.m, g.n, g.k),
        (true, false, 3, 5, 4)
    );
    assert_eq!((g.lda, g.ldb, g.ldc), (4, 4, 3));
    let g = Gemm::matmul(5, 4, 3).unwrap();
    assert_eq!((g.m, g.n, g.k, g.lda, g.ldb, g.ldc), (3, 5, 4, 3, 4, 3));
    assert_eq!(g.flops(), 2.0 * 60.0);
}

#[test]
fn flops_count_the_dense_ops_only() {
    let mut b = petite_graph::Builder::new();
    let x = b.input("x", Dtype::F32, &[3, 4]).unwrap();
    let w = b.weight("w", Dtype::F32, &[5, 4]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    let z = b.exp(y).unwrap();
    b.output("z", z).unwrap();
    let p = b.finish().unwrap();
    assert_eq!(program_flops(&p), 2.0 * 3.0 * 5.0 * 4.0);
}

#[test]
fn attention_batches_query_groups_over_kv_heads() {
    // pi0.5's prefix at full size: 8 query heads, 1 KV head, 968 tokens, head dim 256.
    let (l, pv) = attention_gemms(1, 8, 1, 968, 968, 256, 256).unwrap();
    assert_eq!((l.m, l.n, l.k, l.batch), (968, 8 * 968, 256, 1));
    assert_eq!((pv.m, pv.n, pv.k, pv.batch), (256, 8 * 968, 968, 1));
    let (l, _) = attention_gemms(2, 4, 2, 3, 5, 8, 8).unwrap();
    assert_eq!(
        (l.batch, l.stride_a, l.stride_b, l.stride_c),
        (4, 40, 48, 30)
    );
    assert!(attention_gemms(1, 3, 2, 1, 1, 1, 1).is_err());
}

#[test]
fn attention_per_head_reads_split_heads_and_writes_merged_ones() {
    // SigLIP: 16 heads of 72 split out of [256, 1152] rows, written as [256, 16, 72].
    let split = HeadLayout { ld: 1152, head: 72 };
    let (l, pv) = attention_gemms_per_head(16, 16, 256, 256, 72, 72, [split, split, split, split])
        .unwrap()
        .unwrap();
    // logitsᵀ [K, Q] = k [K, D] · qᵀ, a head a batch, every leading dimension the row stride.
    assert!(l.trans_a && !l.trans_b);
    assert_eq!(
        (l.m, l.n, l.k, l.lda, l.ldb, l.ldc),
        (256, 256, 72, 1152, 1152, 256)
    );
    assert_eq!(
        (l.batch, l.stride_a, l.stride_b, l.stride_c),
        (16, 72, 72, 256 * 256)
    );
    assert!(!pv.trans_a && !pv.trans_b);
    assert_eq!(
        (pv.m, pv.n, pv.k, pv.lda, pv.ldb, pv.ldc),
        (72, 256, 256, 1152, 256, 1152)
    );
    assert_eq!(
        (pv.batch, pv.stride_a, pv.stride_b, pv.stride_c),
        (16, 72, 256 * 256, 72)
    );
    // One KV head shared by all: batch stride 0.
    let dense = |s: usize, d: usize| HeadLayout {
        ld: d as i64,
        head: (s * d) as i64,
    };
    let (l, pv) = attention_gemms_per_head(
        8,
        1,
        5,
        7,
        4,
        4,
        [
            dense(5, 4),
            dense(7, 4),
            dense(7, 4),
            HeadLayout { ld: 32, head: 4 },
        ],
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        (l.stride_a, l.stride_b, pv.stride_a, pv.ldc, pv.stride_c),
        (0, 20, 0, 32, 4)
    );
    // Two KV heads for four query heads: no one stride reaches them.
    assert!(
        attention_gemms_per_head(4, 2, 5, 7, 4, 4, [dense(5, 4); 4])
            .unwrap()
            .is_none()
    );
}

#[test]
fn tf32_attention_launches_take_siglips_shape_and_refuse_the_rest() {
    let h200 = 232_448;
    // SigLIP: 3 cameras × 16 heads × 256 queries and keys, head dim 72, q/k/v split from
    // [3, 256, 1152] rows in place; the output merged back to [3, 256, 16, 72].
    let s = [256 * 1152, 72, 1152];
    let (p, cfg) = tf32_attention_launch(
        [3, 16, 16, 256, 256, 72, 72],
        s,
        s,
        s,
        s,
        0.117_851_13,
        h200,
    )
    .unwrap();
    assert_eq!((p.tiles, p.d, p.dv, p.nk), (4, 72, 72, 256));
    assert_eq!(cfg.grid_dim, (3 * 16 * 4, 1, 1));
    // q's 64 rows, then K's and v's 256, each of 76 floats.
    assert_eq!(cfg.shared_mem_bytes, (64 + 2 * 256) * 76 * 4);
    // 100 queries: two tiles; KV heads shared by two query heads; one key: the partial
    // results (4 quarters × 64 rows of 12 floats, and their statistics) outgrow the staging.
    let (p, cfg) = tf32_attention_launch([1, 4, 2, 100, 1, 16, 8], s, s, s, s, 1.0, h200).unwrap();
    assert_eq!((p.tiles, p.kvh), (2, 2));
    assert_eq!(cfg.shared_mem_bytes, (64 * 20 + 512 + 256 * 12) * 4);
    for (dims, ks, max) in [
        ([3, 16, 16, 256, 256, 68, 72], s, h200),
        ([3, 16, 16, 256, 256, 72, 88], s, h200),
        ([3, 16, 16, 256, 257, 72, 72], s, h200),
        ([3, 16, 3, 256, 256, 72, 72], s, h200),
        ([3, 16, 16, 0, 256, 72, 72], s, h200),
        ([3, 16, 16, 256, 256, 72, 72], [256 * 1152, 72, 1150], h200),
        ([3, 16, 16, 256, 256, 72, 72], s, 100 << 10),
    ] {
        assert!(
            tf32_attention_launch(dims, s, ks, s, s, 1.0, max).is_none(),
            "{dims:?}"
        );
    }
    // q's rows are staged 16 bytes a copy too.
    let odd = [256 * 1152, 72, 1150];
    let siglip = [3, 16, 16, 256, 256, 72, 72];
    assert!(tf32_attention_launch(siglip, odd, s, s, s, 1.0, h200).is_none());
}

/// `pt_wq_gemm`'s splits cover K exactly once, in whole 32-column steps, and give the weights
/// of pi0.5's step (and odd shapes) about `WQ_BLOCKS` blocks, never fewer than the features
/// need.
#[test]
fn weight_only_grids_cover_k_once_with_about_256_blocks() {
    for (n, k) in [
        (2048, 1024),
        (256, 1024),
        (1024, 2048),
        (4096, 1024),
        (1024, 4096),
        (300, 2048),
        (24, 64),
        (16384, 2048),
        (7, 32),
    ] {
        let g = wq_grid(n, k).unwrap();
        assert!(g.kc.is_multiple_of(32) && g.kc > 0, "{n}×{k}: {g:?}");
        assert!(
            g.splits * g.kc >= k && (g.splits - 1) * g.kc < k,
            "{n}×{k}: {g:?}"
        );
        assert_eq!(g.tiles, n.div_ceil(128));
        let blocks = g.tiles * g.splits;
        // Whole-K splits only where K has fewer 32-column steps than the blocks want.
        assert!(
            blocks >= WQ_BLOCKS.min(g.tiles * (k / 32)) / 2
                && (g.splits == 1 || blocks <= 2 * WQ_BLOCKS),
            "{n}×{k}: {blocks} blocks ({g:?})"
        );
    }
    // The GPU test's shapes with several 32-column steps a split and a shorter last split.
    let g = wq_grid(4000, 640).unwrap();
    assert_eq!((g.tiles, g.kc, g.splits), (32, 96, 7));
    assert_eq!(640 - (g.splits - 1) * g.kc, 64);
    let g = wq_grid(2100, 1280).unwrap();
    assert_eq!((g.tiles, g.kc, g.splits), (17, 96, 14));
    assert_eq!(1280 - (g.splits - 1) * g.kc, 32);
    assert_eq!(wq_grid(24, 48), None);
    assert_eq!(wq_grid(0, 64), None);
    assert_eq!(wq_grid(24, 0), None);
}
