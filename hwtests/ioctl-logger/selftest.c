/* Tests the logger's decision and formatting with synthetic RM structs. */
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>

#include "valve_ioctl_log.h"

static int passed, failed;
static void expect(const char *what, const char *got, const char *want) {
  if (strcmp(got, want) == 0) {
    passed++;
  } else {
    failed++;
    printf("FAIL %s: got '%s' want '%s'\n", what, got, want);
  }
}

struct nvos64 { unsigned h_root, h_parent, h_new, h_class; unsigned long long p_params, p_rights; unsigned size, flags, status, pad; };
struct nvos21 { unsigned h_root, h_parent, h_new, h_class; unsigned long long p_params; unsigned size, status; };
struct nvos00 { unsigned h_root, h_parent, h_object, status; };
struct nvos54 { unsigned h_client, h_object, cmd, flags; unsigned long long p_params; unsigned size, status; };
struct nvos55 { unsigned h_client, h_parent, h_object, h_client_src, h_object_src, flags, status; };

int main(void) {
  char buf[128];
  unsigned device_params[14] = {2};
  /* As CUDA 13 issues it: params pointer set, paramsSize 0. */
  struct nvos64 dev = {0xc1d00002, 0xc1d00002, 0x5c000002, 0x80, (unsigned long long)(size_t)device_params, 0, 0, 0, 0, 0};
  buf[valve_format_rm_call(buf, sizeof buf, 0x1234, _IOWR('F', 0x2B, struct nvos64), &dev, &dev)] = 0;
  expect("device alloc (NVOS64) logs the instance", buf, "alloc 1234 c1d00002 c1d00002 5c000002 80 2\n");
  /* The driver hands the struct back without the params pointer: the logger uses the copy. */
  struct nvos64 dev_after = dev;
  dev_after.p_params = 0;
  buf[valve_format_rm_call(buf, sizeof buf, 0x1234, _IOWR('F', 0x2B, struct nvos64), &dev, &dev_after)] = 0;
  expect("instance comes from the pre-call copy", buf, "alloc 1234 c1d00002 c1d00002 5c000002 80 2\n");
  struct nvos64 chan = {0xc1d00002, 0x5c000100, 0x5c000010, 0xc86f, 0, 0, 0, 0, 0, 0};
  buf[valve_format_rm_call(buf, sizeof buf, 0x1234, _IOWR('F', 0x2B, struct nvos64), &chan, &chan)] = 0;
  expect("channel alloc", buf, "alloc 1234 c1d00002 5c000100 5c000010 c86f -\n");
  chan.status = 0x1f;
  expect("failed alloc is not logged", valve_format_rm_call(buf, sizeof buf, 1, _IOWR('F', 0x2B, struct nvos64), &chan, &chan) ? "logged" : "", "");
  struct nvos21 root = {0, 0, 0xc1d00001, 0x41, 0, 0, 0};
  buf[valve_format_rm_call(buf, sizeof buf, 7, _IOWR('F', 0x2B, struct nvos21), &root, &root)] = 0;
  expect("root client (NVOS21)", buf, "alloc 7 0 0 c1d00001 41 -\n");
  struct nvos00 fr = {0xc1d00001, 0, 0xc1d00001, 0};
  buf[valve_format_rm_call(buf, sizeof buf, 7, _IOWR('F', 0x29, struct nvos00), &fr, &fr)] = 0;
  expect("free", buf, "free 7 c1d00001 0 c1d00001\n");
  struct nvos55 dup = {0xc1d00003, 0x5c000002, 0x5c000300, 0xc1d00009, 0x5c000042, 0, 0};
  buf[valve_format_rm_call(buf, sizeof buf, 7, _IOWR('F', 0x34, struct nvos55), &dup, &dup)] = 0;
  expect("dup of another client's object", buf, "dup 7 c1d00003 5c000002 5c000300 c1d00009 5c000042\n");
  dup.status = 0x1b;
  expect("failed dup is not logged", valve_format_rm_call(buf, sizeof buf, 7, _IOWR('F', 0x34, struct nvos55), &dup, &dup) ? "logged" : "", "");
  static unsigned token = 0x1d;
  struct nvos54 ctl = {0xc1d00003, 0x5c000010, 0xc36f0108, 0, (unsigned long long)(size_t)&token, 4, 0};
  buf[valve_format_rm_call(buf, sizeof buf, 7, _IOWR('F', 0x2A, struct nvos54), &ctl, &ctl)] = 0;
  expect("work submit token", buf, "ctrl 7 c1d00003 5c000010 c36f0108 1d\n");
  ctl.cmd = 0x20801102;
  expect("a subdevice control is ignored", valve_format_rm_call(buf, sizeof buf, 7, _IOWR('F', 0x2A, struct nvos54), &ctl, &ctl) ? "logged" : "", "");
  expect("control with the wrong struct is ignored", valve_format_rm_call(buf, sizeof buf, 7, _IOWR('F', 0x2A, struct nvos21), &root, &root) ? "logged" : "", "");
  expect("other ioctl type is ignored", valve_format_rm_call(buf, sizeof buf, 7, _IOWR('T', 0x2B, struct nvos64), &dev, &dev) ? "logged" : "", "");
  expect("odd size is ignored", valve_format_rm_call(buf, sizeof buf, 7, _IOWR('F', 0x2B, int), &dev, &dev) ? "logged" : "", "");
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
