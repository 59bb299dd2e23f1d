//! Allocation over the backends this machine has (memfd and host memory everywhere; DMA-BUF
//! heaps, udmabuf and GBM where the devices exist), sizes, CPU access guards, fallback reports
//! and fd hygiene.

use std::path::Path;

use uvm_alloc::{
    Access, Allocator, AllocatorDesc, Backend, BackendKind, Error, UnifiedBuffer, rounded_size,
};

#[test]
fn sizes_are_rounded_and_checked() {
    let page = rustix::param::page_size();
    assert_eq!(rounded_size(1, 64).unwrap(), page);
    assert_eq!(rounded_size(page + 1, 128).unwrap(), 2 * page);
    assert_eq!(rounded_size(0, 64), Err(Error::ZeroSize));
    assert_eq!(
        rounded_size(usize::MAX - 3, 64),
        Err(Error::TooLarge {
            size: usize::MAX - 3
        })
    );
    assert!(matches!(
        Allocator::new(AllocatorDesc {
            cache_line: 96,
            ..Default::default()
        }),
        Err(Error::BadCacheLine { cache_line: 96 })
    ));
    for make in [UnifiedBuffer::memfd, UnifiedBuffer::host] {
        assert_eq!(make(0).unwrap_err(), Error::ZeroSize);
        let b = make(1000).unwrap();
        assert_eq!((b.len(), b.mapped_len()), (1000, page));
        assert_eq!(b.as_ptr() as usize % page, 0, "mappings are page aligned");
    }
}

#[test]
fn the_allocator_falls_back_and_says_why() {
    let allocator = Allocator::new(AllocatorDesc::default()).unwrap();
    let buffer = allocator.allocate(1 << 20).unwrap();
    // Every refusal names its backend and the device or call that refused.
    for refusal in buffer.refusals() {
        assert!(!refusal.reason.is_empty());
        eprintln!("refused: {refusal}");
    }
    let refused: Vec<BackendKind> = buffer.refusals().iter().map(|r| r.backend).collect();
    if !Path::new("/dev/dma_heap").exists() {
        assert!(refused.contains(&BackendKind::DmaHeap));
        let why = &buffer
            .refusals()
            .iter()
            .find(|r| r.backend == BackendKind::DmaHeap)
            .unwrap()
            .reason;
        assert!(why.contains("/dev/dma_heap/system"), "{why}");
    }
    if !Path::new("/dev/udmabuf").exists() {
        let why = &buffer
            .refusals()
            .iter()
            .find(|r| r.backend == BackendKind::Udmabuf)
            .unwrap()
            .reason;
        assert!(why.contains("/dev/udmabuf"), "{why}");
    }
    assert!(!refused.contains(&buffer.backend().kind()));
    // When nothing works, the error lists every refusal.
    let only_absent = Allocator::new(AllocatorDesc {
        backends: vec![BackendKind::DmaHeap],
        heaps: vec!["no-such-heap".into()],
        ..Default::default()
    })
    .unwrap();
    match only_absent.allocate(4096) {
        Err(Error::NoBackend { refusals }) => {
            assert_eq!(refusals.len(), 1);
            assert!(
                refusals[0].reason.contains("/dev/dma_heap/no-such-heap"),
                "{}",
                refusals[0].reason
            );
        }
        other => panic!("expected NoBackend, got {other:?}"),
    }
}

#[test]
fn absent_devices_name_themselves() {
    if !Path::new("/dev/udmabuf").exists() {
        let err = UnifiedBuffer::udmabuf(4096).unwrap_err();
        assert!(
            matches!(&err, Error::Unavailable { backend: BackendKind::Udmabuf, why } if why.contains("/dev/udmabuf")),
            "{err}"
        );
    }
    if !Path::new("/dev/dma_heap/system").exists() {
        let err = UnifiedBuffer::dma_heap("system", 4096).unwrap_err();
        assert!(err.to_string().contains("/dev/dma_heap/system"), "{err}");
    }
}

