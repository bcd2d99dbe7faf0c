// A stand-in for libcuda.so.1, so that every path of driver.rs runs on machines without a GPU (the test
// `driver_paths_against_a_mock_driver` builds it with the system C compiler and loads it in a child process).
//
// It models what the backend's correctness depends on, not a GPU:
// - one device ("Mock H200", compute capability 9.0, 1 GiB) and its primary context; the calls that use the
//   *current* context (stream, event and module creation, page-locked allocation, memory info, context
//   synchronisation) fail with CUDA_ERROR_INVALID_CONTEXT and record a violation when none is current;
// - device memory is host memory; pool allocations are 256-byte aligned and counted, a freed block stays
//   reserved unless the pool's release threshold is below what it holds at a synchronisation, trims are counted;
// - streams are queues executed only at synchronisation points (stream, event and context synchronise, and an
//   event waited for), so a copy reads its source late: reusing a staging buffer before its copy ran, or freeing
//   page-locked memory a pending copy reads, shows up as wrong data or a violation; an asynchronous host-to-device
//   copy from memory that is not page-locked is a violation;
// - modules must be CUDA ELF objects; the test kernels of driver/tests.rs run on the host: their declared
//   parameter sizes answer cuFuncGetParamInfo, and dynamic shared memory above 48 KiB needs the function's
//   attribute raised first; `longctx_test_fault` leaves a sticky CUDA_ERROR_ILLEGAL_ADDRESS;
// - timing needs two events made without CU_EVENT_DISABLE_TIMING;
// - `longctx_mock_*` report live objects, counters and the first violation to the test.
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    INVALID_DEVICE = 101,
};

#define TOTAL (1ull << 30)
#define OPTIN_SHARED 232448
#define MAX_OPS 4096

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized, primary_refs, sticky;
static char the_ctx;
static __thread void* current;
static char first_violation[512];
static long violations;

// Live objects by kind and counters.
enum { K_POOL, K_STREAM, K_EVENT, K_HOST, K_DEVICE, K_MODULE, K_KINDS };
static long live[K_KINDS];
static long trims, module_loads, launches;

static void violate(const char* fmt, const char* what) {
    if (violations++ == 0) snprintf(first_violation, sizeof first_violation, fmt, what);
}

#define NEED_CONTEXT()                                                        \
    do {                                                                      \
        if (current != &the_ctx || primary_refs <= 0) {                       \
            violate("%s called without the primary context current", __func__); \
            pthread_mutex_unlock(&lock);                                      \
            return INVALID_CONTEXT;                                           \
        }                                                                     \
    } while (0)

// ---- memory ---------------------------------------------------------------------------------------------------

typedef struct {
    uint64_t threshold, used, reserved, used_high, reserved_high;
} Pool;

typedef struct Block {
    char* base;
    size_t size;
    int device;  // 1: pool memory, 0: page-locked host memory
    Pool* pool;
    struct Block* next;
} Block;
static Block* blocks;

static Block* find_block(const void* p, size_t n, int device) {
    for (Block* b = blocks; b; b = b->next)
        if (b->device == device && (const char*)p >= b->base && (const char*)p + n <= b->base + b->size) return b;
    return NULL;
}

static void remove_block(Block* gone) {
    for (Block** b = &blocks; *b; b = &(*b)->next)
        if (*b == gone) {
            *b = gone->next;
            return;
        }
}

// ---- streams --------------------------------------------------------------------------------------------------

enum { OP_H2D, OP_D2H, OP_D2D, OP_MEMSET, OP_KERNEL, OP_FREE };
typedef struct {
    int kind;
    char *dst, *src;
    size_t n;
    unsigned value;
    int kernel;
    unsigned char params[64];
} Op;

typedef struct Stream {
    Op ops[MAX_OPS];
    long enqueued, done;
    struct Stream* next;
} Stream;
static Stream* streams;

typedef struct {
    unsigned flags;
    Stream* stream;
    long at;
    int recorded;
} Event;

static int pending_reads(const char* base, size_t size) {
    for (Stream* s = streams; s; s = s->next)
        for (long i = s->done; i < s->enqueued; i++) {
            Op* op = &s->ops[i % MAX_OPS];
            if ((op->kind == OP_H2D) && op->src >= base && op->src < base + size) return 1;
        }
    return 0;
}

static void run_kernel(Op* op);

