//! The reference composition: a frame source, the ISP, the GPU vision encoder and connector, and
//! the NPU decoder, held as trait objects and overlapped on timelines.
//!
//! What is here:
//! - [`model`]: GGUF and Hugging Face safetensors loaders (mmapped, validated as untrusted
//!   input) behind [`model::TensorSource`], and the tokenizer with its chat templates.
//! - [`decoder`]: the LLaMA-family decoder over npu-hal with per-class weight policies;
//!   [`mxcache`] saves converted weights; [`llm`] holds generation, llama.cpp-method perplexity
//!   and llama-bench-style measurement.
//! - [`vision`] (CPU) and [`vision_gpu`] (WGSL through wgpu): the SigLIP tower and the SmolVLM
//!   connector.
//! - The `pipeline` binary: `isp`, `generate`, `perplexity`, `bench`, `encode`, `devices`.
//!
//! Still to come (issue #9): the stage traits, the composed `run` with its timelines, stats and
//! traces.
//!
//! # Design
//! - Stages run ahead on their own workers, connected by rings of unified buffers; handoffs are
//!   timeline values submitted ahead of time.
//! - Every unavoidable copy goes through uvm-alloc's ledger and shows in the run's report.
//!
//! # Unsafe
//! Denied at the root; the exceptions are the `mmap` of a model file in [`model`] and of the
//! weight cache in [`mxcache`], whose `SAFETY` notes state the limitation they accept.

#![deny(unsafe_code)]

pub mod decoder;
pub mod llm;
pub mod model;
pub mod mxcache;
pub mod vision;
pub mod vision_gpu;
