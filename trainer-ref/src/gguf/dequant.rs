//! GGML tensor types and their dequantisation to `f32`, block by block, as ggml's `dequantize_row_*` does.
//!
//! Legend: a block holds `QK` consecutive elements of a row (32, or 256 for the k-quants) with its own scale
//! `d` (and minimum `m`) in `f16`:
//!
//! ```text
//! Q4_0  [d, 16 B nibbles]          x = (q − 8)·d             low nibbles are elements 0..16, high 16..32
//! Q4_1  [d, m, 16 B nibbles]       x = q·d + m
//! Q5_0  [d, 4 B high bits, 16 B]   x = (q | h<<4 − 16)·d
//! Q5_1  [d, m, 4 B, 16 B]          x = (q | h<<4)·d + m
//! Q8_0  [d, 32 × i8]               x = q·d
//! Q4_K  [d, dmin, 12 B 6-bit scales/mins, 128 B nibbles], 8 sub-blocks of 32: x = d·sc·q − dmin·mn
//! Q6_K  [128 B low nibbles, 64 B high 2 bits, 16 × i8 scales, d], 16 sub-blocks of 16: x = d·sc·(q − 32)
//! ```

use half::{bf16, f16};

/// The GGML types this importer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 4-bit, scale only.
    Q4_0,
    /// 4-bit, scale and minimum.
    Q4_1,
    /// 5-bit, scale only.
    Q5_0,
    /// 5-bit, scale and minimum.
    Q5_1,
    /// 8-bit, scale only.
    Q8_0,
    /// 4-bit k-quant (super-blocks of 256).
    Q4K,
    /// 6-bit k-quant (super-blocks of 256).
    Q6K,
}

impl GgmlType {
    /// The type of a GGML type id, or `None` for one this importer does not read.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// ggml's name of a type id (for messages about the ones not read).
    pub fn name_of(id: u32) -> String {
        const NAMES: [&str; 31] = [
            "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS",
            "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16",
        ];
        NAMES.get(id as usize).map_or_else(|| format!("type {id}"), |n| format!("{n} ({id})"))
    }

    /// The names of the types read, for messages.
    pub const SUPPORTED: &'static str = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K";

    /// `(elements, bytes)` per block.
    pub fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q6K => (256, 210),
        }
    }

    /// Bytes of `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let (qk, bytes) = self.block();
        n.is_multiple_of(qk).then(|| n / qk * bytes)
    }

    /// Dequantises `raw` (a whole number of blocks) into `out` (`raw.len() / bytes · elements` values).
    pub fn dequantize(self, raw: &[u8], out: &mut [f32]) {
        let (qk, bytes) = self.block();
        let (qk, bytes) = (qk as usize, bytes as usize);
        for (b, y) in raw.chunks_exact(bytes).zip(out.chunks_exact_mut(qk)) {
            match self {
                GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                GgmlType::F16 => y[0] = h(b, 0),
                GgmlType::Bf16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                GgmlType::Q4_0 => q4(b, y, h(b, 0), 8, 0.0, 2),
                GgmlType::Q4_1 => q4(b, y, h(b, 0), 0, h(b, 2), 4),
                GgmlType::Q5_0 => q5(b, y, h(b, 0), 16, 0.0, 2),
                GgmlType::Q5_1 => q5(b, y, h(b, 0), 0, h(b, 2), 4),
                GgmlType::Q8_0 => {
                    let d = h(b, 0);
                    for (o, &q) in y.iter_mut().zip(&b[2..34]) {
                        *o = q as i8 as f32 * d;
                    }
                }
                GgmlType::Q4K => q4k(b, y),
                GgmlType::Q6K => q6k(b, y),
            }
        }
    }
}

/// The `f16` at byte `at`.
fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// 4-bit block: 16 bytes of nibbles after a `head`-byte header; `x = (q − off)·d + m`, the integer offset
/// taken first as ggml does, so the values are bit-identical to its own.
fn q4(b: &[u8], y: &mut [f32], d: f32, off: i32, m: f32, head: usize) {
    for j in 0..16 {
        let q = b[head + j];
        y[j] = ((q & 0x0F) as i32 - off) as f32 * d + m;
        y[j + 16] = ((q >> 4) as i32 - off) as f32 * d + m;
    }
}

/// 5-bit block: the fifth bits in a little-endian `u32` after the scales, then 16 bytes of nibbles.
fn q5(b: &[u8], y: &mut [f32], d: f32, off: i32, m: f32, head: usize) {
    let qh = u32::from_le_bytes([b[head], b[head + 1], b[head + 2], b[head + 3]]);
    for j in 0..16 {
        let q = b[head + 4 + j];
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = (((q & 0x0F) as u32 | h0) as i32 - off) as f32 * d + m;
        y[j + 16] = (((q >> 4) as u32 | h1) as i32 - off) as f32 * d + m;
    }
}

/// Scale and minimum of sub-block `j` from Q4_K's 12 packed bytes (six bits each).
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        let d = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (d as f32, m as f32)
    }
}

fn q4k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (h(b, 0), h(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        for l in 0..32 {
            y[l] = d * sc1 * (q[l] & 0x0F) as f32 - dmin * m1;
            y[l + 32] = d * sc2 * (q[l] >> 4) as f32 - dmin * m2;
        }
    }
}

fn q6k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = h(b, 208);
    for half in 0..2 {
        let (ql, qh, sc, y) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..], &mut y[128 * half..]);
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |i: usize| d * sc[i] as i8 as f32;
            y[l] = s(is) * q1 as f32;
            y[l + 32] = s(is + 2) * q2 as f32;
            y[l + 64] = s(is + 4) * q3 as f32;
            y[l + 96] = s(is + 6) * q4 as f32;
        }
    }
}
