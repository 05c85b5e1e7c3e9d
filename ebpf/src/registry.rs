//! Folds [`RmEvent`]s into per-process RM object trees (client -> device -> subdevices, TSGs ->
//! channels -> compute objects) and answers which (client, channel) pairs a process has per GPU.
//!
//! Objects are keyed by (pid, client handle) and then by object handle: object handles are
//! chosen by the process and repeat across processes. Only the classes Valve needs are kept;
//! memory and other objects are ignored (a free of one is a no-op).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use valve_ioctl_bindings::{
    ChannelHandle, ClientHandle, DeviceHandle, ObjectHandle, SubdeviceHandle, TsgHandle,
    CHANNEL_GPFIFO_CLASSES, COMPUTE_CLASSES, KEPLER_CHANNEL_GROUP_A, NV01_DEVICE_0,
    NV01_ROOT_CLIENT, NV20_SUBDEVICE_0,
};

use crate::event::{AllocEvent, FreeEvent, RmEvent, RmEventKind};

/// True for the root-client classes: `NV01_ROOT` (0x0), `NV01_ROOT_NON_PRIV` (0x1) and
/// `NV01_ROOT_CLIENT` (0x41). The handle RM assigns comes back in `hObjectNew`.
pub fn is_root_client_class(class: u32) -> bool {
    matches!(class, 0x0000 | 0x0001 | NV01_ROOT_CLIENT)
}

/// True for the GPFIFO channel classes (Volta and later; later generations that keep the
/// `0x..6F` numbering are recognised too).
pub fn is_channel_class(class: u32) -> bool {
    CHANNEL_GPFIFO_CLASSES.contains(&class)
        || (class & 0xff == 0x6f && (0xc36f..=0xffff).contains(&class))
}

/// True for the compute engine classes (Volta and later, same rule as [`is_channel_class`]).
pub fn is_compute_class(class: u32) -> bool {
    COMPUTE_CLASSES.contains(&class) || (class & 0xff == 0xc0 && (0xc3c0..=0xffff).contains(&class))
}

/// What a tracked object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectKind {
    /// `NV01_DEVICE_0` directly under the client; `instance` is the RM device instance
    /// (`deviceId` of the alloc params), if it could be read.
    Device {
        /// RM device instance.
        instance: Option<u32>,
    },
    /// `NV20_SUBDEVICE_0` under a device.
    Subdevice {
        /// `subDeviceId` of the alloc params.
        id: Option<u32>,
    },
    /// `KEPLER_CHANNEL_GROUP_A` under a device.
    Tsg,
    /// A GPFIFO channel under a TSG or directly under a device.
    Channel {
        /// Channel class.
        class: u32,
    },
    /// Any object allocated under a channel (compute, copy engine, ...).
    EngineObject {
        /// Its class; see [`is_compute_class`].
        class: u32,
    },
}

#[derive(Clone, Debug)]
struct Object {
    parent: u32,
    kind: ObjectKind,
}

#[derive(Clone, Debug, Default)]
struct Client {
    objects: BTreeMap<u32, Object>,
}

/// What [`Registry::apply`] did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A root client was created (or replaced a stale one with the same key).
    ClientAdded(ClientHandle),
    /// An object was added.
    ObjectAdded(ObjectKind),
    /// A client and all its objects were removed.
    ClientRemoved {
        /// Objects removed with it.
        objects: usize,
    },
    /// An object and its descendants were removed.
    ObjectsRemoved(usize),
    /// A process and all its clients were removed.
    ProcessRemoved {
        /// Clients removed.
        clients: usize,
    },
    /// Nothing changed.
    Ignored(IgnoreReason),
}

/// Why an event changed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IgnoreReason {
    /// The event names a client the registry does not know (created before the watcher
    /// started, or already freed).
    UnknownClient,
    /// The parent object is unknown (created before the watcher started, or of an ignored class).
    UnknownParent,
    /// The class is not one the registry keeps, or not under a parent of the expected kind.
    UntrackedClass,
    /// A free of an object the registry does not keep.
    UntrackedObject,
    /// Exit of a process without RM objects.
    UnknownProcess,
}

