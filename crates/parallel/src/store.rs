//! A small TCP key–value store for rendezvous: rank 0 serves it, every process of the job connects
//! to `MASTER_ADDR:MASTER_PORT` to exchange start-up data (the NCCL unique id) and to meet at
//! barriers. Frames are length-prefixed and bounded ([`MAX_FRAME`]); a connection must first
//! present the job's token or it is closed; every wait is bounded by a timeout.
//!
//! Wire format (little-endian): a frame is `u32 length` + bytes. A client's first frame is the
//! token. Requests: `b'S' u16 key_len key value` (set), `b'G' u16 key_len key` (get, waits until
//! the key exists), `b'T' u16 key_len key` (try-get: `1` + the value, or `0` at once when the key
//! is absent), `b'A' u16 key_len key i64` (add, returns the new value). Replies: `b'O'` +
//! payload, or `b'E'` + a UTF-8 message.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Largest frame accepted in either direction.
pub const MAX_FRAME: usize = 1 << 20;

/// A rendezvous failure, naming the address and the operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Network failure or timeout.
    #[error("rendezvous store {addr}: {op}: {message}")]
    Io {
        addr: String,
        op: String,
        message: String,
    },
    /// The store answered with an error (wrong token, timeout waiting for a key, ...).
    #[error("rendezvous store {addr}: {op}: {message}")]
    Refused {
        addr: String,
        op: String,
        message: String,
    },
}

/// Connections the server serves at once by default; more are closed unanswered (a job needs one
/// per rank: [`StoreServer::start_for`] raises it for a job of more ranks).
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections that have not yet presented the token, at once: each holds a thread for up to
/// the greeting's timeout, so strangers are held to this many threads; a rank refused meanwhile
/// retries until its connect timeout.
pub const MAX_PENDING: usize = 64;
/// How long a new connection may take to present the token.
const GREETING_TIMEOUT: Duration = Duration::from_secs(10);

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    read_frame_bounded(s, MAX_FRAME)
}

/// Reads a frame of at most `max` bytes, refusing a longer one before allocating it.
fn read_frame_bounded(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds {max}"),
        ));
    }
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    if bytes.len() > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("frame of {} bytes exceeds {MAX_FRAME}", bytes.len()),
        ));
    }
    s.write_all(&(bytes.len() as u32).to_le_bytes())?;
    s.write_all(bytes)
}

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
}

