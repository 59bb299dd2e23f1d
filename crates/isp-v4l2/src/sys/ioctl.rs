//! One thin function per V4L2 ioctl this crate makes, named after it, over the generated UAPI.
//!
//! Each pairs a generated request code with the struct the kernel expects for it; that pairing
//! is what makes the `rustix::ioctl` call sound, and it is stated once, here. The structs are
//! built field by field (their unions through an integer or byte-array member), so no value is
//! conjured from zeroed memory, and union members are read only where every bit pattern of the
//! member is a valid value (plain integers).
//!
//! # References
//! Linux `include/uapi/linux/videodev2.h`, `Documentation/userspace-api/media/v4l/` (the
//! `vidioc-*.rst` page of each call).

use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

use rustix::io::Result;
use rustix::ioctl::{Getter, Opcode, Setter, Updater, ioctl};

use super::uapi;

/// `V4L2_BUF_TYPE_VIDEO_CAPTURE`, the only buffer type this crate streams.
pub(crate) const CAPTURE: u32 = uapi::v4l2_buf_type_V4L2_BUF_TYPE_VIDEO_CAPTURE;

/// Which memory a capture queue streams into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Memory {
    /// The driver's own buffers (`V4L2_MEMORY_MMAP`), exported with `VIDIOC_EXPBUF`.
    Mmap,
    /// Dma-bufs the caller allocates and queues by fd (`V4L2_MEMORY_DMABUF`).
    DmaBuf,
}

impl Memory {
    fn code(self) -> u32 {
        match self {
            Memory::Mmap => uapi::v4l2_memory_V4L2_MEMORY_MMAP,
            Memory::DmaBuf => uapi::v4l2_memory_V4L2_MEMORY_DMABUF,
        }
    }
}

/// `ioctl(fd, VIDIOC_QUERYCAP, &cap)`—The driver's name, card and capability flags.
pub(crate) fn vidioc_querycap(fd: BorrowedFd<'_>) -> Result<uapi::v4l2_capability> {
    const OPCODE: Opcode = uapi::VIDIOC_QUERYCAP as Opcode;
    // SAFETY: OPCODE is VIDIOC_QUERYCAP (an _IOR), whose argument is `v4l2_capability`.
    let getter = unsafe { Getter::<OPCODE, uapi::v4l2_capability>::new() };
    // SAFETY: the getter pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, getter) }
}

/// `ioctl(fd, VIDIOC_ENUM_FMT, &desc)`—The capture format at `index`; `EINVAL` past the last.
pub(crate) fn vidioc_enum_fmt(fd: BorrowedFd<'_>, index: u32) -> Result<uapi::v4l2_fmtdesc> {
    const OPCODE: Opcode = uapi::VIDIOC_ENUM_FMT as Opcode;
    let mut desc = uapi::v4l2_fmtdesc {
        index,
        type_: CAPTURE,
        ..Default::default()
    };
    // SAFETY: OPCODE is VIDIOC_ENUM_FMT (an _IOWR), whose argument is `v4l2_fmtdesc`.
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_fmtdesc>::new(&mut desc) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }?;
    Ok(desc)
}

/// One answer of `VIDIOC_ENUM_FRAMESIZES`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FrameSize {
    Discrete {
        width: u32,
        height: u32,
    },
    /// A stepwise or continuous range: its bounds.
    Range {
        min: (u32, u32),
        max: (u32, u32),
    },
}

/// `ioctl(fd, VIDIOC_ENUM_FRAMESIZES, &size)`—The frame size at `index` for `pixel_format`;
/// `EINVAL` past the last.
pub(crate) fn vidioc_enum_framesizes(
    fd: BorrowedFd<'_>,
    pixel_format: u32,
    index: u32,
) -> Result<FrameSize> {
    const OPCODE: Opcode = uapi::VIDIOC_ENUM_FRAMESIZES as Opcode;
    let mut size = uapi::v4l2_frmsizeenum {
        index,
        pixel_format,
        type_: 0,
        __bindgen_anon_1: uapi::v4l2_frmsizeenum__bindgen_ty_1 {
            stepwise: uapi::v4l2_frmsize_stepwise::default(),
        },
        reserved: [0; 2],
    };
    // SAFETY: OPCODE is VIDIOC_ENUM_FRAMESIZES (an _IOWR), whose argument is `v4l2_frmsizeenum`.
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_frmsizeenum>::new(&mut size) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }?;
    Ok(
        if size.type_ == uapi::v4l2_frmsizetypes_V4L2_FRMSIZE_TYPE_DISCRETE {
            // SAFETY: the union was initialised whole through its larger member (stepwise) and
            // `discrete` is two plain `u32`s, so the read is of initialised integers.
            let d = unsafe { size.__bindgen_anon_1.discrete };
            FrameSize::Discrete {
                width: d.width,
                height: d.height,
            }
        } else {
            // SAFETY: as above; `stepwise` is six plain `u32`s.
            let s = unsafe { size.__bindgen_anon_1.stepwise };
            FrameSize::Range {
                min: (s.min_width, s.min_height),
                max: (s.max_width, s.max_height),
            }
        },
    )
}

