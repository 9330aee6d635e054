//! A small TCP rendezvous for multi-process runs, and torchrun's environment.
//!
//! # Environment
//!
//! [`DistEnv::from_env`] reads the variables `torchrun` sets: `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`.
//! With neither `RANK` nor `WORLD_SIZE` set it is a single-process run (rank 0
//! of 1). Missing `LOCAL_RANK`/`LOCAL_WORLD_SIZE` default to `RANK`/`WORLD_SIZE`
//! (one node); `MASTER_ADDR` defaults to `127.0.0.1` and `MASTER_PORT` to 29500
//! (torchrun's default).
//!
//! # Protocol
//!
//! A star around rank 0, which listens at `MASTER_ADDR:MASTER_PORT`:
//!
//! 1. every other rank connects, retrying every `retry_interval` until
//!    `timeout` (rank 0 may start last), and sends
//!    `HELLO = "BRAIDRZ1" | rank u32 | world_size u32` (little-endian);
//! 2. rank 0 accepts until all `world_size - 1` ranks have said hello or
//!    `timeout` passes. A connection that does not start with the magic is
//!    dropped (a stray client); a world-size mismatch, an out-of-range or a
//!    duplicate rank fails the rendezvous. Rank 0 then answers every connected
//!    rank `OK` or `ERR <reason>` (so a failure names the culprit everywhere);
//! 3. the connections stay open for [`Rendezvous::broadcast`] (rank 0 sends a
//!    frame `len u64 | bytes` to each rank, each rank acknowledges, so a
//!    broadcast is also a barrier), [`Rendezvous::all_gather`] and
//!    [`Rendezvous::barrier`].
//!
//! Every read and write carries the configured timeout; every error names the
//! address and the rank it concerns. The payload is plain bytes: the NCCL unique
//! id (128 bytes) first, later any small blob (a bucket order decided by rank 0).
//! Nothing here needs a GPU.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// `MASTER_ADDR` when unset.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// `MASTER_PORT` when unset (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Default time to wait for all ranks.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

const MAGIC: &[u8; 8] = b"BRAIDRZ1";
/// Largest frame accepted (guards against garbage lengths).
const MAX_FRAME: u64 = 1 << 30;

/// A bad or inconsistent distributed environment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A variable is set but unusable.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Invalid {
        /// Variable name.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
    /// A variable is required because another one is set.
    #[error("environment variable {var} is not set, but {because} is (torchrun sets both)")]
    Missing {
        /// The missing variable.
        var: &'static str,
        /// The variable that requires it.
        because: &'static str,
    },
}

/// Where this process sits in a distributed run (torchrun's variables).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank within this node: the GPU ordinal to use.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Rank 0's host.
    pub master_addr: String,
    /// Rank 0's port.
    pub master_port: u16,
}

impl Default for DistEnv {
    fn default() -> Self {
        Self::single()
    }
}

