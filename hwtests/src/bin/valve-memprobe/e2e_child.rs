//! The end-to-end run's children: an offline job and an online server that get their KV memory
//! from the daemon's pool through `valve-client`, as a framework linked with it would.
//!
//! Offline streams over all of its KV space in long kernels from a step thread, tells the
//! library which request owns each block, collects invalidated blocks after every step and
//! refills at step boundaries. Online grows into offline's memory, writes and reads it, shrinks.

use std::collections::BTreeSet;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use valve_client::{Client, Role};

use crate::proto;
use crate::side::{us, Kernels};

const INITIAL: u32 = 11;
const BLOCK_BYTES: u64 = 2 << 20;

fn connect(pool: &Path, role: Role) -> Result<Client> {
    Client::connect(pool, role, "0").with_context(|| format!("connecting to {}", pool.display()))
}

/// Serves the parent's requests on `sock` with `handle` until the parent closes it.
fn serve(sock: &UnixStream, mut handle: impl FnMut(&Value) -> Result<Value>) -> Result<()> {
    while let Some((m, _)) = proto::recv(sock)? {
        let reply = handle(&m).unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        proto::send(sock, &reply, &[])?;
    }
    Ok(())
}

struct Steps {
    stop: Arc<AtomicBool>,
    /// Take back free pool memory at every step boundary (as a framework growing its cache).
    greedy: Arc<AtomicBool>,
    want: Arc<AtomicU64>,
    launches: Arc<AtomicU64>,
    thread: JoinHandle<Result<(BTreeSet<u32>, Vec<f64>)>>,
}

struct Offline {
    k: Arc<Kernels>,
    client: Arc<Mutex<Client>>,
    base: u64,
    slots: u32,
    slot_bytes: u64,
    blocks_per_slot: u32,
    passes: u32,
    steps: Option<Steps>,
}

impl Offline {
    fn open(ptx: &Path, pool: &Path, gib: u64) -> Result<Offline> {
        // The context first: the library reserves and maps in this process's primary context.
        let k = Arc::new(Kernels::new(ptx)?);
        let mut client = connect(pool, Role::Offline)?;
        let space = client.kv_space(1, gib << 30, BLOCK_BYTES)?;
        let got = client.grow(space.slots)?;
        if got.len() != space.slots as usize {
            bail!("offline got {} of {} slots", got.len(), space.slots);
        }
        // Eight blocks per request, with varied costs, so Algorithm 1 has choices.
        for b in 0..space.blocks() {
            let req = u64::from(b / 8);
            client.set_block_owner(b, req, 1000 + (req % 7) * 300)?;
        }
        Ok(Offline {
            k,
            base: space.region_ptrs[0],
            slots: space.slots,
            slot_bytes: space.piece_bytes,
            blocks_per_slot: space.blocks_per_slot,
            client: Arc::new(Mutex::new(client)),
            passes: 1,
            steps: None,
        })
    }

    fn words(&self) -> u64 {
        u64::from(self.slots) * self.slot_bytes / 4
    }

    fn start(&mut self, kernel_ms: f64) -> Result<Value> {
        self.k.fill_at(self.base, self.words(), INITIAL)?;
        let stream = self.k.ctx.new_stream()?;
        let t = Instant::now();
        self.k.stream_add_at(&stream, self.base, self.words(), 2)?;
        stream.synchronize()?;
        let per_pass = t.elapsed().as_secs_f64() * 1e3 / 2.0;
        self.passes = ((kernel_ms / per_pass).round() as u32).max(1);
        self.steps = Some(self.spawn_steps()?);
        Ok(json!({"pid": std::process::id(), "slots": self.slots, "passes": self.passes}))
    }
}

