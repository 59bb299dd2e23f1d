//! `cargo xtask codegen [--check]`: every checked-in generated file, made anew.
//!
//! Each generator renders its files in memory and hands them to [`ensure_file`], the one place that
//! writes (or, with `--check`, compares and reports "stale: run `cargo xtask codegen`"). Output is
//! rustfmt-formatted so `cargo fmt --check` and `codegen --check` agree on every byte.
//!
//! The first generator is the Linux UAPI: Rust mirrors of the kernel structs and ioctl request codes
//! that the hardware crates call, made by bindgen from the installed headers. bindgen opens libclang
//! at run time (clang-sys `runtime`), so the xtask builds everywhere and only this command needs
//! libclang; when it is missing the error says which package to install. Function-like ioctl macros
//! (`_IOWR('H', 0, struct dma_heap_allocation_data)`) are evaluated by clang itself
//! (`clang_macro_fallback`), so request codes are the compiler's answer, not a re-derivation.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Where the kernel's own UAPI headers live on Debian/Ubuntu (package `linux-libc-dev`).
const KERNEL_INCLUDE: &str = "/usr/include";
/// Debian ships the DRM UAPI headers (drm.h and the driver headers) in `libdrm-dev`, not in
/// `linux-libc-dev`; they are the kernel's headers, synced by libdrm.
const DRM_INCLUDE: &str = "/usr/include/libdrm";

/// One generated UAPI binding file.
struct UapiBinding {
    /// Path of the generated file, relative to the workspace root.
    out: &'static str,
    /// What the file is for, one sentence, written into its header.
    purpose: &'static str,
    /// `#include` lines, as a C file would write them.
    includes: &'static [&'static str],
    /// Type names (regexes) to emit, with whatever they depend on.
    types: &'static [&'static str],
    /// Constant names (regexes) to emit, ioctl request codes included.
    vars: &'static [&'static str],
    /// Types with pointer fields, for which bindgen's `Default` would be an `unsafe` zeroing; the
    /// safe layer builds them field by field instead, keeping generated code free of unsafe.
    no_default: &'static [&'static str],
}

const UAPI_BINDINGS: &[UapiBinding] = &[
    UapiBinding {
        out: "crates/uvm-alloc/src/sys/uapi.rs",
        purpose: "DMA-BUF heaps, udmabuf and dma-buf CPU-access synchronisation",
        includes: &["linux/dma-heap.h", "linux/udmabuf.h", "linux/dma-buf.h"],
        // UDMABUF_CREATE_LIST (a flexible array member) is left out: one memfd range per buffer
        // is all uvm-alloc asks for, and the generated code stays free of unsafe.
        types: &["dma_heap_.*", "udmabuf_create", "dma_buf_.*"],
        vars: &[
            "DMA_HEAP_.*",
            "UDMABUF_CREATE",
            "UDMABUF_FLAGS_.*",
            "DMA_BUF_.*",
        ],
        no_default: &[],
    },
    UapiBinding {
        out: "crates/sync-timeline/src/sys/uapi.rs",
        purpose: "sync_file fences and DRM syncobj timelines",
        includes: &["linux/sync_file.h", "linux/dma-buf.h", "drm.h"],
        types: &[
            "dma_buf_export_sync_file",
            "sync_merge_data",
            "sync_fence_info",
            "sync_file_info",
            "drm_syncobj_.*",
        ],
        vars: &[
            "SYNC_IOC_.*",
            "DMA_BUF_IOCTL_EXPORT_SYNC_FILE",
            "DMA_BUF_SYNC_(READ|WRITE|RW)",
            "DRM_IOCTL_SYNCOBJ_.*",
            "DRM_SYNCOBJ_.*",
            "DRM_CAP_SYNCOBJ.*",
        ],
        no_default: &[],
    },
    UapiBinding {
        out: "crates/sync-timeline/tests/support/vgem_uapi.rs",
        purpose: "vgem's fence ioctls, which the fence-bridge test uses to make real kernel fences",
        includes: &["fixtures/uapi/vgem_drm.h"],
        types: &["drm_vgem_.*"],
        vars: &["DRM_IOCTL_VGEM_.*", "VGEM_FENCE_.*"],
        no_default: &[],
    },
    UapiBinding {
        out: "crates/isp-v4l2/src/sys/uapi.rs",
        purpose: "V4L2 capture: capabilities, formats, buffers (MMAP, EXPBUF, DMABUF) and streaming",
        includes: &["linux/videodev2.h"],
        types: &[
            "v4l2_capability",
            "v4l2_fmtdesc",
            "v4l2_frmsizeenum",
            "v4l2_format",
            "v4l2_streamparm",
            "v4l2_requestbuffers",
            "v4l2_buffer",
            "v4l2_exportbuffer",
            "v4l2_buf_type",
            "v4l2_memory",
            "v4l2_field",
            "v4l2_frmsizetypes",
        ],
        vars: &[
            "VIDIOC_(QUERYCAP|ENUM_FMT|ENUM_FRAMESIZES|G_FMT|S_FMT|S_PARM|REQBUFS|QUERYBUF|EXPBUF|QBUF|DQBUF|STREAMON|STREAMOFF)",
            "V4L2_CAP_(VIDEO_CAPTURE|STREAMING|DEVICE_CAPS)",
            "V4L2_BUF_FLAG_(ERROR|MAPPED|QUEUED|DONE)",
            "V4L2_PIX_FMT_(NV12|YUYV|YUV420|RGB24|MJPEG)",
        ],
        // Unions (and the structs holding them) would get an `unsafe` zeroing `Default`; the
        // safe layer (`sys::ioctl`) builds them itself.
        no_default: &[
            "v4l2_format",
            "v4l2_buffer",
            "v4l2_streamparm",
            "v4l2_frmsizeenum",
            "v4l2_pix_format",
            "v4l2_window",
            "v4l2_clip",
            "v4l2_plane",
            "v4l2_pix_format_mplane",
            ".*__bindgen_ty_.*",
        ],
    },
    UapiBinding {
        out: "crates/npu-hal/src/sys/uapi.rs",
        purpose: "accel device discovery: /dev/accel/accel* nodes answer the DRM core ioctls",
        includes: &["drm.h"],
        types: &["drm_version", "drm_get_cap"],
        vars: &["DRM_IOCTL_VERSION", "DRM_IOCTL_GET_CAP"],
        no_default: &["drm_version"],
    },
];

