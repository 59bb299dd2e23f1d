//! `pipeline isp` end to end: a pattern frame to PNG and raw RGB, a Y4M file, and clear errors.

use std::process::Command;

fn pipeline() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pipeline"))
}

#[test]
fn isp_writes_what_the_model_sees() {
    let dir = std::env::temp_dir().join(format!("pipeline-isp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let raw = dir.join("frame.rgb");
    let status = pipeline()
        .args([
            "isp",
            "--source",
            "pattern:320x240@30:i420",
            "--frame",
            "2",
            "--size",
            "64x48",
            "--matrix",
            "bt709",
        ])
        .args(["--range", "full", "--out"])
        .arg(&raw)
        .status()
        .unwrap();
    assert!(status.success());
    let bytes = std::fs::read(&raw).unwrap();
    assert_eq!(bytes.len(), 64 * 48 * 3);
    let png = dir.join("frame.png");
    assert!(
        pipeline()
            .args(["isp", "--source", "pattern:64x64@30", "--out"])
            .arg(&png)
            .status()
            .unwrap()
            .success()
    );
    assert!(image::open(&png).is_ok());

    // A Y4M file: frame 1 of 2.
    let y4m = dir.join("clip.y4m");
    let mut data = b"YUV4MPEG2 W16 H8 F25:1 C420jpeg\n".to_vec();
    for f in 0..2u8 {
        data.extend_from_slice(b"FRAME\n");
        data.extend(std::iter::repeat_n(100 + f * 50, 16 * 8));
        data.extend(std::iter::repeat_n(128u8, 2 * 8 * 4));
    }
    std::fs::write(&y4m, data).unwrap();
    let out = dir.join("y4m.rgb");
    let status = pipeline()
        .args([
            "isp",
            "--source",
            &format!("file:{}", y4m.display()),
            "--frame",
            "1",
            "--size",
            "16x8",
            "--range",
            "full",
            "--out",
        ])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        std::fs::read(&out).unwrap().iter().all(|&b| b == 150),
        "grey 150 in full range stays 150"
    );

    // Errors name the problem and exit non-zero.
    let o = pipeline()
        .args([
            "isp",
            "--source",
            "file:/no/such.y4m",
            "--out",
            "/tmp/x.rgb",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("/no/such.y4m"));
    let o = pipeline()
        .args([
            "isp",
            "--source",
            &format!("file:{}", y4m.display()),
            "--frame",
            "5",
            "--out",
            "/tmp/x.rgb",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("ends before frame 5"));
    let o = pipeline()
        .args([
            "isp",
            "--source",
            "camera:/dev/video0",
            "--out",
            "/tmp/x.rgb",
        ])
        .output()
        .unwrap();
    // Cameras are in the default build; where /dev/video0 is absent the error names the node.
    // Never a success.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    if !std::path::Path::new("/dev/video0").exists() {
        assert!(err.contains("/dev/video0"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
