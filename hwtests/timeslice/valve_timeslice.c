/* LD_PRELOAD library for an offline job: the job sets its own GPU scheduling controls, right after
 * RM allocates the objects they apply to (docs/gate.md, candidates 6 and 7). Both need no privilege.
 * - VALVE_TSG_TIMESLICE_US: every channel group (TSG) the job's CUDA context creates gets this
 *   timeslice (NVA06C_CTRL_CMD_SET_TIMESLICE). One line on stderr per try: the TSG's handles, the
 *   asked and the resulting timeslice, RM's status. Where RM refuses it at the group's allocation
 *   (perhaps wanting the group populated), it is tried again at the group's next few child
 *   allocations (its context share, its channels).
 * - VALVE_COMPUTE_PREEMPT=report|wfi|cta|cilp: the mode is set on a channel just before a compute
 *   object is allocated under it (unless "report"), and read back after it (the GR context then
 *   exists; NV2080_CTRL_CMD_GR_GET_CTXSW_MODES). One line on stderr per channel. Where RM does not
 *   find the channel's handle, both are asked again naming its TSG. */
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

int valve_rm_alloc_args(unsigned long request, const void *arg, struct valve_alloc *out, uint32_t *status) {
  if (arg == NULL || _IOC_TYPE(request) != 'F' || _IOC_NR(request) != VALVE_ESC_RM_ALLOC) return 0;
  if (_IOC_SIZE(request) == sizeof(struct nvos64)) {
    const struct nvos64 *a = arg;
    *out = (struct valve_alloc){a->h_root, a->h_parent, a->h_new, a->h_class};
    *status = a->status;
  } else if (_IOC_SIZE(request) == sizeof(struct nvos21)) {
    const struct nvos21 *a = arg;
    *out = (struct valve_alloc){a->h_root, a->h_parent, a->h_new, a->h_class};
    *status = a->status;
  } else {
    return 0;
  }
  return 1;
}

int valve_rm_alloc(unsigned long request, const void *arg, struct valve_alloc *out) {
  uint32_t status;
  return valve_rm_alloc_args(request, arg, out, &status) && status == 0;
}

void valve_control(struct nvos54 *ctl, uint32_t client, uint32_t object, uint32_t cmd, void *params,
                   uint32_t size) {
  memset(ctl, 0, sizeof *ctl);
  ctl->h_client = client;
  ctl->h_object = object;
  ctl->cmd = cmd;
  ctl->p_params = (uint64_t)(uintptr_t)params;
  ctl->params_size = size;
}

void valve_tsg_control(struct nvos54 *ctl, uint32_t client, uint32_t object, uint32_t cmd,
                       uint64_t *params) {
  valve_control(ctl, client, object, cmd, params, sizeof *params);
}

int valve_compute_preempt(const char *text) {
  if (text == NULL || *text == '\0') return VALVE_PREEMPT_OFF;
  static const char *const names[] = {"wfi", "cta", "cilp", "report"};
  for (int i = 0; i < 4; i++)
    if (strcmp(text, names[i]) == 0) return i;
  return VALVE_PREEMPT_BAD;
}

const char *valve_compute_mode_name(uint32_t mode) {
  static const char *const names[] = {"WFI", "CTA", "CILP"};
  return mode < 3 ? names[mode] : "?";
}

int valve_is_compute_class(uint32_t cls) {
  return cls <= 0xffffu && (cls & 0xffu) == 0xc0u && (cls >> 8) >= 0xc3u;
}

int valve_subdevice_add(struct valve_subdevices *s, uint32_t client, uint32_t subdevice) {
  if (valve_subdevice_of(s, client) != 0) return 1;
  if (s->n >= VALVE_SUBDEVICES_MAX) return 0;
  s->at[s->n].client = client;
  s->at[s->n].subdevice = subdevice;
  s->n++;
  return 1;
}

uint32_t valve_subdevice_of(const struct valve_subdevices *s, uint32_t client) {
  for (int i = 0; i < s->n; i++)
    if (s->at[i].client == client) return s->at[i].subdevice;
  return 0;
}

