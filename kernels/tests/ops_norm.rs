//! RMSNorm and LayerNorm on every backend present (`test_device!`): the conformance suite's family (forward with its
//! saved `rstd` and `mean`, backward with `dweight`/`dbias` per `GradMode` in `f32` or the inputs' type, against f64
//! loops whose own gradients are checked by finite differences in the suite's unit tests; many row blocks).

#[macro_use]
mod common;

use common::Device;
use longctx_kernels::testing::conformance::Family;

fn norm(dev: &Device) {
    dev.conformance(&[Family::Norm]);
}

test_device!(norm);