/// Counts of events that changed nothing, by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryStats {
    /// [`IgnoreReason::UnknownClient`].
    pub unknown_client: u64,
    /// [`IgnoreReason::UnknownParent`].
    pub unknown_parent: u64,
    /// [`IgnoreReason::UntrackedClass`] and [`IgnoreReason::UntrackedObject`].
    pub untracked: u64,
}

/// A channel and the objects allocated on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelView {
    /// Channel handle (within its client).
    pub handle: ChannelHandle,
    /// Channel class.
    pub class: u32,
    /// Objects under the channel as (handle, class).
    pub objects: Vec<(ObjectHandle, u32)>,
}

impl ChannelView {
    /// Whether a compute object was allocated on this channel.
    pub fn has_compute(&self) -> bool {
        self.objects.iter().any(|&(_, c)| is_compute_class(c))
    }
}

/// A TSG and its channels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TsgView {
    /// TSG handle (within its client).
    pub handle: TsgHandle,
    /// Its channels, by handle.
    pub channels: Vec<ChannelView>,
}

impl TsgView {
    /// Whether any channel of this TSG has a compute object.
    pub fn has_compute(&self) -> bool {
        self.channels.iter().any(ChannelView::has_compute)
    }
}

/// One device object of a process: a GPU as seen through one client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuView {
    /// RM device instance (`deviceId`), if known.
    pub device_instance: Option<u32>,
    /// The client the device object belongs to.
    pub client: ClientHandle,
    /// The device object.
    pub device: DeviceHandle,
    /// Subdevices as (handle, subDeviceId).
    pub subdevices: Vec<(SubdeviceHandle, Option<u32>)>,
    /// TSGs under the device, by handle.
    pub tsgs: Vec<TsgView>,
    /// Channels allocated directly under the device (no TSG).
    pub ungrouped_channels: Vec<ChannelView>,
}

impl GpuView {
    /// Every channel on this device object, in TSGs or not.
    pub fn channels(&self) -> impl Iterator<Item = &ChannelView> {
        self.tsgs
            .iter()
            .flat_map(|t| t.channels.iter())
            .chain(self.ungrouped_channels.iter())
    }
}

/// RM objects of every observed process.
#[derive(Clone, Debug, Default)]
pub struct Registry {
    clients: BTreeMap<(u32, ClientHandle), Client>,
    stats: RegistryStats,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Folds one event in.
    pub fn apply(&mut self, ev: &RmEvent) -> Applied {
        let applied = match &ev.kind {
            RmEventKind::Alloc(a) => self.alloc(ev.pid, a),
            RmEventKind::Free(f) => self.free(ev.pid, f),
            RmEventKind::Exit => self.exit(ev.pid),
        };
        match applied {
            Applied::Ignored(IgnoreReason::UnknownClient) => self.stats.unknown_client += 1,
            Applied::Ignored(IgnoreReason::UnknownParent) => self.stats.unknown_parent += 1,
            Applied::Ignored(IgnoreReason::UntrackedClass | IgnoreReason::UntrackedObject) => {
                self.stats.untracked += 1
            }
            _ => {}
        }
        applied
    }

    /// Counts of ignored events.
    pub fn stats(&self) -> RegistryStats {
        self.stats
    }

    /// The key of `client` for an event of `pid`: normally (pid, client). Client handles are
    /// unique on the node while they live, so a client used from another process (an inherited
    /// fd) is found under its owner.
    fn client_key(&self, pid: u32, client: ClientHandle) -> Option<(u32, ClientHandle)> {
        if self.clients.contains_key(&(pid, client)) {
            return Some((pid, client));
        }
        self.clients.keys().find(|k| k.1 == client).copied()
    }

