/* The decision of libvalve_timeslice.so, apart from the interposer so the CPU self-test can call it. */
#ifndef VALVE_TIMESLICE_H
#define VALVE_TIMESLICE_H
#include <stddef.h>
#include <stdint.h>

/* NVOS54_PARAMETERS (RM_CONTROL), as ioctl-bindings' Nvos54Control: 32 bytes. */
struct valve_nvos54 {
  uint32_t h_client, h_object, cmd, flags;
  uint64_t p_params;
  uint32_t params_size, status;
};

#define VALVE_ESC_RM_ALLOC 0x2B
#define VALVE_ESC_RM_CONTROL 0x2A
#define VALVE_CLASS_TSG 0xa06cu                 /* KEPLER_CHANNEL_GROUP_A: a channel group (TSG) */
#define VALVE_CMD_SET_TIMESLICE 0xa06c0103u     /* NVA06C_CTRL_CMD_SET_TIMESLICE (non-privileged) */
#define VALVE_CMD_GET_TIMESLICE 0xa06c0104u     /* NVA06C_CTRL_CMD_GET_TIMESLICE */

/* If `request` with `arg` (after the call) was a successful RM_ALLOC of a TSG, fills `ctl` with the
 * RM_CONTROL that sets its timeslice (`cmd`; `params` points at a u64 of microseconds) and
 * returns 1; else 0. */
int valve_timeslice_control(unsigned long request, const void *arg, uint32_t cmd, uint64_t *params,
                            struct valve_nvos54 *ctl);

/* Parses VALVE_TSG_TIMESLICE_US: a whole number of microseconds, 1 to 10 s; 0 for anything else. */
uint64_t valve_timeslice_us(const char *text);
#endif
