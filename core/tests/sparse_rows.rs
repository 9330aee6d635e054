//! The reducer's row contributions (a gradient with several writers): the
//! dense part reduced with its bucket, the rows exchanged and added at
//! `finish`. Checked against the average of the full gradients computed here
//! (each rank's dense gradient plus its rows), on 1–4 CPU ranks, in f32 and
//! bf16, with repeated ids, with sync off (local accumulation), and for bad
//! input; the CPU reference of the CUDA kernels against the definition.

use braid::comm::{
    sparse_add_chunk, sparse_links, Bf16, BucketConfig, DType, ParamSpec, SparseRows,
};
use braid::{launch, BackendKind, Error, Reducer, Runtime};

const ROW: usize = 3;
const ROWS: usize = 5; // the tied parameter: 5 rows of 3
const OTHER: usize = 4; // a second, dense-only parameter

fn runtime(rank: usize) -> braid::Result<Runtime> {
    Runtime::builder()
        .backend(BackendKind::Cpu)
        .rank(rank)
        .build()
}

/// Rank `r`'s dense gradient (both parameters) and its row contribution.
fn inputs(r: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let dense: Vec<f32> = (0..ROWS * ROW + OTHER)
        .map(|i| ((i * 7 + r * 13) % 11) as f32 * 0.25 - 1.0)
        .collect();
    // Ids repeat (1 twice) and differ between ranks.
    let ids: Vec<u32> = vec![(r % ROWS) as u32, 1, 4, 1];
    let rows: Vec<f32> = (0..ids.len() * ROW)
        .map(|i| ((i * 5 + r * 3) % 7) as f32 * 0.5 + 0.125)
        .collect();
    (dense, ids, rows)
}

/// The average over ranks of (dense + rows added in), in f64.
fn expected(world: usize) -> Vec<f64> {
    let mut sum = [0f64; ROWS * ROW + OTHER];
    for r in 0..world {
        let (dense, ids, rows) = inputs(r);
        let mut full: Vec<f64> = dense.iter().map(|&x| x as f64).collect();
        for (i, &id) in ids.iter().enumerate() {
            for k in 0..ROW {
                full[id as usize * ROW + k] += rows[i * ROW + k] as f64;
            }
        }
        for (s, f) in sum.iter_mut().zip(full) {
            *s += f;
        }
    }
    sum.iter().map(|s| s / world as f64).collect()
}

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("wte", 0..ROWS * ROW),
        ParamSpec::new("other", ROWS * ROW..ROWS * ROW + OTHER),
    ]
}

/// One synced step on `world` ranks with gradients, rows and buckets of
/// `dtype` (bf16: the same values, rounded); every rank's reduced
/// gradient, widened to `f32`.
fn step(world: usize, dtype: DType) -> Vec<Vec<f32>> {
    step_with(world, specs(), dtype, |red, rows| {
        red.grad_ready(0)?; // the dense writer of wte, first
        red.grad_ready(1)?;
        red.sparse_ready(0, rows)
    })
}

/// One synced step on `world` ranks of a reducer of `params` in `dtype`,
/// which `hand_over` marks ready and gives the rank's rows; every rank's
/// reduced gradient, widened to `f32`.
fn step_with(
    world: usize,
    params: Vec<ParamSpec>,
    dtype: DType,
    hand_over: fn(&mut Reducer, SparseRows) -> braid::Result<()>,
) -> Vec<Vec<f32>> {
    let bf = |v: &[f32]| v.iter().map(|&x| Bf16::from_f32(x)).collect::<Vec<_>>();
    let out = launch(world, |rank, comm| {
        let rt = runtime(rank)?;
        let (dense, ids, rows) = inputs(rank);
        let (grads, rows) = match dtype {
            DType::Bf16 => (
                rt.alloc_from("grads", &bf(&dense))?,
                rt.alloc_from("rows", &bf(&rows))?,
            ),
            _ => (
                rt.alloc_from("grads", &dense)?,
                rt.alloc_from("rows", &rows)?,
            ),
        };
        let ids = rt.alloc_from("ids", &ids)?;
        let config = BucketConfig::default().dtype(dtype);
        let mut red = Reducer::new(comm.bind(&rt)?, &grads, params.clone(), config)?;
        hand_over(&mut red, SparseRows::new(ids.whole(), rows.whole(), ROW))?;
        red.finish()?;
        match dtype {
            DType::Bf16 => Ok(rt
                .read_vec::<Bf16>(&grads)?
                .iter()
                .map(|x| x.to_f32())
                .collect()),
            _ => rt.read_vec::<f32>(&grads),
        }
    });
    out.into_iter().map(|r| r.expect("rank failed")).collect()
}