impl Offline {
    /// The step loop: refill at the boundary if asked, one long kernel, wait, collect the
    /// blocks a reclaim invalidated (their slots are never checked at the end).
    fn spawn_steps(&self) -> Result<Steps> {
        let (k, client) = (self.k.clone(), self.client.clone());
        let (base, words, passes, bps) =
            (self.base, self.words(), self.passes, self.blocks_per_slot);
        let stop = Arc::new(AtomicBool::new(false));
        let greedy = Arc::new(AtomicBool::new(false));
        let g2 = greedy.clone();
        let slots = self.slots;
        let want = Arc::new(AtomicU64::new(0));
        let launches = Arc::new(AtomicU64::new(0));
        let (s2, w2, l2) = (stop.clone(), want.clone(), launches.clone());
        let thread = std::thread::spawn(move || -> Result<(BTreeSet<u32>, Vec<f64>)> {
            k.ctx.bind_to_thread()?;
            let stream = k.ctx.new_stream()?;
            let (mut invalid, mut regrow_us) = (BTreeSet::new(), Vec::new());
            while !s2.load(Ordering::Relaxed) {
                let n = w2.load(Ordering::Acquire);
                if n > 0 {
                    let t = Instant::now();
                    client.lock().unwrap().grow(n as u32)?;
                    regrow_us.push(us(t));
                    w2.store(0, Ordering::Release);
                }
                if g2.load(Ordering::Relaxed) {
                    refill_free(&mut client.lock().unwrap(), slots);
                }
                k.stream_add_at(&stream, base, words, passes)?;
                stream.synchronize()?;
                l2.fetch_add(1, Ordering::Relaxed);
                for b in client.lock().unwrap().take_invalidated() {
                    invalid.insert(b / bps);
                }
            }
            Ok((invalid, regrow_us))
        });
        Ok(Steps {
            stop,
            greedy,
            want,
            launches,
            thread,
        })
    }

    /// Asks the step loop to take `n` handles back at its next boundary and waits for it.
    fn regrow(&self, n: u64) -> Result<Value> {
        let steps = self.steps.as_ref().context("not started")?;
        steps.want.store(n, Ordering::Release);
        let deadline = Instant::now() + Duration::from_secs(10);
        while steps.want.load(Ordering::Acquire) != 0 {
            if Instant::now() > deadline || steps.thread.is_finished() {
                bail!("the step loop did not refill (it stopped? see stop's error)");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(json!({"ok": true}))
    }

    fn stop(&mut self) -> Result<Value> {
        let steps = self.steps.take().context("not started")?;
        steps.stop.store(true, Ordering::Relaxed);
        let launches = steps.launches.load(Ordering::Relaxed);
        let joined = steps
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("step thread panicked"))?;
        let launches = launches.max(steps.launches.load(Ordering::Relaxed));
        let (invalid, regrow_us, error) = match joined {
            Ok((i, r)) => (i, r, None),
            Err(e) => (BTreeSet::new(), Vec::new(), Some(format!("{e:#}"))),
        };
        let expect = INITIAL
            .wrapping_add(2)
            .wrapping_add((launches as u32).wrapping_mul(self.passes));
        let (mut bad, mut checked) = (0u64, 0u32);
        if error.is_none() {
            for s in (0..self.slots).filter(|s| !invalid.contains(s)) {
                let p = self.base + u64::from(s) * self.slot_bytes;
                bad += self.k.count_ne_at(p, self.slot_bytes / 4, expect)?;
                checked += 1;
            }
        }
        let stats = format!("{:?}", self.client.lock().unwrap().stats());
        Ok(
            json!({"launches": launches, "passes": self.passes, "kernel_error": error,
                  "invalidated_slots": invalid.len(), "verified_slots": checked, "bad_words": bad,
                  "regrow_us": crate::child::summary_of(&regrow_us), "client_stats": stats}),
        )
    }
}

/// Grows one handle at a time into empty slots until the pool has none free.
fn refill_free(client: &mut Client, slots: u32) {
    let held = client.stats().held_slots;
    for _ in held..slots {
        if client.grow(1).is_err() {
            break;
        }
    }
}

/// The offline child: serves start / regrow / greedy / stop.
pub fn run_offline(
    sock: UnixStream,
    ptx: &Path,
    pool: &Path,
    gib: u64,
    kernel_ms: f64,
) -> Result<()> {
    let mut me = Offline::open(ptx, pool, gib)?;
    serve(&sock, |m| match m["op"].as_str().unwrap_or("") {
        "start" => me.start(kernel_ms),
        "regrow" => me.regrow(m["count"].as_u64().unwrap_or(0)),
        "greedy" => {
            let steps = me.steps.as_ref().context("not started")?;
            steps.greedy.store(true, Ordering::Relaxed);
            Ok(json!({"ok": true}))
        }
        "stop" => me.stop(),
        op => bail!("unknown op {op}"),
    })
}

struct Online {
    k: Kernels,
    client: Client,
    base: u64,
    slot_bytes: u64,
    held: Vec<u32>,
    round: u32,
}

impl Online {
    fn grow(&mut self, n: u32) -> Result<Value> {
        let t = Instant::now();
        let slots = self.client.grow(n)?;
        let grow_us = us(t);
        let got = slots.len();
        self.held.extend(slots);
        Ok(json!({"grow_us": grow_us, "got": got}))
    }