int valve_is_gpfifo_class(uint32_t cls) {
  return cls <= 0xffffu && (cls & 0xffu) == 0x6fu && (cls >> 8) >= 0xc3u;
}

int valve_channel_add(struct valve_channels *c, uint32_t client, uint32_t channel, uint32_t tsg) {
  if (c->n >= VALVE_CHANNELS_MAX) return 0;
  c->at[c->n].client = client;
  c->at[c->n].channel = channel;
  c->at[c->n].tsg = tsg;
  c->n++;
  return 1;
}

uint32_t valve_tsg_of(const struct valve_channels *c, uint32_t client, uint32_t channel) {
  for (int i = c->n - 1; i >= 0; i--) /* the newest first: RM may reuse a freed handle */
    if (c->at[i].client == client && c->at[i].channel == channel) return c->at[i].tsg;
  return 0;
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

static int preempt_mode = VALVE_PREEMPT_OFF;

static void init(void) {
  real_ioctl = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
  const char *text = getenv("VALVE_TSG_TIMESLICE_US");
  want_us = valve_timeslice_us(text);
  if (text && *text && want_us == 0)
    fprintf(stderr, "valve-timeslice: VALVE_TSG_TIMESLICE_US=%s is not 1-10000000 (us): left alone\n", text);
  const char *mode = getenv("VALVE_COMPUTE_PREEMPT");
  preempt_mode = valve_compute_preempt(mode);
  if (preempt_mode == VALVE_PREEMPT_BAD) {
    fprintf(stderr, "valve-preempt: VALVE_COMPUTE_PREEMPT=%s is not wfi, cta, cilp or report: left alone\n", mode);
    preempt_mode = VALVE_PREEMPT_OFF;
  }
}

static struct valve_pending pending;
static struct valve_subdevices subdevices;
static pthread_mutex_t pending_mu = PTHREAD_MUTEX_INITIALIZER; /* guards both */

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

static struct valve_channels channels; /* guarded by pending_mu too */

/* One GR control on the client's subdevice `sub` about channel a->parent. `handle` points at the
 * params' channel handle. Where RM answers NOT_FOUND, it is asked once more naming the channel's
 * TSG. Returns the ioctl's result; `ctl` holds RM's status; `tried` says what was named. */
static int gr_control(int fd, const struct valve_alloc *a, uint32_t sub, uint32_t cmd, void *params,
                      uint32_t size, uint32_t *handle, struct nvos54 *ctl, char *tried, size_t tried_size) {
  unsigned long req = _IOWR('F', VALVE_ESC_RM_CONTROL, struct nvos54);
  *handle = a->parent;
  valve_control(ctl, a->client, sub, cmd, params, size);
  int r = real_ioctl(fd, req, ctl);
  snprintf(tried, tried_size, "channel");
  if (r != 0 || ctl->status != VALVE_STATUS_OBJECT_NOT_FOUND) return r;
  pthread_mutex_lock(&pending_mu);
  uint32_t tsg = valve_tsg_of(&channels, a->client, a->parent);
  pthread_mutex_unlock(&pending_mu);
  if (tsg == 0) {
    snprintf(tried, tried_size, "channel (its TSG unknown)");
    return r;
  }
  *handle = tsg;
  valve_control(ctl, a->client, sub, cmd, params, size);
  r = real_ioctl(fd, req, ctl);
  snprintf(tried, tried_size, "channel: not found; its TSG %x", tsg);
  return r;
}

static uint32_t subdevice_of(uint32_t client) {
  pthread_mutex_lock(&pending_mu);
  uint32_t sub = valve_subdevice_of(&subdevices, client);
  pthread_mutex_unlock(&pending_mu);
  return sub;
}

/* Before a compute object is allocated under channel a->parent: sets the channel's compute
 * preemption mode (RM applies the mode when it sets the GR context up, so it is asked before, as
 * NVIDIA's own CILP test does), through the client's subdevice. What happened goes in `said`. */
static void set_before_compute(int fd, const struct valve_alloc *a, char *said, size_t size) {
  uint32_t sub = subdevice_of(a->client);
  if (sub == 0) {
    snprintf(said, size, "not set: no subdevice of this client seen");
    return;
  }
  struct valve_set_preemption_mode set = {.flags = VALVE_PREEMPT_FLAGS_CILP_SET,
                                          .cilp_preempt_mode = (uint32_t)preempt_mode};
  struct nvos54 ctl;
  char tried[64];
  int r = gr_control(fd, a, sub, VALVE_CMD_SET_CTXSW_PREEMPTION_MODE, &set, sizeof set, &set.h_channel, &ctl,
                     tried, sizeof tried);
  snprintf(said, size, "asked %s before the compute object naming the %s, status 0x%x (ioctl %d)",
           valve_compute_mode_name((uint32_t)preempt_mode), tried, ctl.status, r);
}

/* After a compute object under channel a->parent: reads the channel's compute preemption mode back
 * through the client's subdevice; one line on stderr with what set_before_compute said. Where one
 * client drives several GPUs, only its first subdevice is known, and RM refuses the others' channels
 * (the line says so). */
static void compute_preempt(int fd, const struct valve_alloc *a, const char *said) {
  uint32_t sub = subdevice_of(a->client);
  if (sub == 0) {
    fprintf(stderr, "valve-preempt: pid %d channel %x/%x: no subdevice of this client seen: not read\n",
            (int)getpid(), a->client, a->parent);
    return;
  }
  struct valve_get_ctxsw_modes get = {0};
  struct nvos54 ctl;
  char tried[64];
  int r = gr_control(fd, a, sub, VALVE_CMD_GET_CTXSW_MODES, &get, sizeof get, &get.h_channel, &ctl, tried,
                     sizeof tried);
  if (r == 0 && ctl.status == 0)
    fprintf(stderr, "valve-preempt: pid %d channel %x/%x (compute class %x): %s; read naming the %s: compute %s (%u), graphics %u\n",
            (int)getpid(), a->client, a->parent, a->cls, said, tried, valve_compute_mode_name(get.cilp_preempt_mode),
            get.cilp_preempt_mode, get.gfxp_preempt_mode);
  else
    fprintf(stderr, "valve-preempt: pid %d channel %x/%x (compute class %x): %s; read naming the %s refused: status 0x%x (ioctl %d)\n",
            (int)getpid(), a->client, a->parent, a->cls, said, tried, ctl.status, r);
}

/* The timeslice's part of after_alloc. */
static void timeslice_after_alloc(int fd, const struct valve_alloc *a) {
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

/* After a successful RM_ALLOC: a subdevice or a channel's TSG is remembered, a compute object gets its channel's
 * preemption mode read (and set), a new TSG gets the timeslice, and a child of a TSG that RM refused
 * at its allocation gets another try. */
static void after_alloc(int fd, const struct valve_alloc *a, const char *said) {
  if (a->cls == VALVE_CLASS_SUBDEVICE) {
    pthread_mutex_lock(&pending_mu);
    valve_subdevice_add(&subdevices, a->client, a->object);
    pthread_mutex_unlock(&pending_mu);
    return;
  }
  if (preempt_mode != VALVE_PREEMPT_OFF && valve_is_gpfifo_class(a->cls)) {
    pthread_mutex_lock(&pending_mu);
    valve_channel_add(&channels, a->client, a->object, a->parent);
    pthread_mutex_unlock(&pending_mu);
  }
  if (preempt_mode != VALVE_PREEMPT_OFF && valve_is_compute_class(a->cls)) compute_preempt(fd, a, said);
  if (want_us != 0) timeslice_after_alloc(fd, a);
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
  char said[160] = "read only";
  struct valve_alloc a;
  uint32_t status;
  if (preempt_mode >= 0 && preempt_mode <= 2 && valve_rm_alloc_args(request, arg, &a, &status) &&
      valve_is_compute_class(a.cls)) {
    int saved = errno;
    set_before_compute(fd, &a, said, sizeof said);
    errno = saved;
  }
  int ret = real_ioctl(fd, request, arg);
  if (ret == 0 && (want_us != 0 || preempt_mode != VALVE_PREEMPT_OFF) && valve_rm_alloc(request, arg, &a)) {
    int saved = errno;
    after_alloc(fd, &a, said);
    errno = saved;
  }
  return ret;
}
#endif
