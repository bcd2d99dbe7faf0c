// The CUDA emulator's runtime: runs the blocks of one launch on the calling OS thread, one fiber per CUDA thread, and
// implements the barriers and warp collectives (shuffles, votes, mma.sync, ldmatrix) and cp.async. Compiled once (with
// emu.h prepended) and linked into every unit's library. See mod.rs for the model and emu.h for the fiber layout.
//
// Scheduling: cooperative and deterministic. A fiber runs until it waits (a barrier, a warp collective) or exits,
// then switches straight to the next runnable fiber (a FIFO, first filled in thread order); the last to arrive at a
// barrier completes it, makes the waiters runnable and goes on. When nothing is runnable the scheduler regains
// control: either every thread has exited, or the block is deadlocked, which is reported with where each thread waits.
// Nothing here needs locks: a block is one OS thread; blocks share only the launch's atomic block counter (and what
// kernels share through global memory: atomics, and the flags by which one block waits for another, flag_wait_eq).
//
// A warp collective is gathered in the warp's slots: each lane writes its operands, the last lane to arrive computes
// every lane's result (so the whole collective happens at one instant, as on the GPU) and each lane reads its own.
#include <dlfcn.h>
#include <link.h>
#include <sched.h>

#include <cstdarg>
#include <string>
#include <vector>

namespace emu {

constexpr unsigned int kAbiVersion = 1;
// Guard bytes on each side of a block's dynamic shared memory.
constexpr std::size_t kDynGuardBytes = 256;
constexpr unsigned char kSmemPoison = 0xff;  // NaN as f32, bf16 and f16; -1 as an integer
constexpr unsigned char kGuardByte = 0xfd;
// The shared-state window (smem_window_addr): static shared memory from this address, dynamic shared memory from the
// next 1024-byte boundary after it plus 16 (CUDA promises dynamic shared memory 16-byte alignment only).
constexpr std::size_t kSmemWindowStatic = 1024;

}  // namespace emu

// The launch, as the Rust side lays it out (launch.rs). Read-only during the launch except the two atomics.
extern "C" {
struct LongctxEmuLaunch {
    void (*kernel)(void**);
    void** args;
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int shared_bytes;
    unsigned long long nblocks;
    unsigned long long* next_block;  // the next block to run, shared by the workers
    int* abort;                      // set by the first worker that fails
};
// What one worker (OS thread) owns: fiber regions (kFiberRegionBytes each, aligned to it, guard pages mapped by Rust)
// and a buffer for the block's dynamic shared memory with its guards.
struct LongctxEmuWorker {
    unsigned char* regions;
    unsigned long long nregions;
    unsigned char* dyn;
    unsigned long long dyn_capacity;
};
struct LongctxEmuAbi {
    unsigned int version;
    unsigned int fiber_region_bytes;
    unsigned int fiber_header_bytes;
    unsigned int dyn_guard_bytes;
    unsigned long long static_smem_bytes;
};
}

// ---------------------------------------------------------------------------------------------------------------------
// Context switch. x86-64: push the callee-saved registers and the SSE/x87 control words, swap stack pointers, pop.
// Measured on this project's 2-core dev machine (an AMD EPYC, shared with other work): a block of 128 threads doing
// 1000 __syncthreads and nothing else takes 2.2 ms, 17 ns per thread per barrier (one switch to the next fiber plus
// the barrier's bookkeeping); 1024 threads, 21 ns. The ucontext fallback (forced with -DLONGCTX_EMU_UCONTEXT) takes
// 336 ns: swapcontext saves and restores the signal mask with a system call at every switch.
extern "C" void longctx_emu_switch(void** save_sp, void* load_sp);
extern "C" [[noreturn]] void longctx_emu_fiber_main(emu::Fiber* f);

namespace emu {
inline unsigned char* region_of(Fiber* f) {
    return reinterpret_cast<unsigned char*>(reinterpret_cast<std::uintptr_t>(f) &
                                            ~static_cast<std::uintptr_t>(kFiberRegionBytes - 1));
}
// Where a fiber's stack starts: the top of its region, less a per-thread offset (up to 64 cache lines and 15 pages)
// so that the stacks' hot tops do not all fall into the same cache sets. Every fiber keeps over 170 KiB of stack.
inline unsigned char* stack_top(Fiber* f) {
    return region_of(f) + kFiberRegionBytes - (f->linear % 64) * 64 - (f->linear / 64 % 16) * 4096;
}
}  // namespace emu

#if defined(__x86_64__) && !defined(LONGCTX_EMU_UCONTEXT)
extern "C" void longctx_emu_fiber_start();
asm(R"(
    .text
    .p2align 4
    .globl longctx_emu_switch
    .hidden longctx_emu_switch
    .type longctx_emu_switch, @function
longctx_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size longctx_emu_switch, .-longctx_emu_switch

    .p2align 4
    .globl longctx_emu_fiber_start
    .hidden longctx_emu_fiber_start
    .type longctx_emu_fiber_start, @function
longctx_emu_fiber_start:
    .cfi_startproc
    .cfi_undefined rip
    movq %r12, %rdi
    callq *%r13
    ud2
    .cfi_endproc
    .size longctx_emu_fiber_start, .-longctx_emu_fiber_start
)");

namespace emu {
inline void switch_to(Context* from, Context* to) { longctx_emu_switch(&from->sp, to->sp); }

// A new fiber's stack: the frame longctx_emu_switch pops (control words, r15..rbp, return address), returning into
// longctx_emu_fiber_start with r12 = the fiber and r13 = the function to call. After `ret` the stack pointer is
// 16-byte aligned, as the `call` there needs.
inline void prepare(Fiber* f) {
    unsigned char* top = stack_top(f);
    auto* frame = reinterpret_cast<std::uint64_t*>(top - 80);
    frame[0] = 0x1f80ull | (0x037full << 32);  // MXCSR and x87 control word at their defaults
    frame[1] = 0;                              // r15
    frame[2] = 0;                              // r14
    frame[3] = reinterpret_cast<std::uint64_t>(&longctx_emu_fiber_main);  // r13
    frame[4] = reinterpret_cast<std::uint64_t>(f);                        // r12
    frame[5] = 0;                                                         // rbx
    frame[6] = 0;                                                         // rbp
    frame[7] = reinterpret_cast<std::uint64_t>(&longctx_emu_fiber_start);
    f->ctx.sp = frame;
}
}  // namespace emu
#else
// Portable fallback: ucontext (slower: swapcontext saves and restores the signal mask with a system call).
namespace emu {
inline void switch_to(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
extern "C" void longctx_emu_fiber_entry(unsigned int hi, unsigned int lo) {
    longctx_emu_fiber_main(reinterpret_cast<Fiber*>((static_cast<std::uintptr_t>(hi) << 32) | lo));
}
inline void prepare(Fiber* f) {
    getcontext(&f->ctx.uc);
    unsigned char* lo = region_of(f) + kFiberHeaderBytes + 65536;  // above any guard page
    f->ctx.uc.uc_stack.ss_sp = lo;
    f->ctx.uc.uc_stack.ss_size = static_cast<std::size_t>(stack_top(f) - lo);
    f->ctx.uc.uc_link = nullptr;
    const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(f);
    makecontext(&f->ctx.uc, reinterpret_cast<void (*)()>(&longctx_emu_fiber_entry), 2,
                static_cast<unsigned int>(p >> 32), static_cast<unsigned int>(p));
}
}  // namespace emu
#endif

namespace emu {

// ---------------------------------------------------------------------------------------------------------------------
// Block state.

// One lane's operands and result in a warp collective.
struct LaneSlot {
    alignas(16) unsigned char in[48];  // mma: a[4], b[2], c[4]; ldmatrix: the row address; shfl: the value
    alignas(16) unsigned char out[16];  // mma: d[4]; ldmatrix: r[num]; shfl/vote/reduce: the result
    int arg;                            // shfl: the source lane
};

// Collective kinds, so that lanes meeting in different collectives are caught.
enum Op {
    kOpSyncwarp = 1,
    kOpShfl = 10,       // + ShflMode
    kOpVote = 20,       // + VoteOp
    kOpReduce = 30,     // + ReduceOp
    kOpMma = 40,        // + MmaType
    kOpLdmatrix = 50,   // + num · 2 + trans
};

struct Warp {
    unsigned int lanes;    // threads in the warp (fewer than 32 in the last warp of a block that is not whole warps)
    unsigned int live;     // lanes not exited
    unsigned int arrived;  // lanes waiting in the collective being gathered
    int op;
    int width;
    const char* what;
    Site site;
    unsigned int first_lane;  // the first to arrive, for messages
    Fiber* waiting[32];
    LaneSlot slot[32];
};

// wgmma (ptx_hopper.cuh): a warpgroup collective (128 threads, warps 4g..4g+3). One issued wgmma.mma_async: its
// result for each thread, written to the thread's accumulators only when a wgmma.wait_group of that thread covers
// its group; the shared memory it read (for the check that nothing overwrote it before the wait).
struct WgmmaOp {
    unsigned int group;  // the issuing threads' committed-group count at issue: the group it will belong to
    int n;
    Site site;
    float* dst[128];
    bool pending[128];
    unsigned int left;  // threads that have not retired it
    bool checked;       // its operands were compared with shared memory at its first retirement
    std::vector<float> result;  // 128 × n/2, thread-major
    std::vector<std::pair<const unsigned char*, unsigned short>> reads;
    // The RS form: each thread's A registers (where the kernel keeps them, and their values at issue), which must
    // not change until the wait that covers the op (the instruction reads them asynchronously).
    bool rs;
    const unsigned int* a_src[128];
    unsigned int a_val[128][4];
};

struct WgmmaArrival {
    float* d;
    unsigned long long desc_a, desc_b;
    bool scale_d;
    unsigned int committed;
    unsigned int a[4];  // A's register fragment (wgmma_*_rs), copied at issue as the instruction reads it
    const unsigned int* a_src;  // where the kernel keeps it (null: A from shared memory)
};

struct WarpGroup {
    unsigned int arrived;
    int op;  // type, n and transposes, so that threads meeting in different variants are caught
    Site site;
    unsigned int first_thread;
    Fiber* waiting[128];
    WgmmaArrival in[128];
    std::vector<WgmmaOp> ops;  // issued and not retired by every thread, oldest first
};

// TMA and mbarriers (ptx_tma.cuh). A tensor copy waiting to land: checked at issue, performed (reading global memory
// then) when a thread polls the mbarrier it completes on.
struct TmaCopy {
    unsigned int dst;  // shared-window address of the box's start (a store's source)
    unsigned int thread, group;  // a store's issuing thread and bulk async-group
    unsigned char map[128];
    int coords[5];
    unsigned int bytes;
    Site site;
};

// A bulk reduce-add (cp.reduce.async.bulk .add.f32, ptx_tma.cuh) waiting to be performed: its shared source (a
// window address), global destination, size, and its thread's bulk async-group, as a TMA store's.
struct BulkReduce {
    unsigned int src;
    float* dst;
    unsigned int bytes;
    unsigned int thread, group;
    Site site;
};

// An mbarrier object, by its shared address: the PTX ISA's state (phase, pending arrivals, expected arrivals,
// tx-count), the copies that will complete bytes on it, and the threads sleeping in try_wait until it changes.
struct Mbar {
    const void* addr;
    unsigned int expected;
    unsigned int pending;
    long long tx;
    unsigned int phase;  // phases completed so far: the current phase's parity is phase & 1
    Site init_site;
    std::vector<TmaCopy> copies;
    std::vector<Fiber*> waiting;
};

struct Barrier {
    unsigned int arrived;
    int op;  // -1: __syncthreads; else a SyncOp
    int acc;
    int result;  // of the last completed __syncthreads_{count,and,or}
    Site site;
    unsigned int first_thread;
};

// A named barrier (bar.sync / bar.arrive with an id and a thread count, ptx.cuh): the phase being gathered. The GPU
// counts arrivals per warp (a warp adds its size); here each thread adds one, which is the same for converged warps
// (what bar's .aligned form requires). Exited threads do not count: the thread count is explicit.
constexpr unsigned int kNamedBarriers = 16;  // ids 1..15; 0 is __syncthreads'
struct NamedBar {
    unsigned int count;    // the current phase's thread count (set by its first arrival)
    unsigned int arrived;  // 0: no phase open
    Site first_site;       // where the phase's first arrival came from, for messages
    unsigned int first_thread;
    std::vector<Fiber*> waiting;  // threads in bar.sync
};

struct Block {
    const LongctxEmuLaunch* launch;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    unsigned int nthreads;
    unsigned int live;  // threads not exited
    unsigned int done;  // threads exited
    unsigned char* regions;
    unsigned char* static_smem;
    std::size_t static_bytes;
    unsigned char* dyn_smem;
    std::size_t dyn_bytes;
    Barrier bar;
    std::vector<Fiber*> bar_waiting;
    std::vector<Warp> warps;
    std::vector<WarpGroup> wgs;
    unsigned int dyn_window;  // the shared-window address of dynamic shared memory (smem_window_addr)
    std::vector<Mbar> mbars;  // initialised mbarriers, in order of initialisation
    std::vector<TmaCopy> stores;  // TMA stores issued and not yet performed (TmaCopy::thread, ::group)
    std::vector<BulkReduce> reductions;  // bulk reduce-adds issued and not yet performed
    NamedBar nbars[kNamedBarriers];
    std::vector<Fiber*> queue;  // runnable fibers, a ring
    std::size_t q_head = 0, q_len = 0;
    Context sched;
    bool failed = false;
    std::string error;

