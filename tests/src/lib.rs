//! Cross-crate integration and property tests of longctx live in `tests/tests/`; this library is empty.
