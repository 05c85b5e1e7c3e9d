/* Tests libvalve_timeslice.so's decision with synthetic RM structs (no driver needed). */
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>

#include "valve_timeslice.h"

static int passed, failed;
static void expect(const char *what, int ok) {
  if (ok) {
    passed++;
  } else {
    failed++;
    printf("FAIL %s\n", what);
  }
}

struct nvos64 { unsigned h_root, h_parent, h_new, h_class; unsigned long long p_params, p_rights; unsigned size, flags, status, pad; };
struct nvos21 { unsigned h_root, h_parent, h_new, h_class; unsigned long long p_params; unsigned size, status; };

int main(void) {
  uint64_t us = 200;
  struct valve_nvos54 ctl;
  struct nvos64 tsg = {0xc1d00002, 0x5c000001, 0x5c000010, 0xa06c, 0, 0, 0, 0, 0, 0};
  int yes = valve_timeslice_control(_IOWR('F', 0x2B, struct nvos64), &tsg, VALVE_CMD_SET_TIMESLICE, &us, &ctl);
  expect("a TSG alloc (NVOS64) is answered with a control", yes);
  expect("the control names the TSG's client and handle", ctl.h_client == 0xc1d00002 && ctl.h_object == 0x5c000010);
  expect("the control is SET_TIMESLICE with 8 bytes of params",
         ctl.cmd == 0xa06c0103u && ctl.params_size == 8 && ctl.p_params == (unsigned long long)(size_t)&us);
  struct nvos21 tsg21 = {0xc1d00003, 0x5c000001, 0x5c000011, 0xa06c, 0, 0, 0};
  expect("a TSG alloc (NVOS21) too",
         valve_timeslice_control(_IOWR('F', 0x2B, struct nvos21), &tsg21, VALVE_CMD_GET_TIMESLICE, &us, &ctl)
             && ctl.h_object == 0x5c000011 && ctl.cmd == 0xa06c0104u);
  tsg.status = 0x1f;
  expect("a failed alloc is left alone",
         !valve_timeslice_control(_IOWR('F', 0x2B, struct nvos64), &tsg, VALVE_CMD_SET_TIMESLICE, &us, &ctl));
  tsg.status = 0;
  tsg.h_class = 0xc86f;
  expect("a channel alloc is left alone",
         !valve_timeslice_control(_IOWR('F', 0x2B, struct nvos64), &tsg, VALVE_CMD_SET_TIMESLICE, &us, &ctl));
  tsg.h_class = 0xa06c;
  expect("a control is left alone",
         !valve_timeslice_control(_IOWR('F', 0x2A, struct nvos64), &tsg, VALVE_CMD_SET_TIMESLICE, &us, &ctl));
  expect("another ioctl type is left alone",
         !valve_timeslice_control(_IOWR('T', 0x2B, struct nvos64), &tsg, VALVE_CMD_SET_TIMESLICE, &us, &ctl));
  expect("an odd size is left alone",
         !valve_timeslice_control(_IOWR('F', 0x2B, int), &tsg, VALVE_CMD_SET_TIMESLICE, &us, &ctl));
  expect("200 parses", valve_timeslice_us("200") == 200);
  expect("0, -5, 2x, empty, 11 s and NULL do not",
         !valve_timeslice_us("0") && !valve_timeslice_us("-5") && !valve_timeslice_us("2x") &&
             !valve_timeslice_us("") && !valve_timeslice_us("11000000") && !valve_timeslice_us(NULL));
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
