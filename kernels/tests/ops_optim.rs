//! AdamW on every backend present (`test_device!`): the conformance suite's family (a few steps on `f32` master
//! weights from `f32` or `bf16` gradients against PyTorch's update in f64, with and without the rounded copy, which
//! must be the master weights rounded bit for bit). Gradient clipping is in `backend.rs`'s utilities.

#[macro_use]
mod common;

use common::Device;
use longctx_kernels::testing::conformance::Family;

fn adamw(dev: &Device) {
    dev.conformance(&[Family::Adamw]);
}

test_device!(adamw);
