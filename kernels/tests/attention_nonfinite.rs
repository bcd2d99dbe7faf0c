//! Attention's NaN confinement on every backend present (`test_device!`): the conformance suite's family, which
//! places a NaN or an infinity in `Q`, `K`, `V` or `dO` of drawn cases (any mask, either dtype) and requires every
//! row that cannot see it to be bit-identical to a clean run on the same backend, and the rows that see a NaN to
//! show one; plus the reported cases (a NaN in one document, a NaN query row and the keys after it).

#[macro_use]
mod common;

use common::Device;
use longctx_kernels::testing::conformance::Family;

fn nonfinite(dev: &Device) {
    dev.conformance(&[Family::NonFinite]);
}

test_device!(nonfinite);
