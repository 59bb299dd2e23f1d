//! V4L2 capture (feature `v4l2`): enumerate cameras and their formats, negotiate a layout the
//! ISP reads, and stream with MMAP buffers exported as dma-bufs (`VIDIOC_EXPBUF`) and wrapped as
//! uvm-alloc buffers, so a frame is read where the camera's DMA wrote it.
//!
//! Discovery and negotiation go through the `v4l` crate's safe API; the streaming ioctls
//! (`REQBUFS`, `QUERYBUF`, `EXPBUF`, `QBUF`, `DQBUF`, `STREAMON/OFF`) are issued directly with its
//! generated bindings, one small function each, because the crate's own streams own their
//! buffers and cannot export them.
//!
//! Invariants:
//! - A buffer is handed to the driver (`QBUF`) only when no frame refers to it any more (its
//!   `Arc` is unique), so the camera never writes into memory a consumer is still reading. A
//!   consumer that holds every buffer makes the driver drop frames; the drops show as sequence
//!   gaps and are counted ([`V4l2Source::dropped`]), never hidden.
//! - Every wait for a frame has a timeout, and a device that disappears (`ENODEV`, `POLLERR`) is an
//!   error from [`FrameSource::next_frame`], not a hang.
//! - Answers from the driver are untrusted: the negotiated layout must be one the ISP reads
//!   without padding, buffer indices and `bytesused` are checked before a frame is built.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sync_timeline::{CpuTimeline, Timeline};
use uvm_alloc::UnifiedBuffer;
use v4l::FourCC;
use v4l::v4l_sys::{v4l2_buffer, v4l2_exportbuffer, v4l2_requestbuffers};
use v4l::v4l2::vidioc;
use v4l::video::Capture;

use crate::Error;
use crate::format::{FrameDesc, PixelFormat};
use crate::source::{Frame, FrameSource};

/// `V4L2_BUF_TYPE_VIDEO_CAPTURE`.
const CAPTURE: u32 = 1;
/// `V4L2_MEMORY_MMAP`.
const MEMORY_MMAP: u32 = 1;

/// The formats the ISP reads, in order of preference (fewest bytes per pixel first).
pub const PREFERRED: [(&[u8; 4], PixelFormat); 4] = [
    (b"NV12", PixelFormat::Nv12),
    (b"YUYV", PixelFormat::Yuyv),
    (b"YU12", PixelFormat::I420),
    (b"RGB3", PixelFormat::Rgb24),
];

/// One camera as discovery sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CameraInfo {
    pub path: PathBuf,
    pub driver: String,
    pub card: String,
    pub bus: String,
    /// The device can capture video and stream (`V4L2_CAP_VIDEO_CAPTURE | V4L2_CAP_STREAMING`).
    pub can_stream: bool,
    pub formats: Vec<CameraFormat>,
}

/// One pixel format a camera offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CameraFormat {
    pub fourcc: String,
    pub description: String,
    /// The ISP layout it maps to; `None` for formats listed but not read (MJPEG: no decoder yet).
    pub isp_format: Option<PixelFormat>,
    /// Discrete sizes, or the bounds of a stepwise range (min, max).
    pub sizes: Vec<(u32, u32)>,
}

fn io_err(what: impl Into<String>, e: std::io::Error) -> Error {
    Error::Io {
        what: what.into(),
        error: e.to_string(),
    }
}

/// Lists `/dev/video*` nodes with their capabilities and formats; a node that cannot be queried
/// is an `Err` entry naming it.
pub fn list_cameras() -> Vec<Result<CameraInfo, Error>> {
    let mut nodes: Vec<PathBuf> = v4l::context::enum_devices()
        .into_iter()
        .map(|n| n.path().to_path_buf())
        .collect();
    nodes.sort();
    nodes.into_iter().map(|p| describe(&p)).collect()
}

