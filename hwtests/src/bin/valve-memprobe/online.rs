//! The online child: maps pool handles it is given into its own range and uses them at once
//! (fill, then check every word), as a KV cache growing into reclaimed memory would.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use crate::proto;
use crate::side::{us, Access, Side};

/// First use of slots `first..first+count`: write a value and read every word back.
fn first_use(side: &Side, first: usize, count: usize, v: u32) -> Result<Value> {
    let t = Instant::now();
    side.fill(first, count, v)?;
    let bad = side.count_ne(first, count, v)?;
    if bad != 0 {
        bail!("{bad} words of the new memory did not read back what online wrote");
    }
    Ok(json!({"use_us": us(t)}))
}

fn handle(
    side: &mut Side,
    m: &Value,
    fds: &[std::os::fd::OwnedFd],
    round: &mut u32,
) -> Result<Value> {
    let first = m["first"].as_u64().unwrap_or(0) as usize;
    let count = m["count"].as_u64().unwrap_or(0) as usize;
    let access = Access::parse(m["access"].as_str().unwrap_or(""));
    *round = round.wrapping_add(1);
    match m["op"].as_str().unwrap_or("") {
        // Map (and, unless "map_only", use at once).
        "map" => {
            let mut v = side.map_fds(first, fds, access)?;
            if m["map_only"] != true {
                v["use_us"] =
                    first_use(side, first, fds.len(), 0xA000_0000 | *round)?["use_us"].clone();
            }
            Ok(v)
        }
        // The pool says slots it had premapped here are online's now (nothing to do on the GPU).
        "grant" => Ok(json!({})),
        "use" => first_use(side, first, count, 0xB000_0000 | *round),
        "unmap" => {
            let t = Instant::now();
            for s in first..first + count {
                side.va.unmap(s * side.slot)?;
            }
            Ok(json!({"unmap_us": us(t)}))
        }
        op => bail!("unknown op {op}"),
    }
}

/// Runs the online child on `sock` until the parent closes it.
pub fn run(sock: UnixStream, ptx: &Path, slot: usize, slots: usize) -> Result<()> {
    let mut side = Side::new(ptx, slot, slots)?;
    let mut round = 0u32;
    while let Some((m, fds)) = proto::recv(&sock)? {
        let reply = handle(&mut side, &m, &fds, &mut round)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        proto::send(&sock, &reply, &[])?;
    }
    Ok(())
}