    fn alloc(&mut self, pid: u32, a: &AllocEvent) -> Applied {
        if is_root_client_class(a.class) {
            let client = ClientHandle(a.object.0);
            self.clients.insert((pid, client), Client::default());
            return Applied::ClientAdded(client);
        }
        let Some(key) = self.client_key(pid, a.client) else {
            return Applied::Ignored(IgnoreReason::UnknownClient);
        };
        let client = self.clients.get_mut(&key).expect("key just found");
        let parent_kind = if a.parent.0 == key.1 .0 {
            None
        } else {
            match client.objects.get(&a.parent.0) {
                Some(o) => Some(o.kind),
                None => {
                    return Applied::Ignored(if is_interesting(a.class) {
                        IgnoreReason::UnknownParent
                    } else {
                        IgnoreReason::UntrackedClass
                    })
                }
            }
        };
        let kind = match (a.class, parent_kind) {
            (NV01_DEVICE_0, None) => ObjectKind::Device { instance: a.extra },
            (NV20_SUBDEVICE_0, Some(ObjectKind::Device { .. })) => {
                ObjectKind::Subdevice { id: a.extra }
            }
            (KEPLER_CHANNEL_GROUP_A, Some(ObjectKind::Device { .. })) => ObjectKind::Tsg,
            (c, Some(ObjectKind::Tsg | ObjectKind::Device { .. })) if is_channel_class(c) => {
                ObjectKind::Channel { class: c }
            }
            (c, Some(ObjectKind::Channel { .. })) => ObjectKind::EngineObject { class: c },
            _ => return Applied::Ignored(IgnoreReason::UntrackedClass),
        };
        client.objects.insert(
            a.object.0,
            Object {
                parent: a.parent.0,
                kind,
            },
        );
        Applied::ObjectAdded(kind)
    }

    fn free(&mut self, pid: u32, f: &FreeEvent) -> Applied {
        let Some(key) = self.client_key(pid, f.client) else {
            return Applied::Ignored(IgnoreReason::UnknownClient);
        };
        if f.object.0 == key.1 .0 {
            let c = self.clients.remove(&key).expect("key just found");
            return Applied::ClientRemoved {
                objects: c.objects.len(),
            };
        }
        let client = self.clients.get_mut(&key).expect("key just found");
        if client.objects.remove(&f.object.0).is_none() {
            return Applied::Ignored(IgnoreReason::UntrackedObject);
        }
        // Remove descendants level by level; trees are a few levels deep.
        let mut removed = 1;
        let mut frontier = vec![f.object.0];
        while !frontier.is_empty() {
            let children: Vec<u32> = client
                .objects
                .iter()
                .filter(|(_, o)| frontier.contains(&o.parent))
                .map(|(&h, _)| h)
                .collect();
            for h in &children {
                client.objects.remove(h);
            }
            removed += children.len();
            frontier = children;
        }
        Applied::ObjectsRemoved(removed)
    }

    fn exit(&mut self, pid: u32) -> Applied {
        let before = self.clients.len();
        self.clients.retain(|k, _| k.0 != pid);
        match before - self.clients.len() {
            0 => Applied::Ignored(IgnoreReason::UnknownProcess),
            n => Applied::ProcessRemoved { clients: n },
        }
    }

    /// Processes that have at least one live client, ascending.
    pub fn processes(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.clients.keys().map(|k| k.0).collect();
        v.dedup();
        v
    }

    /// Live clients of `pid`.
    pub fn clients(&self, pid: u32) -> Vec<ClientHandle> {
        self.clients
            .range((pid, ClientHandle(0))..=(pid, ClientHandle(u32::MAX)))
            .map(|(k, _)| k.1)
            .collect()
    }

    /// Every device object of `pid` (one per client and GPU), ordered by device instance.
    pub fn gpus(&self, pid: u32) -> Vec<GpuView> {
        let mut out = Vec::new();
        for ((_, client), c) in self
            .clients
            .range((pid, ClientHandle(0))..=(pid, ClientHandle(u32::MAX)))
        {
            for (&h, o) in &c.objects {
                if let ObjectKind::Device { instance } = o.kind {
                    out.push(c.gpu_view(*client, h, instance));
                }
            }
        }
        out.sort_by_key(|g| (g.device_instance, g.client, g.device));
        out
    }

    /// The device objects of `pid` on RM device instance `instance`.
    pub fn gpu(&self, pid: u32, instance: u32) -> Vec<GpuView> {
        self.gpus(pid)
            .into_iter()
            .filter(|g| g.device_instance == Some(instance))
            .collect()
    }

