//! Combining partial attention results computed over disjoint key sets: the kernel behind
//! [`Backend::attention_merge`](crate::Backend::attention_merge).

/// Merges the partial result `(o2, lse2)` into `(o1, lse1)`, in place, giving exactly the attention over the
/// union of the two key sets. Rows are `lse1.len()`; each output row has `o1.len() / lse1.len()` elements.
///
/// Derivation: for one query row with keys split into sets 1 and 2, let `Z_k = Σ_{j∈k} exp(s_j)`, so
/// `LSE_k = ln Z_k` and `O_k = Σ_{j∈k} exp(s_j) v_j / Z_k`. Over the union, `Z = Z_1 + Z_2` and
/// `O = (Z_1 O_1 + Z_2 O_2) / Z`. With `m = max(LSE_1, LSE_2)` and `w_k = exp(LSE_k - m)` (both ≤ 1, one of them
/// exactly 1, so nothing overflows however large the LSEs are):
/// `LSE = m + ln(w_1 + w_2)` and `O = (w_1 O_1 + w_2 O_2) / (w_1 + w_2)`.
/// A side with `LSE = -inf` saw no key and has weight 0, so it adds nothing even when its `O` is not finite
/// (its term is left out rather than multiplied by 0); when both do, the row stays `O = 0`, `LSE = -inf`.
pub(crate) fn merge_partial_attention(o1: &mut [f32], lse1: &mut [f32], o2: &[f32], lse2: &[f32]) {
    let rows = lse1.len();
    if rows == 0 {
        return;
    }
    let d = o1.len() / rows;
    for i in 0..rows {
        let (a, b) = (lse1[i], lse2[i]);
        let m = a.max(b);
        if m == f32::NEG_INFINITY {
            continue; // neither side saw a key; o1 already holds the zero row
        }
        let w1 = (a - m).exp();
        let w2 = (b - m).exp();
        let z = w1 + w2;
        let (c1, c2) = (w1 / z, w2 / z);
        let (row, row2) = (&mut o1[i * d..(i + 1) * d], &o2[i * d..(i + 1) * d]);
        if w1 == 0.0 || w2 == 0.0 {
            // One side has no weight (it saw no key, or its LSE is far below the other's): its term is dropped,
            // not multiplied by 0, so a NaN there stays out. Equal to the sum below whenever that is finite.
            for (x, y) in row.iter_mut().zip(row2) {
                let (t1, t2) = (c1 * *x, c2 * *y);
                *x = if w1 == 0.0 && !t1.is_finite() {
                    t2
                } else if w2 == 0.0 && !t2.is_finite() {
                    t1
                } else {
                    t1 + t2
                };
            }
        } else {
            for (x, y) in row.iter_mut().zip(row2) {
                *x = c1 * *x + c2 * *y;
            }
        }
        lse1[i] = m + z.ln();
    }
}
