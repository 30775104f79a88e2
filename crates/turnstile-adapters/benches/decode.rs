//! Decode + assemble throughput (issue 4); the measured version follows in the next commit.
fn main() {}