fn parse_num<T: std::str::FromStr>(var: &'static str, value: String) -> Result<T, EnvError>
where
    T::Err: std::fmt::Display,
{
    value.trim().parse::<T>().map_err(|e| EnvError::Invalid {
        var,
        value: value.clone(),
        reason: e.to_string(),
    })
}

impl DistEnv {
    /// Rank 0 of 1 on `127.0.0.1:29500`.
    pub fn single() -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port: DEFAULT_MASTER_PORT,
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads variables through `get` (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let rank = get("RANK");
        let world = get("WORLD_SIZE");
        let (rank, world_size) = match (rank, world) {
            (None, None) => (0usize, 1usize),
            (Some(_), None) => {
                return Err(EnvError::Missing {
                    var: "WORLD_SIZE",
                    because: "RANK",
                })
            }
            (None, Some(_)) => {
                return Err(EnvError::Missing {
                    var: "RANK",
                    because: "WORLD_SIZE",
                })
            }
            (Some(r), Some(w)) => (
                parse_num::<usize>("RANK", r)?,
                parse_num::<usize>("WORLD_SIZE", w)?,
            ),
        };
        if world_size == 0 {
            return Err(EnvError::Invalid {
                var: "WORLD_SIZE",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(EnvError::Invalid {
                var: "RANK",
                value: rank.to_string(),
                reason: format!("must be less than WORLD_SIZE={world_size}"),
            });
        }
        let local_world_size = match get("LOCAL_WORLD_SIZE") {
            Some(v) => parse_num::<usize>("LOCAL_WORLD_SIZE", v)?,
            None => world_size,
        };
        if local_world_size == 0 || local_world_size > world_size {
            return Err(EnvError::Invalid {
                var: "LOCAL_WORLD_SIZE",
                value: local_world_size.to_string(),
                reason: format!("must be in 1..={world_size} (WORLD_SIZE)"),
            });
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse_num::<usize>("LOCAL_RANK", v)?,
            None => rank % local_world_size,
        };
        if local_rank >= local_world_size {
            return Err(EnvError::Invalid {
                var: "LOCAL_RANK",
                value: local_rank.to_string(),
                reason: format!("must be less than LOCAL_WORLD_SIZE={local_world_size}"),
            });
        }
        let master_addr = get("MASTER_ADDR")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|| DEFAULT_MASTER_ADDR.into());
        let master_port = match get("MASTER_PORT") {
            Some(v) => {
                let p = parse_num::<u16>("MASTER_PORT", v.clone())?;
                if p == 0 {
                    return Err(EnvError::Invalid {
                        var: "MASTER_PORT",
                        value: v,
                        reason: "port 0 is not a rendezvous port".into(),
                    });
                }
                p
            }
            None => DEFAULT_MASTER_PORT,
        };
        Ok(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        })
    }

    /// True when more than one rank takes part.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// `MASTER_ADDR:MASTER_PORT` (IPv6 literals bracketed).
    pub fn master_endpoint(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// The rendezvous configuration for this process, default timeouts.
    pub fn rendezvous_config(&self) -> RendezvousConfig {
        RendezvousConfig::new(self.master_endpoint(), self.rank, self.world_size)
    }
}

/// A failed rendezvous. Every variant names the address and, where it applies, the rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The configuration itself is wrong.
    #[error("rendezvous at {addr}: invalid configuration: {reason}")]
    InvalidConfig {
        /// The address.
        addr: String,
        /// What is wrong.
        reason: String,
    },
    /// Rank 0 could not listen.
    #[error("rendezvous: rank 0 could not listen at {addr}: {detail}")]
    Bind {
        /// The address.
        addr: String,
        /// OS error.
        detail: String,
    },
    /// A rank could not reach rank 0 in time.
    #[error("rendezvous: rank {rank} could not connect to rank 0 at {addr} within {waited:?}: {last_error}")]
    ConnectTimeout {
        /// The address.
        addr: String,
        /// The connecting rank.
        rank: usize,
        /// How long it tried.
        waited: Duration,
        /// The last connection error.
        last_error: String,
    },
    /// Rank 0 waited in vain for some ranks.
    #[error("rendezvous at {addr}: ranks {missing:?} did not join within {waited:?}")]
    AcceptTimeout {
        /// The address.
        addr: String,
        /// Ranks that never said hello.
        missing: Vec<usize>,
        /// How long rank 0 waited.
        waited: Duration,
    },
    /// A rank reports a different world size.
    #[error("rendezvous at {addr}: rank {rank} has WORLD_SIZE={got}, rank 0 has {expected}")]
    WorldSizeMismatch {
        /// The address.
        addr: String,
        /// The offending rank.
        rank: usize,
        /// Rank 0's world size.
        expected: usize,
        /// The offending rank's world size.
        got: usize,
    },
    /// Two processes claim one rank, or a rank is out of range.
    #[error("rendezvous at {addr}: rank {rank} joined twice or is out of range (world size {world_size})")]
    BadRank {
        /// The address.
        addr: String,
        /// The rank claimed.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// Rank 0 refused this rank (its reason is included).
    #[error("rendezvous at {addr}: rank 0 rejected rank {rank}: {reason}")]
    Rejected {
        /// The address.
        addr: String,
        /// This rank.
        rank: usize,
        /// Rank 0's reason.
        reason: String,
    },
    /// A socket error or timeout after connecting.
    #[error("rendezvous at {addr}: {op} with rank {rank} failed: {detail}")]
    Io {
        /// The address.
        addr: String,
        /// The peer rank (or this rank, on a client).
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
    /// Bound on joining, and on each later exchange.
    pub timeout: Duration,
    /// Pause between connection attempts.
    pub retry_interval: Duration,
}

impl RendezvousConfig {
    /// Default timeout (300 s) and retry interval (100 ms).
    pub fn new(addr: impl Into<String>, rank: usize, world_size: usize) -> Self {
        RendezvousConfig {
            addr: addr.into(),
            rank,
            world_size,
            timeout: DEFAULT_TIMEOUT,
            retry_interval: Duration::from_millis(100),
        }
    }

    /// Sets the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn validate(&self) -> Result<(), RendezvousError> {
        let bad = |reason: String| {
            Err(RendezvousError::InvalidConfig {
                addr: self.addr.clone(),
                reason,
            })
        };
        if self.world_size == 0 {
            return bad("world size 0".into());
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} >= world size {}",
                self.rank, self.world_size
            ));
        }
        if self.timeout.is_zero() {
            return bad("zero timeout".into());
        }
        Ok(())
    }
}