    Fiber* fiber(unsigned int i) const {
        return fiber_at(reinterpret_cast<std::uintptr_t>(regions) + std::size_t(i) * kFiberRegionBytes);
    }
    // Fibers made runnable so far: what tells a block that waits on try_wait pollers only whether anything happened
    // since it last woke them (the stall handling in run_block).
    unsigned long long progress = 0;
    unsigned long long stall_progress = ~0ull;
    void push(Fiber* f) {
        progress++;
        push_quiet(f);
    }
    // Runnable without counting as progress: a try_wait poller woken to answer false.
    void push_quiet(Fiber* f) {
        f->state = kRunnable;
        std::size_t i = q_head + q_len;
        if (i >= queue.size()) i -= queue.size();
        queue[i] = f;
        q_len++;
    }
    Fiber* pop() {
        if (q_len == 0) return nullptr;
        Fiber* f = queue[q_head];
        if (++q_head == queue.size()) q_head = 0;
        q_len--;
        return f;
    }
};

std::string vformat(const char* fmt, va_list ap) {
    char buf[1024];
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    return std::string(buf);
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = vformat(fmt, ap);
    va_end(ap);
    return s;
}

// Gives the OS thread to the next runnable fiber, or back to the scheduler when there is none (or the block failed).
// Returns when `f` is made runnable again and its turn comes.
void park(Fiber* f) {
    Block& b = *f->block;
    Fiber* next = b.failed ? nullptr : b.pop();
    switch_to(&f->ctx, next ? &next->ctx : &b.sched);
}

// Ends the block with an error from thread `f`; the launch reports the first.
[[noreturn]] __attribute__((format(printf, 2, 3))) void fail(Fiber* f, const char* fmt, ...) {
    Block& b = *f->block;
    if (!b.failed) {
        b.failed = true;
        va_list ap;
        va_start(ap, fmt);
        b.error = format("block (%u,%u,%u) thread (%u,%u,%u): ", b.block_idx.x, b.block_idx.y, b.block_idx.z,
                         f->thread_idx.x, f->thread_idx.y, f->thread_idx.z) +
                  vformat(fmt, ap);
        va_end(ap);
    }
    switch_to(&f->ctx, &b.sched);
    __builtin_unreachable();
}

bool same_site(Site a, Site b) { return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0); }

bool in_smem(const Block& b, const void* p, std::size_t bytes) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    auto within = [&](const unsigned char* base, std::size_t len) {
        return base != nullptr && c >= base && c + bytes <= base + len;
    };
    return within(b.static_smem, b.static_bytes) || within(b.dyn_smem, b.dyn_bytes);
}

// ---------------------------------------------------------------------------------------------------------------------
// Block barrier. Exited threads count as arrived (as on sm_70 and later); two threads waiting at different
// __syncthreads is a divergent barrier, reported at once (the GPU may hang or silently mismatch them).
int block_barrier(Fiber* f, Site site, int op, int pred) {
    Block& b = *f->block;
    Barrier& bar = b.bar;
    if (bar.arrived == 0) {
        bar.site = site;
        bar.op = op;
        bar.first_thread = f->linear;
        bar.acc = op == kSyncAnd ? 1 : 0;
    } else if (!same_site(bar.site, site) || bar.op != op) {
        fail(f,
             "__syncthreads at %s:%d while thread %u waits at the one at %s:%d: a divergent __syncthreads (every "
             "thread of the block that has not exited must reach the same barrier)",
             site.file, site.line, bar.first_thread, bar.site.file, bar.site.line);
    }
    const int p = pred != 0;
    if (op == kSyncCount) bar.acc += p;
    if (op == kSyncAnd) bar.acc &= p;
    if (op == kSyncOr) bar.acc |= p;
    bar.arrived++;
    if (bar.arrived < b.live) {
        f->state = kWaitBlock;
        f->wait_what = "__syncthreads";
        f->wait_site = site;
        b.bar_waiting.push_back(f);
        park(f);
        return bar.result;
    }
    bar.result = bar.acc;
    bar.arrived = 0;
    for (Fiber* w : b.bar_waiting) b.push(w);
    b.bar_waiting.clear();
    return bar.result;
}

// ---------------------------------------------------------------------------------------------------------------------
// Named barriers (bar.sync / bar.arrive a, b; ptx.cuh): barrier `id` completes a phase when `count` threads have
// arrived, by either instruction; bar.sync waits for that (a scheduling point), bar.arrive does not. Every arrival of
// a phase must give the same count (the PTX ISA leaves a mismatch undefined: reported here).
const char* const kBarSyncNames[kNamedBarriers] = {
    "bar.sync 0",  "bar.sync 1",  "bar.sync 2",  "bar.sync 3",  "bar.sync 4",  "bar.sync 5",
    "bar.sync 6",  "bar.sync 7",  "bar.sync 8",  "bar.sync 9",  "bar.sync 10", "bar.sync 11",
    "bar.sync 12", "bar.sync 13", "bar.sync 14", "bar.sync 15"};

void named_barrier_at(Fiber* f, Site site, unsigned int id, unsigned int count, bool wait) {
    Block& b = *f->block;
    const char* what = wait ? "bar.sync" : "bar.arrive";
    if (id == 0 || id >= kNamedBarriers)
        fail(f, "%s %u at %s:%d: the named barriers are 1..%u (0 is __syncthreads')", what, id, site.file, site.line,
             kNamedBarriers - 1);
    if (count == 0 || count % 32 != 0 || count > b.nthreads)
        fail(f, "%s %u, %u at %s:%d: the thread count must be a multiple of the warp size, from 32 to the block's %u "
                "threads",
             what, id, count, site.file, site.line, b.nthreads);
    NamedBar& n = b.nbars[id];
    if (n.arrived == 0) {
        n.count = count;
        n.first_site = site;
        n.first_thread = f->linear;
    } else if (n.count != count) {
        fail(f,
             "%s %u, %u at %s:%d while the barrier's phase, opened by thread %u at %s:%d, counts %u threads: every "
             "arrival of a phase must give the same count",
             what, id, count, site.file, site.line, n.first_thread, n.first_site.file, n.first_site.line, n.count);
    }
    if (++n.arrived == n.count) {
        n.arrived = 0;
        for (Fiber* w : n.waiting) b.push(w);
        n.waiting.clear();
        return;
    }
    if (!wait) return;
    f->state = kWaitNamed;
    f->wait_what = kBarSyncNames[id];
    f->wait_site = site;
    n.waiting.push_back(f);
    park(f);
}

// ---------------------------------------------------------------------------------------------------------------------
// Warp collectives. Only full masks with all 32 lanes present and alive are emulated; anything else is refused with
// an error rather than guessed at. `aligned` collectives (mma.sync.aligned, ldmatrix.sync.aligned) must be the same
// instruction in every lane; shfl.sync and friends may meet from different call sites, as on sm_70 and later.
using Compute = void (*)(Warp& w, Fiber* last);

