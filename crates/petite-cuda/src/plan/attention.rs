//! The attention kernels' launches: the TF32 attention's ([`tf32_attention_launch`]) and the
//! fused bf16 attention's, its tiles and thread-block clusters ([`attention_launch`]).

use super::dtype_code;
use crate::{Error, Result};
use cudarc::driver::LaunchConfig;
use petite_graph::Dtype;

/// `pt_attn_tf32`'s parameter block (mirrors `struct TfAttnParams`): element strides of q
/// `[B, H, Q, D]`, K and v `[B, KVH, K, D]` (batch, head, row; each row contiguous) and the
/// output (batch, head, query; its rows contiguous), the sizes, the 64-row tiles a head.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TfAttnParams {
    /// q's batch, head and query strides.
    pub qs: [i64; 3],
    /// K's batch, head and key strides.
    pub ks: [i64; 3],
    /// v's batch, head and key strides.
    pub vs: [i64; 3],
    /// The output's batch, head and query strides.
    pub os: [i64; 3],
    /// Query heads.
    pub h: i32,
    /// Key/value heads (dividing `h`).
    pub kvh: i32,
    /// Queries.
    pub nq: i32,
    /// Keys.
    pub nk: i32,
    /// q/k head dim.
    pub d: i32,
    /// v head dim.
    pub dv: i32,
    /// Tiles of 64 queries a head.
    pub tiles: i32,
    /// The logits' scale.
    pub scale: f32,
}

// SAFETY: plain `#[repr(C)]` data mirroring the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for TfAttnParams {}

/// Most keys `pt_attn_tf32` takes (four warps' quarters of 64, all staged at once).
pub const TF32_ATTN_MAX_KEYS: usize = 256;

/// Largest head dim `pt_attn_tf32` takes (q and v; the fragments' registers).
pub const TF32_ATTN_MAX_DIM: usize = 80;

/// The `pt_attn_tf32` launch of an f32 attention without a mask over `[b, h, nq, d]` queries
/// and `[b, kvh, nk, d]` keys (v's head dim `dv`), each operand's `[batch, head, row]` element
/// strides given (rows contiguous) and the output's: grid, 512 threads, shared memory for q's
/// 64 rows and all of K and v (or the four key quarters' partial results, if larger). `None`
/// where the kernel does not apply (head dims not multiples of 8 or past
/// [`TF32_ATTN_MAX_DIM`], more than [`TF32_ATTN_MAX_KEYS`] keys, q/K/v rows not 16-byte
/// multiples (all three are staged 16 bytes a copy), heads not a multiple of the KV heads,
/// more shared memory than `max_smem`, sizes past 32 bits, nothing to do), and the unfused
/// GEMMs and softmax run.
#[allow(clippy::too_many_arguments)]
pub fn tf32_attention_launch(
    [b, h, kvh, nq, nk, d, dv]: [usize; 7],
    q: [i64; 3],
    k: [i64; 3],
    v: [i64; 3],
    o: [i64; 3],
    scale: f32,
    max_smem: usize,
) -> Option<(TfAttnParams, LaunchConfig)> {
    let dims_fit = |x: usize| x > 0 && x <= TF32_ATTN_MAX_DIM && x.is_multiple_of(8);
    if b == 0
        || nq == 0
        || nk == 0
        || nk > TF32_ATTN_MAX_KEYS
        || kvh == 0
        || !h.is_multiple_of(kvh)
        || !dims_fit(d)
        || !dims_fit(dv)
        || q.iter().chain(&k).chain(&v).any(|s| s % 4 != 0)
    {
        return None;
    }
    let i = |x: usize| i32::try_from(x).ok();
    let tiles = nq.div_ceil(64);
    let blocks = u32::try_from(b.checked_mul(h)?.checked_mul(tiles)?).ok()?;
    let nkp = nk.div_ceil(64) * 64;
    let (dp, vp) = (d + 4, dv + 4);
    let floats = 64 * dp + (nkp * (dp + vp)).max(2 * 64 * 4 + 64 * 4 * vp);
    let smem = floats * 4;
    if smem > max_smem {
        return None;
    }
    Some((
        TfAttnParams {
            qs: q,
            ks: k,
            vs: v,
            os: o,
            h: i(h)?,
            kvh: i(kvh)?,
            nq: i(nq)?,
            nk: i(nk)?,
            d: i(d)?,
            dv: i(dv)?,
            tiles: i(tiles)?,
            scale,
        },
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: smem as u32,
        },
    ))
}

