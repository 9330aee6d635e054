//! The CUDA backend: detection, device-timed overlap, ordering through events.
//! GPU tests skip with a message when no device is present and fail instead
//! when `BRAID_REQUIRE_GPU=1`.

use braid::cuda::memory::memcpy_dtod_async;
use braid::cuda::{gpu_or_skip, test_kernels, CudaFunction, KernelArgs, KernelCache, LaunchConfig};
use braid::{BackendKind, Error, Runtime, TaskError};
use std::sync::Arc;

/// A profiled CUDA runtime for `test`, or `None` (after saying so) without a GPU.
fn gpu_runtime(test: &str, streams: usize) -> Option<Runtime> {
    if !gpu_or_skip(test) {
        return None;
    }
    let rt = Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(streams)
        .profile(true)
        .build()
        .expect("CUDA runtime");
    Some(rt)
}

/// Kernel `name` of the engine's spin test kernels, on the runtime's device.
fn spin_kernel(rt: &Runtime, name: &str) -> Arc<CudaFunction> {
    let dev = rt.cuda_device().unwrap().clone();
    let module = KernelCache::global()
        .module(&dev, test_kernels::SPIN, "spin.cu")
        .unwrap();
    Arc::new(module.function(name).unwrap())
}

/// Without a GPU, asking for CUDA is a clear error and `auto` falls back to
/// the CPU; with one, `auto` picks CUDA.
#[test]
fn detection_never_panics() {
    let auto = Runtime::builder().build().unwrap();
    match braid::cuda::cuda_available() {
        Ok(n) if n > 0 => assert_eq!(auto.backend_name(), "cuda"),
        _ => {
            assert_eq!(auto.backend_name(), "cpu");
            let e = Runtime::builder()
                .backend(BackendKind::Cuda { device: 0 })
                .build()
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::BackendUnavailable {
                        backend: "cuda",
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("cuda"), "{e}");
        }
    }
}

/// Two spin kernels on two streams, free of dependencies, overlap on the
/// device: their device-timed spans intersect.
#[test]
fn spin_kernels_overlap_on_two_streams() {
    let Some(rt) = gpu_runtime("spin_kernels_overlap_on_two_streams", 2) else {
        return;
    };
    let spin = spin_kernel(&rt, "spin");
    let outs: Vec<_> = (0..2)
        .map(|i| rt.alloc(format!("out{i}"), 8).unwrap())
        .collect();
    // ~50 ms at ~2 GHz.
    let cycles: i64 = 100_000_000;
    for out in &outs {
        let f = spin.clone();
        rt.task("spin")
            .run_cuda(out.write::<i64>(), move |o, cu| -> Result<(), TaskError> {
                let mut args = KernelArgs::new();
                args.i64(cycles).ptr(o.ptr());
                // SAFETY: `spin(long long, long long*)` with a declared 8-byte output.
                unsafe { f.launch(cu.stream(), LaunchConfig::grid_block(1, 1), &args)? };
                Ok(())
            })
            .unwrap();
    }
    rt.synchronize().unwrap();
    for out in &outs {
        let spent = rt.read_vec::<i64>(out).unwrap()[0];
        assert!(spent >= cycles, "kernel did not run: {spent}");
    }
    let p = rt.profile();
    let spins: Vec<_> = p.spans.iter().filter(|s| s.name == "spin").collect();
    assert_eq!(spins.len(), 2);
    assert_ne!(spins[0].stream, spins[1].stream);
    let (a, b) = (spins[0], spins[1]);
    assert!(
        a.start_ns < b.end_ns && b.start_ns < a.end_ns,
        "device spans do not intersect: {a:?} {b:?}"
    );
    let s = p.summary();
    println!("{s}");
    assert!(s.overlap_ns > 0);
}

/// A slow writer on one stream and a reader on another: the reader sees the
/// written data only if the cross-stream event wait was issued.
#[test]
fn cross_stream_read_after_write_waits_for_the_event() {
    let Some(rt) = gpu_runtime("cross_stream_read_after_write_waits_for_the_event", 2) else {
        return;
    };
    let f = spin_kernel(&rt, "spin_then_add");
    let n = 1024usize;
    let x = rt.alloc_from("x", &vec![1.0f32; n]).unwrap();
    rt.task("slow add")
        .on_stream(0)
        .run_cuda(
            x.read_write::<f32>(),
            move |x, cu| -> Result<(), TaskError> {
                let mut args = KernelArgs::new();
                args.i64(50_000_000).ptr(x.ptr()).i32(n as i32).f32(2.0);
                // SAFETY: spin_then_add(long long, float*, int, float) over n declared floats.
                unsafe { f.launch(cu.stream(), LaunchConfig::linear(n, 256), &args)? };
                Ok(())
            },
        )
        .unwrap();
    let out = rt.alloc("copy", n * 4).unwrap();
    rt.task("copy on stream 1")
        .on_stream(1)
        .run_cuda(
            (x.read::<f32>(), out.write::<f32>()),
            |(src, dst), cu| -> Result<(), TaskError> {
                // SAFETY: both are declared accesses of this task, `n` floats
                // each, disjoint (two buffers), and the engine keeps every
                // conflicting task off them until this copy has run.
                unsafe { memcpy_dtod_async(dst.ptr(), src.ptr(), src.bytes(), cu.stream())? };
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(rt.read_vec::<f32>(&out).unwrap(), vec![3.0f32; n]);
    assert!(rt.stats().waits >= 1);
}
