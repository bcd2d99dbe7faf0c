//! Mixture-of-experts routing and dispatch on every backend present (`test_device!`): the conformance suite's family
//! (the router's softmax, top-k, renormalised weights, counts and probability sums and its backward with and
//! without the auxiliary gradient; dispatch, its backward, the weighted combine and its backward, against f64
//! loops; ties to the lower expert; a token's routing and combine independent of the other tokens of the call).

#[macro_use]
mod common;

use common::Device;
use longctx_kernels::testing::conformance::Family;

fn moe(dev: &Device) {
    dev.conformance(&[Family::Moe]);
}

test_device!(moe);
