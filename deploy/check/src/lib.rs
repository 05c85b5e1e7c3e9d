//! Nothing to link: this crate's tests (`tests/manifests.rs`) check `deploy/` — the Kubernetes
//! manifests, the ConfigMap's daemon config and the Grafana dashboard — in `cargo test`.
