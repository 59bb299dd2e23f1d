//! DRM syncobj timelines (feature `drm`): the kernel's own timeline object on a render node,
//! shared between processes and drivers, with sync_file export and import of a point.
//!
//! Wait, signal, query and transfer go through the drm crate. Importing a sync_file *into an
//! existing syncobj* is not covered there (its wrapper always creates a new handle, which the
//! kernel rejects for imports), so that one ioctl is called here with the generated UAPI
//! ([`crate::sys::uapi`]), in [`syncobj_fd_to_handle`].
//!
//! A sync_file carries one binary fence, so a timeline point crosses through a temporary binary
//! syncobj: export = transfer the point into it, then export it; import = import into it, then
//! transfer it to the point.
//!
//! The bridge from implicit to explicit sync: a dma-buf written by a device that fences its
//! buffers implicitly (a camera, a display, a GEM driver) gives its fences up as a sync_file
//! ([`dma_buf_fences`], `DMA_BUF_IOCTL_EXPORT_SYNC_FILE`), which
//! [`SyncobjTimeline::import_sync_file`] turns into a timeline point any waiter can use.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use drm::control::{Device as ControlDevice, syncobj};

use crate::{Backend, Error, Timeline};

/// An open DRM render node (`/dev/dri/renderD*`).
#[derive(Debug)]
pub struct RenderNode {
    file: File,
    path: PathBuf,
}

impl AsFd for RenderNode {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl drm::Device for RenderNode {}
impl ControlDevice for RenderNode {}

impl RenderNode {
    /// Opens `path` and checks that its driver supports timeline syncobjs.
    pub fn open(path: &Path) -> Result<RenderNode, Error> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::Unsupported {
                what: "DRM render node",
                why: format!("{}: {e}", path.display()),
            })?;
        let node = RenderNode {
            file,
            path: path.to_owned(),
        };
        let timeline =
            drm::Device::get_driver_capability(&node, drm::DriverCapability::TimelineSyncObj)
                .map_err(|e| Error::Unsupported {
                    what: "timeline syncobj",
                    why: format!(
                        "{}: DRM_CAP_SYNCOBJ_TIMELINE query failed: {e}",
                        path.display()
                    ),
                })?;
        if timeline == 0 {
            return Err(Error::Unsupported {
                what: "timeline syncobj",
                why: format!(
                    "{}: the driver does not support timeline syncobjs",
                    path.display()
                ),
            });
        }
        Ok(node)
    }

    /// The first render node under `/dev/dri` that supports timeline syncobjs.
    pub fn discover() -> Result<RenderNode, Error> {
        let mut tried = Vec::new();
        let entries = std::fs::read_dir("/dev/dri").map_err(|e| Error::Unsupported {
            what: "DRM render node",
            why: format!("/dev/dri: {e}"),
        })?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("renderD"))
            })
            .collect();
        paths.sort();
        for p in paths {
            match RenderNode::open(&p) {
                Ok(node) => return Ok(node),
                Err(e) => tried.push(e.to_string()),
            }
        }
        Err(Error::Unsupported {
            what: "DRM render node",
            why: if tried.is_empty() {
                "no /dev/dri/renderD* node".into()
            } else {
                tried.join("; ")
            },
        })
    }

    /// The node's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn os(call: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::Os {
        call,
        errno: rustix::io::Errno::from_io_error(&e).unwrap_or(rustix::io::Errno::IO),
    }
}

/// A timeline syncobj.
#[derive(Debug)]
pub struct SyncobjTimeline {
    node: Arc<RenderNode>,
    handle: syncobj::Handle,
    /// Host signals are serialised so that two racing signals reach the kernel in order.
    host_signal: Mutex<()>,
}

impl SyncobjTimeline {
    /// A new timeline syncobj at value 0 on `node`.
    pub fn new(node: Arc<RenderNode>) -> Result<SyncobjTimeline, Error> {
        let handle = node
            .create_syncobj(false)
            .map_err(os("DRM_IOCTL_SYNCOBJ_CREATE"))?;
        Ok(SyncobjTimeline {
            node,
            handle,
            host_signal: Mutex::new(()),
        })
    }

