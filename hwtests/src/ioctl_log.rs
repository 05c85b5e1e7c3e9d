//! Parses the LD_PRELOAD ioctl logger's lines into one process's RM object tree (client, devices
//! with their RM instance, TSGs, channels, compute objects). Stand-in until eBPF discovery lands.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use valve_ioctl_bindings::{
    ChannelHandle, ClientHandle, TsgHandle, CHANNEL_GPFIFO_CLASSES, COMPUTE_CLASSES,
    KEPLER_CHANNEL_GROUP_A, NV01_DEVICE_0, NV01_ROOT_CLIENT,
};

#[derive(Clone, Debug)]
struct Object {
    parent: u32,
    class: u32,
    extra: Option<u32>,
}

/// A TSG and its channels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tsg {
    /// The TSG handle.
    pub handle: TsgHandle,
    /// Its channels, in allocation order, with whether each has a compute object.
    pub channels: Vec<(ChannelHandle, bool)>,
}

/// One GPU's objects of the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuObjects {
    /// RM device instance.
    pub device_instance: u32,
    /// TSGs in allocation order.
    pub tsgs: Vec<Tsg>,
    /// Channels allocated directly under the device (no TSG).
    pub loose_channels: Vec<ChannelHandle>,
}

impl GpuObjects {
    /// Every channel.
    pub fn all_channels(&self) -> Vec<ChannelHandle> {
        let mut v: Vec<ChannelHandle> = self
            .tsgs
            .iter()
            .flat_map(|t| t.channels.iter().map(|c| c.0))
            .collect();
        v.extend(&self.loose_channels);
        v
    }

    /// The TSG whose channels carry compute objects (the most of them; ties: the larger TSG).
    pub fn compute_tsg(&self) -> Option<&Tsg> {
        self.tsgs
            .iter()
            .max_by_key(|t| (t.channels.iter().filter(|c| c.1).count(), t.channels.len()))
    }
}

/// A process's live RM objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessObjects {
    /// The live root client.
    pub client: ClientHandle,
    /// Per GPU with at least one channel.
    pub gpus: Vec<GpuObjects>,
}

/// Per client: handle -> object.
type Clients = HashMap<u32, HashMap<u32, Object>>;

/// Builds the tree of process `pid` from logger text.
pub fn parse(text: &str, pid: u32) -> Result<ProcessObjects> {
    let clients = live_objects(text, pid)?;
    let mut best: Option<ProcessObjects> = None;
    for (client, objs) in &clients {
        let cand = ProcessObjects {
            client: ClientHandle(*client),
            gpus: gpus_of(objs),
        };
        let count =
            |p: &ProcessObjects| p.gpus.iter().map(|g| g.all_channels().len()).sum::<usize>();
        if best.as_ref().is_none_or(|b| count(&cand) > count(b)) {
            best = Some(cand);
        }
    }
    match best {
        Some(p) if !p.gpus.is_empty() => Ok(p),
        _ => bail!("process {pid} has no live GPU channels in the ioctl log"),
    }
}

/// The RM objects of `pid` that are still alive at the end of the log, per client (freed
/// objects, everything below them, and freed clients are gone).
fn live_objects(text: &str, pid: u32) -> Result<Clients> {
    let mut clients: Clients = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let hex = |i: usize| -> Result<u32> {
            let s = f
                .get(i)
                .with_context(|| format!("line {}: too few fields: {line}", n + 1))?;
            u32::from_str_radix(s, 16).with_context(|| format!("line {}: bad hex '{s}'", n + 1))
        };
        match f.first() {
            Some(&"alloc") if hex(1)? == pid => {
                let (root, parent, new, class) = (hex(2)?, hex(3)?, hex(4)?, hex(5)?);
                let extra = f.get(6).and_then(|s| u32::from_str_radix(s, 16).ok());
                if class == NV01_ROOT_CLIENT {
                    clients.insert(new, HashMap::new());
                } else if let Some(objs) = clients.get_mut(&root) {
                    objs.insert(
                        new,
                        Object {
                            parent,
                            class,
                            extra,
                        },
                    );
                }
            }
            Some(&"free") if hex(1)? == pid => {
                let (root, object) = (hex(2)?, hex(4)?);
                if object == root {
                    clients.remove(&root);
                } else if let Some(objs) = clients.get_mut(&root) {
                    // Remove the object and everything below it.
                    let mut doomed = vec![object];
                    while let Some(h) = doomed.pop() {
                        objs.remove(&h);
                        doomed.extend(objs.iter().filter(|(_, o)| o.parent == h).map(|(k, _)| *k));
                    }
                }
            }
            // Another process's lines, and duplicated objects (not part of the tree built here).
            Some(&"alloc") | Some(&"free") | Some(&"dup") | Some(&"ctrl") => {}
            _ if line.trim().is_empty() => {}
            _ => bail!("line {}: not a logger line: {line}", n + 1),
        }
    }
    Ok(clients)
}

