//! Just enough HTTP/1.0 over `std::net::TcpStream` to talk to the broker's
//! admin REST API (health checks, namespace and lookup probes).

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// A parsed `scheme://host:port/...` address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// Parses `scheme://host[:port][/path]`, using `default_port` when the
    /// address names no port. IPv6 hosts are written in brackets.
    pub fn parse(url: &str, default_port: u16) -> Result<Endpoint, String> {
        let rest = match url.split_once("://") {
            Some((_, rest)) => rest,
            None => {
                return Err(format!(
                    "`{url}` is not a URL (expected scheme://host:port)"
                ))
            }
        };
        let authority = rest.split('/').next().unwrap_or_default();
        if authority.contains(',') {
            return Err(format!(
                "`{url}` names several hosts; xtask needs exactly one broker address"
            ));
        }
        let (host, port) = if let Some(stripped) = authority.strip_prefix('[') {
            let (host, after) = stripped
                .split_once(']')
                .ok_or_else(|| format!("`{url}`: unclosed `[` in host"))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| format!("`{url}`: bad port `{p}`"))?,
                None => default_port,
            };
            (host.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (
                    h.to_string(),
                    p.parse().map_err(|_| format!("`{url}`: bad port `{p}`"))?,
                ),
                None => (authority.to_string(), default_port),
            }
        };
        if host.is_empty() {
            return Err(format!("`{url}` has no host"));
        }
        Ok(Endpoint { host, port })
    }

    /// True when the host is this machine's loopback interface, where xtask
    /// may start a broker itself.
    pub fn is_loopback(&self) -> bool {
        self.host == "localhost" || self.host.starts_with("127.") || self.host == "::1"
    }

    fn host_for_socket(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Opens a TCP connection with a connect timeout.
    pub fn connect(&self, timeout: Duration) -> io::Result<TcpStream> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, "host resolved to no address");
        for addr in self.host_for_socket().to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(stream) => return Ok(stream),
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// A response: status code and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

/// Sends one HTTP/1.0 request (the server closes the connection after the
/// response, so the body is simply everything after the headers).
pub fn request(
    endpoint: &Endpoint,
    method: &str,
    path: &str,
    timeout: Duration,
) -> io::Result<Response> {
    let mut stream = endpoint.connect(timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {}\r\nAccept: application/json\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n",
        endpoint.host_for_socket()
    );
    stream.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .lines()
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not an HTTP response: {:?}", head.lines().next()),
            )
        })?;
    Ok(Response {
        status,
        body: body.to_string(),
    })
}

pub fn get(endpoint: &Endpoint, path: &str, timeout: Duration) -> io::Result<Response> {
    request(endpoint, "GET", path, timeout)
}

#[cfg(test)]
mod tests {
    use super::Endpoint;

    #[test]
    fn parses_service_and_web_urls() {
        assert_eq!(
            Endpoint::parse("pulsar://127.0.0.1:6650", 6650).unwrap(),
            Endpoint {
                host: "127.0.0.1".into(),
                port: 6650
            }
        );
        assert_eq!(
            Endpoint::parse("http://localhost/", 8080).unwrap(),
            Endpoint {
                host: "localhost".into(),
                port: 8080
            }
        );
        let v6 = Endpoint::parse("http://[::1]:18080/admin", 8080).unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 18080));
        assert!(v6.is_loopback());
        assert!(!Endpoint::parse("pulsar://broker.example:6650", 1)
            .unwrap()
            .is_loopback());
        assert!(Endpoint::parse("127.0.0.1:6650", 1).is_err());
        assert!(Endpoint::parse("pulsar://a:1,b:2", 1).is_err());
    }
}
