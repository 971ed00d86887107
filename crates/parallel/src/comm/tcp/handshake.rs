//! Building the mesh: dialling the lower ranks until they listen, and accepting the higher ranks'
//! greetings (the job token and their rank) without letting strangers hold anyone up.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::wire::{self, read_frame_bounded, FrameKind};

/// How long an accepted connection may take to greet.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `addr`, retrying until `deadline` (the peer may not listen yet).
pub(super) fn connect_until(addr: &str, deadline: Instant) -> std::io::Result<TcpStream> {
    let target: SocketAddr = addr
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{e}")))?;
    loop {
        match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Greetings read at once; further connections wait in the kernel's queue.
const MAX_PENDING_GREETINGS: usize = 64;

/// Accepts one greeted connection from each rank above `rank`, dropping any connection that
/// does not present `token` and a fresh, valid rank. Greetings are read on threads of their own,
/// each with a deadline and at most [`MAX_PENDING_GREETINGS`] at once, so connections that stay
/// silent cannot hold up the ranks behind them.
pub(super) fn accept_higher(
    listener: &TcpListener,
    rank: usize,
    token: &str,
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
) -> std::result::Result<(), String> {
    let world = streams.len();
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    // A greeting longer than the token is refused before it is allocated.
    let (tx, rx) = std::sync::mpsc::channel::<(TcpStream, std::io::Result<wire::Frame>)>();
    let mut pending = 0usize;
    while streams[rank + 1..].iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (rank + 1..world)
                .filter(|&r| streams[r].is_none())
                .collect();
            return Err(format!("ranks {missing:?} did not connect in time"));
        }
        while let Ok((s, greeted)) = rx.try_recv() {
            pending -= 1;
            if let Ok(f) = greeted {
                let peer = f.seq as usize;
                let valid = f.kind == FrameKind::Hello
                    && f.payload == token.as_bytes()
                    && peer > rank
                    && peer < world
                    && streams[peer].is_none();
                if valid {
                    streams[peer] = Some(s);
                }
            }
        }
        if pending >= MAX_PENDING_GREETINGS {
            // Later connections wait in the kernel's queue until greetings finish.
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        match listener.accept() {
            Ok((mut s, _)) => {
                let wait = (deadline - now).min(HELLO_TIMEOUT);
                let (tx, max) = (tx.clone(), token.len() as u64);
                pending += 1;
                let spawned = std::thread::Builder::new()
                    .name("tcp-greeting".into())
                    .spawn(move || {
                        let greeted = s
                            .set_nonblocking(false)
                            .and_then(|_| {
                                s.set_read_timeout(Some(wait.max(Duration::from_millis(100))))
                            })
                            .and_then(|_| read_frame_bounded(&mut s, max));
                        let _ = tx.send((s, greeted));
                    });
                if spawned.is_err() {
                    pending -= 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => return Err(format!("accept failed: {e}")),
        }
    }
    Ok(())
}
