//! The TCP rendezvous that hands rank 0's NCCL unique id to every other rank.
//!
//! Rank 0 listens at `MASTER_ADDR:MASTER_PORT` ([`DistEnv::rendezvous_config`]).
//! Every other rank connects, retrying every 100 ms until `timeout`
//! (rank 0 may start last), and sends `"BRAIDRZ1" | rank u32 | world_size u32`
//! (little-endian). Rank 0 accepts until all `world_size - 1` ranks have said
//! hello or `timeout` passes. A connection that does not start with the magic
//! is dropped (a stray client); a world-size mismatch, an out-of-range or a
//! duplicate rank fails the rendezvous. Rank 0 then makes the id and answers
//! every connected rank `0 | id` (128 bytes), or `1 | reason` when the
//! rendezvous failed, so every rank reports the same cause; then it closes.
//!
//! Every read and write carries a timeout, and every error names rank 0's
//! address and the rank concerned. Nothing here needs a GPU.
//!
//! [`DistEnv::rendezvous_config`]: super::DistEnv::rendezvous_config

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Length of the id rank 0 hands out (an NCCL unique id).
pub const ID_LEN: usize = 128;
/// Default time to wait for all ranks.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Pause between a rank's attempts to connect to rank 0.
const RETRY_INTERVAL: Duration = Duration::from_millis(100);

const MAGIC: &[u8; 8] = b"BRAIDRZ1";
/// Longest failure reason rank 0 sends.
const MAX_REASON: u64 = 64 << 10;

/// A failed rendezvous. Every variant names rank 0's address and a rank: the
/// rank that failed, or the rank at fault when rank 0 refused one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// Not everyone arrived in time: on rank 0, the ranks that never joined;
    /// on another rank, rank 0 could not be reached.
    #[error("rendezvous at {addr}: rank {rank} gave up after {waited:?}: {detail}")]
    Timeout {
        /// Rank 0's address.
        addr: String,
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// Who was missing, or the last connection error.
        detail: String,
    },
    /// The rendezvous was refused: a bad configuration, a rank with another
    /// world size, a rank out of range or claimed twice, no id from rank 0;
    /// on the other ranks, rank 0's reason.
    #[error("rendezvous at {addr} failed for rank {rank}: {reason}")]
    Rejected {
        /// Rank 0's address.
        addr: String,
        /// The rank concerned.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
    /// A socket operation failed or timed out after connecting.
    #[error("rendezvous at {addr}: {op} (rank {rank}) failed: {detail}")]
    Io {
        /// Rank 0's address.
        addr: String,
        /// The peer rank on rank 0, this rank elsewhere.
        rank: usize,
        /// What was being done.
        op: &'static str,
        /// OS error or protocol problem.
        detail: String,
    },
}

/// How to rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// `host:port` of rank 0.
    pub addr: String,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Bound on joining, and on each exchange after it.
    pub timeout: Duration,
}

