//! Nothing to link: this crate's tests check `deploy/` in `cargo test`: `tests/manifests.rs` the
//! Kubernetes manifests, their daemon config and the Grafana dashboard; `tests/package.rs` the
//! Debian package's config, unit and maintainer scripts, and the image built from the package.
