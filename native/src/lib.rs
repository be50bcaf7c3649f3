//! A whole answer's journal record made into its `ModelCallV1` event JSON, in compiled code.
//!
//! Why: the proxy's shipping worker turns every whole answer the proxy journalled (a little
//! metadata, the chat request sent to the engine, the engine's answer) into the call's event.
//! In Python that took about 55 µs per call, most of it parsing the answer's token ids and
//! logprobs into Python objects only to pack them again; on a machine where the worker shares
//! the proxy's cores, that cost is most of what capture takes from the proxy's throughput.
//!
//! This module does the same work for the usual record and nothing else. It answers `None`
//! for anything it is not sure of (a value of an unexpected type, a duplicate key, a number out
//! of range, a date in another form), and the Python path
//! (`producers.raw_calls._exchange_fields` and `producers.capture.event_json`) then decides,
//! with the same checks it always made. So for a record the proxy writes it never makes an
//! event the Python path would not have made: every check of `producers.capture._vouch` is
//! repeated here, and the unit tests compare both paths on every kind of record they can make.
//! (Parts of the engine's answer the event does not carry are skipped, not parsed, so JSON
//! there that Python's parser refuses goes unnoticed; the proxy journals only answers it parsed.)
//!
//! [`frame`] holds the other half: the proxy's own write of each call's journal frame.

mod frame;

use std::collections::HashSet;
use std::fmt::Write as _;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Longest rollout, task and call id (`producers.capture._MAX_ID`), in characters.
const MAX_ID: usize = 256;
/// Longest weight version (`_MAX_VERSION`).
const MAX_VERSION: usize = 128;
/// Longest event id (`_MAX_EVENT_ID`).
const MAX_EVENT_ID: usize = 128;
/// `schemas.call.v1.ApiProtocol`'s values.
const PROTOCOLS: [&str; 3] = ["openai_chat", "openai_responses", "anthropic_messages"];
/// `schemas.call.v1._CREDENTIAL_HEADERS`: never in an event's session headers.
const CREDENTIAL_HEADERS: [&str; 6] = [
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "set-cookie",
];
/// `producers.capture.SAMPLING_KEYS`.
const SAMPLING_KEYS: [&str; 13] = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
];
/// `producers.capture.CAPTURE_KEYS`.
const CAPTURE_KEYS: [&str; 6] = [
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "return_weight_versions",
    "stream_options",
    "include_reasoning",
];
/// `producers.capture._STRUCTURE_KEYS`.
const STRUCTURE_KEYS: [&str; 5] = ["messages", "tools", "tool_choice", "model", "stream"];

/// A JSON object's members in document order (a `dict` keeps insertion order, and the event
/// lists the request's sampling parameters and extras in the order the request had them).
struct Ordered<V>(Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Ordered<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Members<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Members<V> {
            type Value = Ordered<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members: Vec<(String, V)> = Vec::new();
                // A harness may send a request with any number of fields: a set, not a scan
                // of the keys before each, keeps that linear.
                let mut seen: HashSet<String> = HashSet::new();
                while let Some((key, value)) = map.next_entry::<String, V>()? {
                    if !seen.insert(key.clone()) {
                        // Python keeps the last value at the first key's place; leave that to it.
                        return Err(serde::de::Error::custom("duplicate key"));
                    }
                    members.push((key, value));
                }
                Ok(Ordered(members))
            }
        }
        deserializer.deserialize_map(Members(std::marker::PhantomData))
    }
}

impl<V> Ordered<V> {
    fn get(&self, key: &str) -> Option<&V> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// A member that may be absent: `None` when absent, `Some` (maybe JSON `null`) when present.
fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(deserializer).map(Some)
}

/// A member that must be present and may be `null` (Python reads it with `meta[...]`).
fn nullable<'de, D: Deserializer<'de>, T: Deserialize<'de>>(deserializer: D) -> Result<Option<T>, D::Error> {
    Option::<T>::deserialize(deserializer)
}

