//! A node agent that serves a recorded harvest document (`valve-scheduler agent`): for test
//! clusters without GPUs and for replaying a node's past. The jobs' progress is live, read from
//! the node's progress directory on every request; the file is re-read too, so it can change.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use valve_harvest::{progress, NodeHarvest};

/// What the agent serves.
#[derive(Clone, Debug)]
pub struct Replay {
    /// The node it speaks for (replaces the recorded name).
    pub node: String,
    /// The recorded document.
    pub harvest: PathBuf,
    /// Where this node's jobs report progress.
    pub progress_dir: PathBuf,
    /// Windows of the jobs' rates (default: the document's).
    pub rate_windows_s: Vec<u32>,
    /// Jobs silent for longer than this are left out.
    pub stale_ms: u64,
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Replay {
    /// The document as of `now_unix_ms`.
    pub fn document(&self, now_unix_ms: u64) -> Result<NodeHarvest, String> {
        let text = std::fs::read_to_string(&self.harvest)
            .map_err(|e| format!("cannot read {}: {e}", self.harvest.display()))?;
        let mut doc = NodeHarvest::from_json(&text)
            .map_err(|e| format!("{}: {e}", self.harvest.display()))?;
        doc.node = self.node.clone();
        doc.generated_unix_ms = now_unix_ms;
        doc.source = "recorded".into();
        let windows = if self.rate_windows_s.is_empty() {
            doc.gpus
                .first()
                .map(|g| g.windows.iter().map(|w| w.window_s).collect())
                .unwrap_or_default()
        } else {
            self.rate_windows_s.clone()
        };
        doc.jobs = progress::read_all(&self.progress_dir, now_unix_ms, &windows, self.stale_ms);
        Ok(doc)
    }

    /// Serves `GET /v1/harvest` on `server` until it fails.
    pub fn serve(&self, server: &tiny_http::Server) {
        let json =
            tiny_http::Header::from_bytes("Content-Type", "application/json").expect("ascii");
        for req in server.incoming_requests() {
            let reply = match (req.method(), req.url()) {
                (tiny_http::Method::Get, "/v1/harvest") => match self.document(unix_ms()) {
                    Ok(doc) => tiny_http::Response::from_string(
                        serde_json::to_string(&doc).expect("document serialises"),
                    )
                    .with_header(json.clone()),
                    Err(e) => {
                        tiny_http::Response::from_string(format!("{e}\n")).with_status_code(500)
                    }
                },
                _ => tiny_http::Response::from_string(
                    "valve-scheduler agent serves GET /v1/harvest\n",
                )
                .with_status_code(404),
            };
            if let Err(e) = req.respond(reply) {
                tracing::debug!("agent: reply failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agents::fetch;
    use std::time::Duration;

    #[test]
    fn a_recorded_document_is_served_with_live_progress_and_checked_by_the_fetcher() {
        let dir = tempfile::tempdir().unwrap();
        let harvest = dir.path().join("h.json");
        let doc = crate::testutil::doc("recorded-name", 2, 0.3, 20 << 30);
        std::fs::write(&harvest, serde_json::to_string(&doc).unwrap()).unwrap();
        let progress_dir = dir.path().join("progress");
        let now = unix_ms();
        progress::report(&progress_dir, "17", now - 30_000, 0.0).unwrap();
        progress::report(&progress_dir, "17", now - 1_000, 290.0).unwrap();
        let replay = Replay {
            node: "gpu004".into(),
            harvest,
            progress_dir,
            rate_windows_s: vec![],
            stale_ms: 60_000,
        };
        let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
        let addr = server.server_addr().to_ip().unwrap();
        let r = replay.clone();
        std::thread::spawn(move || r.serve(&server));
        let url = format!("http://{addr}/v1/harvest");
        let got = fetch("gpu004", &url, Duration::from_secs(5)).unwrap();
        assert_eq!(got.source, "recorded");
        assert_eq!(got.gpus.len(), 2);
        let rate = got.job("17").unwrap().rate(60).unwrap();
        assert!(rate.per_s > 9.0 && rate.per_s < 10.5, "{rate:?}");
        let e = fetch("gpu005", &url, Duration::from_secs(5)).unwrap_err();
        assert!(e.contains("not \"gpu005\""), "{e}");
    }
}
