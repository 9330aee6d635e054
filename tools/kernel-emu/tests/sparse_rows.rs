//! cuda/kernels/sparse_rows.cu, emulated, against the CPU reference in
//! braid's reducer (`braid::comm::sparse_links`, `sparse_add_chunk`): the
//! links and each rank's add, bit for bit in f32 and bf16, launched as the
//! reducer's CUDA bodies launch them (core/src/comm/sparse.rs).

mod common;

use braid::comm::{sparse_add_chunk, sparse_links};
use braid_kernel_emu::{self as emu, Dim3};
use common::{assert_bits, bits, compare_bf16, ids, linear, to_bf16, values};

/// The add's launch: one block of 128 per row of the rank's contribution.
fn add_launch(n: usize) -> (Dim3, Dim3) {
    ((common::grid(n), 1, 1), (128, 1, 1))
}

/// (rows per rank, rows of the gradient, row length): more rows than one
/// tile of the links kernel, a row length past one block and not a
/// multiple of 32, a small table (many repeats).
const SHAPES: [(usize, usize, usize); 3] = [(300, 50, 150), (37, 333, 20), (1, 4, 7)];

fn cpu_links(ids: &[u32]) -> Vec<u32> {
    let mut l = vec![0; ids.len()];
    sparse_links(ids, &mut l);
    l
}

#[test]
fn links_are_bit_identical_to_the_cpu() {
    for (s, &(n, nrows, _)) in SHAPES.iter().enumerate() {
        let ids = ids(n, nrows, 7 + s as u64);
        let mut got = vec![u32::MAX; n];
        let (g, b) = linear(n, 256);
        emu::sparse_rows_links(g, b, &mut got, &ids, n as i32).unwrap();
        assert_eq!(got, cpu_links(&ids), "n {n}, rows {nrows}");
    }
}

/// Three ranks' contributions added rank by rank (one launch each, as the
/// reducer does), with scale 1/3: f32 bit-identical to the CPU; bf16 too
/// (each touched element's f32 sum rounded once, in the same order). Small
/// gradients and larger rows, so that rounding after each row would differ.
#[test]
fn ranks_add_bit_identically_to_the_cpu() {
    let (world, scale) = (3usize, 1.0f32 / 3.0);
    for (s, &(n, nrows, len)) in SHAPES.iter().enumerate() {
        let what = format!("n {n}, rows {nrows}, row length {len}");
        let grad = values(nrows * len, 20 + s as u64, 0.01);
        let chunks: Vec<(Vec<u32>, Vec<f32>)> = (0..world)
            .map(|r| {
                let seed = 30 + (s * world + r) as u64;
                (ids(n, nrows, seed), values(n * len, seed, 1.0))
            })
            .collect();

        let (mut want, mut got) = (grad.clone(), grad.clone());
        let (mut want_b, mut got_b) = (to_bf16(&grad), bits(&to_bf16(&grad)));
        for (ids, rows) in &chunks {
            let links = cpu_links(ids);
            sparse_add_chunk(&mut want, ids, &links, rows, len, scale).unwrap();
            let rows_b = to_bf16(rows);
            sparse_add_chunk(&mut want_b, ids, &links, &rows_b, len, scale).unwrap();
            let (g, b) = add_launch(n);
            let [ni, li] = [n, len].map(|x| x as i32);
            emu::sparse_rows_add_f32(
                g,
                b,
                &mut got,
                ids,
                &links,
                rows,
                ni,
                li,
                nrows as i64,
                scale,
            )
            .unwrap();
            let rows_b = bits(&rows_b);
            emu::sparse_rows_add_bf16(
                g,
                b,
                &mut got_b,
                ids,
                &links,
                &rows_b,
                ni,
                li,
                nrows as i64,
                scale,
            )
            .unwrap();
        }
        assert_bits(&format!("sparse_rows_add_f32 {what}"), &got, &want);
        compare_bf16(&format!("sparse_rows_add_bf16 {what}"), &got_b, &want_b, 0);
    }
}

/// An id at or past the gradient's rows is skipped (the kernel writes
/// nothing outside the gradient: the emulator's guard bytes are intact):
/// the result is the CPU's with that row's contribution zero.
#[test]
fn an_id_past_the_rows_is_skipped() {
    let (n, nrows, len) = (40, 9, 33);
    let mut ids = ids(n, nrows, 5);
    let rows = values(n * len, 6, 1.0);
    let grad = values(nrows * len, 7, 1.0);
    ids[3] = nrows as u32 + 4; // its only entry: a chain of its own
    let links = cpu_links(&ids);
    let mut got = grad.clone();
    let (g, b) = add_launch(n);
    emu::sparse_rows_add_f32(
        g,
        b,
        &mut got,
        &ids,
        &links,
        &rows,
        n as i32,
        len as i32,
        nrows as i64,
        1.0,
    )
    .unwrap();

    let (mut zeroed, mut fixed) = (rows.clone(), ids.clone());
    zeroed[3 * len..4 * len].fill(0.0);
    fixed[3] = 0;
    let mut want = grad.clone();
    sparse_add_chunk(&mut want, &fixed, &cpu_links(&fixed), &zeroed, len, 1.0).unwrap();
    assert_bits("sparse_rows_add_f32 with an id past the rows", &got, &want);
}