#[derive(Deserialize)]
struct Meta<'a> {
    rollout_id: String,
    #[serde(deserialize_with = "nullable")]
    task_id: Option<String>,
    call_id: String,
    attempt: u64,
    #[serde(deserialize_with = "nullable")]
    retry_of: Option<String>,
    protocol: String,
    model: String,
    streamed: bool,
    #[serde(deserialize_with = "nullable")]
    session_headers: Option<Ordered<String>>,
    started_at: String,
    #[serde(borrow)]
    first_token_s: &'a RawValue,
    #[serde(borrow)]
    total_s: &'a RawValue,
    #[serde(deserialize_with = "nullable")]
    weight_version: Option<String>,
    #[serde(borrow)]
    asked: Ordered<&'a RawValue>,
    #[serde(deserialize_with = "nullable")]
    upstream_status_code: Option<i64>,
    #[serde(deserialize_with = "nullable")]
    upstream_replica: Option<String>,
    #[serde(rename = "_event_id")]
    event_id: String,
    #[serde(rename = "_created_at")]
    created_at: String,
    #[serde(rename = "_trace")]
    trace: Vec<(String, String)>,
}

/// A member Python reads with `.get(...)`: absent, `null`, or a value of the expected type.
#[derive(Default)]
enum Field<T> {
    #[default]
    Absent,
    Null,
    Value(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match Option::<T>::deserialize(deserializer)? {
            None => Field::Null,
            Some(value) => Field::Value(value),
        })
    }
}

impl<T> Field<T> {
    /// The value, or `None` when absent or `null`.
    fn value(self) -> Option<T> {
        match self {
            Field::Value(value) => Some(value),
            _ => None,
        }
    }
}

impl<T> Field<Vec<T>> {
    /// Python's `x or []` for a member that must be a list.
    fn or_empty(self) -> Vec<T> {
        self.value().unwrap_or_default()
    }
}

/// A JSON object read into a derived struct. serde's derived structs would also take a JSON
/// array of their fields in order, which Python's path refuses (it reads the value by key).
struct Obj<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        T::deserialize(MapOnly(deserializer)).map(Obj)
    }
}

/// A deserializer that reads every value as a JSON object (see [`Obj`]).
struct MapOnly<D>(D);

impl<'de, D: Deserializer<'de>> Deserializer<'de> for MapOnly<D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_map(visitor)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
        unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier ignored_any
    }
}

/// The engine's answer: only what the event carries is read; the rest is skipped unparsed.
#[derive(Deserialize)]
struct Answer<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    choices: Field<Vec<Obj<Choice<'a>>>>,
    #[serde(default)]
    prompt_token_ids: Field<Vec<u32>>,
    #[serde(borrow, default, deserialize_with = "present")]
    usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: Field<u64>,
    #[serde(default)]
    token_ids: Field<Vec<u32>>,
    #[serde(default)]
    weight_versions: Field<Vec<Obj<VersionRange>>>,
    #[serde(borrow, default)]
    message: Field<Obj<Message<'a>>>,
    #[serde(default)]
    logprobs: Field<Obj<LogprobsField>>,
    #[serde(default)]
    finish_reason: Field<String>,
    #[serde(borrow, default, deserialize_with = "present")]
    stop_reason: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default)]
    role: Field<String>,
    #[serde(default)]
    content: Field<String>,
    #[serde(default)]
    reasoning: Field<String>,
    #[serde(default)]
    reasoning_content: Field<String>,
    #[serde(borrow, default)]
    tool_calls: Field<&'a RawValue>,
}

#[derive(Deserialize)]
struct LogprobsField {
    #[serde(default)]
    content: Field<Vec<Obj<TokenLogprob>>>,
}

/// One token's entry of `logprobs.content`: only its `logprob` is read.
#[derive(Deserialize)]
struct TokenLogprob {
    logprob: f64,
}

/// One range of `weight_versions`.
#[derive(Deserialize)]
struct VersionRange {
    version: String,
    start: i64,
    end: i64,
}

/// Absent or JSON `null`.
fn none(raw: Option<&RawValue>) -> bool {
    raw.is_none_or(|r| r.get() == "null")
}

fn parse<'a, T: Deserialize<'a>>(raw: &'a RawValue) -> Option<T> {
    serde_json::from_str(raw.get()).ok()
}