impl RendezvousConfig {
    /// With the default timeout (300 s).
    pub fn new(addr: impl Into<String>, rank: usize, world_size: usize) -> Self {
        RendezvousConfig {
            addr: addr.into(),
            rank,
            world_size,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    fn rejected(&self, rank: usize, reason: impl Into<String>) -> RendezvousError {
        RendezvousError::Rejected {
            addr: self.addr.clone(),
            rank,
            reason: reason.into(),
        }
    }

    fn io(&self, rank: usize, op: &'static str, e: impl std::fmt::Display) -> RendezvousError {
        RendezvousError::Io {
            addr: self.addr.clone(),
            rank,
            op,
            detail: e.to_string(),
        }
    }

    fn timed_out(&self, start: Instant, detail: String) -> RendezvousError {
        RendezvousError::Timeout {
            addr: self.addr.clone(),
            rank: self.rank,
            waited: start.elapsed(),
            detail,
        }
    }

    fn validate(&self) -> Result<(), RendezvousError> {
        let reason = if self.world_size == 0 {
            "world size 0".to_string()
        } else if self.rank >= self.world_size {
            format!("rank {} >= world size {}", self.rank, self.world_size)
        } else if self.timeout.is_zero() {
            "zero timeout".to_string()
        } else {
            return Ok(());
        };
        Err(self.rejected(self.rank, format!("invalid configuration: {reason}")))
    }
}

/// Joins the rendezvous and returns rank 0's id. Rank 0 listens, waits for
/// every other rank, then calls `make_id` and sends its id to all of them;
/// the other ranks connect and receive it (they never call `make_id`). A world
/// of one rank needs no network.
pub fn exchange_id(
    cfg: &RendezvousConfig,
    make_id: impl FnOnce() -> Result<[u8; ID_LEN], String>,
) -> Result<[u8; ID_LEN], RendezvousError> {
    cfg.validate()?;
    match (cfg.world_size, cfg.rank) {
        (1, _) => make_id().map_err(|reason| cfg.rejected(0, reason)),
        (_, 0) => {
            let listener =
                TcpListener::bind(cfg.addr.as_str()).map_err(|e| cfg.io(0, "listening", e))?;
            serve(listener, cfg, make_id)
        }
        _ => receive_id(cfg),
    }
}

/// Rank 0: waits on `listener` for every other rank (or the timeout), then
/// calls `make_id` and answers every rank that joined: the id, or why the
/// rendezvous failed.
fn serve(
    listener: TcpListener,
    cfg: &RendezvousConfig,
    make_id: impl FnOnce() -> Result<[u8; ID_LEN], String>,
) -> Result<[u8; ID_LEN], RendezvousError> {
    let n = cfg.world_size;
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| cfg.io(0, "listening", e))?;
    // `joined[r - 1]` is rank r; a refused connection is answered too.
    let mut joined: Vec<Option<TcpStream>> = (1..n).map(|_| None).collect();
    let mut refused = None;
    let result = loop {
        if joined.iter().all(Option::is_some) {
            break make_id().map_err(|e| cfg.rejected(0, format!("no unique id: {e}")));
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..n).filter(|r| joined[r - 1].is_none()).collect();
            break Err(cfg.timed_out(start, format!("ranks {missing:?} did not join")));
        }
        let (s, rank, world) = match listener.accept() {
            Ok((s, _)) => match read_hello(s, deadline, cfg.timeout) {
                Some(hello) => hello,
                None => continue, // Not one of ours: drop it, keep listening.
            },
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => break Err(cfg.io(0, "accepting", e)),
        };
        let why = match joined.get_mut(rank.wrapping_sub(1)) {
            _ if world != n => format!("it has WORLD_SIZE={world}, rank 0 has {n}"),
            Some(slot @ None) => {
                *slot = Some(s);
                continue;
            }
            _ => format!("joined twice or out of range (world size {n})"),
        };
        refused = Some(s);
        break Err(cfg.rejected(rank, why));
    };
    let answer = match &result {
        Ok(id) => [&[0u8][..], id].concat(),
        Err(e) => [&[1u8][..], e.to_string().as_bytes()].concat(),
    };
    let mut answered = Ok(());
    for (rank, s) in joined.iter_mut().enumerate() {
        if let Some(Err(e)) = s.as_mut().map(|s| s.write_all(&answer)) {
            answered = answered.and(Err(cfg.io(rank + 1, "answering", e)));
        }
    }
    if let Some(mut s) = refused {
        let _ = s.write_all(&answer);
    }
    result.and_then(|id| answered.map(|()| id))
}

/// Reads a hello: `None` when it is not one (a stray connection).
fn read_hello(
    mut s: TcpStream,
    deadline: Instant,
    timeout: Duration,
) -> Option<(TcpStream, usize, usize)> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    let wait = remaining.clamp(Duration::from_millis(1), Duration::from_secs(10));
    s.set_nonblocking(false).ok()?;
    set_timeouts(&s, wait).ok()?;
    let mut hello = [0u8; 16];
    s.read_exact(&mut hello).ok()?;
    if &hello[..8] != MAGIC {
        return None;
    }
    set_timeouts(&s, timeout).ok()?;
    let word = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().expect("4 bytes")) as usize;
    Some((s, word(8), word(12)))
}