/// Every rank's gradient is the average over `world` ranks within
/// `rtol · (floor + |want|)`, and every rank has the same bits.
fn assert_averaged(world: usize, got: &[Vec<f32>], rtol: f64, floor: f64) {
    let want = expected(world);
    for (rank, g) in got.iter().enumerate() {
        for (i, (&g, &w)) in g.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= rtol * (floor + w.abs()),
                "world {world}, rank {rank}, element {i}: {g} vs {w}"
            );
        }
        // Every rank computes the same bits.
        assert_eq!(g, &got[0], "world {world}: rank {rank} differs from rank 0");
    }
}

/// bf16 gradients: the average within bf16 rounding (the inputs are exact
/// in bf16: quarters and eighths), every rank the same bits.
#[test]
fn bf16_rows_are_averaged_into_the_reduced_gradient() {
    for world in 1..=4 {
        // A few roundings of 2^-8 relative each.
        assert_averaged(world, &step(world, DType::Bf16), 1.6e-2, 0.25);
    }
}

/// Ids with repeats, runs and singletons.
fn chunk_ids(n: usize, nrows: usize, seed: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7 + seed) % 11 % nrows) as u32)
        .collect()
}

/// `sparse_links` is its definition: the next index with the same id (n
/// if none), bit 31 when an earlier index has it.
#[test]
fn links_follow_their_definition() {
    for (n, nrows) in [(0, 3), (1, 3), (40, 5), (300, 64)] {
        let ids = chunk_ids(n, nrows, n);
        let mut links = vec![0u32; n];
        sparse_links(&ids, &mut links);
        for i in 0..n {
            let next = (i + 1..n).find(|&r| ids[r] == ids[i]).unwrap_or(n) as u32;
            let repeat = ids[..i].contains(&ids[i]);
            assert_eq!(
                links[i],
                next | (u32::from(repeat) << 31),
                "n {n}, index {i}"
            );
        }
    }
}

/// With f32 gradients, a chunk's add is bit for bit the rows added one by
/// one (`g += scale * row`, in order); with bf16, each touched element is
/// the f32 sum rounded once.
#[test]
fn a_chunk_adds_as_defined_in_f32_and_bf16() {
    let (n, nrows, row_len, scale) = (60, 7, 5, 1.0 / 3.0);
    let ids = chunk_ids(n, nrows, 2);
    let mut links = vec![0u32; n];
    sparse_links(&ids, &mut links);
    let rows: Vec<f32> = (0..n * row_len)
        .map(|i| ((i * 37) % 101) as f32 * 0.0137 - 0.6)
        .collect();
    let grad: Vec<f32> = (0..nrows * row_len).map(|i| i as f32 * 0.01).collect();

    let mut got = grad.clone();
    sparse_add_chunk(&mut got, &ids, &links, &rows, row_len, scale).unwrap();
    let mut want = grad.clone();
    for (i, &id) in ids.iter().enumerate() {
        for k in 0..row_len {
            want[id as usize * row_len + k] += scale * rows[i * row_len + k];
        }
    }
    assert_eq!(got, want);

    let bf = |v: &[f32]| v.iter().map(|&x| Bf16::from_f32(x)).collect::<Vec<_>>();
    let (rows_b, mut got_b) = (bf(&rows), bf(&grad));
    sparse_add_chunk(&mut got_b, &ids, &links, &rows_b, row_len, scale).unwrap();
    let mut sum: Vec<f32> = bf(&grad).iter().map(|x| x.to_f32()).collect();
    for (i, &id) in ids.iter().enumerate() {
        for k in 0..row_len {
            sum[id as usize * row_len + k] += scale * rows_b[i * row_len + k].to_f32();
        }
    }
    let want_b = bf(&sum);
    assert_eq!(got_b, want_b);

    // An id past the rows: an error, nothing written.
    let mut bad_ids = ids.clone();
    bad_ids[n - 1] = nrows as u32;
    sparse_links(&bad_ids, &mut links);
    let mut g = grad.clone();
    let e = sparse_add_chunk(&mut g, &bad_ids, &links, &rows, row_len, scale).unwrap_err();
    assert!(e.contains("row id 7 is past the gradient's 7 rows"), "{e}");
    assert_eq!(g, grad);
}

#[test]
fn rows_are_averaged_into_the_reduced_gradient() {
    for world in 1..=4 {
        assert_averaged(world, &step(world, DType::F32), 1e-5, 1.0);
    }
}