/// A JSON object read into a derived struct (which would also take an array of its fields).
fn object<'a, T: Deserialize<'a>>(text: &'a str) -> Option<T> {
    text.trim_start_matches([' ', '\t', '\n', '\r'])
        .starts_with('{')
        .then_some(())?;
    serde_json::from_str(text).ok()
}

/// A part of the engine's answer copied into the event as it is: it must be JSON that Python's
/// parser reads too (no number beyond a double's range, no lone surrogate). The parts not read
/// are only skipped, which takes such JSON: the proxy journals only answers `orjson` parsed.
fn strict(raw: Option<&RawValue>) -> Option<()> {
    match raw {
        None => Some(()),
        Some(raw) => serde_json::from_str::<serde_json::Value>(raw.get()).ok().map(|_| ()),
    }
}

fn is_id(value: &str) -> bool {
    let n = value.chars().count();
    0 < n && n <= MAX_ID
}

/// A JSON number Python parses as a `float` (it has a fraction or an exponent), finite and not negative.
fn seconds(raw: &RawValue) -> Option<()> {
    let text = raw.get();
    if !text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
        return None;
    }
    let value: f64 = text.parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some(())
}

/// `datetime.fromisoformat` of the form the proxy writes, in UTC, as `orjson` writes it back with
/// `OPT_UTC_Z`: `YYYY-MM-DDTHH:MM:SS[.ffffff]+00:00` becomes `YYYY-MM-DDTHH:MM:SS[.ffffff]Z`, the
/// fraction dropped when it is zero.
fn utc_z(text: &str) -> Option<String> {
    let stamp = text.strip_suffix("+00:00")?.as_bytes();
    if !(stamp.len() == 19 || stamp.len() == 26) {
        return None;
    }
    let digits = |range: std::ops::Range<usize>| -> Option<u32> {
        let part = &stamp[range];
        part.iter()
            .all(u8::is_ascii_digit)
            .then(|| part.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')))
    };
    if stamp[4] != b'-' || stamp[7] != b'-' || stamp[10] != b'T' || stamp[13] != b':' || stamp[16] != b':' {
        return None;
    }
    let (year, month, day) = (digits(0..4)?, digits(5..7)?, digits(8..10)?);
    let (hour, minute, second) = (digits(11..13)?, digits(14..16)?, digits(17..19)?);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return None,
    };
    if year == 0 || day == 0 || day > days || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let mut out = String::with_capacity(28);
    out.push_str(std::str::from_utf8(&stamp[..19]).ok()?);
    if stamp.len() == 26 {
        if stamp[19] != b'.' {
            return None;
        }
        let micros = digits(20..26)?;
        if micros != 0 {
            out.push_str(std::str::from_utf8(&stamp[19..]).ok()?);
        }
    }
    out.push('Z');
    Some(out)
}

fn push_str(out: &mut Vec<u8>, value: &str) {
    // Writing a str into a Vec cannot fail.
    serde_json::to_writer(&mut *out, value).expect("a str always serialises");
}

fn push_opt_str(out: &mut Vec<u8>, value: Option<&str>) {
    match value {
        Some(text) => push_str(out, text),
        None => out.extend_from_slice(b"null"),
    }
}

fn push_raw(out: &mut Vec<u8>, raw: Option<&RawValue>) {
    out.extend_from_slice(raw.map_or("null", RawValue::get).as_bytes());
}

/// An event's JSON, its rollout id (the Kafka key) and its trace headers.
type Made = (Vec<u8>, String, Vec<(String, String)>);

