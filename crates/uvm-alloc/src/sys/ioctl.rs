//! One thin `unsafe fn` per ioctl this crate makes, named after it, over the generated UAPI.
//!
//! Each pairs a generated request code with the struct the kernel expects for it; that pairing
//! is what makes the `rustix::ioctl` call sound, and it is stated once, here.

use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::ioctl::{Opcode, Setter, Updater, ioctl};

use super::uapi;

/// `ioctl(heap, DMA_HEAP_IOCTL_ALLOC, &data)`—Allocates `len` bytes from a DMA-BUF heap and
/// returns the new dma-buf.
///
/// # Errors
/// The kernel's errno (`ENOMEM`, `EINVAL` for a zero or misaligned length).
///
/// # References
/// Linux `include/uapi/linux/dma-heap.h`, `Documentation/userspace-api/dma-buf-heaps.rst`.
pub(crate) fn dma_heap_alloc(heap: BorrowedFd<'_>, len: u64) -> rustix::io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    const OPCODE: Opcode = uapi::DMA_HEAP_IOCTL_ALLOC as Opcode;
    let mut data = uapi::dma_heap_allocation_data {
        len,
        fd: 0,
        fd_flags: (rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC).bits(),
        heap_flags: 0,
    };
    // SAFETY: OPCODE is DMA_HEAP_IOCTL_ALLOC, whose argument is `dma_heap_allocation_data`.
    let updater = unsafe { Updater::<OPCODE, uapi::dma_heap_allocation_data>::new(&mut data) };
    // SAFETY: the updater pairs the opcode with its argument type; `heap` is an open fd.
    unsafe { ioctl(heap, updater) }?;
    // SAFETY: on success the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(data.fd as i32) })
}

/// `ioctl(udmabuf, UDMABUF_CREATE, &create)`—Turns `size` bytes of the sealed memfd `memfd` at
/// `offset` into a dma-buf.
///
/// # Errors
/// The kernel's errno: `EINVAL` if the memfd lacks `F_SEAL_SHRINK` or the range is not page
/// aligned, `E2BIG` past the module's size limit.
///
/// # References
/// Linux `include/uapi/linux/udmabuf.h`, `drivers/dma-buf/udmabuf.c`.
pub(crate) fn udmabuf_create(
    udmabuf: BorrowedFd<'_>,
    memfd: BorrowedFd<'_>,
    offset: u64,
    size: u64,
) -> rustix::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let create = uapi::udmabuf_create {
        memfd: memfd.as_raw_fd() as u32,
        flags: uapi::UDMABUF_FLAGS_CLOEXEC,
        offset,
        size,
    };
    // SAFETY: `UdmabufCreate` pairs UDMABUF_CREATE with its argument type (see its impl).
    unsafe { ioctl(udmabuf, UdmabufCreate(create)) }
}

/// UDMABUF_CREATE returns the new dma-buf as the ioctl's return value, which rustix's generic
/// `Setter` discards; this pattern keeps it.
struct UdmabufCreate(uapi::udmabuf_create);

// SAFETY: the opcode is UDMABUF_CREATE (an _IOW of `udmabuf_create`), `as_ptr` points at one,
// the kernel only reads it, and a non-negative return value is a new fd owned by the caller.
unsafe impl rustix::ioctl::Ioctl for UdmabufCreate {
    type Output = OwnedFd;
    const IS_MUTATING: bool = false;

    fn opcode(&self) -> Opcode {
        uapi::UDMABUF_CREATE as Opcode
    }

    fn as_ptr(&mut self) -> *mut core::ffi::c_void {
        (&raw mut self.0).cast()
    }

    unsafe fn output_from_ptr(
        out: rustix::ioctl::IoctlOutput,
        _: *mut core::ffi::c_void,
    ) -> rustix::io::Result<OwnedFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: rustix calls this only for a successful (non-negative) return, which for
        // UDMABUF_CREATE is a new fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(out) })
    }
}

/// `ioctl(dmabuf, DMA_BUF_IOCTL_SYNC, &sync)`—Begins or ends CPU access to a dma-buf
/// (`flags`: `DMA_BUF_SYNC_START`/`END` with `READ`/`WRITE`).
///
/// # Errors
/// The kernel's errno (`EINVAL` for bad flags; exporters may fail with `EIO`).
///
/// # References
/// Linux `include/uapi/linux/dma-buf.h`, `Documentation/driver-api/dma-buf.rst` (CPU access).
pub(crate) fn dma_buf_sync(dmabuf: BorrowedFd<'_>, flags: u64) -> rustix::io::Result<()> {
    const OPCODE: Opcode = uapi::DMA_BUF_IOCTL_SYNC as Opcode;
    // SAFETY: OPCODE is DMA_BUF_IOCTL_SYNC (an _IOW), whose argument is `dma_buf_sync`.
    let setter = unsafe { Setter::<OPCODE, uapi::dma_buf_sync>::new(uapi::dma_buf_sync { flags }) };
    // SAFETY: the setter pairs the opcode with its argument type; `dmabuf` is an open fd.
    unsafe { ioctl(dmabuf, setter) }
}
