//! Linear layers on every backend present (`test_device!`): the conformance suite's family (forward and backward
//! against f64 loops, with and without bias and `dx`, `GradMode::Accumulate`, `f32`, `bf16`, and `bf16` with `f32`
//! weight gradients; every tensor possibly a few rows into its buffer, nothing written outside it; shapes past the
//! CPU's output tiles, weight gradients over 4 500 and 9 000 tokens where the limits allow).

#[macro_use]
mod common;

use common::Device;
use longctx_kernels::testing::conformance::Family;

fn linear(dev: &Device) {
    dev.conformance(&[Family::Linear]);
}

test_device!(linear);
