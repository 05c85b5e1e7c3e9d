/* LD_PRELOAD library for an offline job: every channel group (TSG) the job's CUDA context creates
 * gets the timeslice VALVE_TSG_TIMESLICE_US, set by the job itself right after RM allocated it
 * (NVA06C_CTRL_CMD_SET_TIMESLICE needs no privilege; docs/gate.md, candidate 6). When online has
 * work, the GPU then leaves the job after at most that slice, before the gate's disable lands.
 * Each try gets one line on stderr: the TSG's handles, the asked and the resulting timeslice, RM's
 * status. Where RM refuses it at the group's allocation (perhaps wanting the group populated), it
 * is tried again at the group's next few child allocations (its context share, its channels). */
#define _GNU_SOURCE
#include "valve_timeslice.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

int valve_rm_alloc(unsigned long request, const void *arg, struct valve_alloc *out) {
  if (arg == NULL || _IOC_TYPE(request) != 'F' || _IOC_NR(request) != VALVE_ESC_RM_ALLOC) return 0;
  uint32_t status;
  if (_IOC_SIZE(request) == sizeof(struct nvos64)) {
    const struct nvos64 *a = arg;
    *out = (struct valve_alloc){a->h_root, a->h_parent, a->h_new, a->h_class};
    status = a->status;
  } else if (_IOC_SIZE(request) == sizeof(struct nvos21)) {
    const struct nvos21 *a = arg;
    *out = (struct valve_alloc){a->h_root, a->h_parent, a->h_new, a->h_class};
    status = a->status;
  } else {
    return 0;
  }
  return status == 0;
}

void valve_tsg_control(struct nvos54 *ctl, uint32_t client, uint32_t object, uint32_t cmd,
                       uint64_t *params) {
  memset(ctl, 0, sizeof *ctl);
  ctl->h_client = client;
  ctl->h_object = object;
  ctl->cmd = cmd;
  ctl->p_params = (uint64_t)(uintptr_t)params;
  ctl->params_size = sizeof *params;
}

int valve_pending_add(struct valve_pending *p, uint32_t client, uint32_t tsg) {
  if (p->n >= VALVE_PENDING_MAX) return 0;
  p->at[p->n].client = client;
  p->at[p->n].tsg = tsg;
  p->at[p->n].tries = 1;
  p->n++;
  return 1;
}

int valve_pending_find(const struct valve_pending *p, const struct valve_alloc *a) {
  for (int i = 0; i < p->n; i++)
    if (p->at[i].client == a->client && p->at[i].tsg == a->parent) return i;
  return -1;
}

void valve_pending_after_try(struct valve_pending *p, int i, int took) {
  if (i < 0 || i >= p->n) return;
  if (!took && ++p->at[i].tries < VALVE_TRIES_MAX) return;
  p->at[i] = p->at[--p->n];
}

uint64_t valve_timeslice_us(const char *text) {
  if (text == NULL || *text < '0' || *text > '9') return 0;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < 1 || v > 10000000ull) return 0;
  return v;
}

#ifndef VALVE_TIMESLICE_NO_INTERPOSE
typedef int (*ioctl_fn)(int, unsigned long, ...);
static ioctl_fn real_ioctl;
static uint64_t want_us;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init(void) {
  real_ioctl = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
  const char *text = getenv("VALVE_TSG_TIMESLICE_US");
  want_us = valve_timeslice_us(text);
  if (text && *text && want_us == 0)
    fprintf(stderr, "valve-timeslice: VALVE_TSG_TIMESLICE_US=%s is not 1-10000000 (us): left alone\n", text);
}

static struct valve_pending pending;
static pthread_mutex_t pending_mu = PTHREAD_MUTEX_INITIALIZER;

/* Sets, then reads back, a TSG's timeslice on the fd RM allocated it on; one line on stderr.
 * Returns whether RM took it. */
static int set_timeslice(int fd, uint32_t client, uint32_t tsg, const char *when) {
  uint64_t us = want_us, now = 0;
  struct nvos54 set, get;
  valve_tsg_control(&set, client, tsg, VALVE_CMD_SET_TIMESLICE, &us);
  valve_tsg_control(&get, client, tsg, VALVE_CMD_GET_TIMESLICE, &now);
  unsigned long ctl_req = _IOWR('F', VALVE_ESC_RM_CONTROL, struct nvos54);
  int r1 = real_ioctl(fd, ctl_req, &set);
  int took = r1 == 0 && set.status == 0;
  int r2 = took ? real_ioctl(fd, ctl_req, &get) : -1;
  fprintf(stderr, "valve-timeslice: pid %d TSG %x/%x (%s): asked %llu us, status 0x%x (ioctl %d); now %llu us\n",
          (int)getpid(), client, tsg, when, (unsigned long long)want_us, set.status, r1,
          (unsigned long long)(r2 == 0 && get.status == 0 ? now : 0));
  return took;
}

/* After a successful RM_ALLOC: a new TSG gets the timeslice; a child of one that RM refused at its
 * allocation gets another try. */
static void after_alloc(int fd, const struct valve_alloc *a) {
  if (a->cls == VALVE_CLASS_TSG) {
    if (!set_timeslice(fd, a->client, a->object, "allocated")) {
      pthread_mutex_lock(&pending_mu);
      valve_pending_add(&pending, a->client, a->object);
      pthread_mutex_unlock(&pending_mu);
    }
    return;
  }
  pthread_mutex_lock(&pending_mu);
  int i = valve_pending_find(&pending, a);
  pthread_mutex_unlock(&pending_mu);
  if (i < 0) return;
  int took = set_timeslice(fd, a->client, a->parent, "after a child's allocation");
  pthread_mutex_lock(&pending_mu);
  i = valve_pending_find(&pending, a); /* another thread may have moved it meanwhile */
  valve_pending_after_try(&pending, i, took);
  pthread_mutex_unlock(&pending_mu);
}

int ioctl(int fd, unsigned long request, ...) {
  va_list ap;
  va_start(ap, request);
  void *arg = va_arg(ap, void *);
  va_end(ap);
  pthread_once(&init_once, init);
  if (!real_ioctl) {
    errno = ENOSYS;
    return -1;
  }
  int ret = real_ioctl(fd, request, arg);
  struct valve_alloc a;
  if (ret == 0 && want_us != 0 && valve_rm_alloc(request, arg, &a)) {
    int saved = errno;
    after_alloc(fd, &a);
    errno = saved;
  }
  return ret;
}
#endif
