//! In-memory RM for tests (this crate's, and others' through the `fake` feature) and for
//! `valvectl demo`: GPUs with chosen ids/instances/minors, other processes' channels, RM's answers.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use valve_ioctl_bindings::{
    self as b, CardInfo, ChannelHandle, ClientHandle, Nv0000GetAttachedIdsParams,
    Nv0000GetIdInfoV2Params, Nv0080AllocParams, Nv2080AllocParams, Nv2080FifoDisableChannelsParams,
    Nv2080GetGidInfoParams, Nv2080GetNameStringParams, Nv208fGetChannelStateParams, ObjectHandle,
    RmStatus,
};

use crate::driver::{AllocParams, ControlParams, RmCallError, RmDriver};
use crate::error::Error;

/// A GPU the fake driver exposes.
#[derive(Clone, Debug)]
pub struct FakeGpu {
    /// RM's GPU id (GET_ATTACHED_IDS).
    pub gpu_id: u32,
    /// RM device instance.
    pub instance: u32,
    /// Minor of its `/dev/nvidia<minor>`.
    pub minor: u32,
    /// PCI bus number.
    pub pci_bus: u8,
    /// Marketing name (GET_NAME_STRING).
    pub name: &'static str,
    /// UUID as `nvidia-smi` prints it.
    pub uuid: String,
}

/// What the fake driver has been asked so far, and what it will answer.
#[derive(Default)]
pub struct FakeState {
    next_client: u32,
    /// Valve's live root clients.
    pub clients: HashSet<ClientHandle>,
    /// (client, object) -> (class, device instance)
    objects: HashMap<(ClientHandle, ObjectHandle), (u32, u32)>,
    registered_minors: HashSet<u32>,
    /// Channels of "other processes": (client, channel) -> (instance, disabled)
    pub channels: HashMap<(ClientHandle, ChannelHandle), (u32, bool)>,
    /// Answer this status to the next disable on this device instance.
    pub fail_disable_on: Option<(u32, RmStatus)>,
    /// Every FIFO_DISABLE_CHANNELS seen: (instance, disable, entries).
    pub disable_calls: Vec<(u32, bool, usize)>,
    /// The name of the thread that issued each of those calls.
    pub disable_threads: Vec<Option<String>>,
    /// Channels a disable is accepted for but does not reach (RM says OK, the channel stays
    /// enabled): a freeze that did not take, for the freeze check's tests.
    pub ignore_disable: HashSet<(ClientHandle, ChannelHandle)>,
    /// Refuse diag objects (NV20_SUBDEVICE_DIAG), as a driver without them would.
    pub refuse_diag: bool,
    /// GET_CHANNEL_STATE calls answered.
    pub state_reads: usize,
}

/// The in-memory RM: an [`RmDriver`] over [`FakeGpu`]s.
pub struct FakeRm {
    /// Its GPUs, in attach order.
    pub gpus: Vec<FakeGpu>,
    /// Its state, for tests to read and to set failures in.
    pub state: Mutex<FakeState>,
}

impl FakeRm {
    /// A host with these GPUs and no clients or channels yet.
    pub fn new(gpus: Vec<FakeGpu>) -> Self {
        FakeRm {
            gpus,
            state: Mutex::new(FakeState {
                next_client: 0xc1d0_0001,
                ..Default::default()
            }),
        }
    }

    /// An H100-like host with `n` GPUs whose minors are NOT their instances and whose
    /// attach order is not PCI order.
    pub fn host(n: u32) -> Self {
        let gpus = (0..n)
            .map(|i| FakeGpu {
                gpu_id: 0x100 * (n - i),
                instance: i,
                // Minor != instance (seen on the 4-GPU hosts).
                minor: (i * 2) % n.max(1) + if n > 1 && i * 2 >= n { 1 } else { 0 },
                pci_bus: 0x18 + 0x11 * (n - 1 - i) as u8,
                name: "NVIDIA H100 80GB HBM3",
                uuid: format!("GPU-{:08x}-0000-0000-0000-000000000000", 0xabc0 + i),
            })
            .collect();
        Self::new(gpus)
    }

    /// Adds `n` channels (handles from `first` up) of another process's `client` on the first
    /// GPU, and returns them as disable targets (GPU index 0).
    pub fn process_on_first_gpu(
        &self,
        client: ClientHandle,
        first: u32,
        n: u32,
    ) -> Vec<crate::controller::ChannelTarget> {
        let chans: Vec<ChannelHandle> = (first..first + n).map(ChannelHandle).collect();
        self.add_channels(client, self.gpus[0].instance, &chans);
        chans
            .into_iter()
            .map(|channel| crate::controller::ChannelTarget {
                gpu: 0,
                client,
                channel,
            })
            .collect()
    }

