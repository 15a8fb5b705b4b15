//! The comparison run behind `cargo xtask bench`.
fn main() {}
