//! Raw kernel interfaces, generated: the only place this crate names kernel structs and ioctl
//! request codes. Regenerate with `cargo xtask codegen`; `cargo xtask codegen --check` (also a
//! test) fails when the checked-in file is stale.
//!
//! The request codes use the asm-generic `_IOC` encoding shared by x86, x86-64, arm, aarch64 and
//! riscv; other architectures encode ioctls differently and are refused at compile time.

#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "riscv64"
)))]
compile_error!(
    "the generated UAPI assumes the asm-generic ioctl encoding; regenerate for this architecture"
);

pub(crate) mod ioctl;
pub mod uapi;
