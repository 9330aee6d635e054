//! Misuse, on every backend: overlapping or misaligned views refused at
//! submission, and wrong shapes failing the task with a message that names
//! the kernel and the argument.

use super::*;

/// Overlapping outputs and misaligned views are refused at submission, with
/// nothing submitted and nothing written.
fn misuse_is_refused_at_submission(dev: Device) {
    let g = Dev::new(dev);
    let n = 1000;
    let (a, b, big) = (g.up(&randn(n, 1.0, 80)), g.zeros(n), g.zeros(2 * n + 1));
    let half = |lo: usize| big.view_of::<f32>(lo..lo + n).unwrap();
    // The output overlapping the input.
    let e = gelu::forward(g.rt.task("overlap"), &half(0), &half(n / 2)).unwrap_err();
    assert!(
        matches!(&e, Error::BorrowConflict { task, .. } if task == "overlap"),
        "{e}"
    );
    // Residual gradients into overlapping views.
    let e = residual::backward(g.rt.task("overlap 2"), &half(0), &half(1), &a.whole()).unwrap_err();
    assert!(matches!(&e, Error::BorrowConflict { .. }), "{e}");
    // A misaligned output (starts 2 bytes into the buffer).
    let odd = big.view(2..2 + 4 * n).unwrap();
    let e = gelu::forward(g.rt.task("odd"), &odd, &a.whole()).unwrap_err();
    assert!(matches!(&e, Error::Misaligned { .. }), "{e}");
    g.rt.synchronize().unwrap();
    assert!(g.down(&b).iter().all(|&x| x == 0.0));
    assert!(g.down(&big).iter().all(|&x| x == 0.0));
}

test_device!(
    misuse_is_refused_at_submission,
    misuse_is_refused_at_submission_cpu,
    misuse_is_refused_at_submission_cuda
);

/// A wrong shape fails the task, naming the kernel and the argument: a
/// launcher's typed error on CUDA (before anything is queued), the CPU
/// kernel's assertion on the CPU (before any work).
fn bad_shapes_fail_the_task(dev: Device) {
    let g = Dev::new(dev);
    let n = B * T;
    // Fresh buffers for every case: a failed task's outputs fail its readers.
    let f = |len: usize| g.zeros(len).whole();
    let fails = |h: braid::Result<TaskHandle>, task: &str, needles: &[&str]| {
        let e = h.expect("a shape error is not a submission error").wait();
        let msg = e.expect_err("a wrong shape must fail the task").to_string();
        assert!(msg.contains(task), "{dev:?}: {msg}");
        for needle in needles {
            assert!(msg.contains(needle), "{dev:?}: `{needle}` not in: {msg}");
        }
    };
    // `out` one element short.
    let h = layernorm::forward(
        g.rt.task("short out"),
        &f(n * C - 1),
        &f(n),
        &f(n),
        &f(n * C),
        &f(C),
        &f(C),
        n,
        C,
    );
    fails(h, "short out", &["layernorm_forward", "`out`"]);
    // Lengths that differ.
    let h = gelu::forward(g.rt.task("lengths"), &f(n * C), &f(n * C - 1));
    fails(h, "lengths", &["gelu_forward", "`inp`"]);
    // C not divisible by NH.
    let h = attention::forward(
        g.rt.task("heads"),
        &f(n * C),
        &f(B * 5 * T * T),
        &f(B * 5 * T * T),
        &f(n * 3 * C),
        &f(4 * n * C),
        B,
        T,
        C,
        5,
    );
    fails(h, "heads", &["not divisible"]);
    // Step 0.
    let h = adamw::update(
        g.rt.task("step 0"),
        &f(C),
        &f(C),
        &f(C),
        &f(C),
        None,
        0,
        AdamWHyper::default(),
    );
    fails(h, "step 0", &["from 1"]);
}

test_device!(
    bad_shapes_fail_the_task,
    bad_shapes_fail_the_task_cpu,
    bad_shapes_fail_the_task_cuda
);
