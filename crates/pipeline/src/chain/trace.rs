//! Chrome / Perfetto trace events (the JSON "Trace Event Format"): one complete event (`"X"`)
//! per stage span, one instant event (`"i"`) per timeline signal, and on the `gpu` lane one
//! async slice (`"b"`/`"e"`) per GPU submission, from its submission to the completion value
//! the queue signalled, so a user opening the file in ui.perfetto.dev or chrome://tracing sees
//! the stages overlap and several frames in flight on the GPU at once.
//!
//! Each worker records into its own [`TraceLog`] (no sharing on the hot path); the logs are
//! merged when the workers have joined.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// One event.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    pub name: String,
    /// Thread lane (one per stage worker).
    pub lane: u32,
    /// Microseconds since the run started.
    pub start_us: f64,
    /// `Some` for a span, `None` for an instant (a timeline signal).
    pub duration_us: Option<f64>,
    /// The frame the event belongs to.
    pub frame: Option<u64>,
    /// The timeline value signalled, for instants.
    pub value: Option<u64>,
    /// For a span that may overlap others on its lane (GPU work in flight): its id, and the
    /// span is written as an async slice (`b`/`e`), which trace viewers stack.
    pub async_id: Option<u64>,
}

/// A worker's events, recorded against the run's start time.
#[derive(Clone, Debug)]
pub struct TraceLog {
    origin: Instant,
    lane: u32,
    lane_name: &'static str,
    enabled: bool,
    events: Vec<TraceEvent>,
}

impl TraceLog {
    /// A log for lane `lane` named `lane_name`; a disabled log records nothing.
    pub fn new(origin: Instant, lane: u32, lane_name: &'static str, enabled: bool) -> TraceLog {
        TraceLog {
            origin,
            lane,
            lane_name,
            enabled,
            events: Vec::new(),
        }
    }

    fn micros(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }

    /// A span from `start` for `duration`.
    pub fn span(&mut self, name: &str, frame: Option<u64>, start: Instant, duration: Duration) {
        if self.enabled {
            self.events.push(TraceEvent {
                name: name.to_string(),
                lane: self.lane,
                start_us: self.micros(start),
                duration_us: Some(duration.as_secs_f64() * 1e6),
                frame,
                value: None,
                async_id: None,
            });
        }
    }

    /// A span from `start` to `end` that may overlap other spans of the lane (work in flight
    /// on a GPU queue), identified by `id` (its completion timeline value).
    pub fn async_span(&mut self, name: &str, frame: u64, id: u64, start: Instant, end: Instant) {
        if self.enabled {
            self.events.push(TraceEvent {
                name: name.to_string(),
                lane: self.lane,
                start_us: self.micros(start),
                duration_us: Some(end.saturating_duration_since(start).as_secs_f64() * 1e6),
                frame: Some(frame),
                value: Some(id),
                async_id: Some(id),
            });
        }
    }

    /// A timeline signal: `timeline` reached `value` now.
    pub fn signal(&mut self, timeline: &str, value: u64, frame: Option<u64>) {
        if self.enabled {
            self.events.push(TraceEvent {
                name: format!("signal {timeline}"),
                lane: self.lane,
                start_us: self.micros(Instant::now()),
                duration_us: None,
                frame,
                value: Some(value),
                async_id: None,
            });
        }
    }

    /// The lane's id and name.
    pub fn lane(&self) -> (u32, &'static str) {
        (self.lane, self.lane_name)
    }

    /// The recorded events.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }
}

/// Writes `logs` as one Chrome trace JSON file.
pub fn write(path: &Path, logs: &[TraceLog]) -> std::io::Result<()> {
    let mut events = Vec::new();
    for log in logs {
        let (lane, name) = log.lane();
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 1, "tid": lane,
            "args": { "name": name },
        }));
        for e in log.events() {
            let mut args = serde_json::Map::new();
            if let Some(f) = e.frame {
                args.insert("frame".into(), f.into());
            }
            if let Some(v) = e.value {
                args.insert("value".into(), v.into());
            }
            let mut event = serde_json::json!({
                "name": e.name, "pid": 1, "tid": e.lane, "ts": e.start_us, "args": args,
            });
            match (e.duration_us, e.async_id) {
                (Some(d), Some(id)) => {
                    event["ph"] = "b".into();
                    event["cat"] = name.into();
                    event["id"] = id.into();
                    let mut end = event.clone();
                    end["ph"] = "e".into();
                    end["ts"] = (e.start_us + d).into();
                    events.push(event);
                    events.push(end);
                    continue;
                }
                (Some(d), None) => {
                    event["ph"] = "X".into();
                    event["dur"] = d.into();
                }
                (None, _) => {
                    event["ph"] = "i".into();
                    event["s"] = "t".into();
                }
            }
            events.push(event);
        }
    }
    let doc = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    serde_json::to_writer(&mut file, &doc)?;
    file.flush()
}
