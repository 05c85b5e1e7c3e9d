//! Tests of the client against the mock daemon (`crate::mock`), with a fake GPU: the protocol,
//! the bookkeeping of both roles, reclaim with Algorithm 1, errors, and the C ABI.

mod c_abi;
mod errors;
mod protocol;
mod reclaim;

use std::time::{Duration, Instant};

use crate::mock::{Config, Mock};
use crate::{Backend, Client, FakeGpu, Options, Role, Selection};

/// A client of `mock` on a fake GPU.
fn client(mock: &Mock, role: Role, options: Options) -> (Client, FakeGpu) {
    let fake = FakeGpu::new();
    let options = Options {
        backend: Backend::Fake(fake.clone()),
        ..options
    };
    (
        Client::connect_with(&mock.path, role, "0", options).unwrap(),
        fake,
    )
}

/// An offline client with a KV space of 2 regions and 1 MiB blocks (8 MiB handles: 4 MiB
/// pieces, 4 blocks per slot, one slot per pool handle).
fn offline(mock: &Mock, selection: Selection) -> (Client, FakeGpu, u64) {
    let (mut c, fake) = client(
        mock,
        Role::Offline,
        Options {
            selection,
            ..Options::default()
        },
    );
    c.kv_space(2, 0, 1 << 20).unwrap();
    let id = *mock.clients("offline").last().unwrap();
    (c, fake, id)
}

fn mock() -> Mock {
    Mock::start(Config::default())
}

/// Waits (bounded) until `f` holds; the tests assert on state, never on time.
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}
