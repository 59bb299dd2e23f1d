//! The allocator and its backends: DMA-BUF heaps, udmabuf, GBM, memfd and host memory.
//!
//! Each backend constructor either returns a mapped buffer or an [`Error::Unavailable`] that
//! names the device or call that refused; [`Allocator::allocate`] tries them in preference order
//! and keeps those refusals, so a run can say "memfd, because /dev/dma_heap does not exist and
//! /dev/udmabuf does not exist".

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::Error;
use crate::buffer::{Backend, BackendKind, Refusal, UnifiedBuffer};
use crate::sys::ioctl;

/// How an [`Allocator`] chooses and sizes buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatorDesc {
    /// Backends to try, in order.
    pub backends: Vec<BackendKind>,
    /// DMA-BUF heap names to try, in order (`/dev/dma_heap/<name>`).
    pub heaps: Vec<String>,
    /// Cache line to align sizes to: 64 or 128 bytes (the mapping itself is page aligned).
    pub cache_line: usize,
    /// Name given to memfds (visible in `/proc/<pid>/fd` and `/proc/<pid>/maps`).
    pub name: String,
}

impl Default for AllocatorDesc {
    fn default() -> AllocatorDesc {
        AllocatorDesc {
            backends: BackendKind::ALL.to_vec(),
            heaps: vec!["system".into(), "linux,cma".into(), "reserved".into()],
            cache_line: 128,
            name: "uvm-alloc".into(),
        }
    }
}

/// Picks the best available backend for each allocation.
#[derive(Clone, Debug)]
pub struct Allocator {
    desc: AllocatorDesc,
}

impl Allocator {
    /// An allocator for `desc`; the cache line must be 64 or 128.
    pub fn new(desc: AllocatorDesc) -> Result<Allocator, Error> {
        if desc.cache_line != 64 && desc.cache_line != 128 {
            return Err(Error::BadCacheLine {
                cache_line: desc.cache_line,
            });
        }
        if desc.backends.is_empty() {
            return Err(Error::NoBackend {
                refusals: Vec::new(),
            });
        }
        Ok(Allocator { desc })
    }

    /// The allocator's settings.
    pub fn desc(&self) -> &AllocatorDesc {
        &self.desc
    }

    /// Allocates `size` bytes from the first backend that works. The buffer remembers the
    /// backends that refused ([`UnifiedBuffer::refusals`]); when all refuse, the error lists them.
    pub fn allocate(&self, size: usize) -> Result<UnifiedBuffer, Error> {
        let mapped = rounded_size(size, self.desc.cache_line)?;
        let mut refusals = Vec::new();
        for &kind in &self.desc.backends {
            let attempt = match kind {
                BackendKind::DmaHeap => self.first_heap(size, mapped),
                BackendKind::Udmabuf => {
                    udmabuf(&self.desc.name, size, mapped, self.desc.cache_line)
                }
                BackendKind::Gbm => gbm(size, mapped, self.desc.cache_line),
                BackendKind::Memfd => memfd(&self.desc.name, size, mapped, self.desc.cache_line),
                BackendKind::Host => host(size, mapped, self.desc.cache_line),
                BackendKind::Imported => Err(unavailable(
                    BackendKind::Imported,
                    "imported buffers come from another driver; use UnifiedBuffer::import_dma_buf",
                )),
            };
            match attempt {
                Ok(buffer) => return Ok(buffer.with_refusals(refusals)),
                Err(e) => refusals.push(Refusal {
                    backend: kind,
                    reason: e.to_string(),
                }),
            }
        }
        Err(Error::NoBackend { refusals })
    }

    fn first_heap(&self, size: usize, mapped: usize) -> Result<UnifiedBuffer, Error> {
        let mut why = Vec::new();
        for heap in &self.desc.heaps {
            match dma_heap(heap, size, mapped, self.desc.cache_line) {
                Ok(b) => return Ok(b),
                Err(e) => why.push(e.to_string()),
            }
        }
        Err(Error::Unavailable {
            backend: BackendKind::DmaHeap,
            why: why.join("; "),
        })
    }
}