/// Capabilities and formats of one node.
pub fn describe(path: &Path) -> Result<CameraInfo, Error> {
    let dev =
        v4l::Device::with_path(path).map_err(|e| io_err(format!("open {}", path.display()), e))?;
    let caps = dev
        .query_caps()
        .map_err(|e| io_err(format!("VIDIOC_QUERYCAP on {}", path.display()), e))?;
    let can_stream = caps
        .capabilities
        .contains(v4l::capability::Flags::VIDEO_CAPTURE | v4l::capability::Flags::STREAMING);
    let mut formats = Vec::new();
    if can_stream {
        for f in dev
            .enum_formats()
            .map_err(|e| io_err(format!("VIDIOC_ENUM_FMT on {}", path.display()), e))?
        {
            let sizes = dev
                .enum_framesizes(f.fourcc)
                .unwrap_or_default()
                .into_iter()
                .flat_map(|s| match s.size {
                    v4l::framesize::FrameSizeEnum::Discrete(d) => vec![(d.width, d.height)],
                    v4l::framesize::FrameSizeEnum::Stepwise(s) => {
                        vec![(s.min_width, s.min_height), (s.max_width, s.max_height)]
                    }
                })
                .collect();
            formats.push(CameraFormat {
                fourcc: f.fourcc.str().unwrap_or("????").to_string(),
                description: f.description.clone(),
                isp_format: isp_format(f.fourcc),
                sizes,
            });
        }
    }
    Ok(CameraInfo {
        path: path.to_path_buf(),
        driver: caps.driver,
        card: caps.card,
        bus: caps.bus,
        can_stream,
        formats,
    })
}

fn isp_format(fourcc: FourCC) -> Option<PixelFormat> {
    PREFERRED
        .iter()
        .find(|(code, _)| fourcc.repr == **code)
        .map(|&(_, f)| f)
}

/// What to ask a camera for.
#[derive(Clone, Debug, PartialEq)]
pub struct V4l2Config {
    pub width: u32,
    pub height: u32,
    /// Frames per second to request (the driver may pick the nearest it supports).
    pub fps: Option<u32>,
    /// Driver buffers (at least 2).
    pub buffers: u32,
    /// How long [`FrameSource::next_frame`] waits for a frame before failing.
    pub timeout: Duration,
}

impl Default for V4l2Config {
    fn default() -> Self {
        V4l2Config {
            width: 1920,
            height: 1080,
            fps: Some(30),
            buffers: 4,
            timeout: Duration::from_secs(2),
        }
    }
}

/// One driver buffer, exported and mapped.
#[derive(Debug)]
struct Slot {
    buffer: Arc<UnifiedBuffer>,
    queued: bool,
}

/// A streaming V4L2 capture source.
pub struct V4l2Source {
    dev: v4l::Device,
    path: PathBuf,
    desc: FrameDesc,
    rate: Option<f64>,
    slots: Vec<Slot>,
    timeline: Arc<CpuTimeline>,
    timeout: Duration,
    first_sequence: Option<u32>,
    last_sequence: Option<u32>,
    first_timestamp: Option<Duration>,
    dropped: u64,
    delivered: u64,
}

impl std::fmt::Debug for V4l2Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("V4l2Source")
            .field("path", &self.path)
            .field("desc", &self.desc)
            .field("buffers", &self.slots.len())
            .field("dropped", &self.dropped)
            .finish_non_exhaustive()
    }
}

