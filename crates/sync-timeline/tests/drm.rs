//! DRM syncobj timelines. The hardware tests need a render node whose driver supports timeline
//! syncobjs; they are ignored in plain `cargo test` (so an absent device never reads as a pass)
//! and run by `cargo test -- --ignored` on a device (the device-test campaign).
#![cfg(feature = "drm")]

use std::sync::Arc;
use std::time::Duration;

use sync_timeline::drm::{RenderNode, SyncobjTimeline};
use sync_timeline::{Error, Timeline};

#[test]
fn an_absent_render_node_names_itself() {
    if std::path::Path::new("/dev/dri").exists() {
        return; // this machine has DRM; the hardware tests below cover it
    }
    match RenderNode::discover() {
        Err(Error::Unsupported { what, why }) => {
            assert_eq!(what, "DRM render node");
            assert!(why.contains("/dev/dri"), "{why}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
#[ignore = "hardware: needs a DRM render node with timeline syncobjs (cargo test -- --ignored on a device)"]
fn syncobj_timeline_signal_wait_query() {
    let node = Arc::new(RenderNode::discover().expect("a render node with timeline syncobjs"));
    let t = SyncobjTimeline::new(node).unwrap();
    assert_eq!(t.value().unwrap(), 0);
    t.signal(4).unwrap();
    assert_eq!(t.value().unwrap(), 4);
    assert_eq!(
        t.signal(2),
        Err(Error::Backwards {
            current: 4,
            requested: 2
        })
    );
    t.wait(4, Duration::from_secs(1)).unwrap();
    assert!(matches!(
        t.wait(5, Duration::from_millis(20)),
        Err(Error::Timeout {
            wanted: 5,
            reached: 4,
            ..
        })
    ));
}

#[test]
#[ignore = "hardware: needs a DRM render node with timeline syncobjs (cargo test -- --ignored on a device)"]
fn sync_file_round_trip_of_a_point() {
    let node = Arc::new(RenderNode::discover().expect("a render node with timeline syncobjs"));
    let a = SyncobjTimeline::new(Arc::clone(&node)).unwrap();
    let b = SyncobjTimeline::new(node).unwrap();
    a.signal(3).unwrap();
    let fence = a.export_sync_file(3).unwrap();
    b.import_sync_file(std::os::fd::AsFd::as_fd(&fence), 7)
        .unwrap();
    b.wait(7, Duration::from_secs(1)).unwrap();
}

#[test]
#[ignore = "hardware: needs a DRM render node with timeline syncobjs (cargo test -- --ignored on a device)"]
fn transfer_between_timelines() {
    let node = Arc::new(RenderNode::discover().expect("a render node with timeline syncobjs"));
    let a = SyncobjTimeline::new(Arc::clone(&node)).unwrap();
    let b = SyncobjTimeline::new(node).unwrap();
    a.signal(2).unwrap();
    a.transfer_to(2, &b, 5).unwrap();
    b.wait(5, Duration::from_secs(1)).unwrap();
}