/// An open rendezvous: rank 0 holds a connection to every other rank, the
/// others one connection to rank 0.
#[derive(Debug)]
pub struct Rendezvous {
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    role: Role,
}

#[derive(Debug)]
enum Role {
    /// `peers[r - 1]` is rank `r`.
    Root {
        peers: Vec<TcpStream>,
    },
    Leaf {
        root: TcpStream,
    },
    Alone,
}

/// Rank 0's bound listener, before the other ranks joined (lets a caller bind
/// port 0 and learn the real port first).
#[derive(Debug)]
pub struct RendezvousListener {
    listener: TcpListener,
    cfg: RendezvousConfig,
}

fn io_err(addr: &str, rank: usize, op: &'static str, e: impl std::fmt::Display) -> RendezvousError {
    RendezvousError::Io {
        addr: addr.to_string(),
        rank,
        op,
        detail: e.to_string(),
    }
}

fn set_timeouts(s: &TcpStream, t: Duration) -> std::io::Result<()> {
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))?;
    s.set_nodelay(true)
}

fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(&(bytes.len() as u64).to_le_bytes())?;
    s.write_all(bytes)?;
    s.flush()
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the 1 GiB limit"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

/// Status frames: `[0]` = OK, `[1, reason...]` = error.
fn write_status(s: &mut TcpStream, err: Option<&str>) -> std::io::Result<()> {
    match err {
        None => write_frame(s, &[0]),
        Some(reason) => {
            let mut b = vec![1u8];
            b.extend_from_slice(reason.as_bytes());
            write_frame(s, &b)
        }
    }
}

impl RendezvousListener {
    /// Rank 0: starts listening at `cfg.addr`.
    pub fn bind(cfg: &RendezvousConfig) -> Result<Self, RendezvousError> {
        cfg.validate()?;
        if cfg.rank != 0 {
            return Err(RendezvousError::InvalidConfig {
                addr: cfg.addr.clone(),
                reason: "only rank 0 listens".into(),
            });
        }
        let listener = TcpListener::bind(cfg.addr.as_str()).map_err(|e| RendezvousError::Bind {
            addr: cfg.addr.clone(),
            detail: e.to_string(),
        })?;
        Ok(RendezvousListener {
            listener,
            cfg: cfg.clone(),
        })
    }

