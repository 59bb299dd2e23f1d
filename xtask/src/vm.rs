//! The VM device lab behind `cargo xtask device-test --vm`: a qemu guest (TCG: the host is itself
//! a guest, so KVM cannot run a stock kernel) booting Debian's Linux 6.12, whose real drivers
//! give this workspace the kernel interfaces the host lacks:
//!
//! | interface | driver in the guest |
//! |---|---|
//! | DMA-BUF heaps (`/dev/dma_heap/system`) | built in (`CONFIG_DMABUF_HEAPS_SYSTEM`) |
//! | udmabuf | built in (`CONFIG_UDMABUF`) |
//! | V4L2 capture, MMAP + EXPBUF and DMABUF import | `vivid` (one capture node) |
//! | DRM syncobj timelines, sync_file export | `virtio_gpu` (`-device virtio-gpu-pci`) |
//! | real kernel fences on a dma-buf | `vgem` |
//!
//! What it fetches, all through apt: `qemu-system-x86` and `xz-utils`, installed as packages
//! when missing (qemu needs its shared libraries); `busybox-static` and the kernel `.deb`
//! (`linux-image-6.12.*-amd64-unsigned`, the version `linux-image-6.12-amd64` depends on now,
//! because older builds leave the archive), downloaded with `apt-get download`, unpacked with
//! `dpkg -x` under `target/vm/` and reused from there, never installed (the kernel never reaches
//! `/boot`).
//!
//! The guest's initramfs is busybox, the modules the lab needs (with their dependencies, from
//! each module's own `depends=` entry) and an `/init` that loads them, mounts the host's root
//! read-only over 9p under a tmpfs overlay, chroots into it and runs this xtask's guest half
//! (`device-test --guest PLAN`). The host's test binaries therefore run unchanged, as root, and
//! write their results into a second, writable 9p share (`target/vm/run`).
//!
//! Results from here are real-driver results over virtual devices, not real silicon; the
//! report's `environment` object says so.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The kernel series the lab boots: Debian 12's backported 6.12 (the default 6.1 has no heaps and
/// no udmabuf).
const KERNEL_META_PACKAGE: &str = "linux-image-6.12-amd64";
/// Host packages the lab runs on.
const HOST_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "/usr/bin/qemu-system-x86_64"),
    ("xz-utils", "/usr/bin/xz"),
];
/// The guest's userland: one static binary, unpacked (not installed) from this package.
const BUSYBOX_PACKAGE: &str = "busybox-static";
/// Modules the guest loads, with their parameters; their dependencies are loaded first.
const MODULES: &[(&str, &str)] = &[
    ("9pnet_virtio", ""),
    ("9p", ""),
    ("overlay", ""),
    // One capture node only: the tests pick the first camera, and probing fewer nodes is faster.
    ("vivid", "n_devs=1 node_types=0x1"),
    ("vgem", ""),
    ("virtio_gpu", ""),
];
/// Drivers built into the kernel that the lab's tests use (no module to load).
const BUILT_IN: &[&str] = &["dma-buf heaps (system)", "udmabuf", "sync_file"];
/// Guest memory and CPUs: enough for the chain test's tiny models, small enough for CI.
const GUEST_MEMORY_MIB: u32 = 2048;
const GUEST_CPUS: u32 = 2;
/// How long the whole guest run may take before it is stopped.
const RUN_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A prepared lab: packages present, kernel unpacked.
#[derive(Debug)]
pub(crate) struct Lab {
    /// `target/vm`.
    dir: PathBuf,
    kernel_version: String,
    vmlinuz: PathBuf,
    /// `lib/modules/VERSION` of the unpacked kernel.
    modules: PathBuf,
    /// The static busybox unpacked from [`BUSYBOX_PACKAGE`].
    busybox: PathBuf,
}

/// What a guest run left.
#[derive(Debug)]
pub(crate) struct GuestOutput {
    pub(crate) environment: Value,
    pub(crate) devices: Value,
    pub(crate) results: Vec<Value>,
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

impl Lab {
    /// Installs the host packages if missing and fetches (or reuses) the kernel.
    pub(crate) fn prepare(root: &Path) -> Result<Lab> {
        let dir = root.join("target/vm");
        std::fs::create_dir_all(&dir)?;
        ensure_host_packages()?;
        let busybox =
            unpack_package(&dir, BUSYBOX_PACKAGE, &dir.join("busybox"))?.join("bin/busybox");
        let (kernel_version, unpacked) = ensure_kernel(&dir)?;
        let vmlinuz = unpacked.join(format!("boot/vmlinuz-{kernel_version}"));
        let modules = unpacked.join(format!("lib/modules/{kernel_version}"));
        for p in [&vmlinuz, &modules, &busybox] {
            if !p.exists() {
                return Err(format!("the unpacked kernel lacks {}", p.display()).into());
            }
        }
        Ok(Lab {
            dir,
            kernel_version,
            vmlinuz,
            modules,
            busybox,
        })
    }