/// The alignment every mapping and size is rounded to: the page, or the cache line if larger.
fn mapping_alignment(cache_line: usize) -> usize {
    rustix::param::page_size().max(cache_line)
}

/// `size` rounded up to the page and the cache line; zero and overflow are errors.
pub fn rounded_size(size: usize, cache_line: usize) -> Result<usize, Error> {
    if size == 0 {
        return Err(Error::ZeroSize);
    }
    let align = mapping_alignment(cache_line);
    size.checked_next_multiple_of(align)
        .ok_or(Error::TooLarge { size })
}

impl UnifiedBuffer {
    /// `size` bytes from the DMA-BUF heap `/dev/dma_heap/<heap>`.
    pub fn dma_heap(heap: &str, size: usize) -> Result<UnifiedBuffer, Error> {
        dma_heap(heap, size, rounded_size(size, 128)?, 128)
    }

    /// `size` bytes of a sealed memfd turned into a dma-buf by `/dev/udmabuf`.
    pub fn udmabuf(size: usize) -> Result<UnifiedBuffer, Error> {
        udmabuf("uvm-alloc", size, rounded_size(size, 128)?, 128)
    }

    /// `size` bytes of a sealed memfd: host memory another process can map (send the fd).
    pub fn memfd(size: usize) -> Result<UnifiedBuffer, Error> {
        memfd("uvm-alloc", size, rounded_size(size, 128)?, 128)
    }

    /// `size` bytes of page-aligned anonymous host memory.
    pub fn host(size: usize) -> Result<UnifiedBuffer, Error> {
        host(size, rounded_size(size, 128)?, 128)
    }
}

fn unavailable(backend: BackendKind, why: impl Into<String>) -> Error {
    Error::Unavailable {
        backend,
        why: why.into(),
    }
}

impl UnifiedBuffer {
    /// Imports a dma-buf another driver exported (a V4L2 buffer through `VIDIOC_EXPBUF`, a GPU
    /// allocation): maps its first `len` bytes shared, and takes the fd. CPU access then goes
    /// through the same `DMA_BUF_IOCTL_SYNC` guard as every dma-buf. `exporter` names the source
    /// in reports.
    ///
    /// # Errors
    /// [`Error::Os`] when the fd cannot be mapped for that length (it is not a dma-buf, or it is
    /// shorter); zero or overflowing lengths are [`Error::ZeroSize`] and [`Error::TooLarge`], from
    /// [`rounded_size`].
    pub fn import_dma_buf(fd: OwnedFd, len: usize, exporter: &str) -> Result<UnifiedBuffer, Error> {
        // A dma-buf answers DMA_BUF_IOCTL_SYNC; anything else (a file, a memfd) does not, and
        // would fail later inside every CPU access guard: refuse it here, by name.
        let read = u64::from(crate::sys::uapi::DMA_BUF_SYNC_READ);
        ioctl::dma_buf_sync(
            fd.as_fd(),
            u64::from(crate::sys::uapi::DMA_BUF_SYNC_START) | read,
        )
        .and_then(|()| {
            ioctl::dma_buf_sync(
                fd.as_fd(),
                u64::from(crate::sys::uapi::DMA_BUF_SYNC_END) | read,
            )
        })
        .map_err(|errno| Error::Os {
            call: "DMA_BUF_IOCTL_SYNC on an imported fd (is it a dma-buf?)",
            errno,
        })?;
        let page = rustix::param::page_size();
        let mapped = rounded_size(len, page)?;
        let ptr = map_shared(&fd, mapped, "mmap(imported dma-buf)")?;
        Ok(UnifiedBuffer::from_parts(
            ptr,
            mapped,
            len,
            page,
            Some(fd),
            true,
            Backend::Imported {
                exporter: exporter.to_owned(),
            },
        ))
    }
}

