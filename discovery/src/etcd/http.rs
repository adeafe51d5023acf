//! The smallest HTTP/1.1 client etcd's JSON gateway needs: one POST per connection, a
//! `Content-Length` or chunked answer, and a chunked stream for watches. Every read and write
//! has a deadline and every size a bound, so a slow, dead or hostile endpoint costs at most a
//! timeout and never unbounded memory.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The largest status line plus headers accepted.
const MAX_HEAD: usize = 16 * 1024;
/// The largest unary answer accepted (a range over every rank of a big fleet stays far below).
pub const MAX_BODY: usize = 64 * 1024 * 1024;
/// The longest line of a watch stream accepted (one watch response).
pub const MAX_LINE: usize = 16 * 1024 * 1024;

/// What went wrong talking HTTP.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// No connection could be made.
    #[error("cannot connect: {0}")]
    Connect(io::Error),
    /// The connection failed or timed out after it was made.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The answer is not HTTP we can read.
    #[error("malformed HTTP answer: {0}")]
    Malformed(&'static str),
    /// A non-2xx status, with the start of the body.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status code.
        status: u16,
        /// The body (at most 512 bytes of it).
        body: String,
    },
}

/// An answer's body being read: either whole or as a chunked stream.
pub struct Body {
    reader: BufReader<TcpStream>,
    chunked: bool,
    /// Bytes left in the current chunk (chunked) or in the body (length-delimited).
    left: usize,
    done: bool,
    line: Vec<u8>,
}

/// Sends `body` to `path` at `addr` as a POST and reads the status and headers. `timeout`
/// bounds the connection, each write and each read.
pub fn post(addr: &str, path: &str, body: &[u8], timeout: Duration) -> Result<Body, HttpError> {
    let stream = connect(addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    let mut w = &stream;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    w.write_all(head.as_bytes())?;
    w.write_all(body)?;
    let mut reader = BufReader::new(stream);
    let (status, chunked, length) = read_head(&mut reader)?;
    let mut body = Body {
        reader,
        chunked,
        left: if chunked {
            0
        } else {
            length.unwrap_or(usize::MAX)
        },
        done: false,
        line: Vec::new(),
    };
    if !(200..300).contains(&status) {
        let mut text = body.read_all(512).unwrap_or_default();
        text.truncate(512);
        return Err(HttpError::Status {
            status,
            body: String::from_utf8_lossy(&text).into_owned(),
        });
    }
    Ok(body)
}

fn connect(addr: &str, timeout: Duration) -> Result<TcpStream, HttpError> {
    let addrs = addr.to_socket_addrs().map_err(HttpError::Connect)?;
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolved to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(HttpError::Connect(last))
}

/// Reads the status line and headers: (status, chunked, content length).
fn read_head(r: &mut impl BufRead) -> Result<(u16, bool, Option<usize>), HttpError> {
    let mut used = 0usize;
    let mut line = Vec::new();
    read_line(r, &mut line, MAX_HEAD)?;
    used = used.saturating_add(line.len());
    let text = std::str::from_utf8(&line).map_err(|_| HttpError::Malformed("status line"))?;
    let mut parts = text.split_whitespace();
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::Malformed("status line"));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..600).contains(s))
        .ok_or(HttpError::Malformed("status code"))?;
    let (mut chunked, mut length) = (false, None);
    loop {
        line.clear();
        read_line(r, &mut line, MAX_HEAD.saturating_sub(used))?;
        used = used.saturating_add(line.len());
        let l = trim_eol(&line);
        if l.is_empty() {
            break;
        }
        let l = std::str::from_utf8(l).map_err(|_| HttpError::Malformed("header"))?;
        let (name, value) = l.split_once(':').ok_or(HttpError::Malformed("header"))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
            if !chunked {
                return Err(HttpError::Malformed("transfer encoding"));
            }
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(
                value
                    .parse()
                    .map_err(|_| HttpError::Malformed("content length"))?,
            );
        }
    }
    Ok((status, chunked, length))
}

