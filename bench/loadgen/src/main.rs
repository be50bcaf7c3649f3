//! A closed-loop HTTP/1.1 load generator for the proxy benchmark (`bench/proxy.py`).
//!
//! Why it exists: on a two-core machine the benchmark's Python client spends 50–65 µs of CPU per
//! call, on the same cores as the proxy, its shipping worker, the upstream and the broker. This
//! one sends the same requests for 11–20 µs each, so more of the cores go to what is measured.
//!
//! The conversation on stdin and stdout, line by line (no JSON parser needed, no dependencies):
//!
//! ```text
//! in:  <port>
//!      <seconds>
//!      <request head: "{len}" for the body's length, "{token}" for the connection's token,
//!       each "\r\n" written as the four characters \r\n>
//!      <body, with "{n}" for the request's counter>
//!      <counter base>
//!      <requests per connection at most; connection k counts from base + k * this>
//!      <bearer token of connection 0 ("-" where the head has no "{token}")>
//!      <bearer token of connection 1>
//!      ...
//!      <an empty line>
//! out: ready                  (every connection is open and has had one untimed request)
//! in:  go                     (the caller has read its CPU counters; anything else aborts)
//! out: ok <answered> errors <failed> seconds <elapsed> cpu <CPU seconds of the timed part>
//!      warm <untimed requests answered>
//! ```
//!
//! One thread per connection, each sending its next request as soon as the last is answered,
//! until the deadline or its request bound; a request under way at the deadline is finished and
//! counted, and the clock runs until the last one is back. The CPU figure sums every thread's
//! run time over the timed part (`/proc/thread-self/schedstat`, nanoseconds). The first error,
//! if any, goes to stderr and ends that connection; the exit status is then 1.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

/// The longest a request may take, as the Python client's limit.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest the whole answer may be, head and body.
const MAX_ANSWER: usize = 64 << 20;

/// Untimed requests answered (0 or 1), timed requests answered, requests failed, the first failure,
/// CPU seconds of the timed part.
type Outcome = (u64, u64, u64, Option<String>, f64);

struct Spec {
    port: u16,
    seconds: f64,
    head: String,
    body: String,
    base: u64,
    per_conn: u64,
    tokens: Vec<String>,
}

fn read_spec(input: &mut impl BufRead) -> Result<Spec, String> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if input.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            break; // end of input: the spec must be complete without its empty line
        }
        let line = line.trim_end_matches(['\r', '\n']).to_string();
        if line.is_empty() {
            break;
        }
        lines.push(line);
    }
    if lines.len() < 7 {
        return Err(format!(
            "expected at least 7 lines on stdin (one per connection from the 7th), got {}",
            lines.len()
        ));
    }
    let num = |i: usize, what: &str| -> Result<u64, String> {
        lines[i]
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("line {}: {what} is not a whole number: {:?}", i + 1, lines[i]))
    };
    let seconds = lines[1]
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .ok_or_else(|| format!("line 2: seconds must be a positive number: {:?}", lines[1]))?;
    Ok(Spec {
        port: u16::try_from(num(0, "port")?).map_err(|_| "line 1: port out of range".to_string())?,
        seconds,
        head: lines[2].replace("\\r\\n", "\r\n"),
        body: lines[3].clone(),
        base: num(4, "counter base")?,
        per_conn: num(5, "requests per connection")?.max(1),
        tokens: lines[6..].to_vec(),
    })
}

/// This thread's run time so far, in seconds (0 where the kernel does not say).
fn thread_cpu_s() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|ns| ns.parse::<f64>().ok()))
        .map_or(0.0, |ns| ns / 1e9)
}

