//! The reference composition: a frame source, the ISP, the GPU vision encoder and connector, and
//! the NPU decoder, held as trait objects and overlapped on timelines.
//!
//! Its stages, model loaders and the `pipeline` binary arrive with issues #6, #8 and #9; this
//! crate exports nothing yet. Its tests already prove that CI drives a real Vulkan driver.
//!
//! # Design
//! - Stages run ahead on their own workers, connected by rings of unified buffers; handoffs are
//!   timeline values submitted ahead of time.
//! - Every unavoidable copy goes through uvm-alloc's ledger and shows in the run's report.

#![forbid(unsafe_code)]
