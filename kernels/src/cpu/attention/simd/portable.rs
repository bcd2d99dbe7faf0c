//! Plain loops; LLVM vectorises the 8-wide inner loops with the baseline instruction set.

#[allow(clippy::too_many_arguments)]
pub(super) fn matmul(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    ldb: usize,
    b_js: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    // n is a multiple of 8: eight accumulators per block of columns, no allocation.
    for i in 0..m {
        for j in (0..n).step_by(8) {
            let mut acc = [0f32; 8];
            let col = (j - j % super::STRIP) * b_js + j % super::STRIP;
            for p in 0..k {
                let av = a[i * a_rs + p * a_cs];
                let brow = &b[p * ldb + col..p * ldb + col + 8];
                for (o, bv) in acc.iter_mut().zip(brow) {
                    *o = av.mul_add(*bv, *o);
                }
            }
            let crow = &mut c[i * ldc + j..i * ldc + j + 8];
            if accumulate {
                for (o, v) in crow.iter_mut().zip(&acc) {
                    *o += v;
                }
            } else {
                crow.copy_from_slice(&acc);
            }
        }
    }
}

pub(super) fn max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for ch in &mut chunks {
        for l in 0..8 {
            lanes[l] = lanes[l].max(ch[l]);
        }
    }
    let mut m = f32::NEG_INFINITY;
    for v in lanes.iter().chain(chunks.remainder()) {
        m = m.max(*v);
    }
    m
}

pub(super) fn scale(y: &mut [f32], a: f32) {
    for v in y {
        *v *= a;
    }
}

pub(super) fn exp2_scaled_sum(x: &mut [f32], c: f32, m: f32) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for ch in &mut chunks {
        for l in 0..8 {
            ch[l] = (ch[l] * c - m).exp2();
            lanes[l] += ch[l];
        }
    }
    let mut s = 0f32;
    for v in chunks.into_remainder() {
        *v = (*v * c - m).exp2();
        s += *v;
    }
    lanes.iter().sum::<f32>() + s
}