/// One client's channels per GPU (RM device instance), grouped into their TSGs, with whether
/// each has a compute object; GPUs in instance order.
fn gpus_of(objs: &HashMap<u32, Object>) -> Vec<GpuObjects> {
    let is_channel = |c: u32| CHANNEL_GPFIFO_CLASSES.contains(&c);
    let device_of = |mut h: u32| -> Option<u32> {
        for _ in 0..8 {
            let o = objs.get(&h)?;
            if o.class == NV01_DEVICE_0 {
                return o.extra;
            }
            h = o.parent;
        }
        None
    };
    let mut handles: Vec<&u32> = objs.keys().collect();
    handles.sort();
    let mut gpus: Vec<GpuObjects> = Vec::new();
    for &h in handles {
        let o = &objs[&h];
        if !is_channel(o.class) {
            continue;
        }
        let Some(inst) = device_of(h) else { continue };
        let has_compute = objs
            .values()
            .any(|c| c.parent == h && COMPUTE_CLASSES.contains(&c.class));
        let gpu = match gpus.iter_mut().position(|g| g.device_instance == inst) {
            Some(i) => &mut gpus[i],
            None => {
                gpus.push(GpuObjects {
                    device_instance: inst,
                    tsgs: vec![],
                    loose_channels: vec![],
                });
                gpus.last_mut().expect("pushed")
            }
        };
        let parent_is_tsg = objs
            .get(&o.parent)
            .is_some_and(|p| p.class == KEPLER_CHANNEL_GROUP_A);
        if parent_is_tsg {
            match gpu.tsgs.iter_mut().find(|t| t.handle.0 == o.parent) {
                Some(t) => t.channels.push((ChannelHandle(h), has_compute)),
                None => gpu.tsgs.push(Tsg {
                    handle: TsgHandle(o.parent),
                    channels: vec![(ChannelHandle(h), has_compute)],
                }),
            }
        } else {
            gpu.loose_channels.push(ChannelHandle(h));
        }
    }
    gpus.sort_by_key(|g| g.device_instance);
    gpus
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CUDA-13-like log: a first client freed at once, then the live one with one device per
    /// visible GPU, 4 TSGs (8/4/4/4 channels) on instance 1, compute objects on the 8.
    fn cuda_like_log(pid: u32) -> String {
        let mut s = format!("alloc {pid:x} 0 0 c1d00001 41 -\nfree {pid:x} c1d00001 0 c1d00001\n");
        s += &format!("alloc {pid:x} 0 0 c1d00002 41 -\n");
        s += &format!("alloc {pid:x} c1d00002 c1d00002 5c000001 80 0\n");
        s += &format!("alloc {pid:x} c1d00002 c1d00002 5c000002 80 1\n");
        s += &format!("alloc {pid:x} c1d00002 5c000002 5c000003 2080 0\n");
        let mut h = 0x5c00_0010u32;
        for (t, n) in [8, 4, 4, 4].iter().enumerate() {
            let tsg = 0x5c00_0100 + t as u32;
            s += &format!("alloc {pid:x} c1d00002 5c000002 {tsg:x} a06c -\n");
            for _ in 0..*n {
                s += &format!("alloc {pid:x} c1d00002 {tsg:x} {h:x} c86f -\n");
                if t == 0 {
                    s += &format!("alloc {pid:x} c1d00002 {h:x} {:x} cbc0 -\n", h + 0x1000);
                }
                h += 1;
            }
        }
        s
    }

    #[test]
    fn cuda_like_tree() {
        let mut log = cuda_like_log(0x1234);
        // Another process with the same object handles must not leak in.
        log += &cuda_like_log(0x999).replace("c1d0000", "c1d0009");
        let p = parse(&log, 0x1234).unwrap();
        assert_eq!(p.client, ClientHandle(0xc1d0_0002));
        assert_eq!(p.gpus.len(), 1);
        let g = &p.gpus[0];
        assert_eq!(g.device_instance, 1);
        assert_eq!(g.all_channels().len(), 20);
        assert_eq!(g.tsgs.len(), 4);
        let c = g.compute_tsg().unwrap();
        assert_eq!(c.channels.len(), 8);
        assert!(c.channels.iter().all(|ch| ch.1));
    }

    #[test]
    fn frees_remove_subtrees_and_no_channels_is_an_error() {
        let mut log = cuda_like_log(7);
        log += "free 7 c1d00002 5c000002 5c000100\n"; // the 8-channel TSG
        let p = parse(&log, 7).unwrap();
        assert_eq!(p.gpus[0].all_channels().len(), 12);
        log += "free 7 c1d00002 0 c1d00002\n";
        let err = parse(&log, 7).unwrap_err().to_string();
        assert!(err.contains("no live GPU channels"), "{err}");
        assert!(parse("garbage line\n", 7).is_err());
        let with_dup = cuda_like_log(7) + "dup 7 c1d00002 5c000002 5c000300 c1d00009 5c000042\n";
        assert_eq!(
            parse(&with_dup, 7).unwrap().gpus[0].all_channels().len(),
            20
        );
    }
}
