//! The q/k row permutation between the two rotary pairings.
//!
//! Interleaved (Meta's original checkpoints, GGUF): each head's rotary pairs are rows `(2i, 2i+1)`. Half-split
//! (transformers' `rotate_half`, and this trainer's RoPE kernel): rows `(i, i + D/2)`. transformers'
//! `convert_llama_weights_to_hf.py` turns the first into the second with, per projection of `n` heads,
//! `w.view(n, D/2, 2, in).transpose(1, 2).reshape(n·D, in)`: row `h·D + j·D/2 + i` of the result is row
//! `h·D + 2i + j` of the input. Hugging Face checkpoints are already half-split and need neither function.

/// Reorders the rows of `w` (`[n·d, cols]`, row-major, `n` heads of `d` rows) from interleaved pairs to
/// half-split pairs. `d` must be even.
pub fn permute_interleaved_to_half_split(w: &[f32], n: usize, d: usize, cols: usize) -> Vec<f32> {
    reorder(w, n, d, cols, false)
}

/// The inverse of [`permute_interleaved_to_half_split`]: half-split rows back to interleaved pairs.
pub fn permute_half_split_to_interleaved(w: &[f32], n: usize, d: usize, cols: usize) -> Vec<f32> {
    reorder(w, n, d, cols, true)
}

/// Row `h·d + j·d/2 + i` (half-split) ↔ row `h·d + 2i + j` (interleaved); `back` picks the direction.
fn reorder(w: &[f32], n: usize, d: usize, cols: usize, back: bool) -> Vec<f32> {
    let mut out = vec![0.0; w.len()];
    let half = d / 2;
    for h in 0..n {
        for j in 0..2 {
            for i in 0..half {
                let (split, inter) = (h * d + j * half + i, h * d + 2 * i + j);
                let (dst, src) = if back { (inter, split) } else { (split, inter) };
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_converter_and_inverts() {
        // 2 heads of 4 rows, 1 column: row r holds r.
        let w: Vec<f32> = (0..8).map(|r| r as f32).collect();
        // view(2, 2, 2, 1).transpose(1, 2): per head [0, 2, 1, 3].
        let got = permute_interleaved_to_half_split(&w, 2, 4, 1);
        assert_eq!(got, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(permute_half_split_to_interleaved(&got, 2, 4, 1), w);
        let wide: Vec<f32> = (0..8 * 3).map(|x| x as f32).collect();
        assert_eq!(
            permute_half_split_to_interleaved(&permute_interleaved_to_half_split(&wide, 1, 8, 3), 1, 8, 3),
            wide
        );
    }
}