/// The tied gradient handed over in pieces (rows 0..2 and 2..5 of `wte`,
/// each marked ready on its own, the second first), the rows given to the
/// pieces together: the same bits as with one parameter. Pieces that do not
/// follow each other are refused.
#[test]
fn rows_over_pieces_are_added_as_over_one_parameter() {
    let world = 3;
    let whole = step(world, DType::F32);
    let pieces = vec![
        ParamSpec::new("wte[0..2]", 0..2 * ROW),
        ParamSpec::new("wte[2..5]", 2 * ROW..ROWS * ROW),
        ParamSpec::new("other", ROWS * ROW..ROWS * ROW + OTHER),
    ];
    let got = step_with(world, pieces, DType::F32, |red, rows| {
        red.grad_ready(1)?;
        red.grad_ready(0)?;
        red.grad_ready(2)?;
        red.sparse_ready_range(0..2, rows)
    });
    assert_eq!(got, whole);

    let out = launch(1, |rank, comm| {
        let rt = runtime(rank)?;
        let grads = rt.alloc("grads", (ROWS * ROW + OTHER) * 4)?;
        let ids = rt.alloc_from("ids", &[0u32])?;
        let rows = rt.alloc("rows", ROW * 4)?;
        let gap = vec![
            ParamSpec::new("a", 0..ROW),
            ParamSpec::new("b", 2 * ROW..ROWS * ROW),
        ];
        let mut red = Reducer::new(comm.bind(&rt)?, &grads, gap, BucketConfig::default())?;
        let rows = || SparseRows::new(ids.whole(), rows.whole(), ROW);
        let e = red.sparse_ready_range(0..2, rows()).unwrap_err();
        assert!(e.to_string().contains("do not follow each other"), "{e}");
        let e = red.sparse_ready_range(1..3, rows()).unwrap_err();
        assert!(e.to_string().contains("no parameters #1..#3"), "{e}");
        Ok(())
    });
    out.into_iter().for_each(|r| r.expect("rank failed"));
}

#[test]
fn with_sync_off_rows_accumulate_locally() {
    let out = launch(2, |rank, comm| {
        let rt = runtime(rank)?;
        let (dense, ids, rows) = inputs(rank);
        let grads = rt.alloc_from("grads", &dense)?;
        let ids_b = rt.alloc_from("ids", &ids)?;
        let rows_b = rt.alloc_from("rows", &rows)?;
        let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs(), BucketConfig::default())?;
        {
            let mut quiet = red.no_sync();
            quiet.grad_ready(0)?;
            quiet.grad_ready(1)?;
            quiet.sparse_ready(0, SparseRows::new(ids_b.whole(), rows_b.whole(), ROW))?;
            quiet.finish()?;
        }
        let got = rt.read_vec::<f32>(&grads)?;
        // Local: dense + rows, nothing exchanged, nothing scaled.
        let mut want = dense.clone();
        for (i, &id) in ids.iter().enumerate() {
            for k in 0..ROW {
                want[id as usize * ROW + k] += rows[i * ROW + k];
            }
        }
        assert_eq!(got, want, "rank {rank}");
        Ok(())
    });
    for r in out {
        r.expect("rank failed");
    }
}

#[test]
fn bad_contributions_are_refused_with_their_reason() {
    let out = launch(1, |rank, comm| {
        let rt = runtime(rank)?;
        let grads = rt.alloc("grads", (ROWS * ROW + OTHER) * 4)?;
        let ids = rt.alloc_from("ids", &[0u32, 1])?;
        let rows = rt.alloc("rows", 2 * ROW * 4)?;
        let mut red = Reducer::new(comm.bind(&rt)?, &grads, specs(), BucketConfig::default())?;
        // Rows of 4 do not tile wte's 15 gradients.
        let e = red
            .sparse_ready(0, SparseRows::new(ids.whole(), rows.whole(), 4))
            .unwrap_err();
        assert!(e.to_string().contains("do not tile"), "{e}");
        // Two ids need 24 bytes of rows, not 12.
        let short = rows.view(0..12)?;
        let e = red
            .sparse_ready(0, SparseRows::new(ids.whole(), short, ROW))
            .unwrap_err();
        assert!(e.to_string().contains("24 bytes"), "{e}");
        assert!(matches!(
            red.sparse_ready(9, SparseRows::new(ids.whole(), rows.whole(), ROW)),
            Err(Error::Collective { .. })
        ));
        // An id past the rows fails the add task, naming the parameter, and
        // leaves the gradient as the all-reduce made it.
        let far = rt.alloc_from("far ids", &[0u32, ROWS as u32])?;
        red.grad_ready(0)?;
        red.grad_ready(1)?;
        red.sparse_ready(0, SparseRows::new(far.whole(), rows.whole(), ROW))?;
        red.finish()?;
        let e = rt.synchronize().unwrap_err();
        assert!(e.to_string().contains("past the 5 rows of `wte`"), "{e}");
        assert_eq!(rt.read_vec::<f32>(&grads)?, vec![0.0; ROWS * ROW + OTHER]);
        Ok(())
    });
    for r in out {
        r.expect("rank failed");
    }
}
