//! The `pulsar` crate's broker connections, seen through the process's
//! sockets: Nagle's algorithm turned off on them, and a connection lost and
//! made again noticed.
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
//!
//! The crate also reconnects by itself, after a broker restart say, and
//! tells nobody; the acks sent in the connection's last moments are lost,
//! and their messages come back on the new connection. Each look at the
//! sockets therefore also notes which broker connections are open (by
//! their local address): one that was open and is gone, with a new one
//! open since, is a [`ConnectionLoss`], which lets the settlement
//! bookkeeping tell a lost ack from a replay however long the outage took.
//! The last few losses are kept ([`ConnectionLosses`]): after a broker
//! restart the crate can close one of its new connections a while later,
//! and that loss must not hide the restart's, whose lost acks may still be
//! coming back.
//!
//! This needs Linux's `/proc/self/fd`; elsewhere it does nothing.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

/// The broker addresses this transport talks to, the connections to them
/// open at the last look, and when that look was (see the module doc).
#[derive(Default)]
pub(super) struct BrokerSockets {
    peers: RefCell<HashSet<SocketAddr>>,
    last_check: Cell<Option<Instant>>,
    /// Messages received by every consumer of the transport.
    received: Cell<u64>,
    /// The broker connections open at the last look, by local address.
    open: RefCell<HashSet<SocketAddr>>,
    /// The connections lost lately.
    losses: Cell<ConnectionLosses>,
}

/// A broker connection found gone, and the connection made after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ConnectionLoss {
    /// The last look that saw the lost connection open.
    pub(super) last_seen_open: Instant,
    /// The first look that saw a new broker connection open after the loss
    /// (`None` until one does).
    pub(super) reconnected: Option<Instant>,
}

/// How many connection losses are kept. Each covers the acks it may have
/// lost for a minute after its reconnection (see `settlement::RecentAcks`),
/// and a later loss must not hide it meanwhile: after a broker restart the
/// crate can make several connections and close some of them again a while
/// later, while the acks lost in the restart are still coming back. Losses
/// closer together than [`SAME_OUTAGE`] are one, so a minute holds only a
/// few.
const KEPT_LOSSES: usize = 8;

/// The broker connections lost lately, oldest first; the latest is the one
/// a new connection reconnects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ConnectionLosses([Option<ConnectionLoss>; KEPT_LOSSES]);

impl ConnectionLosses {
    /// The losses kept, oldest first.
    pub(super) fn iter(&self) -> impl Iterator<Item = &ConnectionLoss> {
        self.0.iter().flatten()
    }

    /// The latest loss, if any.
    pub(super) fn latest(&self) -> Option<ConnectionLoss> {
        self.0[KEPT_LOSSES - 1]
    }

    /// Adds a loss, forgetting the oldest kept if there is no room.
    fn push(&mut self, loss: ConnectionLoss) {
        self.0.rotate_left(1);
        self.0[KEPT_LOSSES - 1] = Some(loss);
    }