void warp_collective(Fiber* f, Site site, int op, const char* what, unsigned int mask, int width, bool aligned,
                     Compute compute) {
    Block& b = *f->block;
    Warp& w = b.warps[f->warp];
    if (mask != 0xffffffffu)
        fail(f, "%s at %s:%d with mask 0x%08x: the emulator runs warp collectives with the full mask only", what,
             site.file, site.line, mask);
    if (w.lanes != 32)
        fail(f,
             "%s at %s:%d in warp %u, which has %u threads: the block's %u threads are not whole warps, so the full "
             "mask names lanes that do not exist",
             what, site.file, site.line, f->warp, w.lanes, b.nthreads);
    if (w.live != 32)
        fail(f, "%s at %s:%d: %u lanes of warp %u have exited, and a full-mask collective needs all 32", what,
             site.file, site.line, 32 - w.live, f->warp);
    if (w.arrived == 0) {
        w.op = op;
        w.width = width;
        w.what = what;
        w.site = site;
        w.first_lane = f->lane;
    } else if (w.op != op || w.width != width || (aligned && !same_site(w.site, site))) {
        fail(f, "%s at %s:%d while lane %u of its warp waits in %s at %s:%d: the warp's lanes diverged", what,
             site.file, site.line, w.first_lane, w.what, w.site.file, w.site.line);
    }
    if (++w.arrived < 32) {
        f->state = kWaitWarp;
        f->wait_what = what;
        f->wait_site = site;
        w.waiting[w.arrived - 1] = f;
        park(f);
        return;
    }
    compute(w, f);
    w.arrived = 0;
    for (int i = 0; i < 31; i++) b.push(w.waiting[i]);
}

Warp& warp_of(Fiber* f) { return f->block->warps[f->warp]; }

void compute_shfl(Warp& w, Fiber*) {
    for (int l = 0; l < 32; l++) std::memcpy(w.slot[l].out, w.slot[w.slot[l].arg].in, 8);
}

void compute_vote(Warp& w, Fiber*) {
    unsigned int ballot = 0;
    for (int l = 0; l < 32; l++) ballot |= (w.slot[l].in[0] ? 1u : 0u) << l;
    unsigned int r = ballot;
    if (w.op == kOpVote + kVoteAny) r = ballot != 0;
    if (w.op == kOpVote + kVoteAll) r = ballot == 0xffffffffu;
    for (int l = 0; l < 32; l++) std::memcpy(w.slot[l].out, &r, 4);
}