    /// The address actually bound (the real port when `cfg.addr` used port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, RendezvousError> {
        self.listener
            .local_addr()
            .map_err(|e| RendezvousError::Bind {
                addr: self.cfg.addr.clone(),
                detail: e.to_string(),
            })
    }

    /// Accepts every other rank (or fails after the timeout), then answers all.
    pub fn accept_all(self) -> Result<Rendezvous, RendezvousError> {
        let cfg = self.cfg;
        let addr = cfg.addr.clone();
        let n = cfg.world_size;
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let mut peers: Vec<Option<TcpStream>> = (1..n).map(|_| None).collect();
        let mut joined = 1usize;
        let mut failure: Option<RendezvousError> = None;
        self.listener
            .set_nonblocking(true)
            .map_err(|e| io_err(&addr, 0, "configuring the listener", e))?;

        while joined < n && failure.is_none() {
            let now = Instant::now();
            if now >= deadline {
                let missing = (1..n).filter(|r| peers[r - 1].is_none()).collect();
                failure = Some(RendezvousError::AcceptTimeout {
                    addr: addr.clone(),
                    missing,
                    waited: now - start,
                });
                break;
            }
            match self.listener.accept() {
                Ok((mut s, _peer)) => {
                    let remaining = deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1));
                    if s.set_nonblocking(false).is_err()
                        || set_timeouts(&s, remaining.min(Duration::from_secs(10))).is_err()
                    {
                        continue;
                    }
                    let mut hello = [0u8; 16];
                    if s.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
                        continue; // Not one of ours: drop it and keep listening.
                    }
                    let rank =
                        u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes")) as usize;
                    let world =
                        u32::from_le_bytes(hello[12..16].try_into().expect("4 bytes")) as usize;
                    let _ = set_timeouts(&s, cfg.timeout);
                    let err = if world != n {
                        Some(RendezvousError::WorldSizeMismatch {
                            addr: addr.clone(),
                            rank,
                            expected: n,
                            got: world,
                        })
                    } else if rank == 0 || rank >= n || peers[rank - 1].is_some() {
                        Some(RendezvousError::BadRank {
                            addr: addr.clone(),
                            rank,
                            world_size: n,
                        })
                    } else {
                        None
                    };
                    match err {
                        Some(e) => {
                            let _ = write_status(&mut s, Some(&e.to_string()));
                            failure = Some(e);
                        }
                        None => {
                            peers[rank - 1] = Some(s);
                            joined += 1;
                        }
                    }
                }
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => failure = Some(io_err(&addr, 0, "accepting", e)),
            }
        }

        // Answer everyone who joined: OK, or the reason the rendezvous failed.
        let reason = failure.as_ref().map(|e| e.to_string());
        let mut answer_err = None;
        for (i, p) in peers.iter_mut().enumerate() {
            if let Some(s) = p {
                if let Err(e) = write_status(s, reason.as_deref()) {
                    answer_err.get_or_insert(io_err(&addr, i + 1, "answering hello", e));
                }
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if let Some(e) = answer_err {
            return Err(e);
        }
        let peers = peers.into_iter().map(|p| p.expect("all joined")).collect();
        Ok(Rendezvous {
            addr,
            rank: 0,
            world_size: n,
            timeout: cfg.timeout,
            role: Role::Root { peers },
        })
    }
}

impl Rendezvous {
    /// Joins the rendezvous: rank 0 listens and waits for everyone; the others
    /// connect (with retries). A world of 1 needs no network.
    pub fn connect(cfg: &RendezvousConfig) -> Result<Self, RendezvousError> {
        cfg.validate()?;
        if cfg.world_size == 1 {
            return Ok(Rendezvous {
                addr: cfg.addr.clone(),
                rank: 0,
                world_size: 1,
                timeout: cfg.timeout,
                role: Role::Alone,
            });
        }
        if cfg.rank == 0 {
            return RendezvousListener::bind(cfg)?.accept_all();
        }
        Self::connect_leaf(cfg)
    }