    /// Notes a connection made at `now` as the reconnection of the latest
    /// loss, unless that has one; returns whether it had none.
    fn reconnect(&mut self, now: Instant) -> bool {
        match &mut self.0[KEPT_LOSSES - 1] {
            Some(loss) if loss.reconnected.is_none() => {
                loss.reconnected = Some(now);
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
impl FromIterator<ConnectionLoss> for ConnectionLosses {
    fn from_iter<I: IntoIterator<Item = ConnectionLoss>>(losses: I) -> Self {
        let mut kept = ConnectionLosses::default();
        for loss in losses {
            kept.push(loss);
        }
        kept
    }
}

#[cfg(test)]
impl From<ConnectionLoss> for ConnectionLosses {
    fn from(loss: ConnectionLoss) -> Self {
        [loss].into_iter().collect()
    }
}

/// How often a consumer that is receiving looks again, so that a connection
/// the crate re-establishes after a failure also gets Nagle's algorithm off.
const NODELAY_RECHECK: Duration = Duration::from_secs(10);

/// Received messages between two looks at the clock for [`NODELAY_RECHECK`].
const NODELAY_RECHECK_EVERY: u64 = 256;

/// A connection lost at most this long after the last loss's reconnection
/// (or before it) belongs to the same outage: a broker starting up can
/// take a connection and drop it, and of two connections lost together one
/// can be noticed a look later. The outage keeps its first connection's
/// last sighting, which dates the acks lost.
const SAME_OUTAGE: Duration = Duration::from_secs(10);

/// How old a look may be for [`BrokerSockets::losses`] to answer from it.
const LOSS_RECHECK: Duration = Duration::from_secs(1);

impl BrokerSockets {
    pub(super) async fn add(&self, host: Option<&str>, port: Option<u16>) {
        let (Some(host), Some(port)) = (host, port) else {
            return;
        };
        if let Ok(addresses) = tokio::net::lookup_host((host, port)).await {
            self.peers.borrow_mut().extend(addresses);
        }
    }

    /// Looks at the broker connections now: turns Nagle's algorithm off on
    /// the new ones, and notes those lost and made since the last look.
    pub(super) fn look(&self) {
        let now = Instant::now();
        let previous = self.last_check.replace(Some(now));
        let Some(found) = broker_connections(&self.peers.borrow()) else {
            return;
        };
        let changed = found
            .iter()
            .filter(|connection| connection.nodelay_set)
            .count();
        if changed > 0 {
            tracing::debug!(changed, "TCP_NODELAY set on broker connections");
        }
        let found = found.iter().map(|connection| connection.local).collect();
        self.note_open(found, previous, now);
    }

    /// Notes the broker connections open at `now`, by local address, and a
    /// connection lost (open at the `previous` look) or made since.
    fn note_open(&self, found: HashSet<SocketAddr>, previous: Option<Instant>, now: Instant) {
        let mut open = self.open.borrow_mut();
        let mut losses = self.losses.get();
        let same_outage = losses.latest().is_some_and(|loss| {
            loss.reconnected
                .is_none_or(|reconnected| now.duration_since(reconnected) <= SAME_OUTAGE)
        });
        if let Some(last_seen_open) = previous {
            if !open.is_subset(&found) && !same_outage {
                tracing::debug!("a broker connection was lost");
                losses.push(ConnectionLoss {
                    last_seen_open,
                    reconnected: None,
                });
            }
        }
        if !found.is_subset(&open) && losses.reconnect(now) {
            tracing::debug!("a broker connection was made after the loss");
        }
        self.losses.set(losses);
        *open = found;
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
        self.look_unless_within(NODELAY_RECHECK);
    }

    /// The broker connections lost lately, looking again first unless the
    /// last look is under [`LOSS_RECHECK`] old.
    pub(super) fn losses(&self) -> ConnectionLosses {
        self.look_unless_within(LOSS_RECHECK);
        self.losses.get()
    }

    /// Looks again unless the last look is under `age` old.
    fn look_unless_within(&self, age: Duration) {
        if self
            .last_check
            .get()
            .is_none_or(|last| last.elapsed() >= age)
        {
            self.look();
        }
    }
}

/// A broker connection of this process.
struct BrokerConnection {
    local: SocketAddr,
    /// Whether this look turned Nagle's algorithm off on it.
    nodelay_set: bool,
}

/// The TCP connections of this process whose peer is one of `peers`, each
/// with Nagle's algorithm turned off; `None` where the process's sockets
/// cannot be listed.
fn broker_connections(peers: &HashSet<SocketAddr>) -> Option<Vec<BrokerConnection>> {
    if peers.is_empty() {
        return Some(Vec::new());
    }
    #[cfg(target_os = "linux")]
    {
        linux::broker_connections(peers)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::collections::HashSet;
    use std::net::SocketAddr;
    use std::os::fd::{BorrowedFd, RawFd};

    use socket2::{SockRef, Type};

    use super::BrokerConnection;

    pub(super) fn broker_connections(peers: &HashSet<SocketAddr>) -> Option<Vec<BrokerConnection>> {
        let entries = std::fs::read_dir("/proc/self/fd").ok()?;
        Some(
            entries
                .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
                .filter_map(|fd| broker_connection(fd, peers))
                .collect(),
        )
    }

    fn broker_connection(fd: RawFd, peers: &HashSet<SocketAddr>) -> Option<BrokerConnection> {
        // SAFETY: the descriptor was listed as open a moment ago and is only
        // borrowed for the calls below. Should another thread close it and
        // the number be reused in between, the calls either fail (not a
        // socket) or act on a socket with the same broker peer, which is
        // what they are for.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let socket = SockRef::from(&fd);
        if !socket.r#type().is_ok_and(|t| t == Type::STREAM) {
            return None;
        }
        // A connection the broker has reset has no peer any more; one it
        // has closed still has, and reads an end at once.
        let peer = socket.peer_addr().ok()?.as_socket()?;
        if !peers.contains(&peer) || closed_by_peer(&socket) {
            return None;
        }
        let local = socket.local_addr().ok()?.as_socket()?;
        let nodelay_set =
            !socket.tcp_nodelay().unwrap_or(true) && socket.set_tcp_nodelay(true).is_ok();
        Some(BrokerConnection { local, nodelay_set })
    }

    /// Whether the peer has closed its end: a peek that may not wait reads
    /// the end of the stream. (Data not read yet, or nothing to read, is an
    /// open connection.)
    fn closed_by_peer(socket: &SockRef<'_>) -> bool {
        let mut byte = [std::mem::MaybeUninit::uninit()];
        matches!(
            socket.recv_with_flags(&mut byte, libc::MSG_PEEK | libc::MSG_DONTWAIT),
            Ok(0)
        )
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn sockets_for(broker: &TcpListener) -> BrokerSockets {
        let sockets = BrokerSockets::default();
        sockets
            .peers
            .borrow_mut()
            .insert(broker.local_addr().unwrap());
        sockets
    }

    #[test]
    fn only_connections_to_the_given_peers_are_changed() {
        let broker = TcpListener::bind("127.0.0.1:0").unwrap();
        let other = TcpListener::bind("127.0.0.1:0").unwrap();
        let to_broker = TcpStream::connect(broker.local_addr().unwrap()).unwrap();
        let to_other = TcpStream::connect(other.local_addr().unwrap()).unwrap();
        assert!(!to_broker.nodelay().unwrap());
        let peers = HashSet::from([broker.local_addr().unwrap()]);
        let found = broker_connections(&peers).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].local, to_broker.local_addr().unwrap());
        assert!(found[0].nodelay_set);
        assert!(to_broker.nodelay().unwrap());
        assert!(!to_other.nodelay().unwrap());
        let again = broker_connections(&peers).unwrap();
        assert!(!again[0].nodelay_set, "already done");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_lost_and_made_again_is_noticed() {
        let broker = TcpListener::bind("127.0.0.1:0").unwrap();
        let sockets = sockets_for(&broker);
        let first = TcpStream::connect(broker.local_addr().unwrap()).unwrap();
        let opened = Instant::now();
        sockets.look();
        assert_eq!(sockets.losses().latest(), None, "nothing lost yet");

        tokio::time::advance(Duration::from_secs(5)).await;
        drop(first);
        assert_eq!(
            sockets.losses().latest(),
            Some(ConnectionLoss {
                last_seen_open: opened,
                reconnected: None
            }),
            "lost, and nothing open since"
        );

        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(
            sockets.losses().latest().and_then(|loss| loss.reconnected),
            None,
            "still nothing open"
        );
        let _second = TcpStream::connect(broker.local_addr().unwrap()).unwrap();
        tokio::time::advance(LOSS_RECHECK).await;
        let made = Instant::now();
        assert_eq!(
            sockets.losses().latest(),
            Some(ConnectionLoss {
                last_seen_open: opened,
                reconnected: Some(made)
            })
        );

        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(
            sockets.losses().latest().and_then(|loss| loss.reconnected),
            Some(made),
            "a connection that stays open changes nothing"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn losses_soon_after_a_reconnection_belong_to_its_outage() {
        let broker = TcpListener::bind("127.0.0.1:0").unwrap();
        let sockets = sockets_for(&broker);
        let connect = || TcpStream::connect(broker.local_addr().unwrap()).unwrap();
        let (first, second) = (connect(), connect());
        let opened = Instant::now();
        sockets.look();

        tokio::time::advance(LOSS_RECHECK).await;
        drop(first);
        let third = connect();
        let reconnected = Instant::now();
        let outage = Some(ConnectionLoss {
            last_seen_open: opened,
            reconnected: Some(reconnected),
        });
        assert_eq!(sockets.losses().latest(), outage);

        tokio::time::advance(LOSS_RECHECK).await;
        drop(second);
        assert_eq!(
            sockets.losses().latest(),
            outage,
            "the other connection of the outage, noticed a look later"
        );
        tokio::time::advance(LOSS_RECHECK).await;
        drop(third);
        let fourth = connect();
        assert_eq!(
            sockets.losses().latest(),
            outage,
            "a connection made during the outage and dropped again"
        );

        tokio::time::advance(SAME_OUTAGE).await;
        let seen = Instant::now();
        assert_eq!(sockets.losses().latest(), outage, "nothing lost since");
        tokio::time::advance(LOSS_RECHECK).await;
        drop(fourth);
        let another = ConnectionLoss {
            last_seen_open: seen,
            reconnected: None,
        };
        assert_eq!(
            sockets.losses().latest(),
            Some(another),
            "a loss long after the reconnection is another outage"
        );
        let kept: Vec<_> = sockets.losses().iter().copied().map(Some).collect();
        assert_eq!(
            kept,
            [outage, Some(another)],
            "and the outage before it is kept"
        );
    }

    #[test]
    fn the_latest_losses_are_kept_oldest_first() {
        let start = Instant::now();
        let loss = |n: u64| ConnectionLoss {
            last_seen_open: start + Duration::from_secs(n),
            reconnected: None,
        };
        let mut losses = ConnectionLosses::default();
        assert_eq!(losses.latest(), None);
        assert!(!losses.reconnect(start), "no loss to reconnect");
        for n in 0..KEPT_LOSSES as u64 + 2 {
            losses.push(loss(n));
        }
        let kept: Vec<_> = losses.iter().copied().collect();
        let expected: Vec<_> = (2..KEPT_LOSSES as u64 + 2).map(loss).collect();
        assert_eq!(kept, expected, "the two oldest forgotten");
        let later = start + Duration::from_secs(60);
        assert!(losses.reconnect(later));
        assert!(!losses.reconnect(later + Duration::from_secs(1)), "once");
        assert_eq!(losses.latest().unwrap().reconnected, Some(later));
        let reconnected = losses.iter().filter(|loss| loss.reconnected.is_some());
        assert_eq!(reconnected.count(), 1, "only the latest is reconnected");
    }

    /// The broker's end of a connection closes: with a reset, or with a
    /// shutdown that leaves this process's end open until the crate drops
    /// it. Either way the connection counts as lost.
    #[tokio::test(start_paused = true)]
    async fn a_connection_the_broker_resets_or_shuts_down_counts_as_lost() {
        for reset in [true, false] {
            let broker = TcpListener::bind("127.0.0.1:0").unwrap();
            let sockets = sockets_for(&broker);
            let connection = TcpStream::connect(broker.local_addr().unwrap()).unwrap();
            let (accepted, _) = broker.accept().unwrap();
            sockets.look();
            tokio::time::advance(LOSS_RECHECK).await;
            assert_eq!(sockets.losses().latest(), None, "open both ways");
            if reset {
                socket2::SockRef::from(&accepted)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
            }
            drop(accepted);
            tokio::time::advance(LOSS_RECHECK).await;
            assert!(
                sockets.losses().latest().is_some(),
                "reset: {reset}; still open here: {connection:?}"
            );
        }
    }
}