void compute_reduce(Warp& w, Fiber*) {
    const int op = w.op - kOpReduce;
    unsigned int acc;
    std::memcpy(&acc, w.slot[0].in, 4);
    for (int l = 1; l < 32; l++) {
        unsigned int v;
        std::memcpy(&v, w.slot[l].in, 4);
        const int si = static_cast<int>(v), sa = static_cast<int>(acc);
        switch (op) {
            case kReduceAddU: acc += v; break;
            case kReduceMinU: acc = v < acc ? v : acc; break;
            case kReduceMaxU: acc = v > acc ? v : acc; break;
            case kReduceMinI: acc = static_cast<unsigned int>(si < sa ? si : sa); break;
            case kReduceMaxI: acc = static_cast<unsigned int>(si > sa ? si : sa); break;
            case kReduceAnd: acc &= v; break;
            case kReduceOr: acc |= v; break;
            default: acc ^= v; break;
        }
    }
    for (int l = 0; l < 32; l++) std::memcpy(w.slot[l].out, &acc, 4);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D = A·B + C with A 16×16, B 16×8, C and D 16×8 in f32, each lane
// holding the fragments of the PTX ISA's layout (ptx.cuh). The products of 16-bit floats are exact; the emulator sums
// them and C in double and rounds once to f32, where the tensor core's order and rounding are unspecified (it is
// known to truncate its partial sums): results agree to about f32 precision, not bit for bit.
float half_bits_to_f32(int type, unsigned int h) {
    return type == kMmaBf16 ? bits_f32((h & 0xffffu) << 16) : f16_bits_to_f32(static_cast<unsigned short>(h));
}

void compute_mma(Warp& w, Fiber*) {
    const int type = w.op - kOpMma;
    float A[16][16], B[16][8], C[16][8];
    for (unsigned int l = 0; l < 32; l++) {
        const unsigned int gid = l >> 2, tig = l & 3;
        unsigned int a[4], b[2];
        float c[4];
        std::memcpy(a, w.slot[l].in, 16);
        std::memcpy(b, w.slot[l].in + 16, 8);
        std::memcpy(c, w.slot[l].in + 24, 16);
        for (unsigned int r = 0; r < 4; r++) {
            // a[r]: row gid (+8 for r odd), columns 2·tig, 2·tig+1 (+8 for r ≥ 2), the lower column in the low half.
            const unsigned int row = gid + 8 * (r & 1), col = 2 * tig + 8 * (r >> 1);
            A[row][col] = half_bits_to_f32(type, a[r]);
            A[row][col + 1] = half_bits_to_f32(type, a[r] >> 16);
        }
        for (unsigned int r = 0; r < 2; r++) {
            // b[r]: rows (k) 2·tig, 2·tig+1 (+8 for r = 1), column gid.
            const unsigned int k = 2 * tig + 8 * r;
            B[k][gid] = half_bits_to_f32(type, b[r]);
            B[k + 1][gid] = half_bits_to_f32(type, b[r] >> 16);
        }
        // c[i]: row gid (+8 for i ≥ 2), column 2·tig + (i & 1).
        C[gid][2 * tig] = c[0];
        C[gid][2 * tig + 1] = c[1];
        C[gid + 8][2 * tig] = c[2];
        C[gid + 8][2 * tig + 1] = c[3];
    }
    for (unsigned int l = 0; l < 32; l++) {
        const unsigned int gid = l >> 2, tig = l & 3;
        float d[4];
        for (unsigned int i = 0; i < 4; i++) {
            const unsigned int row = gid + 8 * (i >> 1), col = 2 * tig + (i & 1);
            double acc = 0.0;
            for (int k = 0; k < 16; k++) acc += static_cast<double>(A[row][k]) * static_cast<double>(B[k][col]);
            d[i] = static_cast<float>(acc + static_cast<double>(C[row][col]));
        }
        std::memcpy(w.slot[l].out, d, 16);
    }
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16: lanes 8j..8j+7 give the row addresses of matrix j (16 bytes
// each, 16-byte aligned, in shared memory); lane l gets in r[j] the elements (row l/4, columns 2·(l%4), +1) of matrix
// j, or with .trans those of its transpose: (rows 2·(l%4), +1, column l/4) of the matrix as stored.
void compute_ldmatrix(Warp& w, Fiber* last) {
    const int code = w.op - kOpLdmatrix;
    const int num = code >> 1;
    const bool trans = code & 1;
    const Block& b = *last->block;
    const unsigned char* rows[32];
    for (int i = 0; i < 8 * num; i++) {
        std::memcpy(&rows[i], w.slot[i].in, sizeof(void*));
        const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(rows[i]);
        if (a % 16 != 0)
            fail(last, "%s at %s:%d: lane %d's row address %p is not 16-byte aligned", w.what, w.site.file,
                 w.site.line, i, static_cast<const void*>(rows[i]));
        if (!in_smem(b, rows[i], 16))
            fail(last, "%s at %s:%d: lane %d's row address %p is not in the block's shared memory", w.what,
                 w.site.file, w.site.line, i, static_cast<const void*>(rows[i]));
    }
    for (int l = 0; l < 32; l++) {
        unsigned int r[4];
        for (int j = 0; j < num; j++) {
            if (!trans) {
                std::memcpy(&r[j], rows[8 * j + l / 4] + 4 * (l % 4), 4);
            } else {
                unsigned short lo, hi;
                std::memcpy(&lo, rows[8 * j + 2 * (l % 4)] + 2 * (l / 4), 2);
                std::memcpy(&hi, rows[8 * j + 2 * (l % 4) + 1] + 2 * (l / 4), 2);
                r[j] = static_cast<unsigned int>(lo) | (static_cast<unsigned int>(hi) << 16);
            }
        }
        std::memcpy(w.slot[l].out, r, 4 * num);
    }
}

const char* const kShflNames[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync"};
const char* const kVoteNames[] = {"__ballot_sync", "__any_sync", "__all_sync"};
const char* const kLdmatrixNames[] = {"", "", "ldmatrix.x1", "ldmatrix.x1.trans", "ldmatrix.x2", "ldmatrix.x2.trans",
                                      "", "", "ldmatrix.x4", "ldmatrix.x4.trans"};

// ---------------------------------------------------------------------------------------------------------------------
// cp.async: each thread's copies wait in its fiber header and land at the cp.async.wait_group that covers their group
// (or when the thread exits), reading global memory then. So a kernel that reads shared memory before waiting, or
// before the __syncthreads after the other threads' waits, sees the poison there, where a GPU would usually (not
// always) see the data.
void complete_cp_async(Fiber* f, unsigned int below_group, bool all) {
    unsigned int kept = 0;
    for (unsigned int i = 0; i < f->cp_count; i++) {
        CpAsync& c = f->cp[i];
        if (all || c.group < below_group) {
            if (c.valid)
                std::memcpy(c.dst, c.src, 16);
            else
                std::memset(c.dst, 0, 16);
        } else {
            f->cp[kept++] = c;
        }
    }
    f->cp_count = kept;
}

void perform_stores(Fiber* f, unsigned int below, bool all);

[[noreturn]] void thread_exit(Fiber* f) {
    Block& b = *f->block;
    complete_cp_async(f, 0, true);
    perform_stores(f, 0, true);
    if (f->warp / 4 < b.wgs.size()) {
        WarpGroup& g = b.wgs[f->warp / 4];
        if (g.arrived > 0)
            fail(f, "exited while %u threads of its warpgroup wait in wgmma.mma_async at %s:%d", g.arrived,
                 g.site.file, g.site.line);
        for (const WgmmaOp& op : g.ops)
            if (op.pending[f->linear % 128])
                fail(f,
                     "exited with the wgmma.mma_async issued at %s:%d still in flight (no wgmma.wait_group covered "
                     "its group)",
                     op.site.file, op.site.line);
    }
    f->state = kDone;
    b.done++;
    b.live--;
    Warp& w = b.warps[f->warp];
    w.live--;
    if (w.arrived > 0)
        fail(f, "exited while %u lanes of its warp wait in %s at %s:%d (a full-mask collective needs every lane)",
             w.arrived, w.what, w.site.file, w.site.line);
    if (b.bar.arrived > 0 && b.bar.arrived == b.live) {
        b.bar.result = b.bar.acc;
        b.bar.arrived = 0;
        for (Fiber* x : b.bar_waiting) b.push(x);
        b.bar_waiting.clear();
    }
    park(f);
    __builtin_unreachable();
}

// ---------------------------------------------------------------------------------------------------------------------
// The block: its fibers, run to completion or to the first error.

struct StaticSmem {
    unsigned char* data;
    std::size_t bytes;
};

// Forces this module's TLS block to exist on the calling thread (glibc allocates a dlopen'ed module's lazily).
thread_local unsigned char tls_anchor;

int find_tls(dl_phdr_info* info, std::size_t, void* out) {
    const auto self_addr = reinterpret_cast<std::uintptr_t>(&find_tls);
    bool mine = false;
    std::size_t tls_bytes = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type == PT_LOAD) {
            const std::uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
            if (self_addr >= lo && self_addr < lo + ph.p_memsz) mine = true;
        }
        if (ph.p_type == PT_TLS) tls_bytes = ph.p_memsz;
    }
    if (!mine) return 0;
    auto* s = static_cast<StaticSmem*>(out);
    s->data = static_cast<unsigned char*>(info->dlpi_tls_data);
    s->bytes = tls_bytes;
    return 1;
}

// The calling OS thread's instance of this module's `__shared__` variables: the module's PT_TLS segment.
StaticSmem static_smem() {
    *static_cast<volatile unsigned char*>(&tls_anchor) = 0;
    StaticSmem s{nullptr, 0};
    dl_iterate_phdr(&find_tls, &s);
    return s;
}

bool check_guard(const unsigned char* p, std::size_t n, std::size_t* bad) {
    for (std::size_t i = 0; i < n; i++) {
        if (p[i] != kGuardByte) {
            *bad = i;
            return false;
        }
    }
    return true;
}

unsigned int window_of(const Block& b, const void* p, bool* ok);

std::string deadlock_report(Block& b) {
    std::string s = "deadlock: no thread of the block can go on (a barrier or warp collective some threads never "
                    "reach, or an mbarrier phase that cannot complete); waiting:";
    struct Group {
        const char* what;
        Site site;
        unsigned int count, first;
    };
    std::vector<Group> groups;
    for (unsigned int i = 0; i < b.nthreads; i++) {
        Fiber* f = b.fiber(i);
        if (f->state == kDone) continue;
        bool found = false;
        for (Group& g : groups) {
            if (g.what == f->wait_what && same_site(g.site, f->wait_site)) {
                g.count++;
                found = true;
                break;
            }
        }
        if (!found) groups.push_back(Group{f->wait_what, f->wait_site, 1, i});
    }
    for (const Group& g : groups)
        s += format(" %u threads (the first: %u) at %s at %s:%d;", g.count, g.first, g.what, g.site.file, g.site.line);
    s += format(" %u threads exited", b.done);
    for (unsigned int id = 1; id < kNamedBarriers; id++) {
        const NamedBar& n = b.nbars[id];
        if (n.arrived == 0) continue;
        s += format("; named barrier %u has %u of its %u threads (the first: thread %u at %s:%d), %zu of them waiting "
                    "in bar.sync",
                    id, n.arrived, n.count, n.first_thread, n.first_site.file, n.first_site.line, n.waiting.size());
    }
    for (const Mbar& m : b.mbars) {
        if (m.waiting.empty()) continue;
        bool ok = false;
        s += format("; the mbarrier at shared 0x%x (initialised at %s:%d) is in its phase of parity %u with %u of "
                    "%u arrivals and %lld transaction bytes to come",
                    window_of(b, m.addr, &ok), m.init_site.file, m.init_site.line, m.phase & 1, m.pending, m.expected,
                    m.tx);
    }
    return s;
}

bool run_block(Block& b, unsigned long long linear) {
    const LongctxEmuLaunch& L = *b.launch;
    b.block_idx = uint3{static_cast<unsigned int>(linear % L.grid[0]),
                        static_cast<unsigned int>((linear / L.grid[0]) % L.grid[1]),
                        static_cast<unsigned int>(linear / (static_cast<unsigned long long>(L.grid[0]) * L.grid[1]))};
    b.live = b.nthreads;
    b.done = 0;
    b.failed = false;
    b.error.clear();
    b.bar = Barrier{0, -1, 0, 0, Site{"", 0}, 0};
    b.bar_waiting.clear();
    b.q_head = 0;
    b.q_len = 0;
    for (std::size_t i = 0; i < b.warps.size(); i++) {
        Warp& w = b.warps[i];
        w.lanes = std::min<unsigned int>(32, b.nthreads - static_cast<unsigned int>(i) * 32);
        w.live = w.lanes;
        w.arrived = 0;
    }
    for (WarpGroup& g : b.wgs) {
        g.arrived = 0;
        g.ops.clear();
    }
    b.mbars.clear();
    b.stores.clear();
    b.reductions.clear();
    for (NamedBar& n : b.nbars) {
        n.arrived = 0;
        n.waiting.clear();
    }
    if (b.static_smem) std::memset(b.static_smem, kSmemPoison, b.static_bytes);
    std::memset(b.dyn_smem - kDynGuardBytes, kGuardByte, kDynGuardBytes);
    std::memset(b.dyn_smem, kSmemPoison, b.dyn_bytes);
    std::memset(b.dyn_smem + b.dyn_bytes, kGuardByte, kDynGuardBytes);

    const unsigned int bx = L.block[0], by = L.block[1];
    for (unsigned int i = 0; i < b.nthreads; i++) {
        Fiber* f = b.fiber(i);
        f->thread_idx = uint3{i % bx, (i / bx) % by, i / (bx * by)};
        f->block = &b;
        f->linear = i;
        f->lane = i % 32;
        f->warp = i / 32;
        f->wait_what = "";
        f->wait_site = Site{"", 0};
        f->cp_committed = 0;
        f->cp_count = 0;
        f->wg_committed = 0;
        f->wg_fenced = false;
        f->mbar_poll = false;
        f->bulk_committed = 0;
        prepare(f);
        b.push(f);
    }
    b.stall_progress = ~0ull;
    for (Fiber* next = b.pop(); next;) {
        switch_to(&b.sched, &next->ctx);
        // Back here when no fiber is runnable: all exited, a failure, or every live thread waits. Threads in a single
        // mbarrier.try_wait (not the mbarrier_wait loop) then answer false, as the GPU's would once its time limit
        // passes; if that happens twice with nothing made runnable in between, the block is deadlocked (a poller
        // looping on try_wait with nothing else going on).
        next = nullptr;
        if (b.failed || b.done == b.nthreads || b.progress == b.stall_progress) break;
        b.stall_progress = b.progress;
        for (Mbar& m : b.mbars) {
            std::size_t kept = 0;
            for (Fiber* w : m.waiting) {
                if (w->mbar_poll) b.push_quiet(w);
                else m.waiting[kept++] = w;
            }
            m.waiting.resize(kept);
        }
        next = b.pop();
    }
    if (b.failed) return false;
    if (b.done < b.nthreads) {
        b.error = format("block (%u,%u,%u): ", b.block_idx.x, b.block_idx.y, b.block_idx.z) + deadlock_report(b);
        return false;
    }
    // Every thread exited with a named barrier's phase still open: arrivals no bar.sync ever matched. The GPU drops
    // them at exit, but they mean the protocol's counts do not balance (in a loop, the next phase would pair the
    // wrong arrivals), so they are reported.
    for (unsigned int id = 1; id < kNamedBarriers; id++) {
        const NamedBar& n = b.nbars[id];
        if (n.arrived == 0) continue;
        b.error = format("block (%u,%u,%u): every thread exited with named barrier %u's phase open: %u of its %u "
                         "threads arrived (the first: thread %u at %s:%d) and nothing completed it (arrivals that "
                         "no bar.sync matched; the counts do not balance)",
                         b.block_idx.x, b.block_idx.y, b.block_idx.z, id, n.arrived, n.count, n.first_thread,
                         n.first_site.file, n.first_site.line);
        return false;
    }
    std::size_t bad = 0;
    if (!check_guard(b.dyn_smem - kDynGuardBytes, kDynGuardBytes, &bad)) {
        b.error = format("block (%u,%u,%u) wrote %zu bytes before the start of its %zu bytes of dynamic shared memory",
                         b.block_idx.x, b.block_idx.y, b.block_idx.z, kDynGuardBytes - bad, b.dyn_bytes);
        return false;
    }
    if (!check_guard(b.dyn_smem + b.dyn_bytes, kDynGuardBytes, &bad)) {
        b.error = format("block (%u,%u,%u) wrote past the end of its %zu bytes of dynamic shared memory (at byte %zu)",
                         b.block_idx.x, b.block_idx.y, b.block_idx.z, b.dyn_bytes, b.dyn_bytes + bad);
        return false;
    }
    return true;
}

}  // namespace emu

using namespace emu;

extern "C" [[noreturn]] void longctx_emu_fiber_main(Fiber* f) {
    const LongctxEmuLaunch& L = *f->block->launch;
    L.kernel(L.args);
    thread_exit(f);
}

// ---------------------------------------------------------------------------------------------------------------------
// Device-side entry points (emu.h).
namespace emu {

const uint3& block_idx() { return self()->block->block_idx; }
const dim3& block_dim() { return self()->block->block_dim; }
const dim3& grid_dim() { return self()->block->grid_dim; }
unsigned char* dynamic_smem() { return self()->block->dyn_smem; }

void syncthreads(Site site) { block_barrier(self(), site, -1, 0); }
int syncthreads_reduce(Site site, int op, int pred) { return block_barrier(self(), site, op, pred); }

// Another block's progress, which runs on another worker (workers take blocks in the order of their linear index, as
// the GPU dispatches them): the OS thread is yielded between reads and no other fiber of this block runs meanwhile
// (none could set a flag meant for another block). A wait that outlasts 60 seconds, or that another block's failure
// has made hopeless, ends the launch with an error rather than a hang.
void flag_wait_eq(Site site, const unsigned int* flag, unsigned int v) {
    Fiber* f = self();
    timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned long long n = 0;; ++n) {
        unsigned int x = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
        if (x == v) return;
        if (__atomic_load_n(f->block->launch->abort, __ATOMIC_ACQUIRE))
            fail(f, "%s:%d: another block failed while this one waited for the flag at %p to hold %u", site.file,
                 site.line, static_cast<const void*>(flag), v);
        if ((n & 1023) == 1023) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if (t.tv_sec - t0.tv_sec > 60)
                fail(f,
                     "%s:%d: waited 60 s for the flag at %p to hold %u (it holds %u): no block of a lower index sets "
                     "it (a block may wait only for those)",
                     site.file, site.line, static_cast<const void*>(flag), v, x);
        }
        sched_yield();
    }
}

