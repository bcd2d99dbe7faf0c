//! The fused chunked cross-entropy on every backend present (`test_device!`): the conformance suite's family (the loss,
//! its sum and the valid count, `dhidden` and `dweight` against f64 loops for every chunk size including one chunk,
//! ignored targets by `-100` or by an id inside the vocabulary, given denominators, `GradMode::Accumulate`, `f32` and
//! `bf16` with `dweight` in either; the logits themselves through an identity projection up to a saturated softmax;
//! what an ignored token may not change).

#[macro_use]
mod common;

use common::Device;
use longctx_kernels::testing::conformance::Family;

fn cross_entropy(dev: &Device) {
    dev.conformance(&[Family::CrossEntropy]);
}

test_device!(cross_entropy);