    fn connect_leaf(cfg: &RendezvousConfig) -> Result<Self, RendezvousError> {
        let addr = cfg.addr.clone();
        let rank = cfg.rank;
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let mut last_error = String::from("no attempt made");
        let mut stream = loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(RendezvousError::ConnectTimeout {
                    addr,
                    rank,
                    waited: start.elapsed(),
                    last_error,
                });
            }
            // Resolve on every attempt: the host name may appear late.
            match addr.to_socket_addrs() {
                Ok(addrs) => {
                    let mut connected = None;
                    for a in addrs {
                        match TcpStream::connect_timeout(&a, remaining.min(Duration::from_secs(5)))
                        {
                            Ok(s) => {
                                connected = Some(s);
                                break;
                            }
                            Err(e) => last_error = format!("{a}: {e}"),
                        }
                    }
                    if let Some(s) = connected {
                        break s;
                    }
                }
                Err(e) => last_error = format!("cannot resolve: {e}"),
            }
            std::thread::sleep(
                cfg.retry_interval
                    .min(deadline.saturating_duration_since(Instant::now())),
            );
        };
        set_timeouts(&stream, cfg.timeout)
            .map_err(|e| io_err(&addr, rank, "configuring the socket", e))?;
        let mut hello = Vec::with_capacity(16);
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(cfg.world_size as u32).to_le_bytes());
        stream
            .write_all(&hello)
            .map_err(|e| io_err(&addr, rank, "sending hello", e))?;
        // Rank 0 answers once everyone joined (or it gave up): wait up to the
        // remaining join time plus a margin for rank 0's own deadline.
        let wait = deadline.saturating_duration_since(Instant::now())
            + cfg.timeout.min(Duration::from_secs(30));
        stream
            .set_read_timeout(Some(wait))
            .map_err(|e| io_err(&addr, rank, "configuring the socket", e))?;
        let status = read_frame(&mut stream)
            .map_err(|e| io_err(&addr, rank, "waiting for rank 0's answer", e))?;
        match status.split_first() {
            Some((0, _)) => {}
            Some((1, reason)) => {
                return Err(RendezvousError::Rejected {
                    addr,
                    rank,
                    reason: String::from_utf8_lossy(reason).into_owned(),
                })
            }
            _ => {
                return Err(io_err(
                    &addr,
                    rank,
                    "reading rank 0's answer",
                    "malformed status frame",
                ))
            }
        }
        stream
            .set_read_timeout(Some(cfg.timeout))
            .map_err(|e| io_err(&addr, rank, "configuring the socket", e))?;
        Ok(Rendezvous {
            addr,
            rank,
            world_size: cfg.world_size,
            timeout: cfg.timeout,
            role: Role::Leaf { root: stream },
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank 0's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The per-exchange timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Rank 0 passes `Some(bytes)` and gets them back; every other rank passes
    /// `None` (ignored if `Some`) and receives rank 0's bytes. Returns only after
    /// every rank has received them.
    pub fn broadcast(&mut self, payload: Option<&[u8]>) -> Result<Vec<u8>, RendezvousError> {
        let addr = self.addr.clone();
        match &mut self.role {
            Role::Alone => {
                payload
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| RendezvousError::InvalidConfig {
                        addr,
                        reason: "rank 0 must provide the broadcast payload".into(),
                    })
            }
            Role::Root { peers } => {
                let data = payload.ok_or_else(|| RendezvousError::InvalidConfig {
                    addr: addr.clone(),
                    reason: "rank 0 must provide the broadcast payload".into(),
                })?;
                for (i, p) in peers.iter_mut().enumerate() {
                    write_frame(p, data).map_err(|e| io_err(&addr, i + 1, "broadcast send", e))?;
                }
                for (i, p) in peers.iter_mut().enumerate() {
                    let ack = read_frame(p)
                        .map_err(|e| io_err(&addr, i + 1, "broadcast acknowledgement", e))?;
                    if !ack.is_empty() {
                        return Err(io_err(
                            &addr,
                            i + 1,
                            "broadcast acknowledgement",
                            "unexpected payload",
                        ));
                    }
                }
                Ok(data.to_vec())
            }
            Role::Leaf { root } => {
                let rank = self.rank;
                let data =
                    read_frame(root).map_err(|e| io_err(&addr, rank, "broadcast receive", e))?;
                write_frame(root, &[])
                    .map_err(|e| io_err(&addr, rank, "broadcast acknowledgement", e))?;
                Ok(data)
            }
        }
    }

    /// Every rank contributes `mine`; every rank gets all contributions in rank order.
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, RendezvousError> {
        let addr = self.addr.clone();
        match &mut self.role {
            Role::Alone => Ok(vec![mine.to_vec()]),
            Role::Root { peers } => {
                let mut all = vec![mine.to_vec()];
                for (i, p) in peers.iter_mut().enumerate() {
                    all.push(
                        read_frame(p).map_err(|e| io_err(&addr, i + 1, "all_gather receive", e))?,
                    );
                }
                let mut packed = Vec::new();
                for part in &all {
                    packed.extend_from_slice(&(part.len() as u64).to_le_bytes());
                    packed.extend_from_slice(part);
                }
                for (i, p) in peers.iter_mut().enumerate() {
                    write_frame(p, &packed)
                        .map_err(|e| io_err(&addr, i + 1, "all_gather send", e))?;
                }
                Ok(all)
            }
            Role::Leaf { root } => {
                let rank = self.rank;
                write_frame(root, mine).map_err(|e| io_err(&addr, rank, "all_gather send", e))?;
                let packed =
                    read_frame(root).map_err(|e| io_err(&addr, rank, "all_gather receive", e))?;
                let mut out = Vec::with_capacity(self.world_size);
                let mut rest = packed.as_slice();
                while !rest.is_empty() {
                    let (len, tail) = rest.split_at_checked(8).ok_or_else(|| {
                        io_err(&addr, rank, "all_gather receive", "truncated frame")
                    })?;
                    let len = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
                    let (part, tail) = tail.split_at_checked(len).ok_or_else(|| {
                        io_err(&addr, rank, "all_gather receive", "truncated frame")
                    })?;
                    out.push(part.to_vec());
                    rest = tail;
                }
                if out.len() != self.world_size {
                    return Err(io_err(
                        &addr,
                        rank,
                        "all_gather receive",
                        format!("{} parts for {} ranks", out.len(), self.world_size),
                    ));
                }
                Ok(out)
            }
        }
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), RendezvousError> {
        self.all_gather(&[]).map(|_| ())
    }
}

