//! The processor's integration tests, in one binary: the real binary on SIGTERM against LocalStack
//! (`signals`), and the processor's pipeline on the in-memory backends (`memory`). Tests of the
//! processor together with the other services are in deploy/e2e.

mod memory;
mod signals;
