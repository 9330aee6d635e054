use braid::{Error, Runtime};

#[test]
fn doc_example_and_errors() -> Result<(), Error> {
    let rt = Runtime::cpu()?;
    let x = rt.alloc_from("x", &[1.0f32, 2.0, 3.0, 4.0])?;
    let y = rt.alloc("y", 16)?;
    let (xs, ys) = (x.clone(), y.clone());
    rt.task("double").read(&x).write(&y).run_ctx(move |ctx| {
        let (a, b) = (ctx.read::<f32>(&xs)?, ctx.write::<f32>(&ys)?);
        for (o, i) in b.iter_mut().zip(a) {
            *o = 2.0 * i;
        }
        Ok(())
    })?;
    assert_eq!(rt.read_vec::<f32>(&y)?, vec![2.0, 4.0, 6.0, 8.0]);
    rt.synchronize()
}
