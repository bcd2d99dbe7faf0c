// Element types, conversions and reductions shared by every kernel (see sources.rs).
