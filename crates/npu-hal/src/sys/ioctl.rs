//! One thin function per ioctl this crate makes, named after it, over the generated UAPI. Each
//! pairs a generated request code with the struct the kernel expects for it; that pairing is what
//! makes the `rustix::ioctl` call sound, and it is stated once, here.

use std::os::fd::BorrowedFd;

use rustix::ioctl::{Opcode, Updater, ioctl};

use super::uapi;

/// `ioctl(fd, DRM_IOCTL_VERSION, v)`: the driver fills in its version and copies at most
/// `v.name_len` / `v.date_len` / `v.desc_len` bytes into the buffers `v` points at, then writes
/// the full lengths back (which may exceed the buffers: callers clamp).
///
/// # Safety
/// `v.name`, `v.date` and `v.desc` must each be null or point at a live, writable buffer of at
/// least `v.name_len` / `v.date_len` / `v.desc_len` bytes: the kernel writes through them.
///
/// # References
/// Linux `include/uapi/drm/drm.h`, `drivers/gpu/drm/drm_ioctl.c` (`drm_version`).
pub(crate) unsafe fn drm_version(
    fd: BorrowedFd<'_>,
    v: &mut uapi::drm_version,
) -> rustix::io::Result<()> {
    const OPCODE: Opcode = uapi::DRM_IOCTL_VERSION as Opcode;
    // SAFETY: OPCODE is DRM_IOCTL_VERSION, whose argument is `drm_version` (an _IOWR).
    let updater = unsafe { Updater::<OPCODE, uapi::drm_version>::new(v) };
    // SAFETY: the updater pairs the opcode with its argument type; `fd` is open; the buffers
    // `v` points at are live and as long as stated (the caller's contract).
    unsafe { ioctl(fd, updater) }
}