/// `pt_attn_logits`/`pt_attn_pv`'s parameter block ([`crate::fuse::Attend`]): field for field
/// the `AttnParams` of [`crate::source`]'s attention kernels. Strides are in elements.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParams {
    /// Keys.
    pub nk: i64,
    /// Keys in K's and v's first piece (`nk`: one piece).
    pub n0: i64,
    /// Query rows a group (`H·Q` when all heads share K and v, else `Q`).
    pub rpg: i64,
    /// Row tiles of 16 a group.
    pub tiles: i64,
    /// Query heads.
    pub h: i64,
    /// Queries.
    pub q: i64,
    /// 1 when all heads read one K and v (their head strides are 0): a group is a batch.
    pub shared: i32,
    /// q's and k's head dim (a multiple of 16).
    pub d: i32,
    /// Key splits of `pt_attn_logits` (32 keys each).
    pub splits: i32,
    /// Dtype code the scaled logits are rounded to (f32: not rounded).
    pub dscale: i32,
    /// Multiplies the bf16 logits.
    pub scale: f32,
    /// A mask is added.
    pub has_mask: i32,
    /// v's head dim (a multiple of 32, at most 256).
    pub dv: i32,
    /// Key blocks of `pt_attn_pv` (128 keys each).
    pub splits2: i32,
    /// q's strides along B, H, Q.
    pub qsb: i64,
    /// See `qsb`.
    pub qsh: i64,
    /// See `qsb`.
    pub qsq: i64,
    /// k's strides along B, H, K (its first piece).
    pub ksb: i64,
    /// See `ksb`.
    pub ksh: i64,
    /// See `ksb` (both pieces).
    pub ksk: i64,
    /// k's second piece's strides along B, H.
    pub k1sb: i64,
    /// See `k1sb`.
    pub k1sh: i64,
    /// v's strides along B, H, K (its first piece).
    pub vsb: i64,
    /// See `vsb`.
    pub vsh: i64,
    /// See `vsb` (both pieces).
    pub vsk: i64,
    /// v's second piece's strides along B, H.
    pub v1sb: i64,
    /// See `v1sb`.
    pub v1sh: i64,
    /// The mask's strides along B, H, Q, K (0 where broadcast).
    pub msb: i64,
    /// See `msb`.
    pub msh: i64,
    /// See `msb`.
    pub msq: i64,
    /// See `msb`.
    pub msk: i64,
    /// The output's strides along B, H, Q (its last dim contiguous).
    pub osb: i64,
    /// See `osb`.
    pub osh: i64,
    /// See `osb`.
    pub osq: i64,
}
// SAFETY: as for EwParams.
unsafe impl cudarc::driver::DeviceRepr for AttnParams {}

/// A fused attention's operands: `(shape, element strides)` of q `[B, H, Q, D]`, of k seen
/// as kᵀ `[B, H, D, K]` and of v `[B, H, K, Dv]` (head-repeated K/V as head stride 0), the
/// mask's `[H, Q, sb, sh, sq, sk]` (as `pt_softmax` takes it), the scaling folded in, and the
/// output's strides along B, H, Q.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape<'a> {
    /// q.
    pub q: (&'a [usize], &'a [i64]),
    /// kᵀ.
    pub k: (&'a [usize], &'a [i64]),
    /// v.
    pub v: (&'a [usize], &'a [i64]),
    /// The mask's heads, queries and strides.
    pub mask: [i64; 6],
    /// The scaling and the dtype its product is rounded to.
    pub scale: Option<(f32, Dtype)>,
    /// Output strides along B, H, Q.
    pub out: [i64; 3],
    /// With K and v each two pieces along the keys (kᵀ's and v's strides those of their
    /// contiguous concat): the first pieces' keys.
    pub n0: Option<usize>,
}

/// A planned fused attention: the parameters, both launches, and the scratch rows (`B·H·Q`:
/// f32 logits of `nk` and `splits` (max, sum) pairs each).
#[derive(Debug, Clone, Copy)]
pub struct AttnLaunch {
    /// The kernels' parameters.
    pub params: AttnParams,
    /// `pt_attn_logits`: (row tiles, key splits), 128 threads.
    pub logits: LaunchConfig,
    /// `pt_attn_pv`: (row tiles, Dv / 32), 256 threads.
    pub pv: LaunchConfig,
    /// `pt_attn_cl`, the whole attention in one launch, where it fits ([`attention_cluster`]):
    /// ([`ATTN_CLUSTER`] key blocks, tiles of 32 rows), 512 threads, its dynamic shared memory;
    /// launched in clusters of [`ATTN_CLUSTER`] blocks along x.
    pub cluster: Option<LaunchConfig>,
    /// Scratch rows.
    pub rows: usize,
    /// Row tiles (`pt_attn_pv`'s counters; its partial products are `tiles · splits2 · 16 · dv`).
    pub tiles: usize,
}

