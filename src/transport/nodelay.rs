//! Nagle's algorithm off on the `pulsar` crate's broker connections.
//!
//! The crate (6.9) leaves Nagle's algorithm on. With a small receiver queue
//! every message costs a flow command and an ack, two small writes in quick
//! succession; Nagle holds the second back until the broker acknowledges the
//! first, which the broker's delayed-ACK timer postpones by up to 40 ms. At
//! the default receiver queue size of 1 that caps a consumer at about 46
//! messages per second on loopback, against about 5,000 with Nagle off
//! (measured on this project's machines). The crate has no hook to configure
//! its sockets, so the transport finds its connections among the process's
//! file descriptors by their peer address and sets `TCP_NODELAY` on them.
//! This needs Linux's `/proc/self/fd`; elsewhere it does nothing.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The broker addresses this transport talks to, and when their sockets
/// were last checked for Nagle's algorithm (see `nodelay`).
#[derive(Default)]
pub(super) struct BrokerSockets {
    peers: RefCell<HashSet<SocketAddr>>,
    last_check: Cell<Option<Instant>>,
    /// Messages received by every consumer of the transport.
    received: Cell<u64>,
}

/// How often a consumer that is receiving looks again, so that a connection
/// the crate re-establishes after a failure also gets Nagle's algorithm off.
const NODELAY_RECHECK: Duration = Duration::from_secs(10);

/// Received messages between two looks at the clock for [`NODELAY_RECHECK`].
const NODELAY_RECHECK_EVERY: u64 = 256;

impl BrokerSockets {
    pub(super) async fn add(&self, host: Option<&str>, port: Option<u16>) {
        let (Some(host), Some(port)) = (host, port) else {
            return;
        };
        if let Ok(addresses) = tokio::net::lookup_host((host, port)).await {
            self.peers.borrow_mut().extend(addresses);
        }
    }

    pub(super) fn disable_nagle(&self) {
        self.last_check.set(Some(Instant::now()));
        let changed = disable_nagle(&self.peers.borrow());
        if changed > 0 {
            tracing::debug!(changed, "TCP_NODELAY set on broker connections");
        }
    }

    /// Called for every message received; looks at the clock only every
    /// [`NODELAY_RECHECK_EVERY`] messages, as reading it costs more than the
    /// rest of this bookkeeping.
    pub(super) fn recheck_if_due(&self) {
        let received = self.received.get().wrapping_add(1);
        self.received.set(received);
        if received % NODELAY_RECHECK_EVERY != 0 {
            return;
        }
        if self
            .last_check
            .get()
            .is_none_or(|last| last.elapsed() >= NODELAY_RECHECK)
        {
            self.disable_nagle();
        }
    }
}

/// Sets `TCP_NODELAY` on every TCP connection of this process whose peer is
/// one of `peers`, and returns how many connections were changed.
pub(crate) fn disable_nagle(peers: &HashSet<SocketAddr>) -> usize {
    if peers.is_empty() {
        return 0;
    }
    #[cfg(target_os = "linux")]
    {
        linux::disable_nagle(peers)
    }
    #[cfg(not(target_os = "linux"))]
    {
        0
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::collections::HashSet;
    use std::net::SocketAddr;
    use std::os::fd::{BorrowedFd, RawFd};

    use socket2::{SockRef, Type};

    pub(super) fn disable_nagle(peers: &HashSet<SocketAddr>) -> usize {
        let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
            return 0;
        };
        entries
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
            .filter(|&fd| set_nodelay_if_peer(fd, peers))
            .count()
    }

    fn set_nodelay_if_peer(fd: RawFd, peers: &HashSet<SocketAddr>) -> bool {
        // SAFETY: the descriptor was listed as open a moment ago and is only
        // borrowed for the calls below. Should another thread close it and
        // the number be reused in between, the calls either fail (not a
        // socket) or act on a socket with the same broker peer, which is
        // what they are for.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let socket = SockRef::from(&fd);
        let is_broker_stream = socket.r#type().is_ok_and(|t| t == Type::STREAM)
            && socket
                .peer_addr()
                .ok()
                .and_then(|peer| peer.as_socket())
                .is_some_and(|peer| peers.contains(&peer));
        if !is_broker_stream || socket.tcp_nodelay().unwrap_or(true) {
            return false;
        }
        socket.set_tcp_nodelay(true).is_ok()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn only_connections_to_the_given_peers_are_changed() {
            let broker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let to_broker = std::net::TcpStream::connect(broker.local_addr().unwrap()).unwrap();
            let to_other = std::net::TcpStream::connect(other.local_addr().unwrap()).unwrap();
            assert!(!to_broker.nodelay().unwrap());
            let peers = HashSet::from([broker.local_addr().unwrap()]);
            assert_eq!(disable_nagle(&peers), 1);
            assert!(to_broker.nodelay().unwrap());
            assert!(!to_other.nodelay().unwrap());
            assert_eq!(disable_nagle(&peers), 0, "already done");
        }
    }
}
