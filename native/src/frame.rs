//! One journal frame appended in a single call: the proxy's record of a whole answer.
//!
//! Why: the proxy journals every answered call on the event loop that serves every call. In
//! Python the frame takes a dozen steps (the record's head, its length prefixes, a checksum
//! carried over four buffers, the frame header, the `writev`), and under load, with the
//! shipping worker and the broker on the same cores, those steps cost several times what they
//! cost in a loop. Here they are one call: the head is built in a small buffer, the checksum is
//! `crc32fast`'s (the same CRC-32 as `zlib.crc32`, computed with the CPU's carry-less multiply
//! where it has one), and the parts are written as they are with one `writev`.
//!
//! The bytes are `producers.journal`'s frame of `producers.spool.pack_record`'s record, exactly;
//! a unit test writes the same record both ways and compares the files.

use std::fs::File;
use std::io::{ErrorKind, IoSlice, Write};
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// `producers.spool._MAGIC`: every record starts with it.
pub const RECORD_MAGIC: &[u8] = b"OFSPOOL1";
/// `producers.journal._FRAME.size`: body length, checksum of the body, sequence number.
const FRAME_HEADER: usize = 16;
/// Linux's errno for a bad file descriptor.
const EBADF: i32 = 9;

/// Appends the frame of record `seq` (`topic`, `key`, no headers, the value `parts` joined) to
/// the open file `fd`, and returns the frame's size in bytes.
///
/// A short write is finished, in order, without copying. An error is raised as Python's
/// `OSError` with its errno; the caller cuts back whatever part of the frame reached the file.
#[pyfunction]
pub fn append_frame(fd: i32, seq: u64, topic: &str, key: &[u8], parts: Vec<Bound<'_, PyBytes>>) -> PyResult<usize> {
    let parts: Vec<&[u8]> = parts.iter().map(|part| part.as_bytes()).collect();
    let value_length: usize = parts.iter().map(|part| part.len()).sum();
    let mut head = Vec::with_capacity(FRAME_HEADER + RECORD_MAGIC.len() + 20 + topic.len() + key.len());
    head.extend_from_slice(&[0; FRAME_HEADER]);
    head.extend_from_slice(RECORD_MAGIC);
    push_field(&mut head, topic.as_bytes())?;
    head.push(1); // a key follows
    push_field(&mut head, key)?;
    head.extend_from_slice(&0u32.to_le_bytes()); // no headers
    head.extend_from_slice(&u32_of(value_length)?.to_le_bytes());
    let body_length = u32_of(head.len() - FRAME_HEADER + value_length)?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head[FRAME_HEADER..]);
    for part in &parts {
        crc.update(part);
    }
    head[0..4].copy_from_slice(&body_length.to_le_bytes());
    head[4..8].copy_from_slice(&crc.finalize().to_le_bytes());
    head[8..16].copy_from_slice(&seq.to_le_bytes());
    let size = head.len() + value_length;
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() + 1);
    slices.push(IoSlice::new(&head));
    slices.extend(parts.iter().map(|part| IoSlice::new(part)));
    if fd < 0 {
        // std's File asserts on a negative descriptor: a panic, past Python's `except Exception`.
        return Err(PyOSError::new_err((EBADF, "Bad file descriptor")));
    }
    // Borrowed, not owned: the journal closes its own descriptor.
    let mut file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        match file.write_vectored(rest) {
            Ok(0) => return Err(os_error(&std::io::Error::from(ErrorKind::WriteZero))),
            Ok(written) => IoSlice::advance_slices(&mut rest, written),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return Err(os_error(&error)),
        }
    }
    Ok(size)
}

/// The error as `os.writev` raises it: `OSError(errno, strerror)`, which Python makes the
/// errno's subclass. (pyo3's own conversion leaves `errno` unset, and the proxy's callers and
/// logs read it.)
fn os_error(error: &std::io::Error) -> PyErr {
    match error.raw_os_error() {
        Some(errno) => {
            let text = error.to_string();
            let strerror = text.split(" (os error").next().unwrap_or(&text).to_owned();
            PyOSError::new_err((errno, strerror))
        }
        None => PyOSError::new_err(error.to_string()),
    }
}

fn push_field(out: &mut Vec<u8>, data: &[u8]) -> PyResult<()> {
    out.extend_from_slice(&u32_of(data.len())?.to_le_bytes());
    out.extend_from_slice(data);
    Ok(())
}

fn u32_of(length: usize) -> PyResult<u32> {
    u32::try_from(length).map_err(|_| PyValueError::new_err(format!("{length} bytes do not fit a journal record")))
}