/// Plans a fused attention over `s` on a device of compute capability `cc`; refuses what the
/// kernels cannot index (the fusion plan only picks what they can).
pub fn attention_launch(s: AttnShape<'_>, cc: (i32, i32)) -> Result<AttnLaunch> {
    let bad = |m: String| Error::Plan(format!("fused attention: {m}"));
    if cc.0 < 8 {
        return Err(bad(format!(
            "needs sm_80 or later, not sm_{}{}",
            cc.0, cc.1
        )));
    }
    let (qs, qst) = s.q;
    let (ks, kst) = s.k;
    let (vs, vst) = s.v;
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Err(bad("operands of rank 4 only".into()));
    }
    let (b, h, nq, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (nk, dv) = (ks[3], vs[3]);
    if ks[..3] != [b, h, d] || vs[..3] != [b, h, nk] {
        return Err(bad(format!("q {qs:?}, kᵀ {ks:?}, v {vs:?} disagree")));
    }
    if qst[3] != 1 || kst[2] != 1 || vst[3] != 1 {
        return Err(bad("head dims not contiguous".into()));
    }
    if !attention_dims_fit(d, dv) || nk == 0 || nq == 0 {
        return Err(bad(format!("head dims {d}/{dv}, {nq} queries, {nk} keys")));
    }
    // Rows are read 16 bytes at a time.
    if !attention_strides_fit(qst, kst, vst) {
        return Err(bad(format!(
            "q {qst:?}, kᵀ {kst:?} or v {vst:?} rows not 8 elements apart"
        )));
    }
    let shared = kst[1] == 0 && vst[1] == 0;
    let (groups, rpg) = if shared { (b, h * nq) } else { (b * h, nq) };
    let tiles = rpg.div_ceil(16);
    let splits = nk.div_ceil(32);
    let splits2 = nk.div_ceil(128);
    // The kernels index in 32 bits: every element they address must be below 2^31.
    let reach = |dims: &[usize], st: &[i64]| -> u128 {
        dims.iter()
            .zip(st)
            .map(|(&n, &x)| n.saturating_sub(1) as u128 * x.unsigned_abs() as u128)
            .sum::<u128>()
            + 1
    };
    let m = s.mask;
    let scratch = [
        (b * h * nq) as u128 * nk as u128,
        (groups * tiles * splits2 * 16 * dv) as u128,
        reach(qs, qst),
        reach(ks, kst),
        reach(vs, vst),
        reach(&[b, h, nq, nk], &m[2..]),
        reach(&[b, h, nq, dv], &s.out),
    ];
    if scratch.iter().any(|&x| x >= 1 << 31) {
        return Err(bad(format!(
            "{scratch:?} elements reach past 32-bit indices"
        )));
    }
    let n = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| bad(format!("{v} {what} exceed the grid")))
    };
    let blocks = n(groups * tiles, "row tiles")?;
    let (splits32, blocks2) = (n(splits, "key splits")?, n(splits2, "key blocks")?);
    if splits32 > 65_535 {
        return Err(bad(format!("{nk} keys")));
    }
    // Each piece is contiguous like the concat: its batch and head strides scale with its keys.
    let piece = |x: i64, n: usize| -> Result<i64> {
        if x % nk as i64 != 0 {
            return Err(bad(format!("a stride of {x} over {nk} concatenated keys")));
        }
        Ok(x / nk as i64 * n as i64)
    };
    let n0 = s.n0.unwrap_or(nk);
    if n0 == 0 || n0 > nk {
        return Err(bad(format!(
            "pieces of {n0} and {} keys",
            nk.wrapping_sub(n0)
        )));
    }
    let split = |st: &[i64]| -> Result<[i64; 4]> {
        if n0 == nk {
            return Ok([st[0], st[1], st[0], st[1]]);
        }
        Ok([
            piece(st[0], n0)?,
            piece(st[1], n0)?,
            piece(st[0], nk - n0)?,
            piece(st[1], nk - n0)?,
        ])
    };
    let (kp, vp) = (split(kst)?, split(vst)?);
    let (scale, dscale) = match s.scale {
        Some((x, dt)) => (x, dtype_code(dt)),
        None => (1.0, dtype_code(Dtype::F32)),
    };
    let params = AttnParams {
        nk: nk as i64,
        n0: n0 as i64,
        rpg: rpg as i64,
        tiles: tiles as i64,
        h: h as i64,
        q: nq as i64,
        shared: i32::from(shared),
        d: i32::try_from(d).map_err(|_| bad(format!("head dim {d}")))?,
        splits: splits32 as i32,
        dscale,
        scale,
        has_mask: 1,
        dv: dv as i32,
        splits2: blocks2 as i32,
        qsb: qst[0],
        qsh: qst[1],
        qsq: qst[2],
        ksb: kp[0],
        ksh: kp[1],
        ksk: kst[3],
        k1sb: kp[2],
        k1sh: kp[3],
        vsb: vp[0],
        vsh: vp[1],
        vsk: vst[2],
        v1sb: vp[2],
        v1sh: vp[3],
        msb: m[2],
        msh: m[3],
        msq: m[4],
        msk: m[5],
        osb: s.out[0],
        osh: s.out[1],
        osq: s.out[2],
    };
    let cfg = |grid: (u32, u32), threads: u32| LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let cluster = match attention_cluster(nk, dv, cc) {
        Some(bytes) => {
            let rows = n(groups * rpg.div_ceil(32), "row tiles")?;
            (rows <= 65_535).then_some(LaunchConfig {
                grid_dim: (ATTN_CLUSTER, rows, 1),
                block_dim: (512, 1, 1),
                shared_mem_bytes: bytes,
            })
        }
        None => None,
    };
    Ok(AttnLaunch {
        params,
        logits: cfg((blocks, splits32), 128),
        pv: cfg((blocks, blocks2), 256),
        cluster,
        rows: groups * rpg,
        tiles: groups * tiles,
    })
}

