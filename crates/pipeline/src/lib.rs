//! The reference composition: a frame source, the ISP, the GPU vision encoder and connector, and
//! the NPU decoder, held as trait objects and overlapped on timelines.
//!
//! What is here:
//! - [`model`]: GGUF and Hugging Face safetensors loaders (mmapped, validated as untrusted
//!   input) behind [`model::TensorSource`], and the tokenizer with its chat templates.
//! - [`decoder`]: the LLaMA-family decoder over npu-hal with per-class weight policies;
//!   [`mxcache`] saves converted weights; [`llm`] holds generation, llama.cpp-method perplexity
//!   and llama-bench-style measurement; [`speculative`] drafts tokens (n-gram lookup or a
//!   smaller model) for one-batch verification; [`quantize`] converts a model offline (calibrated
//!   GPTQ, block rotations) into a GGUF file of MX matrices.
//! - [`vision`] (CPU) and [`vision_gpu`] (WGSL through wgpu): the SigLIP tower and the SmolVLM
//!   connector.
//! - [`chain`]: the stage traits ([`chain::IspStage`], [`chain::EncoderStage`],
//!   [`chain::DecoderStage`], with isp-v4l2's `FrameSource`), their CPU and GPU implementations,
//!   and [`chain::run`], which overlaps them on timeline-driven rings of unified buffers and
//!   reports per-stage latency, drops, tokens/s, copies and a Chrome trace.
//! - [`grammar`]: grammar-constrained sampling on llguidance (a regular expression, a JSON
//!   schema or a Lark grammar).
//! - The `pipeline` binary: `run`, `isp`, `generate`, `perplexity`, `bench`, `quantize`, `encode`,
//!   `devices`.
//!
//! # Design
//! - Stages run ahead on their own workers, connected by rings of unified buffers; handoffs are
//!   timeline values submitted ahead of time.
//! - Every unavoidable copy goes through uvm-alloc's ledger and shows in the run's report.
//!
//! # Unsafe
//! Denied at the root; the exceptions are the `mmap` of a model file in [`model`] and of the
//! weight cache in [`mxcache`], whose `SAFETY` notes state the limitation they accept, the
//! GPU stages' imports of ring buffers and frames (`uvm_alloc::vulkan::import_wgpu_buffer`,
//! whose CPU-guard contract the ring's hand-offs keep), the staged completion signal in
//! [`chain::GpuContext`], and the token that enables wgpu's experimental cooperative matrices in
//! [`vision_gpu::device_descriptor`].

#![deny(unsafe_code)]

#[cfg(feature = "vision")]
pub mod chain;
pub mod decoder;
pub mod grammar;
pub mod llm;
pub mod model;
pub mod mxcache;
pub mod npy;
pub mod quantize;
pub mod speculative;
#[cfg(feature = "vision")]
pub mod vision;
#[cfg(feature = "vision")]
#[allow(unsafe_code)]
pub mod vision_gpu;

/// The README's example, compiled as a doctest so it cannot rot (`no_run`: it needs the model).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