void named_barrier(Site site, unsigned int id, unsigned int count, bool wait) {
    named_barrier_at(self(), site, id, count, wait);
}

void syncwarp(Site site, unsigned int mask) {
    warp_collective(self(), site, kOpSyncwarp, "__syncwarp", mask, 32, false, [](Warp&, Fiber*) {});
}

unsigned long long shfl(Site site, int mode, unsigned int mask, unsigned long long bits, int arg, int width) {
    Fiber* f = self();
    const char* what = kShflNames[mode];
    if (width < 1 || width > 32 || (width & (width - 1)) != 0)
        fail(f, "%s at %s:%d with width %d: the width must be a power of two up to 32", what, site.file, site.line,
             width);
    LaneSlot& s = warp_of(f).slot[f->lane];
    std::memcpy(s.in, &bits, 8);
    const int lane = static_cast<int>(f->lane);
    const int base = lane & ~(width - 1);
    int src = lane;
    switch (mode) {
        case kShflIdx: src = base + (arg & (width - 1)); break;
        case kShflUp:
            src = static_cast<unsigned int>(arg) <= static_cast<unsigned int>(lane - base) ? lane - arg : lane;
            break;
        case kShflDown:
            src = static_cast<unsigned int>(arg) < static_cast<unsigned int>(base + width - lane) ? lane + arg : lane;
            break;
        default: {
            const unsigned int x = static_cast<unsigned int>(lane) ^ static_cast<unsigned int>(arg);
            src = x < static_cast<unsigned int>(base + width) ? static_cast<int>(x) : lane;
        }
    }
    s.arg = src;
    warp_collective(f, site, kOpShfl + mode, what, mask, width, false, compute_shfl);
    unsigned long long out;
    std::memcpy(&out, s.out, 8);
    return out;
}

unsigned int vote(Site site, int op, unsigned int mask, int pred) {
    Fiber* f = self();
    LaneSlot& s = warp_of(f).slot[f->lane];
    s.in[0] = pred != 0;
    warp_collective(f, site, kOpVote + op, kVoteNames[op], mask, 32, false, compute_vote);
    unsigned int out;
    std::memcpy(&out, s.out, 4);
    return out;
}

unsigned long long warp_reduce(Site site, int op, unsigned int mask, unsigned long long bits) {
    Fiber* f = self();
    LaneSlot& s = warp_of(f).slot[f->lane];
    const unsigned int v = static_cast<unsigned int>(bits);
    std::memcpy(s.in, &v, 4);
    warp_collective(f, site, kOpReduce + op, "__reduce_*_sync", mask, 32, false, compute_reduce);
    unsigned int out;
    std::memcpy(&out, s.out, 4);
    return out;
}

void mma_m16n8k16(Site site, int type, float* d, const unsigned int* a, const unsigned int* b, const float* c) {
    Fiber* f = self();
    LaneSlot& s = warp_of(f).slot[f->lane];
    std::memcpy(s.in, a, 16);
    std::memcpy(s.in + 16, b, 8);
    std::memcpy(s.in + 24, c, 16);
    warp_collective(f, site, kOpMma + type,
                    type == kMmaBf16 ? "mma.m16n8k16.f32.bf16" : "mma.m16n8k16.f32.f16", 0xffffffffu, 32, true,
                    compute_mma);
    std::memcpy(d, s.out, 16);
}

void ldmatrix(Site site, int num, bool trans, unsigned int* r, const void* smem) {
    Fiber* f = self();
    LaneSlot& s = warp_of(f).slot[f->lane];
    std::memcpy(s.in, &smem, sizeof(void*));
    const int code = num * 2 + (trans ? 1 : 0);
    warp_collective(f, site, kOpLdmatrix + code, kLdmatrixNames[code], 0xffffffffu, 32, true, compute_ldmatrix);
    std::memcpy(r, s.out, 4 * static_cast<std::size_t>(num));
}

void cp_async_16(Site site, void* smem, const void* gmem, bool valid) {
    Fiber* f = self();
    const Block& b = *f->block;
    if (reinterpret_cast<std::uintptr_t>(smem) % 16 != 0 || !in_smem(b, smem, 16))
        fail(f, "cp.async at %s:%d: the destination %p is not 16 bytes of the block's shared memory, 16-byte aligned",
             site.file, site.line, smem);
    if (valid && reinterpret_cast<std::uintptr_t>(gmem) % 16 != 0)
        fail(f, "cp.async at %s:%d: the source %p is not 16-byte aligned", site.file, site.line, gmem);
    if (f->cp_count == static_cast<unsigned int>(kMaxCpAsync))
        fail(f, "cp.async at %s:%d: more than %d copies in flight in one thread (the emulator's limit; wait sooner)",
             site.file, site.line, kMaxCpAsync);
    f->cp[f->cp_count++] = CpAsync{smem, gmem, f->cp_committed, valid};
}

void cp_async_commit() { self()->cp_committed++; }

void cp_async_wait(Site site, int pending) {
    Fiber* f = self();
    if (pending < 0) fail(f, "cp.async.wait_group %d at %s:%d: a negative count", pending, site.file, site.line);
    const unsigned int p = static_cast<unsigned int>(pending);
    complete_cp_async(f, f->cp_committed > p ? f->cp_committed - p : 0, false);
}

// ---------------------------------------------------------------------------------------------------------------------
// wgmma (ptx_hopper.cuh): the shared-state window, and wgmma.mma_async as a warpgroup collective whose results land
// at the wgmma.wait_group that covers them.

// The window address of a host pointer into the block's shared memory; 0 with `ok` false when it is not there.
unsigned int window_of(const Block& b, const void* p, bool* ok) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    *ok = true;
    if (b.static_smem && c >= b.static_smem && c < b.static_smem + b.static_bytes)
        return static_cast<unsigned int>(kSmemWindowStatic + static_cast<std::size_t>(c - b.static_smem));
    if (b.dyn_smem && c >= b.dyn_smem && c < b.dyn_smem + b.dyn_bytes)
        return b.dyn_window + static_cast<unsigned int>(c - b.dyn_smem);
    *ok = false;
    return 0;
}

// The host address of `bytes` bytes at window address `a`, or nullptr when they are not all shared memory.
const unsigned char* host_of(const Block& b, std::size_t a, std::size_t bytes) {
    if (b.static_smem && a >= kSmemWindowStatic && a + bytes <= kSmemWindowStatic + b.static_bytes)
        return b.static_smem + (a - kSmemWindowStatic);
    if (a >= b.dyn_window && a + bytes <= b.dyn_window + b.dyn_bytes) return b.dyn_smem + (a - b.dyn_window);
    return nullptr;
}

unsigned int smem_window_addr(Site site, const void* p) {
    Fiber* f = self();
    bool ok = false;
    const unsigned int a = window_of(*f->block, p, &ok);
    if (!ok)
        fail(f, "%s:%d: %p is not in the block's shared memory (a wgmma operand must be)", site.file, site.line, p);
    return a;
}

void wgmma_fence(Site) { self()->wg_fenced = true; }

void wgmma_commit_group(Site) { self()->wg_committed++; }

