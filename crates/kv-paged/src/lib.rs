//! PagedAttention's memory manager for a decoder's KV cache: fixed-size token blocks carved from
//! one unified buffer, per-sequence block tables, copy-on-write forks, prefix caching, quantized
//! pages, pruning policies and paged attention kernels.
//!
//! # What is here
//! - [`BlockManager`]: the allocator, refcounts, copy-on-write forks, block tables, the prefix
//!   cache with LRU eviction, truncation (speculative decoding's rollback), out-of-blocks
//!   errors with a preemption hook, and accounting.
//! - [`KvCache`]: the pages of every block in one uvm-alloc buffer, in f32, f16, bf16, MXFP8 or
//!   MXFP4 ([`PageDtype`]); copy-on-write copies go through uvm-alloc's copy ledger.
//! - [`attention`]: paged decode (GQA, threads over query heads) and causal prefill on the CPU,
//!   and the contiguous baseline.
//! - [`prune`]: StreamingLLM sinks + window, page-level heavy hitters (H2O) and per-layer
//!   attention-entropy pruning, behind one trait, each reporting what it dropped.
//!
//! # Design
//! - Every block is in exactly one state: free, used (refcounted by sequence tables) or cached
//!   (unreferenced, full, hashed with its parent's hash, evicted LRU). Allocate and free are O(1).
//! - The manager is storage-agnostic and reports copy-on-write copies for the caller to perform
//!   (or for the storage layer, which counts them in uvm-alloc's copy ledger).
//! - Block ids are handed out lowest first, so a scripted workload gives the same tables on
//!   every run (the goldens rely on it).
//!
//! # Invariants
//! - A block's refcount equals the number of sequence tables that hold it
//!   ([`BlockManager::check_invariants`] verifies this and the state partition).

#![forbid(unsafe_code)]
#![allow(clippy::too_many_arguments)]

pub mod attention;
mod cache;
mod pool;
pub mod prune;

/// The README's example, compiled and run as a doctest so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;

pub use cache::{KvCache, KvLayout, PageDtype};
pub use pool::{
    Accounting, Appended, BlockCopy, BlockId, BlockManager, Preempt, PreemptNewest, Preempted,
    SeqId, Slot, block_hash,
};

/// Why a cache operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Not enough blocks: free (including evictable cached) blocks fall short.
    #[error(
        "out of KV blocks: {requested} needed, {free} available of {total}; free or preempt a sequence"
    )]
    OutOfBlocks {
        requested: usize,
        free: usize,
        total: usize,
    },
    /// A sequence id that is not present.
    #[error("sequence {seq} does not exist")]
    UnknownSequence { seq: u64 },
    /// A sequence id that is already present.
    #[error("sequence {seq} already exists")]
    SequenceExists { seq: u64 },
    /// A truncation to more tokens than the sequence holds.
    #[error("sequence {seq} holds {have} tokens; it cannot be truncated to {len}")]
    TruncatePastEnd { seq: u64, len: usize, have: usize },
    /// A logical block index past the sequence's full blocks.
    #[error("sequence {seq} has {full_blocks} full blocks; block {logical} cannot be dropped")]
    BlockOutOfRange {
        seq: u64,
        logical: usize,
        full_blocks: usize,
    },
    /// A configuration value is out of range.
    #[error("bad configuration: {what}")]
    BadConfig { what: &'static str },
    /// The unified buffer behind the pages refused.
    #[error("KV storage: {0}")]
    Memory(uvm_alloc::Error),
    /// An MX page could not be (de)quantized.
    #[error("KV page quantization: {0}")]
    Quant(mx_quant::Error),
}