    /// Boots the guest on `plan` (written to `target/vm/run/plan.json`), streams its console,
    /// and collects what the guest half wrote.
    pub(crate) fn run_plan(&self, plan: &Value) -> Result<GuestOutput> {
        let run = self.dir.join("run");
        let _ = std::fs::remove_dir_all(&run);
        std::fs::create_dir_all(&run)?;
        let run = run.canonicalize()?;
        let plan_path = run.join("plan.json");
        std::fs::write(&plan_path, serde_json::to_string_pretty(plan)? + "\n")?;
        let xtask = std::env::current_exe()?.canonicalize()?;
        let modules = self.module_load_order()?;
        let initrd = self.dir.join("initrd.cpio");
        write_initramfs(
            &initrd,
            &self.busybox,
            &self.init_script(&run, &xtask, &modules),
            &modules,
        )?;

        let console_path = self.dir.join("console.log");
        let mut console = std::fs::File::create(&console_path)?;
        println!(
            "booting Linux {} under qemu (TCG, {GUEST_CPUS} vCPU, {GUEST_MEMORY_MIB} MiB); console in {}",
            self.kernel_version,
            console_path.display()
        );
        let mut child = Command::new("qemu-system-x86_64")
            .args(["-accel", "tcg", "-cpu", "max", "-nographic", "-no-reboot"])
            .args(["-m", &GUEST_MEMORY_MIB.to_string()])
            .args(["-smp", &GUEST_CPUS.to_string()])
            .arg("-kernel")
            .arg(&self.vmlinuz)
            .arg("-initrd")
            .arg(&initrd)
            .args([
                "-append",
                "console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init",
            ])
            .args([
                "-virtfs",
                "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            ])
            .arg("-virtfs")
            .arg(format!(
                "local,path={},mount_tag=labout,security_model=none,multidevs=remap",
                run.display()
            ))
            .args(["-device", "virtio-gpu-pci", "-nic", "none"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start qemu-system-x86_64: {e}"))?;
        let stdout = child.stdout.take().expect("stdout was piped");
        let stderr = child.stderr.take().expect("stderr was piped");
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(|l| l.ok())
            {
                let _ = tx.send(line);
            }
        });
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(|l| l.ok())
            {
                let _ = tx2.send(format!("qemu: {line}"));
            }
        });
        let start = Instant::now();
        let mut timed_out = false;
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => {
                    // The serial console ends lines with \r\n, and the firmware clears the
                    // screen with escape sequences: keep printable text only.
                    let line = printable(&line);
                    writeln!(console, "{line}")?;
                    println!("vm | {line}");
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
            if start.elapsed() > RUN_TIMEOUT {
                timed_out = true;
                let _ = child.kill();
                break;
            }
        }
        let status = child.wait()?;
        println!(
            "guest ended after {:.0} s ({status})",
            start.elapsed().as_secs_f64()
        );
        if timed_out {
            println!("the guest ran past {RUN_TIMEOUT:?} and was stopped");
        }

        let read_json = |name: &str| -> Option<Value> {
            serde_json::from_str(&std::fs::read_to_string(run.join(name)).ok()?).ok()
        };
        let devices = read_json("devices.json").unwrap_or_else(
            || json!({ "error": "the guest wrote no device report (see target/vm/console.log)" }),
        );
        let guest = read_json("guest.json").unwrap_or(Value::Null);
        let results = std::fs::read_to_string(run.join("results.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let qemu = Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.lines().next().map(str::to_owned))
            .unwrap_or_default();
        let environment = json!({
            "kind": "vm",
            "note": "real kernel drivers over virtual devices (vivid, vgem, virtio-gpu) in a qemu \
                     guest: not real silicon",
            "kernel": guest["kernel"].as_str().unwrap_or(&self.kernel_version),
            "machine": format!("{qemu}, TCG, {GUEST_CPUS} vCPU, {GUEST_MEMORY_MIB} MiB"),
            "modules_loaded": guest["modules"].clone(),
            "built_in": BUILT_IN,
        });
        Ok(GuestOutput {
            environment,
            devices,
            results,
        })
    }

    /// The lab's modules and their dependencies, dependencies first, each once.
    fn module_load_order(&self) -> Result<Vec<Module>> {
        let mut index = std::collections::HashMap::new();
        let mut stack = vec![self.modules.join("kernel")];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir)? {
                let path = entry?.path();
                if path.is_dir() {
                    stack.push(path);
                } else if let Some(stem) = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".ko.xz"))
                {
                    index.insert(stem.replace('-', "_"), path.clone());
                }
            }
        }
        let mut order: Vec<Module> = Vec::new();
        fn visit(
            name: &str,
            params: &str,
            index: &std::collections::HashMap<String, PathBuf>,
            order: &mut Vec<Module>,
            depth: usize,
        ) -> Result<()> {
            let key = name.replace('-', "_");
            if order.iter().any(|m| m.name == key) {
                return Ok(());
            }
            if depth > 32 {
                return Err(format!("module dependencies of {name} loop").into());
            }
            let path = index
                .get(&key)
                .ok_or_else(|| format!("the kernel has no module {name}"))?;
            let bytes = decompress(path)?;
            for dep in module_depends(&bytes) {
                visit(&dep, "", index, order, depth + 1)?;
            }
            order.push(Module {
                name: key,
                params: params.to_owned(),
                bytes,
            });
            Ok(())
        }
        for (name, params) in MODULES {
            visit(name, params, &index, &mut order, 0)?;
        }
        Ok(order)
    }

    /// The guest's `/init`: load modules, mount the host root under an overlay, run the plan.
    /// Nothing is mounted over the host's directories but `/proc`, `/sys` and `/dev` (the
    /// overlay's tmpfs upper already makes `/tmp` writable): the workspace, and so the run
    /// directory, may live anywhere, `/tmp` included.
    fn init_script(&self, run: &Path, xtask: &Path, modules: &[Module]) -> String {
        let mut s = String::from(
            "#!/bin/busybox sh\n\
             /bin/busybox --install -s /bin\n\
             export PATH=/bin\n\
             mount -t proc proc /proc\n\
             mount -t sysfs sysfs /sys\n\
             mount -t devtmpfs devtmpfs /dev\n\
             echo \"lab: Linux $(uname -r), $(nproc) CPU(s)\"\n",
        );
        for (i, m) in modules.iter().enumerate() {
            s += &format!(
                "insmod /lib/modules/{i:02}-{}.ko {} || echo \"lab: insmod {} failed\"\n",
                m.name, m.params, m.name
            );
        }
        let run = run.display();
        s += &format!(
            "mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /host || exec poweroff -f\n\
             mount -t tmpfs -o size=1024m tmpfs /rw\n\
             mkdir -p /rw/upper /rw/work\n\
             mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work /newroot || exec poweroff -f\n\
             mount -t proc proc /newroot/proc\n\
             mount -t sysfs sysfs /newroot/sys\n\
             mount -t devtmpfs devtmpfs /newroot/dev\n\
             mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 labout /newroot{run} || exec poweroff -f\n\
             echo \"lab: modules loaded, host root mounted; running the plan\"\n\
             chroot /newroot /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin \
             HOME=/root XDG_RUNTIME_DIR=/run NPU_HAL_WAIT_TIMEOUT_S=1800 CI={ci} {xtask} device-test --guest {run}/plan.json\n\
             echo \"lab: guest runner exited with $?\"\n\
             sync\n\
             poweroff -f\n",
            xtask = xtask.display(),
            // The host's CI flag, so tests that insist on their tools under CI do so in the
            // guest too.
            ci = if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                "true"
            } else {
                ""
            },
        );
        s
    }
}

