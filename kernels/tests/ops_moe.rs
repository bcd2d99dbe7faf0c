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

/// A routing (host metadata every backend takes) refuses a token choosing an expert twice or one that does not
/// exist.
#[test]
fn routing_refuses_repeated_or_unknown_experts() {
    use longctx_kernels::{KernelError, Routing};
    assert!(matches!(Routing::new(vec![0, 0], 1, 3, 2), Err(KernelError::InvalidArgument { name: "choice", .. })));
    assert!(matches!(Routing::new(vec![0, 3], 1, 3, 2), Err(KernelError::InvalidArgument { name: "choice", .. })));
    assert!(matches!(Routing::new(vec![0], 1, 3, 4), Err(KernelError::InvalidArgument { name: "top_k", .. })));
    let r = Routing::new(vec![1, 2, 0, 1], 2, 3, 2).unwrap();
    assert_eq!((r.offsets(), r.row_tokens(), r.counts()), (&[0, 1, 3, 4][..], &[1, 0, 1, 0][..], vec![1, 2, 1]));
}
