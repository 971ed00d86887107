//! The rendezvous store over loopback: threads and separate processes exchange values and meet at
//! barriers; wrong tokens, oversized frames, missing keys and dead servers give clear errors.

use std::process::Command;
use std::time::{Duration, Instant};

use parallel::store::{Store, StoreServer, MAX_FRAME};

const TOKEN: &str = "job-1234";

#[test]
fn threads_exchange_values_and_meet_at_a_barrier() {
    let server = StoreServer::start("127.0.0.1:0", TOKEN, Duration::from_secs(10)).unwrap();
    let addr = server.addr().to_string();
    let world = 4;
    std::thread::scope(|s| {
        for rank in 0..world {
            let addr = addr.clone();
            s.spawn(move || {
                let mut st = Store::connect(&addr, TOKEN, Duration::from_secs(10)).unwrap();
                st.set(&format!("id/{rank}"), format!("rank-{rank}").as_bytes())
                    .unwrap();
                st.barrier("start", world).unwrap();
                for other in 0..world {
                    assert_eq!(
                        st.get(&format!("id/{other}")).unwrap(),
                        format!("rank-{other}").into_bytes()
                    );
                }
                st.barrier("end", world).unwrap();
            });
        }
    });
    let mut st = Store::connect(&addr, TOKEN, Duration::from_secs(5)).unwrap();
    assert_eq!(st.add("end/count", 0).unwrap(), world as i64);
    // try-get answers at once, whether the key is there or not (an empty value is a value).
    let t = Instant::now();
    assert_eq!(st.try_get("absent").unwrap(), None);
    assert_eq!(st.try_get("id/2").unwrap(), Some(b"rank-2".to_vec()));
    st.set("empty", b"").unwrap();
    assert_eq!(st.try_get("empty").unwrap(), Some(vec![]));
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn errors_are_clear_and_bounded() {
    let server = StoreServer::start("127.0.0.1:0", TOKEN, Duration::from_millis(300)).unwrap();
    let addr = server.addr().to_string();

    let e = Store::connect(&addr, "other-job", Duration::from_secs(5))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("wrong job token") && e.contains(&addr), "{e}");
    // A token longer than the job's is refused before its end is read; the answer still
    // arrives (the server reads the rest before closing instead of resetting the connection).
    let long = "x".repeat(64 << 10);
    let start = Instant::now();
    let e = Store::connect(&addr, &long, Duration::from_secs(5))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("wrong job token"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));

    let mut st = Store::connect(&addr, TOKEN, Duration::from_secs(5)).unwrap();
    let start = Instant::now();
    let e = st.get("never-set").unwrap_err().to_string();
    assert!(e.contains("timed out") && e.contains("never-set"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));

    let e = st
        .set("big", &vec![0u8; MAX_FRAME + 1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("exceeds"), "{e}");

    drop(server);
    let start = Instant::now();
    let e = Store::connect(&addr, TOKEN, Duration::from_millis(500))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("connect") && e.contains(&addr), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));
}

/// A connection closed before the greeting is answered (another listener briefly on the port,
/// a server going away) is retried until the store answers, within the connect timeout.
#[test]
fn a_connection_lost_before_the_greeting_is_retried() {
    let early = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = early.local_addr().unwrap().to_string();
    let client = {
        let addr = addr.clone();
        std::thread::spawn(move || Store::connect(&addr, TOKEN, Duration::from_secs(10)))
    };
    // Take the client's first connection in and close it unanswered, then serve the store.
    let (taken, _) = early.accept().unwrap();
    drop((taken, early));
    let server = StoreServer::start(&addr, TOKEN, Duration::from_secs(10)).unwrap();
    let mut st = client.join().unwrap().unwrap();
    st.set("k", b"v").unwrap();
    assert_eq!(st.get("k").unwrap(), b"v");
    drop(server);

    // Another service on the port answers something else: that fails at once, not after the
    // timeout.
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = other.local_addr().unwrap().to_string();
    let service = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut c, _) = other.accept().unwrap();
        let _ = c.read(&mut [0u8; 64]);
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_secs(1));
    });
    let start = Instant::now();
    let e = Store::connect(&addr, TOKEN, Duration::from_secs(30))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("hello") && e.contains("exceeds"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(10));
    service.join().unwrap();
}

/// Child side of `processes_rendezvous_on_loopback` (runs only inside a spawned child).
#[test]
fn store_child_process() {
    let (Ok(addr), Ok(rank), Ok(world)) = (
        std::env::var("STORE_TEST_ADDR"),
        std::env::var("STORE_TEST_RANK"),
        std::env::var("STORE_TEST_WORLD"),
    ) else {
        return;
    };
    let (rank, world): (usize, usize) = (rank.parse().unwrap(), world.parse().unwrap());
    let mut st = Store::connect(&addr, TOKEN, Duration::from_secs(20)).unwrap();
    st.set(
        &format!("pid/{rank}"),
        std::process::id().to_string().as_bytes(),
    )
    .unwrap();
    st.barrier("all", world).unwrap();
    let pids: Vec<Vec<u8>> = (0..world)
        .map(|r| st.get(&format!("pid/{r}")).unwrap())
        .collect();
    assert_eq!(pids[rank], std::process::id().to_string().into_bytes());
    st.set(&format!("done/{rank}"), &pids.concat()).unwrap();
}

#[test]
fn processes_rendezvous_on_loopback() {
    let server = StoreServer::start("127.0.0.1:0", TOKEN, Duration::from_secs(20)).unwrap();
    let world = 3;
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "store_child_process", "--test-threads=1"])
                .env("STORE_TEST_ADDR", server.addr().to_string())
                .env("STORE_TEST_RANK", rank.to_string())
                .env("STORE_TEST_WORLD", world.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let mut st = Store::connect(&server.addr().to_string(), TOKEN, Duration::from_secs(5)).unwrap();
    let seen: Vec<Vec<u8>> = (0..world)
        .map(|r| st.get(&format!("done/{r}")).unwrap())
        .collect();
    assert!(
        seen.windows(2).all(|w| w[0] == w[1]),
        "every process saw the same pids"
    );
}

/// This process's thread count.
fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Threads:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Silent connections that never present the token hold at most
/// `MAX_PENDING` server threads (each used to get one, up to 1024), and a rank still joins once
/// they are gone.
#[test]
fn silent_connections_hold_a_bounded_number_of_threads() {
    use parallel::store::MAX_PENDING;
    let server = StoreServer::start("127.0.0.1:0", TOKEN, Duration::from_secs(5)).unwrap();
    let before = threads();
    let silent: Vec<_> = (0..400)
        .filter_map(|_| std::net::TcpStream::connect(server.addr()).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let held = threads().saturating_sub(before);
    // (Other tests of this binary may run threads meanwhile: a margin of 32.)
    assert!(
        held <= MAX_PENDING + 32,
        "{held} threads for 400 silent connections"
    );
    drop(silent);
    let mut st =
        Store::connect(&server.addr().to_string(), TOKEN, Duration::from_secs(20)).unwrap();
    st.set("k", b"v").unwrap();
    assert_eq!(st.get("k").unwrap(), b"v");
}
