//! One integration-test binary for the testkit: a CI-sized run of seeds that must find no
//! violation, and one test per invariant showing the checker catches a planted bug.

mod planted;
mod seeds;