/// One-shot: joins, broadcasts rank 0's `payload` (e.g. the NCCL unique id) to
/// every rank, closes. Rank 0 must pass `Some`.
pub fn broadcast_bytes(
    cfg: &RendezvousConfig,
    payload: Option<&[u8]>,
) -> Result<Vec<u8>, RendezvousError> {
    let mut r = Rendezvous::connect(cfg)?;
    r.broadcast(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn env_single_process_defaults() {
        let e = DistEnv::from_vars(vars(&[])).unwrap();
        assert_eq!(e, DistEnv::single());
        assert!(!e.is_distributed());
        assert_eq!(e.master_endpoint(), "127.0.0.1:29500");
    }

    #[test]
    fn env_torchrun_variables() {
        let e = DistEnv::from_vars(vars(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(e.master_endpoint(), "node0:1234");
        assert!(e.is_distributed());
        let v6 = DistEnv {
            master_addr: "::1".into(),
            ..e
        };
        assert_eq!(v6.master_endpoint(), "[::1]:1234");
        // LOCAL_* default to one node.
        let e = DistEnv::from_vars(vars(&[("RANK", "2"), ("WORLD_SIZE", "3")])).unwrap();
        assert_eq!((e.local_rank, e.local_world_size), (2, 3));
    }

    #[test]
    fn env_errors_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "1")], "WORLD_SIZE"),
            (&[("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "2")],
                "LOCAL_RANK",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_WORLD_SIZE", "3"),
                ],
                "LOCAL_WORLD_SIZE",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")],
                "MASTER_PORT",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")],
                "MASTER_PORT",
            ),
        ];
        for (pairs, var) in cases {
            let err = DistEnv::from_vars(vars(pairs)).unwrap_err();
            assert!(err.to_string().contains(var), "{pairs:?}: {err}");
        }
    }

    fn quick(addr: &str, rank: usize, world: usize) -> RendezvousConfig {
        let mut c = RendezvousConfig::new(addr, rank, world).with_timeout(Duration::from_secs(10));
        c.retry_interval = Duration::from_millis(10);
        c
    }

    /// Binds rank 0 on an ephemeral port, starts the other ranks as threads,
    /// runs `f` on every rank, returns the results in rank order.
    fn run_world<T: Send + 'static>(
        world: usize,
        f: impl Fn(&mut Rendezvous) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let listener = RendezvousListener::bind(&quick("127.0.0.1:0", 0, world)).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let f = std::sync::Arc::new(f);
        let handles: Vec<_> = (1..world)
            .map(|r| {
                let (addr, f) = (addr.clone(), f.clone());
                std::thread::spawn(move || {
                    f(&mut Rendezvous::connect(&quick(&addr, r, world)).unwrap())
                })
            })
            .collect();
        let mut root = listener.accept_all().unwrap();
        let mut out = vec![f(&mut root)];
        out.extend(handles.into_iter().map(|h| h.join().unwrap()));
        out
    }

    #[test]
    fn broadcast_unique_id_and_blobs_2_to_4_ranks() {
        for world in 2..=4 {
            let id: Vec<u8> = (0..128u8).map(|b| b.wrapping_mul(31)).collect();
            let id2 = id.clone();
            let got = run_world(world, move |rz| {
                let first = rz
                    .broadcast((rz.rank() == 0).then_some(id2.as_slice()))
                    .unwrap();
                let blob: Vec<u8> = if rz.rank() == 0 {
                    vec![9; 100_000]
                } else {
                    vec![]
                };
                let second = rz
                    .broadcast((rz.rank() == 0).then_some(blob.as_slice()))
                    .unwrap();
                let gathered = rz.all_gather(&[rz.rank() as u8; 3]).unwrap();
                rz.barrier().unwrap();
                (first, second.len(), gathered)
            });
            assert_eq!(got.len(), world);
            for (first, second_len, gathered) in got {
                assert_eq!(first, id);
                assert_eq!(second_len, 100_000);
                let want: Vec<Vec<u8>> = (0..world).map(|r| vec![r as u8; 3]).collect();
                assert_eq!(gathered, want);
            }
        }
    }

    #[test]
    fn leaves_retry_until_rank0_listens() {
        // Pick a free port, release it, start the leaves first.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let world = 3;
        let leaves: Vec<_> = (1..world)
            .map(|r| {
                let addr = addr.clone();
                std::thread::spawn(move || broadcast_bytes(&quick(&addr, r, world), None))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let root = broadcast_bytes(&quick(&addr, 0, world), Some(b"hello")).unwrap();
        assert_eq!(root, b"hello");
        for l in leaves {
            assert_eq!(l.join().unwrap().unwrap(), b"hello");
        }
    }

    #[test]
    fn missing_rank_times_out_and_everyone_hears_why() {
        let world = 3;
        let mut cfg0 = quick("127.0.0.1:0", 0, world);
        cfg0.timeout = Duration::from_millis(700);
        let listener = RendezvousListener::bind(&cfg0).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        // Rank 1 comes, rank 2 never does.
        let leaf = {
            let addr = addr.clone();
            std::thread::spawn(move || Rendezvous::connect(&quick(&addr, 1, world)).map(|_| ()))
        };
        let t = Instant::now();
        let err = listener.accept_all().unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        match &err {
            RendezvousError::AcceptTimeout {
                addr: a, missing, ..
            } => {
                assert_eq!(missing, &vec![2]);
                assert_eq!(a, "127.0.0.1:0");
            }
            other => panic!("expected AcceptTimeout, got {other:?}"),
        }
        assert!(err.to_string().contains("ranks [2]"), "{err}");
        let leaf_err = leaf.join().unwrap().unwrap_err();
        match &leaf_err {
            RendezvousError::Rejected { rank, reason, .. } => {
                assert_eq!(*rank, 1);
                assert!(reason.contains("ranks [2]"), "{reason}");
            }
            other => panic!("expected Rejected, got {other:?}"),
        }
    }

    #[test]
    fn leaf_without_rank0_times_out_naming_addr_and_rank() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let mut cfg = quick(&addr, 2, 4);
        cfg.timeout = Duration::from_millis(300);
        let t = Instant::now();
        let err = Rendezvous::connect(&cfg).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(
            matches!(err, RendezvousError::ConnectTimeout { rank: 2, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&addr) && msg.contains("rank 2"), "{msg}");
    }

    #[test]
    fn world_size_mismatch_is_reported_on_both_sides() {
        let listener = RendezvousListener::bind(&quick("127.0.0.1:0", 0, 2)).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let leaf = std::thread::spawn(move || Rendezvous::connect(&quick(&addr, 1, 3)).map(|_| ()));
        let err = listener.accept_all().unwrap_err();
        assert!(
            matches!(
                err,
                RendezvousError::WorldSizeMismatch {
                    rank: 1,
                    expected: 2,
                    got: 3,
                    ..
                }
            ),
            "{err:?}"
        );
        let leaf_err = leaf.join().unwrap().unwrap_err();
        assert!(leaf_err.to_string().contains("WORLD_SIZE=3"), "{leaf_err}");
    }

    #[test]
    fn stray_connections_are_ignored() {
        let listener = RendezvousListener::bind(&quick("127.0.0.1:0", 0, 2)).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let a2 = addr.clone();
        let stray = std::thread::spawn(move || {
            let mut s = TcpStream::connect(&a2).unwrap();
            let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n");
        });
        stray.join().unwrap();
        let leaf = std::thread::spawn(move || broadcast_bytes(&quick(&addr, 1, 2), None));
        let mut root = listener.accept_all().unwrap();
        assert_eq!(root.broadcast(Some(b"id")).unwrap(), b"id");
        assert_eq!(leaf.join().unwrap().unwrap(), b"id");
    }

    #[test]
    fn single_rank_needs_no_network() {
        let mut r = Rendezvous::connect(&quick("256.0.0.1:1", 0, 1)).unwrap();
        assert_eq!(r.broadcast(Some(b"x")).unwrap(), b"x");
        assert_eq!(r.all_gather(b"y").unwrap(), vec![b"y".to_vec()]);
        assert!(Rendezvous::connect(&quick("127.0.0.1:1", 3, 2)).is_err());
    }
}