impl V4l2Source {
    /// Opens `path`, negotiates the first of [`PREFERRED`] the camera offers at the requested
    /// size, exports its buffers and starts streaming.
    pub fn open(path: &Path, config: &V4l2Config) -> Result<V4l2Source, Error> {
        let info = describe(path)?;
        if !info.can_stream {
            return Err(Error::BadFrame {
                what: format!(
                    "{} ({}) cannot stream video capture",
                    path.display(),
                    info.card
                ),
            });
        }
        let dev = v4l::Device::with_path(path)
            .map_err(|e| io_err(format!("open {}", path.display()), e))?;
        let offered: Vec<FourCC> = info
            .formats
            .iter()
            .filter_map(|f| f.fourcc.as_bytes().try_into().ok().map(FourCC::new))
            .collect();
        let Some(&(code, pixel)) = PREFERRED
            .iter()
            .find(|(code, _)| offered.iter().any(|f| f.repr == **code))
        else {
            return Err(Error::BadFrame {
                what: format!(
                    "{} offers {:?}; the ISP reads NV12, YUYV, YU12 or RGB3 (MJPEG needs a decoder, not built yet)",
                    path.display(),
                    info.formats
                        .iter()
                        .map(|f| f.fourcc.as_str())
                        .collect::<Vec<_>>()
                ),
            });
        };
        let want = v4l::Format::new(config.width, config.height, FourCC::new(code));
        let got = dev
            .set_format(&want)
            .map_err(|e| io_err(format!("VIDIOC_S_FMT on {}", path.display()), e))?;
        if got.fourcc.repr != *code {
            return Err(Error::BadFrame {
                what: format!(
                    "{} accepted {:?} but switched to {}",
                    path.display(),
                    code,
                    got.fourcc
                ),
            });
        }
        let desc = FrameDesc::new(got.width as usize, got.height as usize, pixel)?;
        let packed_stride = desc.planes()[0].stride;
        if got.stride as usize != packed_stride {
            return Err(Error::BadFrame {
                what: format!(
                    "{} pads rows ({} bytes per line for {} pixels of {:?}); padded layouts are not read yet",
                    path.display(),
                    got.stride,
                    got.width,
                    pixel
                ),
            });
        }
        if (got.size as usize) < desc.byte_len() {
            return Err(Error::BadFrame {
                what: format!(
                    "{} reports {} bytes per image, the layout needs {}",
                    path.display(),
                    got.size,
                    desc.byte_len()
                ),
            });
        }
        let mut rate = None;
        if let Some(fps) = config.fps.filter(|&f| f > 0) {
            let params = v4l::video::capture::Parameters::with_fps(fps);
            if let Ok(p) = dev.set_params(&params) {
                let (n, d) = (p.interval.numerator, p.interval.denominator);
                rate = (n > 0).then(|| f64::from(d) / f64::from(n));
            }
        }
        let mut source = V4l2Source {
            dev,
            path: path.to_path_buf(),
            desc,
            rate,
            slots: Vec::new(),
            timeline: Arc::new(CpuTimeline::new(0)),
            timeout: config.timeout,
            first_sequence: None,
            last_sequence: None,
            first_timestamp: None,
            dropped: 0,
            delivered: 0,
        };
        source.start(config.buffers.max(2))?;
        Ok(source)
    }

