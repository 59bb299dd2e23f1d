//! No fd leaks: allocating, accessing and dropping buffers (and failing to open absent devices)
//! leaves `/proc/self/fd` as it was. Alone in its test binary, so no other test opens fds
//! meanwhile.

use uvm_alloc::{Access, Allocator, AllocatorDesc, UnifiedBuffer};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn no_fd_leaks() {
    // Warm up lazily opened process state (page size, memfd support) first.
    drop(UnifiedBuffer::memfd(4096).unwrap());
    let before = open_fds();
    let allocator = Allocator::new(AllocatorDesc::default()).unwrap();
    for i in 0..64 {
        let buffers = [
            allocator.allocate(4096 * (i + 1)).unwrap(),
            UnifiedBuffer::memfd(4096).unwrap(),
            UnifiedBuffer::host(4096).unwrap(),
        ];
        for b in &buffers {
            drop(b.cpu_access(0..64, Access::ReadWrite).unwrap());
        }
        let _ = UnifiedBuffer::udmabuf(4096);
        let _ = UnifiedBuffer::dma_heap("system", 4096);
    }
    assert_eq!(open_fds(), before, "fds leaked");
}