    /// Every (client, channel) pair of `pid` on device instance `instance`: the lists that
    /// FIFO_DISABLE_CHANNELS takes.
    pub fn channels(&self, pid: u32, instance: u32) -> Vec<(ClientHandle, ChannelHandle)> {
        self.gpu(pid, instance)
            .iter()
            .flat_map(|g| g.channels().map(move |ch| (g.client, ch.handle)))
            .collect()
    }

    /// A human-readable dump of every process (for tools and logs).
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for pid in self.processes() {
            let clients: Vec<String> = self.clients(pid).iter().map(|c| c.to_string()).collect();
            let _ = writeln!(s, "pid {pid}: clients {}", clients.join(" "));
            for g in self.gpus(pid) {
                let inst = g.device_instance.map_or("?".into(), |i| i.to_string());
                let _ = writeln!(
                    s,
                    "  gpu instance {inst}: client {} device {} subdevices {} channels {}",
                    g.client,
                    g.device,
                    g.subdevices.len(),
                    g.channels().count()
                );
                for t in &g.tsgs {
                    let _ = writeln!(
                        s,
                        "    tsg {}: {} channels{}",
                        t.handle,
                        t.channels.len(),
                        if t.has_compute() { " (compute)" } else { "" }
                    );
                }
                if !g.ungrouped_channels.is_empty() {
                    let _ = writeln!(s, "    {} channels without TSG", g.ungrouped_channels.len());
                }
            }
        }
        s
    }
}

/// Classes whose unknown parent is worth counting as a lost event.
fn is_interesting(class: u32) -> bool {
    matches!(class, NV20_SUBDEVICE_0 | KEPLER_CHANNEL_GROUP_A)
        || is_channel_class(class)
        || is_compute_class(class)
}

