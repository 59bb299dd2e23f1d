//! Frames in, model input out: V4L2 capture into unified buffers, Y4M/image/pattern sources, and
//! an ISP that converts, resizes and normalises a camera frame straight into the encoder's input
//! tensor in one fused pass.
//!
//! # What is here
//! - [`FrameDesc`]/[`PixelFormat`]: NV12, I420, YUYV, 4:2:2 and 4:4:4 planar, RGB24 layouts,
//!   validated (zero sizes, odd sizes for subsampled formats, overflow) before any byte is read.
//! - [`FrameSource`] (object-safe) with [`PatternSource`] (a moving test pattern at any size and
//!   rate) and [`Y4mSource`] (8-bit 4:2:0/4:2:2/4:4:4 through the `y4m` crate); real-time or
//!   as-fast-as-possible pacing; each frame signals its source's timeline when ready.
//! - [`isp`]: the CPU reference of the fused pass (YUV -> RGB with BT.601/BT.709, limited or
//!   full range, crop, swscale's bilinear or area resize, mean/std normalisation, f32/f16,
//!   CHW/HWC); conversions and resizes agree with ffmpeg's swscale within 1 LSB.
//!
//! - [`ImageSource`] (PNG/JPEG files and folders through the `image` crate) and
//!   [`open_source`], which parses `pattern:`/`file:`/`camera:` specs.
//!
//! - `v4l2` (feature `v4l2`): camera discovery, format negotiation and streaming with MMAP
//!   buffers exported as dma-bufs (`VIDIOC_EXPBUF`) and imported as uvm-alloc buffers; drops are
//!   counted from sequence gaps; a vanished device is an error, never a hang.
//!
//! - [`gpu`]: the same fused pass as a WGSL compute shader with its uniform block, writing f32 or
//!   f16 (packed pairs, no `SHADER_F16` needed); the crate has no GPU dependency, callers bind the
//!   frame's unified buffer as-is.
//!
//! Still to come with issue #7: explicit SIMD, `V4L2_MEMORY_DMABUF` import of uvm-alloc buffers.
//!
//! # Design
//! - One object-safe frame-source trait; each frame carries its buffer, format, timestamp,
//!   sequence number and the timeline value signalled when it is ready.
//! - Capture buffers are exported as dma-bufs (VIDIOC_EXPBUF) or imported from uvm-alloc, so the
//!   ISP reads the camera's own memory. Sources that must copy (a decoder's own buffers) count
//!   the bytes in uvm-alloc's copy ledger.
//!
//! # Features
//! - `v4l2`: V4L2 capture through the `v4l` crate. Its bindgen step needs libclang at build time
//!   (Debian/Ubuntu: `libclang1-14`, plus `linux-libc-dev` for the headers).

//! # Unsafe
//! Denied everywhere except [`v4l2`] (feature `v4l2`): the streaming ioctls issued through the
//! `v4l` crate's generated bindings (`REQBUFS`, `QUERYBUF`, `EXPBUF`, `QBUF`, `DQBUF`,
//! `STREAMON/OFF`), each on a zero-initialised struct of the type its request code names, and
//! taking ownership of the dma-buf fd `EXPBUF` returns.

#![deny(unsafe_code)]

/// The README's example, compiled and run as a doctest so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;

mod format;
pub mod gpu;
pub mod isp;
mod source;
#[cfg(feature = "v4l2")]
#[allow(unsafe_code)]
pub mod v4l2;

pub use format::{FrameDesc, PixelFormat, Plane};
pub use source::{Frame, FrameSource, ImageSource, Pacing, PatternSource, Y4mSource, open_source};

/// Why a source or the ISP refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A frame's size or layout is invalid.
    #[error("bad frame: {what}")]
    BadFrame { what: String },
    /// A format or feature this crate does not handle.
    #[error("unsupported: {what}")]
    Unsupported { what: &'static str },
    /// A malformed or truncated Y4M stream.
    #[error("Y4M: {what}")]
    Y4m { what: String },
    /// A file could not be read.
    #[error("{what}: {error}")]
    Io { what: String, error: String },
    /// The unified buffer for a frame could not be made.
    #[error("frame buffer: {0}")]
    Memory(uvm_alloc::Error),
    /// The source's timeline refused a signal.
    #[error("timeline: {0}")]
    Timeline(sync_timeline::Error),
}
