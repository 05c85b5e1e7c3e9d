//! What the gate's end-to-end tests share: an offline process on the in-memory RM, and waiting
//! for what the gate thread does.

use std::time::{Duration, Instant};

use valve::fake::FakeRm;
use valve::state::DisabledRecord;
use valve_ioctl_bindings::{ChannelHandle, ClientHandle};

/// Whether `f` holds within 3 s (checked every millisecond).
pub fn wait_until(mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// An offline process `pid` with 20 channels under RM client `client` on `rm`'s first GPU, as
/// the gate is told of it.
pub fn offline_process(rm: &FakeRm, pid: u32, client: u32) -> DisabledRecord {
    let channels: Vec<u32> = (0..20).map(|i| 0x5c00_0000 + i).collect();
    rm.add_channels(
        ClientHandle(client),
        0,
        &channels
            .iter()
            .map(|&c| ChannelHandle(c))
            .collect::<Vec<_>>(),
    );
    DisabledRecord {
        pid,
        device_instance: 0,
        client,
        channels,
    }
}