// Element (mn, k) of a 16-bit operand whose descriptor is `desc`: the PTX ISA's canonical layouts (ptx_hopper.cuh),
// no swizzle or 128B swizzle, base offset 0. Fails on anything else, or when the element is not shared memory.
const unsigned char* wgmma_element(Fiber* last, const WarpGroup& g, const char* which, unsigned long long desc,
                                   bool mn_major, unsigned int mn, unsigned int k) {
    const Block& b = *last->block;
    const std::size_t start = (desc & 0x3fffull) << 4;
    const std::size_t lbo = ((desc >> 16) & 0x3fffull) << 4;
    const std::size_t sbo = ((desc >> 32) & 0x3fffull) << 4;
    const unsigned int base = static_cast<unsigned int>((desc >> 49) & 7ull);
    const unsigned int mode = static_cast<unsigned int>(desc >> 62);
    if (mode == 2 || mode == 3)
        fail(last, "wgmma.mma_async at %s:%d: %s's descriptor asks for the %s swizzle, which the emulator does not "
                   "implement (only none and 128B)",
             g.site.file, g.site.line, which, mode == 2 ? "64B" : "32B");
    if (base != 0 && mode != 0)
        fail(last, "wgmma.mma_async at %s:%d: %s's descriptor has base offset %u, which the emulator does not "
                   "implement (start swizzled tiles on a 1024-byte boundary)",
             g.site.file, g.site.line, which, base);
    std::size_t off;
    if (mode == 0) {
        off = mn_major ? (mn % 8) * 2 + (mn / 8) * sbo + (k % 8) * 16 + (k / 8) * lbo
                       : (mn % 8) * 16 + (mn / 8) * sbo + (k % 8) * 2 + (k / 8) * lbo;
    } else {
        off = mn_major ? (mn % 64) * 2 + (mn / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo
                       : (mn % 8) * 128 + (mn / 8) * sbo + k * 2;
    }
    std::size_t a = start + off;
    if (mode == 1) a ^= ((a >> 7) & 7) << 4;
    const unsigned char* p = host_of(b, a, 2);
    if (!p)
        fail(last, "wgmma.mma_async at %s:%d: %s's element (%s %u, k %u) is at shared address 0x%zx, outside the "
                   "block's shared memory",
             g.site.file, g.site.line, which, which[0] == 'A' ? "m" : "n", mn, k, a);
    return p;
}

// `rs`: A comes from the threads' registers (g.in[t].a) rather than from shared memory through desc_a.
void compute_wgmma(WarpGroup& g, Fiber* last, int type, int n, bool ta, bool tb, bool rs) {
    const WgmmaArrival& first = g.in[0];
    for (unsigned int t = 1; t < 128; t++) {
        const WgmmaArrival& x = g.in[t];
        if ((!rs && x.desc_a != first.desc_a) || x.desc_b != first.desc_b || x.scale_d != first.scale_d)
            fail(last, "wgmma.mma_async at %s:%d: thread %u of the warpgroup passes other descriptors or scale-d "
                       "than its first thread (they must be the same in all 128)",
                 g.site.file, g.site.line, t);
        if (x.committed != first.committed)
            fail(last, "wgmma.mma_async at %s:%d: the warpgroup's threads have committed different numbers of "
                       "wgmma groups",
                 g.site.file, g.site.line);
    }
    WgmmaOp op;
    op.group = first.committed;
    op.n = n;
    op.site = g.site;
    op.left = 128;
    op.checked = false;
    op.rs = rs;
    for (unsigned int t = 0; t < 128; t++) {
        op.a_src[t] = g.in[t].a_src;
        std::memcpy(op.a_val[t], g.in[t].a, sizeof op.a_val[t]);
    }
    // The operands, read now (and compared with shared memory again when the op retires).
    float A[64][16];
    std::vector<float> B(static_cast<std::size_t>(n) * 16);
    op.reads.reserve((64 + static_cast<std::size_t>(n)) * 16);
    auto load = [&](const char* which, unsigned long long desc, bool mn_major, unsigned int mn, unsigned int k) {
        const unsigned char* p = wgmma_element(last, g, which, desc, mn_major, mn, k);
        unsigned short h;
        std::memcpy(&h, p, 2);
        op.reads.emplace_back(p, h);
        return half_bits_to_f32(type, h);
    };
    if (rs) {
        // A's register fragment (PTX ISA 9.7.15.5.1.1, .m64nNk16 with 16-bit A): warp w of the warpgroup holds rows
        // 16w..16w+15 as mma.m16n8k16's A: a[r] is row 16w + gid (+8 for r odd), columns 2·tig, 2·tig+1 (+8 for
        // r ≥ 2), the lower column in the low half.
        for (unsigned int t = 0; t < 128; t++) {
            const unsigned int w = t / 32, lane = t % 32, gid = lane >> 2, tig = lane & 3;
            for (unsigned int r = 0; r < 4; r++) {
                const unsigned int row = 16 * w + gid + 8 * (r & 1), col = 2 * tig + 8 * (r >> 1);
                A[row][col] = half_bits_to_f32(type, g.in[t].a[r]);
                A[row][col + 1] = half_bits_to_f32(type, g.in[t].a[r] >> 16);
            }
        }
    } else {
        for (unsigned int m = 0; m < 64; m++)
            for (unsigned int k = 0; k < 16; k++) A[m][k] = load("A", first.desc_a, ta, m, k);
    }
    for (unsigned int j = 0; j < static_cast<unsigned int>(n); j++)
        for (unsigned int k = 0; k < 16; k++) B[j * 16 + k] = load("B", first.desc_b, tb, j, k);
    const unsigned int regs = static_cast<unsigned int>(n) / 2;
    op.result.resize(128 * static_cast<std::size_t>(regs));
    for (unsigned int t = 0; t < 128; t++) {
        float* d = g.in[t].d;
        // The accumulator's input: the result of the latest op in flight into the same registers (a chain of
        // wgmma into one accumulator), else the registers themselves.
        const float* c = d;
        for (auto it = g.ops.rbegin(); it != g.ops.rend(); ++it) {
            if (it->pending[t] && it->dst[t] == d) {
                if (it->n != n)
                    fail(last, "wgmma.mma_async at %s:%d accumulates into the registers of the one at %s:%d, of "
                               "another N, still in flight",
                         g.site.file, g.site.line, it->site.file, it->site.line);
                c = &it->result[t * regs];
                break;
            }
        }
        const unsigned int w = t / 32, lane = t % 32, gid = lane >> 2, tig = lane & 3;
        for (unsigned int i = 0; i < regs; i++) {
            const unsigned int row = 16 * w + gid + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * tig + (i & 1);
            double acc = 0.0;
            for (unsigned int k = 0; k < 16; k++)
                acc += static_cast<double>(A[row][k]) * static_cast<double>(B[col * 16 + k]);
            if (first.scale_d) acc += static_cast<double>(c[i]);
            op.result[t * regs + i] = static_cast<float>(acc);
        }
    }
    // The registers are NaN until a wgmma.wait_group covers the op: a kernel reading them early sees it.
    for (unsigned int t = 0; t < 128; t++) {
        op.dst[t] = g.in[t].d;
        op.pending[t] = true;
        for (unsigned int i = 0; i < regs; i++) g.in[t].d[i] = bits_f32(0x7fc00000u);
    }
    g.ops.push_back(std::move(op));
}

// Both forms of wgmma.mma_async: A from shared memory (`a` null, desc_a) or from registers (`a`: the thread's four).
void wgmma_issue(Site site, int type, int n, int trans_a, int trans_b, float* d, const unsigned int* a,
                 unsigned long long desc_a, unsigned long long desc_b, bool scale_d) {
    Fiber* f = self();
    Block& b = *f->block;
    const unsigned int gi = f->warp / 4;
    if (gi >= b.wgs.size())
        fail(f, "wgmma.mma_async at %s:%d in warp %u: the block's %u threads have no whole warpgroup (128 threads, "
                "warps 4g..4g+3) there",
             site.file, site.line, f->warp, b.nthreads);
    for (unsigned int w = 4 * gi; w < 4 * gi + 4; w++)
        if (b.warps[w].live != 32)
            fail(f, "wgmma.mma_async at %s:%d: %u threads of warp %u of its warpgroup have exited (all 128 must "
                    "execute it)",
                 site.file, site.line, 32 - b.warps[w].live, w);
    if (!f->wg_fenced)
        fail(f, "wgmma.mma_async at %s:%d without a wgmma.fence since the thread's last wgmma.wait_group (the "
                "accumulators' registers must be fenced before wgmma uses them)",
             site.file, site.line);
    WarpGroup& g = b.wgs[gi];
    const bool rs = a != nullptr;
    const int op = (rs ? 10000 : 0) + type * 1000 + n * 4 + trans_a * 2 + trans_b;
    if (g.arrived == 0) {
        g.op = op;
        g.site = site;
        g.first_thread = f->linear;
    } else if (g.op != op || !same_site(g.site, site)) {
        fail(f, "wgmma.mma_async at %s:%d while thread %u of its warpgroup waits in the one at %s:%d: the "
                "warpgroup's threads diverged",
             site.file, site.line, g.first_thread, g.site.file, g.site.line);
    }
    const unsigned int t = f->linear % 128;
    g.in[t] = WgmmaArrival{d, desc_a, desc_b, scale_d, f->wg_committed, {0, 0, 0, 0}, a};
    if (rs) std::memcpy(g.in[t].a, a, sizeof g.in[t].a);
    if (++g.arrived < 128) {
        f->state = kWaitWarp;
        f->wait_what = "wgmma.mma_async";
        f->wait_site = site;
        g.waiting[g.arrived - 1] = f;
        park(f);
        return;
    }
    compute_wgmma(g, f, type, n, trans_a != 0, trans_b != 0, rs);
    g.arrived = 0;
    for (int i = 0; i < 127; i++) b.push(g.waiting[i]);
}

void wgmma_mma_async(Site site, int type, int n, int trans_a, int trans_b, float* d, unsigned long long desc_a,
                     unsigned long long desc_b, bool scale_d) {
    wgmma_issue(site, type, n, trans_a, trans_b, d, nullptr, desc_a, desc_b, scale_d);
}

void wgmma_mma_async_rs(Site site, int type, int n, int trans_b, float* d, const unsigned int* a,
                        unsigned long long desc_b, bool scale_d) {
    wgmma_issue(site, type, n, 0, trans_b, d, a, 0, desc_b, scale_d);
}

void wgmma_wait_group(Site site, int pending) {
    Fiber* f = self();
    Block& b = *f->block;
    f->wg_fenced = false;
    const unsigned int gi = f->warp / 4;
    if (gi >= b.wgs.size()) return;
    WarpGroup& g = b.wgs[gi];
    const unsigned int t = f->linear % 128;
    const unsigned int p = static_cast<unsigned int>(pending);
    const unsigned int below = f->wg_committed > p ? f->wg_committed - p : 0;
    for (std::size_t i = 0; i < g.ops.size(); i++) {
        WgmmaOp& op = g.ops[i];
        if (!op.pending[t] || op.group >= below) continue;
        if (!op.checked) {
            op.checked = true;
            for (const auto& r : op.reads) {
                unsigned short now;
                std::memcpy(&now, r.first, 2);
                if (now != r.second)
                    fail(f, "wgmma.wait_group at %s:%d: shared memory the wgmma.mma_async at %s:%d reads was "
                            "overwritten before a wgmma.wait_group covered it",
                         site.file, site.line, op.site.file, op.site.line);
            }
        }
        if (op.rs && std::memcmp(op.a_src[t], op.a_val[t], sizeof op.a_val[t]) != 0)
            fail(f, "wgmma.wait_group at %s:%d: the A registers of the wgmma.mma_async at %s:%d (A from registers) "
                    "were overwritten before a wgmma.wait_group covered it",
                 site.file, site.line, op.site.file, op.site.line);
        // The result lands unless a later op in flight accumulates into the same registers (they stay NaN).
        bool later = false;
        for (std::size_t j = i + 1; j < g.ops.size(); j++)
            if (g.ops[j].pending[t] && g.ops[j].dst[t] == op.dst[t]) later = true;
        if (!later) {
            const unsigned int regs = static_cast<unsigned int>(op.n) / 2;
            std::memcpy(op.dst[t], &op.result[t * regs], 4 * static_cast<std::size_t>(regs));
        }
        op.pending[t] = false;
        op.left--;
    }
    std::size_t kept = 0;
    for (std::size_t i = 0; i < g.ops.size(); i++) {
        if (g.ops[i].left == 0) continue;
        if (kept != i) g.ops[kept] = std::move(g.ops[i]);
        kept++;
    }
    g.ops.resize(kept);
}

// setmaxnreg.{inc,dec}.sync.aligned.u32 (ptx_hopper.cuh): the emulator has no register file, so it only checks
// what the PTX ISA requires: every thread of a whole warpgroup executes the same instruction (.sync.aligned).
void setmaxnreg(Site site, bool inc, unsigned int regs) {
    Fiber* f = self();
    Block& b = *f->block;
    const char* what = inc ? "setmaxnreg.inc" : "setmaxnreg.dec";
    if (regs < 24 || regs > 256 || regs % 8 != 0)
        fail(f, "%s at %s:%d with %u registers: the count must be a multiple of 8 in 24..256", what, site.file,
             site.line, regs);
    const unsigned int gi = f->warp / 4;
    if (gi >= b.wgs.size())
        fail(f, "%s at %s:%d in warp %u: the block's %u threads have no whole warpgroup (128 threads, warps "
                "4g..4g+3) there",
             what, site.file, site.line, f->warp, b.nthreads);
    for (unsigned int w = 4 * gi; w < 4 * gi + 4; w++)
        if (b.warps[w].live != 32)
            fail(f, "%s at %s:%d: %u threads of warp %u of its warpgroup have exited (all 128 must execute it)", what,
                 site.file, site.line, 32 - b.warps[w].live, w);
    WarpGroup& g = b.wgs[gi];
    const int op = 100000 + (inc ? 1000 : 0) + static_cast<int>(regs);
    if (g.arrived == 0) {
        g.op = op;
        g.site = site;
        g.first_thread = f->linear;
    } else if (g.op != op || !same_site(g.site, site)) {
        fail(f, "%s at %s:%d while thread %u of its warpgroup waits in another warpgroup instruction at %s:%d: the "
                "warpgroup's threads diverged",
             what, site.file, site.line, g.first_thread, g.site.file, g.site.line);
    }
    if (++g.arrived < 128) {
        f->state = kWaitWarp;
        f->wait_what = what;
        f->wait_site = site;
        g.waiting[g.arrived - 1] = f;
        park(f);
        return;
    }
    g.arrived = 0;
    for (int i = 0; i < 127; i++) b.push(g.waiting[i]);
}

// ---------------------------------------------------------------------------------------------------------------------
// mbarriers and TMA loads (ptx_tma.cuh states the PTX ISA's semantics these follow).

// The emulator's tensor map (tensor_map.rs writes it): little-endian fields at fixed offsets.
constexpr unsigned int kTmaMagic = 0x4d54434cu;  // "LCTM"
struct TmaMap {
    unsigned int rank, elem, swizzle;
    unsigned long long addr;
    unsigned long long dims[5], strides[5];
    unsigned int box[5];
};

bool decode_map(const unsigned char* m, TmaMap* out) {
    unsigned int magic;
    std::memcpy(&magic, m, 4);
    if (magic != kTmaMagic) return false;
    out->rank = m[4];
    out->elem = m[5];
    out->swizzle = m[6];
    std::memcpy(&out->addr, m + 8, 8);
    std::memcpy(out->dims, m + 16, 40);
    std::memcpy(out->strides, m + 56, 40);
    std::memcpy(out->box, m + 96, 20);
    return out->rank >= 1 && out->rank <= 5 && (out->elem == 2 || out->elem == 4) && out->swizzle <= 3;
}

constexpr long long kMaxTx = (1ll << 20) - 1;

Mbar* find_mbar(Block& b, const void* bar) {
    for (Mbar& m : b.mbars)
        if (m.addr == bar) return &m;
    return nullptr;
}

Mbar& mbar_of(Fiber* f, Site site, const void* bar, const char* what) {
    Mbar* m = find_mbar(*f->block, bar);
    if (!m)
        fail(f, "%s at %s:%d on %p, which is not an initialised mbarrier (mbarrier.init it first, then "
                "fence.mbarrier_init and a barrier)",
             what, site.file, site.line, bar);
    return *m;
}

// Completes the current phase when nothing is pending: the parity flips, the expected arrivals are due again, and the
// threads sleeping on the barrier wake to poll it.
void mbar_maybe_complete(Block& b, Mbar& m) {
    if (m.pending == 0 && m.tx == 0) {
        m.phase++;
        m.pending = m.expected;
    }
    for (Fiber* w : m.waiting) b.push(w);
    m.waiting.clear();
}

// Performs copy `c`: each element of the box read from global memory (zero out of bounds) and written at its
// swizzled shared address.
void land_copy(Fiber* f, const TmaCopy& c, bool store = false) {
    Block& b = *f->block;
    TmaMap t;
    decode_map(c.map, &t);  // checked at issue
    const unsigned int mask = t.swizzle == 3 ? 7u : (t.swizzle == 2 ? 3u : (t.swizzle == 1 ? 1u : 0u));
    unsigned int idx[5] = {0, 0, 0, 0, 0};
    std::size_t count = 1;
    for (unsigned int d = 0; d < t.rank; d++) count *= t.box[d];
    for (std::size_t e = 0; e < count; e++) {
        bool inside = true;
        unsigned long long src = t.addr;
        for (unsigned int d = 0; d < t.rank; d++) {
            const long long g = static_cast<long long>(c.coords[d]) + idx[d];
            if (g < 0 || static_cast<unsigned long long>(g) >= t.dims[d]) inside = false;
            else src += static_cast<unsigned long long>(g) * t.strides[d];
        }
        std::size_t a = c.dst + e * t.elem;
        a ^= ((a >> 7) & mask) << 4;
        unsigned char* p = const_cast<unsigned char*>(host_of(b, a, t.elem));
        if (!p)
            fail(f, "the TMA copy issued at %s:%d touches shared address 0x%zx, outside the block's shared memory",
                 c.site.file, c.site.line, a);
        void* g = reinterpret_cast<void*>(static_cast<std::uintptr_t>(src));
        if (store) {
            if (inside) std::memcpy(g, p, t.elem);  // out of bounds: not written
        } else if (inside) {
            std::memcpy(p, g, t.elem);
        } else {
            std::memset(p, 0, t.elem);
        }
        for (unsigned int d = 0; d < t.rank; d++) {
            if (++idx[d] < t.box[d]) break;
            idx[d] = 0;
        }
    }
}

void mbar_init(Site site, void* bar, unsigned int count) {
    Fiber* f = self();
    Block& b = *f->block;
    if (reinterpret_cast<std::uintptr_t>(bar) % 8 != 0 || !in_smem(b, bar, 8))
        fail(f, "mbarrier.init at %s:%d: %p is not 8 bytes of the block's shared memory, 8-byte aligned", site.file,
             site.line, bar);
    if (count < 1 || count > static_cast<unsigned int>(kMaxTx))
        fail(f, "mbarrier.init at %s:%d with count %u: the expected arrival count must be in 1..2^20-1", site.file,
             site.line, count);
    Mbar* m = find_mbar(b, bar);
    if (m && (!m->copies.empty() || !m->waiting.empty()))
        fail(f, "mbarrier.init at %s:%d re-initialises the mbarrier initialised at %s:%d while %s", site.file,
             site.line, m->init_site.file, m->init_site.line,
             m->copies.empty() ? "threads wait on it" : "TMA copies are to complete on it");
    if (!m) {
        b.mbars.push_back(Mbar{});
        m = &b.mbars.back();
    }
    m->addr = bar;
    m->expected = count;
    m->pending = count;
    m->tx = 0;
    m->phase = 0;
    m->init_site = site;
    // The object's bytes: what an mbarrier.init leaves is opaque; zero rather than the poison.
    std::memset(bar, 0, 8);
}

unsigned long long mbar_arrive(Site site, void* bar, unsigned int tx_bytes) {
    Fiber* f = self();
    Block& b = *f->block;
    const char* what = tx_bytes ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive";
    Mbar& m = mbar_of(f, site, bar, what);
    if (m.tx + tx_bytes > kMaxTx)
        fail(f, "%s at %s:%d: the tx-count would reach %lld bytes, above the PTX ISA's 2^20-1", what, site.file,
             site.line, m.tx + tx_bytes);
    const unsigned long long token = static_cast<unsigned long long>(m.phase & 1) << 63;
    if (m.pending == 0)
        fail(f, "%s at %s:%d: all %u expected arrivals of the mbarrier's current phase (initialised at %s:%d) have "
                "arrived already (it waits for %lld transaction bytes): more arrivals than its count",
             what, site.file, site.line, m.expected, m.init_site.file, m.init_site.line, m.tx);
    m.tx += tx_bytes;
    m.pending--;
    mbar_maybe_complete(b, m);
    return token;
}

bool mbar_try_wait(Site site, void* bar, unsigned int parity, bool wait) {
    Fiber* f = self();
    Block& b = *f->block;
    if (parity > 1)
        fail(f, "mbarrier.try_wait.parity at %s:%d with parity %u: 0 or 1", site.file, site.line, parity);
    for (int pass = 0;; pass++) {
        Mbar& m = mbar_of(f, site, bar, "mbarrier.try_wait.parity");
        // The copies completing on it land now (this poll is when the emulator lets them finish).
        if (!m.copies.empty()) {
            std::vector<TmaCopy> copies;
            copies.swap(m.copies);
            for (const TmaCopy& c : copies) land_copy(f, c);
            Mbar& again = mbar_of(f, site, bar, "mbarrier.try_wait.parity");
            for (const TmaCopy& c : copies) again.tx -= c.bytes;
            mbar_maybe_complete(b, again);
        }
        Mbar& now = mbar_of(f, site, bar, "mbarrier.try_wait.parity");
        if ((now.phase & 1) != parity) return true;
        // try_wait may suspend the thread for a while: here until the barrier changes (then it answers again, once),
        // or until the whole block waits (run_block: it answers false). mbarrier_wait sleeps until the phase
        // completes.
        if (pass > 0 && !wait) return false;
        f->state = kWaitMbar;
        f->mbar_poll = !wait;
        f->wait_what = wait ? (parity ? "mbarrier_wait parity 1" : "mbarrier_wait parity 0")
                            : (parity ? "mbarrier.try_wait.parity 1" : "mbarrier.try_wait.parity 0");
        f->wait_site = site;
        now.waiting.push_back(f);
        park(f);
    }
}

// A tensor copy of `rank` at `coords` between `smem` (what = "destination" or "source") and `map`'s tensor, checked.
TmaCopy tma_copy(Fiber* f, Site site, const void* smem, const char* what, const void* map, int rank,
                 const int* coords) {
    Block& b = *f->block;
    TmaCopy c;
    std::memcpy(c.map, map, 128);
    TmaMap t;
    if (!decode_map(c.map, &t))
        fail(f, "cp.async.bulk.tensor at %s:%d: the tensor map is not one the emulator's encoder wrote (encode it with "
                "tensor_map.rs for the device the kernel runs on)",
             site.file, site.line);
    if (t.rank != static_cast<unsigned int>(rank))
        fail(f, "cp.async.bulk.tensor.%dd at %s:%d with a tensor map of rank %u", rank, site.file, site.line, t.rank);
    bool ok = false;
    const unsigned int w = window_of(b, smem, &ok);
    if (!ok)
        fail(f, "cp.async.bulk.tensor at %s:%d: the %s %p is not in the block's shared memory", site.file, site.line,
             what, smem);
    const unsigned int align = t.swizzle == 3 ? 1024 : 128;
    if (w % align != 0)
        fail(f, "cp.async.bulk.tensor at %s:%d: the %s (shared address 0x%x) is not %u-byte aligned (%s)", site.file,
             site.line, what, w, align, t.swizzle == 3 ? "the 128B swizzle's pattern" : "the TMA's requirement");
    std::size_t bytes = t.elem;
    for (unsigned int d = 0; d < t.rank; d++) bytes *= t.box[d];
    if (!host_of(b, w, bytes))
        fail(f, "cp.async.bulk.tensor at %s:%d: the box's %zu bytes at shared address 0x%x run past the block's shared "
                "memory",
             site.file, site.line, bytes, w);
    c.dst = w;
    for (int d = 0; d < 5; d++) c.coords[d] = d < rank ? coords[d] : 0;
    c.bytes = static_cast<unsigned int>(bytes);
    c.site = site;
    c.thread = f->linear;
    c.group = f->bulk_committed;
    return c;
}

// Performs the TMA stores of thread `f` in groups below `below` (all when `all`), in issue order.
void perform_stores(Fiber* f, unsigned int below, bool all) {
    Block& b = *f->block;
    std::vector<TmaCopy> now;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < b.stores.size(); i++) {
        TmaCopy& c = b.stores[i];
        if (c.thread == f->linear && (all || c.group < below)) now.push_back(c);
        else b.stores[kept++] = c;
    }
    b.stores.resize(kept);
    for (const TmaCopy& c : now) land_copy(f, c, true);
    // The bulk reduce-adds: each float of the source added to its destination with an atomic addition (other blocks
    // may add to the same floats at once, as on the GPU, whose additions to one address are atomic too).
    std::vector<BulkReduce> due;
    kept = 0;
    for (std::size_t i = 0; i < b.reductions.size(); i++) {
        BulkReduce& r = b.reductions[i];
        if (r.thread == f->linear && (all || r.group < below)) due.push_back(r);
        else b.reductions[kept++] = r;
    }
    b.reductions.resize(kept);
    for (const BulkReduce& r : due) {
        const float* src = reinterpret_cast<const float*>(host_of(b, r.src, r.bytes));
        if (!src)
            fail(f, "the bulk reduce-add issued at %s:%d reads shared address 0x%x (%u bytes), outside the block's "
                    "shared memory", r.site.file, r.site.line, r.src, r.bytes);
        for (unsigned int i = 0; i < r.bytes / 4; i++) atomicAdd(r.dst + i, src[i]);
    }
}

