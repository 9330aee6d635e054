//! Prints the topology Braid sees: CPUs (with hwloc when built with the
//! `hwloc` feature, which also pins stream threads) and CUDA devices.
//!
//! `cargo run -p braid --example topology [--features hwloc]`

fn main() {
    println!("host: {}", braid::topo::describe());
    match braid::cuda::cuda_available() {
        Ok(0) => println!("cuda: driver present, no device"),
        Ok(n) => {
            for i in 0..n {
                match braid::cuda::CudaDevice::open(i) {
                    Ok(d) => println!(
                        "cuda:{i}: {} ({}, {} SMs, {:.1} GiB, stream priorities {:?})",
                        d.name(),
                        d.arch(),
                        d.sm_count(),
                        d.total_memory() as f64 / (1u64 << 30) as f64,
                        d.stream_priority_range()
                    ),
                    Err(e) => println!("cuda:{i}: {e}"),
                }
            }
        }
        Err(e) => println!("cuda: unavailable ({e})"),
    }
}