/// Why codegen could not finish.
#[derive(Debug)]
pub(crate) enum Error {
    /// libclang could not be opened, so bindgen cannot run.
    LibclangMissing,
    /// A header the generator reads is not installed.
    HeaderMissing {
        header: PathBuf,
        package: &'static str,
    },
    /// bindgen failed on a header set.
    Bindgen {
        out: &'static str,
        message: String,
    },
    /// rustfmt failed or is missing.
    Rustfmt(String),
    /// `--check` found files that differ from what the generators make.
    Stale(Vec<PathBuf>),
    Io(PathBuf, std::io::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::LibclangMissing => write!(
                f,
                "libclang is not installed, so bindgen cannot read the kernel headers; \
                 install it (Debian/Ubuntu: `apt-get install libclang1-14`, or set LIBCLANG_PATH)"
            ),
            Error::HeaderMissing { header, package } => write!(
                f,
                "header {} is missing; install it (Debian/Ubuntu: `apt-get install {package}`)",
                header.display()
            ),
            Error::Bindgen { out, message } => write!(f, "bindgen failed for {out}: {message}"),
            Error::Rustfmt(msg) => write!(f, "rustfmt failed: {msg}"),
            Error::Stale(paths) => {
                write!(f, "generated files are stale, run `cargo xtask codegen`:")?;
                for p in paths {
                    write!(f, "\n  {}", p.display())?;
                }
                Ok(())
            }
            Error::Io(path, e) => write!(f, "{}: {e}", path.display()),
        }
    }
}

impl std::error::Error for Error {}

/// Whether generated files are written or only compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Write,
    Check,
}

/// Runs every generator. In [`Mode::Check`] nothing is written and stale files are an error.
pub(crate) fn run(root: &Path, mode: Mode) -> Result<(), Error> {
    if !libclang_available() {
        return Err(Error::LibclangMissing);
    }
    let mut stale = Vec::new();
    for binding in UAPI_BINDINGS {
        let text = generate_uapi(root, binding)?;
        if let Some(path) = ensure_file(root, binding.out, &text, mode)? {
            stale.push(path);
        }
    }
    if stale.is_empty() {
        Ok(())
    } else {
        Err(Error::Stale(stale))
    }
}

/// Whether libclang can be opened, the one tool the generators need beyond the toolchain.
pub(crate) fn libclang_available() -> bool {
    // clang-sys's runtime loader searches the same paths bindgen will use.
    bindgen::clang_version().parsed.is_some()
}

