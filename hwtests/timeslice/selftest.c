/* Tests libvalve_timeslice.so's decisions with synthetic RM structs (no driver needed). */
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

static void allocs(void) {
  struct valve_alloc a;
  struct nvos64 tsg = {0xc1d00002, 0x5c000001, 0x5c000010, 0xa06c, 0, 0, 0, 0, 0, 0};
  expect("a TSG alloc (NVOS64) is read",
         valve_rm_alloc(_IOWR('F', 0x2B, struct nvos64), &tsg, &a) && a.client == 0xc1d00002 &&
             a.parent == 0x5c000001 && a.object == 0x5c000010 && a.cls == 0xa06c);
  struct nvos21 ch = {0xc1d00003, 0x5c000010, 0x5c000011, 0xc86f, 0, 0, 0};
  expect("a channel alloc (NVOS21) is read",
         valve_rm_alloc(_IOWR('F', 0x2B, struct nvos21), &ch, &a) && a.parent == 0x5c000010 && a.cls == 0xc86f);
  tsg.status = 0x1f;
  expect("a failed alloc is not", !valve_rm_alloc(_IOWR('F', 0x2B, struct nvos64), &tsg, &a));
  tsg.status = 0;
  expect("a control is not", !valve_rm_alloc(_IOWR('F', 0x2A, struct nvos64), &tsg, &a));
  expect("another ioctl type is not", !valve_rm_alloc(_IOWR('T', 0x2B, struct nvos64), &tsg, &a));
  expect("an odd size is not", !valve_rm_alloc(_IOWR('F', 0x2B, int), &tsg, &a));
  struct nvos64 compute = {0xc1d00002, 0x5c000011, 0x5c000012, 0xcbc0, 0, 0, 0, 0, 0, 0};
  uint32_t status = 7;
  expect("a compute alloc is read before the call (its status still unset by RM)",
         valve_rm_alloc_args(_IOWR('F', 0x2B, struct nvos64), &compute, &a, &status) && status == 0 &&
             a.parent == 0x5c000011 && valve_is_compute_class(a.cls));
  compute.status = 0x1f;
  expect("and its status given as it is",
         valve_rm_alloc_args(_IOWR('F', 0x2B, struct nvos64), &compute, &a, &status) && status == 0x1f);
}

static void controls(void) {
  uint64_t us = 200;
  struct nvos54 ctl;
  valve_tsg_control(&ctl, 0xc1d00002, 0x5c000010, VALVE_CMD_SET_TIMESLICE, &us);
  expect("the control names the TSG and is SET_TIMESLICE with 8 bytes",
         ctl.h_client == 0xc1d00002 && ctl.h_object == 0x5c000010 && ctl.cmd == 0xa06c0103u &&
             ctl.params_size == 8 && ctl.p_params == (unsigned long long)(size_t)&us && ctl.status == 0);
}

static void pending(void) {
  struct valve_pending p = {0};
  struct valve_alloc child = {0xc1d00002, 0x5c000010, 0x5c000020, 0x9067};
  expect("nothing pending at first", valve_pending_find(&p, &child) == -1);
  valve_pending_add(&p, 0xc1d00002, 0x5c000010);
  int i = valve_pending_find(&p, &child);
  expect("a child of a refused TSG is found", i == 0);
  struct valve_alloc other = {0xc1d00009, 0x5c000010, 0x5c000021, 0xc86f};
  expect("the same handle under another client is not", valve_pending_find(&p, &other) == -1);
  for (int t = 2; t < VALVE_TRIES_MAX; t++) valve_pending_after_try(&p, i, 0);
  expect("still pending before its last try", valve_pending_find(&p, &child) == 0);
  valve_pending_after_try(&p, i, 0);
  expect("forgotten after its last try", valve_pending_find(&p, &child) == -1);
  valve_pending_add(&p, 0xc1d00002, 0x5c000010);
  valve_pending_after_try(&p, valve_pending_find(&p, &child), 1);
  expect("forgotten once it took", p.n == 0);
  for (int k = 0; k < VALVE_PENDING_MAX; k++) valve_pending_add(&p, 1, (uint32_t)k);
  expect("no room beyond the cap", !valve_pending_add(&p, 1, 999) && p.n == VALVE_PENDING_MAX);
  valve_pending_after_try(&p, -1, 1);
  expect("a try at no index changes nothing", p.n == VALVE_PENDING_MAX);
}