/// The event's JSON, written straight from the record, or `None` for the Python path to decide.
fn event_json(record: &[u8]) -> Option<Made> {
    let head_length = u32::from_le_bytes(record.get(0..4)?.try_into().ok()?) as usize;
    let request_length = u32::from_le_bytes(record.get(4..8)?.try_into().ok()?) as usize;
    let start = 8usize.checked_add(head_length)?;
    let meta: Meta = object(std::str::from_utf8(record.get(8..start)?).ok()?)?;
    let chat_end = start.checked_add(request_length)?;
    let chat: Ordered<&RawValue> = serde_json::from_slice(record.get(start..chat_end)?).ok()?;
    let answer: Answer = object(std::str::from_utf8(record.get(chat_end..)?).ok()?)?;

    // The call's own fields, as producers.capture._vouch checks them.
    let task_ok = meta.task_id.as_deref().is_none_or(is_id);
    let retry_ok = meta.retry_of.as_deref().is_none_or(is_id);
    if !(is_id(&meta.rollout_id) && is_id(&meta.call_id) && task_ok && retry_ok) {
        return None;
    }
    if (meta.attempt == 0) != meta.retry_of.is_none() || meta.retry_of.as_deref() == Some(meta.call_id.as_str()) {
        return None;
    }
    if meta.model.is_empty() || !PROTOCOLS.contains(&meta.protocol.as_str()) {
        return None;
    }
    if !meta.upstream_status_code.is_none_or(|code| (100..=599).contains(&code)) {
        return None;
    }
    let no_headers = Ordered(Vec::new());
    let headers = meta.session_headers.as_ref().unwrap_or(&no_headers);
    for (name, _) in &headers.0 {
        // Python checks name == name.lower(); for ASCII names that is "no capital letter".
        if !name.is_ascii()
            || name.bytes().any(|b| b.is_ascii_uppercase())
            || CREDENTIAL_HEADERS.contains(&name.as_str())
        {
            return None;
        }
    }
    let n_chars = meta.event_id.chars().count();
    if n_chars == 0 || n_chars > MAX_EVENT_ID {
        return None;
    }
    let created_at = utc_z(&meta.created_at)?;
    let started_at = utc_z(&meta.started_at)?;
    seconds(meta.total_s)?;
    if meta.first_token_s.get() != "null" {
        seconds(meta.first_token_s)?;
    }

    // The request as the harness meant it (producers.capture.normalize_request).
    let messages = chat.get("messages").copied().filter(|raw| raw.get() != "null");
    if let Some(raw) = messages {
        if !raw.get().starts_with('[') {
            return None;
        }
    }
    let tools = chat.get("tools").copied().filter(|raw| raw.get() != "null");
    if let Some(raw) = tools {
        if !raw.get().starts_with('[') {
            return None;
        }
    }
    for (key, _) in &meta.asked.0 {
        let kept_in_extra = !SAMPLING_KEYS.contains(&key.as_str())
            && !STRUCTURE_KEYS.contains(&key.as_str())
            && !CAPTURE_KEYS.contains(&key.as_str());
        if kept_in_extra && chat.get(key).is_some() {
            return None; // the harness's value would replace the request's in place; Python's path does that
        }
    }

    // The one choice of the engine's answer (producers.raw_calls._one_choice_fields).
    let mut choices = answer.choices.value()?;
    if choices.len() != 1 {
        return None;
    }
    let Obj(choice) = choices.pop()?;
    let index: u64 = match choice.index {
        Field::Absent => 0,
        Field::Null => return None,
        Field::Value(index) => index,
    };
    let ids = choice.token_ids.or_empty();
    let ranges = choice.weight_versions.or_empty();
    let prompt = answer.prompt_token_ids.or_empty();
    if ids.iter().chain(prompt.iter()).any(|&id| id > i32::MAX as u32) {
        return None;
    }
    let message = match choice.message.value() {
        Some(Obj(message)) => message,
        None => Message {
            role: Field::Absent,
            content: Field::Absent,
            reasoning: Field::Absent,
            reasoning_content: Field::Absent,
            tool_calls: Field::Absent,
        },
    };
    let content = message.content.value().filter(|text| !text.is_empty());
    // producers.capture.reasoning_text: `reasoning`, else the older `reasoning_content`.
    let thought = message
        .reasoning
        .value()
        .filter(|text| !text.is_empty())
        .or_else(|| message.reasoning_content.value().filter(|text| !text.is_empty()));
    let tool_calls = match message.tool_calls.value() {
        None => None,
        Some(raw) if raw.get().starts_with('[') => {
            let inner = raw.get()[1..raw.get().len() - 1].trim_matches([' ', '\t', '\n', '\r']);
            (!inner.is_empty()).then_some(raw)
        }
        Some(_) => return None,
    };
    let role = message
        .role
        .value()
        .filter(|text| !text.is_empty())
        .unwrap_or_else(|| "assistant".to_owned());
    let logprobs: Vec<f64> = match choice.logprobs.value() {
        None => Vec::new(),
        Some(Obj(field)) => field
            .content
            .or_empty()
            .into_iter()
            .map(|Obj(item)| item.logprob)
            .collect(),
    };
    if logprobs.iter().any(|value| *value == 0.0 && value.is_sign_negative()) {
        // JSON `-0` is the int 0 to Python, whose float is +0.0; serde_json reads -0.0. Which
        // spelling the engine used is not known here.
        return None;
    }
    let n = if logprobs.is_empty() {
        ids.len()
    } else {
        ids.len().min(logprobs.len())
    };
    if logprobs.len().min(n) != n {
        return None; // validation refuses ids without their logprobs: Python's path says so
    }
    let ids = &ids[..n];
    let logprobs = &logprobs[..n];
    let finish_reason = choice.finish_reason.value();
    let stop_reason: Option<&RawValue> = choice.stop_reason.filter(|raw| raw.get() != "null");
    if let Some(raw) = stop_reason {
        let text = raw.get();
        if !(text.starts_with('"') && parse::<String>(raw).is_some() || text.parse::<i64>().is_ok()) {
            return None;
        }
    }
    let mut versions: Vec<(&str, i64, i64)> = Vec::new();
    if ranges.is_empty() {
        if let Some(version) = meta.weight_version.as_deref().filter(|v| !v.is_empty()) {
            if n > 0 {
                versions.push((version, 0, n as i64));
            }
        }
    } else {
        for Obj(range) in &ranges {
            let end = range.end.min(n as i64);
            if range.start < end {
                versions.push((range.version.as_str(), range.start, end));
            }
        }
    }
    let mut position = 0i64;
    for &(version, start, end) in &versions {
        let length = version.chars().count();
        if !(0 < length && length <= MAX_VERSION && start == position && end > start) {
            return None;
        }
        position = end;
    }
    if !versions.is_empty() && position != n as i64 {
        return None;
    }
    let usage: Option<Ordered<&RawValue>> = if none(answer.usage) {
        None
    } else {
        Some(parse(answer.usage?)?)
    };
    let usage = usage.filter(|members| !members.0.is_empty());
    let counts = match &usage {
        None => None,
        Some(members) => {
            let count = |key: &str| -> Option<u64> {
                match members.get(key) {
                    None => Some(0),
                    Some(raw) if raw.get() == "null" => Some(0),
                    Some(raw) => parse(raw),
                }
            };
            let cached: Option<u64> = match members.get("prompt_tokens_details") {
                None => None,
                Some(raw) if raw.get() == "null" => None,
                Some(raw) => {
                    let details: Ordered<&RawValue> = parse(raw)?;
                    match details.get("cached_tokens") {
                        None => None,
                        Some(raw) if raw.get() == "null" => None,
                        Some(raw) => Some(parse::<u64>(raw)?),
                    }
                }
            };
            Some((count("prompt_tokens")?, count("completion_tokens")?, cached))
        }
    };

    strict(answer.id)?;
    strict(answer.model)?;
    strict(tool_calls)?;
    if usage.is_some() {
        strict(answer.usage)?;
    }

    // The event, field by field in ModelCallV1's order.
    let mut out: Vec<u8> = Vec::with_capacity(record.len());
    out.extend_from_slice(b"{\"event_id\":");
    push_str(&mut out, &meta.event_id);
    out.extend_from_slice(b",\"created_at\":");
    push_str(&mut out, &created_at);
    out.extend_from_slice(b",\"rollout_id\":");
    push_str(&mut out, &meta.rollout_id);
    out.extend_from_slice(b",\"task_id\":");
    push_opt_str(&mut out, meta.task_id.as_deref());
    out.extend_from_slice(b",\"call_id\":");
    push_str(&mut out, &meta.call_id);
    write!(Text(&mut out), ",\"attempt\":{}", meta.attempt).ok()?;
    out.extend_from_slice(b",\"retry_of\":");
    push_opt_str(&mut out, meta.retry_of.as_deref());
    out.extend_from_slice(b",\"protocol\":");
    push_str(&mut out, &meta.protocol);
    out.extend_from_slice(b",\"model\":");
    push_str(&mut out, &meta.model);
    out.extend_from_slice(b",\"request\":{\"messages\":");
    out.extend_from_slice(messages.map_or("[]", RawValue::get).as_bytes());
    out.extend_from_slice(b",\"tools\":");
    push_raw(&mut out, tools);
    out.extend_from_slice(b",\"tool_choice\":");
    push_raw(&mut out, chat.get("tool_choice").copied());
    out.extend_from_slice(b",\"sampling\":{");
    let mut first = true;
    for (key, value) in chat.0.iter().filter(|(key, _)| SAMPLING_KEYS.contains(&key.as_str())) {
        member(&mut out, &mut first, key, value);
    }
    out.extend_from_slice(b"},\"extra\":{");
    first = true;
    for (key, value) in chat.0.iter().filter(|(key, _)| {
        let key = key.as_str();
        !SAMPLING_KEYS.contains(&key) && !STRUCTURE_KEYS.contains(&key) && !CAPTURE_KEYS.contains(&key)
    }) {
        member(&mut out, &mut first, key, value);
    }
    for (key, value) in &meta.asked.0 {
        member(&mut out, &mut first, key, value);
    }
    out.extend_from_slice(b"}},\"response\":{\"id\":");
    push_raw(&mut out, answer.id);
    out.extend_from_slice(b",\"model\":");
    push_raw(&mut out, answer.model);
    write!(
        Text(&mut out),
        ",\"choices\":[{{\"index\":{index},\"message\":{{\"role\":"
    )
    .ok()?;
    push_str(&mut out, &role);
    out.extend_from_slice(b",\"content\":");
    push_opt_str(&mut out, content.as_deref());
    if let Some(text) = &thought {
        out.extend_from_slice(b",\"reasoning\":");
        push_str(&mut out, text);
    }
    if let Some(raw) = tool_calls {
        out.extend_from_slice(b",\"tool_calls\":");
        out.extend_from_slice(raw.get().as_bytes());
    }
    out.extend_from_slice(b"},\"finish_reason\":");
    push_opt_str(&mut out, finish_reason.as_deref());
    out.extend_from_slice(b"}],\"usage\":");
    match &usage {
        None => out.extend_from_slice(b"null"),
        Some(_) => push_raw(&mut out, answer.usage),
    }
    out.extend_from_slice(b"},\"prompt_token_ids\":\"");
    push_base64(&mut out, prompt.iter().flat_map(|id| id.to_le_bytes()));
    write!(
        Text(&mut out),
        "\",\"choices\":[{{\"index\":{index},\"completion_token_ids\":\""
    )
    .ok()?;
    push_base64(&mut out, ids.iter().flat_map(|id| id.to_le_bytes()));
    out.extend_from_slice(b"\",\"logprobs\":\"");
    push_base64(&mut out, logprobs.iter().flat_map(|value| value.to_le_bytes()));
    out.extend_from_slice(b"\",\"weight_versions\":[");
    for (k, &(version, start, end)) in versions.iter().enumerate() {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"version\":");
        push_str(&mut out, version);
        write!(Text(&mut out), ",\"start\":{start},\"end\":{end}}}").ok()?;
    }
    out.extend_from_slice(b"],\"finish_reason\":");
    push_opt_str(&mut out, finish_reason.as_deref());
    out.extend_from_slice(b",\"stop_reason\":");
    match stop_reason {
        None => out.extend_from_slice(b"null"),
        Some(raw) if raw.get().starts_with('"') => push_str(&mut out, &parse::<String>(raw)?),
        Some(raw) => write!(Text(&mut out), "{}", raw.get().parse::<i64>().ok()?).ok()?,
    }
    out.extend_from_slice(b"}],\"usage\":");
    match counts {
        None => out.extend_from_slice(b"null"),
        Some((prompt_tokens, completion_tokens, cached)) => {
            write!(Text(&mut out), "{{\"prompt_tokens\":{prompt_tokens},\"completion_tokens\":{completion_tokens},\"cached_prompt_tokens\":").ok()?;
            match cached {
                None => out.extend_from_slice(b"null"),
                Some(cached) => write!(Text(&mut out), "{cached}").ok()?,
            }
            out.push(b'}');
        }
    }
    out.extend_from_slice(b",\"timings\":{\"started_at\":");
    push_str(&mut out, &started_at);
    out.extend_from_slice(b",\"time_to_first_token_s\":");
    out.extend_from_slice(meta.first_token_s.get().as_bytes());
    out.extend_from_slice(b",\"total_s\":");
    out.extend_from_slice(meta.total_s.get().as_bytes());
    out.extend_from_slice(b"},\"status\":\"ok\",\"upstream_status_code\":");
    match meta.upstream_status_code {
        None => out.extend_from_slice(b"null"),
        Some(code) => write!(Text(&mut out), "{code}").ok()?,
    }
    out.extend_from_slice(b",\"error_message\":null,\"upstream_replica\":");
    push_opt_str(&mut out, meta.upstream_replica.as_deref());
    out.extend_from_slice(if meta.streamed {
        b",\"streamed\":true"
    } else {
        b",\"streamed\":false"
    });
    out.extend_from_slice(b",\"session_headers\":{");
    first = true;
    for (name, value) in &headers.0 {
        if !first {
            out.push(b',');
        }
        first = false;
        push_str(&mut out, name);
        out.push(b':');
        push_str(&mut out, value);
    }
    out.extend_from_slice(b"}}");
    Some((out, meta.rollout_id, meta.trace))
}