/// Reads until `buf` holds `at_least` bytes.
fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>, at_least: usize) -> Result<(), String> {
    let mut chunk = [0u8; 16384];
    while buf.len() < at_least {
        let n = stream.read(&mut chunk).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("the server closed the connection inside an answer".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

/// Reads until `buf[from..]` holds `needle`; returns where the needle ends.
fn fill_until(stream: &mut TcpStream, buf: &mut Vec<u8>, from: usize, needle: &[u8]) -> Result<usize, String> {
    loop {
        if let Some(at) = buf[from..].windows(needle.len()).position(|w| w == needle) {
            return Ok(from + at + needle.len());
        }
        if buf.len() > MAX_ANSWER {
            return Err(format!("an answer larger than {MAX_ANSWER} bytes"));
        }
        let want = buf.len() + 1;
        fill(stream, buf, want)?;
    }
}

/// Reads one answer whole; returns whether the server will close the connection after it.
///
/// One request at a time on each connection, so every byte after the answer is a protocol error.
fn read_answer(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Result<bool, String> {
    buf.clear();
    let head_end = fill_until(stream, buf, 0, b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| "the answer's head is not UTF-8")?;
    let status: u16 = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or("an answer without a status code")?;
    let (mut length, mut chunked, mut close) = (None, false, false);
    for line in head.split("\r\n").skip(1) {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim().to_ascii_lowercase());
        match name.as_str() {
            "content-length" => length = Some(value.parse::<usize>().map_err(|_| "a bad content-length")?),
            "transfer-encoding" => chunked = value.contains("chunked"),
            "connection" => close = value == "close",
            _ => {}
        }
    }
    let end = if chunked {
        let mut at = head_end;
        'chunks: loop {
            let line_end = fill_until(stream, buf, at, b"\r\n")?;
            let size_text = std::str::from_utf8(&buf[at..line_end - 2]).map_err(|_| "a bad chunk size")?;
            let size_text = size_text.split(';').next().unwrap_or("").trim(); // chunk extensions
            let size = usize::from_str_radix(size_text, 16).map_err(|_| format!("a bad chunk size {size_text:?}"))?;
            if size == 0 {
                // Trailer fields, if any, then the empty line.
                let mut line_start = line_end;
                loop {
                    let next = fill_until(stream, buf, line_start, b"\r\n")?;
                    if next == line_start + 2 {
                        break 'chunks next;
                    }
                    line_start = next;
                }
            } else {
                if size > MAX_ANSWER {
                    return Err(format!("a chunk larger than {MAX_ANSWER} bytes"));
                }
                fill(stream, buf, line_end + size + 2)?;
                if &buf[line_end + size..line_end + size + 2] != b"\r\n" {
                    return Err("a chunk not followed by CRLF".into());
                }
                at = line_end + size + 2;
            }
        }
    } else {
        let length = length.ok_or("an answer with neither content-length nor chunked encoding")?;
        if length > MAX_ANSWER {
            return Err(format!("an answer larger than {MAX_ANSWER} bytes"));
        }
        fill(stream, buf, head_end + length)?;
        head_end + length
    };
    if buf.len() > end {
        return Err(format!("{} bytes after the answer's end", buf.len() - end));
    }
    if status != 200 {
        let text = String::from_utf8_lossy(&buf[head_end..end.min(head_end + 300)]).into_owned();
        return Err(format!("HTTP {status}: {text}"));
    }
    Ok(close)
}

fn connect(port: u16) -> Result<TcpStream, String> {
    let stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect to port {port}: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(REQUEST_TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(REQUEST_TIMEOUT))
        .map_err(|e| e.to_string())?;
    Ok(stream)
}

struct Client {
    port: u16,
    stream: Option<TcpStream>,
    head: String,
    body: String,
    request: Vec<u8>,
    buf: Vec<u8>,
}

impl Client {
    /// One request and its whole answer, on a connection opened again if the server closed it.
    fn call(&mut self, n: u64) -> Result<(), String> {
        let body = self.body.replace("{n}", &n.to_string());
        self.request.clear();
        self.request
            .extend_from_slice(self.head.replace("{len}", &body.len().to_string()).as_bytes());
        self.request.extend_from_slice(body.as_bytes());
        let started = Instant::now();
        let stream = match self.stream.as_mut() {
            Some(stream) => stream,
            None => self.stream.insert(connect(self.port)?),
        };
        stream.write_all(&self.request).map_err(|e| format!("write: {e}"))?;
        let close = read_answer(stream, &mut self.buf)?;
        if started.elapsed() > REQUEST_TIMEOUT {
            return Err(format!("an answer took longer than {} s", REQUEST_TIMEOUT.as_secs()));
        }
        if close {
            self.stream = None;
        }
        Ok(())
    }
}

fn connection(spec: Arc<Spec>, index: usize, stop: Arc<AtomicBool>, ready: Arc<Barrier>, go: Arc<Barrier>) -> Outcome {
    let first = spec.base + index as u64 * spec.per_conn;
    let mut client = Client {
        port: spec.port,
        stream: None,
        head: spec.head.replace("{token}", &spec.tokens[index]),
        body: spec.body.clone(),
        request: Vec::with_capacity(4096),
        buf: Vec::with_capacity(16384),
    };
    // Open the connection and warm it (and the server's state for it) before the clock starts.
    let warm = client.call(first);
    ready.wait();
    go.wait();
    let cpu0 = thread_cpu_s();
    let (mut ok, mut failed, mut first_error) = (0u64, 0u64, None);
    if let Err(e) = warm {
        return (0, 0, 1, Some(e), 0.0);
    }
    let mut n = first + 1;
    while n < first + spec.per_conn && !stop.load(Ordering::Relaxed) {
        match client.call(n) {
            Ok(()) => ok += 1,
            Err(e) => {
                failed += 1;
                first_error = Some(e);
                break; // the connection's state is unknown after an error
            }
        }
        n += 1;
    }
    (1, ok, failed, first_error, thread_cpu_s() - cpu0)
}

fn run() -> Result<bool, String> {
    let mut stdin = BufReader::new(io::stdin());
    let spec = Arc::new(read_spec(&mut stdin)?);
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(Barrier::new(spec.tokens.len() + 1));
    let go = Arc::new(Barrier::new(spec.tokens.len() + 1));
    let handles: Vec<_> = (0..spec.tokens.len())
        .map(|k| {
            let (spec, stop, ready, go) = (spec.clone(), stop.clone(), ready.clone(), go.clone());
            thread::spawn(move || connection(spec, k, stop, ready, go))
        })
        .collect();
    ready.wait();
    println!("ready");
    io::stdout().flush().map_err(|e| e.to_string())?;
    let mut line = String::new();
    stdin.read_line(&mut line).map_err(|e| e.to_string())?;
    if line.trim() != "go" {
        stop.store(true, Ordering::Relaxed);
        go.wait();
        return Err(format!("expected \"go\" after \"ready\", got {:?}", line.trim()));
    }
    let cpu0 = thread_cpu_s();
    let started = Instant::now();
    go.wait();
    let deadline = started + Duration::from_secs_f64(spec.seconds);
    while Instant::now() < deadline && !handles.iter().all(|h| h.is_finished()) {
        thread::sleep(Duration::from_millis(5).min(deadline.saturating_duration_since(Instant::now())));
    }
    stop.store(true, Ordering::Relaxed);
    let (mut warm, mut ok, mut failed, mut first_error, mut cpu) = (0, 0, 0, None, thread_cpu_s() - cpu0);
    for handle in handles {
        let (w, o, f, e, c) = handle
            .join()
            .unwrap_or((0, 0, 1, Some("a connection's thread panicked".into()), 0.0));
        warm += w;
        ok += o;
        failed += f;
        cpu += c;
        if first_error.is_none() {
            first_error = e;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!("ok {ok} errors {failed} seconds {elapsed:.6} cpu {cpu:.6} warm {warm}");
    if let Some(e) = first_error {
        eprintln!("openforge-loadgen: {e}");
    }
    Ok(failed == 0)
}

fn main() {
    match run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("openforge-loadgen: {e}");
            std::process::exit(2);
        }
    }
}