    /// Adds channels of another process on device `instance`.
    pub fn add_channels(&self, client: ClientHandle, instance: u32, channels: &[ChannelHandle]) {
        let mut st = self.state.lock().unwrap();
        for &c in channels {
            st.channels.insert((client, c), (instance, false));
        }
    }

    /// Every (client, channel) disabled now, sorted.
    pub fn disabled(&self) -> Vec<(ClientHandle, ChannelHandle)> {
        let st = self.state.lock().unwrap();
        let mut v: Vec<_> = st
            .channels
            .iter()
            .filter(|(_, (_, d))| *d)
            .map(|(k, _)| *k)
            .collect();
        v.sort();
        v
    }

    fn gpu_by_instance(&self, inst: u32) -> Option<&FakeGpu> {
        self.gpus.iter().find(|g| g.instance == inst)
    }
}

fn downcast<T: 'static, P: Any>(p: &mut P) -> &mut T {
    (p as &mut dyn Any)
        .downcast_mut::<T>()
        .expect("params type matches its command")
}

impl RmDriver for FakeRm {
    fn alloc_root_client(&self) -> Result<ClientHandle, RmCallError> {
        let mut st = self.state.lock().unwrap();
        let c = ClientHandle(st.next_client);
        st.next_client += 1;
        st.clients.insert(c);
        Ok(c)
    }

    fn alloc<P: AllocParams>(
        &self,
        client: ClientHandle,
        parent: ObjectHandle,
        new: ObjectHandle,
        params: &mut P,
    ) -> Result<(), RmCallError> {
        let mut st = self.state.lock().unwrap();
        if !st.clients.contains(&client) {
            return Err(RmCallError::Rm(b::NV_ERR_INVALID_CLIENT));
        }
        if st.objects.contains_key(&(client, new)) {
            return Err(RmCallError::Rm(b::NV_ERR_INVALID_OBJECT_NEW));
        }
        let instance = match P::CLASS {
            b::NV01_DEVICE_0 => {
                let inst = downcast::<Nv0080AllocParams, P>(params).device_id;
                let gpu = self
                    .gpu_by_instance(inst)
                    .ok_or(RmCallError::Rm(b::NV_ERR_INVALID_ARGUMENT))?;
                if !st.registered_minors.contains(&gpu.minor) {
                    // The real driver refuses a device whose file was not registered.
                    return Err(RmCallError::Rm(b::NV_ERR_INVALID_ARGUMENT));
                }
                inst
            }
            b::NV20_SUBDEVICE_0 => {
                let _ = downcast::<Nv2080AllocParams, P>(params);
                st.objects
                    .get(&(client, parent))
                    .filter(|(class, _)| *class == b::NV01_DEVICE_0)
                    .ok_or(RmCallError::Rm(b::NV_ERR_INVALID_OBJECT_PARENT))?
                    .1
            }
            b::NV20_SUBDEVICE_DIAG => {
                if st.refuse_diag {
                    return Err(RmCallError::Rm(b::NV_ERR_INVALID_CLASS));
                }
                st.objects
                    .get(&(client, parent))
                    .filter(|(class, _)| *class == b::NV20_SUBDEVICE_0)
                    .ok_or(RmCallError::Rm(b::NV_ERR_INVALID_OBJECT_PARENT))?
                    .1
            }
            _ => return Err(RmCallError::Rm(b::NV_ERR_INVALID_CLASS)),
        };
        st.objects.insert((client, new), (P::CLASS, instance));
        Ok(())
    }

