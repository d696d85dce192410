/* See devcopy.h. The driver API's prototypes are declared here (no CUDA headers at build time);
 * their ABI is stable across driver versions, and a driver keeps its older entry points. */
#include "devcopy.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;

#define CU_STREAM_NON_BLOCKING 1
#define CU_MEMHOSTREGISTER_PORTABLE 1
#define CU_MEMHOSTREGISTER_DEVICEMAP 2
#define CU_MEM_ADVISE_SET_PREFERRED_LOCATION 3
#define CUDA_ERROR_NOT_READY 600

static struct {
    CUresult (*init)(unsigned);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*stream_query)(CUstream);
    CUresult (*host_register)(void *, size_t, unsigned);
    CUresult (*host_unregister)(void *);
    CUresult (*memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*advise_v2)(CUdeviceptr, size_t, int, CUmemLocation);
    CUresult (*advise)(CUdeviceptr, size_t, int, CUdevice);
    CUresult (*prefetch_v2)(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream);
    CUresult (*prefetch)(CUdeviceptr, size_t, CUdevice, CUstream);
    CUresult (*error_string)(CUresult, const char **);
    CUresult (*host_get_device_pointer)(CUdeviceptr *, void *, unsigned);
    CUresult (*launch_host_func)(CUstream, void (*)(void *), void *);
} cu;

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static int init_rc = 1; /* 1: not tried; 0: ready; < 0: failed */
static CUcontext ctx;
static char message[256];

struct DevCopyThread {
    CUstream stream;
};

const char *devcopy_error(void) { return message; }

static void *sym(void *lib, const char *name) { return lib ? dlsym(lib, name) : NULL; }

static int fail(int rc, const char *what, CUresult e) {
    const char *s = NULL;
    if (cu.error_string) cu.error_string(e, &s);
    snprintf(message, sizeof message, "%s failed: %s (CUresult %d)", what, s ? s : "?", e);
    return rc;
}

int devcopy_init(int ordinal) {
    pthread_mutex_lock(&init_mu);
    if (init_rc != 1) goto out;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(message, sizeof message, "no CUDA driver (libcuda) on this machine");
        init_rc = -1;
        goto out;
    }
    *(void **)&cu.init = sym(lib, "cuInit");
    *(void **)&cu.device_get = sym(lib, "cuDeviceGet");
    *(void **)&cu.primary_ctx_retain = sym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&cu.ctx_set_current = sym(lib, "cuCtxSetCurrent");
    *(void **)&cu.stream_create = sym(lib, "cuStreamCreate");
    *(void **)&cu.stream_destroy = sym(lib, "cuStreamDestroy_v2");
    *(void **)&cu.stream_synchronize = sym(lib, "cuStreamSynchronize");
    *(void **)&cu.stream_query = sym(lib, "cuStreamQuery");
    *(void **)&cu.host_register = sym(lib, "cuMemHostRegister_v2");
    *(void **)&cu.host_unregister = sym(lib, "cuMemHostUnregister");
    *(void **)&cu.memcpy_htod_async = sym(lib, "cuMemcpyHtoDAsync_v2");
    *(void **)&cu.advise_v2 = sym(lib, "cuMemAdvise_v2");
    *(void **)&cu.advise = sym(lib, "cuMemAdvise");
    *(void **)&cu.prefetch_v2 = sym(lib, "cuMemPrefetchAsync_v2");
    *(void **)&cu.prefetch = sym(lib, "cuMemPrefetchAsync");
    *(void **)&cu.error_string = sym(lib, "cuGetErrorString");
    *(void **)&cu.host_get_device_pointer = sym(lib, "cuMemHostGetDevicePointer_v2");
    *(void **)&cu.launch_host_func = sym(lib, "cuLaunchHostFunc");
    if (!cu.init || !cu.device_get || !cu.primary_ctx_retain || !cu.ctx_set_current ||
        !cu.stream_create || !cu.stream_destroy || !cu.stream_synchronize ||
        !cu.host_register || !cu.host_unregister || !cu.memcpy_htod_async) {
        snprintf(message, sizeof message, "the CUDA driver lacks an entry point the reader needs");
        init_rc = -2;
        goto out;
    }
    CUdevice dev;
    CUresult e;
    if ((e = cu.init(0)) || (e = cu.device_get(&dev, ordinal)) ||
        (e = cu.primary_ctx_retain(&ctx, dev))) {
        init_rc = fail(-3, "CUDA initialisation", e);
        goto out;
    }
    init_rc = 0;
out:;
    int rc = init_rc;
    pthread_mutex_unlock(&init_mu);
    return rc;
}

/* Streams outlive the threads that used them: a new thread takes one no thread uses, else a
 * new one; past MAX_STREAMS, threads share the least used (their copies take turns, and a
 * thread's wait for its own copies waits for the sharer's too). A stream sharing one of the
 * driver's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) with MLX's does not queue its copies
 * behind MLX's kernels: under one queue for every stream, a copy landed while a decode gate
 * spun on the device waiting for it (measured on an H100). */