/// `line` without terminal control sequences (`ESC [ ... letter`) and other control characters.
fn printable(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // Parameters and intermediates, then one final byte in @..~.
                for d in chars.by_ref() {
                    if ('@'..='~').contains(&d) {
                        break;
                    }
                }
            } else {
                chars.next();
            }
        } else if !c.is_control() || c == '\t' {
            out.push(c);
        }
    }
    out
}

/// One module for the initramfs, decompressed.
struct Module {
    name: String,
    params: String,
    bytes: Vec<u8>,
}

/// Installs whichever of [`HOST_PACKAGES`] is missing (as root, or through sudo).
fn ensure_host_packages() -> Result<()> {
    let missing: Vec<&str> = HOST_PACKAGES
        .iter()
        .filter(|(_, file)| !Path::new(file).exists())
        .map(|(p, _)| *p)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    println!("installing {} (apt-get)", missing.join(" "));
    let root = running_as_root();
    let apt = |args: &[&str]| -> Result<()> {
        let mut cmd = if root {
            Command::new("apt-get")
        } else {
            let mut c = Command::new("sudo");
            c.arg("apt-get");
            c
        };
        let status = cmd
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(args)
            .status()
            .map_err(|e| format!("cannot run apt-get: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("apt-get {} failed ({status})", args.join(" ")).into())
        }
    };
    apt(&["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(&missing);
    apt(&args)
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            == Some("0")
    })
}

/// The current 6.12 kernel, unpacked under `dir/kernel/VERSION` (fetched once, then reused):
/// its version and directory.
fn ensure_kernel(dir: &Path) -> Result<(String, PathBuf)> {
    let cached = || -> Option<(String, PathBuf)> {
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir.join("kernel"))
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join(".complete").exists())
            .collect();
        found.sort();
        let p = found.pop()?;
        Some((p.file_name()?.to_string_lossy().into_owned(), p))
    };
    let package = match current_kernel_package() {
        Ok(p) => p,
        Err(e) => {
            if let Some(c) = cached() {
                println!(
                    "apt cannot name the current kernel ({e}); using the cached {}",
                    c.0
                );
                return Ok(c);
            }
            return Err(e);
        }
    };
    let version = package
        .strip_prefix("linux-image-")
        .ok_or_else(|| format!("unexpected kernel package name {package}"))?
        .to_owned();
    let unsigned = format!("{package}-unsigned");
    let unpacked = unpack_package(dir, &unsigned, &dir.join("kernel").join(&version))?;
    Ok((version, unpacked))
}

