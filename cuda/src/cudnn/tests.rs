//! Which shapes go to cuDNN (any machine); and on a GPU, every graph kind
//! the machine's cuDNN offers, forward and backward, against a plain causal
//! attention in f32 on the same bf16 inputs. A kind cuDNN finds no engine
//! for is reported, not failed; a kind that runs must be right, and at
//! least one must run both directions.

use super::*;
use crate::device::CudaDevice;

/// `x` rounded to bf16 (to nearest, ties to even), as its bits.
fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn widen(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Deterministic values in [-1, 1), rounded to bf16.
fn values(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

/// Causal attention on `qkv` `(B, T, 3, NH, HS)` and `dout` `(B, T, NH,
/// HS)`, in f32: `(out, lse, dqkv)`.
fn reference(s: SdpaShape, qkv: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (t, nh, hs, c) = (s.t, s.nh, s.hs, s.c());
    let scale = 1.0 / (hs as f32).sqrt();
    let at = |b: usize, i: usize, part: usize, h: usize| ((b * t + i) * 3 + part) * c + h * hs;
    let o_at = |b: usize, i: usize, h: usize| (b * t + i) * c + h * hs;
    let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f32>();
    let mut out = vec![0.0f32; s.b * t * c];
    let mut lse = vec![0.0f32; s.b * nh * t];
    let mut dqkv = vec![0.0f32; qkv.len()];
    for b in 0..s.b {
        for h in 0..nh {
            // P, row by row.
            let mut p = vec![0.0f32; t * t];
            for i in 0..t {
                let q = &qkv[at(b, i, 0, h)..][..hs];
                let sc: Vec<f32> = (0..=i)
                    .map(|j| scale * dot(q, &qkv[at(b, j, 1, h)..][..hs]))
                    .collect();
                let m = sc.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                let l: f32 = sc.iter().map(|x| (x - m).exp()).sum();
                lse[(b * nh + h) * t + i] = m + l.ln();
                for j in 0..=i {
                    p[i * t + j] = (sc[j] - m).exp() / l;
                    for d in 0..hs {
                        out[o_at(b, i, h) + d] += p[i * t + j] * qkv[at(b, j, 2, h) + d];
                    }
                }
            }
            for i in 0..t {
                let d_o = &dout[o_at(b, i, h)..][..hs];
                let delta = dot(d_o, &out[o_at(b, i, h)..][..hs]);
                for j in 0..=i {
                    let dp = dot(d_o, &qkv[at(b, j, 2, h)..][..hs]);
                    let ds = p[i * t + j] * (dp - delta);
                    for d in 0..hs {
                        dqkv[at(b, i, 0, h) + d] += scale * ds * qkv[at(b, j, 1, h) + d];
                        dqkv[at(b, j, 1, h) + d] += scale * ds * qkv[at(b, i, 0, h) + d];
                        dqkv[at(b, j, 2, h) + d] += p[i * t + j] * d_o[d];
                    }
                }
            }
        }
    }
    (out, lse, dqkv)
}

/// The largest |got - want| over the largest |want|.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-20);
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
    if got.iter().any(|g| !g.is_finite()) {
        f32::INFINITY
    } else {
        err / scale
    }
}

/// What cuDNN is given and what stays with Braid's kernels, by version.
#[test]
fn shapes_cudnn_takes() {
    use Direction::{Backward, Forward};
    let s = |t, hs| SdpaShape { b: 2, t, nh: 3, hs };
    assert!(takes(91300, s(1024, 64), Forward) && takes(91300, s(1024, 64), Backward));
    assert!(takes(91300, s(150, 64), Forward), "any T forward");
    assert!(
        !takes(91500, s(150, 64), Backward),
        "9.15.0: T % 128 backward"
    );
    assert!(takes(91501, s(150, 64), Backward), "9.15.1 on: any T");
    assert!(!takes(92800, s(1, 64), Backward), "one position backward");
    assert!(takes(92800, s(1, 64), Forward));
    assert!(
        !takes(92800, s(128, 60), Forward),
        "head size not a multiple of 8"
    );
    assert!(!takes(92800, s(128, 136), Forward), "head size above 128");
    assert!(!takes(
        92800,
        SdpaShape {
            b: 0,
            t: 8,
            nh: 1,
            hs: 64
        },
        Forward
    ));
    assert_eq!(version_string(91300), "9.13.0");
    assert_eq!(version_string(92801), "9.28.1");
}

#[test]
fn every_graph_kind_computes_causal_attention_on_this_gpu() {
    if !cudnn_or_skip("cudnn::every_graph_kind_computes_causal_attention_on_this_gpu") {
        return;
    }
    let dev = CudaDevice::open(0).unwrap();
    let stream = CudaStream::compute(&dev).unwrap();
    let shape = SdpaShape {
        b: 2,
        t: 256,
        nh: 3,
        hs: 64,
    };
    let (n_qkv, n_out) = (
        shape.b * shape.t * 3 * shape.c(),
        shape.b * shape.t * shape.c(),
    );
    let (qkv, dout) = (values(n_qkv, 1), values(n_out, 2));
    let wide = |x: &[u16]| -> Vec<f32> { x.iter().map(|&b| widen(b)).collect() };
    let (want_out, want_lse, want_dqkv) = reference(shape, &wide(&qkv), &wide(&dout));
    let up = |x: &[u16]| DeviceBuffer::from_host(&stream, x).unwrap();
    let (d_qkv, d_dout) = (up(&qkv), up(&dout));
    let down = |b: &DeviceBuffer| -> Vec<f32> { wide(&b.to_host_vec::<u16>(&stream).unwrap()) };
    let version = backend::version().unwrap();
    let bound = 0.02;
    let mut both = 0;
    let mut report = Vec::new();
    for kind in [GraphKind::Unified, GraphKind::Band, GraphKind::Composite] {
        if !kind.available(version, Direction::Forward) {
            report.push(format!(
                "{}: not in cuDNN {}",
                kind.name(),
                version_string(version)
            ));
            continue;
        }
        let a = CudnnAttention::with_kinds(std::slice::from_ref(&stream), &[kind]).unwrap();
        let out = DeviceBuffer::zeroed(&stream, n_out * 2).unwrap();
        let lse = DeviceBuffer::zeroed(&stream, shape.b * shape.nh * shape.t * 4).unwrap();
        // SAFETY: the buffers hold the shapes `forward` takes, bf16 (lse
        // f32), from `DeviceBuffer` (256-byte aligned), on `stream`.
        let fwd = unsafe {
            a.forward(
                &stream,
                shape,
                d_qkv.device_ptr(),
                out.device_ptr(),
                lse.device_ptr(),
            )
        };
        match fwd {
            Err(e) => {
                report.push(format!("{} forward: {e}", kind.name()));
                continue;
            }
            Ok(built) => assert!(built, "{}: the first forward builds its plan", kind.name()),
        }
        let (e_out, e_lse) = (
            relative_error(&down(&out), &want_out),
            relative_error(&lse.to_host_vec::<f32>(&stream).unwrap(), &want_lse),
        );
        report.push(format!(
            "{} forward ({}): out error {e_out:.2e}, lse error {e_lse:.2e}",
            kind.name(),
            a.describe(shape, Direction::Forward).unwrap_or_default()
        ));
        assert!(
            e_out <= bound && e_lse <= 1e-3,
            "{}: {report:#?}",
            kind.name()
        );
        if !kind.available(version, Direction::Backward) {
            continue;
        }
        let dqkv = DeviceBuffer::zeroed(&stream, n_qkv * 2).unwrap();
        let backward = || {
            // SAFETY: as above; `dqkv` has `qkv`'s shape and is disjoint.
            unsafe {
                a.backward(
                    &stream,
                    shape,
                    d_qkv.device_ptr(),
                    out.device_ptr(),
                    d_dout.device_ptr(),
                    lse.device_ptr(),
                    dqkv.device_ptr(),
                )
            }
        };
        match backward() {
            Err(e) => {
                report.push(format!("{} backward: {e}", kind.name()));
                continue;
            }
            Ok(built) => assert!(built, "{}: the first backward builds its plan", kind.name()),
        }
        let first = dqkv.to_host_vec::<u16>(&stream).unwrap();
        let e_grad = relative_error(&wide(&first), &want_dqkv);
        report.push(format!(
            "{} backward ({}): gradient error {e_grad:.2e}",
            kind.name(),
            a.describe(shape, Direction::Backward).unwrap_or_default()
        ));
        assert!(e_grad <= bound, "{}: {report:#?}", kind.name());
        // The deterministic algorithm: the same bits again, from the plan
        // the first call built.
        assert!(!backward().unwrap(), "{}: the plan is reused", kind.name());
        assert_eq!(
            dqkv.to_host_vec::<u16>(&stream).unwrap(),
            first,
            "{}: a second backward",
            kind.name()
        );
        both += 1;
    }
    eprintln!(
        "cuDNN {}:\n  {}",
        version_string(version),
        report.join("\n  ")
    );
    assert!(both >= 1, "no graph kind ran both directions: {report:#?}");
}
