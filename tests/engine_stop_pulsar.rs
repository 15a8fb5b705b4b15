//! A `pulsar` crate consumer whose engine stops for good, against a real
//! Apache Pulsar broker.
//!
//! A test binary of its own: it breaks every broker connection of the
//! process, which would disturb tests running beside it.

mod common;

use std::net::Shutdown;
use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use common::{authority, pulsar_url, run_local, HeldBacklog};
use socket2::SockRef;

/// The crate's consumer engine stops for good when its connection fails
/// and subscribing again fails too; from then on the crate refuses acks
/// (`ConsumerError::Closed`), and its stream ends once what it had queued
/// is received. Here the broker refuses the subscription's type (an
/// operator allows only another) when the process's broker connections
/// break, while the dispatcher holds the messages it was delivered: one in
/// a handler, one in the slot, the rest in the crate's queue. Those are
/// handled after the engines stopped; their acks wait for the partition's
/// new consumer, subscribed once the topic takes the type again, and the
/// broker's redeliveries of them are recognised as acked. Each message is
/// handled once, no ack fails, and the backlog empties. Plain and
/// partitioned topics, Exclusive and Shared.
#[test]
fn acks_made_after_the_crate_consumer_stopped_wait_for_its_replacement() {
    run_local(Duration::from_secs(240), async {
        let break_connections = async |_: String, _| {
            assert!(
                break_broker_connections() > 0,
                "no broker connection to break"
            );
            // Time for each engine to find its connection broken (it looks
            // at least once a second) and to be refused a new subscribe.
            tokio::time::sleep(Duration::from_secs(3)).await;
        };
        for (case, totals) in HeldBacklog::through_a_refusal("stopped", break_connections).await {
            assert_eq!(totals.acks_failed, 0, "{case}: no ack failed: {totals:?}");
        }
    });
}

/// Shuts down, both ways, every TCP connection of the process to the
/// broker's port, as a failing network would end them; returns how many.
fn break_broker_connections() -> usize {
    let port = broker_port();
    let fds: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
        .expect("listing /proc/self/fd")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    fds.into_iter()
        .filter(|&fd| {
            // SAFETY: the descriptor was listed as open a moment ago and is
            // only borrowed for these calls; this test binary runs no other
            // test that could close it meanwhile.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let socket = SockRef::from(&fd);
            let to_broker = socket
                .peer_addr()
                .ok()
                .and_then(|peer| peer.as_socket())
                .is_some_and(|peer| peer.port() == port);
            to_broker && socket.shutdown(Shutdown::Both).is_ok()
        })
        .count()
}

/// The port of the broker's service URL (Pulsar's 6650 if it names none).
fn broker_port() -> u16 {
    let authority = authority(&pulsar_url());
    let port = authority.rsplit_once(':').map(|(_, port)| port);
    port.and_then(|port| port.parse().ok()).unwrap_or(6650)
}
