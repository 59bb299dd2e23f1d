//! Discovery of Linux compute accelerators (`/dev/accel/accel*`, the DRM accel subsystem).
//!
//! Each node is opened and asked `DRM_IOCTL_VERSION` for its driver's name, version and
//! description. Drivers this crate knows by name (Intel `ivpu`, AMD `amdxdna`, Qualcomm `qaic`,
//! Rockchip `rocket`, Arm `ethosu`, Habana `habanalabs`) are named in the report; none has an
//! execution backend here yet, and the report says exactly that instead of pretending.
//!
//! The driver answers are untrusted: lengths are clamped to our buffers, the strings are decoded
//! lossily, and a node that cannot be opened or queried is reported with the error.

use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};

use crate::sys::uapi;

/// What one accel node said about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccelDevice {
    /// The device node, e.g. `/dev/accel/accel0`.
    pub path: PathBuf,
    /// The outcome of opening and querying it.
    pub state: AccelState,
}

/// Whether an accel node answered, and what this crate can do with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccelState {
    /// The driver answered `DRM_IOCTL_VERSION`.
    Identified {
        driver: String,
        version: (i32, i32, i32),
        description: String,
        /// The hardware family when the driver is one this crate knows by name.
        family: Option<&'static str>,
        /// Why ops cannot run on it yet (every driver, for now).
        unsupported: String,
    },
    /// The node exists but could not be opened or queried (permissions, a driver error).
    Unreachable { error: String },
}

/// The drivers this crate recognises, with the hardware they drive.
pub const KNOWN_DRIVERS: &[(&str, &str)] = &[
    ("ivpu", "Intel NPU (Meteor Lake and later)"),
    ("amdxdna", "AMD XDNA NPU (Ryzen AI)"),
    ("qaic", "Qualcomm Cloud AI 100"),
    ("rocket", "Rockchip RKNN NPU"),
    ("ethosu", "Arm Ethos-U NPU"),
    ("habanalabs", "Intel Gaudi"),
];

/// Lists and queries every `accel*` node under `/dev/accel` (empty when the directory does not
/// exist, the usual case on machines without an NPU).
pub fn discover() -> Vec<AccelDevice> {
    discover_in(Path::new("/dev/accel"))
}

/// [`discover`] over another directory (tests, containers with remapped /dev).
pub fn discover_in(dir: &Path) -> Vec<AccelDevice> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("accel"))
        })
        .collect();
    paths.sort();
    paths.into_iter().map(|p| query(&p)).collect()
}

fn query(path: &Path) -> AccelDevice {
    let state = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Err(e) => AccelState::Unreachable {
            error: format!("open failed: {e}"),
        },
        Ok(file) => match drm_version(file.as_fd()) {
            Err(e) => AccelState::Unreachable {
                error: format!("DRM_IOCTL_VERSION failed: {e}"),
            },
            Ok(v) => {
                let family = KNOWN_DRIVERS
                    .iter()
                    .find(|(name, _)| *name == v.driver)
                    .map(|(_, family)| *family);
                AccelState::Identified {
                    unsupported: format!(
                        "no execution backend for this driver ({}) yet: ops run on the CPU NPU",
                        v.driver
                    ),
                    driver: v.driver,
                    version: v.version,
                    description: v.description,
                    family,
                }
            }
        },
    };
    AccelDevice {
        path: path.to_path_buf(),
        state,
    }
}

/// The decoded answer of `DRM_IOCTL_VERSION`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrmVersion {
    pub driver: String,
    pub version: (i32, i32, i32),
    pub description: String,
}

/// Asks a DRM or accel node for its driver's name, version and description.
pub fn drm_version(fd: BorrowedFd<'_>) -> rustix::io::Result<DrmVersion> {
    let mut name = [0u8; 64];
    let mut date = [0u8; 64];
    let mut desc = [0u8; 256];
    let mut v = uapi::drm_version {
        version_major: 0,
        version_minor: 0,
        version_patchlevel: 0,
        name_len: name.len() as _,
        name: name.as_mut_ptr().cast(),
        date_len: date.len() as _,
        date: date.as_mut_ptr().cast(),
        desc_len: desc.len() as _,
        desc: desc.as_mut_ptr().cast(),
    };
    // SAFETY: `v`'s three pointers point at the local arrays above, live for this call, and its
    // lengths are those arrays' lengths.
    unsafe { crate::sys::ioctl::drm_version(fd, &mut v) }?;
    // The kernel writes at most the lengths we gave and reports the full lengths back, which
    // may be larger: clamp before slicing.
    let text = |buf: &[u8], len: uapi::__kernel_size_t| {
        let len = usize::try_from(len).unwrap_or(usize::MAX).min(buf.len());
        let s = &buf[..len];
        let end = s.iter().position(|&b| b == 0).unwrap_or(s.len());
        String::from_utf8_lossy(&s[..end]).into_owned()
    };
    Ok(DrmVersion {
        driver: text(&name, v.name_len),
        version: (v.version_major, v.version_minor, v.version_patchlevel),
        description: text(&desc, v.desc_len),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_directory_is_no_devices() {
        assert!(discover_in(Path::new("/nonexistent/accel")).is_empty());
    }

    #[test]
    fn a_node_that_is_not_a_drm_device_is_unreachable_not_working() {
        let dir = std::env::temp_dir().join(format!("npu-hal-accel-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("accel0"), b"not a device").unwrap();
        std::fs::write(dir.join("other"), b"ignored").unwrap();
        let found = discover_in(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found.len(), 1);
        match &found[0].state {
            AccelState::Unreachable { error } => assert!(error.contains("DRM_IOCTL_VERSION")),
            other => panic!("a regular file must not identify as a device: {other:?}"),
        }
    }

    /// Runs on machines with an accel device (`cargo xtask device-test`).
    #[test]
    #[ignore = "hardware: needs /dev/accel/accel* (an NPU with a DRM accel driver)"]
    fn every_accel_node_identifies_its_driver() {
        let found = discover();
        assert!(
            !found.is_empty(),
            "no /dev/accel/accel* node on this machine"
        );
        for d in found {
            match d.state {
                AccelState::Identified { driver, .. } => assert!(!driver.is_empty()),
                AccelState::Unreachable { error } => panic!("{}: {error}", d.path.display()),
            }
        }
    }
}
