//! `valve-memprobe e2e --soak-reclaims N`: many reclaims of one size, with offline and online
//! clients SIGKILLed in turn between them; after each kill the pool must hold what the
//! survivors hold, no more (a leaked handle is memory no client can ever get back).

use anyhow::Result;
use serde_json::{json, Value};

use crate::child::{nvml_used, Child};
use crate::e2e::{cycles, wait_until, Daemon, E2eArgs, HANDLE_MIB};

/// The pool's books on GPU 0: (handles, free, online, offline).
fn books(d: &Daemon) -> Result<(u64, u64, u64, u64)> {
    let s = d.status()?;
    let g = &s["gpus"][0];
    let n = |k: &str| g[k].as_u64().unwrap_or(u64::MAX);
    Ok((n("handles"), n("free"), n("online"), n("offline")))
}

/// A fresh offline child holding `--offline-gib` of the pool, its step loop running, with its
/// answer to `start`.
pub fn spawn_offline(a: &E2eArgs, d: &Daemon) -> Result<(Child, Value)> {
    let args = [
        "--ptx".into(),
        a.ptx.display().to_string(),
        "--pool".into(),
        d.pool.display().to_string(),
        "--gib".into(),
        a.offline_gib.to_string(),
        "--kernel-ms".into(),
        a.kernel_ms.to_string(),
    ];
    let c = Child::spawn("e2e-offline", &args)?;
    let started = c.call(json!({"op": "start"}), &[])?;
    Ok((c, started))
}

/// A fresh online child.
pub fn spawn_online(a: &E2eArgs, d: &Daemon) -> Result<Child> {
    let args = [
        "--ptx".into(),
        a.ptx.display().to_string(),
        "--pool".into(),
        d.pool.display().to_string(),
    ];
    Child::spawn("e2e-online", &args)
}

/// Kills one client (SIGKILL, by dropping it) and checks that the pool takes back exactly what
/// it held: the handle total unchanged, the dead role's count back to 0 within 5 s. Returns a
/// leak's description, if any.
fn kill_and_check(d: &Daemon, victim: Child, role: &str, at: usize) -> Result<Option<Value>> {
    let (total, ..) = books(d)?;
    drop(victim);
    let back = wait_until(&format!("the killed {role}'s handles back"), 5, || {
        books(d).is_ok_and(|(_, _, on, off)| if role == "online" { on == 0 } else { off == 0 })
    });
    let (after, free, on, off) = books(d)?;
    if back && after <= total && free + on + off == after {
        return Ok(None);
    }
    Ok(Some(
        json!({"reclaim": at, "killed": role, "handles_before": total,
        "handles_after": after, "free": free, "online": on, "offline": off}),
    ))
}

/// The soak; returns the (new) clients for the checks that follow, and its record.
pub fn run(
    a: &E2eArgs,
    d: &Daemon,
    offline: Child,
    online: Child,
) -> Result<(Child, Child, Value)> {
    let (mut offline, mut online) = (offline, online);
    if a.soak_reclaims == 0 {
        return Ok((offline, online, json!({"reclaims": 0, "leaks": []})));
    }
    let k = (a.soak_mib / HANDLE_MIB).max(1);
    let every = a.soak_kill_every.max(1);
    let used_before = nvml_used();
    let reclaimed_before = d.status()?["reclaims"]["reclaims"].as_u64().unwrap_or(0);
    let (mut leaks, mut kills) = (Vec::new(), [0usize; 2]);
    let started = std::time::Instant::now();
    let mut done = 0;
    while done < a.soak_reclaims {
        let n = every.min(a.soak_reclaims - done);
        cycles(&online, &offline, k, n - 1)?;
        done += n;
        let turn = (done / every) % 2;
        let leak = if turn == 0 {
            let l = kill_and_check(d, offline, "offline", done)?;
            offline = spawn_offline(a, d)?.0;
            l
        } else {
            let l = kill_and_check(d, online, "online", done)?;
            online = spawn_online(a, d)?;
            l
        };
        kills[turn] += 1;
        leaks.extend(leak);
    }
    let reclaims = d.status()?["reclaims"]["reclaims"].as_u64().unwrap_or(0) - reclaimed_before;
    let used_after = nvml_used();
    println!(
        "  soak: {done} grows of {} MiB ({reclaims} reclaims counted by the pool), {} offline and {} online kills, {} leaks, {:.0} s",
        k * HANDLE_MIB, kills[0], kills[1], leaks.len(), started.elapsed().as_secs_f64()
    );
    let rec = json!({"grows": done, "reclaim_mib": k * HANDLE_MIB, "reclaims": reclaims,
        "offline_kills": kills[0], "online_kills": kills[1], "leaks": leaks,
        "nvml_used_before": used_before, "nvml_used_after": used_after,
        "secs": started.elapsed().as_secs_f64()});
    Ok((offline, online, rec))
}