/// The one writer: in write mode updates `rel` when its contents differ; in check mode returns the
/// path when it is stale.
fn ensure_file(
    root: &Path,
    rel: &str,
    contents: &str,
    mode: Mode,
) -> Result<Option<PathBuf>, Error> {
    let path = root.join(rel);
    let current = std::fs::read_to_string(&path).ok();
    if current.as_deref() == Some(contents) {
        return Ok(None);
    }
    match mode {
        Mode::Check => Ok(Some(path)),
        Mode::Write => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| Error::Io(dir.to_owned(), e))?;
            }
            std::fs::write(&path, contents).map_err(|e| Error::Io(path.clone(), e))?;
            eprintln!("codegen: updated {rel}");
            Ok(None)
        }
    }
}

/// Where an include lives and which package ships it; `fixtures/...` is a header committed to the
/// workspace (one no Debian package ships), read from the workspace root.
fn header_path(root: &Path, include: &str) -> (PathBuf, &'static str) {
    if include.starts_with("fixtures/") {
        (
            root.join(include),
            "the workspace's fixtures (git checkout)",
        )
    } else if include.starts_with("linux/") {
        (Path::new(KERNEL_INCLUDE).join(include), "linux-libc-dev")
    } else {
        (Path::new(DRM_INCLUDE).join(include), "libdrm-dev")
    }
}

fn generate_uapi(root: &Path, binding: &UapiBinding) -> Result<String, Error> {
    let mut source = String::new();
    for include in binding.includes {
        let (path, package) = header_path(root, include);
        if !path.exists() {
            return Err(Error::HeaderMissing {
                header: path,
                package,
            });
        }
        if include.starts_with("fixtures/") {
            source.push_str(&format!("#include \"{}\"\n", path.display()));
        } else {
            source.push_str(&format!("#include <{include}>\n"));
        }
    }
    // clang_macro_fallback evaluates macros against real header files (not `header_contents`),
    // so the include list is written to a scratch header first.
    let scratch = std::env::temp_dir().join(format!("xtask-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| Error::Io(scratch.clone(), e))?;
    let header = scratch.join("uapi.h");
    std::fs::write(&header, &source).map_err(|e| Error::Io(header.clone(), e))?;
    let mut builder = bindgen::Builder::default()
        .header(header.display().to_string())
        .clang_macro_fallback_build_dir(&scratch)
        .clang_arg(format!("-I{DRM_INCLUDE}"))
        .use_core()
        .layout_tests(true)
        .derive_default(true)
        .derive_debug(true)
        .generate_comments(true)
        .clang_macro_fallback()
        .formatter(bindgen::Formatter::None);
    for t in binding.types {
        builder = builder.allowlist_type(t);
    }
    for v in binding.vars {
        builder = builder.allowlist_var(v);
    }
    for t in binding.no_default {
        builder = builder.no_default(*t);
    }
    let generated = builder.generate();
    let _ = std::fs::remove_dir_all(&scratch);
    let bindings = generated.map_err(|e| Error::Bindgen {
        out: binding.out,
        message: e.to_string(),
    })?;
    let headers: Vec<String> = binding
        .includes
        .iter()
        .map(|i| match i.strip_prefix("fixtures/") {
            // Named relative to the workspace, so the generated file does not depend on where
            // the checkout is.
            Some(_) => (*i).to_owned(),
            None => header_path(root, i).0.display().to_string(),
        })
        .collect();
    let raw = format!(
        "//! Linux UAPI for {purpose}.\n\
         //!\n\
         //! Generated by `cargo xtask codegen` from {headers}; do not edit.\n\
         //! Layout assertions below are compile-time: a header that disagrees fails the build.\n\n\
         #![allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code)]\n\
         #![allow(clippy::all, unreachable_pub, missing_debug_implementations)]\n\n\
         {body}",
        purpose = binding.purpose,
        headers = headers.join(", "),
        body = bindings,
    );
    rustfmt(&raw)
}

/// Formats `source` exactly as `cargo fmt` would (edition from the workspace, no config file).
fn rustfmt(source: &str) -> Result<String, Error> {
    use std::io::Write;
    let mut child = Command::new(std::env::var("RUSTFMT").unwrap_or_else(|_| "rustfmt".into()))
        .args(["--edition", "2024", "--emit", "stdout"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            Error::Rustfmt(format!(
                "cannot start rustfmt ({e}); `rustup component add rustfmt`"
            ))
        })?;
    let mut stdin = child.stdin.take().expect("stdin was piped");
    let input = source.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let output = child
        .wait_with_output()
        .map_err(|e| Error::Rustfmt(e.to_string()))?;
    writer
        .join()
        .map_err(|_| Error::Rustfmt("stdin writer panicked".into()))?
        .map_err(|e| Error::Rustfmt(e.to_string()))?;
    if !output.status.success() {
        return Err(Error::Rustfmt(
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ));
    }
    String::from_utf8(output.stdout).map_err(|e| Error::Rustfmt(e.to_string()))
}
