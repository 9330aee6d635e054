//! The reducer's row contributions (a gradient with several writers): the
//! dense part reduced with its bucket, the rows exchanged and added at
//! `finish`. Checked against the average of the full gradients computed here
//! (each rank's dense gradient plus its rows), on 1–4 CPU ranks, with
//! repeated ids, with sync off (local accumulation), and for bad input.

use braid::comm::{BucketConfig, ParamSpec, SparseRows};
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

/// One synced step on `world` ranks; every rank's reduced gradient.
fn step(world: usize) -> Vec<Vec<f32>> {
    step_with(world, specs(), |red, rows| {
        red.grad_ready(0)?; // the dense writer of wte, first
        red.grad_ready(1)?;
        red.sparse_ready(0, rows)
    })
}

/// One synced step on `world` ranks of a reducer of `params`, which
/// `hand_over` marks ready and gives the rank's rows; every rank's reduced
/// gradient.
fn step_with(
    world: usize,
    params: Vec<ParamSpec>,
    hand_over: fn(&mut Reducer, SparseRows) -> braid::Result<()>,
) -> Vec<Vec<f32>> {
    let out = launch(world, |rank, comm| {
        let rt = runtime(rank)?;
        let (dense, ids, rows) = inputs(rank);
        let grads = rt.alloc_from("grads", &dense)?;
        let ids = rt.alloc_from("ids", &ids)?;
        let rows = rt.alloc_from("rows", &rows)?;
        let mut red = Reducer::new(
            comm.bind(&rt)?,
            &grads,
            params.clone(),
            BucketConfig::default(),
        )?;
        hand_over(&mut red, SparseRows::new(ids.whole(), rows.whole(), ROW))?;
        red.finish()?;
        rt.read_vec::<f32>(&grads)
    });
    out.into_iter().map(|r| r.expect("rank failed")).collect()
}

#[test]
fn rows_are_averaged_into_the_reduced_gradient() {
    for world in 1..=4 {
        let want = expected(world);
        let got = step(world);
        for (rank, g) in got.iter().enumerate() {
            for (i, (&g, &w)) in g.iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "world {world}, rank {rank}, element {i}: {g} vs {w}"
                );
            }
            // Every rank computes the same bits.
            assert_eq!(g, &got[0], "world {world}: rank {rank} differs from rank 0");
        }
    }
}

/// The tied gradient handed over in pieces (rows 0..2 and 2..5 of `wte`,
/// each marked ready on its own, the second first), the rows given to the
/// pieces together: the same bits as with one parameter. Pieces that do not
/// follow each other are refused.
#[test]
fn rows_over_pieces_are_added_as_over_one_parameter() {
    let world = 3;
    let whole = step(world);
    let pieces = vec![
        ParamSpec::new("wte[0..2]", 0..2 * ROW),
        ParamSpec::new("wte[2..5]", 2 * ROW..ROWS * ROW),
        ParamSpec::new("other", ROWS * ROW..ROWS * ROW + OTHER),
    ];
    let got = step_with(world, pieces, |red, rows| {
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
