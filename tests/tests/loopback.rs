//! The conformance suite on the loopback transport (host memory, real copies).

use kvxfer_tests::loopback::Loopback;

kvxfer_tests::conformance_suite!(Loopback);
