use braid::{Error, Runtime};

#[test]
fn doc_example_and_errors() -> Result<(), Error> {
    let rt = Runtime::cpu()?;
    let x = rt.alloc_from("x", &[1.0f32, 2.0, 3.0, 4.0])?;
    let y = rt.alloc("y", 16)?;
    rt.task("double")
        .run((x.read::<f32>(), y.write::<f32>()), |(a, b)| {
            for (o, i) in b.iter_mut().zip(a) {
                *o = 2.0 * i;
            }
        })?;
    assert_eq!(rt.read_vec::<f32>(&y)?, vec![2.0, 4.0, 6.0, 8.0]);
    rt.synchronize()
}
