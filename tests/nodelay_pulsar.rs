//! The dispatcher's broker connections have Nagle's algorithm off (see
//! `src/transport/nodelay.rs` for why). A test binary of its own, so that
//! no other test's connections share the process.

mod common;

use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use common::{pulsar_url, run_local, unique_name, unique_topic};
use pulsar_dispatcher::{Dispatcher, Message, SubscribeOptions};
use socket2::SockRef;

/// `TCP_NODELAY` of every TCP connection of this process to `port`.
fn nodelay_of_connections_to(port: u16) -> Vec<bool> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
        .filter_map(|fd| {
            // SAFETY: only this thread opens or closes descriptors while the
            // test looks, and each is borrowed for two calls.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let socket = SockRef::from(&fd);
            let peer = socket.peer_addr().ok()?.as_socket()?;
            (peer.port() == port).then(|| socket.tcp_nodelay().unwrap())
        })
        .collect()
}

#[test]
fn broker_connections_have_nagle_off() {
    run_local(Duration::from_secs(60), async {
        let url = pulsar_url();
        let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
        let dispatcher = Dispatcher::connect(&url).await.unwrap();
        dispatcher
            .subscribe(
                &unique_topic("nodelay"),
                async |_: &Message| Ok::<_, std::convert::Infallible>(()),
                SubscribeOptions::new().subscription(unique_name("sub")),
            )
            .await
            .unwrap();
        let connections = nodelay_of_connections_to(port);
        assert!(!connections.is_empty(), "no connection to the broker found");
        assert!(
            connections.iter().all(|&nodelay| nodelay),
            "connections without TCP_NODELAY: {connections:?}"
        );
        dispatcher.close().await;
    });
}
