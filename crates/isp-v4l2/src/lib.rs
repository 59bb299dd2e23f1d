//! Frames in, model input out: V4L2 capture into unified buffers, Y4M/image/pattern sources, and
//! an ISP that converts, resizes and normalises a camera frame straight into the encoder's input
//! tensor in one fused pass.
//!
//! Its sources and ISP operations arrive with issue #7; this crate exports nothing yet.
//!
//! # Design
//! - One object-safe frame-source trait; each frame carries its buffer, format, timestamp,
//!   sequence number and the timeline value signalled when it is ready.
//! - Capture buffers are exported as dma-bufs (VIDIOC_EXPBUF) or imported from uvm-alloc, so the
//!   ISP reads the camera's own memory.
//!
//! # Features
//! - `v4l2`: V4L2 capture through the `v4l` crate. Its bindgen step needs libclang at build time
//!   (Debian/Ubuntu: `libclang1-14`, plus `linux-libc-dev` for the headers).

#![forbid(unsafe_code)]