static void preempt(void) {
  expect("report, wfi, cta and cilp parse",
         valve_compute_preempt("report") == VALVE_PREEMPT_REPORT && valve_compute_preempt("wfi") == 0 &&
             valve_compute_preempt("cta") == 1 && valve_compute_preempt("cilp") == 2);
  expect("unset or empty is off", valve_compute_preempt(NULL) == VALVE_PREEMPT_OFF &&
                                      valve_compute_preempt("") == VALVE_PREEMPT_OFF);
  expect("CILP, 2 and cilp2 are refused", valve_compute_preempt("CILP") == VALVE_PREEMPT_BAD &&
                                              valve_compute_preempt("2") == VALVE_PREEMPT_BAD &&
                                              valve_compute_preempt("cilp2") == VALVE_PREEMPT_BAD);
  expect("mode names", !strcmp(valve_compute_mode_name(0), "WFI") && !strcmp(valve_compute_mode_name(2), "CILP") &&
                           !strcmp(valve_compute_mode_name(7), "?"));
  expect("Volta to Blackwell compute classes are compute",
         valve_is_compute_class(0xc3c0) && valve_is_compute_class(0xc7c0) && valve_is_compute_class(0xcbc0) &&
             valve_is_compute_class(0xcdc0));
  expect("a TSG, a channel, a copy engine, a subdevice and Pascal compute are not",
         !valve_is_compute_class(0xa06c) && !valve_is_compute_class(0xc86f) && !valve_is_compute_class(0xc8b5) &&
             !valve_is_compute_class(0x2080) && !valve_is_compute_class(0xc1c0) && !valve_is_compute_class(0x1cbc0));

  struct valve_set_preemption_mode set = {.flags = VALVE_PREEMPT_FLAGS_CILP_SET, .h_channel = 0x5c000011,
                                          .cilp_preempt_mode = 2};
  struct nvos54 ctl;
  valve_control(&ctl, 0xc1d00002, 0x5c000003, VALVE_CMD_SET_CTXSW_PREEMPTION_MODE, &set, sizeof set);
  expect("the set goes to the subdevice with 32 bytes naming the channel",
         ctl.h_object == 0x5c000003 && ctl.cmd == 0x20801210u && ctl.params_size == 32 &&
             ctl.p_params == (unsigned long long)(size_t)&set);
  unsigned char *raw = (unsigned char *)&set;
  expect("flags, channel and compute mode at offsets 0, 4 and 12; the route zero",
         raw[0] == 1 && raw[4] == 0x11 && raw[7] == 0x5c && raw[12] == 2 && set.route == 0 && set.route_flags == 0);

  struct valve_subdevices subs = {0};
  expect("no subdevice at first", valve_subdevice_of(&subs, 0xc1d00002) == 0);
  valve_subdevice_add(&subs, 0xc1d00002, 0x5c000003);
  valve_subdevice_add(&subs, 0xc1d00002, 0x5c000099);
  valve_subdevice_add(&subs, 0xc1d00007, 0x5c000004);
  expect("each client keeps its first subdevice", valve_subdevice_of(&subs, 0xc1d00002) == 0x5c000003 &&
                                                      valve_subdevice_of(&subs, 0xc1d00007) == 0x5c000004 &&
                                                      subs.n == 2);
  for (uint32_t k = 0; k < VALVE_SUBDEVICES_MAX; k++) valve_subdevice_add(&subs, 100 + k, 1);
  expect("no room beyond the cap", !valve_subdevice_add(&subs, 999, 1) && subs.n == VALVE_SUBDEVICES_MAX);

  expect("Volta to Blackwell GPFIFO classes are channels",
         valve_is_gpfifo_class(0xc36f) && valve_is_gpfifo_class(0xc86f) && valve_is_gpfifo_class(0xca6f));
  expect("a TSG, compute, Pascal's GPFIFO and a wide class are not",
         !valve_is_gpfifo_class(0xa06c) && !valve_is_gpfifo_class(0xc8c0) && !valve_is_gpfifo_class(0xc06f) &&
             !valve_is_gpfifo_class(0x1c86f));
  struct valve_channels ch = {0};
  valve_channel_add(&ch, 0xc1d00002, 0x5c00002e, 0x5c00002a);
  valve_channel_add(&ch, 0xc1d00007, 0x5c00002e, 0x5c000030);
  expect("a channel's TSG, by client", valve_tsg_of(&ch, 0xc1d00002, 0x5c00002e) == 0x5c00002a &&
                                           valve_tsg_of(&ch, 0xc1d00007, 0x5c00002e) == 0x5c000030 &&
                                           valve_tsg_of(&ch, 0xc1d00002, 0x5c000031) == 0);
  valve_channel_add(&ch, 0xc1d00002, 0x5c00002e, 0x5c000040);
  expect("a reused handle answers its newest TSG", valve_tsg_of(&ch, 0xc1d00002, 0x5c00002e) == 0x5c000040);
  while (ch.n < VALVE_CHANNELS_MAX) valve_channel_add(&ch, 1, (uint32_t)ch.n, 2);
  expect("no room beyond the cap", !valve_channel_add(&ch, 1, 9999, 2) && ch.n == VALVE_CHANNELS_MAX);
}

int main(void) {
  allocs();
  controls();
  pending();
  preempt();
  expect("200 parses", valve_timeslice_us("200") == 200);
  expect("0, -5, 2x, empty, 11 s and NULL do not",
         !valve_timeslice_us("0") && !valve_timeslice_us("-5") && !valve_timeslice_us("2x") &&
             !valve_timeslice_us("") && !valve_timeslice_us("11000000") && !valve_timeslice_us(NULL));
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
