//! The CUDA backend: detection, device-timed overlap, ordering through events.
//! GPU tests skip with a message when no device is present and fail instead
//! when `BRAID_REQUIRE_GPU=1`.

use braid::cuda::{gpu_or_skip, test_kernels, KernelArgs, KernelCache, LaunchConfig};
use braid::{BackendKind, Error, Runtime};

fn gpu_runtime(streams: usize) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Cuda { device: 0 })
        .compute_streams(streams)
        .profile(true)
        .build()
        .expect("CUDA runtime")
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
    if !gpu_or_skip("spin_kernels_overlap_on_two_streams") {
        return;
    }
    let rt = gpu_runtime(2);
    let dev = rt.cuda_device().unwrap().clone();
    let module = KernelCache::global()
        .module(&dev, test_kernels::SPIN, "spin.cu")
        .unwrap();
    let spin = std::sync::Arc::new(module.function("spin").unwrap());
    let outs: Vec<_> = (0..2)
        .map(|i| rt.alloc(format!("out{i}"), 8).unwrap())
        .collect();
    // ~50 ms at ~2 GHz.
    let cycles: i64 = 100_000_000;
    for out in &outs {
        let (o, f) = (out.clone(), spin.clone());
        rt.task("spin")
            .write(out)
            .run_ctx(move |ctx| {
                let cu = ctx.device().cuda().expect("cuda ctx");
                let mut args = KernelArgs::new();
                args.i64(cycles).ptr(ctx.device_ptr(&o, true)?);
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
    if !gpu_or_skip("cross_stream_read_after_write_waits_for_the_event") {
        return;
    }
    let rt = gpu_runtime(2);
    let dev = rt.cuda_device().unwrap().clone();
    let module = KernelCache::global()
        .module(&dev, test_kernels::SPIN, "spin.cu")
        .unwrap();
    let f = std::sync::Arc::new(module.function("spin_then_add").unwrap());
    let n = 1024usize;
    let x = rt.alloc_from("x", &vec![1.0f32; n]).unwrap();
    let xx = x.clone();
    rt.task("slow add")
        .read_write(&x)
        .on_stream(0)
        .run_ctx(move |ctx| {
            let cu = ctx.device().cuda().expect("cuda ctx");
            let mut args = KernelArgs::new();
            args.i64(50_000_000)
                .ptr(ctx.device_ptr(&xx, true)?)
                .i32(n as i32)
                .f32(2.0);
            // SAFETY: spin_then_add(long long, float*, int, float) over n declared floats.
            unsafe { f.launch(cu.stream(), LaunchConfig::linear(n, 256), &args)? };
            Ok(())
        })
        .unwrap();
    let out = rt.alloc("copy", n * 4).unwrap();
    let (src, dst) = (x.clone(), out.clone());
    rt.task("copy on stream 1")
        .read(&x)
        .write(&out)
        .on_stream(1)
        .run_ctx(move |ctx| {
            let v = ctx.read_to_vec::<f32>(&src)?;
            ctx.write_from_slice(&dst, &v)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(rt.read_vec::<f32>(&out).unwrap(), vec![3.0f32; n]);
    assert!(rt.stats().waits >= 1);
}