/// `ioctl(fd, VIDIOC_S_FMT, &format)`—Asks for `pix` (single-planar capture); returns what the
/// driver set, which may differ.
pub(crate) fn vidioc_s_fmt(
    fd: BorrowedFd<'_>,
    pix: uapi::v4l2_pix_format,
) -> Result<uapi::v4l2_pix_format> {
    const OPCODE: Opcode = uapi::VIDIOC_S_FMT as Opcode;
    let mut format = uapi::v4l2_format {
        type_: CAPTURE,
        fmt: uapi::v4l2_format__bindgen_ty_1 { raw_data: [0; 200] },
    };
    format.fmt.pix = pix;
    // SAFETY: OPCODE is VIDIOC_S_FMT (an _IOWR), whose argument is `v4l2_format`.
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_format>::new(&mut format) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }?;
    // SAFETY: the union was initialised whole (raw_data) before `pix` was written, and
    // `v4l2_pix_format` is plain integers (its inner union too), so any bytes are a valid value.
    Ok(unsafe { format.fmt.pix })
}

/// `ioctl(fd, VIDIOC_S_PARM, &parm)`—Asks for a frame interval of `interval` (seconds as a
/// fraction); returns the interval the driver chose (`0/0` if it cannot set one).
pub(crate) fn vidioc_s_parm(
    fd: BorrowedFd<'_>,
    interval: uapi::v4l2_fract,
) -> Result<uapi::v4l2_fract> {
    const OPCODE: Opcode = uapi::VIDIOC_S_PARM as Opcode;
    let mut parm = uapi::v4l2_streamparm {
        type_: CAPTURE,
        parm: uapi::v4l2_streamparm__bindgen_ty_1 { raw_data: [0; 200] },
    };
    parm.parm.capture = uapi::v4l2_captureparm {
        timeperframe: interval,
        ..Default::default()
    };
    // SAFETY: OPCODE is VIDIOC_S_PARM (an _IOWR), whose argument is `v4l2_streamparm`.
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_streamparm>::new(&mut parm) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }?;
    // SAFETY: the union was initialised whole (raw_data) before `capture` was written, and
    // `v4l2_captureparm` is plain integers, so any bytes are a valid value.
    Ok(unsafe { parm.parm.capture }.timeperframe)
}

/// `ioctl(fd, VIDIOC_REQBUFS, &req)`—Asks for `count` buffers of `memory` (0 frees them);
/// returns how many the driver granted.
pub(crate) fn vidioc_reqbufs(fd: BorrowedFd<'_>, count: u32, memory: Memory) -> Result<u32> {
    const OPCODE: Opcode = uapi::VIDIOC_REQBUFS as Opcode;
    let mut req = uapi::v4l2_requestbuffers {
        count,
        type_: CAPTURE,
        memory: memory.code(),
        ..Default::default()
    };
    // SAFETY: OPCODE is VIDIOC_REQBUFS (an _IOWR), whose argument is `v4l2_requestbuffers`.
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_requestbuffers>::new(&mut req) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }?;
    Ok(req.count)
}

/// What this crate reads of a `v4l2_buffer` the driver filled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BufferInfo {
    pub(crate) index: u32,
    pub(crate) bytesused: u32,
    pub(crate) flags: u32,
    pub(crate) sequence: u32,
    /// `CLOCK_MONOTONIC` capture time (`tv_sec`, `tv_usec`), as the driver stamped it.
    pub(crate) timestamp: (i64, i64),
    pub(crate) length: u32,
}

/// A `v4l2_buffer` for `index`, with `m` set to `fd` for DMABUF (ignored for MMAP).
fn buffer(index: u32, memory: Memory, fd: i32, length: u32) -> uapi::v4l2_buffer {
    uapi::v4l2_buffer {
        index,
        type_: CAPTURE,
        bytesused: 0,
        flags: 0,
        field: 0,
        timestamp: uapi::timeval::default(),
        timecode: uapi::v4l2_timecode::default(),
        sequence: 0,
        memory: memory.code(),
        // `m` is 8 bytes; `userptr` (an unsigned long) covers it whole, so the kernel never sees
        // uninitialised bytes, then `fd` takes its first four for DMABUF.
        m: match memory {
            Memory::Mmap => uapi::v4l2_buffer__bindgen_ty_1 { userptr: 0 },
            Memory::DmaBuf => {
                let mut m = uapi::v4l2_buffer__bindgen_ty_1 { userptr: 0 };
                m.fd = fd;
                m
            }
        },
        length,
        reserved2: 0,
        __bindgen_anon_1: uapi::v4l2_buffer__bindgen_ty_2 { reserved: 0 },
    }
}

// `timeval`'s fields are C `long`s: i64 here, i32 on 32-bit targets, where the conversion is not
// the identity.
#[allow(clippy::useless_conversion)]
fn info(b: &uapi::v4l2_buffer) -> BufferInfo {
    BufferInfo {
        index: b.index,
        bytesused: b.bytesused,
        flags: b.flags,
        sequence: b.sequence,
        timestamp: (
            i64::from(b.timestamp.tv_sec),
            i64::from(b.timestamp.tv_usec),
        ),
        length: b.length,
    }
}

