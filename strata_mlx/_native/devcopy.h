/* Copies from host memory into CUDA device-visible memory, through the CUDA driver API loaded
 * at run time (dlopen of libcuda), so the extension builds and runs where CUDA is absent.
 *
 * Why: MLX's CUDA arrays are managed memory. A CPU copy into a slot whose pages sit on the
 * device migrates them to the host, and the next kernel to touch them migrates them back on
 * fault; an asynchronous copy-engine transfer from pinned host memory writes the pages where
 * they are. devcopy_* never touches the Python API. */
#ifndef STRATA_DEVCOPY_H
#define STRATA_DEVCOPY_H

#include <stddef.h>

/* Load libcuda and retain device `ordinal`'s primary context (the one MLX's runtime uses).
 * 0 on success; otherwise a negative code and a message in devcopy_error(). Idempotent. */
int devcopy_init(int ordinal);
const char *devcopy_error(void);

/* Per thread: a stream while it lives (one no thread uses, or a new one; past the process's
 * cap on streams, shared with another thread: devcopy.c), host buffers pinned. */
typedef struct DevCopyThread DevCopyThread;
DevCopyThread *devcopy_thread_new(void);
void devcopy_thread_free(DevCopyThread *t);
/* Pin [buf, buf + len) for asynchronous copies (cuMemHostRegister; the buffer keeps its huge
 * pages). A failure only makes copies slower: the driver stages pageable memory itself. */
void devcopy_pin(DevCopyThread *t, void *buf, size_t len);
void devcopy_unpin(DevCopyThread *t, void *buf);
/* Copy len bytes from host `src` to device-visible `dst` and wait for it: 0 or a CUresult. */
int devcopy_copy(DevCopyThread *t, void *dst, const void *src, size_t len);
/* The same copy queued on the thread's stream (`src` must stay untouched until it is done),
 * and the wait for every copy the thread queued: 0 or a CUresult. */
int devcopy_start(DevCopyThread *t, void *dst, const void *src, size_t len);
int devcopy_wait(DevCopyThread *t);

/* Queue fn(arg) on the thread's stream: the driver calls it on a thread of its own once the
 * copies queued before it are done (fn must not call CUDA). 0, -1 where the driver lacks
 * cuLaunchHostFunc, or a CUresult; fn is not called unless 0. */
int devcopy_then(DevCopyThread *t, void (*fn)(void *), void *arg);

/* Ask the driver to keep [addr, addr + len) (managed memory) on the device and move it there
 * now: 0 or a CUresult. */
int devcopy_prefer_device(void *addr, size_t len, int ordinal);

/* Page-locked host memory the device reads and writes in place ([addr, addr + len), page
 * aligned): registered with the device mapping, its device address in *device_address. 0, a
 * negative code (no driver) or a CUresult. Undone by devcopy_unmap_host. */
int devcopy_map_host(void *addr, size_t len, unsigned long long *device_address);
int devcopy_unmap_host(void *addr);

#endif