    fn control<P: ControlParams>(
        &self,
        client: ClientHandle,
        object: ObjectHandle,
        params: &mut P,
    ) -> Result<(), RmCallError> {
        let mut st = self.state.lock().unwrap();
        if !st.clients.contains(&client) {
            return Err(RmCallError::Rm(b::NV_ERR_INVALID_CLIENT));
        }
        match P::CMD {
            b::NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS => {
                let p = downcast::<Nv0000GetAttachedIdsParams, P>(params);
                for (i, g) in self.gpus.iter().enumerate() {
                    p.gpu_ids[i] = g.gpu_id;
                }
                Ok(())
            }
            b::NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 => {
                let p = downcast::<Nv0000GetIdInfoV2Params, P>(params);
                let g = self
                    .gpus
                    .iter()
                    .find(|g| g.gpu_id == p.gpu_id)
                    .ok_or(RmCallError::Rm(b::NV_ERR_INVALID_ARGUMENT))?;
                p.device_instance = g.instance;
                Ok(())
            }
            cmd => {
                let (class, inst) = *st
                    .objects
                    .get(&(client, object))
                    .ok_or(RmCallError::Rm(b::NV_ERR_INVALID_OBJECT_HANDLE))?;
                if class == b::NV20_SUBDEVICE_DIAG
                    && cmd == b::NV208F_CTRL_CMD_FIFO_GET_CHANNEL_STATE
                {
                    let p = downcast::<Nv208fGetChannelStateParams, P>(params);
                    let &(ci, disabled) = st
                        .channels
                        .get(&(p.client, p.channel))
                        .ok_or(RmCallError::Rm(b::NV_ERR_INVALID_CHANNEL))?;
                    if ci != inst {
                        return Err(RmCallError::Rm(b::NV_ERR_INVALID_CHANNEL));
                    }
                    p.enabled = u8::from(!disabled);
                    p.scheduled = 1;
                    st.state_reads += 1;
                    return Ok(());
                }
                if class != b::NV20_SUBDEVICE_0 {
                    return Err(RmCallError::Rm(b::NV_ERR_INVALID_COMMAND));
                }
                let gpu = self.gpu_by_instance(inst).expect("allocated above");
                match cmd {
                    b::NV2080_CTRL_CMD_GPU_GET_NAME_STRING => {
                        let p = downcast::<Nv2080GetNameStringParams, P>(params);
                        p.name[..gpu.name.len()].copy_from_slice(gpu.name.as_bytes());
                        Ok(())
                    }
                    b::NV2080_CTRL_CMD_GPU_GET_GID_INFO => {
                        let p = downcast::<Nv2080GetGidInfoParams, P>(params);
                        p.data[..gpu.uuid.len()].copy_from_slice(gpu.uuid.as_bytes());
                        p.length = gpu.uuid.len() as u32 + 1;
                        Ok(())
                    }
                    b::NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS => {
                        let p = downcast::<Nv2080FifoDisableChannelsParams, P>(params);
                        let n = p.num_channels as usize;
                        if n > b::FIFO_DISABLE_CHANNELS_MAX_ENTRIES
                            || p.p_runlist_preempt_event != 0
                        {
                            return Err(RmCallError::Rm(b::NV_ERR_INVALID_ARGUMENT));
                        }
                        st.disable_calls.push((inst, p.disable != 0, n));
                        st.disable_threads
                            .push(std::thread::current().name().map(str::to_string));
                        if let Some((fail_inst, status)) = st.fail_disable_on {
                            if fail_inst == inst && p.disable != 0 {
                                return Err(RmCallError::Rm(status));
                            }
                        }
                        for i in 0..n {
                            let key = (p.client_list[i], p.channel_list[i]);
                            match st.channels.get(&key) {
                                None if !st.channels.keys().any(|k| k.0 == key.0) => {
                                    return Err(RmCallError::Rm(b::NV_ERR_INVALID_CLIENT))
                                }
                                Some((ci, _)) if *ci == inst => {}
                                _ => return Err(RmCallError::Rm(b::NV_ERR_INVALID_CHANNEL)),
                            }
                        }
                        for i in 0..n {
                            let key = (p.client_list[i], p.channel_list[i]);
                            if p.disable != 0 && st.ignore_disable.contains(&key) {
                                continue;
                            }
                            st.channels.get_mut(&key).expect("checked").1 = p.disable != 0;
                        }
                        Ok(())
                    }
                    _ => Err(RmCallError::Rm(b::NV_ERR_NOT_SUPPORTED)),
                }
            }
        }
    }

    fn free(
        &self,
        client: ClientHandle,
        _parent: ObjectHandle,
        object: ObjectHandle,
    ) -> Result<(), RmCallError> {
        let mut st = self.state.lock().unwrap();
        if object.0 == client.0 {
            st.clients.remove(&client);
            st.objects.retain(|(c, _), _| *c != client);
            return Ok(());
        }
        st.objects
            .remove(&(client, object))
            .map(|_| ())
            .ok_or(RmCallError::Rm(b::NV_ERR_INVALID_OBJECT_HANDLE))
    }

    fn card_info(&self) -> Result<Vec<CardInfo>, RmCallError> {
        Ok(self
            .gpus
            .iter()
            .map(|g| CardInfo {
                valid: 1,
                pci_bus: g.pci_bus,
                pci_vendor_id: 0x10de,
                pci_device_id: 0x2330,
                gpu_id: g.gpu_id,
                minor_number: g.minor,
                ..Default::default()
            })
            .collect())
    }

    fn register_device_file(&self, minor: u32) -> Result<(), Error> {
        if !self.gpus.iter().any(|g| g.minor == minor) {
            return Err(Error::DriverMissing {
                path: format!("/dev/nvidia{minor}").into(),
            });
        }
        self.state.lock().unwrap().registered_minors.insert(minor);
        Ok(())
    }
}