/// The store server (rank 0). Stops and joins its threads when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `bind` (e.g. `0.0.0.0:29500`, or port 0 for any free port) for clients presenting
    /// `token`; a `get` waits at most `timeout` for its key.
    pub fn start(bind: &str, token: &str, timeout: Duration) -> std::io::Result<Self> {
        Self::start_for(bind, token, timeout, 0)
    }

    /// [`StoreServer::start`] for `clients` connections at once (a job's ranks): it serves at
    /// least twice that, plus the connections still greeting, so that ranks reconnecting while
    /// their old connection is still counted are served too (128 nodes of 8 GPUs are 1,024
    /// ranks, the default cap exactly).
    pub fn start_for(
        bind: &str,
        token: &str,
        timeout: Duration,
        clients: usize,
    ) -> std::io::Result<Self> {
        let max_connections = MAX_CONNECTIONS.max(2 * clients + MAX_PENDING);
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (shared, token, stop2) = (
            Arc::new(Shared::default()),
            token.as_bytes().to_vec(),
            stop.clone(),
        );
        let active = Arc::new(AtomicUsize::new(0));
        let pending = Arc::new(AtomicUsize::new(0));
        let accept = std::thread::Builder::new()
            .name("rendezvous-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = conn else { continue };
                    // Strangers cannot exhaust the server: past either cap, connections are
                    // closed.
                    if active.load(Ordering::SeqCst) >= max_connections
                        || pending.load(Ordering::SeqCst) >= MAX_PENDING
                    {
                        continue;
                    }
                    active.fetch_add(1, Ordering::SeqCst);
                    pending.fetch_add(1, Ordering::SeqCst);
                    let (shared, token) = (shared.clone(), token.clone());
                    let (mine, greeting) = (active.clone(), pending.clone());
                    let spawned = std::thread::Builder::new()
                        .name("rendezvous-conn".into())
                        .spawn(move || {
                            serve(stream, &shared, &token, timeout, &greeting);
                            mine.fetch_sub(1, Ordering::SeqCst);
                        });
                    if spawned.is_err() {
                        active.fetch_sub(1, Ordering::SeqCst);
                        pending.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })?;
        Ok(Self {
            addr,
            stop,
            accept: Some(accept),
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)); // wakes `accept`
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// One client connection: token check (counted in `pending` until it is done), then requests
/// until the peer closes.
fn serve(
    mut s: TcpStream,
    shared: &Shared,
    token: &[u8],
    timeout: Duration,
    pending: &AtomicUsize,
) {
    // The token first, briefly and bounded by its own length: nothing larger is allocated for
    // a connection that has not proven it belongs to the job.
    let _ = s.set_read_timeout(Some(GREETING_TIMEOUT));
    let greeted = read_frame_bounded(&mut s, token.len());
    pending.fetch_sub(1, Ordering::SeqCst);
    match greeted {
        Ok(t) if t == token => {}
        _ => {
            let _ = write_frame(&mut s, b"Ewrong job token");
            // Closing with the greeting's rest unread would reset the connection, and the
            // client could lose the answer; read (a bounded amount of) it first.
            let _ = s.shutdown(std::net::Shutdown::Write);
            let _ = std::io::copy(&mut (&mut s).take(MAX_FRAME as u64), &mut std::io::sink());
            return;
        }
    }
    let _ = s.set_read_timeout(Some(timeout.max(Duration::from_secs(1)) * 4));
    let _ = write_frame(&mut s, b"O");
    while let Ok(req) = read_frame(&mut s) {
        let reply = handle(&req, shared, timeout);
        if write_frame(&mut s, &reply).is_err() {
            return;
        }
    }
}

fn handle(req: &[u8], shared: &Shared, timeout: Duration) -> Vec<u8> {
    let err = |m: &str| [b"E".as_slice(), m.as_bytes()].concat();
    if req.len() < 3 {
        return err("malformed request");
    }
    let klen = u16::from_le_bytes([req[1], req[2]]) as usize;
    let Some(key) = req
        .get(3..3 + klen)
        .and_then(|k| std::str::from_utf8(k).ok())
    else {
        return err("malformed key");
    };
    let rest = &req[3 + klen..];
    let mut map = shared.map.lock().unwrap_or_else(|e| e.into_inner());
    match req[0] {
        b'S' => {
            map.insert(key.to_string(), rest.to_vec());
            shared.cv.notify_all();
            b"O".to_vec()
        }
        b'G' => {
            let deadline = Instant::now() + timeout;
            loop {
                if let Some(v) = map.get(key) {
                    return [b"O".as_slice(), v].concat();
                }
                let now = Instant::now();
                if now >= deadline {
                    return err(&format!(
                        "timed out after {:.1}s waiting for key {key:?}",
                        timeout.as_secs_f64()
                    ));
                }
                map = shared
                    .cv
                    .wait_timeout(map, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        b'T' => match map.get(key) {
            Some(v) => [b"O\x01".as_slice(), v].concat(),
            None => b"O\x00".to_vec(),
        },
        b'A' => {
            let Ok(delta) = <[u8; 8]>::try_from(rest).map(i64::from_le_bytes) else {
                return err("malformed add");
            };
            let old = map
                .get(key)
                .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                .map_or(0, i64::from_le_bytes);
            let new = old + delta;
            map.insert(key.to_string(), new.to_le_bytes().to_vec());
            shared.cv.notify_all();
            [b"O".as_slice(), &new.to_le_bytes()].concat()
        }
        _ => err("unknown request"),
    }
}

/// Whether `e` is a connection closed under us (reset, aborted, ended early), as opposed to a
/// peer that answered something else or did not answer in time.
fn lost(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionReset | ConnectionAborted | UnexpectedEof | BrokenPipe
    )
}

/// A connection to the store.
pub struct Store {
    stream: TcpStream,
    addr: String,
}

impl Store {
    /// Connects to `addr`, retrying until `timeout` (rank 0 may start later), and presents `token`.
    /// A connection lost before the store answers the greeting (a listener closing, a socket
    /// given the store's port as its own and so connected to itself) is retried too; a refusal
    /// (the wrong token) is not.
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<Self, StoreError> {
        let io = |op: &str, e: &dyn std::fmt::Display| StoreError::Io {
            addr: addr.into(),
            op: op.into(),
            message: e.to_string(),
        };
        let deadline = Instant::now() + timeout;
        // Every resolved address, IPv4 first (the server listens on IPv4; `localhost` often
        // resolves to `::1` first).
        let mut targets: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| io("resolve", &e))?
            .collect();
        targets.sort_by_key(|a| !a.is_ipv4());
        if targets.is_empty() {
            return Err(io("resolve", &"no address"));
        }
        let gave_up = |e: &dyn std::fmt::Display| {
            format!("{e} (gave up after {:.1}s)", timeout.as_secs_f64())
        };
        let mut attempt = 0usize;
        loop {
            let target = targets[attempt % targets.len()];
            attempt += 1;
            let stream = match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
                Ok(s) if s.local_addr().ok() != s.peer_addr().ok() => s,
                Ok(_) => {
                    std::thread::sleep(Duration::from_millis(100)); // connected to itself
                    continue;
                }
                Err(e) if Instant::now() >= deadline => return Err(io("connect", &gave_up(&e))),
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            // Server-side waits are bounded by the server's timeout; allow for it plus slack.
            stream
                .set_read_timeout(Some(timeout + Duration::from_secs(5)))
                .map_err(|e| io("configure", &e))?;
            stream
                .set_write_timeout(Some(timeout))
                .map_err(|e| io("configure", &e))?;
            stream.set_nodelay(true).map_err(|e| io("configure", &e))?;
            let mut store = Self {
                stream,
                addr: addr.to_string(),
            };
            match store.exchange(token.as_bytes()) {
                Ok(reply) => return store.answer("hello", &reply).map(|_| store),
                // Lost before an answer: a listener closing, not a store that refused.
                Err(e) if lost(&e) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) if lost(&e) => return Err(io("hello", &gave_up(&e))),
                Err(e) => return Err(io("hello", &e)),
            }
        }
    }

    fn call(&mut self, op: &str, frame: &[u8]) -> Result<Vec<u8>, StoreError> {
        let reply = self.exchange(frame).map_err(|e| StoreError::Io {
            addr: self.addr.clone(),
            op: op.into(),
            message: e.to_string(),
        })?;
        self.answer(op, &reply)
    }

    /// Sends one frame and reads the reply's.
    fn exchange(&mut self, frame: &[u8]) -> std::io::Result<Vec<u8>> {
        write_frame(&mut self.stream, frame)?;
        read_frame(&mut self.stream)
    }

    /// The payload of an `O` reply, or the store's error.
    fn answer(&self, op: &str, reply: &[u8]) -> Result<Vec<u8>, StoreError> {
        let refused = |message: String| StoreError::Refused {
            addr: self.addr.clone(),
            op: op.into(),
            message,
        };
        match reply.split_first() {
            Some((b'O', rest)) => Ok(rest.to_vec()),
            Some((_, msg)) => Err(refused(String::from_utf8_lossy(msg).into())),
            None => Err(refused("empty reply".into())),
        }
    }

    fn request(op: u8, key: &str, payload: &[u8]) -> Vec<u8> {
        let k = key.as_bytes();
        [&[op][..], &(k.len() as u16).to_le_bytes(), k, payload].concat()
    }

    /// This end's address of the connection: the local interface that reaches the store, which
    /// peers on other hosts can reach too.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.stream.local_addr()
    }

    /// Stores `value` under `key`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.call(&format!("set {key:?}"), &Self::request(b'S', key, value))
            .map(|_| ())
    }

    /// The value of `key`, waiting until some process sets it (bounded by the server's timeout).
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.call(&format!("get {key:?}"), &Self::request(b'G', key, &[]))
    }

    /// The value of `key` if some process has set it, without waiting.
    pub fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let v = self.call(&format!("try-get {key:?}"), &Self::request(b'T', key, &[]))?;
        Ok(match v.split_first() {
            Some((1, value)) => Some(value.to_vec()),
            _ => None,
        })
    }

    /// Adds `delta` to the integer at `key` (0 when absent) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let v = self.call(
            &format!("add {key:?}"),
            &Self::request(b'A', key, &delta.to_le_bytes()),
        )?;
        Ok(i64::from_le_bytes(
            v.as_slice().try_into().unwrap_or([0; 8]),
        ))
    }

    /// First writer wins: `key` takes `value` unless another process claimed it first; returns
    /// the value that holds, so every claimant learns the same winner (built on `add`, whose
    /// count `{key}/claims` orders the claimants). A winner that dies between its `add` and its
    /// `set` leaves the others waiting, bounded by the server's timeout.
    pub fn claim(&mut self, key: &str, value: &[u8]) -> Result<Vec<u8>, StoreError> {
        if self.add(&format!("{key}/claims"), 1)? == 1 {
            self.set(key, value)?;
        }
        self.get(key)
    }

    /// Returns once `world` processes have called `barrier(name, world)`.
    pub fn barrier(&mut self, name: &str, world: usize) -> Result<(), StoreError> {
        if self.add(&format!("{name}/count"), 1)? as usize == world {
            self.set(&format!("{name}/open"), b"")?;
        }
        self.get(&format!("{name}/open")).map(|_| ())
    }
}
