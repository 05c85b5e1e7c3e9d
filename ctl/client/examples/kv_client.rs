//! A KV client for trying the pool on a GPU host: registers, makes a KV space, grows it, holds
//! it (offline: with synthetic block owners, printing what reclaims invalidate), then gives it
//! back. Prints one JSON object per line. No kernels: it maps and reports.
//!
//! ```text
//! cargo run --release -p valve-client --example kv_client -- \
//!     --socket /run/valve/pool.sock --role offline --gpu 0 --regions 2 --block-kib 2048 \
//!     --grow 16 --hold-secs 30
//! ```
//! Start one offline, then an online one with `--grow` larger than what is free, and watch the
//! offline one print `invalidated` lines as the daemon reclaims from it.
//!
//! The main thread has the GPU's primary CUDA context current, as a framework's would;
//! `--no-context` leaves it out, to learn whether the VMM calls need one (the library's callback
//! thread, which maps on reclaim and on `pool_handles`, never has one).

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valve_client::{Client, Options, Role, Selection, Stats};

struct Args {
    socket: String,
    role: Role,
    gpu: String,
    regions: u32,
    block_bytes: u64,
    capacity_bytes: u64,
    grow: u32,
    hold: Duration,
    context: bool,
    options: Options,
}

const USAGE: &str = "usage: kv_client [--socket PATH] [--role online|offline] [--gpu ID] \
[--regions N] [--block-kib K] [--capacity-mib M (per region; 0: the pool)] [--grow N] \
[--hold-secs S] [--no-premap] [--fifo] [--cuda-ordinal N] [--no-context]";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        socket: valve_client::DEFAULT_SOCKET.into(),
        role: Role::Offline,
        gpu: "0".into(),
        regions: 2,
        block_bytes: 2 << 20,
        capacity_bytes: 0,
        grow: 4,
        hold: Duration::from_secs(10),
        context: true,
        options: Options::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        let num = |v: String| v.parse::<u64>().map_err(|e| format!("{v}: {e}"));
        match flag.as_str() {
            "--socket" => a.socket = value()?,
            "--role" => a.role = value()?.parse().map_err(|e| format!("{e}"))?,
            "--gpu" => a.gpu = value()?,
            "--regions" => a.regions = num(value()?)? as u32,
            "--block-kib" => a.block_bytes = num(value()?)? << 10,
            "--capacity-mib" => a.capacity_bytes = num(value()?)? << 20,
            "--grow" => a.grow = num(value()?)? as u32,
            "--hold-secs" => a.hold = Duration::from_secs(num(value()?)?),
            "--no-premap" => a.options.premap = false,
            "--no-context" => a.context = false,
            "--fifo" => a.options.selection = Selection::Fifo,
            "--cuda-ordinal" => a.options.cuda_ordinal = Some(num(value()?)? as u32),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    Ok(a)
}

fn stats_json(s: &Stats) -> Value {
    json!({"held_slots": s.held_slots, "mapped_slots": s.mapped_slots,
        "quarantined_slots": s.quarantined_slots, "pending_invalidated": s.pending_invalidated,
        "requests": s.requests, "reclaims": s.reclaims, "reclaimed_handles": s.reclaimed_handles,
        "invalidated_blocks": s.invalidated_blocks, "pool_handle_events": s.pool_handle_events,
        "unmappable_handles": s.unmappable_handles, "callback_errors": s.callback_errors,
        "daemon_closed": s.daemon_closed})
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Offline: request `s` owns the first block of slot `s` and costs `(s % 7 + 1) * 100` tokens,
/// so Algorithm 1 has costs to compare.
fn synthetic_owners(c: &Client, slots: &[u32]) -> Result<(), valve_client::Error> {
    let per_slot = c.space().map_or(1, |s| s.blocks_per_slot);
    for &s in slots {
        c.set_block_owner(s * per_slot, s as u64, (s as u64 % 7 + 1) * 100)?;
    }
    Ok(())
}

fn run(a: Args) -> Result<(), valve_client::Error> {
    let ordinal = a.options.cuda_ordinal.or(a.gpu.parse().ok()).unwrap_or(0);
    // Without the driver there is no context to make (kv_space then names the problem).
    let _context = match a.context && valve_vmm::driver_present() {
        true => Some(
            cudarc::driver::CudaContext::new(ordinal as usize).map_err(|e| {
                valve_client::Error::Invalid(format!(
                    "creating a CUDA context on GPU {ordinal}: {e}"
                ))
            })?,
        ),
        false => None,
    };
    let t = Instant::now();
    let mut c = Client::connect_with(&a.socket, a.role, &a.gpu, a.options.clone())?;
    let r = c.registration().clone();
    println!(
        "{}",
        json!({"event": "registered", "client": r.client, "handle_bytes": r.handle_bytes,
        "gpu_index": r.gpu_index, "pool_capacity_handles": r.pool_capacity_handles, "ms": ms(t)})
    );
    let t = Instant::now();
    let s = c.kv_space(a.regions, a.capacity_bytes, a.block_bytes)?;
    println!(
        "{}",
        json!({"event": "kv_space", "regions": s.regions, "slots": s.slots,
        "piece_bytes": s.piece_bytes, "blocks_per_slot": s.blocks_per_slot,
        "region_ptrs": s.region_ptrs.iter().map(|p| format!("{p:#x}")).collect::<Vec<_>>(),
        "ms": ms(t), "stats": stats_json(&c.stats())})
    );
    let t = Instant::now();
    let slots = c.grow(a.grow)?;
    println!(
        "{}",
        json!({"event": "grow", "slots": slots, "ms": ms(t), "stats": stats_json(&c.stats())})
    );
    if a.role == Role::Offline {
        synthetic_owners(&c, &slots)?;
    }
    let end = Instant::now() + a.hold;
    let mut last = Instant::now();
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        let blocks = c.take_invalidated();
        if !blocks.is_empty() {
            println!(
                "{}",
                json!({"event": "invalidated", "blocks": blocks.len(),
                "first": blocks.first(), "stats": stats_json(&c.stats())})
            );
        }
        if a.role == Role::Online && last.elapsed() >= Duration::from_secs(1) {
            let used = c.stats().held_slots as u64 * r.handle_bytes / 2;
            let target = c.usage(used)?;
            println!(
                "{}",
                json!({"event": "usage", "used_bytes": used, "target_handles": target})
            );
            last = Instant::now();
        }
    }
    let t = Instant::now();
    c.shrink(&slots)?;
    println!(
        "{}",
        json!({"event": "shrink", "slots": slots.len(), "ms": ms(t), "stats": stats_json(&c.stats())})
    );
    let t = Instant::now();
    drop(c);
    println!("{}", json!({"event": "closed", "ms": ms(t)}));
    Ok(())
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args) {
        println!(
            "{}",
            json!({"event": "error", "code": e.code(), "error": e.to_string()})
        );
        std::process::exit(1);
    }
}