/// Maps `len` bytes of `fd` shared, read-write.
fn map_shared(fd: &OwnedFd, len: usize, call: &'static str) -> Result<NonNull<u8>, Error> {
    // SAFETY: a fresh mapping chosen by the kernel (no address hint), of an fd we own; the
    // returned pointer is owned by the buffer, which unmaps it exactly once.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .map_err(|errno| Error::Os { call, errno })?;
    NonNull::new(ptr.cast()).ok_or(Error::Os {
        call,
        errno: rustix::io::Errno::FAULT,
    })
}

fn dma_heap(
    heap: &str,
    size: usize,
    mapped: usize,
    cache_line: usize,
) -> Result<UnifiedBuffer, Error> {
    let path = Path::new("/dev/dma_heap").join(heap);
    let heap_fd = rustix::fs::open(
        &path,
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| unavailable(BackendKind::DmaHeap, format!("{}: {e}", path.display())))?;
    let buf = ioctl::dma_heap_alloc(heap_fd.as_fd(), mapped as u64).map_err(|e| {
        unavailable(
            BackendKind::DmaHeap,
            format!("{}: DMA_HEAP_IOCTL_ALLOC: {e}", path.display()),
        )
    })?;
    let ptr = map_shared(&buf, mapped, "mmap(dma-buf)")?;
    Ok(UnifiedBuffer::from_parts(
        ptr,
        mapped,
        size,
        mapping_alignment(cache_line),
        Some(buf),
        true,
        Backend::DmaHeap {
            heap: heap.to_owned(),
        },
    ))
}

/// A memfd of `len` bytes, sealed against shrinking and growing (udmabuf requires
/// `F_SEAL_SHRINK`; growing would change what was shared).
fn sealed_memfd(name: &str, len: usize) -> Result<OwnedFd, Error> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| unavailable(BackendKind::Memfd, format!("memfd_create: {e}")))?;
    rustix::fs::ftruncate(&fd, len as u64).map_err(|errno| Error::Os {
        call: "ftruncate(memfd)",
        errno,
    })?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(|errno| Error::Os {
            call: "fcntl(F_ADD_SEALS)",
            errno,
        })?;
    Ok(fd)
}

fn memfd(
    name: &str,
    size: usize,
    mapped: usize,
    cache_line: usize,
) -> Result<UnifiedBuffer, Error> {
    let fd = sealed_memfd(name, mapped)?;
    let ptr = map_shared(&fd, mapped, "mmap(memfd)")?;
    Ok(UnifiedBuffer::from_parts(
        ptr,
        mapped,
        size,
        mapping_alignment(cache_line),
        Some(fd),
        false,
        Backend::Memfd,
    ))
}

fn udmabuf(
    name: &str,
    size: usize,
    mapped: usize,
    cache_line: usize,
) -> Result<UnifiedBuffer, Error> {
    let dev = rustix::fs::open(
        "/dev/udmabuf",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| unavailable(BackendKind::Udmabuf, format!("/dev/udmabuf: {e}")))?;
    let memfd = sealed_memfd(name, mapped)?;
    let buf = ioctl::udmabuf_create(dev.as_fd(), memfd.as_fd(), 0, mapped as u64).map_err(|e| {
        unavailable(
            BackendKind::Udmabuf,
            format!("/dev/udmabuf: UDMABUF_CREATE: {e}"),
        )
    })?;
    // The dma-buf holds the memfd's pages; the memfd itself can close.
    let ptr = map_shared(&buf, mapped, "mmap(udmabuf)")?;
    Ok(UnifiedBuffer::from_parts(
        ptr,
        mapped,
        size,
        mapping_alignment(cache_line),
        Some(buf),
        true,
        Backend::Udmabuf,
    ))
}

