//! A closed-loop HTTP/1.1 load generator for the proxy benchmark (`bench/proxy.py`).
//!
//! Why it exists: on a two-core machine the benchmark's Python client spends 50–65 µs of CPU per
//! call, on the same cores as the proxy, its shipping worker, the upstream and the broker. This
//! one sends the same requests for a few µs each, so the cores go to what is measured.
//!
//! Input, one line per argument on stdin (no JSON parser needed, no dependencies):
//!
//! ```text
//! <port>
//! <seconds>
//! <request head, with "{len}" for the body's length, "\r\n" written as the two characters \r\n>
//! <body, with "{n}" for the request's counter>
//! <counter base>
//! <requests per connection at most; connection k counts from base + k * this>
//! <bearer token of connection 0>
//! <bearer token of connection 1>
//! ...
//! ```
//!
//! One thread per connection, each sending its next request as soon as the last is answered; the
//! clock starts once every connection is open and stops when the last answer in flight at the
//! deadline has come back.
//! Output on stdout, one line: `ok <answered> errors <failed> seconds <elapsed> cpu <process CPU s>`,
//! then the first error, if any, on stderr. Exit status 0 when every request got a 200.

use std::io::{self, BufRead, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

/// Requests answered, requests failed, the first failure.
type Outcome = (u64, u64, Option<String>);

struct Spec {
    port: u16,
    seconds: f64,
    head: String,
    body: String,
    base: u64,
    per_conn: u64,
    tokens: Vec<String>,
}

fn read_spec() -> Result<Spec, String> {
    let lines: Vec<String> = io::stdin()
        .lock()
        .lines()
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    if lines.len() < 7 || lines[6..].iter().all(|t| t.is_empty()) {
        return Err(format!(
            "expected at least 7 lines on stdin (one per connection from the 7th), got {}",
            lines.len()
        ));
    }
    let num = |i: usize, what: &str| -> Result<f64, String> {
        lines[i]
            .trim()
            .parse::<f64>()
            .map_err(|_| format!("line {}: {what} is not a number: {:?}", i + 1, lines[i]))
    };
    Ok(Spec {
        port: num(0, "port")? as u16,
        seconds: num(1, "seconds")?,
        head: lines[2].replace("\\r\\n", "\r\n"),
        body: lines[3].clone(),
        base: num(4, "counter base")? as u64,
        per_conn: (num(5, "requests per connection")? as u64).max(1),
        tokens: lines[6..].iter().filter(|t| !t.is_empty()).cloned().collect(),
    })
}

/// Reads one response; returns its status code.
fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Result<u16, String> {
    buf.clear();
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed before the response's head".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| "response head is not UTF-8")?;
    let status: u16 = head.get(9..12).and_then(|s| s.parse().ok()).ok_or("no status code")?;
    let mut length: Option<usize> = None;
    let mut chunked = false;
    for line in head.split("\r\n").skip(1) {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim().to_ascii_lowercase();
        if name == "content-length" {
            length = value.trim().parse().ok();
        } else if name == "transfer-encoding" && value.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        }
    }
    if chunked {
        // Read until the zero-size chunk and the blank line after it.
        while !buf[head_end..].windows(5).any(|w| w == b"0\r\n\r\n") {
            let n = stream.read(&mut chunk).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed inside a chunked body".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    } else {
        let length = length.ok_or("response without content-length or chunked encoding")?;
        while buf.len() < head_end + length {
            let n = stream.read(&mut chunk).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed inside the body".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }
    if status != 200 {
        let text = String::from_utf8_lossy(&buf[head_end..buf.len().min(head_end + 300)]).into_owned();
        return Err(format!("HTTP {status}: {text}"));
    }
    Ok(status)
}

fn connection(spec: Arc<Spec>, index: usize, stop: Arc<AtomicBool>, ready: Arc<Barrier>) -> Outcome {
    // Connect first, then wait for every other connection: the clock starts on a warm start line.
    let connected = TcpStream::connect(("127.0.0.1", spec.port));
    ready.wait();
    let mut stream = match connected {
        Ok(s) => s,
        Err(e) => return (0, 1, Some(format!("connect to port {}: {e}", spec.port))),
    };
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    let head = spec.head.replace("{token}", &spec.tokens[index]);
    let (mut ok, mut failed, mut first_error) = (0u64, 0u64, None);
    let mut buf = Vec::with_capacity(16384);
    let mut request = Vec::with_capacity(4096);
    let first = spec.base + index as u64 * spec.per_conn;
    let mut n = first;
    while n < first + spec.per_conn && !stop.load(Ordering::Relaxed) {
        let body = spec.body.replace("{n}", &n.to_string());
        n += 1;
        request.clear();
        request.extend_from_slice(head.replace("{len}", &body.len().to_string()).as_bytes());
        request.extend_from_slice(body.as_bytes());
        let result = stream
            .write_all(&request)
            .map_err(|e| e.to_string())
            .and_then(|()| read_response(&mut stream, &mut buf));
        match result {
            Ok(_) => ok += 1,
            Err(e) => {
                failed += 1;
                first_error.get_or_insert(e);
                break; // the connection's state is unknown after an error
            }
        }
    }
    (ok, failed, first_error)
}

fn process_cpu_s() -> f64 {
    // utime + stime of the whole process, from /proc (clock ticks of 1/100 s).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

fn main() {
    let spec = match read_spec() {
        Ok(spec) => Arc::new(spec),
        Err(e) => {
            eprintln!("openforge-loadgen: {e}");
            std::process::exit(2);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(Barrier::new(spec.tokens.len() + 1));
    let handles: Vec<_> = (0..spec.tokens.len())
        .map(|k| {
            let (spec, stop, ready) = (spec.clone(), stop.clone(), ready.clone());
            thread::spawn(move || connection(spec, k, stop, ready))
        })
        .collect();
    ready.wait();
    let cpu0 = process_cpu_s();
    let started = Instant::now();
    // Every connection may also finish early, on its request bound.
    let deadline = started + Duration::from_secs_f64(spec.seconds);
    while Instant::now() < deadline && !handles.iter().all(|h| h.is_finished()) {
        thread::sleep(Duration::from_millis(5).min(deadline.saturating_duration_since(Instant::now())));
    }
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut failed, mut first_error) = (0, 0, None);
    for handle in handles {
        let (o, f, e) = handle
            .join()
            .unwrap_or((0, 1, Some("a connection's thread panicked".into())));
        ok += o;
        failed += f;
        if first_error.is_none() {
            first_error = e;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "ok {ok} errors {failed} seconds {elapsed:.6} cpu {:.2}",
        process_cpu_s() - cpu0
    );
    if let Some(e) = first_error {
        eprintln!("openforge-loadgen: {e}");
        std::process::exit(1);
    }
}