#define MAX_STREAMS 64
static pthread_mutex_t streams_mu = PTHREAD_MUTEX_INITIALIZER;
static CUstream streams[MAX_STREAMS];
static int users[MAX_STREAMS]; /* threads using each stream now */
static int n_streams;

static void drop_stream(int i) { /* (streams_mu held) */
    streams[i] = streams[--n_streams];
    users[i] = users[n_streams];
}

/* A stream for a new thread in *out: one no thread uses, a new one below MAX_STREAMS, else the
 * least used; 0 or the driver's CUresult, the context made current. A stream the driver no
 * longer knows (its context was reset) is dropped. */
static CUresult take_stream(CUstream *out) {
    CUresult e = cu.ctx_set_current(ctx);
    if (e) return e;
    pthread_mutex_lock(&streams_mu);
    for (;;) {
        int best = -1;
        for (int i = 0; i < n_streams; i++)
            if (best < 0 || users[i] < users[best]) best = i;
        if (best >= 0 && users[best] > 0 && n_streams < MAX_STREAMS) best = -1;
        if (best < 0) {
            CUstream s = NULL;
            e = cu.stream_create(&s, CU_STREAM_NON_BLOCKING);
            if (!e) {
                streams[n_streams] = s;
                users[n_streams++] = 1;
                *out = s;
            }
            break;
        }
        e = users[best] ? 0 : cu.stream_query ? cu.stream_query(streams[best]) : 0;
        if (e == 0 || e == CUDA_ERROR_NOT_READY) {
            users[best]++;
            *out = streams[best];
            e = 0;
            break;
        }
        drop_stream(best);
    }
    pthread_mutex_unlock(&streams_mu);
    return e;
}

/* A thread's stream given back once nothing it queued is left (a failed stream is destroyed
 * by its last user). */
static void give_stream(CUstream s) {
    int failed = cu.stream_synchronize(s) != 0;
    pthread_mutex_lock(&streams_mu);
    for (int i = 0; i < n_streams; i++) {
        if (streams[i] != s) continue;
        if (--users[i] == 0 && failed) {
            drop_stream(i);
            cu.stream_destroy(s);
        }
        break;
    }
    pthread_mutex_unlock(&streams_mu);
}

DevCopyThread *devcopy_thread_new(void) {
    if (init_rc != 0) return NULL;
    DevCopyThread *t = calloc(1, sizeof *t);
    if (t && take_stream(&t->stream)) {
        free(t);
        t = NULL;
    }
    return t;
}

void devcopy_thread_free(DevCopyThread *t) {
    if (!t) return;
    give_stream(t->stream);
    free(t);
}

void devcopy_pin(DevCopyThread *t, void *buf, size_t len) {
    if (t) cu.host_register(buf, len, 0);
}

void devcopy_unpin(DevCopyThread *t, void *buf) {
    if (t) cu.host_unregister(buf);
}

int devcopy_start(DevCopyThread *t, void *dst, const void *src, size_t len) {
    return cu.memcpy_htod_async((CUdeviceptr)(uintptr_t)dst, src, len, t->stream);
}

int devcopy_wait(DevCopyThread *t) { return cu.stream_synchronize(t->stream); }

int devcopy_copy(DevCopyThread *t, void *dst, const void *src, size_t len) {
    CUresult e = devcopy_start(t, dst, src, len);
    if (!e) e = devcopy_wait(t);
    return e;
}

int devcopy_prefer_device(void *addr, size_t len, int ordinal) {
    if (init_rc != 0) return -1;
    CUresult e = cu.ctx_set_current(ctx);
    if (e) return e;
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)addr;
    CUmemLocation loc = {1, ordinal};
    if (cu.advise_v2)
        e = cu.advise_v2(p, len, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, loc);
    else if (cu.advise)
        e = cu.advise(p, len, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, ordinal);
    if (e) return e;
    CUstream s;
    if ((e = take_stream(&s))) return e;
    if (cu.prefetch_v2)
        e = cu.prefetch_v2(p, len, loc, 0, s);
    else if (cu.prefetch)
        e = cu.prefetch(p, len, ordinal, s);
    if (!e) e = cu.stream_synchronize(s);
    give_stream(s);
    return e;
}

int devcopy_map_host(void *addr, size_t len, unsigned long long *device_address) {
    if (init_rc != 0) return -1;
    if (!cu.host_get_device_pointer) return -2;
    CUresult e = cu.ctx_set_current(ctx);
    if (!e)
        e = cu.host_register(addr, len,
                             CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
    if (e) return e;
    CUdeviceptr p = 0;
    if ((e = cu.host_get_device_pointer(&p, addr, 0))) {
        cu.host_unregister(addr);
        return e;
    }
    *device_address = p;
    return 0;
}

int devcopy_unmap_host(void *addr) {
    if (init_rc != 0) return -1;
    CUresult e = cu.ctx_set_current(ctx);
    return e ? e : cu.host_unregister(addr);
}

int devcopy_then(DevCopyThread *t, void (*fn)(void *), void *arg) {
    if (!cu.launch_host_func) return -1;
    return cu.launch_host_func(t->stream, fn, arg);
}