    /// Frames the driver dropped so far (sequence gaps).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The device node.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn fd(&self) -> std::os::raw::c_int {
        self.dev.handle().fd()
    }

    fn start(&mut self, count: u32) -> Result<(), Error> {
        let fd = self.fd();
        let mut req = v4l2_requestbuffers {
            count,
            type_: CAPTURE,
            memory: MEMORY_MMAP,
            // SAFETY: an all-zero v4l2_requestbuffers is valid (plain integers and padding).
            ..unsafe { std::mem::zeroed() }
        };
        // SAFETY: VIDIOC_REQBUFS takes a v4l2_requestbuffers, which `req` is, live for the call.
        unsafe { v4l::v4l2::ioctl(fd, vidioc::VIDIOC_REQBUFS, (&raw mut req).cast()) }
            .map_err(|e| io_err("VIDIOC_REQBUFS", e))?;
        if req.count < 2 {
            return Err(Error::BadFrame {
                what: format!(
                    "{} granted {} buffers; streaming needs 2",
                    self.path.display(),
                    req.count
                ),
            });
        }
        for index in 0..req.count {
            let mut buf = v4l2_buffer {
                index,
                type_: CAPTURE,
                memory: MEMORY_MMAP,
                // SAFETY: an all-zero v4l2_buffer is valid (integers, a union of integers and
                // pointers left null, padding).
                ..unsafe { std::mem::zeroed() }
            };
            // SAFETY: VIDIOC_QUERYBUF takes a v4l2_buffer, which `buf` is, live for the call.
            unsafe { v4l::v4l2::ioctl(fd, vidioc::VIDIOC_QUERYBUF, (&raw mut buf).cast()) }
                .map_err(|e| io_err("VIDIOC_QUERYBUF", e))?;
            let len = buf.length as usize;
            if len < self.desc.byte_len() {
                return Err(Error::BadFrame {
                    what: format!(
                        "driver buffer {index} holds {len} bytes, a frame needs {}",
                        self.desc.byte_len()
                    ),
                });
            }
            let mut exp = v4l2_exportbuffer {
                type_: CAPTURE,
                index,
                flags: (libc_flags::O_RDWR | libc_flags::O_CLOEXEC) as u32,
                // SAFETY: an all-zero v4l2_exportbuffer is valid (plain integers).
                ..unsafe { std::mem::zeroed() }
            };
            // SAFETY: VIDIOC_EXPBUF takes a v4l2_exportbuffer, which `exp` is, live for the call.
            unsafe { v4l::v4l2::ioctl(fd, vidioc::VIDIOC_EXPBUF, (&raw mut exp).cast()) }.map_err(
                |e| io_err("VIDIOC_EXPBUF (exporting a capture buffer as a dma-buf)", e),
            )?;
            if exp.fd < 0 {
                return Err(Error::BadFrame {
                    what: format!("VIDIOC_EXPBUF returned fd {}", exp.fd),
                });
            }
            // SAFETY: on success the kernel returned a new dma-buf fd that nothing else owns.
            let owned = unsafe { OwnedFd::from_raw_fd(exp.fd) };
            let buffer =
                UnifiedBuffer::import_dma_buf(owned, len, "v4l2").map_err(Error::Memory)?;
            self.slots.push(Slot {
                buffer: Arc::new(buffer),
                queued: false,
            });
        }
        for i in 0..self.slots.len() {
            self.queue(i)?;
        }
        let mut ty = CAPTURE;
        // SAFETY: VIDIOC_STREAMON takes a pointer to the buffer type (an int).
        unsafe { v4l::v4l2::ioctl(fd, vidioc::VIDIOC_STREAMON, (&raw mut ty).cast()) }
            .map_err(|e| io_err("VIDIOC_STREAMON", e))?;
        Ok(())
    }

    fn queue(&mut self, index: usize) -> Result<(), Error> {
        let mut buf = v4l2_buffer {
            index: index as u32,
            type_: CAPTURE,
            memory: MEMORY_MMAP,
            // SAFETY: an all-zero v4l2_buffer is valid (see `start`).
            ..unsafe { std::mem::zeroed() }
        };
        // SAFETY: VIDIOC_QBUF takes a v4l2_buffer, which `buf` is, live for the call.
        unsafe { v4l::v4l2::ioctl(self.fd(), vidioc::VIDIOC_QBUF, (&raw mut buf).cast()) }
            .map_err(|e| io_err("VIDIOC_QBUF", e))?;
        self.slots[index].queued = true;
        Ok(())
    }
}

/// The open(2) flags VIDIOC_EXPBUF takes for the new fd.
mod libc_flags {
    pub(super) const O_RDWR: i32 = 0o2;
    pub(super) const O_CLOEXEC: i32 = 0o2000000;
}

impl FrameSource for V4l2Source {
    fn desc(&self) -> FrameDesc {
        self.desc
    }

    fn rate(&self) -> Option<f64> {
        self.rate
    }

    fn timeline(&self) -> Arc<dyn Timeline> {
        self.timeline.clone()
    }