static void run(Stream* s, long upto) {
    while (s->done < upto) {
        Op* op = &s->ops[s->done % MAX_OPS];
        switch (op->kind) {
            case OP_H2D:
            case OP_D2H:
            case OP_D2D:
                if ((op->kind != OP_D2H && !find_block(op->dst, op->n, 1)) ||
                    (op->kind != OP_H2D && !find_block(op->src, op->n, 1)))
                    violate("%s outside live device memory", "a copy");
                else
                    memcpy(op->dst, op->src, op->n);
                break;
            case OP_MEMSET:
                if (!find_block(op->dst, op->n * 4, 1))
                    violate("%s outside live device memory", "memset");
                else
                    for (size_t i = 0; i < op->n; i++) memcpy(op->dst + 4 * i, &op->value, 4);
                break;
            case OP_KERNEL:
                run_kernel(op);
                break;
            case OP_FREE: {
                Block* b = find_block(op->dst, 1, 1);
                if (!b || b->base != op->dst) {
                    violate("%s of memory that is not a live allocation", "cuMemFreeAsync");
                } else {
                    b->pool->used -= b->size;
                    remove_block(b);
                    free(b->base);
                    free(b);
                    live[K_DEVICE]--;
                }
                break;
            }
        }
        s->done++;
    }
}

static Op* enqueue(Stream* s) {
    if (s->enqueued - s->done >= MAX_OPS) run(s, s->done + 1);
    Op* op = &s->ops[s->enqueued % MAX_OPS];
    memset(op, 0, sizeof *op);
    s->enqueued++;
    return op;
}

static Pool* pools[16];

static void release_to_threshold(void) {
    for (int i = 0; i < 16; i++)
        if (pools[i]) {
            Pool* p = pools[i];
            uint64_t keep = p->used > p->threshold ? p->used : p->threshold;
            if (p->reserved > keep) p->reserved = keep;
        }
}

static void run_all(void) {
    for (Stream* s = streams; s; s = s->next) run(s, s->enqueued);
    release_to_threshold();
}

// ---- kernels --------------------------------------------------------------------------------------------------

typedef struct {
    const char* name;
    int nparams;
    size_t sizes[6];
} KernelInfo;
static const KernelInfo kernels[] = {
    {"longctx_test_affine", 5, {8, 8, 4, 4, 4}},
    {"longctx_test_reverse", 3, {8, 8, 4}},
    {"longctx_test_slow_fill", 4, {8, 4, 4, 8}},
    {"longctx_test_fault", 1, {8}},
};
#define NKERNELS (int)(sizeof kernels / sizeof kernels[0])

typedef struct {
    int kernel;
    int max_dynamic_shared;
} Function;
typedef struct {
    Function functions[NKERNELS];
} Module;

static size_t param_offset(int k, int index) {
    size_t off = 0;
    for (int i = 0; i <= index; i++) {
        size_t sz = kernels[k].sizes[i];
        off = (off + sz - 1) / sz * sz;
        if (i < index) off += sz;
    }
    return off;
}

#define PARAM(op, k, i, type) (*(type*)((op)->params + param_offset((k), (i))))

static void run_kernel(Op* op) {
    int k = op->kernel;
    if (sticky) return;
    if (!strcmp(kernels[k].name, "longctx_test_affine")) {
        float* out = PARAM(op, k, 0, float*);
        const float* in = PARAM(op, k, 1, const float*);
        float scale = PARAM(op, k, 2, float), shift = PARAM(op, k, 3, float);
        int n = PARAM(op, k, 4, int);
        if (!find_block(out, 4 * (size_t)n, 1) || !find_block(in, 4 * (size_t)n, 1)) {
            sticky = ILLEGAL_ADDRESS;
            return;
        }
        for (int i = 0; i < n; i++) out[i] = in[i] * scale + shift;
    } else if (!strcmp(kernels[k].name, "longctx_test_reverse")) {
        float* out = PARAM(op, k, 0, float*);
        const float* in = PARAM(op, k, 1, const float*);
        int n = PARAM(op, k, 2, int);
        for (int i = 0; i < n; i++) out[i] = in[n - 1 - i];
    } else if (!strcmp(kernels[k].name, "longctx_test_slow_fill")) {
        float* out = PARAM(op, k, 0, float*);
        float v = PARAM(op, k, 1, float);
        int n = PARAM(op, k, 2, int);
        for (int i = 0; i < n; i++) out[i] = v;
    } else {
        sticky = ILLEGAL_ADDRESS;
    }
}

// ---- the driver API -------------------------------------------------------------------------------------------