/// Blocks of a `pt_attn_cl` cluster (its `AT_CL`): each holds an eighth of the keys, so the
/// row statistics and the partial products are exchanged through distributed shared memory
/// instead of global memory (a portable cluster size).
pub const ATTN_CLUSTER: u32 = 8;

/// Keys a `pt_attn_cl` block holds (its `AT_CL_KC`): an eighth of `nk`, rounded up to 64.
pub fn attention_cluster_keys(nk: usize) -> usize {
    nk.div_ceil(ATTN_CLUSTER as usize).div_ceil(64) * 64
}

/// `pt_attn_cl`'s dynamic shared memory for `nk` keys and v's head dim `dv`, where the one-launch
/// attention runs: sm_90 or later (clusters), at most 1,024 keys (128 a block) and `dv` a
/// multiple of 128; `None` elsewhere (the two launches run). The layout is the kernel's: q's 32
/// rows, K's (or the f32 partial products, rows of `dv + 8`, whichever is larger), v's (rows
/// of 264 bf16), p, and the row statistics.
pub fn attention_cluster(nk: usize, dv: usize, cc: (i32, i32)) -> Option<u32> {
    if cc.0 < 9 || nk == 0 || nk > 1024 || !dv.is_multiple_of(128) || dv > 256 {
        return None;
    }
    let kc = attention_cluster_keys(nk);
    let row = (256 + 8) * 2;
    let bytes =
        32 * row + (kc * row).max(32 * (dv + 8) * 4) + kc * row + 64 * (kc + 8) + 1024 + 256 + 256;
    u32::try_from(bytes).ok()
}

/// Head dims the fused attention kernels take: q/k's a multiple of 16, v's of 32, both at most
/// 256 (a row of each in shared memory).
pub fn attention_dims_fit(d: usize, dv: usize) -> bool {
    d > 0 && d <= 256 && d.is_multiple_of(16) && dv > 0 && dv <= 256 && dv.is_multiple_of(32)
}

/// Strides the fused attention kernels read (rows 16 bytes at a time): q `[B, H, Q, D]`, kᵀ
/// `[B, H, D, K]` and v `[B, H, K, Dv]` with their head dims contiguous and every other
/// stride a multiple of 8 elements.
pub fn attention_strides_fit(q: &[i64], k: &[i64], v: &[i64]) -> bool {
    let eight = |xs: &[i64]| xs.iter().all(|x| x % 8 == 0);
    q.len() == 4
        && k.len() == 4
        && v.len() == 4
        && q[3] == 1
        && k[2] == 1
        && v[3] == 1
        && eight(&q[..3])
        && eight(&[k[0], k[1], k[3]])
        && eight(&v[..3])
}
