//! The reference composition: a frame source, the ISP, the GPU vision encoder and connector, and
//! the NPU decoder, held as trait objects and overlapped on timelines.
//!
//! Its stages arrive with issues #6, #8 and #9. The library so far exports [`model`]: the
//! model-file loaders (GGUF and Hugging Face safetensors, mmapped and validated as untrusted
//! input), the [`model::TensorSource`] trait the decoder reads weights through, and the tokenizer
//! with its chat templates. The `pipeline` binary has its first subcommand, `isp` (one frame of
//! any source through the ISP, written as 8-bit RGB); its tests also prove that CI drives a real
//! Vulkan driver.
//!
//! # Design
//! - Stages run ahead on their own workers, connected by rings of unified buffers; handoffs are
//!   timeline values submitted ahead of time.
//! - Every unavoidable copy goes through uvm-alloc's ledger and shows in the run's report.
//!
//! # Unsafe
//! Denied at the root; the one exception is the `mmap` of a model file in [`model`], whose
//! `SAFETY` note states the limitation it accepts.

#![deny(unsafe_code)]

pub mod decoder;
pub mod llm;
pub mod model;
pub mod mxcache;
pub mod vision;
pub mod vision_gpu;
