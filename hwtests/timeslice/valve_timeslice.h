/* The decisions of libvalve_timeslice.so, apart from the interposer so the CPU self-test can call them. */
#ifndef VALVE_TIMESLICE_H
#define VALVE_TIMESLICE_H
#include <stddef.h>
#include <stdint.h>

#include "../ioctl-logger/rm_abi.h"

/* A successful RM_ALLOC, as the interposer sees it after the call. */
struct valve_alloc {
  uint32_t client, parent, object, cls;
};

#define VALVE_CLASS_TSG 0xa06cu                 /* KEPLER_CHANNEL_GROUP_A: a channel group (TSG) */
#define VALVE_CMD_SET_TIMESLICE 0xa06c0103u     /* NVA06C_CTRL_CMD_SET_TIMESLICE (non-privileged) */
#define VALVE_CMD_GET_TIMESLICE 0xa06c0104u     /* NVA06C_CTRL_CMD_GET_TIMESLICE */
#define VALVE_PENDING_MAX 64                    /* TSGs whose first SET_TIMESLICE RM refused, retried */
#define VALVE_TRIES_MAX 4                       /* ... at their next few child allocations */

/* Whether `request` with `arg` is an RM_ALLOC (NVOS21 or NVOS64); if so, fills `out` and its status
 * (read before the call too: the handles and class are the caller's). */
int valve_rm_alloc_args(unsigned long request, const void *arg, struct valve_alloc *out, uint32_t *status);
/* Whether `request` with `arg` (after the call) was a successful RM_ALLOC; if so, fills `out`. */
int valve_rm_alloc(unsigned long request, const void *arg, struct valve_alloc *out);

/* The RM_CONTROL `cmd` on channel group `object` of `client`; `params` points at a u64 of us. */
void valve_tsg_control(struct nvos54 *ctl, uint32_t client, uint32_t object, uint32_t cmd,
                       uint64_t *params);

/* TSGs to set again: one RM refused at their allocation (it may want the group populated first). */
struct valve_pending {
  struct { uint32_t client, tsg; int tries; } at[VALVE_PENDING_MAX];
  int n;
};
/* Remembers a TSG (no room: forgotten, returns 0). */
int valve_pending_add(struct valve_pending *p, uint32_t client, uint32_t tsg);
/* The index of the pending TSG that `a` was allocated under, or -1. */
int valve_pending_find(const struct valve_pending *p, const struct valve_alloc *a);
/* After a try at index `i`: forgotten when it took, or after VALVE_TRIES_MAX tries. */
void valve_pending_after_try(struct valve_pending *p, int i, int took);

/* Parses VALVE_TSG_TIMESLICE_US: a whole number of microseconds, 1 to 10 s; 0 for anything else. */
uint64_t valve_timeslice_us(const char *text);

/* The compute preemption mode of the job's own GR contexts (docs/gate.md, candidate 7): read back
 * after each compute object, and set first where VALVE_COMPUTE_PREEMPT names a mode. Both controls
 * are on the subdevice and exported RMCTRL_FLAGS_NON_PRIVILEGED (flags 0x48 and 0x10348 in
 * g_subdevice_nvoc.c, 595.45.04); both are routed to GSP. */
#define VALVE_CLASS_SUBDEVICE 0x2080u                 /* NV20_SUBDEVICE_0 */
#define VALVE_CMD_GET_CTXSW_MODES 0x20801235u         /* NV2080_CTRL_CMD_GR_GET_CTXSW_MODES */
#define VALVE_CMD_SET_CTXSW_PREEMPTION_MODE 0x20801210u /* NV2080_CTRL_CMD_GR_SET_CTXSW_PREEMPTION_MODE */
#define VALVE_PREEMPT_FLAGS_CILP_SET 0x1u             /* ..._MODE_FLAGS_CILP_SET: set the compute mode */
#define VALVE_SUBDEVICES_MAX 16

