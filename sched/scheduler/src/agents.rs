//! Fetching the nodes' harvest documents from their agents (the Valve daemon's `GET /v1/harvest`,
//! or `valve-scheduler agent` replaying a recorded one), many at a time, keeping each node's last
//! good document so that a node that stops answering ages out instead of vanishing at once.

use std::collections::HashMap;
use std::time::Duration;

use valve_harvest::NodeHarvest;

use crate::cycle::Report;

/// The default agent address: the daemon's metrics listener on each node.
pub const DEFAULT_URL: &str = "http://{node}:9401/v1/harvest";

/// Fetches run this many at a time.
const PARALLEL: usize = 32;

/// Where each node's agent is, and what it last said.
pub struct Agents {
    template: String,
    overrides: HashMap<String, String>,
    timeout: Duration,
    /// The last good document of each node.
    pub reports: HashMap<String, Report>,
    /// The latest failure per node (cleared by a success).
    pub errors: HashMap<String, String>,
}

impl Agents {
    /// Agents at `template` (`{node}` is replaced by the node's name) unless `overrides` names
    /// a node's address; each fetch gives up after `timeout`.
    pub fn new(template: &str, overrides: HashMap<String, String>, timeout: Duration) -> Self {
        Agents {
            template: template.into(),
            overrides,
            timeout,
            reports: HashMap::new(),
            errors: HashMap::new(),
        }
    }

    /// The address of `node`'s agent.
    pub fn url(&self, node: &str) -> String {
        self.overrides
            .get(node)
            .cloned()
            .unwrap_or_else(|| self.template.replace("{node}", node))
    }

    /// Fetches every node's document; a failure keeps the node's previous one (with its old
    /// receive time) and records the error. The documents that came are stamped with
    /// `clock()` read once all fetches ended, which is returned: the time to judge them at.
    pub fn refresh(&mut self, nodes: &[String], clock: &dyn Fn() -> u64) -> u64 {
        let urls: Vec<(String, String)> = nodes.iter().map(|n| (n.clone(), self.url(n))).collect();
        let timeout = self.timeout;
        let mut results = Vec::with_capacity(urls.len());
        for chunk in urls.chunks(PARALLEL) {
            std::thread::scope(|s| {
                let handles: Vec<_> = chunk
                    .iter()
                    .map(|(node, url)| s.spawn(move || (node.clone(), fetch(node, url, timeout))))
                    .collect();
                results.extend(handles.into_iter().filter_map(|h| h.join().ok()));
            });
        }
        let now_unix_ms = clock();
        for (node, r) in results {
            match r {
                Ok(doc) => {
                    self.errors.remove(&node);
                    self.reports.insert(
                        node,
                        Report {
                            doc,
                            received_unix_ms: now_unix_ms,
                        },
                    );
                }
                Err(e) => {
                    self.errors.insert(node, e);
                }
            }
        }
        now_unix_ms
    }
}

/// One node's document, checked: valid, and about the node it was asked for.
pub fn fetch(node: &str, url: &str, timeout: Duration) -> Result<NodeHarvest, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .build()
        .into();
    let text = agent
        .get(url)
        .call()
        .map_err(|e| format!("GET {url}: {e}"))?
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("GET {url}: {e}"))?;
    let doc = NodeHarvest::from_json(&text).map_err(|e| format!("{url}: {e}"))?;
    if doc.node != node {
        return Err(format!(
            "{url} describes node {:?}, not {node:?}: check --agent-url / --agents",
            doc.node
        ));
    }
    Ok(doc)
}

/// Reads an agents file: one `NODE URL` per line, `#` comments.
pub fn parse_agents_file(text: &str) -> Result<HashMap<String, String>, String> {
    let mut map = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut it = line.split_whitespace();
        match (it.next(), it.next(), it.next()) {
            (Some(n), Some(u), None) if u.starts_with("http://") => {
                map.insert(n.to_string(), u.to_string());
            }
            _ => {
                return Err(format!(
                    "line {}: {line:?} is not `NODE http://HOST:PORT/v1/harvest`",
                    i + 1
                ))
            }
        }
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_come_from_the_template_unless_a_node_is_listed() {
        let files =
            parse_agents_file("# agents\ngpu002 http://10.0.0.2:9401/v1/harvest\n\n").unwrap();
        let a = Agents::new(DEFAULT_URL, files, Duration::from_secs(1));
        assert_eq!(a.url("gpu001"), "http://gpu001:9401/v1/harvest");
        assert_eq!(a.url("gpu002"), "http://10.0.0.2:9401/v1/harvest");
        let e = parse_agents_file("gpu001 ftp://x\n").unwrap_err();
        assert!(e.contains("line 1"), "{e}");
    }

    #[test]
    fn an_unreachable_agent_keeps_the_last_document_and_records_why() {
        let mut a = Agents::new(
            "http://127.0.0.1:9/{node}",
            HashMap::new(),
            Duration::from_millis(300),
        );
        a.reports.insert(
            "n1".into(),
            Report {
                doc: crate::testutil::doc("n1", 1, 0.1, 1 << 30),
                received_unix_ms: 5,
            },
        );
        assert_eq!(a.refresh(&["n1".into(), "n2".into()], &|| 1000), 1000);
        assert_eq!(a.reports["n1"].received_unix_ms, 5, "kept, aging");
        assert!(!a.reports.contains_key("n2"));
        assert!(
            a.errors["n2"].contains("GET http://127.0.0.1:9/n2"),
            "{:?}",
            a.errors
        );
    }
}