void bulk_reduce_add_f32(Site site, float* dst, const void* src, unsigned int bytes) {
    Fiber* f = self();
    const unsigned int a = smem_window_addr(site, src);
    if (bytes == 0 || bytes % 16 != 0 || a % 16 != 0 || reinterpret_cast<std::uintptr_t>(dst) % 16 != 0)
        fail(f,
             "cp.reduce.async.bulk at %s:%d: %u bytes from shared address 0x%x to %p (the size must be a positive "
             "multiple of 16, both addresses 16-byte aligned)",
             site.file, site.line, bytes, a, static_cast<void*>(dst));
    if (!host_of(*f->block, a, bytes))
        fail(f, "cp.reduce.async.bulk at %s:%d reads %u bytes from shared address 0x%x, past the block's shared memory",
             site.file, site.line, bytes, a);
    f->block->reductions.push_back(BulkReduce{a, dst, bytes, f->linear, f->bulk_committed, site});
}

void tma_store(Site site, const void* src, const void* map, int rank, const int* coords) {
    Fiber* f = self();
    f->block->stores.push_back(tma_copy(f, site, src, "source", map, rank, coords));
}

void tma_store_commit() { self()->bulk_committed++; }

void tma_store_wait(int pending) {
    Fiber* f = self();
    const unsigned int p = static_cast<unsigned int>(pending);
    perform_stores(f, f->bulk_committed > p ? f->bulk_committed - p : 0, false);
}

