//! Shared helpers for the engine's integration tests: random programs and
//! their sequential reference.
#![allow(dead_code)]

use braid::cuda::memory::{memcpy_dtoh_async, memcpy_htod_async};
use braid::{Buffer, CudaTaskCtx, DevBytes, DynAccess, Mode, Policy, Runtime, TaskError};
use proptest::prelude::*;
use std::ops::Range;

/// One access of a generated task: buffer index, element range, mode.
#[derive(Debug, Clone)]
pub struct GenAccess {
    pub buf: usize,
    pub range: Range<usize>,
    pub mode: Mode,
}

/// One generated task.
#[derive(Debug, Clone)]
pub struct GenTask {
    pub accesses: Vec<GenAccess>,
    pub salt: u32,
    /// Busy-work iterations, to shake up interleavings.
    pub spin: u32,
}

#[derive(Debug, Clone)]
pub struct Program {
    pub sizes: Vec<usize>,
    pub tasks: Vec<GenTask>,
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![Just(Mode::Read), Just(Mode::Write), Just(Mode::ReadWrite)]
}

fn conflicting(a: &GenAccess, b: &GenAccess) -> bool {
    a.buf == b.buf && a.range.start < b.range.end && b.range.start < a.range.end
}

/// Random programs: 1–4 buffers of 1–48 u32s, up to `max_tasks` tasks of
/// 1–3 accesses each on random sub-ranges. Accesses of one task never
/// overlap each other (a task declares each byte once).
pub fn program(max_tasks: usize) -> impl Strategy<Value = Program> {
    prop::collection::vec(1usize..48, 1..5).prop_flat_map(move |sizes| {
        let nb = sizes.len();
        let sz = sizes.clone();
        let access = (0..nb, any::<(u16, u16)>(), mode()).prop_map(move |(b, (x, y), m)| {
            let n = sz[b];
            let (mut s, mut e) = (x as usize % (n + 1), y as usize % (n + 1));
            if s > e {
                std::mem::swap(&mut s, &mut e);
            }
            if s == e {
                e = (s + 1).min(n);
                s = e - 1;
            }
            GenAccess {
                buf: b,
                range: s..e,
                mode: m,
            }
        });
        let task = (prop::collection::vec(access, 1..4), any::<u32>(), 0u32..300).prop_map(
            |(mut acc, salt, spin)| {
                let mut keep: Vec<GenAccess> = Vec::new();
                for a in acc.drain(..) {
                    if !keep.iter().any(|k| conflicting(k, &a)) {
                        keep.push(a);
                    }
                }
                GenTask {
                    accesses: keep,
                    salt,
                    spin,
                }
            },
        );
        (Just(sizes), prop::collection::vec(task, 1..max_tasks))
            .prop_map(|(sizes, tasks)| Program { sizes, tasks })
    })
}

/// The task body's arithmetic, shared by the engine run and the reference:
/// fold every readable access into an accumulator, then overwrite (write) or
/// update (read_write) every writable one.
pub fn apply(t: &GenTask, reads: &[&[u32]], writes: &mut [&mut [u32]], modes: &[Mode]) {
    let mut acc = t.salt;
    for r in reads {
        for (i, &x) in r.iter().enumerate() {
            acc = acc.wrapping_mul(31).wrapping_add(x ^ i as u32);
        }
    }
    let mut spin = acc;
    for _ in 0..t.spin {
        spin = std::hint::black_box(spin.rotate_left(5) ^ 0x9e37_79b9);
    }
    let mut wi = 0;
    for m in modes {
        if !m.writes() {
            continue;
        }
        let w = &mut writes[wi];
        wi += 1;
        for (i, x) in w.iter_mut().enumerate() {
            *x = match m {
                Mode::Write => acc.wrapping_add((i as u32).wrapping_mul(t.salt | 1)),
                _ => x.wrapping_mul(3).wrapping_add(acc).wrapping_add(i as u32),
            };
        }
    }
    let _ = spin;
}