#[test]
fn cpu_access_is_scoped_typed_and_exclusive() {
    for buffer in [
        UnifiedBuffer::memfd(4096).unwrap(),
        UnifiedBuffer::host(4096).unwrap(),
    ] {
        {
            let mut w = buffer.cpu_access(0..4096, Access::Write).unwrap();
            let words: &mut [u32] = w.typed_mut().unwrap();
            for (i, v) in words.iter_mut().enumerate() {
                *v = i as u32 * 3;
            }
            // A writer excludes every other access.
            assert!(matches!(
                buffer.cpu_access(0..4, Access::Read),
                Err(Error::AccessConflict { .. })
            ));
        }
        let r1 = buffer.cpu_access(8..16, Access::Read).unwrap();
        let r2 = buffer.cpu_access(0..4096, Access::Read).unwrap();
        assert_eq!(r1.typed::<u32>().unwrap(), &[6, 9]);
        assert_eq!(r2.typed::<u32>().unwrap()[1000], 3000);
        assert!(matches!(
            buffer.cpu_access(0..4, Access::Write),
            Err(Error::AccessConflict { .. })
        ));
        let mut r3 = buffer.cpu_access(0..4, Access::Read).unwrap();
        assert_eq!(r3.bytes_mut().unwrap_err(), Error::ReadOnlyAccess);
        assert!(matches!(
            buffer
                .cpu_access(1..3, Access::Read)
                .unwrap()
                .typed::<u32>(),
            Err(Error::BadView { .. })
        ));
        assert!(matches!(
            buffer.cpu_access(0..4097, Access::Read),
            Err(Error::OutOfBounds { .. })
        ));
    }
}

#[test]
fn memfd_buffers_are_shareable() {
    let buffer = UnifiedBuffer::memfd(8192).unwrap();
    assert_eq!(buffer.backend(), &Backend::Memfd);
    buffer
        .cpu_access(0..8, Access::Write)
        .unwrap()
        .bytes_mut()
        .unwrap()
        .copy_from_slice(b"unified!");
    // Map the same fd a second time, as another process would, and see the same bytes.
    let fd = buffer.fd().unwrap();
    let second = rustix::io::dup(fd).unwrap();
    let mut read = [0u8; 8];
    rustix::io::pread(&second, &mut read, 0).unwrap();
    assert_eq!(&read, b"unified!");
    // Sealed: the size cannot change under a device that imported it.
    assert!(rustix::fs::ftruncate(&second, 4096).is_err());
}

#[test]
#[ignore = "hardware: needs /dev/dma_heap/system (cargo test -- --ignored on a device)"]
fn dma_heap_buffers_sync_cpu_access() {
    let buffer = UnifiedBuffer::dma_heap("system", 1 << 20).expect("a system DMA-BUF heap");
    assert!(buffer.is_dma_buf());
    buffer
        .cpu_access(0..16, Access::Write)
        .unwrap()
        .bytes_mut()
        .unwrap()
        .fill(0xA5);
    assert!(
        buffer
            .cpu_access(0..16, Access::Read)
            .unwrap()
            .bytes()
            .iter()
            .all(|&b| b == 0xA5)
    );
}

#[test]
#[ignore = "hardware: needs /dev/udmabuf (cargo test -- --ignored on a device)"]
fn udmabuf_buffers_sync_cpu_access() {
    let buffer = UnifiedBuffer::udmabuf(1 << 20).expect("/dev/udmabuf");
    assert!(buffer.is_dma_buf());
    buffer
        .cpu_access(0..16, Access::Write)
        .unwrap()
        .bytes_mut()
        .unwrap()
        .fill(0x5A);
    assert!(
        buffer
            .cpu_access(0..16, Access::Read)
            .unwrap()
            .bytes()
            .iter()
            .all(|&b| b == 0x5A)
    );
}

#[test]
fn importing_an_fd_that_is_not_a_dma_buf_is_refused_by_name() {
    let file = std::fs::File::open("/proc/self/exe").unwrap();
    let err = uvm_alloc::UnifiedBuffer::import_dma_buf(file.into(), 4096, "test").unwrap_err();
    assert!(err.to_string().contains("dma-buf"), "{err}");
}

#[test]
#[ignore = "hardware: needs a DMA-BUF heap (/dev/dma_heap/system) to export a dma-buf to import"]
fn a_dma_buf_from_a_heap_imports_and_reads_back_what_was_written() {
    use std::os::fd::AsFd;
    let original = uvm_alloc::UnifiedBuffer::dma_heap("system", 8192).unwrap();
    {
        let mut w = original
            .cpu_access(0..8192, uvm_alloc::Access::Write)
            .unwrap();
        w.bytes_mut().unwrap().fill(0x5a);
    }
    let dup = original.fd().unwrap().as_fd().try_clone_to_owned().unwrap();
    let imported = uvm_alloc::UnifiedBuffer::import_dma_buf(dup, 8192, "heap").unwrap();
    assert_eq!(imported.backend().kind(), uvm_alloc::BackendKind::Imported);
    let r = imported
        .cpu_access(0..8192, uvm_alloc::Access::Read)
        .unwrap();
    assert!(r.bytes().iter().all(|&b| b == 0x5a));
}
