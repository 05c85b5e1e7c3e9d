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

/* Whether `request` with `arg` (after the call) was a successful RM_ALLOC (NVOS21 or NVOS64); if
 * so, fills `out`. */
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
#endif
