// Inline-PTX wrappers (see sources.rs).