/// `package` unpacked into `dest` with `dpkg -x` (downloaded with `apt-get download` into
/// `dir/debs`, deleted once unpacked), or `dest` as it is when an earlier run finished unpacking
/// it there.
fn unpack_package(dir: &Path, package: &str, dest: &Path) -> Result<PathBuf> {
    if dest.join(".complete").exists() {
        return Ok(dest.to_owned());
    }
    let debs = dir.join("debs");
    std::fs::create_dir_all(&debs)?;
    println!("fetching {package} (apt-get download; unpacked with dpkg -x, never installed)");
    let download = || {
        Command::new("apt-get")
            .current_dir(&debs)
            .args(["download", "-qq", package])
            .status()
    };
    let mut status = download()?;
    if !status.success() {
        // Lists that never were, or went stale, name no (or a removed) version: refresh once.
        if Command::new("apt-get")
            .args(["update", "-qq"])
            .status()?
            .success()
        {
            status = download()?;
        }
    }
    if !status.success() {
        return Err(format!("apt-get download {package} failed ({status})").into());
    }
    let deb = std::fs::read_dir(&debs)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{package}_")) && n.ends_with(".deb"))
        })
        .ok_or_else(|| format!("apt-get download left no {package} .deb"))?;
    let _ = std::fs::remove_dir_all(dest);
    std::fs::create_dir_all(dest)?;
    let status = Command::new("dpkg")
        .arg("-x")
        .arg(&deb)
        .arg(dest)
        .status()?;
    if !status.success() {
        return Err(format!("dpkg -x {} failed ({status})", deb.display()).into());
    }
    // The .deb is not needed once unpacked; the marker says the unpack finished.
    let _ = std::fs::remove_file(&deb);
    std::fs::write(dest.join(".complete"), "")?;
    Ok(dest.to_owned())
}

/// The versioned image package [`KERNEL_META_PACKAGE`] depends on now, from apt's lists
/// (refreshed once if they do not know it).
fn current_kernel_package() -> Result<String> {
    let query = || -> Option<String> {
        let out = Command::new("apt-cache")
            .args(["depends", KERNEL_META_PACKAGE])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
            let dep = l.trim().strip_prefix("Depends: ")?;
            dep.starts_with("linux-image-6.12.").then(|| dep.to_owned())
        })
    };
    if let Some(p) = query() {
        return Ok(p);
    }
    let status = Command::new("apt-get").args(["update", "-qq"]).status()?;
    if !status.success() {
        return Err(format!("apt-get update failed ({status})").into());
    }
    query().ok_or_else(|| {
        format!(
            "apt knows no {KERNEL_META_PACKAGE} (is Debian's bookworm-security in the sources?)"
        )
        .into()
    })
}