void tma_load(Site site, void* dst, const void* map, void* bar, int rank, const int* coords) {
    Fiber* f = self();
    Block& b = *f->block;
    const TmaCopy c = tma_copy(f, site, dst, "destination", map, rank, coords);
    Mbar& m = mbar_of(f, site, bar, "cp.async.bulk.tensor");
    m.copies.push_back(c);
    // Threads sleeping on the barrier poll it again (which lands the copy).
    for (Fiber* x : m.waiting) b.push(x);
    m.waiting.clear();
}

float ex2_approx_ftz(float x) {
    if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
    float r = exp2f(x);
    if (std::fpclassify(r) == FP_SUBNORMAL) r = std::copysign(0.0f, r);
    return r;
}

[[noreturn]] void trap(Site site, const char* what) { fail(self(), "%s at %s:%d", what, site.file, site.line); }

[[noreturn]] void assert_fail(const char* expr, Site site, const char* func) {
    fail(self(), "assertion `%s` failed at %s:%d in %s", expr, site.file, site.line, func);
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------------------------------
// Host-side entry points (launch.rs).

extern "C" __attribute__((visibility("default"))) void longctx_emu_abi(LongctxEmuAbi* abi) {
    const StaticSmem s = static_smem();
    abi->version = kAbiVersion;
    abi->fiber_region_bytes = static_cast<unsigned int>(kFiberRegionBytes);
    abi->fiber_header_bytes = static_cast<unsigned int>(kFiberHeaderBytes);
    abi->dyn_guard_bytes = static_cast<unsigned int>(kDynGuardBytes);
    abi->static_smem_bytes = s.bytes;
}

// Runs blocks of the launch, taking their indices from the shared counter, until none are left or a worker failed.
// Returns 0, or 1 with a message in `err` (NUL-terminated, truncated to err_len).
extern "C" __attribute__((visibility("default"))) int longctx_emu_run(const LongctxEmuLaunch* launch,
                                                                      const LongctxEmuWorker* worker, char* err,
                                                                      std::size_t err_len) {
    Block b;
    b.launch = launch;
    b.block_dim = dim3(launch->block[0], launch->block[1], launch->block[2]);
    b.grid_dim = dim3(launch->grid[0], launch->grid[1], launch->grid[2]);
    b.nthreads = launch->block[0] * launch->block[1] * launch->block[2];
    if (worker->nregions < b.nthreads) {
        std::snprintf(err, err_len, "the worker has %llu fiber regions for a block of %u threads", worker->nregions,
                      b.nthreads);
        return 1;
    }
    b.regions = worker->regions;
    const StaticSmem s = static_smem();
    b.static_smem = s.data;
    b.static_bytes = s.bytes;
    const std::uintptr_t base = (reinterpret_cast<std::uintptr_t>(worker->dyn) + 31) & ~std::uintptr_t(31);
    // 16-byte aligned and not 32: what CUDA promises and no more.
    b.dyn_smem = reinterpret_cast<unsigned char*>(base) + kDynGuardBytes + 16;
    b.dyn_bytes = launch->shared_bytes;
    if (b.dyn_smem + b.dyn_bytes + kDynGuardBytes > worker->dyn + worker->dyn_capacity) {
        std::snprintf(err, err_len, "the worker's dynamic shared memory buffer (%llu bytes) is too small for %u bytes",
                      worker->dyn_capacity, launch->shared_bytes);
        return 1;
    }
    b.bar_waiting.reserve(b.nthreads);
    b.warps.resize((b.nthreads + 31) / 32);
    b.wgs.resize(b.nthreads / 128);
    b.dyn_window = static_cast<unsigned int>(((kSmemWindowStatic + b.static_bytes + 1023) & ~std::size_t(1023)) + 16);
    b.queue.resize(b.nthreads);
    for (;;) {
        if (__atomic_load_n(launch->abort, __ATOMIC_ACQUIRE)) return 0;
        const unsigned long long i = __atomic_fetch_add(launch->next_block, 1ull, __ATOMIC_RELAXED);
        if (i >= launch->nblocks) return 0;
        if (!run_block(b, i)) {
            __atomic_store_n(launch->abort, 1, __ATOMIC_RELEASE);
            std::snprintf(err, err_len, "%s", b.error.c_str());
            return 1;
        }
    }
}
