//! libbpf's own messages (why a load or an attach failed: a symbol it could not resolve, what the
//! kernel refused) go to `tracing` under the target `libbpf`, so the daemon's log has them.

use std::sync::Once;

use libbpf_rs::PrintLevel;

/// Routes libbpf's warnings and notes to `tracing`; the first call does it, later ones nothing.
/// Called before every skeleton is opened.
pub(crate) fn route_to_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        libbpf_rs::set_print(Some((PrintLevel::Debug, forward)));
    });
}

fn forward(level: PrintLevel, msg: String) {
    let msg = msg.trim_end();
    match level {
        PrintLevel::Warn => tracing::warn!(target: "libbpf", "{msg}"),
        PrintLevel::Info => tracing::info!(target: "libbpf", "{msg}"),
        PrintLevel::Debug => tracing::debug!(target: "libbpf", "{msg}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_installs_a_callback_once() {
        route_to_tracing();
        route_to_tracing();
        let (level, cb) = libbpf_rs::get_print().expect("a callback is installed");
        assert!(matches!(level, PrintLevel::Debug));
        assert_eq!(cb as usize, forward as fn(PrintLevel, String) as usize);
    }
}