/// `ioctl(fd, VIDIOC_QUERYBUF, &buf)`—The driver's buffer `index` (its length, for MMAP).
pub(crate) fn vidioc_querybuf(
    fd: BorrowedFd<'_>,
    index: u32,
    memory: Memory,
) -> Result<BufferInfo> {
    const OPCODE: Opcode = uapi::VIDIOC_QUERYBUF as Opcode;
    let mut buf = buffer(index, memory, -1, 0);
    // SAFETY: OPCODE is VIDIOC_QUERYBUF (an _IOWR), whose argument is `v4l2_buffer`; for the
    // single-planar type it is given, the kernel follows no pointer in it.
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_buffer>::new(&mut buf) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }?;
    Ok(info(&buf))
}

/// `ioctl(fd, VIDIOC_EXPBUF, &exp)`—Exports MMAP buffer `index` as a new dma-buf.
pub(crate) fn vidioc_expbuf(fd: BorrowedFd<'_>, index: u32) -> Result<OwnedFd> {
    const OPCODE: Opcode = uapi::VIDIOC_EXPBUF as Opcode;
    let mut exp = uapi::v4l2_exportbuffer {
        type_: CAPTURE,
        index,
        flags: (rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC).bits(),
        fd: -1,
        ..Default::default()
    };
    // SAFETY: OPCODE is VIDIOC_EXPBUF (an _IOWR), whose argument is `v4l2_exportbuffer`.
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_exportbuffer>::new(&mut exp) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }?;
    if exp.fd < 0 {
        return Err(rustix::io::Errno::BADF);
    }
    // SAFETY: on success the kernel returned a new dma-buf fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(exp.fd) })
}

/// `ioctl(fd, VIDIOC_QBUF, &buf)`—Hands buffer `index` to the driver to fill; for DMABUF,
/// `dmabuf` is the dma-buf (of `length` bytes) it writes into.
pub(crate) fn vidioc_qbuf(
    fd: BorrowedFd<'_>,
    index: u32,
    memory: Memory,
    dmabuf: Option<(BorrowedFd<'_>, u32)>,
) -> Result<()> {
    use std::os::fd::AsRawFd;
    const OPCODE: Opcode = uapi::VIDIOC_QBUF as Opcode;
    let (raw, length) = dmabuf.map_or((-1, 0), |(f, len)| (f.as_raw_fd(), len));
    let mut buf = buffer(index, memory, raw, length);
    // SAFETY: OPCODE is VIDIOC_QBUF (an _IOWR), whose argument is `v4l2_buffer`; for the
    // single-planar type it is given, the kernel follows no pointer in it, and a DMABUF fd is
    // borrowed for the call (the kernel takes its own reference).
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_buffer>::new(&mut buf) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }
}

/// `ioctl(fd, VIDIOC_DQBUF, &buf)`—Takes the oldest filled buffer back; `EAGAIN` on a
/// non-blocking fd when none is ready.
pub(crate) fn vidioc_dqbuf(fd: BorrowedFd<'_>, memory: Memory) -> Result<BufferInfo> {
    const OPCODE: Opcode = uapi::VIDIOC_DQBUF as Opcode;
    let mut buf = buffer(0, memory, -1, 0);
    // SAFETY: OPCODE is VIDIOC_DQBUF (an _IOWR), whose argument is `v4l2_buffer`; for the
    // single-planar type it is given, the kernel follows no pointer in it.
    let updater = unsafe { Updater::<OPCODE, uapi::v4l2_buffer>::new(&mut buf) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, updater) }?;
    Ok(info(&buf))
}

/// `ioctl(fd, VIDIOC_STREAMON, &type)`—Starts capture.
pub(crate) fn vidioc_streamon(fd: BorrowedFd<'_>) -> Result<()> {
    const OPCODE: Opcode = uapi::VIDIOC_STREAMON as Opcode;
    // SAFETY: OPCODE is VIDIOC_STREAMON (an _IOW of int), whose argument is the buffer type.
    let setter = unsafe { Setter::<OPCODE, core::ffi::c_int>::new(CAPTURE as core::ffi::c_int) };
    // SAFETY: the setter pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, setter) }
}

/// `ioctl(fd, VIDIOC_STREAMOFF, &type)`—Stops capture and takes every buffer back from the
/// driver.
pub(crate) fn vidioc_streamoff(fd: BorrowedFd<'_>) -> Result<()> {
    const OPCODE: Opcode = uapi::VIDIOC_STREAMOFF as Opcode;
    // SAFETY: OPCODE is VIDIOC_STREAMOFF (an _IOW of int), whose argument is the buffer type.
    let setter = unsafe { Setter::<OPCODE, core::ffi::c_int>::new(CAPTURE as core::ffi::c_int) };
    // SAFETY: the setter pairs the opcode with its argument type; `fd` is an open fd.
    unsafe { ioctl(fd, setter) }
}