    fn next_frame(&mut self) -> Result<Option<Frame>, Error> {
        // Give back every buffer no frame refers to any more.
        for i in 0..self.slots.len() {
            if !self.slots[i].queued && Arc::strong_count(&self.slots[i].buffer) == 1 {
                self.queue(i)?;
            }
        }
        if !self.slots.iter().any(|s| s.queued) {
            return Err(Error::BadFrame {
                what: "every capture buffer is still held by a frame: drop frames (or ask for more --buffers) before asking for the next".into(),
            });
        }
        let timeout_ms = i32::try_from(self.timeout.as_millis()).unwrap_or(i32::MAX);
        let ready = self
            .dev
            .handle()
            .poll(0x001 /* POLLIN */, timeout_ms)
            .map_err(|e| io_err(format!("poll {}", self.path.display()), e))?;
        if ready == 0 {
            return Err(Error::Io {
                what: format!("waiting for a frame from {}", self.path.display()),
                error: format!(
                    "no frame within {:?} (is the camera still there?)",
                    self.timeout
                ),
            });
        }
        let mut buf = v4l2_buffer {
            type_: CAPTURE,
            memory: MEMORY_MMAP,
            // SAFETY: an all-zero v4l2_buffer is valid (see `start`).
            ..unsafe { std::mem::zeroed() }
        };
        // SAFETY: VIDIOC_DQBUF takes a v4l2_buffer, which `buf` is, live for the call.
        unsafe { v4l::v4l2::ioctl(self.fd(), vidioc::VIDIOC_DQBUF, (&raw mut buf).cast()) }
            .map_err(|e| {
                io_err(
                    format!("VIDIOC_DQBUF on {} (device gone?)", self.path.display()),
                    e,
                )
            })?;
        let index = buf.index as usize;
        let Some(slot) = self.slots.get_mut(index) else {
            return Err(Error::BadFrame {
                what: format!("the driver returned buffer {index} of {}", self.slots.len()),
            });
        };
        slot.queued = false;
        if (buf.bytesused as usize) < self.desc.byte_len() {
            // A short frame (a driver error flag, a truncated transfer): count it as dropped.
            self.dropped += 1;
            return self.next_frame();
        }
        if let Some(last) = self.last_sequence {
            self.dropped += u64::from(buf.sequence.wrapping_sub(last).saturating_sub(1));
        }
        self.last_sequence = Some(buf.sequence);
        let first_seq = *self.first_sequence.get_or_insert(buf.sequence);
        let stamp = Duration::new(
            u64::try_from(buf.timestamp.tv_sec).unwrap_or(0),
            u32::try_from(buf.timestamp.tv_usec)
                .unwrap_or(0)
                .min(999_999)
                * 1000,
        );
        let first = *self.first_timestamp.get_or_insert(stamp);
        self.delivered += 1;
        let ready = self.delivered;
        self.timeline.signal(ready).map_err(Error::Timeline)?;
        Ok(Some(Frame {
            buffer: Arc::clone(&self.slots[index].buffer),
            desc: self.desc,
            timestamp: stamp.saturating_sub(first),
            sequence: u64::from(buf.sequence.wrapping_sub(first_seq)),
            ready,
        }))
    }
}

impl Drop for V4l2Source {
    fn drop(&mut self) {
        let mut ty = CAPTURE;
        // SAFETY: VIDIOC_STREAMOFF takes a pointer to the buffer type (an int). Failure (the
        // device is gone) leaves nothing to stop.
        let _ =
            unsafe { v4l::v4l2::ioctl(self.fd(), vidioc::VIDIOC_STREAMOFF, (&raw mut ty).cast()) };
        // The exported dma-bufs unmap and close as the slots drop (frames still held keep theirs
        // alive; the kernel keeps the memory until the last reference goes).
        self.slots.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs where a camera exists (`cargo xtask device-test`); elsewhere it is ignored, never a
    /// pass.
    #[test]
    #[ignore = "hardware: needs a V4L2 capture device (/dev/video*) offering NV12, YUYV, YU12 or RGB3"]
    fn a_camera_streams_frames_into_exported_dma_bufs() {
        let cams: Vec<CameraInfo> = list_cameras().into_iter().filter_map(Result::ok).collect();
        let cam = cams
            .iter()
            .find(|c| c.can_stream && c.formats.iter().any(|f| f.isp_format.is_some()))
            .expect("a streaming camera with a format the ISP reads");
        let mut src = V4l2Source::open(
            &cam.path,
            &V4l2Config {
                width: 640,
                height: 480,
                ..V4l2Config::default()
            },
        )
        .unwrap();
        let mut last = None;
        for _ in 0..10 {
            let f = src.next_frame().unwrap().unwrap();
            assert!(f.buffer.is_dma_buf());
            assert_eq!(src.timeline().value().unwrap(), f.ready);
            if let Some(prev) = last {
                assert!(f.sequence > prev);
            }
            last = Some(f.sequence);
            let g = f
                .buffer
                .cpu_access(0..f.desc.byte_len(), uvm_alloc::Access::Read)
                .unwrap();
            assert_eq!(g.bytes().len(), f.desc.byte_len());
        }
    }

    #[test]
    fn every_preferred_format_maps_to_an_isp_layout() {
        for (code, pixel) in PREFERRED {
            assert_eq!(isp_format(FourCC::new(code)), Some(pixel));
        }
        assert_eq!(isp_format(FourCC::new(b"MJPG")), None);
    }
}