fn decompress(path: &Path) -> Result<Vec<u8>> {
    let out = Command::new("xz").arg("-dc").arg(path).output()?;
    if !out.status.success() {
        return Err(format!("xz -dc {} failed", path.display()).into());
    }
    Ok(out.stdout)
}

/// The `depends=` entry of a module's `.modinfo` (NUL-separated `key=value` strings).
fn module_depends(module: &[u8]) -> Vec<String> {
    module
        .split(|&b| b == 0)
        .find_map(|s| s.strip_prefix(b"depends="))
        .map(|deps| {
            String::from_utf8_lossy(deps)
                .split(',')
                .filter(|d| !d.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Writes the initramfs as an uncompressed `newc` cpio archive: `/init`, busybox, the modules in
/// load order, the mount points, and `/dev/console` (the kernel opens it for init's stdio
/// before anything mounts devtmpfs).
fn write_initramfs(path: &Path, busybox: &Path, init: &str, modules: &[Module]) -> Result<()> {
    let busybox = std::fs::read(busybox)?;
    let mut archive = Cpio::default();
    for d in [
        "bin",
        "dev",
        "proc",
        "sys",
        "lib",
        "lib/modules",
        "host",
        "newroot",
        "rw",
        "tmp",
    ] {
        archive.entry(d, 0o040_755, &[], 0);
    }
    archive.entry("dev/console", 0o020_600, &[], (5 << 8) | 1);
    archive.entry("init", 0o100_755, init.as_bytes(), 0);
    archive.entry("bin/busybox", 0o100_755, &busybox, 0);
    for (i, m) in modules.iter().enumerate() {
        archive.entry(
            &format!("lib/modules/{i:02}-{}.ko", m.name),
            0o100_644,
            &m.bytes,
            0,
        );
    }
    std::fs::write(path, archive.finish())?;
    Ok(())
}

/// A `newc` cpio writer (the initramfs format: `Documentation/driver-api/early-userspace`).
#[derive(Default)]
struct Cpio {
    bytes: Vec<u8>,
    inode: u32,
}

impl Cpio {
    /// Appends one entry; `rdev` is `major << 8 | minor` for device nodes.
    fn entry(&mut self, name: &str, mode: u32, data: &[u8], rdev: u32) {
        self.inode += 1;
        let header = format!(
            "070701{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}",
            self.inode,
            mode,
            0, // uid
            0, // gid
            1, // nlink
            0, // mtime
            data.len(),
            0, // dev major
            0, // dev minor
            rdev >> 8,
            rdev & 0xff,
            name.len() + 1,
            0, // check
        );
        self.bytes.extend_from_slice(header.as_bytes());
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[], 0);
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_depends_reads_the_modinfo_entry() {
        let modinfo = b"\0license=GPL\0depends=videobuf2-common,v4l2-tpg,videodev\0vermagic=6.12\0";
        assert_eq!(
            module_depends(modinfo),
            ["videobuf2-common", "v4l2-tpg", "videodev"]
        );
        assert!(module_depends(b"\0depends=\0").is_empty());
        assert!(module_depends(b"license=GPL").is_empty());
    }

    #[test]
    fn console_lines_lose_escape_sequences() {
        assert_eq!(
            printable("\u{1b}c\u{1b}[?7l\u{1b}[2JBooting from ROM..\r"),
            "Booting from ROM.."
        );
        assert_eq!(printable("lab: ok\t1"), "lab: ok\t1");
    }

    #[test]
    fn cpio_entries_are_newc_and_aligned() {
        let mut c = Cpio::default();
        c.entry("init", 0o100_755, b"#!/bin/sh\n", 0);
        let bytes = c.finish();
        assert!(bytes.starts_with(b"070701"));
        assert_eq!(bytes.len() % 4, 0);
        // Header (110 bytes) + "init\0" (5) padded to 116, then 10 data bytes padded to 12.
        assert_eq!(&bytes[110..114], b"init");
        assert_eq!(&bytes[116..126], b"#!/bin/sh\n");
        assert!(bytes.windows(10).any(|w| w == b"TRAILER!!!"));
    }
}