    /// The syncobj handle, for submissions made elsewhere (on the same node's fd).
    pub fn handle(&self) -> syncobj::Handle {
        self.handle
    }

    /// Makes `dst`'s `dst_point` signal when this timeline's `point` does (a kernel-side
    /// transfer; both on the same render node).
    pub fn transfer_to(
        &self,
        point: u64,
        dst: &SyncobjTimeline,
        dst_point: u64,
    ) -> Result<(), Error> {
        self.node
            .syncobj_timeline_transfer(self.handle, dst.handle, point, dst_point)
            .map_err(os("DRM_IOCTL_SYNCOBJ_TRANSFER"))
    }

    /// Exports the fence of `point` as a sync_file (the point must have a fence submitted).
    pub fn export_sync_file(&self, point: u64) -> Result<OwnedFd, Error> {
        let temp = self
            .node
            .create_syncobj(false)
            .map_err(os("DRM_IOCTL_SYNCOBJ_CREATE"))?;
        let result = self
            .node
            .syncobj_timeline_transfer(self.handle, temp, point, 0)
            .map_err(os("DRM_IOCTL_SYNCOBJ_TRANSFER"))
            .and_then(|()| {
                self.node
                    .syncobj_to_fd(temp, true)
                    .map_err(os("DRM_IOCTL_SYNCOBJ_HANDLE_TO_FD"))
            });
        let _ = self.node.destroy_syncobj(temp);
        result
    }

    /// Makes `point` signal when the sync_file `fence` does.
    pub fn import_sync_file(&self, fence: BorrowedFd<'_>, point: u64) -> Result<(), Error> {
        let temp = self
            .node
            .create_syncobj(false)
            .map_err(os("DRM_IOCTL_SYNCOBJ_CREATE"))?;
        let result = syncobj_fd_to_handle(self.node.as_fd(), fence, temp.into()).and_then(|()| {
            self.node
                .syncobj_timeline_transfer(temp, self.handle, 0, point)
                .map_err(os("DRM_IOCTL_SYNCOBJ_TRANSFER"))
        });
        let _ = self.node.destroy_syncobj(temp);
        result
    }
}

impl Drop for SyncobjTimeline {
    fn drop(&mut self) {
        // Nothing to report to: a failed destroy leaves the handle to be freed with the fd.
        let _ = self.node.destroy_syncobj(self.handle);
    }
}

impl Timeline for SyncobjTimeline {
    fn value(&self) -> Result<u64, Error> {
        let mut points = [0u64];
        self.node
            .syncobj_timeline_query(&[self.handle], &mut points, false)
            .map_err(os("DRM_IOCTL_SYNCOBJ_QUERY"))?;
        Ok(points[0])
    }

    fn signal(&self, value: u64) -> Result<(), Error> {
        let _serial = self.host_signal.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.value()?;
        if value < current {
            return Err(Error::Backwards {
                current,
                requested: value,
            });
        }
        if value == current {
            return Ok(());
        }
        self.node
            .syncobj_timeline_signal(&[self.handle], &[value])
            .map_err(os("DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL"))
    }

    fn wait(&self, value: u64, timeout: Duration) -> Result<(), Error> {
        // The syncobj wait takes an absolute CLOCK_MONOTONIC deadline in nanoseconds.
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        let now_ns = i128::from(now.tv_sec) * 1_000_000_000 + i128::from(now.tv_nsec);
        let deadline = i64::try_from(now_ns + timeout.as_nanos() as i128).unwrap_or(i64::MAX);
        match self
            .node
            .syncobj_timeline_wait(&[self.handle], &[value], deadline, true, true, false)
        {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::TIME.raw_os_error()) => {
                Err(Error::Timeout {
                    wanted: value,
                    reached: self.value()?,
                    timeout,
                })
            }
            Err(e) => Err(os("DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT")(e)),
        }
    }

    fn backend(&self) -> Backend<'_> {
        Backend::Other
    }
}

/// Which of a dma-buf's implicit fences [`dma_buf_fences`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceAccess {
    /// The fences a reader must wait for (the buffer's writers).
    Read,
    /// The fences a writer must wait for (every reader and writer).
    Write,
}