impl Client {
    fn children(&self, parent: u32) -> impl Iterator<Item = (u32, ObjectKind)> + '_ {
        self.objects
            .iter()
            .filter(move |(_, o)| o.parent == parent)
            .map(|(&h, o)| (h, o.kind))
    }

    fn channel_view(&self, h: u32, class: u32) -> ChannelView {
        ChannelView {
            handle: ChannelHandle(h),
            class,
            objects: self
                .children(h)
                .filter_map(|(oh, k)| match k {
                    ObjectKind::EngineObject { class } => Some((ObjectHandle(oh), class)),
                    _ => None,
                })
                .collect(),
        }
    }

    fn gpu_view(&self, client: ClientHandle, dev: u32, instance: Option<u32>) -> GpuView {
        let mut g = GpuView {
            device_instance: instance,
            client,
            device: DeviceHandle(dev),
            subdevices: Vec::new(),
            tsgs: Vec::new(),
            ungrouped_channels: Vec::new(),
        };
        for (h, k) in self.children(dev) {
            match k {
                ObjectKind::Subdevice { id } => g.subdevices.push((SubdeviceHandle(h), id)),
                ObjectKind::Tsg => g.tsgs.push(TsgView {
                    handle: TsgHandle(h),
                    channels: self
                        .children(h)
                        .filter_map(|(ch, k)| match k {
                            ObjectKind::Channel { class } => Some(self.channel_view(ch, class)),
                            _ => None,
                        })
                        .collect(),
                }),
                ObjectKind::Channel { class } => {
                    g.ungrouped_channels.push(self.channel_view(h, class))
                }
                _ => {}
            }
        }
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use valve_ioctl_bindings::{HOPPER_CHANNEL_GPFIFO_A, HOPPER_COMPUTE_A, HOPPER_DMA_COPY_A};

    /// Builds CUDA-13-like event sequences.
    struct Proc {
        pid: u32,
        next: u32,
        events: Vec<RmEvent>,
    }

    impl Proc {
        fn new(pid: u32) -> Proc {
            Proc {
                pid,
                next: 0x5c00_0000,
                events: Vec::new(),
            }
        }
        fn push(&mut self, kind: RmEventKind) {
            self.events.push(RmEvent {
                ts_ns: self.events.len() as u64,
                pid: self.pid,
                tid: self.pid + 1,
                kind,
            });
        }
        fn alloc(&mut self, client: u32, parent: u32, class: u32, extra: Option<u32>) -> u32 {
            self.next += 1;
            let h = self.next;
            self.alloc_h(client, parent, h, class, extra);
            h
        }
        fn alloc_h(&mut self, client: u32, parent: u32, h: u32, class: u32, extra: Option<u32>) {
            self.push(RmEventKind::Alloc(AllocEvent {
                client: ClientHandle(client),
                parent: ObjectHandle(parent),
                object: ObjectHandle(h),
                class,
                extra,
                minor: 255,
                nvos64: true,
            }));
        }
        fn client(&mut self, h: u32) {
            self.alloc_h(0, 0, h, NV01_ROOT_CLIENT, None);
        }
        fn free(&mut self, client: u32, parent: u32, object: u32) {
            self.push(RmEventKind::Free(FreeEvent {
                client: ClientHandle(client),
                parent: ObjectHandle(parent),
                object: ObjectHandle(object),
                minor: 255,
            }));
        }
        /// What a CUDA 13 process does with `gpus` visible GPUs, using GPU `used`:
        /// throw-away client, live client, a device (+subdevice) per GPU, on `used`
        /// 4 TSGs with 8/4/4/4 channels and compute (and copy) objects on the 8.
        fn cuda13(pid: u32, first_client: u32, live: u32, gpus: &[u32], used: u32) -> Proc {
            let mut p = Proc::new(pid);
            p.client(first_client);
            p.free(first_client, first_client, first_client);
            p.client(live);
            let mut used_dev = 0;
            for &inst in gpus {
                let dev = p.alloc(live, live, NV01_DEVICE_0, Some(inst));
                p.alloc(live, dev, NV20_SUBDEVICE_0, Some(0));
                if inst == used {
                    used_dev = dev;
                }
            }
            for (t, n) in [8, 4, 4, 4].into_iter().enumerate() {
                let tsg = p.alloc(live, used_dev, KEPLER_CHANNEL_GROUP_A, None);
                for _ in 0..n {
                    let ch = p.alloc(live, tsg, HOPPER_CHANNEL_GPFIFO_A, None);
                    if t == 0 {
                        p.alloc(live, ch, HOPPER_COMPUTE_A, None);
                        p.alloc(live, ch, HOPPER_DMA_COPY_A, None);
                    }
                }
                // some memory object under the device: ignored.
                p.alloc(live, used_dev, 0x003e, None);
            }
            p
        }
    }

    fn apply_all(r: &mut Registry, evs: &[RmEvent]) {
        for e in evs {
            r.apply(e);
        }
    }

    const C1: u32 = 0xc1d0_0001;
    const C2: u32 = 0xc1d0_0002;
    const C3: u32 = 0xc1d0_0003;
    const C4: u32 = 0xc1d0_0004;

    #[test]
    fn cuda13_process_shape() {
        let p = Proc::cuda13(100, C1, C2, &[0, 1, 2, 3], 2);
        let mut r = Registry::new();
        apply_all(&mut r, &p.events);
        assert_eq!(r.processes(), vec![100]);
        assert_eq!(r.clients(100), vec![ClientHandle(C2)], "first client freed");
        let gpus = r.gpus(100);
        assert_eq!(gpus.len(), 4, "one device per visible GPU");
        assert_eq!(
            gpus.iter().map(|g| g.device_instance).collect::<Vec<_>>(),
            vec![Some(0), Some(1), Some(2), Some(3)]
        );
        assert!(gpus.iter().all(|g| g.subdevices.len() == 1));
        let used = r.gpu(100, 2);
        assert_eq!(used.len(), 1);
        let g = &used[0];
        assert_eq!(g.client, ClientHandle(C2));
        let sizes: Vec<usize> = g.tsgs.iter().map(|t| t.channels.len()).collect();
        assert_eq!(sizes, vec![8, 4, 4, 4]);
        let compute: Vec<bool> = g.tsgs.iter().map(TsgView::has_compute).collect();
        assert_eq!(compute, vec![true, false, false, false]);
        assert!(g.tsgs[0].channels.iter().all(|c| c.objects.len() == 2));
        assert!(g.ungrouped_channels.is_empty());
        let chans = r.channels(100, 2);
        assert_eq!(chans.len(), 20);
        assert!(chans.iter().all(|(c, _)| *c == ClientHandle(C2)));
        assert!(r.channels(100, 0).is_empty());
        assert_eq!(r.stats().unknown_parent, 0);
        assert_eq!(r.stats().unknown_client, 0);
        assert_eq!(r.stats().untracked, 4, "memory objects");
        assert!(r.summary().contains("tsg 0x5c0000"));
    }

    #[test]
    fn identical_object_handles_in_two_processes_stay_apart() {
        let a = Proc::cuda13(100, C1, C2, &[0, 1], 0);
        let b = Proc::cuda13(200, C3, C4, &[0, 1], 1);
        let mut r = Registry::new();
        // Interleave the two streams.
        for (x, y) in a.events.iter().zip(b.events.iter()) {
            r.apply(x);
            r.apply(y);
        }
        assert_eq!(r.processes(), vec![100, 200]);
        assert_eq!(r.channels(100, 0).len(), 20);
        assert_eq!(r.channels(200, 1).len(), 20);
        assert!(r.channels(100, 1).is_empty());
        let ha: Vec<u32> = r.channels(100, 0).iter().map(|c| c.1 .0).collect();
        let hb: Vec<u32> = r.channels(200, 1).iter().map(|c| c.1 .0).collect();
        assert_eq!(ha, hb, "same object handles");
        assert!(r
            .channels(200, 1)
            .iter()
            .all(|(c, _)| *c == ClientHandle(C4)));

        // Exit of one leaves the other intact.
        assert_eq!(
            r.apply(&RmEvent {
                ts_ns: 0,
                pid: 100,
                tid: 100,
                kind: RmEventKind::Exit
            }),
            Applied::ProcessRemoved { clients: 1 }
        );
        assert_eq!(r.processes(), vec![200]);
        assert_eq!(r.channels(200, 1).len(), 20);
        assert!(r.gpus(100).is_empty());
    }

    #[test]
    fn frees_remove_descendants() {
        let mut p = Proc::cuda13(7, C1, C2, &[0], 0);
        let mut r = Registry::new();
        apply_all(&mut r, &p.events);
        let g = r.gpu(7, 0).remove(0);
        let big = g.tsgs[0].handle.0;
        let small = g.tsgs[1].handle.0;
        let one_chan = g.tsgs[2].channels[0].handle.0;
        let compute = g.tsgs[0].channels[0].objects[0].0 .0;
        p.events.clear();
        p.free(C2, g.tsgs[0].channels[0].handle.0, compute);
        p.free(C2, g.tsgs[2].handle.0, one_chan);
        p.free(C2, g.device.0, small);
        apply_all(&mut r, &p.events);
        let g = r.gpu(7, 0).remove(0);
        assert_eq!(g.tsgs.len(), 3);
        assert_eq!(g.tsgs[0].channels[0].objects.len(), 1, "copy object left");
        assert!(g.tsgs[0].has_compute(), "other channels keep compute");
        assert_eq!(g.tsgs[1].channels.len(), 3, "old third TSG lost one");
        assert_eq!(r.channels(7, 0).len(), 20 - 4 - 1);

        // Freeing the big TSG removes it, its 8 channels and their 15 objects.
        assert_eq!(
            r.apply(&free_ev(7, C2, g.device.0, big)),
            Applied::ObjectsRemoved(1 + 8 + 15)
        );
        // Freeing the device removes subdevice, 2 TSGs with 3+4 channels.
        assert_eq!(
            r.apply(&free_ev(7, C2, C2, g.device.0)),
            Applied::ObjectsRemoved(1 + 1 + 2 + 7)
        );
        assert!(r.gpus(7).is_empty());
        assert_eq!(r.clients(7), vec![ClientHandle(C2)]);
        // A free of an object that is not tracked changes nothing.
        assert_eq!(
            r.apply(&free_ev(7, C2, C2, 0x1234)),
            Applied::Ignored(IgnoreReason::UntrackedObject)
        );
        // Freeing the client removes the process.
        assert!(matches!(
            r.apply(&free_ev(7, C2, C2, C2)),
            Applied::ClientRemoved { .. }
        ));
        assert!(r.processes().is_empty());
    }

    fn free_ev(pid: u32, client: u32, parent: u32, object: u32) -> RmEvent {
        RmEvent {
            ts_ns: 0,
            pid,
            tid: pid,
            kind: RmEventKind::Free(FreeEvent {
                client: ClientHandle(client),
                parent: ObjectHandle(parent),
                object: ObjectHandle(object),
                minor: 255,
            }),
        }
    }

    #[test]
    fn freed_client_removes_everything_and_exit_removes_all_clients() {
        let mut p = Proc::cuda13(9, C1, C2, &[0, 1], 1);
        // A second live client in the same process with a channel without TSG.
        p.client(C3);
        let dev = p.alloc(C3, C3, NV01_DEVICE_0, Some(1));
        let ch = p.alloc(C3, dev, HOPPER_CHANNEL_GPFIFO_A, None);
        p.alloc(C3, ch, HOPPER_COMPUTE_A, None);
        let mut r = Registry::new();
        apply_all(&mut r, &p.events);
        assert_eq!(r.clients(9), vec![ClientHandle(C2), ClientHandle(C3)]);
        let on1 = r.gpu(9, 1);
        assert_eq!(on1.len(), 2, "two device objects on instance 1");
        assert_eq!(r.channels(9, 1).len(), 21);
        let g3 = on1.iter().find(|g| g.client == ClientHandle(C3)).unwrap();
        assert_eq!(g3.ungrouped_channels.len(), 1);
        assert!(g3.ungrouped_channels[0].has_compute());

        assert_eq!(
            r.apply(&free_ev(9, C2, C2, C2)),
            Applied::ClientRemoved {
                objects: 2 + 2 + 4 + 20 + 16
            }
        );
        assert_eq!(
            r.channels(9, 1),
            vec![(ClientHandle(C3), ChannelHandle(ch))]
        );
        assert_eq!(
            r.apply(&RmEvent {
                ts_ns: 0,
                pid: 9,
                tid: 9,
                kind: RmEventKind::Exit
            }),
            Applied::ProcessRemoved { clients: 1 }
        );
        assert!(r.processes().is_empty());
        assert_eq!(
            r.apply(&RmEvent {
                ts_ns: 0,
                pid: 9,
                tid: 9,
                kind: RmEventKind::Exit
            }),
            Applied::Ignored(IgnoreReason::UnknownProcess)
        );
    }

    #[test]
    fn unknown_clients_and_parents_are_counted_not_invented() {
        let mut p = Proc::new(5);
        p.alloc(C1, C1, NV01_DEVICE_0, Some(0)); // client never seen
        p.client(C2);
        p.alloc(C2, 0x5c00_9999, KEPLER_CHANNEL_GROUP_A, None); // parent never seen
        p.alloc(C2, C2, KEPLER_CHANNEL_GROUP_A, None); // TSG directly under the client
        let mut r = Registry::new();
        apply_all(&mut r, &p.events);
        let s = r.stats();
        assert_eq!((s.unknown_client, s.unknown_parent, s.untracked), (1, 1, 1));
        assert!(r.gpus(5).is_empty());
    }

    #[test]
    fn client_used_from_another_process_is_found_under_its_owner() {
        let mut p = Proc::new(1);
        p.client(C1);
        let mut r = Registry::new();
        apply_all(&mut r, &p.events);
        let mut q = Proc::new(2);
        q.alloc(C1, C1, NV01_DEVICE_0, Some(3));
        apply_all(&mut r, &q.events);
        assert_eq!(r.processes(), vec![1]);
        assert_eq!(r.gpus(1)[0].device_instance, Some(3));
    }

    #[test]
    fn class_predicates() {
        assert!(is_channel_class(HOPPER_CHANNEL_GPFIFO_A));
        assert!(is_channel_class(0xcb6f), "future generation");
        assert!(!is_channel_class(KEPLER_CHANNEL_GROUP_A));
        assert!(!is_channel_class(0xa06f), "pre-Volta not supported");
        assert!(is_compute_class(HOPPER_COMPUTE_A));
        assert!(is_root_client_class(0) && is_root_client_class(1) && is_root_client_class(0x41));
        assert!(!is_root_client_class(NV01_DEVICE_0));
        assert!(!is_compute_class(HOPPER_DMA_COPY_A));
    }
}
