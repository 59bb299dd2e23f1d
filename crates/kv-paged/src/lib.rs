//! PagedAttention's memory manager for a decoder's KV cache: fixed-size token blocks carved from
//! one unified buffer, per-sequence block tables, copy-on-write forks, prefix caching, quantized
//! pages, pruning policies and paged attention kernels.
//!
//! Its contents arrive with issue #5; this crate exports nothing yet.
//!
//! # Design
//! - One uvm-alloc buffer holds every block, each aligned to 128 B, so an accelerator maps the
//!   whole cache once and a block table is all a kernel needs.
//! - Allocation and free are O(1); blocks are refcounted so forks share until written.

#![forbid(unsafe_code)]
