//! Requests to the broker's admin REST API (health checks, namespace and
//! lookup probes, topic creation) through `ureq`, the HTTP client the
//! integration tests use too, plus the parsing of broker addresses.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use ureq::http::Request;

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

    /// `http://host:port`, the base that request paths are appended to.
    /// (Whatever scheme and path the configured URL had: requests go over
    /// plain HTTP to its host and port, as `ureq` is built without TLS.)
    pub fn base_url(&self) -> String {
        format!("http://{}", self.host_for_socket())
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

/// Sends one request to `{endpoint}{path}` with an `Accept: application/json`
/// header and, when given, a JSON body; `PUT`, `POST` and `PATCH` without one
/// send an empty body (`Content-Length: 0`). `timeout` bounds the whole
/// exchange, connecting included. A response of any status (redirects too:
/// none is followed) is returned with its body; only transport failures are
/// errors. No proxy is used, whatever the environment says.
pub fn request(
    endpoint: &Endpoint,
    method: &str,
    path: &str,
    json_body: Option<&str>,
    timeout: Duration,
) -> Result<Response, ureq::Error> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .proxy(None)
        .timeout_global(Some(timeout))
        .build()
        .into();
    let needs_body = matches!(method, "PUT" | "POST" | "PATCH");
    let builder = Request::builder()
        .method(method)
        .uri(format!("{}{path}", endpoint.base_url()))
        .header("Accept", "application/json");
    let mut response = match json_body {
        Some(body) => agent.run(
            builder
                .header("Content-Type", "application/json")
                .body(body)?,
        )?,
        None if needs_body => agent.run(builder.body(&[][..])?)?,
        None => agent.run(builder.body(())?)?,
    };
    let status = response.status().as_u16();
    let body = response.body_mut().read_to_vec()?;
    Ok(Response {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

pub fn get(endpoint: &Endpoint, path: &str, timeout: Duration) -> Result<Response, ureq::Error> {
    request(endpoint, "GET", path, None, timeout)
}

#[cfg(test)]
mod tests {
    use super::{request, Endpoint};
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::time::Duration;

    /// Sends one request to a one-shot local server that answers
    /// `answer`; returns what the server received (the head lower-cased,
    /// then the body) and the client's result.
    fn exchange(
        method: &str,
        json_body: Option<&str>,
        answer: &'static str,
    ) -> (String, super::Response) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream);
            let mut seen = String::new();
            let mut length = 0;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let line = line.to_ascii_lowercase();
                if let Some(n) = line.strip_prefix("content-length:") {
                    length = n.trim().parse().unwrap();
                }
                seen.push_str(&line);
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0; length];
            std::io::Read::read_exact(&mut reader, &mut body).unwrap();
            seen.push_str(&String::from_utf8(body).unwrap());
            reader.get_mut().write_all(answer.as_bytes()).unwrap();
            seen
        });
        let endpoint = Endpoint::parse(&format!("http://127.0.0.1:{port}"), 80).unwrap();
        let resp = request(
            &endpoint,
            method,
            "/admin/x",
            json_body,
            Duration::from_secs(5),
        )
        .unwrap();
        (server.join().unwrap(), resp)
    }

    #[test]
    fn returns_any_status_and_sends_bodies() {
        let (seen, resp) = exchange(
            "PUT",
            None,
            "HTTP/1.1 409 Conflict\r\nContent-Length: 7\r\nConnection: close\r\n\r\nexists!",
        );
        assert!(seen.starts_with("put /admin/x http/1.1\r\n"), "{seen}");
        assert!(seen.contains("content-length: 0\r\n"), "{seen}");
        assert!(seen.contains("accept: application/json\r\n"), "{seen}");
        assert_eq!((resp.status, resp.body.as_str()), (409, "exists!"));

        let (seen, resp) = exchange(
            "PUT",
            Some("3"),
            "HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n",
        );
        assert!(
            seen.contains("content-type: application/json\r\n"),
            "{seen}"
        );
        assert!(seen.ends_with("\r\n\r\n3"), "{seen}");
        assert_eq!((resp.status, resp.body.as_str()), (204, ""));

        // Not followed: the redirect itself is the answer.
        let (seen, resp) = exchange(
            "GET",
            None,
            "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:1/\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n",
        );
        assert!(seen.starts_with("get /admin/x http/1.1\r\n"), "{seen}");
        assert!(!seen.contains("content-length"), "{seen}");
        assert_eq!(resp.status, 307);
    }

    #[test]
    fn transport_failures_are_errors() {
        // A port that was free a moment ago: nothing listens there.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let endpoint = Endpoint::parse(&format!("http://127.0.0.1:{port}"), 80).unwrap();
        assert!(request(&endpoint, "GET", "/", None, Duration::from_secs(5)).is_err());
    }

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