/// Runs task `t` on `data`, one vector per access in declaration order: folds
/// the readable ones, then overwrites or updates the writable ones in place.
pub fn execute(t: &GenTask, data: &mut [Vec<u32>]) {
    let reads: Vec<Vec<u32>> = t
        .accesses
        .iter()
        .zip(data.iter())
        .filter(|(a, _)| a.mode.reads())
        .map(|(_, d)| d.clone())
        .collect();
    let r: Vec<&[u32]> = reads.iter().map(|v| v.as_slice()).collect();
    let mut w: Vec<&mut [u32]> = t
        .accesses
        .iter()
        .zip(data.iter_mut())
        .filter(|(a, _)| a.mode.writes())
        .map(|(_, d)| d.as_mut_slice())
        .collect();
    let modes: Vec<Mode> = t.accesses.iter().map(|a| a.mode).collect();
    apply(t, &r, &mut w, &modes);
}

/// Runs the program one task at a time on plain vectors.
pub fn sequential(p: &Program) -> Vec<Vec<u32>> {
    let mut bufs: Vec<Vec<u32>> = p
        .sizes
        .iter()
        .enumerate()
        .map(|(b, &n)| (0..n as u32).map(|i| i * 7 + b as u32).collect())
        .collect();
    for t in &p.tasks {
        let mut data: Vec<Vec<u32>> = t
            .accesses
            .iter()
            .map(|a| bufs[a.buf][a.range.clone()].to_vec())
            .collect();
        execute(t, &mut data);
        for (a, d) in t.accesses.iter().zip(data) {
            if a.mode.writes() {
                bufs[a.buf][a.range.clone()].copy_from_slice(&d);
            }
        }
    }
    bufs
}

/// Runs the program on `rt` and reads every buffer back.
pub fn on_engine(rt: &Runtime, p: &Program) -> Vec<Vec<u32>> {
    let bufs = alloc_buffers(rt, p);
    submit_tasks(rt, &bufs, &p.tasks);
    read_back(rt, &bufs)
}

/// The program's buffers, with the same initial contents as `sequential`'s.
pub fn alloc_buffers(rt: &Runtime, p: &Program) -> Vec<Buffer> {
    p.sizes
        .iter()
        .enumerate()
        .map(|(b, &n)| {
            let init: Vec<u32> = (0..n as u32).map(|i| i * 7 + b as u32).collect();
            rt.alloc_from(format!("b{b}"), &init).unwrap()
        })
        .collect()
}

/// Submits `tasks` on `bufs`, one engine task each.
pub fn submit_tasks(rt: &Runtime, bufs: &[Buffer], tasks: &[GenTask]) {
    submit_tasks_as(rt, bufs, tasks, |_| braid::TaskKind::Compute)
}

/// [`submit_tasks`], each task of the kind `kind` gives it (the same
/// arithmetic whatever its kind).
pub fn submit_tasks_as(
    rt: &Runtime,
    bufs: &[Buffer],
    tasks: &[GenTask],
    kind: impl Fn(&GenTask) -> braid::TaskKind,
) {
    for t in tasks {
        let k = kind(t);
        // Modes chosen at run time: byte accesses, one per generated access.
        let tokens: Vec<DynAccess> = t
            .accesses
            .iter()
            .map(|a| {
                let v = bufs[a.buf].view_of::<u32>(a.range.clone()).unwrap();
                v.access(a.mode)
            })
            .collect();
        let (t, t2) = (t.clone(), t.clone());
        // The same arithmetic on every backend: copy the declared data out,
        // compute on the host, copy the results back (on CUDA these are
        // copies on the task's stream, ordered by the engine's events).
        rt.task(format!("t{}", t.salt))
            .kind(k)
            .run_any(
                tokens,
                move |mut host| {
                    let mut data: Vec<Vec<u32>> = host
                        .iter()
                        .map(|h| bytemuck::pod_collect_to_vec(h.as_slice()))
                        .collect();
                    execute(&t, &mut data);
                    for (h, d) in host.iter_mut().zip(&data) {
                        if let Some(out) = h.as_mut_slice() {
                            out.copy_from_slice(bytemuck::cast_slice(d));
                        }
                    }
                },
                move |dev, cu| -> Result<(), TaskError> {
                    let mut data = dev
                        .iter()
                        .map(|d| download(cu, d))
                        .collect::<Result<Vec<_>, _>>()?;
                    execute(&t2, &mut data);
                    for (d, v) in dev.iter().zip(&data) {
                        if d.writes {
                            upload(cu, d, v)?;
                        }
                    }
                    Ok(())
                },
            )
            .unwrap();
    }
}