struct valve_get_ctxsw_modes {                        /* NV2080_CTRL_GR_GET_CTXSW_MODES_PARAMS */
  uint32_t h_channel, zcull_mode, pm_mode, smpc_mode, cilp_preempt_mode, gfxp_preempt_mode;
};
struct valve_set_preemption_mode {                    /* NV2080_CTRL_GR_SET_CTXSW_PREEMPTION_MODE_PARAMS */
  uint32_t flags, h_channel, gfxp_preempt_mode, cilp_preempt_mode;
  uint32_t route_flags, route_pad;                    /* NV2080_CTRL_GR_ROUTE_INFO: 0 = the default GR */
  uint64_t route;
};
_Static_assert(sizeof(struct valve_get_ctxsw_modes) == 24, "GET_CTXSW_MODES_PARAMS");
_Static_assert(sizeof(struct valve_set_preemption_mode) == 32 &&
                   offsetof(struct valve_set_preemption_mode, route) == 24, "SET_CTXSW_PREEMPTION_MODE_PARAMS");

/* VALVE_COMPUTE_PREEMPT: "wfi", "cta" or "cilp" (the mode to set: 0, 1, 2), "report" (read only:
 * VALVE_PREEMPT_REPORT); VALVE_PREEMPT_OFF when unset or empty; VALVE_PREEMPT_BAD for anything else. */
#define VALVE_PREEMPT_REPORT 3
#define VALVE_PREEMPT_OFF (-1)
#define VALVE_PREEMPT_BAD (-2)
int valve_compute_preempt(const char *text);
/* "WFI", "CTA", "CILP", or "?" for a value RM should not return. */
const char *valve_compute_mode_name(uint32_t mode);
/* Whether `cls` is a compute engine class (VOLTA_COMPUTE_A 0xc3c0 and later: 0xXXc0): its parent
 * is a channel whose GR context now exists. */
int valve_is_compute_class(uint32_t cls);

/* Any RM_CONTROL: `params` of `size` bytes on `object` of `client`. */
void valve_control(struct nvos54 *ctl, uint32_t client, uint32_t object, uint32_t cmd, void *params,
                   uint32_t size);

/* The subdevice each RM client of the job allocated (its handle for the GR controls). */
struct valve_subdevices {
  struct { uint32_t client, subdevice; } at[VALVE_SUBDEVICES_MAX];
  int n;
};
/* Remembers the client's subdevice (the first one it allocated; no room: forgotten, returns 0). */
int valve_subdevice_add(struct valve_subdevices *s, uint32_t client, uint32_t subdevice);
/* The client's subdevice, or 0. */
uint32_t valve_subdevice_of(const struct valve_subdevices *s, uint32_t client);

/* Whether `cls` is a GPFIFO channel class (VOLTA_CHANNEL_GPFIFO_A 0xc36f and later: 0xXX6f): its
 * parent is the channel group (TSG) it runs in. */
int valve_is_gpfifo_class(uint32_t cls);
/* Each channel's TSG, for the GR controls' second try: RM on GSP answered NV_ERR_OBJECT_NOT_FOUND
 * (0x57) to a channel handle on the H100 (580.159.04), and RM's own GR routing takes a TSG handle
 * where a channel handle is not found (kgrmgrCtrlRouteKGRWithDevice, 580.95.05). */
#define VALVE_CHANNELS_MAX 256
#define VALVE_STATUS_OBJECT_NOT_FOUND 0x57u
struct valve_channels {
  struct { uint32_t client, channel, tsg; } at[VALVE_CHANNELS_MAX];
  int n;
};
/* Remembers a channel's TSG (no room: forgotten, returns 0). */
int valve_channel_add(struct valve_channels *c, uint32_t client, uint32_t channel, uint32_t tsg);
/* The channel's TSG, or 0. */
uint32_t valve_tsg_of(const struct valve_channels *c, uint32_t client, uint32_t channel);
#endif
