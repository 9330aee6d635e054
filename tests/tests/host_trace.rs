//! Host-side spans (submission, synchronisation) go to a Chrome trace of their
//! own through `tracing-chrome`.

use braid::trace::HostTraceGuard;
use braid::{BackendKind, Runtime};

#[test]
fn host_spans_are_written_as_a_chrome_trace() {
    let path = std::env::temp_dir().join(format!("braid-host-{}.json", std::process::id()));
    {
        let _guard = HostTraceGuard::start(&path);
        let rt = Runtime::builder()
            .backend(BackendKind::Cpu)
            .build()
            .unwrap();
        let x = rt.alloc("x", 16).unwrap();
        for _ in 0..3 {
            rt.task("work").run(x.read_write::<u8>(), |_| ()).unwrap();
        }
        rt.synchronize().unwrap();
    }
    let text = std::fs::read_to_string(&path).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = doc
        .as_array()
        .expect("tracing-chrome writes an array of events");
    let named = |n: &str| events.iter().filter(|e| e["name"] == n).count();
    assert!(named("submit") >= 3, "{text}");
    assert!(named("synchronize") >= 1, "{text}");
    std::fs::remove_file(&path).unwrap();
}