/// Reads every buffer back, then synchronises (no task may have failed).
pub fn read_back(rt: &Runtime, bufs: &[Buffer]) -> Vec<Vec<u32>> {
    let out = bufs
        .iter()
        .map(|b| rt.read_vec::<u32>(b).unwrap())
        .collect();
    rt.synchronize().unwrap();
    out
}

/// Copies the device bytes of a declared access into a new vector.
fn download(cu: &CudaTaskCtx<'_>, d: &DevBytes) -> Result<Vec<u32>, TaskError> {
    let mut out = vec![0u32; d.len / 4];
    // SAFETY: `d` is a declared access of the running task, so `d.len` bytes
    // of live device memory at `d.ptr` that no other task writes meanwhile;
    // `out` holds `d.len` bytes and outlives the copy (synchronised below).
    unsafe { memcpy_dtoh_async(out.as_mut_ptr().cast(), d.ptr, d.len, cu.stream())? };
    cu.stream().synchronize()?;
    Ok(out)
}

/// Overwrites the device bytes of a declared writable access with `data`.
fn upload(cu: &CudaTaskCtx<'_>, d: &DevBytes, data: &[u32]) -> Result<(), TaskError> {
    assert_eq!(d.len, data.len() * 4);
    // SAFETY: `d` is a declared write of the running task, so no other task
    // touches its `d.len` device bytes meanwhile; `data` outlives the copy
    // (synchronised below).
    unsafe { memcpy_htod_async(d.ptr, data.as_ptr().cast(), d.len, cu.stream())? };
    cu.stream().synchronize()?;
    Ok(())
}

/// The backends to run a test body on: the CPU always, CUDA when a device is
/// present (and required when `BRAID_REQUIRE_GPU=1`).
pub fn backends() -> Vec<braid::BackendKind> {
    let mut v = vec![braid::BackendKind::Cpu];
    if braid::cuda::gpu_or_skip("CUDA backend") {
        v.push(braid::BackendKind::Cuda { device: 0 });
    }
    v
}

/// A CPU runtime that uses all its compute streams whatever the core budget
/// (`oversubscribe`), so tests cover every stream count however many other
/// tests' runtimes are alive in the process.
pub fn cpu_runtime(streams: usize, policy: Policy) -> Runtime {
    Runtime::builder()
        .backend(braid::BackendKind::Cpu)
        .compute_streams(streams)
        .comm_streams(1)
        .policy(policy)
        .oversubscribe(true)
        .build()
        .unwrap()
}

/// Scope segments random programs use (nested up to three deep).
pub const SEGMENTS: [&str; 6] = [
    "forward",
    "backward",
    "layer0",
    "layer1",
    "attn",
    "optimizer",
];

/// A random scope path: 0–3 segments (0: outside any scope).
pub fn scope_path() -> impl Strategy<Value = Vec<&'static str>> {
    prop::collection::vec(prop::sample::select(&SEGMENTS[..]), 0..4)
}

/// One rule of a random placement file; `stream` is taken modulo the
/// runtime's compute streams when the file is written.
#[derive(Debug, Clone)]
pub struct GenRule {
    pub pattern: &'static str,
    pub stream: Option<u8>,
    pub priority: Option<&'static str>,
    pub policy: Option<&'static str>,
    pub bundle: Option<bool>,
    pub replay: Option<bool>,
}

/// A random placement file: up to six rules and perhaps `[runtime]`.
#[derive(Debug, Clone)]
pub struct GenFile {
    pub auto_replay: Option<bool>,
    pub rules: Vec<GenRule>,
}

/// Random placement files over [`SEGMENTS`]' scopes.
pub fn placement_file() -> impl Strategy<Value = GenFile> {
    let pattern = prop::sample::select(
        &[
            "forward",
            "forward/*",
            "*/layer*",
            "**/attn",
            "backward/layer1",
            "**",
            "layer?",
            "*",
            "optimizer/**",
        ][..],
    );
    let rule = (
        pattern,
        prop::option::of(0u8..8),
        prop::option::of(prop::sample::select(&["main", "side"][..])),
        prop::option::of(prop::sample::select(
            &["single", "round-robin", "affinity"][..],
        )),
        prop::option::of(any::<bool>()),
        prop::option::of(any::<bool>()),
    )
        .prop_map(
            |(pattern, stream, priority, policy, bundle, replay)| GenRule {
                pattern,
                stream,
                priority,
                policy,
                bundle,
                replay,
            },
        );
    (
        prop::option::of(any::<bool>()),
        prop::collection::vec(rule, 0..7),
    )
        .prop_map(|(auto_replay, rules)| GenFile { auto_replay, rules })
}