fn set_timeouts(s: &TcpStream, t: Duration) -> std::io::Result<()> {
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))?;
    s.set_nodelay(true)
}

/// A rank other than 0: connects (with retries), says hello, reads the answer.
fn receive_id(cfg: &RendezvousConfig) -> Result<[u8; ID_LEN], RendezvousError> {
    let rank = cfg.rank;
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    let mut last_error = String::from("no attempt made");
    let mut s = 'connect: loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            let detail = format!("could not connect to rank 0: {last_error}");
            return Err(cfg.timed_out(start, detail));
        }
        // Resolve on every attempt: the host name may appear late.
        match cfg.addr.to_socket_addrs() {
            Ok(addrs) => {
                for a in addrs {
                    match TcpStream::connect_timeout(&a, remaining.min(Duration::from_secs(5))) {
                        Ok(s) => break 'connect s,
                        Err(e) => last_error = format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("cannot resolve: {e}"),
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(RETRY_INTERVAL.min(remaining));
    };
    // Rank 0 answers once everyone joined (or it gave up): wait up to the
    // remaining join time plus a margin for rank 0's own deadline.
    let wait = deadline.saturating_duration_since(Instant::now())
        + cfg.timeout.min(Duration::from_secs(30));
    let hello = [
        &MAGIC[..],
        &(rank as u32).to_le_bytes(),
        &(cfg.world_size as u32).to_le_bytes(),
    ]
    .concat();
    set_timeouts(&s, wait)
        .and_then(|()| s.write_all(&hello))
        .map_err(|e| cfg.io(rank, "sending hello", e))?;
    let mut status = [0u8; 1];
    s.read_exact(&mut status)
        .map_err(|e| cfg.io(rank, "waiting for rank 0's answer", e))?;
    match status[0] {
        0 => {
            let mut id = [0u8; ID_LEN];
            s.read_exact(&mut id)
                .map_err(|e| cfg.io(rank, "receiving the id", e))?;
            Ok(id)
        }
        1 => {
            let mut reason = Vec::new();
            let _ = s.take(MAX_REASON).read_to_end(&mut reason);
            let reason = String::from_utf8_lossy(&reason);
            Err(cfg.rejected(rank, format!("rank 0 answered: {reason}")))
        }
        b => Err(cfg.io(rank, "reading rank 0's answer", format!("bad status {b}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick(addr: &str, rank: usize, world: usize) -> RendezvousConfig {
        let mut cfg = RendezvousConfig::new(addr, rank, world);
        cfg.timeout = Duration::from_secs(10);
        cfg
    }

    fn id(salt: u8) -> [u8; ID_LEN] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(31) ^ salt)
    }

    fn never() -> Result<[u8; ID_LEN], String> {
        panic!("only rank 0 makes the id")
    }

    /// Rank 0 bound on an ephemeral port, and its configuration.
    fn rank0(world: usize) -> (TcpListener, RendezvousConfig) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let cfg = quick(&listener.local_addr().unwrap().to_string(), 0, world);
        (listener, cfg)
    }

    /// An address where nobody listens (a port picked free, then released).
    fn free_addr() -> String {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string()
    }

    type Leaf = std::thread::JoinHandle<Result<[u8; ID_LEN], RendezvousError>>;

    /// A rank other than 0, on a thread.
    fn leaf(addr: &str, rank: usize, world: usize) -> Leaf {
        let cfg = quick(addr, rank, world);
        std::thread::spawn(move || exchange_id(&cfg, never))
    }

    #[test]
    fn every_rank_gets_rank0s_id_2_to_4_ranks() {
        for world in 2..=4 {
            let (listener, cfg) = rank0(world);
            let leaves: Vec<_> = (1..world).map(|r| leaf(&cfg.addr, r, world)).collect();
            let want = id(world as u8);
            assert_eq!(serve(listener, &cfg, || Ok(want)).unwrap(), want);
            for l in leaves {
                assert_eq!(l.join().unwrap().unwrap(), want);
            }
        }
    }

    #[test]
    fn leaves_retry_until_rank0_listens() {
        let (addr, world) = (free_addr(), 3);
        let leaves: Vec<_> = (1..world).map(|r| leaf(&addr, r, world)).collect();
        std::thread::sleep(Duration::from_millis(300));
        let root = exchange_id(&quick(&addr, 0, world), || Ok(id(7))).unwrap();
        assert_eq!(root, id(7));
        for l in leaves {
            assert_eq!(l.join().unwrap().unwrap(), id(7));
        }
    }

    #[test]
    fn missing_rank_times_out_and_everyone_hears_why() {
        let (listener, mut cfg) = rank0(3);
        cfg.timeout = Duration::from_millis(700);
        // Rank 1 comes, rank 2 never does.
        let leaf = leaf(&cfg.addr, 1, 3);
        let t = Instant::now();
        let err = serve(listener, &cfg, || Ok(id(0))).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        match &err {
            RendezvousError::Timeout { addr, rank: 0, .. } => assert_eq!(addr, &cfg.addr),
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert!(err.to_string().contains("ranks [2]"), "{err}");
        match &leaf.join().unwrap().unwrap_err() {
            RendezvousError::Rejected { rank, reason, .. } => {
                assert_eq!(*rank, 1);
                assert!(reason.contains("ranks [2]"), "{reason}");
            }
            other => panic!("expected Rejected, got {other:?}"),
        }
    }

    #[test]
    fn leaf_without_rank0_times_out_naming_addr_and_rank() {
        let addr = free_addr();
        let mut cfg = quick(&addr, 2, 4);
        cfg.timeout = Duration::from_millis(300);
        let t = Instant::now();
        let err = exchange_id(&cfg, never).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(
            matches!(err, RendezvousError::Timeout { rank: 2, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&addr) && msg.contains("rank 2"), "{msg}");
    }

    #[test]
    fn world_size_mismatch_is_reported_on_both_sides() {
        let (listener, cfg) = rank0(2);
        let leaf = leaf(&cfg.addr, 1, 3);
        let err = serve(listener, &cfg, || Ok(id(0))).unwrap_err();
        assert!(
            matches!(&err, RendezvousError::Rejected { rank: 1, reason, .. }
                if reason.contains("WORLD_SIZE=3")),
            "{err:?}"
        );
        let leaf_err = leaf.join().unwrap().unwrap_err();
        assert!(leaf_err.to_string().contains("WORLD_SIZE=3"), "{leaf_err}");
    }

    #[test]
    fn no_id_on_rank0_is_reported_on_every_rank() {
        let (listener, cfg) = rank0(2);
        let leaf = leaf(&cfg.addr, 1, 2);
        let err = serve(listener, &cfg, || Err("no NCCL".into())).unwrap_err();
        assert!(err.to_string().contains("no NCCL"), "{err}");
        let leaf_err = leaf.join().unwrap().unwrap_err();
        assert!(leaf_err.to_string().contains("no NCCL"), "{leaf_err}");
    }

    #[test]
    fn stray_connections_are_ignored() {
        let (listener, cfg) = rank0(2);
        let mut stray = TcpStream::connect(&cfg.addr).unwrap();
        let _ = stray.write_all(b"GET / HTTP/1.1\r\n\r\n");
        drop(stray);
        let leaf = leaf(&cfg.addr, 1, 2);
        assert_eq!(serve(listener, &cfg, || Ok(id(3))).unwrap(), id(3));
        assert_eq!(leaf.join().unwrap().unwrap(), id(3));
    }

    #[test]
    fn single_rank_needs_no_network() {
        let one = exchange_id(&quick("256.0.0.1:1", 0, 1), || Ok(id(1)));
        assert_eq!(one.unwrap(), id(1));
        assert!(exchange_id(&quick("127.0.0.1:1", 3, 2), never).is_err());
    }
}