/// Reads one `\n`-ended line of at most `max` bytes into `buf` (which it clears first).
fn read_line(r: &mut impl BufRead, buf: &mut Vec<u8>, max: usize) -> Result<(), HttpError> {
    buf.clear();
    let n = r.by_ref().take(max as u64).read_until(b'\n', buf)?;
    if n == 0 {
        return Err(HttpError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    if buf.last() != Some(&b'\n') {
        return Err(HttpError::Malformed("line too long"));
    }
    Ok(())
}

fn trim_eol(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

impl Body {
    /// Reads the whole body, refusing more than `max` bytes.
    pub fn read_all(&mut self, max: usize) -> Result<Vec<u8>, HttpError> {
        let mut out = Vec::new();
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = self.read(&mut buf)?;
            if n == 0 {
                return Ok(out);
            }
            if out.len().saturating_add(n) > max {
                return Err(HttpError::Malformed("body too large"));
            }
            out.extend_from_slice(&buf[..n]);
        }
    }

    /// The next `\n`-ended line of a streamed body (a watch response), `None` at its end.
    /// A read timeout surfaces as an `Io` error of kind `WouldBlock` or `TimedOut`, after
    /// which reading may go on: the partial line is kept.
    pub fn next_line(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        let mut buf = [0u8; 8 * 1024];
        loop {
            if let Some(at) = self.line.iter().position(|b| *b == b'\n') {
                let rest = self.line.split_off(at.saturating_add(1));
                let mut line = std::mem::replace(&mut self.line, rest);
                line.pop();
                return Ok(Some(line));
            }
            let n = self.read(&mut buf)?;
            if n == 0 {
                return Ok(None);
            }
            if self.line.len().saturating_add(n) > MAX_LINE {
                return Err(HttpError::Malformed("stream line too long"));
            }
            self.line.extend_from_slice(&buf[..n]);
        }
    }

    /// Sets the read timeout of a streamed body (watches wait longer than unary calls).
    pub fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        self.reader.get_ref().set_read_timeout(Some(t))
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize, HttpError> {
        if self.done {
            return Ok(0);
        }
        if self.chunked && self.left == 0 {
            let mut line = Vec::new();
            read_line(&mut self.reader, &mut line, 1024)?;
            let size = trim_eol(&line);
            let size = size.split(|b| *b == b';').next().unwrap_or_default();
            let size = std::str::from_utf8(size)
                .ok()
                .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
                .ok_or(HttpError::Malformed("chunk size"))?;
            if size == 0 {
                self.done = true;
                return Ok(0);
            }
            // The chunk's data; its CRLF is read once the data is used up.
            self.left = size;
        }
        let want = buf.len().min(self.left);
        let n = self.reader.read(&mut buf[..want])?;
        if n == 0 {
            if self.chunked || self.left != usize::MAX {
                return Err(HttpError::Io(io::ErrorKind::UnexpectedEof.into()));
            }
            self.done = true;
            return Ok(0);
        }
        if self.left != usize::MAX {
            self.left = self.left.saturating_sub(n);
        }
        if self.chunked && self.left == 0 {
            let mut crlf = Vec::new();
            read_line(&mut self.reader, &mut crlf, 2)?;
            if !trim_eol(&crlf).is_empty() {
                return Err(HttpError::Malformed("chunk end"));
            }
        }
        if !self.chunked && self.left == 0 {
            self.done = true;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;

    /// Serves `answer` once to whatever connects; returns the address.
    fn serve(answer: &'static [u8]) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut req = [0u8; 4096];
            let _ = s.read(&mut req);
            let _ = s.write_all(answer);
        });
        addr
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn reads_a_length_delimited_body() {
        let a = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloEXTRA");
        assert_eq!(
            post(&a, "/x", b"{}", T).unwrap().read_all(100).unwrap(),
            b"hello"
        );
    }

    #[test]
    fn reads_a_chunked_body_and_its_lines() {
        let a = serve(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n6;x=y\r\n:1}\n{}\r\n2\r\n\n\n\r\n0\r\n\r\n");
        let mut b = post(&a, "/x", b"", T).unwrap();
        assert_eq!(b.next_line().unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(b.next_line().unwrap().unwrap(), b"{}");
        assert_eq!(b.next_line().unwrap().unwrap(), b"");
        assert_eq!(b.next_line().unwrap(), None);
    }

    #[test]
    fn a_body_to_the_close_is_read_when_no_length_is_given() {
        let a = serve(b"HTTP/1.0 200 OK\r\n\r\nall of it");
        assert_eq!(
            post(&a, "/x", b"", T).unwrap().read_all(100).unwrap(),
            b"all of it"
        );
    }

    #[test]
    fn an_error_status_carries_the_body() {
        let a = serve(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found");
        match post(&a, "/x", b"", T) {
            Err(HttpError::Status { status: 404, body }) => assert_eq!(body, "not found"),
            other => panic!("{:?}", other.err()),
        }
    }

    #[test]
    fn malformed_answers_are_errors_not_panics() {
        for bad in [
            &b"SMTP ready\r\n\r\n"[..],
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            b"",
        ] {
            let a = serve(bad);
            let r = post(&a, "/x", b"", T).and_then(|mut b| b.read_all(1 << 20));
            assert!(r.is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn sizes_are_bounded() {
        let a = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n01234567890123456789");
        assert!(post(&a, "/x", b"", T).unwrap().read_all(19).is_err());
        // A header block larger than MAX_HEAD.
        let big: &'static [u8] = Box::leak(
            [
                &b"HTTP/1.1 200 OK\r\nX: "[..],
                &vec![b'a'; MAX_HEAD],
                b"\r\n\r\n",
            ]
            .concat()
            .into_boxed_slice(),
        );
        assert!(post(&serve(big), "/x", b"", T).is_err());
    }

    #[test]
    fn a_silent_server_costs_one_timeout() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap().to_string();
        let hold = thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            thread::sleep(Duration::from_millis(600));
            drop(s);
        });
        let t0 = std::time::Instant::now();
        assert!(post(&a, "/x", b"", Duration::from_millis(100)).is_err());
        assert!(t0.elapsed() < Duration::from_millis(500));
        hold.join().unwrap();
    }

    #[test]
    fn nobody_listening_is_a_connect_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap().to_string();
        drop(l);
        assert!(matches!(post(&a, "/x", b"", T), Err(HttpError::Connect(_))));
    }
}
