//! The AVX2 attention path against the f64 reference, on machines whose default is AVX-512 (where the rest of
//! the suite never reaches it). A separate test binary, because capping the path is process-wide.

mod common;

use longctx_kernels::attention::{limit_simd, simd_path, AttnShape, SimdPath};

#[test]
fn avx2_path_matches_reference() {
    limit_simd(SimdPath::Avx2);
    if simd_path() != SimdPath::Avx2 {
        eprintln!("skipped: this CPU has no AVX2 + FMA (path {:?})", simd_path());
        return;
    }
    // Sizes that reach every tile height and the 16- and 8-column tails of the micro-kernel.
    let shape = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: 141, kv_len: 200, head_dim: 40 };
    common::matches_reference("AVX2", shape, 59, 70, None, 11);
}
