//! Token embeddings on every backend present (`test_device!`): the conformance suite's family (the lookup bit for
//! bit; the scatter-add backward with many repeated ids and no ids at all, per `GradMode`, into a gradient of
//! `f32` or the table's type, against f64 sums).

#[macro_use]
mod common;

use common::Device;
use longctx_kernels::testing::conformance::Family;

fn embedding(dev: &Device) {
    dev.conformance(&[Family::Embedding]);
}

test_device!(embedding);
