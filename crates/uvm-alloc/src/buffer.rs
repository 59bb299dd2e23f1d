//! [`UnifiedBuffer`]: one allocation that the CPU maps and devices import, and the scoped CPU
//! access guard ([`CpuAccess`]) that keeps a dma-buf's caches coherent while the CPU holds it.

use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::Error;
use crate::sys::{ioctl, uapi};

/// Which backend made a buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// A DMA-BUF heap (`/dev/dma_heap/<heap>`).
    DmaHeap { heap: String },
    /// A sealed memfd turned into a dma-buf by `/dev/udmabuf`.
    Udmabuf,
    /// A GBM buffer object on a DRM render node, exported as a dma-buf.
    Gbm { node: String },
    /// A sealed memfd: shareable host memory (pass the fd to another process).
    Memfd,
    /// Anonymous host memory, page aligned.
    Host,
    /// A dma-buf exported by another driver (a V4L2 capture buffer, a GPU allocation) and
    /// imported with [`UnifiedBuffer::import_dma_buf`]; `exporter` says who made it.
    Imported { exporter: String },
}

impl Backend {
    /// The backend's kind, without its details.
    pub fn kind(&self) -> BackendKind {
        match self {
            Backend::DmaHeap { .. } => BackendKind::DmaHeap,
            Backend::Udmabuf => BackendKind::Udmabuf,
            Backend::Gbm { .. } => BackendKind::Gbm,
            Backend::Memfd => BackendKind::Memfd,
            Backend::Host => BackendKind::Host,
            Backend::Imported { .. } => BackendKind::Imported,
        }
    }
}

/// A backend kind, for allocator preference lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    DmaHeap,
    Udmabuf,
    Gbm,
    Memfd,
    Host,
    /// Not allocatable: buffers other drivers made (see [`Backend::Imported`]).
    Imported,
}

impl BackendKind {
    /// Every allocatable kind, best first: the allocator's default preference.
    pub const ALL: [BackendKind; 5] = [
        BackendKind::DmaHeap,
        BackendKind::Udmabuf,
        BackendKind::Gbm,
        BackendKind::Memfd,
        BackendKind::Host,
    ];

    /// Whether buffers of this kind are dma-bufs (a device imports them by fd); the others are
    /// host memory (imported by address, `VK_EXT_external_memory_host`).
    pub fn is_dma_buf(self) -> bool {
        matches!(
            self,
            BackendKind::DmaHeap | BackendKind::Udmabuf | BackendKind::Gbm | BackendKind::Imported
        )
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::DmaHeap => "dma-heap",
            BackendKind::Udmabuf => "udmabuf",
            BackendKind::Gbm => "gbm",
            BackendKind::Memfd => "memfd",
            BackendKind::Host => "host",
            BackendKind::Imported => "imported",
        })
    }
}

/// A backend the allocator tried and why it refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub backend: BackendKind,
    pub reason: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.backend, self.reason)
    }
}

/// Direction of a CPU access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl Access {
    fn writes(self) -> bool {
        !matches!(self, Access::Read)
    }

    fn sync_flags(self) -> u64 {
        u64::from(match self {
            Access::Read => uapi::DMA_BUF_SYNC_READ,
            Access::Write => uapi::DMA_BUF_SYNC_WRITE,
            Access::ReadWrite => uapi::DMA_BUF_SYNC_RW,
        })
    }
}

/// The CPU-access state word: the number of readers, or [`WRITER`].
const WRITER: u32 = 1 << 31;

/// Memory shared by the CPU and devices, mapped into this process.
///
/// Made by an [`crate::Allocator`] (or a backend constructor such as
/// [`UnifiedBuffer::memfd`]). The CPU touches it only through [`UnifiedBuffer::cpu_access`];
/// devices import it (see the `vulkan` module). Dropping it unmaps the memory and closes its fd.
pub struct UnifiedBuffer {
    // Drop order: `Drop::drop` unmaps `ptr`; then `fd` closes (after the mapping, which holds
    // its own reference anyway), then `_gbm_bo` releases the buffer object.
    ptr: NonNull<u8>,
    mapped_len: usize,
    len: usize,
    alignment: usize,
    fd: Option<OwnedFd>,
    is_dma_buf: bool,
    backend: Backend,
    access: AtomicU32,
    refusals: Vec<Refusal>,
    #[cfg(feature = "gbm")]
    pub(crate) _gbm_bo: Option<Box<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the mapping is plain process memory owned by this value (no thread affinity); shared
// use goes through `cpu_access`, whose atomic state word gives writers exclusivity.
unsafe impl Send for UnifiedBuffer {}
// SAFETY: as above: `&UnifiedBuffer` exposes bytes only through guards that respect the
// reader/writer state, so concurrent `&self` use cannot alias a `&mut [u8]`.
unsafe impl Sync for UnifiedBuffer {}

impl std::fmt::Debug for UnifiedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnifiedBuffer")
            .field("backend", &self.backend)
            .field("len", &self.len)
            .field("mapped_len", &self.mapped_len)
            .field("is_dma_buf", &self.is_dma_buf)
            .finish_non_exhaustive()
    }
}

impl UnifiedBuffer {
    /// Wraps an established mapping. `fd` is the dma-buf or memfd behind it, if any.
    pub(crate) fn from_parts(
        ptr: NonNull<u8>,
        mapped_len: usize,
        len: usize,
        alignment: usize,
        fd: Option<OwnedFd>,
        is_dma_buf: bool,
        backend: Backend,
    ) -> UnifiedBuffer {
        UnifiedBuffer {
            ptr,
            mapped_len,
            len,
            alignment,
            fd,
            is_dma_buf,
            backend,
            access: AtomicU32::new(0),
            refusals: Vec::new(),
            #[cfg(feature = "gbm")]
            _gbm_bo: None,
        }
    }

