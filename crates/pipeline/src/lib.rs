//! The reference composition: a frame source, the ISP, the GPU vision encoder and connector, and
//! the NPU decoder, held as trait objects and overlapped on timelines.
//!
//! Its stages and model loaders arrive with issues #6, #8 and #9, so the library exports nothing
//! yet. The `pipeline` binary has its first subcommand, `isp` (one frame of any source through
//! the ISP, written as 8-bit RGB); its tests also prove that CI drives a real Vulkan driver.
//!
//! # Design
//! - Stages run ahead on their own workers, connected by rings of unified buffers; handoffs are
//!   timeline values submitted ahead of time.
//! - Every unavoidable copy goes through uvm-alloc's ledger and shows in the run's report.

#![forbid(unsafe_code)]
