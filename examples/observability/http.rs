//! A tiny HTTP/1.1 responder for `/metrics` and `/health`, enough for a
//! Prometheus scraper and a health probe (not a general web server): per
//! connection it reads the request head, answers `GET` or `HEAD` with the
//! page `route` gives for the path, and closes the connection.
//!
//! `tests/observability_pulsar.rs` serves its scrape with this module too.

use std::rc::Rc;
use std::time::Duration;

use pulsar_dispatcher::Health;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The content type of Prometheus's text exposition format.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Requests larger than this (the request line and headers) are refused.
const MAX_HEAD: usize = 16 * 1024;
/// A connection that has not been answered by then is dropped.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);

/// An answer: status code, content type and body.
#[derive(Debug)]
pub struct Page {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Page {
    pub fn text(status: u16, body: impl Into<String>) -> Page {
        Page {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    pub fn json(status: u16, body: &serde_json::Value) -> Page {
        Page {
            status,
            content_type: "application/json",
            body: format!("{body:#}\n"),
        }
    }
}

/// The `/health` page: the dispatcher's health as JSON, with status 200
/// while it is ready (running, every subscription receiving) and 503
/// otherwise, or when it is gone (`None`).
pub fn health_page(health: Option<Health>) -> Page {
    let Some(health) = health else {
        return Page::json(503, &serde_json::json!({ "phase": "Gone", "ready": false }));
    };
    let subscriptions: Vec<_> = health
        .subscriptions
        .iter()
        .map(|s| {
            serde_json::json!({
                "topic": s.topic,
                "subscription": s.subscription,
                "receiving": s.receiving,
                "last_received_seconds_ago": s.last_received.map(|d| d.as_secs_f64()),
                "overdue_handlers": s.overdue_handlers,
            })
        })
        .collect();
    let body = serde_json::json!({
        "phase": format!("{:?}", health.phase),
        "live": health.is_live(),
        "ready": health.is_ready(),
        "in_flight": health.in_flight,
        "subscriptions": subscriptions,
    });
    Page::json(if health.is_ready() { 200 } else { 503 }, &body)
}

/// Answers every connection on `listener` with `route(path)` (the request
/// target without its query string). Runs until dropped: `spawn_local` it.
pub async fn serve(listener: TcpListener, route: impl Fn(&str) -> Page + 'static) {
    let route: Rc<dyn Fn(&str) -> Page> = Rc::new(route);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors, for example: try again shortly.
                tracing::warn!(%error, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let route = route.clone();
        tokio::task::spawn_local(async move {
            let answered = tokio::time::timeout(CONNECTION_DEADLINE, answer(stream, &*route));
            if let Ok(Err(error)) = answered.await {
                tracing::debug!(%error, "answering an HTTP request failed");
            }
        });
    }
}

async fn answer(mut stream: TcpStream, route: &dyn Fn(&str) -> Page) -> std::io::Result<()> {
    // Read the whole head (up to the blank line), so that closing the
    // connection after the answer never resets it under the client.
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_HEAD {
            let page = Page::text(431, "request header fields too large\n");
            return respond(&mut stream, &page, false).await;
        }
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Ok(()); // closed before a whole request arrived
        }
        head.extend_from_slice(&chunk[..read]);
    }
    let head = String::from_utf8_lossy(&head);
    let request_line = head.lines().next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let page = match (method, target, version) {
        (Some(method), Some(target), Some(version))
            if version.starts_with("HTTP/1.") && parts.next().is_none() =>
        {
            if method == "GET" || method == "HEAD" {
                route(target.split('?').next().unwrap_or(target))
            } else {
                Page::text(405, "only GET and HEAD\n")
            }
        }
        _ => Page::text(400, "bad request\n"),
    };
    respond(&mut stream, &page, method == Some("HEAD")).await
}

async fn respond(stream: &mut TcpStream, page: &Page, head_only: bool) -> std::io::Result<()> {
    let reason = match page.status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    };
    let allow = if page.status == 405 {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let mut response = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{allow}\
         Cache-Control: no-store\r\nConnection: close\r\n\r\n",
        page.status,
        page.content_type,
        page.body.len()
    )
    .into_bytes();
    if !head_only {
        response.extend_from_slice(page.body.as_bytes());
    }
    stream.write_all(&response).await?;
    stream.shutdown().await
}
