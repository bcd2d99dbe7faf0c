//! The portable (non-SIMD) attention path against the f64 reference. A separate test binary, because forcing
//! the portable path is process-wide.

mod common;

use longctx_kernels::attention::{force_portable, AttnShape};

#[test]
fn portable_path_matches_reference() {
    force_portable(true);
    let shape = AttnShape { batch: 2, q_heads: 4, kv_heads: 2, q_len: 150, kv_len: 170, head_dim: 40 };
    common::matches_reference("portable", shape, 20, 60, Some(90), 1);
}
