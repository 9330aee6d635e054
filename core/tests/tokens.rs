//! Typed access tokens: what a task declares is what its body gets, and misuse
//! is refused at submission with an error that names it.

use braid::{BackendKind, DynAccess, Error, HostBytes, Mode, Runtime};

fn cpu(streams: usize) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .compute_streams(streams)
        .build()
        .unwrap()
}

#[test]
fn tuple_tokens_declare_what_the_body_gets() {
    let rt = cpu(2);
    let x = rt.alloc_from("x", &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let y = rt.alloc("y", 16).unwrap();
    let s = rt.alloc("s", 4).unwrap();
    for h in 0..2 {
        let (xs, ys) = (
            x.view_of::<f32>(2 * h..2 * h + 2).unwrap(),
            y.view_of::<f32>(2 * h..2 * h + 2).unwrap(),
        );
        rt.task("double")
            .run((xs.read::<f32>(), ys.write::<f32>()), |(x, y)| {
                for (o, i) in y.iter_mut().zip(x) {
                    *o = 2.0 * i;
                }
            })
            .unwrap();
    }
    // The sum reads all of `y`: it is ordered after both writers by inference.
    rt.task("sum")
        .run((y.read::<f32>(), s.read_write::<f32>()), |(y, s)| {
            s[0] += y.iter().sum::<f32>();
        })
        .unwrap();
    assert_eq!(rt.read_vec::<f32>(&y).unwrap(), vec![2.0, 4.0, 6.0, 8.0]);
    assert_eq!(rt.read_vec::<f32>(&s).unwrap(), vec![20.0]);
}

#[test]
fn vec_form_declares_every_view_it_holds() {
    let rt = cpu(3);
    let b = rt.alloc("b", 8 * 4).unwrap();
    let parts: Vec<_> = (0..8)
        .map(|i| b.view_of::<f32>(i..i + 1).unwrap())
        .collect();
    // Eight independent writers, one per element.
    for (i, p) in parts.iter().enumerate() {
        rt.task("fill")
            .run(p.write::<f32>(), move |p| p[0] = i as f32 + 1.0)
            .unwrap();
    }
    // One task that reads all eight through a Vec of tokens, and a
    // Vec of byte accesses whose modes are chosen at run time.
    let total = rt.alloc("total", 4).unwrap();
    let reads: Vec<_> = parts.iter().map(|p| p.read::<f32>()).collect();
    rt.task("gather")
        .run((reads, total.write::<f32>()), |(parts, t)| {
            assert_eq!(parts.len(), 8);
            t[0] = parts.iter().map(|p| p[0]).sum();
        })
        .unwrap();
    let dynamic = vec![
        DynAccess::new(parts[0].clone(), Mode::Read),
        parts[1].access(Mode::ReadWrite),
    ];
    rt.task("bytes")
        .run(dynamic, |mut a| {
            let first = a[0].as_slice().to_vec();
            assert!(matches!(a[0], HostBytes::Read(_)));
            a[1].as_mut_slice()
                .expect("a write")
                .copy_from_slice(&first);
        })
        .unwrap();
    assert_eq!(rt.read_vec::<f32>(&total).unwrap(), vec![36.0]);
    assert_eq!(
        rt.read_vec::<f32>(&b).unwrap(),
        vec![1.0, 1.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    );
    // The tracker saw every declared access: the gather ran after all eight
    // fills, whatever streams they landed on.
    rt.synchronize().unwrap();
}

#[test]
fn option_token_is_declared_only_when_present() {
    let rt = cpu(2);
    let x = rt.alloc_from("x", &[3.0f32; 4]).unwrap();
    let y = rt.alloc("y", 16).unwrap();
    for bias in [None, Some(x.read::<f32>())] {
        rt.task("maybe")
            .run((y.read_write::<f32>(), bias), |(y, bias)| {
                for (i, o) in y.iter_mut().enumerate() {
                    *o += bias.map_or(1.0, |b| b[i]);
                }
            })
            .unwrap();
    }
    assert_eq!(rt.read_vec::<f32>(&y).unwrap(), vec![4.0; 4]);
}

#[test]
fn overlapping_tokens_where_one_writes_are_refused() {
    let rt = cpu(1);
    let x = rt.alloc("x", 64).unwrap();
    let a = x.view(0..32).unwrap();
    let b = x.view(16..48).unwrap();
    let e = rt
        .task("alias")
        .run((a.read::<f32>(), b.write::<f32>()), |_| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::BorrowConflict { task, buffer, .. } if task == "alias" && buffer == "x"),
        "{e}"
    );
    // Many accesses take the sorted path of the check: still refused.
    let mut many: Vec<_> = (0..20)
        .map(|i| x.view(i * 2..i * 2 + 2).unwrap().access(Mode::Read))
        .collect();
    many.push(x.view(30..31).unwrap().access(Mode::Write));
    let e = rt.task("many").run(many, |_| ()).unwrap_err();
    assert!(matches!(&e, Error::BorrowConflict { .. }), "{e}");
    // Two reads of the same bytes are fine, and so are disjoint writes.
    rt.task("reads")
        .run((a.read::<f32>(), b.read::<f32>()), |(a, b)| {
            assert_eq!(a.len() + b.len(), 16)
        })
        .unwrap();
    rt.task("writes")
        .run(
            (
                x.view(0..16).unwrap().write::<f32>(),
                x.view(16..32).unwrap().write::<f32>(),
            ),
            |(a, b)| {
                a[0] = 1.0;
                b[0] = 2.0;
            },
        )
        .unwrap();
    rt.synchronize().unwrap();
}

#[test]
fn misaligned_views_are_refused_at_submission() {
    let rt = cpu(1);
    let x = rt.alloc("x", 64).unwrap();
    let odd = x.view(2..10).unwrap();
    let e = rt.task("odd").run(odd.read::<f32>(), |_| ()).unwrap_err();
    assert!(
        matches!(&e, Error::Misaligned { buffer, ty, .. } if buffer == "x" && ty.contains("f32")),
        "{e}"
    );
    let short = x.view(0..6).unwrap();
    assert!(matches!(
        rt.task("short").run(short.write::<u32>(), |_| ()),
        Err(Error::Misaligned { .. })
    ));
    // Nothing was submitted: the runtime is clean.
    rt.synchronize().unwrap();
}

#[test]
fn a_task_without_a_body_for_the_backend_is_refused() {
    let rt = cpu(1);
    let x = rt.alloc("x", 4).unwrap();
    let e = rt
        .task("gpu only")
        .run_cuda(x.write::<f32>(), |_x, _cu| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::NoBody { task, backend } if task == "gpu only" && *backend == "cpu"),
        "{e}"
    );
    // run_any picks the CPU body here.
    rt.task("either")
        .run_any(x.write::<f32>(), |x| x[0] = 7.0, |_x, _cu| ())
        .unwrap();
    assert_eq!(rt.read_vec::<f32>(&x).unwrap(), vec![7.0]);
}

#[test]
fn body_errors_and_results_reach_the_next_sync_point() {
    let rt = cpu(1);
    let x = rt.alloc("x", 4).unwrap();
    rt.task("parse")
        .run(x.write::<u32>(), |x| {
            x[0] = "12".parse()?;
            Ok(())
        })
        .unwrap();
    rt.task("bad parse")
        .run(x.read_write::<u32>(), |x| {
            x[0] = "twelve".parse()?;
            Ok(())
        })
        .unwrap();
    let e = rt.synchronize().unwrap_err();
    assert!(
        matches!(&e, Error::TaskFailed { task, .. } if task == "bad parse"),
        "{e}"
    );
    assert_eq!(rt.read_vec::<u32>(&x).unwrap(), vec![12]);
}