    /// Writes every word of every slot online holds, then reads them all back.
    fn use_all(&mut self) -> Result<Value> {
        self.round += 1;
        let v = 0xC000_0000 | self.round;
        let t = Instant::now();
        let mut bad = 0;
        for &s in &self.held {
            let p = self.base + u64::from(s) * self.slot_bytes;
            self.k.fill_at(p, self.slot_bytes / 4, v)?;
            bad += self.k.count_ne_at(p, self.slot_bytes / 4, v)?;
        }
        if bad > 0 {
            bail!("{bad} words online wrote did not read back");
        }
        Ok(json!({"use_us": us(t), "slots": self.held.len()}))
    }
}

/// A bursty KV demand, in handles: a base, plus bursts arriving as a Poisson process, each of
/// a random size held for a random time (long prompts arriving together).
struct Demand {
    rng: u64,
    base: u64,
    bursts: Vec<(Instant, u64)>,
    next: Instant,
    mean_gap_s: f64,
}

impl Demand {
    fn rand(&mut self) -> f64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    fn now(&mut self, t: Instant) -> u64 {
        while t >= self.next {
            let size = 2 + (self.rand() * 9.0) as u64;
            let hold = Duration::from_secs_f64(1.0 + 2.0 * self.rand());
            self.bursts.push((self.next + hold, size));
            let gap = -self.mean_gap_s * (1.0 - self.rand()).ln();
            self.next += Duration::from_secs_f64(gap);
        }
        self.bursts.retain(|(end, _)| *end > t);
        self.base + self.bursts.iter().map(|(_, s)| s).sum::<u64>()
    }
}

impl Online {
    /// Follows the demand for `secs`: with `miad`, holds what the daemon's reservation says
    /// (never less than the demand); without, exactly the demand. Every 10 ms.
    fn trace(&mut self, m: &Value) -> Result<Value> {
        let secs = m["secs"].as_f64().unwrap_or(60.0);
        let miad = m["miad"] == true;
        let start = Instant::now();
        let mut d = Demand {
            rng: m["seed"].as_u64().unwrap_or(7) | 1,
            base: m["base"].as_u64().unwrap_or(4),
            bursts: Vec::new(),
            next: start,
            mean_gap_s: m["mean_gap_s"].as_f64().unwrap_or(2.0),
        };
        let (mut grows, mut short, mut spare, mut ticks) = (Vec::new(), 0u64, 0u64, 0u64);
        let mut late_grows = 0u64; // in the second half, after the controller's warm-up
        while start.elapsed().as_secs_f64() < secs {
            let now = Instant::now();
            let need = d.now(now);
            let mut want = need;
            if miad {
                want = want.max(self.client.usage(need * self.slot_bytes)?);
            }
            let held = self.held.len() as u64;
            if want > held {
                let t = Instant::now();
                let got = self.client.grow((want - held) as u32)?;
                grows.push(us(t));
                late_grows += u64::from(start.elapsed().as_secs_f64() >= secs / 2.0);
                self.held.extend(got);
            } else if want < held {
                let give: Vec<u32> = self.held.split_off(want as usize);
                self.client.shrink(&give)?;
            }
            match (self.held.len() as u64).checked_sub(need) {
                Some(s) => spare += s,
                None => short += 1,
            }
            ticks += 1;
            std::thread::sleep(Duration::from_millis(10).saturating_sub(now.elapsed()));
        }
        let held = std::mem::take(&mut self.held);
        self.client.shrink(&held)?;
        Ok(
            json!({"grows": grows.len(), "grows_second_half": late_grows, "grow_us": crate::child::summary_of(&grows), "short_ticks": short,
                  "mean_spare_handles": spare as f64 / ticks.max(1) as f64, "secs": start.elapsed().as_secs_f64()}),
        )
    }
}

/// The online child: serves grow / use / shrink / trace.
pub fn run_online(sock: UnixStream, ptx: &Path, pool: &Path) -> Result<()> {
    let k = Kernels::new(ptx)?;
    let mut client = connect(pool, Role::Online)?;
    let space = client.kv_space(1, 0, BLOCK_BYTES)?;
    let (base, slot_bytes) = (space.region_ptrs[0], space.piece_bytes);
    let mut me = Online {
        k,
        client,
        base,
        slot_bytes,
        held: Vec::new(),
        round: 0,
    };
    serve(&sock, |m| match m["op"].as_str().unwrap_or("") {
        "grow" => me.grow(m["count"].as_u64().unwrap_or(0) as u32),
        "use" => me.use_all(),
        "trace" => me.trace(m),
        "shrink" => {
            let held = std::mem::take(&mut me.held);
            me.client.shrink(&held)?;
            Ok(json!({"released": held.len()}))
        }
        op => bail!("unknown op {op}"),
    })
}