impl GenFile {
    /// The file's TOML for a runtime of `compute` compute streams and one
    /// comm stream (stream codes 0..compute are compute streams; the rest
    /// are `comm`, `side` and `any`).
    pub fn toml(&self, compute: usize) -> String {
        let mut out = String::new();
        if let Some(a) = self.auto_replay {
            out += &format!("[runtime]\nauto_replay = {a}\n\n");
        }
        for r in &self.rules {
            out += &format!("[[scope]]\npattern = \"{}\"\n", r.pattern);
            if let Some(s) = r.stream {
                let s = s as usize % (compute + 3);
                out += &match s.checked_sub(compute) {
                    None => format!("stream = {s}\n"),
                    Some(0) => "stream = \"comm\"\n".to_string(),
                    Some(1) => "stream = \"side\"\n".to_string(),
                    Some(_) => "stream = \"any\"\n".to_string(),
                };
            }
            if let Some(p) = r.priority {
                out += &format!("priority = \"{p}\"\n");
            }
            if let Some(p) = r.policy {
                out += &format!("policy = \"{p}\"\n");
            }
            if let Some(b) = r.bundle {
                out += &format!("bundle = {b}\n");
            }
            if let Some(b) = r.replay {
                out += &format!("replay = {b}\n");
            }
        }
        out
    }
}

/// Submits `tasks` as [`submit_tasks`] does, task `i` inside the scope
/// `paths[i % paths.len()]` (no scope when `paths` is empty): guards are
/// closed and opened between tasks so that scopes nest as the paths say.
pub fn submit_scoped(rt: &Runtime, bufs: &[Buffer], tasks: &[GenTask], paths: &[Vec<&str>]) {
    let mut open: Vec<(&str, braid::Scope)> = Vec::new();
    for (i, t) in tasks.iter().enumerate() {
        let want: &[&str] = if paths.is_empty() {
            &[]
        } else {
            &paths[i % paths.len()]
        };
        let keep = open
            .iter()
            .zip(want)
            .take_while(|((a, _), b)| a == *b)
            .count();
        while open.len() > keep {
            open.pop();
        }
        for seg in &want[keep..] {
            open.push((seg, rt.scope(seg)));
        }
        let expected = (!want.is_empty()).then(|| want.join("/"));
        assert_eq!(rt.current_scope().as_deref(), expected.as_deref());
        submit_tasks(rt, bufs, std::slice::from_ref(t));
    }
    while open.pop().is_some() {}
}

/// `spin_then_add` of the engine's test kernels on the runtime's device.
pub fn spin_then_add(rt: &Runtime) -> std::sync::Arc<braid::cuda::CudaFunction> {
    use braid::cuda::{test_kernels, KernelCache};
    let dev = rt.cuda_device().expect("a CUDA runtime").clone();
    let module = KernelCache::global()
        .module(&dev, test_kernels::SPIN, "spin.cu")
        .expect("the test kernels compile");
    std::sync::Arc::new(module.function("spin_then_add").expect("spin_then_add"))
}

/// Submits task `name` on stream `s`: `add` (`spin_then_add`) spins for
/// `spins` clock cycles, then adds `by` to every f32 of `v`.
pub fn submit_spin_add(
    rt: &Runtime,
    add: &std::sync::Arc<braid::cuda::CudaFunction>,
    (name, s): (&'static str, usize),
    v: &Buffer,
    spins: i64,
    by: f32,
) -> braid::Result<()> {
    use braid::cuda::{KernelArgs, LaunchConfig};
    let (f, n) = (add.clone(), v.len_of::<f32>());
    rt.task(name)
        .on_stream(s)
        .run_cuda(
            v.read_write::<f32>(),
            move |v, cu| -> Result<(), TaskError> {
                let mut args = KernelArgs::new();
                args.i64(spins).ptr(v.ptr()).i32(n as i32).f32(by);
                // SAFETY: spin_then_add(long long, float*, int, float) over
                // the n declared floats of `v`.
                unsafe { f.launch(cu.stream(), LaunchConfig::linear(n, 256), &args)? };
                Ok(())
            },
        )
        .map(drop)
}