fn host(size: usize, mapped: usize, cache_line: usize) -> Result<UnifiedBuffer, Error> {
    // SAFETY: a fresh anonymous mapping chosen by the kernel; the buffer owns and unmaps it.
    let ptr = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            mapped,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }
    .map_err(|errno| Error::Os {
        call: "mmap(anonymous)",
        errno,
    })?;
    let ptr = NonNull::new(ptr.cast()).ok_or(Error::Os {
        call: "mmap(anonymous)",
        errno: rustix::io::Errno::FAULT,
    })?;
    Ok(UnifiedBuffer::from_parts(
        ptr,
        mapped,
        size,
        mapping_alignment(cache_line),
        None,
        false,
        Backend::Host,
    ))
}

#[cfg(not(feature = "gbm"))]
fn gbm(_size: usize, _mapped: usize, _cache_line: usize) -> Result<UnifiedBuffer, Error> {
    Err(unavailable(
        BackendKind::Gbm,
        "built without the `gbm` feature (it links libgbm: install libgbm-dev)",
    ))
}

#[cfg(feature = "gbm")]
fn gbm(size: usize, mapped: usize, cache_line: usize) -> Result<UnifiedBuffer, Error> {
    use std::fs::OpenOptions;
    // A linear R8 buffer object, 4096 bytes wide, as many rows as the size needs.
    const WIDTH: u32 = 4096;
    let mut nodes: Vec<_> = std::fs::read_dir("/dev/dri")
        .map_err(|e| unavailable(BackendKind::Gbm, format!("/dev/dri: {e}")))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("renderD"))
        })
        .collect();
    nodes.sort();
    let node = nodes
        .first()
        .ok_or_else(|| unavailable(BackendKind::Gbm, "/dev/dri: no renderD* node"))?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(node)
        .map_err(|e| unavailable(BackendKind::Gbm, format!("{}: {e}", node.display())))?;
    let device = gbm::Device::new(file)
        .map_err(|e| unavailable(BackendKind::Gbm, format!("gbm_create_device: {e}")))?;
    let rows =
        u32::try_from(mapped.div_ceil(WIDTH as usize)).map_err(|_| Error::TooLarge { size })?;
    let bo = device
        .create_buffer_object::<()>(WIDTH, rows, gbm::Format::R8, gbm::BufferObjectFlags::LINEAR)
        .map_err(|e| unavailable(BackendKind::Gbm, format!("gbm_bo_create: {e}")))?;
    let fd = bo
        .fd()
        .map_err(|e| unavailable(BackendKind::Gbm, format!("gbm_bo_get_fd: {e}")))?;
    let stride = bo.stride() as usize;
    if stride != WIDTH as usize {
        return Err(unavailable(
            BackendKind::Gbm,
            format!("linear R8 buffer got stride {stride}, not {WIDTH}"),
        ));
    }
    let ptr = map_shared(&fd, mapped, "mmap(gbm dma-buf)")?;
    let mut buffer = UnifiedBuffer::from_parts(
        ptr,
        mapped,
        size,
        mapping_alignment(cache_line),
        Some(fd),
        true,
        Backend::Gbm {
            node: node.display().to_string(),
        },
    );
    buffer._gbm_bo = Some(Box::new(GbmKeep {
        _bo: bo,
        _device: device,
    }));
    Ok(buffer)
}

/// Keeps a GBM buffer object and its device alive as long as the buffer. Drop order: the
/// buffer object before the device it came from.
#[cfg(feature = "gbm")]
struct GbmKeep {
    _bo: gbm::BufferObject<()>,
    _device: gbm::Device<std::fs::File>,
}

// SAFETY: the buffer object and device are only dropped (never used) through this value, on
// whichever thread drops the buffer; libgbm objects carry no thread affinity.
#[cfg(feature = "gbm")]
unsafe impl Send for GbmKeep {}
// SAFETY: no method is ever called through a shared reference.
#[cfg(feature = "gbm")]
unsafe impl Sync for GbmKeep {}