CUresult cuGetErrorName(CUresult e, const char** s) {
    switch (e) {
        case OK: *s = "CUDA_SUCCESS"; return OK;
        case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
        case OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return OK;
        case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
        case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return OK;
        case NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; return OK;
        case ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; return OK;
        case INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; return OK;
        default: *s = "CUDA_ERROR_UNKNOWN (mock)"; return OK;
    }
}
CUresult cuGetErrorString(CUresult e, const char** s) {
    *s = e == ILLEGAL_ADDRESS ? "an illegal memory access was encountered" : "mock driver error";
    return OK;
}

// NVRTC opens libcuda.so.1 itself when it is loaded and asks it for an internal export table (it crashes on a
// driver without the symbol); the mock has none to give.
CUresult cuGetExportTable(const void** table, const void* id) {
    (void)id;
    *table = NULL;
    return 801;  // CUDA_ERROR_NOT_SUPPORTED
}

CUresult cuInit(unsigned flags) {
    initialized = flags == 0;
    return flags == 0 ? OK : INVALID_VALUE;
}
CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return OK;
}
CUresult cuDeviceGetCount(int* n) {
    if (!initialized) return NOT_INITIALIZED;
    *n = 1;
    return OK;
}
CUresult cuDeviceGet(int* d, int ordinal) {
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal != 0) return INVALID_DEVICE;
    *d = 0;
    return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attr, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    switch (attr) {
        case 75: *v = 9; break;            // compute capability major
        case 76: *v = 0; break;            // minor
        case 16: *v = 132; break;          // multiprocessors
        case 97: *v = OPTIN_SHARED; break; // shared memory per block, opt-in
        case 115: *v = 1; break;           // memory pools supported
        default: *v = 0;
    }
    return OK;
}
CUresult cuDeviceGetName(char* name, int len, int dev) {
    if (dev != 0 || len < 16) return INVALID_VALUE;
    strcpy(name, "Mock H200");
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int dev) {
    *bytes = TOTAL;
    return dev == 0 ? OK : INVALID_DEVICE;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) {
    if (!initialized || dev != 0) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    primary_refs++;
    pthread_mutex_unlock(&lock);
    *ctx = &the_ctx;
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
    pthread_mutex_lock(&lock);
    if (dev != 0 || primary_refs <= 0) violate("%s without a retain", "cuDevicePrimaryCtxRelease");
    primary_refs--;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = current;
    return OK;
}
CUresult cuCtxSetCurrent(void* ctx) {
    if (ctx != NULL && ctx != &the_ctx) return INVALID_CONTEXT;
    current = ctx;
    return OK;
}
CUresult cuCtxSynchronize(void) {
    pthread_mutex_lock(&lock);
    NEED_CONTEXT();
    run_all();
    CUresult r = sticky;
    pthread_mutex_unlock(&lock);
    return r;
}

typedef struct {
    unsigned allocType, handleTypes;
    struct {
        unsigned type;
        int id;
    } location;
    void* win32;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} PoolProps;

