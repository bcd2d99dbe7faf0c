//! The `longctx` command.
fn main() {}