    pub(crate) fn with_refusals(mut self, refusals: Vec<Refusal>) -> UnifiedBuffer {
        self.refusals = refusals;
        self
    }

    /// The size asked for, in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a zero-sized allocation is an error.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mapped size: the requested size rounded up to the page and cache line.
    pub fn mapped_len(&self) -> usize {
        self.mapped_len
    }

    /// The alignment of the start of the mapping (a page, at least the cache line).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// The backend that made the buffer.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Whether the fd is a dma-buf (devices import it directly, CPU access is synchronised).
    pub fn is_dma_buf(&self) -> bool {
        self.is_dma_buf
    }

    /// The dma-buf or memfd behind the buffer, for sharing with a device or another process.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// The backends the allocator tried before this one, and why each refused.
    pub fn refusals(&self) -> &[Refusal] {
        &self.refusals
    }

    /// The start of the mapping, for device imports by address (`VK_EXT_external_memory_host`).
    /// Reading or writing through it bypasses [`UnifiedBuffer::cpu_access`]'s guarantees.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Begins CPU access to `range` in direction `access`; the access ends when the guard drops.
    /// On a dma-buf this is `DMA_BUF_IOCTL_SYNC` START now and END on drop; on host memory it
    /// costs nothing. Writers are exclusive: a conflicting guard is [`Error::AccessConflict`].
    ///
    /// Devices reach a buffer only through an `unsafe` import
    /// (`vulkan::import_wgpu_buffer`), whose contract excludes device work on the memory while
    /// a guard is alive; so the slices a guard hands out are never raced.
    pub fn cpu_access(&self, range: Range<usize>, access: Access) -> Result<CpuAccess<'_>, Error> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::OutOfBounds {
                start: range.start,
                end: range.end,
                len: self.len,
            });
        }
        let mut state = self.access.load(Ordering::Acquire);
        loop {
            let next = if access.writes() {
                if state != 0 {
                    return Err(Error::AccessConflict {
                        held: describe_state(state),
                    });
                }
                WRITER
            } else {
                if state & WRITER != 0 {
                    return Err(Error::AccessConflict {
                        held: describe_state(state),
                    });
                }
                state + 1
            };
            match self.access.compare_exchange_weak(
                state,
                next,
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        if self.is_dma_buf
            && let Some(fd) = &self.fd
            && let Err(errno) = ioctl::dma_buf_sync(
                fd.as_fd(),
                u64::from(uapi::DMA_BUF_SYNC_START) | access.sync_flags(),
            )
        {
            self.release(access);
            return Err(Error::Os {
                call: "DMA_BUF_IOCTL_SYNC(START)",
                errno,
            });
        }
        Ok(CpuAccess {
            buffer: self,
            range,
            access,
        })
    }

    fn release(&self, access: Access) {
        if access.writes() {
            self.access.store(0, Ordering::Release);
        } else {
            self.access.fetch_sub(1, Ordering::Release);
        }
    }
}

fn describe_state(state: u32) -> String {
    if state & WRITER != 0 {
        "a writer".into()
    } else {
        format!("{state} reader(s)")
    }
}

impl Drop for UnifiedBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + mapped_len` is the mapping this value created and still owns;
        // guards borrow `self`, so none is alive here.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.mapped_len) };
    }
}

/// Scoped CPU access to a range of a [`UnifiedBuffer`]; ends the access on drop.
#[derive(Debug)]
pub struct CpuAccess<'a> {
    buffer: &'a UnifiedBuffer,
    range: Range<usize>,
    access: Access,
}

impl CpuAccess<'_> {
    /// The bytes of the range.
    pub fn bytes(&self) -> &[u8] {
        let start = self.buffer.ptr.as_ptr().wrapping_add(self.range.start);
        // SAFETY: the range is inside the live mapping (checked at creation); this guard holds
        // read or write access, so no other guard writes the range meanwhile.
        unsafe { std::slice::from_raw_parts(start, self.range.len()) }
    }

    /// The bytes of the range, writable. [`Error::ReadOnlyAccess`] for a read guard.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8], Error> {
        if !self.access.writes() {
            return Err(Error::ReadOnlyAccess);
        }
        let start = self.buffer.ptr.as_ptr().wrapping_add(self.range.start);
        // SAFETY: inside the live mapping (checked at creation), and this guard is the only
        // writer and excludes readers (the state word), so the slice is not aliased.
        Ok(unsafe { std::slice::from_raw_parts_mut(start, self.range.len()) })
    }

    /// The range as a slice of `T` (its start and length must suit `T`).
    pub fn typed<T: bytemuck::Pod>(&self) -> Result<&[T], Error> {
        bytemuck::try_cast_slice(self.bytes()).map_err(|e| Error::BadView {
            reason: e.to_string(),
        })
    }

    /// The range as a writable slice of `T`.
    pub fn typed_mut<T: bytemuck::Pod>(&mut self) -> Result<&mut [T], Error> {
        bytemuck::try_cast_slice_mut(self.bytes_mut()?).map_err(|e| Error::BadView {
            reason: e.to_string(),
        })
    }
}

impl Drop for CpuAccess<'_> {
    fn drop(&mut self) {
        if self.buffer.is_dma_buf
            && let Some(fd) = &self.buffer.fd
        {
            // Nothing to report to on drop; END failing leaves caches as the exporter keeps them.
            let _ = ioctl::dma_buf_sync(
                fd.as_fd(),
                u64::from(uapi::DMA_BUF_SYNC_END) | self.access.sync_flags(),
            );
        }
        self.buffer.release(self.access);
    }
}