CUresult cuMemPoolCreate(void** pool, const PoolProps* props) {
    if (props->allocType != 1 || props->handleTypes != 0 || props->location.type != 1 || props->location.id != 0)
        return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    Pool* p = calloc(1, sizeof *p);
    for (int i = 0; i < 16; i++)
        if (!pools[i]) {
            pools[i] = p;
            break;
        }
    live[K_POOL]++;
    pthread_mutex_unlock(&lock);
    *pool = p;
    return OK;
}
CUresult cuMemPoolDestroy(void* pool) {
    pthread_mutex_lock(&lock);
    // The pool's record is kept: blocks still allocated from it refer to it (the driver releases them later).
    for (int i = 0; i < 16; i++)
        if (pools[i] == pool) pools[i] = NULL;
    live[K_POOL]--;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuMemPoolSetAttribute(void* pool, int attr, void* value) {
    Pool* p = pool;
    uint64_t v = *(uint64_t*)value;
    pthread_mutex_lock(&lock);
    CUresult r = OK;
    if (attr == 4) p->threshold = v;
    else if (attr == 6 && v == 0) p->reserved_high = 0;
    else if (attr == 8 && v == 0) p->used_high = 0;
    else r = INVALID_VALUE;
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuMemPoolGetAttribute(void* pool, int attr, void* value) {
    Pool* p = pool;
    pthread_mutex_lock(&lock);
    CUresult r = OK;
    switch (attr) {
        case 4: *(uint64_t*)value = p->threshold; break;
        case 5: *(uint64_t*)value = p->reserved; break;
        case 6: *(uint64_t*)value = p->reserved_high; break;
        case 7: *(uint64_t*)value = p->used; break;
        case 8: *(uint64_t*)value = p->used_high; break;
        default: r = INVALID_VALUE;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuMemPoolTrimTo(void* pool, size_t keep) {
    Pool* p = pool;
    pthread_mutex_lock(&lock);
    uint64_t floor = p->used > keep ? p->used : keep;
    if (p->reserved > floor) p->reserved = floor;
    trims++;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr* ptr, size_t size, void* pool, void* stream) {
    Pool* p = pool;
    if (size == 0 || !stream) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (p->used + size > TOTAL) {
        pthread_mutex_unlock(&lock);
        return OUT_OF_MEMORY;
    }
    Block* b = calloc(1, sizeof *b);
    b->base = aligned_alloc(256, (size + 255) / 256 * 256);
    b->size = size;
    b->device = 1;
    b->pool = p;
    b->next = blocks;
    blocks = b;
    p->used += size;
    if (p->reserved < p->used) p->reserved = p->used;
    if (p->used_high < p->used) p->used_high = p->used;
    if (p->reserved_high < p->reserved) p->reserved_high = p->reserved;
    live[K_DEVICE]++;
    pthread_mutex_unlock(&lock);
    *ptr = (CUdeviceptr)(uintptr_t)b->base;
    return OK;
}
CUresult cuMemFreeAsync(CUdeviceptr ptr, void* stream) {
    pthread_mutex_lock(&lock);
    Op* op = enqueue(stream);
    op->kind = OP_FREE;
    op->dst = (char*)(uintptr_t)ptr;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    pthread_mutex_lock(&lock);
    NEED_CONTEXT();
    uint64_t used = 0;
    for (int i = 0; i < 16; i++)
        if (pools[i]) used += pools[i]->reserved;
    *free_bytes = TOTAL - used;
    *total = TOTAL;
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuMemHostAlloc(void** pp, size_t size, unsigned flags) {
    pthread_mutex_lock(&lock);
    NEED_CONTEXT();
    Block* b = calloc(1, sizeof *b);
    b->base = malloc(size);
    b->size = size;
    b->device = 0;
    b->next = blocks;
    blocks = b;
    live[K_HOST]++;
    pthread_mutex_unlock(&lock);
    *pp = b->base;
    (void)flags;
    return OK;
}
CUresult cuMemFreeHost(void* p) {
    pthread_mutex_lock(&lock);
    Block* b = find_block(p, 1, 0);
    if (!b) {
        pthread_mutex_unlock(&lock);
        return INVALID_VALUE;
    }
    if (pending_reads(b->base, b->size)) violate("%s of page-locked memory a pending copy still reads", "cuMemFreeHost");
    remove_block(b);
    free(b->base);
    free(b);
    live[K_HOST]--;
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuStreamCreate(void** s, unsigned flags) {
    pthread_mutex_lock(&lock);
    NEED_CONTEXT();
    Stream* st = calloc(1, sizeof *st);
    st->next = streams;
    streams = st;
    live[K_STREAM]++;
    pthread_mutex_unlock(&lock);
    *s = st;
    (void)flags;
    return OK;
}
CUresult cuStreamDestroy_v2(void* s) {
    pthread_mutex_lock(&lock);
    Stream* st = s;
    run(st, st->enqueued);  // the driver finishes pending work before releasing a stream
    for (Stream** p = &streams; *p; p = &(*p)->next)
        if (*p == st) {
            *p = st->next;
            break;
        }
    free(st);
    live[K_STREAM]--;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuStreamSynchronize(void* s) {
    pthread_mutex_lock(&lock);
    Stream* st = s;
    run(st, st->enqueued);
    release_to_threshold();
    CUresult r = sticky;
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuEventCreate(void** e, unsigned flags) {
    pthread_mutex_lock(&lock);
    NEED_CONTEXT();
    Event* ev = calloc(1, sizeof *ev);
    ev->flags = flags;
    live[K_EVENT]++;
    pthread_mutex_unlock(&lock);
    *e = ev;
    return OK;
}
CUresult cuEventDestroy_v2(void* e) {
    pthread_mutex_lock(&lock);
    free(e);
    live[K_EVENT]--;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuEventRecord(void* e, void* s) {
    Event* ev = e;
    pthread_mutex_lock(&lock);
    ev->stream = s;
    ev->at = ((Stream*)s)->enqueued;
    ev->recorded = 1;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuEventSynchronize(void* e) {
    Event* ev = e;
    pthread_mutex_lock(&lock);
    if (ev->recorded) run(ev->stream, ev->at);
    CUresult r = sticky;
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuStreamWaitEvent(void* s, void* e, unsigned flags) {
    Event* ev = e;
    pthread_mutex_lock(&lock);
    // Running the producer now is one valid order for what follows on `s`.
    if (ev->recorded) run(ev->stream, ev->at);
    pthread_mutex_unlock(&lock);
    (void)s;
    return flags == 0 ? OK : INVALID_VALUE;
}
CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) {
    Event *a = start, *b = end;
    pthread_mutex_lock(&lock);
    CUresult r = OK;
    if ((a->flags | b->flags) & 2) r = INVALID_HANDLE;  // CU_EVENT_DISABLE_TIMING
    else if (!a->recorded || !b->recorded || b->stream->done < b->at) r = NOT_READY;
    else *ms = 1.5f;
    pthread_mutex_unlock(&lock);
    return r;
}

static CUresult copy(int kind, void* dst, const void* src, size_t n, void* s) {
    pthread_mutex_lock(&lock);
    if (kind == OP_H2D && !find_block(src, n, 0))
        violate("%s from memory that is not page-locked", "an asynchronous host-to-device copy");
    Op* op = enqueue(s);
    op->kind = kind;
    op->dst = dst;
    op->src = (char*)src;
    op->n = n;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    return copy(OP_H2D, (void*)(uintptr_t)dst, src, n, s);
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    return copy(OP_D2H, dst, (void*)(uintptr_t)src, n, s);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    return copy(OP_D2D, (void*)(uintptr_t)dst, (void*)(uintptr_t)src, n, s);
}
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned value, size_t n, void* s) {
    pthread_mutex_lock(&lock);
    Op* op = enqueue(s);
    op->kind = OP_MEMSET;
    op->dst = (char*)(uintptr_t)dst;
    op->value = value;
    op->n = n;
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuModuleLoadData(void** module, const void* image) {
    const unsigned char* elf = image;
    pthread_mutex_lock(&lock);
    NEED_CONTEXT();
    if (memcmp(elf, "\x7f" "ELF", 4) != 0 || elf[18] != 190 || elf[19] != 0 || ((uintptr_t)image & 7)) {
        pthread_mutex_unlock(&lock);
        return INVALID_IMAGE;
    }
    Module* m = calloc(1, sizeof *m);
    for (int k = 0; k < NKERNELS; k++) m->functions[k] = (Function){k, 48 << 10};
    live[K_MODULE]++;
    module_loads++;
    pthread_mutex_unlock(&lock);
    *module = m;
    return OK;
}
CUresult cuModuleUnload(void* module) {
    pthread_mutex_lock(&lock);
    free(module);
    live[K_MODULE]--;
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuModuleGetFunction(void** f, void* module, const char* name) {
    Module* m = module;
    for (int k = 0; k < NKERNELS; k++)
        if (!strcmp(kernels[k].name, name)) {
            *f = &m->functions[k];
            return OK;
        }
    return NOT_FOUND;
}
CUresult cuFuncGetParamInfo(void* f, size_t index, size_t* offset, size_t* size) {
    Function* fn = f;
    if (index >= (size_t)kernels[fn->kernel].nparams) return INVALID_VALUE;
    *offset = param_offset(fn->kernel, (int)index);
    *size = kernels[fn->kernel].sizes[index];
    return OK;
}
CUresult cuFuncSetAttribute(void* f, int attr, int value) {
    Function* fn = f;
    if (attr != 8 || value < 0 || value > OPTIN_SHARED) return INVALID_VALUE;
    fn->max_dynamic_shared = value;
    return OK;
}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* s, void** params, void** extra) {
    Function* fn = f;
    if (!gx || !gy || !gz || !bx || !by || !bz || (size_t)bx * by * bz > 1024 || extra) return INVALID_VALUE;
    if (shared > (unsigned)fn->max_dynamic_shared) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    Op* op = enqueue(s);
    op->kind = OP_KERNEL;
    op->kernel = fn->kernel;
    const KernelInfo* k = &kernels[fn->kernel];
    for (int i = 0; i < k->nparams; i++) memcpy(op->params + param_offset(fn->kernel, i), params[i], k->sizes[i]);
    launches++;
    pthread_mutex_unlock(&lock);
    return OK;
}

// ---- what the test asks -----------------------------------------------------------------------------------------

long longctx_mock_live(int kind) { return kind >= 0 && kind < K_KINDS ? live[kind] : -1; }
long longctx_mock_counter(const char* name) {
    if (!strcmp(name, "trims")) return trims;
    if (!strcmp(name, "module_loads")) return module_loads;
    if (!strcmp(name, "launches")) return launches;
    if (!strcmp(name, "primary_refs")) return primary_refs;
    if (!strcmp(name, "violations")) return violations;
    return -1;
}
const char* longctx_mock_violation(void) { return violations ? first_violation : NULL; }