/// `ioctl(dmabuf, DMA_BUF_IOCTL_EXPORT_SYNC_FILE, {flags, fd})`—The dma-buf's current implicit
/// fences for `access`, merged into one sync_file (already signalled when there are none).
///
/// # Errors
/// The kernel's errno: `ENOTTY` before Linux 6.0, `EINVAL` for a `dmabuf` that is not a dma-buf.
///
/// # References
/// Linux `include/uapi/linux/dma-buf.h`, `drivers/dma-buf/dma-buf.c` (`dma_buf_export_sync_file`).
pub fn dma_buf_fences(dmabuf: BorrowedFd<'_>, access: FenceAccess) -> Result<OwnedFd, Error> {
    use crate::sys::uapi;
    use std::os::fd::FromRawFd;
    let mut args = uapi::dma_buf_export_sync_file {
        flags: match access {
            FenceAccess::Read => uapi::DMA_BUF_SYNC_READ,
            FenceAccess::Write => uapi::DMA_BUF_SYNC_RW,
        },
        fd: -1,
    };
    const OPCODE: rustix::ioctl::Opcode =
        uapi::DMA_BUF_IOCTL_EXPORT_SYNC_FILE as rustix::ioctl::Opcode;
    // SAFETY: OPCODE is the generated DMA_BUF_IOCTL_EXPORT_SYNC_FILE (an _IOWR), whose argument
    // is the `dma_buf_export_sync_file` the kernel reads and writes: the type `Updater` is
    // built with.
    #[allow(unsafe_code)]
    let updater =
        unsafe { rustix::ioctl::Updater::<OPCODE, uapi::dma_buf_export_sync_file>::new(&mut args) };
    // SAFETY: `updater` pairs the opcode with its argument type (above); `dmabuf` is an open fd.
    #[allow(unsafe_code)]
    let result = unsafe { rustix::ioctl::ioctl(dmabuf, updater) };
    result.map_err(|errno| Error::Os {
        call: "DMA_BUF_IOCTL_EXPORT_SYNC_FILE",
        errno,
    })?;
    if args.fd < 0 {
        return Err(Error::Os {
            call: "DMA_BUF_IOCTL_EXPORT_SYNC_FILE",
            errno: rustix::io::Errno::BADF,
        });
    }
    // SAFETY: on success the kernel returned a new sync_file fd that nothing else owns.
    #[allow(unsafe_code)]
    Ok(unsafe { OwnedFd::from_raw_fd(args.fd) })
}

/// `ioctl(fd, DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE, {handle, IMPORT_SYNC_FILE, fence})`—Imports the
/// sync_file `fence` into the existing binary syncobj `handle`.
///
/// # Errors
/// The kernel's errno: `EINVAL` for a `fence` that is not a sync_file, `ENOENT` for a bad handle.
///
/// # References
/// Linux `drivers/gpu/drm/drm_syncobj.c`, `drm_syncobj_import_sync_file_fence`.
pub fn syncobj_fd_to_handle(
    node: BorrowedFd<'_>,
    fence: BorrowedFd<'_>,
    handle: u32,
) -> Result<(), Error> {
    use crate::sys::uapi;
    use std::os::fd::AsRawFd;
    let mut args = uapi::drm_syncobj_handle {
        handle,
        flags: uapi::DRM_SYNCOBJ_FD_TO_HANDLE_FLAGS_IMPORT_SYNC_FILE,
        fd: fence.as_raw_fd(),
        pad: 0,
    };
    const OPCODE: rustix::ioctl::Opcode =
        uapi::DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE as rustix::ioctl::Opcode;
    // SAFETY: OPCODE is the generated DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE, whose argument is the
    // `drm_syncobj_handle` the kernel reads and writes: the type `Updater` is built with.
    #[allow(unsafe_code)]
    let updater =
        unsafe { rustix::ioctl::Updater::<OPCODE, uapi::drm_syncobj_handle>::new(&mut args) };
    // SAFETY: `updater` pairs the opcode with its argument type (above); `node` is an open fd.
    #[allow(unsafe_code)]
    let result = unsafe { rustix::ioctl::ioctl(node, updater) };
    result.map_err(|errno| Error::Os {
        call: "DRM_IOCTL_SYNCOBJ_FD_TO_HANDLE",
        errno,
    })
}