fn member(out: &mut Vec<u8>, first: &mut bool, key: &str, value: &RawValue) {
    if !*first {
        out.push(b',');
    }
    *first = false;
    push_str(out, key);
    out.push(b':');
    out.extend_from_slice(value.get().as_bytes());
}

fn push_base64(out: &mut Vec<u8>, bytes: impl Iterator<Item = u8>) {
    let packed: Vec<u8> = bytes.collect();
    let start = out.len();
    out.resize(start + packed.len().div_ceil(3) * 4, 0);
    let written = STANDARD
        .encode_slice(&packed, &mut out[start..])
        .expect("room was made for the base64");
    out.truncate(start + written);
}

/// `write!` into the output buffer.
struct Text<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for Text<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// [`Made`] as Python objects.
type PyMade<'py> = (Bound<'py, PyBytes>, String, Vec<(String, Bound<'py, PyBytes>)>);

/// The `ModelCallV1` JSON of a raw exchange journal record, its rollout id and its trace headers,
/// or `None` when the Python path must decide (see the module's documentation).
#[pyfunction]
fn exchange_event<'py>(py: Python<'py>, record: &[u8]) -> Option<PyMade<'py>> {
    // A panic would reach Python as a BaseException, past the shipper's `except Exception`, and
    // stop the worker on the same record after every restart: give the record to Python instead.
    let (json, rollout_id, trace) = std::panic::catch_unwind(|| event_json(record)).ok().flatten()?;
    let trace = trace
        .into_iter()
        .map(|(name, text)| (name, PyBytes::new(py, text.as_bytes())))
        .collect();
    Some((PyBytes::new(py, &json), rollout_id, trace))
}

#[pymodule]
fn openforge_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(exchange_event, m)?)?;
    m.add_function(wrap_pyfunction!(frame::append_frame, m)?)?;
    // The facts this module repeats, for the tests that hold them equal to Python's.
    m.add("MAX_ID", MAX_ID)?;
    m.add("MAX_VERSION", MAX_VERSION)?;
    m.add("MAX_EVENT_ID", MAX_EVENT_ID)?;
    m.add("PROTOCOLS", PROTOCOLS.to_vec())?;
    m.add("CREDENTIAL_HEADERS", CREDENTIAL_HEADERS.to_vec())?;
    m.add("SAMPLING_KEYS", SAMPLING_KEYS.to_vec())?;
    m.add("CAPTURE_KEYS", CAPTURE_KEYS.to_vec())?;
    m.add("STRUCTURE_KEYS", STRUCTURE_KEYS.to_vec())?;
    m.add("RECORD_MAGIC", PyBytes::new(m.py(), frame::RECORD_MAGIC))?;
    Ok(())
}
